"""The Kubernetes backend of the scheduler: GPU nodes are hosts, workers are pods.

Hosts are the nodes with allocatable ``nvidia.com/gpu``. A host is *ready*
when its NodeReady condition is True and its store pod (the DaemonSet's, label
``tenplex.io/role=store``) is Running, not being deleted, and Ready: its
kubelet sets the pod's Ready condition False once the store's readiness probe
(``GET /healthz``, the chart's: every 5 s, 2 failures) goes unanswered, so a
daemon that hangs or stops answering while its process lives makes its host
lost as surely as a NotReady node does, and the jobs with workers there
recover from the other nodes' stores (the store pod's status change wakes
them). The store is reached at the store pod's ``hostIP`` and the port its
container publishes as ``store`` (the chart's hostPort). A host is
*schedulable* unless cordoned (``spec.unschedulable``). A node that
disappears from the API stays known as lost, so the jobs that had workers on
it fail over instead of waiting for it.

Worker pods are pinned to their planned node with ``nodeName`` (the
scheduler has already placed them; the kube-scheduler has nothing left to
decide), labelled with the job and role, and owned by the ElasticJob so that
deleting the job deletes its pods. With ``spec.gpusPerPod`` = 1 (the default)
each worker (one rank, one GPU) is a pod named after its worker id. With
``gpusPerPod`` = G > 1 a pod runs G ranks of one node (NCCL's intra-node paths
need them in one container, sharing its GPUs and ``/dev/shm``): the ranks a
node runs are taken G consecutive local ranks at a time; the pod is named after
its first worker id, requests G GPUs, lists its worker ids in the annotation
``tenplex.io/workers`` and its ranks in the label ``tenplex.io/ranks``, and
runs the job's command under ``tenplex worker launch`` (:mod:`tenplex.launcher`),
which starts one process per rank from the per-rank environment in
``TENPLEX_POD_RANKS``. Towards the scheduler nothing changes: ``stop`` and
``exited`` still speak of worker ids; a pod's outcome is that of all its ranks,
and stopping any of them stops the pod.

The rendezvous (``MASTER_ADDR``/``MASTER_PORT``): worker pods use the host
network, so rank 0 listens on its node's address, which the scheduler knows
before any pod runs (a pod IP is not known until the pod starts). The port is
taken from a range (default 29500-29999) and is unique among the live rank-0
pods of the node, which carry it in the annotation ``tenplex.io/master-port``.
The same host network serves gloo/NCCL between nodes.

**Standby pods** (a job with ``standby``): a pod's GPUs are bound when it is
created, so no process started elsewhere could use them, and a new pod costs
its start, an interpreter and the job's imports. The worker pods of such a
job outlive their generation instead: each runs ``tenplex worker standby
--port PORT`` (:mod:`tenplex.standby`) as its main process, which forks the
pod's first workers from its environment and then takes the next ones from
the scheduler over a TCP connection to its node's address and the port in
its ``tenplex.io/standby-port`` annotation (labelled ``tenplex.io/standby``;
:mod:`tenplex.k8s.standbys` holds the connections). At a launch, a live pod
of the job on the planned node with the same GPUs and no running worker is
given the new generation's workers (its labels and annotations are patched
to say which; the request carries their environment, nothing else); the
planned pods left without one are created as usual, and the job's idle pods
the new placement leaves unused are deleted, freeing their GPUs. A stop ends
the workers in their pods and keeps the pods; a pod whose standby does not
answer is deleted instead. What a standby pod holds between generations is
what its worker held: its GPUs (counted as the job's own when it is placed
again), the job's modules in host memory, one port. A node new to the job
starts its pods as without standby; from its next change on they are warm.

Pods and nodes are watched (:class:`~tenplex.k8s.informer.Informer`), so
``hosts()`` and ``exited()`` answer from a cache that the watches keep current,
and listeners hear of a failed or deleted worker pod, a node that turns
NotReady or unschedulable, as soon as the API server tells.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kubernetes import client

from tenplex.core.commands import ENV_LOCAL_WORLD_SIZE, ENV_POD_RANKS
from tenplex.core.protocol import (
    ENV_GENERATION,
    ENV_LOCAL_RANK,
    ENV_RANK,
    ENV_STORE_MEMORY_ROOT,
    ENV_STORE_ROOT,
    ENV_TOKEN,
    ENV_WORKER_ID,
)
from tenplex.core.tls import ENV_TLS_CA
from tenplex.errors import Conflict, InvalidConfig, StoreUnavailable
from tenplex.k8s import crd
from tenplex.k8s.informer import Informer
from tenplex.k8s.settings import KubernetesSettings
from tenplex.k8s.standbys import PodLink, StandbyLinks
from tenplex.scheduler.backend import TRANSIENT_API_STATUS, Backend, HostInfo, WorkerLaunch
from tenplex.scheduler.jobspec import ElasticJobSpec

log = logging.getLogger(__name__)

WORKER_CONTAINER = "worker"
TLS_CA_VOLUME = "tenplex-tls-ca"
TLS_CA_DIR = "/etc/tenplex/tls-ca"
STORE_PORT_NAME = "store"
STORE_VOLUME = "tenplex-store"
MEMORY_VOLUME = "tenplex-store-memory"
LAUNCH_CONCURRENCY = 8
"""Pod creations (deletions) a launch (stop) has in flight at once (the API client's connection pool holds 10
connections)."""
LABEL_GENERATION = "tenplex.io/generation"
LABEL_RANK = "tenplex.io/rank"
LABEL_RANKS = "tenplex.io/ranks"
"""On a multi-rank pod: its ranks, ``first-last`` (they are consecutive)."""
ANNOTATION_WORKERS = "tenplex.io/workers"
"""On a multi-rank pod: the worker ids it runs, comma-separated, in local-rank order."""
ANNOTATION_MASTER_PORT = "tenplex.io/master-port"
ANNOTATION_STANDBY_PORT = "tenplex.io/standby-port"
"""On a standby pod: the port its standby listens on, on its node's address (unique among the node's live pods)."""
LABEL_STANDBY = "tenplex.io/standby"
"""``"true"`` on a standby pod (a worker pod that outlives its generation, see the module docstring)."""
STANDBY_PORT_NAME = "standby"
ANNOTATION_TEMPLATE = "tenplex.io/template"
"""On a worker pod: a digest of what its spec put into it (image, command, environment, resources, tolerations):
a standby pod of another digest was made for an older spec and starts no workers of the current one."""
LAUNCHER_COMMAND = ("tenplex", "worker", "launch", "--")
"""What a multi-rank pod runs before the job's command (the image's ``tenplex`` entry point)."""
RANK_ENV = (ENV_RANK, ENV_LOCAL_RANK, ENV_WORKER_ID)
"""Per-rank variables: always in a multi-rank pod's TENPLEX_POD_RANKS, never in its shared environment."""
PORT_RESERVATION_SECONDS = 120.0
LAUNCH_DELETE_GRACE = 10.0
"""The grace period of a job's standby pods that a launch deletes (idle ones: they have nothing to save)."""
SYNC_TIMEOUT_S = 30.0
"""How long :meth:`KubernetesBackend.start` waits for the first lists of the pods and nodes."""
STOP_MARGIN_SECONDS = 15.0
"""How long past a deleted pod's grace period :meth:`KubernetesBackend.stop` waits for its kubelet to confirm."""


