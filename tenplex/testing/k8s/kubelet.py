"""Test kubelets: the node side of a pod's life, against the test cluster's kube-apiserver (or any) over HTTPS.

Both kinds watch, through the official client, the pods whose
``spec.nodeName`` is their node (as a kubelet does), and do the kubelet's part
of the API contract:

* **Admission**: a pod asking for more ``nvidia.com/gpu`` than the node has
  free is rejected (phase Failed, reason ``OutOfnvidia.com/gpu``), and a pod's
  GPUs stay taken until its containers have ended, so the GPUs of a pod that is
  Terminating are still in use, as with the device plugin.
* **Graceful deletion**: a pod with a ``deletionTimestamp`` gets SIGTERM, then
  SIGKILL once its ``deletionGracePeriodSeconds`` have passed; only when its
  containers have ended does the kubelet report their exit and delete the pod
  with grace period 0 (uid precondition), which is when it disappears from the
  API. A node whose kubelet is stopped confirms nothing: its pods stay
  Terminating, as on a lost node.

:class:`LocalKubelet` runs each pod's first container ``command + args`` as
a local process, with the container's environment resolved as a kubelet does:
plain values, the downward API (``fieldRef`` to ``status.hostIP``,
``status.podIP``, ``metadata.name``, ``metadata.namespace``,
``spec.nodeName``, labels and annotations), ``secretKeyRef``/``configMapKeyRef``,
and ``$(VAR)`` references to earlier entries. It reports the pod Running, then
Succeeded or Failed with the exit code when the process ends. As a container
ends with its main process, whatever that process started and left behind (in
its process group) is killed when it exits: the ranks of a multi-GPU worker
pod do not outlive their killed launcher. The image is not pulled: the process
runs with this machine's Python, and a container without ``command`` runs the
local stand-in given for its image's ENTRYPOINT. A node is emulated by an
address such as 127.0.0.2, where the test also runs that node's store daemon.

Readiness probes run as a kubelet runs them: a container with a
``readinessProbe`` (``httpGet``, its port a number or the name of one of the
container's ports, or ``tcpSocket``) starts not Ready; it is probed at the
pod's IP (the node's address: the pods use the host network or hostPorts)
after ``initialDelaySeconds`` and then every ``periodSeconds``, each probe
given ``timeoutSeconds`` (an HTTP answer 200-399 is a success). After
``successThreshold`` consecutive successes the pod's Ready and
ContainersReady conditions (and the container's ``ready``) are reported
True, after ``failureThreshold`` consecutive failures False; the phase stays
Running. ``probe_period_scale`` scales the periods and initial delays (not the
timeouts) so that tests need not wait out production periods. Liveness and
startup probes are not run (a container is never restarted).

:class:`NodeAgent` is the same kubelet without a container runtime, for tests
that play the containers through the test cluster's hooks (``set_pod_running``,
``fail_pod``): it admits pods, optionally reports them Running, and confirms
their deletion once their (emulated) containers have stopped.

Fault injection: :meth:`~_Kubelet.freeze` makes the kubelet ignore a pod's
deletion (a hung container runtime: the pod stays Terminating past its grace
period, its GPUs held) until :meth:`~_Kubelet.thaw`; :meth:`~_Kubelet.stop`
is a node losing its kubelet.

The node: a kubelet registers its Node (as the node, which the Node authorizer
and NodeRestriction allow) when the test has not made it, renews the node's
Lease in ``kube-node-lease`` every ``heartbeat_seconds`` and posts its Ready
condition every fifth beat (``set_node_ready(False)`` makes it report NotReady;
a stopped kubelet posts nothing, and the node lifecycle controller marks the
node Unknown after its grace period). A pod with the service-account token
volume the API server adds gets, instead of the mount, a kubeconfig with a token
its kubelet requested for it (TokenRequest bound to the pod), named by
``$KUBECONFIG``. Secret and ConfigMap volumes are written as files under the
kubelet's directory, and the container's env values and arguments that name a
path under their ``mountPath`` are pointed there (processes share the host's
file system; there are no mount namespaces).

Watch expiry (410 Gone) and dropped watches are handled by listing again, the
pattern every controller needs.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import os
import re
import signal
import socket
import ssl
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, watch

from tenplex.k8s.apiclient import timeouts_of, watch_timeouts, with_timeouts
from tenplex.k8s.crd import GPU_RESOURCE

LOG = logging.getLogger(__name__)
STATUS_RETRY_SECONDS = 60.0
HEARTBEAT_SECONDS = 2.0
"""How often a test kubelet renews its node's Lease (every fifth beat it also posts the node's status)."""
NODE_GRAPH_WAIT_S = 20.0
"""How long a pod's Secret or ConfigMap read is retried while the Node authorizer does not yet relate it to this
node (see ``LocalKubelet._read``)."""

_VAR_RE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined variables are replaced, undefined ones kept, ``$$`` escapes."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR_RE.sub(sub, value)


def pod_gpus(pod: client.V1Pod) -> int:
    """GPUs a pod requests (sum over its containers)."""
    total = 0
    for c in pod.spec.containers or []:
        res = c.resources
        if res is None:
            continue
        value = (res.limits or {}).get(GPU_RESOURCE) or (res.requests or {}).get(GPU_RESOURCE) or 0
        total += int(value)
    return total


@dataclass
class _Pod:
    """A pod this kubelet admitted: its containers run until ``ended`` is set."""

    uid: str
    namespace: str
    name: str
    gpus: int
    container: str
    image: str
    grace_seconds: float = 30.0
    deleting: bool = False
    started: bool = False
    ended: threading.Event = field(default_factory=threading.Event)
    exit_code: int | None = None
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    ready: bool = True
    """What was last reported of its readiness (a container with a readiness probe starts not Ready)."""
    started_at: str = field(default_factory=lambda: _now())
    ready_since: str = field(default_factory=lambda: _now())
    report_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while reporting its status, so that a readiness report never lands after the report of its end."""


@dataclass(frozen=True)
class ReadinessProbe:
    """A container's readinessProbe, resolved against its pod (see the module docstring)."""

    scheme: str
    """HTTP, HTTPS or TCP (a tcpSocket probe: the connection is the answer)."""
    host: str
    port: int
    path: str = "/"
    headers: tuple[tuple[str, str], ...] = ()
    timeout: float = 1.0
    period: float = 10.0
    initial_delay: float = 0.0
    success_threshold: int = 1
    failure_threshold: int = 3

    @classmethod
    def of(cls, container: client.V1Container, host_ip: str) -> ReadinessProbe | None:
        """The container's readiness probe (None without one); ValueError for a kind this kubelet cannot run."""
        probe = container.readiness_probe
        if probe is None:
            return None
        common = {
            "timeout": float(probe.timeout_seconds or 1), "period": float(probe.period_seconds or 10),
            "initial_delay": float(probe.initial_delay_seconds or 0),
            "success_threshold": int(probe.success_threshold or 1),
            "failure_threshold": int(probe.failure_threshold or 3),
        }
        if probe.http_get is not None:
            get = probe.http_get
            return cls(scheme=(get.scheme or "HTTP").upper(), host=get.host or host_ip,
                       port=_container_port(container, get.port), path=get.path or "/",
                       headers=tuple((h.name, h.value) for h in get.http_headers or []), **common)  # type: ignore[arg-type]
        if probe.tcp_socket is not None:
            sock = probe.tcp_socket
            return cls(scheme="TCP", host=sock.host or host_ip, port=_container_port(container, sock.port),
                       **common)  # type: ignore[arg-type]
        kind = "exec" if probe._exec is not None else "grpc" if probe.grpc is not None else "empty"
        raise ValueError(f"container {container.name}: its readiness probe is {kind}; the test kubelet runs only "
                         "httpGet and tcpSocket probes")

    def check(self) -> bool:
        """One probe: True when it succeeded."""
        try:
            if self.scheme == "TCP":
                with socket.create_connection((self.host, self.port), timeout=self.timeout):
                    return True
            if self.scheme == "HTTPS":  # the kubelet does not verify the certificate
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    self.host, self.port, timeout=self.timeout, context=ssl._create_unverified_context())
            else:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                conn.request("GET", self.path, headers={"User-Agent": "kube-probe/1.30", "Accept": "*/*",
                                                        **dict(self.headers)})
                response = conn.getresponse()
                response.read()
                return 200 <= response.status < 400
            finally:
                conn.close()
        except (OSError, http.client.HTTPException):
            return False


def _container_port(container: client.V1Container, port: int | str | None) -> int:
    """A probe's port: a number, or the name of one of the container's ports (its containerPort)."""
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.ports or []:
        if p.name == port:
            return int(p.container_port)
    raise ValueError(f"container {container.name}: the probe's port {port!r} is not one of its named ports "
                     f"({[p.name for p in container.ports or []]})")