@dataclass(frozen=True)
class ClusterEvent:
    """Something a watch saw that job controllers should react to now rather than at their next poll."""

    kind: str
    """worker-exited, worker-deleted, node-lost, node-unschedulable, node-changed, store-lost (a node's store pod
    stopped being usable: deleted, no longer Running, or not Ready) or store-changed."""
    job: str | None = None
    node: str | None = None
    detail: str = ""


Listener = Callable[[ClusterEvent], None]


def is_ready(obj: Mapping[str, Any]) -> bool:
    """Whether a node's or a pod's Ready condition is True (a pod's: its kubelet's readiness probes pass)."""
    conds = (obj.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def node_gpus(node: Mapping[str, Any]) -> int:
    resource = crd.GPU_RESOURCE
    raw = ((node.get("status") or {}).get("allocatable") or {}).get(resource)
    try:
        return int(str(raw)) if raw is not None else 0
    except ValueError:
        log.warning("node %s: allocatable %s %r is not an integer", node["metadata"]["name"], resource, raw)
        return 0


def node_address(node: Mapping[str, Any]) -> str | None:
    addrs = (node.get("status") or {}).get("addresses") or []
    for kind in ("InternalIP", "ExternalIP"):
        for a in addrs:
            if a.get("type") == kind and a.get("address"):
                return str(a["address"])
    return None


def pod_gpus(pod: Mapping[str, Any]) -> int:
    """GPUs a pod asks for (its containers' limits, else requests, of ``nvidia.com/gpu``)."""
    resource, total = crd.GPU_RESOURCE, 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        value = (res.get("limits") or {}).get(resource) or (res.get("requests") or {}).get(resource) or 0
        try:
            total += int(str(value))
        except ValueError:
            log.warning("pod %s: %s %r is not an integer", pod["metadata"]["name"], resource, value)
    return total


def pod_exit_code(pod: Mapping[str, Any], container: str | None = None) -> int | None:
    """The terminated exit code of ``container`` (default: the first container reporting one)."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if container is not None and cs.get("name") != container:
            continue
        term = (cs.get("state") or {}).get("terminated")
        if term and term.get("exitCode") is not None:
            return int(term["exitCode"])
    return None


def pod_groups(workers: Sequence[WorkerLaunch], gpus_per_pod: int) -> list[tuple[WorkerLaunch, ...]]:
    """The workers each pod runs: per host, ``gpus_per_pod`` consecutive local ranks at a time.

    The scheduler places ranks on a host in multiples of the job's GPUs per pod
    (whole nodes, then the rest, all multiples of it); anything else cannot be
    cut into pods and is refused, naming the host and its ranks.
    """
    if gpus_per_pod < 1:
        raise InvalidConfig(f"gpusPerPod must be at least 1, got {gpus_per_pod}")
    if gpus_per_pod == 1:
        return [(w,) for w in workers]
    by_host: dict[str, list[WorkerLaunch]] = {}
    for w in workers:
        by_host.setdefault(w.host, []).append(w)
    groups: list[tuple[WorkerLaunch, ...]] = []
    for host, ranks in by_host.items():
        ranks.sort(key=lambda w: (w.local_rank, w.rank))
        if len(ranks) % gpus_per_pod:
            raise InvalidConfig(f"node {host} was given {len(ranks)} ranks {[w.rank for w in ranks]}, not a multiple "
                                f"of gpusPerPod={gpus_per_pod}: they cannot be cut into worker pods")
        local = [w.local_rank for w in ranks]
        if len(set(local)) != len(local):
            raise InvalidConfig(f"node {host}: ranks {[w.rank for w in ranks]} have repeated local ranks {local}")
        for start in range(0, len(ranks), gpus_per_pod):
            group = tuple(ranks[start:start + gpus_per_pod])
            numbers = [w.rank for w in group]
            if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
                raise InvalidConfig(f"node {host}: the ranks of one worker pod must be consecutive, got {numbers} "
                                    f"(gpusPerPod={gpus_per_pod})")
            groups.append(group)
    return sorted(groups, key=lambda g: g[0].rank)


def pod_workers(pod: Mapping[str, Any]) -> list[str]:
    """The worker ids a worker pod runs: those of its ``tenplex.io/workers`` annotation, else its name."""
    meta = pod.get("metadata") or {}
    listed = (meta.get("annotations") or {}).get(ANNOTATION_WORKERS)
    return [w for w in listed.split(",") if w] if listed else [meta["name"]]


def _in_flight(call: Callable[..., None], *args: Sequence[Any], name: str) -> None:
    """``call`` on each element of ``args`` (zipped), up to :data:`LAUNCH_CONCURRENCY` at once; the first error
    raised once all have run. One at a time, a 128-pod launch took 20 s of round trips to a loaded API server and
    the deletions of a generation's 128 pods 12 s (benchmarks/control_plane_k8s.py), all of it downtime."""
    n = len(args[0])
    if n <= 1:
        for a in zip(*args, strict=True):
            call(*a)
        return
    with ThreadPoolExecutor(max_workers=min(LAUNCH_CONCURRENCY, n), thread_name_prefix=name) as pool:
        list(pool.map(call, *args))


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def _phase(pod: Mapping[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


class KubernetesBackend(Backend):
    """Pods on GPU nodes, watched (see the module docstring)."""

    name = "kubernetes"

    def __init__(self, api_client: client.ApiClient, settings: KubernetesSettings,
                 elasticjob: Callable[[str], Mapping[str, Any]], *, master_ports: tuple[int, int] = (29500, 29999),
                 watch_timeout: int = 60, stop_margin: float = STOP_MARGIN_SECONDS, token: str | None = None,
                 job_credentials: bool = False) -> None:
        """``elasticjob(name)`` returns the ElasticJob object of a job (raises NotFound for none); ``stop_margin``:
        how long past a deleted pod's grace period :meth:`stop` waits for its kubelet's confirmation; ``token``:
        the scheduler's admin token. Workers hold it too (from the auth Secret) only without ``job_credentials``;
        with them (the scheduler signs each job's own credential) each pod's environment carries its job's
        credential as a plain value, which is also what its standby expects in the hello."""
        self._token = token
        self._job_credentials = job_credentials
        lo, hi = master_ports
        if not 0 < lo <= hi < 65536:
            raise InvalidConfig(f"master port range must be within 1..65535 and ordered, got {lo}-{hi}")
        self.core = client.CoreV1Api(api_client)
        self.settings = settings
        self._elasticjob = elasticjob
        self._ports = (lo, hi)
        self._stop_margin = stop_margin
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._reserved: dict[tuple[str, int], float] = {}
        self._lost_nodes: dict[str, HostInfo] = {}
        self._known_nodes: dict[str, HostInfo] = {}
        self._job_namespace: dict[str, str] = {}
        self._pod_of: dict[tuple[str, str], str] = {}
        """(job, worker id) -> the name of the pod running it, where that is not the worker id (multi-rank pods)."""
        self._assigned: dict[tuple[str, str], str] = {}
        """(job, worker id) -> the uid of the standby pod given that worker (its cached annotations may lag)."""
        self.standbys = StandbyLinks(token, on_exit=self._on_standby_exit)
        self._started = False
        selector = f"{crd.LABEL_ROLE} in ({crd.ROLE_WORKER},{crd.ROLE_STORE})"
        self.nodes = Informer("nodes", self.core.list_node, watch_timeout=watch_timeout)
        if settings.watch_namespaces:
            namespaces = sorted(set(settings.watch_namespaces) | {settings.namespace})
            self.pods = [Informer(f"pods-{ns}", functools.partial(self.core.list_namespaced_pod, ns),
                                  watch_timeout=watch_timeout, label_selector=selector) for ns in namespaces]
        else:
            self.pods = [Informer("pods", self.core.list_pod_for_all_namespaces, watch_timeout=watch_timeout,
                                  label_selector=selector)]
        self.nodes.add_handler(self._on_node)
        for inf in self.pods:
            inf.add_handler(self._on_pod)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> KubernetesBackend:
        """Start the watches and wait for their first lists (the cache must be complete before answering)."""
        if self._started:
            return self
        self._started = True
        for inf in (self.nodes, *self.pods):
            inf.start()
        for inf in (self.nodes, *self.pods):
            if not inf.wait_synced(SYNC_TIMEOUT_S):
                raise StoreUnavailable(f"the Kubernetes API did not answer the first list of {inf.name} "
                                       f"within {SYNC_TIMEOUT_S:.0f}s")
        return self

    def stop_watches(self) -> None:
        """Stop the watches (idempotent; :meth:`start` may start them again)."""
        for inf in (self.nodes, *self.pods):
            inf.stop()
        self._started = False

    def close(self) -> None:
        self.stop_watches()
        self.standbys.close()

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def _emit(self, event: ClusterEvent) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:
                log.exception("listener failed on %s", event)

    # -- watches -> events -----------------------------------------------------------------

    def _on_node(self, kind: str, node: dict[str, Any], old: dict[str, Any] | None) -> None:
        name = node["metadata"]["name"]
        if kind == "DELETED":
            self._emit(ClusterEvent("node-lost", node=name, detail=f"node {name} was deleted"))
            return
        was_ready = old is not None and is_ready(old)
        was_schedulable = old is None or not (old.get("spec") or {}).get("unschedulable")
        if was_ready and not is_ready(node):
            self._emit(ClusterEvent("node-lost", node=name, detail=f"node {name} is NotReady"))
        elif (node.get("spec") or {}).get("unschedulable") and was_schedulable:
            self._emit(ClusterEvent("node-unschedulable", node=name, detail=f"node {name} was cordoned"))
        else:
            self._emit(ClusterEvent("node-changed", node=name))

    def _on_pod(self, kind: str, pod: dict[str, Any], old: dict[str, Any] | None) -> None:
        labels = _labels(pod)
        name = pod["metadata"]["name"]
        node = (pod.get("spec") or {}).get("nodeName")
        if labels.get(crd.LABEL_ROLE) == crd.ROLE_STORE:
            if old is not None and _store_usable(old) and (kind == "DELETED" or not _store_usable(pod)):
                why = "was deleted" if kind == "DELETED" else (
                    "is not Ready (its daemon does not answer its readiness probe)"
                    if _phase(pod) == "Running" and not is_ready(pod) else f"is {_phase(pod)}")
                self._emit(ClusterEvent("store-lost", node=node, detail=f"store pod {name} of node {node} {why}"))
            else:
                ready = "Ready" if is_ready(pod) else "not Ready"
                self._emit(ClusterEvent("store-changed", node=node,
                                        detail=f"store pod {name}: {kind} {_phase(pod)}, {ready}"))
            return
        job = labels.get(crd.LABEL_JOB)
        if labels.get(LABEL_STANDBY) == "true":
            self._follow_standby(kind, pod)
        if kind == "DELETED":
            self._emit(ClusterEvent("worker-deleted", job=job, node=node, detail=f"worker pod {name} was deleted"))
        elif _phase(pod) in ("Failed", "Succeeded") and (old is None or _phase(old) != _phase(pod)):
            code = pod_exit_code(pod, WORKER_CONTAINER)
            self._emit(ClusterEvent("worker-exited", job=job, node=node,
                                    detail=f"worker pod {name} {_phase(pod)} (exit code {code})"))

    def _follow_standby(self, kind: str, pod: Mapping[str, Any]) -> None:
        """Connect to a standby pod once it runs; forget it once it is ending or gone."""
        meta = pod["metadata"]
        address = (pod.get("status") or {}).get("hostIP")
        port = (meta.get("annotations") or {}).get(ANNOTATION_STANDBY_PORT, "")
        if kind == "DELETED" or meta.get("deletionTimestamp") or _phase(pod) in ("Succeeded", "Failed"):
            self.standbys.forget(meta["uid"])
        elif _phase(pod) == "Running" and address and port.isdigit():
            self.standbys.watch(meta["uid"], f"{meta['namespace']}/{meta['name']}", _labels(pod).get(crd.LABEL_JOB, ""),
                                address, int(port), token=_pod_token(pod))

    def _on_standby_exit(self, link: PodLink, worker_id: str, code: int) -> None:
        self._emit(ClusterEvent("worker-exited", job=link.job,
                                detail=f"worker {worker_id} in standby pod {link.pod} exited with {code}"))

    # -- hosts --------------------------------------------------------------------------------

    def _pods(self) -> list[dict[str, Any]]:
        return [p for inf in self.pods for p in inf.items()]

    def _store_pods(self) -> dict[str, dict[str, Any]]:
        """Node -> its best store pod (a usable one, see :func:`_store_usable`, else any)."""
        best: dict[str, dict[str, Any]] = {}
        for pod in self._pods():
            if _labels(pod).get(crd.LABEL_ROLE) != crd.ROLE_STORE:
                continue
            node = (pod.get("spec") or {}).get("nodeName")
            if not node:
                continue
            if node not in best or (_store_usable(pod) and not _store_usable(best[node])):
                best[node] = pod
        return best

    def _store_port(self, pod: Mapping[str, Any]) -> int:
        for c in (pod.get("spec") or {}).get("containers") or []:
            for p in c.get("ports") or []:
                if p.get("name") == STORE_PORT_NAME:
                    return int(p.get("hostPort") or p.get("containerPort") or self.settings.store_port)
        return self.settings.store_port

    def held_gpus(self, pods: Iterable[Mapping[str, Any]] | None = None) -> dict[str, int]:
        """Node -> GPUs that ``pods`` (default: every watched pod) bound to it hold: those not terminated, a
        Terminating one included (its containers may still run; the device plugin frees its GPUs only once they
        have ended)."""
        held: dict[str, int] = {}
        for pod in self._pods() if pods is None else pods:
            node = (pod.get("spec") or {}).get("nodeName")
            gpus = pod_gpus(pod)
            if node and gpus and _phase(pod) not in ("Succeeded", "Failed"):
                held[node] = held.get(node, 0) + gpus
        return held

    def gpus_held_by(self, job: str, worker_ids: Sequence[str]) -> dict[str, int]:
        """Node -> GPUs held by the live pods of these workers (a multi-rank pod once) and by the job's standby
        pods (its own, whatever they run: the next placement reuses or deletes them)."""
        pods = {p["metadata"]["uid"]: p for wid in worker_ids if (p := self._worker_pod(job, wid)) is not None}
        pods.update((p["metadata"]["uid"], p) for p in self._standby_pods(job))
        return self.held_gpus(pods.values())

    def hosts(self) -> list[HostInfo]:
        """The GPU nodes; each one's ``gpus`` are those no pod holds (see :meth:`held_gpus`), so that a new
        placement never counts on the GPUs of a pod that is still running or still terminating."""
        stores = self._store_pods()
        held = self.held_gpus()
        out: list[HostInfo] = []
        present: set[str] = set()
        for node in sorted(self.nodes.items(), key=lambda n: n["metadata"]["name"]):
            name = node["metadata"]["name"]
            allocatable = node_gpus(node)
            if allocatable <= 0:
                continue
            gpus = max(0, allocatable - held.get(name, 0))
            present.add(name)
            address = node_address(node) or name
            store = stores.get(name)
            store_ip = ((store or {}).get("status") or {}).get("hostIP") or address
            port = self._store_port(store) if store is not None else self.settings.store_port
            info = HostInfo(
                name=name, gpus=gpus, store_url=f"{'https' if self.settings.tls_secret else 'http'}://{store_ip}:{port}",
                address=address,
                ready=is_ready(node) and store is not None and _store_usable(store),
                schedulable=not (node.get("spec") or {}).get("unschedulable"),
            )
            out.append(info)
        with self._lock:
            for info in out:
                self._known_nodes[info.name] = info
                self._lost_nodes.pop(info.name, None)
            for name, info in self._known_nodes.items():
                if name not in present:
                    self._lost_nodes[name] = replace(info, ready=False, schedulable=False)
            lost = [self._lost_nodes[n] for n in sorted(self._lost_nodes)]
        return out + lost

    # -- workers ------------------------------------------------------------------------------

    def _worker_pod(self, job: str, worker_id: str) -> dict[str, Any] | None:
        """The cached pod running a worker.

        A direct lookup once the job's namespace and the pod's name are known
        (the worker id, or what launch or an earlier scan recorded); else a scan
        of the cached pods (after a scheduler restart, the multi-rank pods'
        ``tenplex.io/workers`` annotations say which pod runs which worker).
        """
        with self._lock:
            namespace = self._job_namespace.get(job)
            name = self._pod_of.get((job, worker_id), worker_id)
            assigned = self._assigned.get((job, worker_id))
        if namespace is not None:
            informer = self._informer_for(namespace)
            pod = informer.get(namespace, name)
            if pod is not None and _is_worker_of(pod, job) and (
                    worker_id in pod_workers(pod) or pod["metadata"].get("uid") == assigned):
                return pod
            candidates = informer.items()
        else:
            candidates = self._pods()
        for pod in candidates:
            if _is_worker_of(pod, job) and worker_id in pod_workers(pod):
                with self._lock:
                    self._job_namespace[job] = pod["metadata"]["namespace"]
                    if pod["metadata"]["name"] != worker_id:
                        self._pod_of[(job, worker_id)] = pod["metadata"]["name"]
                return pod
        return None

    def _informer_for(self, namespace: str) -> Informer:
        if len(self.pods) == 1 and not self.settings.watch_namespaces:
            return self.pods[0]
        for inf in self.pods:
            if inf.name == f"pods-{namespace}":
                return inf
        raise InvalidConfig(f"namespace {namespace!r} is not watched by this scheduler "
                            f"(watch namespaces: {', '.join(self.settings.watch_namespaces)})")

    def pod_manifest(self, job_obj: Mapping[str, Any], command: Sequence[str],
                     workers: Sequence[WorkerLaunch], standby_port: int | None = None) -> dict[str, Any]:
        """The pod running ``workers`` (one group of :func:`pod_groups`; public so that tests and
        ``kubectl``-minded readers can see exactly what runs); with ``standby_port``, a standby pod whose
        standby listens there (see the module docstring)."""
        spec = crd.parse_spec(job_obj)
        meta = job_obj["metadata"]
        job = meta["name"]
        if len(workers) != spec.gpus_per_pod:
            raise InvalidConfig(f"job {job}: a worker pod runs gpusPerPod={spec.gpus_per_pod} ranks, got "
                                f"{len(workers)} ({[w.worker_id for w in workers]})")
        w = workers[0]
        shared, per_rank = self._pod_env(job, workers)
        env: list[dict[str, Any]] = []
        if self._token_from_secret(workers):
            env.append({"name": ENV_TOKEN, "valueFrom": {"secretKeyRef": {
                "name": self.settings.auth_secret, "key": self.settings.auth_secret_key}}})
        env += [{"name": key, "value": value} for key, value in shared.items()]
        if per_rank is not None:
            env.append({"name": ENV_POD_RANKS, "value": json.dumps(per_rank, separators=(",", ":"))})
        env += [e.model_dump(by_alias=True, exclude_none=True) for e in spec.env if e.value_from is not None]
        env += [
            {"name": crd.ENV_NODE_IP, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.hostIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}},
        ]
        gpus = str(len(workers))
        resources: dict[str, dict[str, Any]] = {
            "requests": {**(spec.resources.requests or {}), crd.GPU_RESOURCE: gpus},
            "limits": {**(spec.resources.limits or {}), crd.GPU_RESOURCE: gpus},
        }
        if standby_port is not None:  # the standby forks the pod's ranks itself (TENPLEX_POD_RANKS, as the launcher)
            argv = [command[0], "-m", "tenplex", "worker", "standby", "--port", str(standby_port), "--", *command]
        else:
            argv = list(command) if per_rank is None else [*LAUNCHER_COMMAND, *command]
        container: dict[str, Any] = {"name": WORKER_CONTAINER, "image": spec.image or self.settings.worker_image,
                                     "command": argv, "env": env, "resources": resources}
        if standby_port is not None:
            container["ports"] = [{"name": STANDBY_PORT_NAME, "containerPort": standby_port, "protocol": "TCP"}]
        if spec.image_pull_policy:
            container["imagePullPolicy"] = spec.image_pull_policy
        generation = str(w.env.get(ENV_GENERATION, "0"))
        annotations = {ANNOTATION_TEMPLATE: template_digest(spec, command)}
        labels = {**crd.job_labels(job), LABEL_GENERATION: generation, LABEL_RANK: str(w.rank)}
        if len(workers) > 1 or standby_port is not None:  # a standby pod keeps its name while its workers change
            annotations[ANNOTATION_WORKERS] = ",".join(x.worker_id for x in workers)
        if len(workers) > 1:
            labels[LABEL_RANKS] = f"{workers[0].rank}-{workers[-1].rank}"
        if standby_port is not None:
            labels[LABEL_STANDBY] = "true"
            annotations[ANNOTATION_STANDBY_PORT] = str(standby_port)
        master = next((x for x in workers if x.rank == 0), None)
        if master is not None and "MASTER_PORT" in master.env:
            annotations[ANNOTATION_MASTER_PORT] = str(master.env["MASTER_PORT"])
        pod_spec: dict[str, Any] = {
            "nodeName": w.host,
            "restartPolicy": "Never",
            "hostNetwork": True,
            "dnsPolicy": "ClusterFirstWithHostNet",
            "enableServiceLinks": False,
            # Workers do not talk to the API server: no token in their filesystem (least privilege).
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 30,
            "containers": [container],
        }
        if self.settings.store_host_path:
            # The node's store directory, shared with its daemon: the ranks snapshot into it directly.
            env.append({"name": ENV_STORE_ROOT, "value": self.settings.store_root})
            container["volumeMounts"] = [{"name": STORE_VOLUME, "mountPath": self.settings.store_root}]
            pod_spec["volumes"] = [{"name": STORE_VOLUME, "hostPath": {"path": self.settings.store_host_path, "type": "Directory"}}]
            if self.settings.store_memory_host_path:
                # The node's memory tier (tmpfs), shared with its daemon: the snapshots are written into it.
                env.append({"name": ENV_STORE_MEMORY_ROOT, "value": self.settings.store_memory_root})
                container["volumeMounts"].append({"name": MEMORY_VOLUME, "mountPath": self.settings.store_memory_root})
                pod_spec["volumes"].append({"name": MEMORY_VOLUME, "hostPath": {"path": self.settings.store_memory_host_path,
                                                                                "type": "Directory"}})
        if self.settings.tls_secret:
            # The CA the stores' and the scheduler's certificates are verified against (tenplex.core.tls).
            env.append({"name": ENV_TLS_CA, "value": f"{TLS_CA_DIR}/ca.crt"})
            container.setdefault("volumeMounts", []).append({"name": TLS_CA_VOLUME, "mountPath": TLS_CA_DIR,
                                                            "readOnly": True})
            pod_spec.setdefault("volumes", []).append({"name": TLS_CA_VOLUME, "secret": {
                "secretName": self.settings.tls_secret, "items": [{"key": "ca.crt", "path": "ca.crt"}]}})
        if spec.tolerations:
            pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
        if self.settings.worker_service_account:
            pod_spec["serviceAccountName"] = self.settings.worker_service_account
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": w.worker_id,
                "namespace": meta.get("namespace") or "default",
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": [crd.owner_reference(job_obj)],
            },
            "spec": pod_spec,
        }

    def _token_from_secret(self, workers: Sequence[WorkerLaunch]) -> bool:
        """Whether the pod reads ``TENPLEX_TOKEN`` from the auth Secret: when the workers hold the shared token. A
        job's own credential (signed, scoped to the job, expiring) is a plain value of the pod's environment."""
        return bool(workers[0].env.get(ENV_TOKEN) and self.settings.auth_secret and not self._job_credentials)

    def _pod_env(self, job: str, workers: Sequence[WorkerLaunch]) -> tuple[dict[str, str], list[dict[str, str]] | None]:
        """The plain values of a pod's environment (:func:`_split_env`, as the pod's ranks see it: ``LOCAL_RANK``
        and ``LOCAL_WORLD_SIZE`` address the pod's own GPUs), and each rank's own variables for several; the
        token is left out when the pod takes it from the scheduler's Secret."""
        shared, per_rank = _split_env(job, workers)
        if self._token_from_secret(workers):
            shared.pop(ENV_TOKEN, None)
        if ENV_LOCAL_RANK in shared:
            shared[ENV_LOCAL_RANK] = "0"  # one GPU per pod: the process's device is cuda:0 whatever its rank on the node
        if ENV_LOCAL_WORLD_SIZE in shared:
            shared[ENV_LOCAL_WORLD_SIZE] = str(len(workers))  # the ranks address the pod's GPUs, which they alone see
        return shared, per_rank

    def launch(self, job: str, command: Sequence[str], workers: Sequence[WorkerLaunch], log_dir: Path) -> dict[str, int | None]:
        """Create the workers' pods (one per ``gpusPerPod`` ranks of a node, see :func:`pod_groups`);
        an existing pod of the same generation is taken as already launched. For a job with ``standby``, the
        job's idle standby pods on the planned nodes are given their workers first (see the module docstring)."""
        if not command:
            raise InvalidConfig(f"job {job!r} has no worker command")
        job_obj = self._elasticjob(job)
        if (job_obj.get("metadata") or {}).get("deletionTimestamp"):
            raise InvalidConfig(f"job {job}: its ElasticJob is being deleted: no new worker pods")
        namespace = job_obj["metadata"].get("namespace") or "default"
        informer = self._informer_for(namespace)
        spec = crd.parse_spec(job_obj)
        groups = pod_groups(workers, spec.gpus_per_pod)
        reuse = self._standbys_for(job, groups, template_digest(spec, command)) if spec.standby else {}
        fresh = [g for i, g in enumerate(groups) if i not in reuse]
        for w in workers:  # the rendezvous port is not a standby's too (master_port reserved it, unless given)
            if w.rank == 0 and str(w.env.get("MASTER_PORT", "")).isdigit():
                self._reserve(w.host, int(w.env["MASTER_PORT"]))
        manifests = [self.pod_manifest(job_obj, command, group,  # all valid before any is made
                                       standby_port=self._free_port(group[0].host) if spec.standby else None)
                     for group in fresh]
        with self._lock:
            self._job_namespace[job] = namespace
        self._remove_finished(job, {str(w.env.get(ENV_GENERATION, "0")) for w in workers})
        # Standby pods not taken (also all of them when the job's spec no longer asks for standby, and those of
        # an older spec) go.
        kept = {p["metadata"]["uid"] for p in reuse.values()}
        unused = [p for p in self._standby_pods(job) if p["metadata"]["uid"] not in kept]
        if unused:
            # Their GPUs may be what the fresh pods on their node need: those are waited for; the others end
            # in the background (waiting for them would stand training still for nothing: ~1 s a pod).
            busy = {g[0].host for g in fresh}
            self._delete_pods(job, [p for p in unused if p["spec"]["nodeName"] not in busy], grace=LAUNCH_DELETE_GRACE)
            self._delete_and_wait(job, [p for p in unused if p["spec"]["nodeName"] in busy], grace=LAUNCH_DELETE_GRACE)
        if spec.standby:
            for i, pod in reuse.items():
                try:
                    self._give(job, pod, groups[i])
                except StoreUnavailable as exc:  # it stopped answering: a fresh pod instead
                    log.warning("job %s: %s; replacing pod %s", job, exc.detail, pod["metadata"]["name"])
                    # The shortest grace, as for workers that outlive their stop: what does not answer its scheduler
                    # would not act on a SIGTERM either, and the fresh pod on its node may need its GPUs now.
                    self._delete_and_wait(job, [pod], grace=1)
                    fresh.append(groups[i])
                    manifests.append(self.pod_manifest(job_obj, command, groups[i],
                                                       standby_port=self._free_port(groups[i][0].host)))
        with self._lock:  # a new pod is named after its first worker (also one _give had put on a standby pod)
            for group in fresh:
                self._pod_of.pop((job, group[0].worker_id), None)
                for x in group:
                    self._assigned.pop((job, x.worker_id), None)
                for x in group[1:]:
                    self._pod_of[(job, x.worker_id)] = group[0].worker_id
        def create(group: tuple[WorkerLaunch, ...], manifest: dict[str, Any]) -> None:
            w = group[0]
            try:
                resp = self.core.create_namespaced_pod(namespace, manifest, _preload_content=False)
                informer.add_created(json.loads(resp.data))
            except client.ApiException as exc:
                if exc.status in TRANSIENT_API_STATUS:
                    raise  # the API server is restarting or overloaded: the controller repeats the launch
                if exc.status != 409:
                    raise InvalidConfig(f"job {job}: the API server refused worker pod {namespace}/{w.worker_id}: "
                                        f"{exc.status} {_api_message(exc)}") from None
                existing = self._worker_pod(job, w.worker_id)
                want = manifest["metadata"]["labels"][LABEL_GENERATION]
                if existing is not None and (existing.get("metadata") or {}).get("deletionTimestamp"):
                    # An earlier pod of that name, still terminating: the new one can only be created once it is gone.
                    self._create_after(existing, manifest, informer)
                    return
                if existing is None or _labels(existing).get(LABEL_GENERATION) != want:
                    raise Conflict(f"job {job}: pod {namespace}/{w.worker_id} already exists and is not "
                                   f"generation {want}'s worker") from None
                log.info("job %s: pod %s already exists (launched before a scheduler restart)", job, w.worker_id)
            log.info("job %s: created pod %s/%s (ranks %s on node %s)", job, namespace, w.worker_id,
                     ", ".join(str(x.rank) for x in group), w.host)

        # Each creation is idempotent, so a failure (raised once the others have been tried) makes the controller
        # repeat the launch as before.
        _in_flight(create, fresh, manifests, name="tenplex-pod-create")
        return {w.worker_id: None for w in workers}

    def _standby_pods(self, job: str) -> list[dict[str, Any]]:
        """The job's live standby pods (not being deleted, not ended)."""
        return [p for p in self.job_pods(job) if _labels(p).get(LABEL_STANDBY) == "true"
                and not p["metadata"].get("deletionTimestamp") and _phase(p) not in ("Succeeded", "Failed")]

    def _standbys_for(self, job: str, groups: Sequence[tuple[WorkerLaunch, ...]],
                      template: str) -> dict[int, dict[str, Any]]:
        """Which group of workers each idle standby pod of the job takes: one on the group's node with as many
        GPUs as it has ranks, made from the job's current spec (``template``, see :func:`template_digest`), whose
        standby answers and runs nothing."""
        idle: dict[str, list[dict[str, Any]]] = {}
        for pod in self._standby_pods(job):
            if (pod["metadata"].get("annotations") or {}).get(ANNOTATION_TEMPLATE) != template:
                continue
            if _phase(pod) == "Running" and self.standbys.idle(pod["metadata"]["uid"]):
                idle.setdefault(pod["spec"]["nodeName"], []).append(pod)
        chosen: dict[int, dict[str, Any]] = {}
        for i, group in enumerate(groups):
            pool = idle.get(group[0].host, [])
            pod = next((p for p in pool if pod_gpus(p) == len(group)), None)
            if pod is not None:
                pool.remove(pod)
                chosen[i] = pod
        return chosen

    def _give(self, job: str, pod: Mapping[str, Any], group: Sequence[WorkerLaunch]) -> None:
        """Make a standby pod run ``group``: say so on the pod (labels, annotations), then ask its standby."""
        meta = pod["metadata"]
        master = next((x for x in group if x.rank == 0), None)
        body = {"metadata": {
            "labels": {LABEL_GENERATION: str(group[0].env.get(ENV_GENERATION, "0")), LABEL_RANK: str(group[0].rank),
                       LABEL_RANKS: f"{group[0].rank}-{group[-1].rank}" if len(group) > 1 else None},
            "annotations": {ANNOTATION_WORKERS: ",".join(x.worker_id for x in group),
                            ANNOTATION_MASTER_PORT: str(master.env["MASTER_PORT"])
                            if master is not None and "MASTER_PORT" in master.env else None},
        }}
        try:
            self.core.patch_namespaced_pod(meta["name"], meta["namespace"], body)
        except client.ApiException as exc:
            raise StoreUnavailable(f"the API server refused to relabel standby pod {meta['name']}: "
                                   f"{exc.status} {_api_message(exc)}") from None
        with self._lock:
            for x in group:
                self._pod_of[(job, x.worker_id)] = meta["name"]
                self._assigned[(job, x.worker_id)] = meta["uid"]
        shared, per_rank = self._pod_env(job, group)
        requests = [{"env": {**shared, **own}, "inherit": True} for own in (per_rank or [{}])]
        pids = self.standbys.get(meta["uid"]).launch(requests)
        log.info("job %s: standby pod %s runs %s (ranks %s on node %s) as pids %s", job, meta["name"],
                 ", ".join(pids), ", ".join(str(x.rank) for x in group), group[0].host, ", ".join(map(str, pids.values())))

    def _create_after(self, terminating: Mapping[str, Any], manifest: dict[str, Any], informer: Informer) -> None:
        """Create ``manifest`` once the pod of that name that is being deleted is gone (its grace period and a
        margin at most); a Conflict if it is not gone by then."""
        meta = terminating["metadata"]
        grace = float(meta.get("deletionGracePeriodSeconds") or 0)
        deadline = time.monotonic() + grace + self._stop_margin
        log.info("pod %s/%s is still terminating; waiting for it to go before creating its successor",
                 meta["namespace"], meta["name"])
        while self._live_pod(terminating) is not None:
            if time.monotonic() > deadline:
                raise Conflict(f"pod {meta['namespace']}/{meta['name']} is still terminating {grace + self._stop_margin:.0f}s "
                               "after its deletion: its successor of the same name cannot be created yet")
            time.sleep(0.05)
        try:
            resp = self.core.create_namespaced_pod(meta["namespace"], manifest, _preload_content=False)
        except client.ApiException as exc:
            if exc.status in TRANSIENT_API_STATUS:
                raise
            raise InvalidConfig(f"the API server refused worker pod {meta['namespace']}/{meta['name']}: "
                                f"{exc.status} {_api_message(exc)}") from None
        informer.add_created(json.loads(resp.data))

    def _remove_finished(self, job: str, generations: set[str]) -> None:
        """Delete the terminated worker pods of earlier generations (a planned stop leaves them Succeeded)."""
        finished = [p for p in self.job_pods(job) if _labels(p).get(LABEL_GENERATION) not in generations
                    and _phase(p) in ("Succeeded", "Failed")]
        if finished:
            log.info("job %s: removing finished pods %s", job, [p["metadata"]["name"] for p in finished])
            self._delete_pods(job, finished, grace=1)  # nothing runs in them: the grace is never waited for

    def stop(self, job: str, worker_ids: Sequence[str], *, grace: float = 10.0) -> None:
        """End these workers: in a standby pod, its standby stops them and the pod stays (see the module
        docstring); any other pod is deleted (the kubelet sends SIGTERM, then SIGKILL after ``grace``), and the
        call waits until they are gone.

        A pod is gone once its kubelet has confirmed that its containers ended; one its kubelet had already
        reported Succeeded or Failed has ended and is not waited for (its deletion completes meanwhile). The wait
        covers the pods on
        Ready nodes; a NotReady node's kubelet cannot confirm, so its pods stay Terminating (and keep their GPUs
        in :meth:`hosts`) without holding the caller up. A pod still there after the grace period and a margin
        is left Terminating with a warning: its GPUs stay counted as held until it is gone. A standby pod whose
        workers do not end by then, or whose standby cannot be reached, is deleted the same way.
        """
        found: dict[str, tuple[dict[str, Any], list[str]]] = {}  # a multi-rank pod once, with the workers named
        for wid in worker_ids:
            if (p := self._worker_pod(job, wid)) is not None:
                found.setdefault(p["metadata"]["uid"], (p, []))[1].append(wid)
        seconds = max(0, math.ceil(grace))
        deadline = time.monotonic() + seconds + self._stop_margin
        asked: list[tuple[dict[str, Any], dict[str, int]]] = []
        delete: list[dict[str, Any]] = []
        for uid, (pod, wids) in found.items():
            if _labels(pod).get(LABEL_STANDBY) != "true" or _phase(pod) != "Running" or not self.standbys.ready(uid):
                delete.append(pod)
                continue
            try:
                asked.append((pod, self.standbys.get(uid).request_stop(wids, seconds)))
            except StoreUnavailable as exc:
                log.warning("job %s: %s; deleting pod %s instead", job, exc.detail, pod["metadata"]["name"])
                delete.append(pod)
        self._delete_and_wait(job, delete, grace=grace)
        for pod, pids in asked:
            link = self.standbys.link(pod["metadata"]["uid"])
            left = link.wait_ended(pids, deadline) if link is not None else list(pids)
            if left:
                log.warning("job %s: workers %s in standby pod %s did not end %.0fs after their stop: deleting the pod",
                            job, left, pod["metadata"]["name"], seconds + self._stop_margin)
                self._delete_and_wait(job, [pod], grace=1)

    def _delete_pods(self, job: str, pods: Sequence[Mapping[str, Any]], *, grace: float) -> None:
        """Delete these pods (their kubelets send SIGTERM, then SIGKILL after ``grace``, at least 1 s); no wait.

        Never a grace of 0: the API server takes that as a forced deletion and removes the pod at once, while
        its containers still run and hold its GPUs; no one could then tell when a new pod may have them (a
        successor created at once is rejected by the node's kubelet for lack of GPUs, as the e2e test of a
        standby pod that stops answering found)."""
        seconds = max(1, math.ceil(grace))

        def delete(pod: Mapping[str, Any]) -> None:
            meta = pod["metadata"]
            try:
                self.core.delete_namespaced_pod(meta["name"], meta["namespace"], grace_period_seconds=seconds,
                                                propagation_policy="Background")
            except client.ApiException as exc:
                if exc.status != 404:
                    log.warning("job %s: deleting pod %s failed: %s %s", job, meta["name"], exc.status, _api_message(exc))

        _in_flight(delete, pods, name="tenplex-pod-delete")

    def _delete_and_wait(self, job: str, pods: Sequence[Mapping[str, Any]], *, grace: float) -> None:
        """Delete these pods and wait until they are gone, those that had ended aside (see :meth:`stop`)."""
        if not pods:
            return
        # A pod its kubelet had reported Succeeded or Failed before this call has no container left (its GPUs are
        # free, see held_gpus): it is deleted without holding the caller (a scale-down's launch waited 10 s for
        # the confirmations of 128 pods that had all ended).
        ended = {p["metadata"]["uid"] for p in pods
                 if (now := self._live_pod(p)) is not None and _phase(now) in ("Succeeded", "Failed")}
        self._delete_pods(job, pods, grace=grace)
        seconds = max(1, math.ceil(grace))
        deadline = time.monotonic() + seconds + self._stop_margin
        left: list[str] = []
        while time.monotonic() < deadline:
            # Node readiness, not the host's: the kubelet of a Ready node whose store hangs still confirms.
            ready = {n["metadata"]["name"] for n in self.nodes.items() if is_ready(n)}
            live = [p for p in pods if p["metadata"]["uid"] not in ended and self._live_pod(p) is not None]
            left = [p["metadata"]["name"] for p in live if (p.get("spec") or {}).get("nodeName") in ready]
            if not left:
                lost = [p["metadata"]["name"] for p in live]
                if lost:
                    log.warning("job %s: pods %s are on nodes that are not Ready: they stay Terminating (their GPUs "
                                "held) until their kubelets confirm", job, lost)
                return
            time.sleep(0.05)
        log.warning("job %s: pods %s still terminating %.0fs after deletion; their GPUs stay held until they are gone",
                    job, left, seconds + self._stop_margin)

    def _live_pod(self, pod: Mapping[str, Any]) -> dict[str, Any] | None:
        """The cached pod with the same namespace, name and uid as ``pod`` (None once it is gone)."""
        meta = pod["metadata"]
        now = self._informer_for(meta["namespace"]).get(meta["namespace"], meta["name"])
        return now if now is not None and now["metadata"].get("uid") == meta.get("uid") else None

    def exited(self, job: str, worker_ids: Sequence[str]) -> dict[str, int | None]:
        """Succeeded -> 0, Failed -> the worker container's exit code (None when it has none), gone -> None.

        A multi-rank pod's outcome is that of each of its workers."""
        out: dict[str, int | None] = {}
        for wid in worker_ids:
            pod = self._worker_pod(job, wid)
            if pod is None:
                out[wid] = None
                continue
            phase = _phase(pod)
            if _labels(pod).get(LABEL_STANDBY) == "true" and phase not in ("Succeeded", "Failed"):
                link = self.standbys.link(pod["metadata"]["uid"])
                code = link.exit_code(wid) if link is not None else None  # its pod lives on: its standby says
                if code is not None:
                    out[wid] = code
            elif phase == "Succeeded":
                out[wid] = 0
            elif phase == "Failed":
                out[wid] = pod_exit_code(pod, WORKER_CONTAINER)
        return out

    def master_port(self, host: HostInfo) -> int:
        """A rendezvous port on ``host`` not used by another live pod there (see the module docstring)."""
        return self._free_port(host.name)

    def _reserve(self, node: str, port: int) -> None:
        with self._lock:
            self._reserved[(node, port)] = time.monotonic()

    def _free_port(self, node: str) -> int:
        """A port of the range that no live pod on ``node`` announces (a rank 0's rendezvous, a standby's) and
        that was not reserved there in the last :data:`PORT_RESERVATION_SECONDS`: the pods use the host network."""
        lo, hi = self._ports
        used: set[int] = set()
        for pod in self._pods():
            ann = (pod.get("metadata") or {}).get("annotations") or {}
            if (pod.get("spec") or {}).get("nodeName") != node or _phase(pod) in ("Succeeded", "Failed"):
                continue
            for key in (ANNOTATION_MASTER_PORT, ANNOTATION_STANDBY_PORT):
                with contextlib.suppress(KeyError, ValueError):
                    used.add(int(ann[key]))
        now = time.monotonic()
        with self._lock:
            self._reserved = {k: t for k, t in self._reserved.items() if now - t < PORT_RESERVATION_SECONDS}
            used |= {port for (n, port) in self._reserved if n == node}
            for port in range(lo, hi + 1):
                if port not in used:
                    self._reserved[(node, port)] = now
                    return port
        raise InvalidConfig(f"no free port on node {node}: all of {lo}-{hi} are taken by live jobs' rendezvous "
                            "and standbys")

    # -- standbys -------------------------------------------------------------------------------

    supports_standby = True

    def keep_standby(self, job: str, command: Sequence[str], env: Mapping[str, str], log_dir: Path) -> int:
        """The job's standby pods are its worker pods, kept by :meth:`launch` and :meth:`stop`: nothing to start
        here; how many there are."""
        return len(self._standby_pods(job))

    def standby_ready(self, job: str) -> int:
        return sum(1 for p in self._standby_pods(job) if self.standbys.ready(p["metadata"]["uid"]))

    def forget_standbys(self, job: str) -> None:
        """Nothing now: the job's standby pods run its current workers; a launch takes only those made from the
        current spec (their ``tenplex.io/template`` annotation) and deletes the others."""

    def release(self, job: str) -> None:
        """Delete the job's standby pods (it ended or was suspended: no next generation to keep them for)."""
        self._delete_pods(job, self._standby_pods(job), grace=LAUNCH_DELETE_GRACE)

    def job_pods(self, job: str) -> list[dict[str, Any]]:
        """The job's worker pods as cached (for the operator's status and for tests)."""
        return [p for p in self._pods() if _is_worker_of(p, job)]


def template_digest(spec: ElasticJobSpec, command: Sequence[str]) -> str:
    """A digest of what a job's spec puts into each of its worker pods (image, command, environment, resources,
    tolerations): equal for pods of one spec, different after a change of any of them."""
    parts = {"image": spec.image, "command": list(command), "env": [e.model_dump(by_alias=True) for e in spec.env],
             "pod": spec.pod_settings()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _pod_token(pod: Mapping[str, Any]) -> str | None:
    """The plain ``TENPLEX_TOKEN`` of a pod's worker container (a job's credential), None when it has none."""
    for container in (pod.get("spec") or {}).get("containers") or ():
        if container.get("name") == WORKER_CONTAINER:
            for e in container.get("env") or ():
                if e.get("name") == ENV_TOKEN and "value" in e:
                    return str(e["value"])
    return None


def _split_env(job: str, workers: Sequence[WorkerLaunch]) -> tuple[dict[str, str], list[dict[str, str]] | None]:
    """A pod's environment: what all its workers share, and (for several) each one's own variables.

    One worker: all of its environment is shared, no per-rank list. Several:
    a variable goes into the per-rank list (``TENPLEX_POD_RANKS``) when it is
    one of :data:`RANK_ENV` or differs between them (or some lack it); each
    rank's ``LOCAL_RANK`` becomes its index in the pod, the GPU it uses among
    the pod's GPUs. The token is never put in the list: it must be shared.
    """
    if len(workers) == 1:
        return {k: str(v) for k, v in workers[0].env.items()}, None
    keys = dict.fromkeys(k for w in workers for k in w.env)
    differ = {k for k in keys if k in RANK_ENV or len({w.env.get(k) for w in workers}) > 1
              or any(k not in w.env for w in workers)}
    if ENV_TOKEN in differ:
        raise InvalidConfig(f"job {job}: the ranks of one pod must share {ENV_TOKEN}; workers "
                            f"{[w.worker_id for w in workers]} do not")
    shared = {k: str(workers[0].env[k]) for k in keys if k not in differ}
    per_rank = []
    for index, w in enumerate(workers):
        own = {k: str(w.env[k]) for k in keys if k in differ and k in w.env}
        own.update({ENV_RANK: str(w.rank), ENV_LOCAL_RANK: str(index), ENV_WORKER_ID: w.worker_id})
        per_rank.append(own)
    return shared, per_rank


def _is_worker_of(pod: Mapping[str, Any], job: str) -> bool:
    labels = _labels(pod)
    return labels.get(crd.LABEL_JOB) == job and labels.get(crd.LABEL_ROLE) == crd.ROLE_WORKER


def _store_usable(pod: Mapping[str, Any]) -> bool:
    """A store pod whose daemon serves: Running, not being deleted, and Ready (its /healthz probe answers)."""
    return _phase(pod) == "Running" and not (pod.get("metadata") or {}).get("deletionTimestamp") and is_ready(pod)


def _api_message(exc: client.ApiException) -> str:
    try:
        return str(json.loads(exc.body).get("message", exc.reason))
    except (TypeError, ValueError):
        return str(exc.reason)