def terminated(container: str, image: str, code: int) -> dict[str, Any]:
    """The status a kubelet reports once a pod's (single) container ended with ``code``."""
    phase = "Succeeded" if code == 0 else "Failed"
    reason = "Completed" if code == 0 else "Error"
    return {
        "phase": phase, "reason": reason,
        "conditions": [{"type": t, "status": "False" if t in ("Ready", "ContainersReady") else "True",
                        "lastTransitionTime": _now()} for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
        "containerStatuses": [{"name": container, "image": image, "imageID": "", "ready": False, "restartCount": 0,
                               "started": False,
                               "state": {"terminated": {"exitCode": code, "reason": reason, "finishedAt": _now()}}}],
    }


class _Kubelet(ABC):
    """What every test kubelet does with the API: watch its node's pods, admit, report, confirm deletions."""

    def __init__(self, api_client: client.ApiClient, node: str, host_ip: str, *, gpus: int | None = None,
                 heartbeat_seconds: float = HEARTBEAT_SECONDS) -> None:
        if timeouts_of(api_client) is None:  # as a real kubelet's: no call hangs on a dead connection
            with_timeouts(api_client)
        self._core = client.CoreV1Api(api_client)
        self._coordination = client.CoordinationV1Api(api_client)
        self.node = node
        self.host_ip = host_ip
        self.gpus = gpus
        """GPUs to register the Node with when it does not exist yet (None: the test made the Node)."""
        self.heartbeat_seconds = heartbeat_seconds
        self.node_ready: bool | None = True
        """The Ready condition this kubelet posts (False: the node reports itself NotReady)."""
        self._heartbeat_thread: threading.Thread | None = None
        self._pods: dict[str, _Pod] = {}
        self._done: set[str] = set()
        """Uids this kubelet is finished with (rejected, or deletion confirmed)."""
        self._frozen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread: threading.Thread | None = None
        self.rejected: list[str] = []
        """``ns/name: reason`` of every pod refused at admission."""

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> _Kubelet:
        self._stop.clear()
        self._register()
        self._heartbeat_thread = threading.Thread(target=self._heartbeats, name=f"kubelet-{self.node}-heartbeat",
                                                  daemon=True)
        self._heartbeat_thread.start()
        self._thread = threading.Thread(target=self._loop, name=f"kubelet-{self.node}", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    # -- the node -----------------------------------------------------------------------

    def _register(self) -> None:
        """Create this kubelet's Node (as the node itself: the Node authorizer and NodeRestriction allow a node
        its own object) when the test has not, with ``gpus`` allocatable ``nvidia.com/gpu``."""
        try:
            self._core.read_node(self.node)
            return
        except client.ApiException as exc:
            if exc.status != 404 or self.gpus is None:
                raise
        self._core.create_node({"metadata": {"name": self.node, "labels": {"kubernetes.io/hostname": self.node}}})
        capacity = {GPU_RESOURCE: str(self.gpus), "cpu": "64", "memory": "512Gi", "pods": "110"}
        self._core.patch_node_status(self.node, {"status": {
            "capacity": capacity, "allocatable": dict(capacity),
            "addresses": [{"type": "InternalIP", "address": self.host_ip}, {"type": "Hostname", "address": self.node}],
            "conditions": [self._ready_condition()]}})

    def _ready_condition(self) -> dict[str, Any]:
        ready = self.node_ready
        status = {True: "True", False: "False", None: "Unknown"}[ready]
        return {"type": "Ready", "status": status, "lastHeartbeatTime": _now(), "lastTransitionTime": _now(),
                "reason": "KubeletReady" if ready else "KubeletNotReady",
                "message": "kubelet is posting ready status" if ready else "the test kubelet reports NotReady"}

    def set_node_ready(self, ready: bool | None) -> None:
        """Post the node's Ready condition now, and keep posting it (False: the node reports itself NotReady)."""
        self.node_ready = ready
        self._post_node_status(transition=True)

    def _post_node_status(self, transition: bool = False) -> None:
        node = self._core.read_node(self.node)
        conditions = [c.to_dict() for c in (node.status.conditions or [])] if node.status else []
        current = next((c for c in conditions if c["type"] == "Ready"), None)
        fresh = self._ready_condition()
        if current is not None and current.get("status") == fresh["status"] and not transition:
            fresh["lastTransitionTime"] = current.get("last_transition_time") or fresh["lastTransitionTime"]
        others = [{"type": c["type"], "status": c["status"], "reason": c.get("reason"), "message": c.get("message")}
                  for c in conditions if c["type"] != "Ready"]
        self._core.patch_node_status(self.node, {"status": {"conditions": [*others, fresh]}})

    def _renew_lease(self) -> None:
        """The node's heartbeat Lease in ``kube-node-lease`` (what the node lifecycle controller watches)."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        spec = {"holderIdentity": self.node, "leaseDurationSeconds": 40, "renewTime": now}
        try:
            self._coordination.patch_namespaced_lease(self.node, "kube-node-lease", {"spec": spec})
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            self._coordination.create_namespaced_lease("kube-node-lease", {
                "metadata": {"name": self.node, "namespace": "kube-node-lease"}, "spec": spec})

    def _heartbeats(self) -> None:
        beat = 0
        while not self._stop.is_set():
            try:
                self._renew_lease()
                if beat % 5 == 0:  # status every fifth beat, as a kubelet posts it less often than its lease
                    self._post_node_status()
                beat += 1
            except Exception as exc:  # the API server may be restarting; the next beat tries again
                if not self._stop.is_set():
                    LOG.info("kubelet %s: heartbeat failed: %s", self.node, exc)
            self._stop.wait(self.heartbeat_seconds)

    def stop(self) -> None:
        """The kubelet goes away: nothing on this node is reported or confirmed any more."""
        self._stop.set()
        deadline = time.monotonic() + 10
        while self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            if self._watch is not None:  # again and again: a watch may have been opened since the last stop
                self._watch.stop()
            self._thread.join(timeout=0.1)
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=10)

    # -- fault injection ---------------------------------------------------------------

    def freeze(self, name: str, namespace: str = "default") -> None:
        """Hang this pod's container runtime until :meth:`thaw`: its deletion is not acted on (no signal), and
        whatever happens to it is neither reported nor confirmed, so a deleted pod stays Terminating past its
        grace period with its GPUs held."""
        with self._lock:
            self._frozen.add((namespace, name))

    def thaw(self, name: str, namespace: str = "default") -> None:
        """Act on the pod's deletion again (as a kubelet whose runtime recovered does at its next sync)."""
        with self._lock:
            self._frozen.discard((namespace, name))
            pod = next((p for p in self._pods.values() if (p.namespace, p.name) == (namespace, name)), None)
        if pod is None:
            return
        if pod.exit_code is not None and not pod.ended.is_set():  # it ended while frozen: report it now
            self._ended(pod, pod.exit_code)
        elif pod.deleting:
            self._begin_termination(pod)

    def used_gpus(self) -> int:
        """GPUs held by the pods whose containers have not ended (Terminating ones included)."""
        with self._lock:
            return sum(p.gpus for p in self._pods.values() if not p.ended.is_set())

    # -- the watch loop ---------------------------------------------------------------

    def _loop(self) -> None:
        selector = f"spec.nodeName={self.node}"
        while not self._stop.is_set():
            try:
                listed = self._core.list_pod_for_all_namespaces(field_selector=selector)
                for pod in listed.items:
                    self._sync(pod, deleted=False)
                self._watch = watch.Watch()
                for event in self._watch.stream(self._core.list_pod_for_all_namespaces, field_selector=selector,
                                                resource_version=listed.metadata.resource_version, timeout_seconds=30,
                                                _request_timeout=watch_timeouts(30)):
                    if self._stop.is_set():
                        break
                    self._sync(event["object"], deleted=event["type"] == "DELETED")
            except client.ApiException as exc:
                if exc.status != 410:
                    LOG.warning("kubelet %s: API error %s, listing again: %s", self.node, exc.status, exc.reason)
                    self._stop.wait(0.5)
            except Exception as exc:  # the API server may be gone at shutdown; keep trying until stopped
                if not self._stop.is_set():
                    LOG.warning("kubelet %s: watch failed (%s), listing again", self.node, exc)
                    self._stop.wait(0.5)

    def _sync(self, pod: client.V1Pod, deleted: bool) -> None:
        if self._stop.is_set():
            return
        uid = pod.metadata.uid
        with self._lock:
            known = self._pods.get(uid)
            done = uid in self._done
        if deleted:  # gone from the API (force-deleted, or our own confirmation): stop what still runs
            if known is not None and not known.ended.is_set():
                known.deleting = True
                known.grace_seconds = 0
                self._begin_termination(known)
            return
        if pod.metadata.deletion_timestamp is not None:
            if known is None:
                if not done:
                    self._confirm_deletion(uid, pod.metadata.namespace, pod.metadata.name)
                return
            if not known.deleting:
                known.deleting = True
                grace = pod.metadata.deletion_grace_period_seconds
                known.grace_seconds = float(grace if grace is not None else known.grace_seconds)
                if known.ended.is_set():  # it had ended already: only the confirmation is left
                    self._confirm_deletion(uid, known.namespace, known.name)
                else:
                    self._begin_termination(known)
            return
        if known is not None and pod.status is not None and pod.status.phase == "Running":
            known.started = True  # (a NodeAgent's containers are reported running by the test's hooks)
        if known is None and not done and pod.status is not None and pod.status.phase == "Pending":
            self._admit(pod)

    # -- admission -----------------------------------------------------------------

    def _capacity(self) -> int:
        node = self._core.read_node(self.node)
        return int((node.status.allocatable or {}).get(GPU_RESOURCE, 0)) if node.status else 0

    def _admit(self, pod: client.V1Pod) -> None:
        meta, spec = pod.metadata, pod.spec
        wanted = pod_gpus(pod)
        if wanted:
            capacity = self._capacity()
            used = self.used_gpus()
            if used + wanted > capacity:
                reason = f"OutOf{GPU_RESOURCE}"
                message = (f"Pod was rejected: Node didn't have enough resource: {GPU_RESOURCE}, requested: {wanted}, "
                           f"used: {used}, capacity: {capacity}")
                LOG.warning("kubelet %s: %s/%s rejected: %s", self.node, meta.namespace, meta.name, message)
                with self._lock:
                    self._done.add(meta.uid)
                    self.rejected.append(f"{meta.namespace}/{meta.name}: {message}")
                self._report(meta.namespace, meta.name, {"phase": "Failed", "reason": reason, "message": message})
                return
        container = spec.containers[0]
        grace = float(spec.termination_grace_period_seconds if spec.termination_grace_period_seconds is not None else 30)
        entry = _Pod(meta.uid, meta.namespace, meta.name, wanted, container.name, container.image or "", grace)
        with self._lock:
            self._pods[meta.uid] = entry
        self._start(pod, entry)

    @abstractmethod
    def _start(self, pod: client.V1Pod, entry: _Pod) -> None:
        """Start the pod's container (the entry is recorded); report it running or failed."""

    @abstractmethod
    def _begin_termination(self, entry: _Pod) -> None:
        """The pod is being deleted: end its container within its grace period."""

    # -- reports ---------------------------------------------------------------------

    def _running_status(self, entry: _Pod) -> dict[str, Any]:
        """Running, Ready as far as its readiness probe says (see the module docstring)."""
        ready = "True" if entry.ready else "False"
        return {
            "phase": "Running", "hostIP": self.host_ip, "podIP": self.host_ip, "startTime": entry.started_at,
            "conditions": [{"type": t, "status": "True", "lastTransitionTime": entry.started_at}
                           for t in ("PodScheduled", "Initialized")]
                          + [{"type": t, "status": ready, "lastTransitionTime": entry.ready_since}
                             for t in ("ContainersReady", "Ready")],
            "containerStatuses": [{"name": entry.container, "image": entry.image, "imageID": "", "ready": entry.ready,
                                   "restartCount": 0, "started": True,
                                   "state": {"running": {"startedAt": entry.started_at}}}],
        }

    def _ended(self, entry: _Pod, code: int) -> None:
        """The pod's containers ended with ``code``: report it, and confirm a deletion in progress (a frozen
        kubelet reports nothing until it is thawed)."""
        with entry.report_lock:
            entry.exit_code = code
            if self._frozen_now(entry):
                return
            entry.ended.set()
            LOG.info("kubelet %s: pod %s/%s ended with %d%s", self.node, entry.namespace, entry.name, code,
                     " (being deleted)" if entry.deleting else "")
            self._report(entry.namespace, entry.name, terminated(entry.container, entry.image, code))
        if entry.deleting:
            self._confirm_deletion(entry.uid, entry.namespace, entry.name)

    def _report(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Report a pod's status; a dropped connection or a 5xx is retried (as a kubelet does) for a minute.

        A lost report would leave a dead worker's pod Running for the
        scheduler, so giving up after one failed request is not an option;
        the retries end when the kubelet stops (the API server may be gone).
        """
        self._retrying(f"status of {namespace}/{name}",
                       lambda: self._core.patch_namespaced_pod_status(name, namespace, {"status": status}))

    def _confirm_deletion(self, uid: str, namespace: str, name: str) -> None:
        """The kubelet's last word on a pod: delete it with grace period 0, for this uid only."""
        if self._stop.is_set():
            return
        with self._lock:
            if uid in self._done:
                return
            self._done.add(uid)
        body = client.V1DeleteOptions(grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid))
        self._retrying(f"deletion of {namespace}/{name}",
                       lambda: self._core.delete_namespaced_pod(name, namespace, body=body, grace_period_seconds=0))

    def _retrying(self, what: str, call: Callable[[], Any]) -> None:
        delay, deadline = 0.1, time.monotonic() + STATUS_RETRY_SECONDS
        while True:
            if self._stop.is_set():
                return
            try:
                call()
                return
            except client.ApiException as exc:
                if exc.status in (404, 409):  # gone meanwhile, or another pod of that name now
                    return
                if exc.status < 500:
                    LOG.warning("kubelet %s: %s not done: %s %s", self.node, what, exc.status, exc.reason)
                    return
                problem = f"API error {exc.status} {exc.reason}"
            except urllib3.exceptions.HTTPError as exc:  # connection refused or reset
                problem = str(exc)
            if time.monotonic() > deadline:
                LOG.warning("kubelet %s: %s not done: %s", self.node, what, problem)
                return
            LOG.warning("kubelet %s: %s not done yet (%s), retrying", self.node, what, problem)
            self._stop.wait(delay)
            delay = min(2.0, delay * 2)

    def _frozen_now(self, entry: _Pod) -> bool:
        with self._lock:
            return (entry.namespace, entry.name) in self._frozen


class NodeAgent(_Kubelet):
    """A kubelet without a container runtime (see the module docstring).

    ``run_pods``: report admitted pods Running at once (else the test does, with
    ``set_pod_running``); ``stop_seconds``: how long a pod's containers take to
    stop once asked (they exit 143, as a process ending on SIGTERM).
    """

    def __init__(self, api_client: client.ApiClient, node: str, host_ip: str = "", *, run_pods: bool = False,
                 stop_seconds: float = 0.0, gpus: int | None = None) -> None:
        super().__init__(api_client, node, host_ip, gpus=gpus)
        self.run_pods = run_pods
        self.stop_seconds = stop_seconds

    def __enter__(self) -> NodeAgent:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self, pod: client.V1Pod, entry: _Pod) -> None:
        if self.run_pods:
            entry.started = True
            self._report(entry.namespace, entry.name, self._running_status(entry))

    def _begin_termination(self, entry: _Pod) -> None:
        if self._frozen_now(entry) or entry.ended.is_set():
            return

        def stop() -> None:
            if self.stop_seconds:
                self._stop.wait(min(self.stop_seconds, entry.grace_seconds) if entry.grace_seconds else 0)
            if not self._frozen_now(entry) and not entry.ended.is_set():
                self._ended(entry, 143)

        threading.Thread(target=stop, name=f"kubelet-{self.node}-stop-{entry.name}", daemon=True).start()

    def _ended(self, entry: _Pod, code: int) -> None:
        if not entry.started:  # nothing ever ran: nothing to report, only the deletion to confirm
            entry.ended.set()
            if entry.deleting:
                self._confirm_deletion(entry.uid, entry.namespace, entry.name)
            return
        super()._ended(entry, code)


class LocalKubelet(_Kubelet):
    """Runs the pods bound to ``node`` as processes on this machine (see the module docstring)."""

    def __init__(self, api_client: client.ApiClient, node: str, host_ip: str, workdir: Path,
                 base_env: Mapping[str, str] | None = None, cwd: Path | None = None,
                 entrypoints: Mapping[str, Sequence[str]] | None = None, probe_period_scale: float = 1.0,
                 gpus: int | None = None) -> None:
        """``entrypoints`` maps an image to the local command standing in for its ENTRYPOINT,
        used when a container gives only ``args`` (e.g. ``{"tenplex:0.1.0": [".venv/bin/tenplex"]}``);
        ``probe_period_scale`` multiplies the readiness probes' periods and initial delays."""
        if not probe_period_scale > 0:
            raise ValueError(f"probe_period_scale must be > 0, got {probe_period_scale}")
        super().__init__(api_client, node, host_ip, gpus=gpus)
        self.probe_period_scale = probe_period_scale
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._base_env = dict(base_env if base_env is not None else os.environ)
        self._cwd = cwd
        self._entrypoints = {image: list(cmd) for image, cmd in (entrypoints or {}).items()}

    def __enter__(self) -> LocalKubelet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, kill_pods: bool = True) -> None:
        """Stop watching and, by default, kill the pods' processes (as a lost node loses them)."""
        super().stop()
        if kill_pods:
            with self._lock:
                running = [p for p in self._pods.values() if p.process is not None]
            for pod in running:
                assert pod.process is not None
                if pod.process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pod.process.pid, signal.SIGKILL)
                    pod.process.wait(timeout=10)

    # -- what tests look at ---------------------------------------------------------

    def pid(self, name: str, namespace: str = "default") -> int | None:
        with self._lock:
            for pod in self._pods.values():
                if (pod.namespace, pod.name) == (namespace, name) and pod.process is not None \
                        and pod.process.poll() is None:
                    return pod.process.pid
        return None

    def kill(self, name: str, namespace: str = "default", sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a pod's process (a crash: the kubelet then reports the pod Failed)."""
        pid = self.pid(name, namespace)
        if pid is None:
            raise KeyError(f"no running process for pod {namespace}/{name} on node {self.node}")
        os.kill(pid, sig)

    def _read(self, read: Any, name: str, namespace: str) -> Any:
        """A Secret or ConfigMap a pod uses, read as the node. The Node authorizer allows it only once its graph has
        seen the pod bound here, which can come a moment after the pod reached this kubelet: "no relationship found
        between node ... and this object" is a 403 a real kubelet retries (its volume mounts back off and try
        again), so this one does too, for up to NODE_GRAPH_WAIT_S."""
        deadline = time.monotonic() + NODE_GRAPH_WAIT_S
        while True:
            try:
                return read(name, namespace)
            except client.ApiException as exc:
                if exc.status != 403 or "no relationship found" not in str(exc.body) or time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def log_path(self, name: str, namespace: str = "default") -> Path:
        return self.workdir / f"{namespace}_{name}.log"

    # -- running a pod ----------------------------------------------------------------

    def _start(self, pod: client.V1Pod, entry: _Pod) -> None:
        meta, spec = pod.metadata, pod.spec
        container = spec.containers[0]
        try:
            env = self._environment(pod, container)
            command = list(container.command or [])
            if not command:
                if container.image not in self._entrypoints:
                    raise ValueError(f"container {container.name} has no command and image {container.image!r} has no "
                                     f"local entry point (known: {sorted(self._entrypoints)})")
                command = self._entrypoints[container.image]
            mounts = self._data_volumes(pod, container)
            env = {name: _remount(value, mounts) for name, value in env.items()}
            argv = [_remount(expand(a, env), mounts) for a in [*command, *(container.args or [])]]
            probe = ReadinessProbe.of(container, self.host_ip)
            if _mounts_service_account(pod) and "KUBECONFIG" not in env:
                env["KUBECONFIG"] = str(self._service_account_kubeconfig(pod))
        except (ValueError, KeyError, client.ApiException) as exc:
            LOG.error("kubelet %s: cannot start pod %s/%s: %s", self.node, meta.namespace, meta.name, exc)
            entry.ended.set()
            self._report(meta.namespace, meta.name, {"phase": "Failed", "reason": "CreateContainerConfigError",
                                                     "message": str(exc)})
            return
        log_path = self.log_path(meta.name, meta.namespace)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(argv, env={**self._base_env, **env}, stdout=log, stderr=subprocess.STDOUT,
                                       cwd=self._cwd, start_new_session=True)
        entry.process, entry.log_path, entry.started = process, log_path, True
        entry.started_at = entry.ready_since = _now()
        entry.ready = probe is None  # with a readiness probe, Ready once it has passed
        LOG.info("kubelet %s: pod %s/%s started as pid %d: %s", self.node, meta.namespace, meta.name, process.pid, argv)
        with entry.report_lock:
            self._report(meta.namespace, meta.name, self._running_status(entry))
        threading.Thread(target=self._reap, args=(entry,), name=f"kubelet-{self.node}-reap-{meta.name}",
                         daemon=True).start()
        if probe is not None:
            threading.Thread(target=self._probe_readiness, args=(entry, probe),
                             name=f"kubelet-{self.node}-probe-{meta.name}", daemon=True).start()

    def _probe_readiness(self, entry: _Pod, probe: ReadinessProbe) -> None:
        """Probe until the container ends (or is being deleted, or the kubelet stops); report each change of its
        readiness once the thresholds are met."""
        scale = self.probe_period_scale
        if self._stop.wait(probe.initial_delay * scale):
            return
        successes = failures = 0
        while not (entry.ended.is_set() or entry.deleting or entry.exit_code is not None):
            began = time.monotonic()
            if probe.check():
                successes, failures = successes + 1, 0
            else:
                successes, failures = 0, failures + 1
            if not entry.ready and successes >= probe.success_threshold:
                self._set_ready(entry, True, f"{successes} probe(s) of {probe.scheme} {probe.host}:{probe.port} passed")
            elif entry.ready and failures >= probe.failure_threshold:
                self._set_ready(entry, False, f"{failures} probes of {probe.scheme} {probe.host}:{probe.port}"
                                              f"{probe.path if probe.scheme != 'TCP' else ''} failed")
            if self._stop.wait(max(0.0, probe.period * scale - (time.monotonic() - began))):
                return

    def _set_ready(self, entry: _Pod, ready: bool, why: str) -> None:
        """Report the pod Running with its Ready conditions ``ready`` (not once it has ended or is being
        deleted, nor while its runtime is frozen: the change is then reported at the next probe)."""
        with entry.report_lock:
            if entry.ended.is_set() or entry.deleting or entry.exit_code is not None or self._frozen_now(entry) \
                    or entry.process is None or entry.process.poll() is not None:
                return
            entry.ready, entry.ready_since = ready, _now()
            LOG.info("kubelet %s: pod %s/%s %s: %s", self.node, entry.namespace, entry.name,
                     "Ready" if ready else "not Ready", why)
            self._report(entry.namespace, entry.name, self._running_status(entry))

    def _reap(self, entry: _Pod) -> None:
        assert entry.process is not None
        code = entry.process.wait()
        _kill_leftovers(entry.process.pid)
        if self._stop.is_set():
            entry.ended.set()
            return
        self._ended(entry, code if code >= 0 else 128 - code)

    def _begin_termination(self, entry: _Pod) -> None:
        if self._frozen_now(entry) or entry.ended.is_set():
            return
        if entry.process is None:  # never started
            entry.ended.set()
            self._confirm_deletion(entry.uid, entry.namespace, entry.name)
            return
        threading.Thread(target=self._terminate, args=(entry,), name=f"kubelet-{self.node}-term-{entry.name}",
                         daemon=True).start()

    def _terminate(self, entry: _Pod) -> None:
        """SIGTERM, then SIGKILL after the grace period; the reaper reports the end and confirms the deletion."""
        process = entry.process
        assert process is not None
        if process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=entry.grace_seconds)
        except subprocess.TimeoutExpired:
            LOG.info("kubelet %s: pod %s/%s still running %.0fs after SIGTERM: SIGKILL", self.node, entry.namespace,
                     entry.name, entry.grace_seconds)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)

    # -- the pod's service account ------------------------------------------------------------

    def _service_account_kubeconfig(self, pod: client.V1Pod) -> Path:
        """What the kubelet's projected token volume gives a container, as a process can take it: a token for
        the pod's ServiceAccount, requested by this node (TokenRequest, bound to the pod: the Node authorizer
        and NodeRestriction allow a node exactly that), in a kubeconfig that ``$KUBECONFIG`` names."""
        meta = pod.metadata
        account = pod.spec.service_account_name or "default"
        request = {"spec": {"expirationSeconds": 3600,
                            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta.name, "uid": meta.uid}}}
        token = self._core.create_namespaced_service_account_token(account, meta.namespace, request).status.token
        cfg = self._core.api_client.configuration
        cluster: dict[str, Any] = {"server": cfg.host}
        if cfg.ssl_ca_cert:
            cluster["certificate-authority"] = cfg.ssl_ca_cert
        kubeconfig = {"apiVersion": "v1", "kind": "Config", "current-context": "pod",
                      "clusters": [{"name": "cluster", "cluster": cluster}],
                      "users": [{"name": account, "user": {"token": token}}],
                      "contexts": [{"name": "pod", "context": {"cluster": "cluster", "user": account,
                                                               "namespace": meta.namespace}}]}
        path = self.workdir / f"{meta.namespace}_{meta.name}.kubeconfig"
        path.write_text(json.dumps(kubeconfig))
        path.chmod(0o600)
        return path

    def _data_volumes(self, pod: client.V1Pod, container: client.V1Container) -> dict[str, Path]:
        """The container's Secret and ConfigMap volumes, written as files under the kubelet's directory, by
        mount path. A container sees them at its ``mountPath``; a process on the host cannot, so the paths the
        container is given (env values, arguments) under a mount path are pointed at these directories
        instead (:func:`_remount`). Written once at the start (a real kubelet also refreshes them later)."""
        sources = {v.name: v for v in pod.spec.volumes or []}
        mounts: dict[str, Path] = {}
        for mount in container.volume_mounts or []:
            volume = sources.get(mount.name)
            if volume is None or (volume.secret is None and volume.config_map is None):
                continue
            if volume.secret is not None:
                secret = self._read(self._core.read_namespaced_secret, volume.secret.secret_name, pod.metadata.namespace)
                data = {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}
                items = volume.secret.items
            else:
                config_map = self._read(self._core.read_namespaced_config_map, volume.config_map.name, pod.metadata.namespace)
                data = {k: v.encode() for k, v in (config_map.data or {}).items()}
                items = volume.config_map.items
            files = {item.path: data[item.key] for item in items} if items else data
            root = self.workdir / "volumes" / f"{pod.metadata.namespace}_{pod.metadata.name}" / mount.name
            root.mkdir(parents=True, exist_ok=True)
            for rel, content in files.items():
                target = root / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
                target.chmod(0o600)
            if mount.sub_path:
                mounts[mount.mount_path] = root / mount.sub_path
            else:
                mounts[mount.mount_path] = root
        return mounts

    # -- environment ----------------------------------------------------------------------

    def _environment(self, pod: client.V1Pod, container: client.V1Container) -> dict[str, str]:
        env: dict[str, str] = {}
        for var in container.env or []:
            if var.value is not None:
                env[var.name] = expand(var.value, env)
            elif var.value_from is not None:
                env[var.name] = self._value_from(pod, var.name, var.value_from)
            else:
                env[var.name] = ""
        return env

    def _value_from(self, pod: client.V1Pod, name: str, source: client.V1EnvVarSource) -> str:
        if source.field_ref is not None:
            path = source.field_ref.field_path
            fields = {"status.hostIP": self.host_ip, "status.podIP": self.host_ip, "metadata.name": pod.metadata.name,
                      "metadata.namespace": pod.metadata.namespace, "spec.nodeName": self.node,
                      "metadata.uid": pod.metadata.uid, "spec.serviceAccountName": pod.spec.service_account_name or ""}
            if path in fields:
                return str(fields[path])
            m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
            if m:
                return str((getattr(pod.metadata, m.group(1)) or {}).get(m.group(2), ""))
            raise ValueError(f"env {name}: fieldRef {path!r} is not supported by the test kubelet")
        if source.secret_key_ref is not None:
            ref = source.secret_key_ref
            secret = self._read(self._core.read_namespaced_secret, ref.name, pod.metadata.namespace)
            if ref.key in (secret.data or {}):
                return base64.b64decode(secret.data[ref.key]).decode()
            if ref.key in (secret.string_data or {}):
                return str(secret.string_data[ref.key])
            raise KeyError(f"env {name}: secret {ref.name} has no key {ref.key!r}")
        if source.config_map_key_ref is not None:
            ref = source.config_map_key_ref
            data = self._read(self._core.read_namespaced_config_map, ref.name, pod.metadata.namespace).data or {}
            if ref.key not in data:
                raise KeyError(f"env {name}: configmap {ref.name} has no key {ref.key!r}")
            return str(data[ref.key])
        raise ValueError(f"env {name}: this kind of valueFrom is not supported by the test kubelet")


def _remount(value: str, mounts: Mapping[str, Path]) -> str:
    """``value`` with a leading mount path (the path itself or a path below it) replaced by the host directory
    that holds that volume's files (:meth:`LocalKubelet._data_volumes`)."""
    for mount_path, host in mounts.items():
        prefix = mount_path.rstrip("/")
        if value == prefix or value.startswith(prefix + "/"):
            return str(host) + value[len(prefix):]
    return value


def _mounts_service_account(pod: client.V1Pod) -> bool:
    """Whether the pod has the projected service-account token volume the API server adds (automount)."""
    for volume in pod.spec.volumes or []:
        for source in (volume.projected.sources or []) if volume.projected is not None else []:
            if source.service_account_token is not None:
                return True
    return False


def _kill_leftovers(pgid: int) -> None:
    """SIGKILL what remains of a pod's process group once its main process is gone (a container's end)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.02, what: str = "condition") -> Any:
    """Poll ``predicate()`` until it returns something truthy; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
