"""End to end on the test cluster: the reference GPT job as an ElasticJob, scaled and recovered.

Everything but the nodes is real: kube-apiserver, etcd, the controller-manager
and the scheduler, one test kubelet per node running that node's pods as processes, the
store DaemonSet's pods as real ``tenplex store serve`` daemons on the node
addresses (127.0.7.x), the scheduler (Kubernetes backend, ElasticJob operator
holding the Lease, state in ConfigMaps and the ElasticJob status) with its
REST API for the workers, and the workers: ``examples/gpt/train.py`` in
elastic mode training a tiny GPT with gloo over the host network.

The job starts on 1 GPU, is scaled to 2 (dp2 on two nodes) through the scale subresource (as
``kubectl scale`` does), is moved off a drained node (its PodDisruptionBudget
holds the evictions until the scheduler has moved the state and the
workers), then one worker's process is killed: the kubelet reports its pod
Failed, and the job resumes from the newest version held by the node stores
and runs to the last step.

A store daemon that stops answering (its process stopped) while its pod stays
Running: its kubelet's readiness probe (the chart's) fails, the pod turns not
Ready, the node is lost, and the dp2 job on it recovers from the surviving
replica onto the nodes whose stores answer.

A second run gives the nodes two GPUs each and the job ``gpusPerPod: 2``: its
worker pods run two ranks each under ``tenplex worker launch``, one pod on one
node, then, scaled to 4 GPUs, one pod on each of two nodes, to the last step.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tenplex.core.version import Version
from tenplex.errors import NotFound
from tenplex.k8s import crd
from tenplex.k8s.backend import (
    ANNOTATION_MASTER_PORT,
    ANNOTATION_STANDBY_PORT,
    ANNOTATION_TEMPLATE,
    ANNOTATION_WORKERS,
    LABEL_GENERATION,
    LABEL_RANKS,
    LABEL_STANDBY,
)
from tenplex.k8s.operator import KubernetesScheduler
from tenplex.k8s.settings import KubernetesSettings
from tenplex.scheduler.api import create_app
from tenplex.scheduler.controller import SchedulerSettings
from tenplex.scheduler.state import Phase
from tenplex.serving import BackgroundServer, bind_socket
from tenplex.sockets import free_port
from tenplex.store.client import StoreClient
from tenplex.testing.k8s.cluster import TestCluster
from tenplex.testing.k8s.controlplane import User
from tenplex.testing.k8s.kubelet import LocalKubelet

from .cluster import (
    NS,
    assert_rbac_clean,
    elasticjob,
    eventually,
    scheduler_client,
    store_daemonset,
    store_pod,
    tool,
    worker_pods,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TOKEN = "e2e-token"
NODES = {"node-0": "127.0.7.2", "node-1": "127.0.7.3", "node-2": "127.0.7.4"}
MODEL = {"vocab": 64, "dim": 32, "n_layers": 4, "n_heads": 4, "seq_len": 16}
SNAPSHOT_EVERY = 3
"""A worker snapshots every 3 steps and the next snapshot joins the previous one's write: a worker killed at step
s + 2 x SNAPSHOT_EVERY while it waits for the write of s + SNAPSHOT_EVERY goes back to s, losing at most 2 x SNAPSHOT_EVERY
steps (exactly that was seen under load)."""
STORE_READINESS = {"httpGet": {"path": "/healthz", "port": "store"}, "periodSeconds": 5, "failureThreshold": 2}
"""The chart's readiness probe of the store container."""
PROBE_PERIOD_SCALE = 0.2
"""The kubelets probe every second instead of every 5 (the timeouts stay the kubelet's 1 s)."""
STEPS = 30
WORKER = [sys.executable, "-m", "examples.gpt.train", "--layers", "4", "--dim", "32", "--heads", "4", "--vocab", "64",
          "--seq-len", "16", "--samples", "4096", "--global-batch", "8", "--snapshot-every", str(SNAPSHOT_EVERY)]


class Cluster:
    def __init__(self, api: TestCluster, root: Path, stack: ExitStack, gpus_per_node: int = 1) -> None:
        self.api = api
        self.kubelets: dict[str, LocalKubelet] = {}
        api.create("secrets", {"metadata": {"name": "tenplex-auth"},
                               "data": {"token": base64.b64encode(TOKEN.encode()).decode()}}, NS)
        # The image's PATH: its ``tenplex`` entry point (multi-GPU pods run their ranks under it) is this venv's.
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        owner = store_daemonset(api)
        for node, ip in NODES.items():
            # One GPU each by default: few processes; every change crosses nodes.
            api.add_node(node, gpus=gpus_per_node, address=ip)
            kubelet = LocalKubelet(stack.enter_context(api.api_client(User.node(node))), node, ip, root / node,
                                   base_env=env, cwd=REPO, probe_period_scale=PROBE_PERIOD_SCALE)
            self.kubelets[node] = stack.enter_context(kubelet)
            api.kubelets[node] = kubelet
            port = free_port(ip)
            pod = store_pod(node, owner, port=port, command=[
                sys.executable, "-m", "tenplex", "store", "serve", "--root", str(root / node / "store"),
                "--host", ip, "--port", str(port)])
            pod["spec"]["containers"][0]["env"] = [
                {"name": "TENPLEX_TOKEN", "valueFrom": {"secretKeyRef": {"name": "tenplex-auth", "key": "token"}}}]
            pod["spec"]["containers"][0]["readinessProbe"] = dict(STORE_READINESS)
            api.create("pods", pod, NS)
        for node, ip in NODES.items():
            port = api.get("pods", f"store-{node}", NS)["spec"]["containers"][0]["ports"][0]["hostPort"]
            store = StoreClient(f"http://{ip}:{port}", TOKEN, retries=0, timeout=2)
            eventually(lambda s=store: _healthy(s), f"the store daemon of {node}", timeout=60, interval=0.2)
            eventually(lambda n=node: self.store_ready(n), f"the store pod of {node} Ready", timeout=30, interval=0.1)

    def store_ready(self, node: str) -> bool:
        """Whether the node's store pod is Ready (its kubelet's readiness probe passes)."""
        conditions = (self.api.get("pods", f"store-{node}", NS).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


    def worker_logs(self, job: str, lines: int = 15) -> str:
        """The last lines of every worker pod's log of ``job``, for a failing test's message."""
        out = []
        for node, kubelet in self.kubelets.items():
            for path in sorted(kubelet.workdir.glob(f"*_{job}-g*.log")):
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"\n--- {node} {path.name} ---\n" + "\n".join(tail))
        return "".join(out)


def _healthy(store: StoreClient) -> bool:
    try:
        store.health()
        return True
    except Exception:
        return False


@pytest.fixture
def cluster(api: TestCluster, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The nodes; ``@pytest.mark.parametrize("cluster", [G], indirect=True)`` gives each G GPUs (default 1)."""
    with ExitStack() as stack:
        yield Cluster(api, tmp_path / "nodes", stack, gpus_per_node=getattr(request, "param", 1))


class Deployment:
    """The scheduler as its Deployment runs it, restartable: the ServiceAccount with the chart's RBAC, the Lease,
    and the REST API the workers reach at one URL (the Service) across restarts."""

    def __init__(self, api: TestCluster, root: Path, stop_margin: float = 15.0) -> None:
        self.api, self.root, self.stop_margin = api, root, stop_margin
        self._sock: socket.socket | None = bind_socket("127.0.0.1", 0)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.base = free_port("0.0.0.0", 21)
        self.starts = 0
        self.sched: KubernetesScheduler | None = None
        self.server: BackgroundServer | None = None

    def start(self) -> KubernetesScheduler:
        sock = self._sock or bind_socket("127.0.0.1", self.port)
        self._sock = None
        # A restarted container keeps its pod's name: the Lease is renewed at once, not waited out. The Lease
        # outlasts a kube-apiserver restart on this machine (up to ~20 s under load), as the chart's 15 s
        # need not: there the scheduler's container would exit and be restarted, resuming the same way.
        settings = KubernetesSettings(namespace=NS, identity="scheduler-0", auth_secret="tenplex-auth",
                                      lease_duration_seconds=30, renew_deadline_seconds=25, retry_period_seconds=1)
        sched = KubernetesScheduler(scheduler_client(self.api), settings,
                                    SchedulerSettings(url=self.url, token=TOKEN, heartbeat_interval=0.3),
                                    self.root / f"sched-{self.starts}", master_ports=(self.base, self.base + 20),
                                    watch_timeout=10, stop_margin=self.stop_margin,
                                    store_client=lambda url: RecordingStoreClient(url, TOKEN, retries=2, timeout=10))
        self.starts += 1
        self.server = BackgroundServer(create_app(sched, token=TOKEN), sock=sock).start()
        sched.recover()
        assert sched.operator.leading.wait(30), "the scheduler never took the Lease"
        self.sched = sched
        return sched

    def crash(self) -> None:
        """The scheduler's process ends: its API and controllers stop; the workers and their pods do not."""
        assert self.server is not None and self.sched is not None
        self.server.stop()
        self.sched.close()
        self.sched = self.server = None

    def restart(self) -> KubernetesScheduler:
        self.crash()
        return self.start()

    def teardown(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.sched is not None:
            for ctl in self.sched.list():
                ctl.close()  # no failure handling while the workers are taken down
                self.sched.backend.stop(ctl.spec.name, [w.worker_id for w in ctl.status.workers], grace=2)
            self.sched.close()


@pytest.fixture
def deployment(api: TestCluster, cluster: Cluster, tmp_path: Path) -> Iterator[Deployment]:
    RecordingStoreClient.calls = []
    deployed = Deployment(api, tmp_path, stop_margin=3.0)
    deployed.start()
    try:
        yield deployed
    finally:
        deployed.teardown()
    assert api.gpu_overbookings() == [], "a node was given more GPUs than it has"
    assert_rbac_clean(api)


@pytest.fixture
def scheduler(deployment: Deployment) -> KubernetesScheduler:
    assert deployment.sched is not None
    return deployment.sched


def wait_job(sched: KubernetesScheduler, name: str, pred: Any, what: str, timeout: float = 240.0,
             cluster: Cluster | None = None) -> Any:
    """Wait for ``pred(status)``; on a timeout, say what the job went through (and its workers' last words)."""
    seen: list[str] = []  # the job's states on the way, for the message when it never gets there

    def check() -> Any:
        try:
            ctl = sched.get(name)
        except NotFound:  # the operator has not seen the ElasticJob yet
            return None
        with ctl.lock:
            st = ctl.status
            assert st.phase != Phase.FAILED, f"job failed while {what}: {st.message}"
            state = f"{st.phase.value}/{st.stage} g{st.generation} step {st.step} on {st.hosts}: {st.message}"
            if not seen or seen[-1] != state:
                seen.append(state)
            return st if pred(st) else None

    try:
        return eventually(check, what, timeout=timeout, interval=0.2)
    except AssertionError as exc:
        states = seen if len(seen) <= 16 else [*seen[:4], f"... {len(seen) - 16} more ...", *seen[-12:]]
        raise AssertionError(f"{exc}; the job's states meanwhile: " + " | ".join(states)
                             + _history(sched, name) + (cluster.worker_logs(name) if cluster else "")) from None


def _history(sched: KubernetesScheduler, name: str) -> str:
    ctl = sched.get(name)
    with ctl.lock:
        return "; its reconfigurations: " + " | ".join(
            f"{r.reason} {r.from_gpus}->{r.to_gpus} {r.from_hosts}->{r.to_hosts} {r.version_from}->{r.version_to}"
            f" error={r.error}" for r in ctl.status.history)


def test_reference_job_scaled_through_the_scale_subresource_and_recovered_after_a_pod_failure(
        api: TestCluster, cluster: Cluster, scheduler: KubernetesScheduler) -> None:
    job = elasticjob("gpt", 1, provider="example-gpt", model=MODEL, command=WORKER, steps=STEPS,
                     snapshot_every=SNAPSHOT_EVERY, max_gpus=2,
                     env=[{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "GLOO_SOCKET_IFNAME", "value": "lo"}])
    api.create("elasticjobs", job, NS)
    wait_job(scheduler, "gpt", lambda s: s.phase == Phase.RUNNING and s.step >= 3, "training on 1 GPU")

    with api.api_client() as api_client:
        client.CustomObjectsApi(api_client).patch_namespaced_custom_object_scale(
            crd.GROUP, crd.VERSION, NS, crd.PLURAL, "gpt", {"spec": {"replicas": 2}})
    st = wait_job(scheduler, "gpt", lambda s: s.phase == Phase.RUNNING and s.generation == 1 and s.step >= 9,
                  "training on 2 GPUs", cluster=cluster)
    assert st.gpus == 2 and st.hosts == ["node-0", "node-1"]
    # The stopped generation-0 pods are removed when generation 1 is launched.
    pods = eventually(lambda: (p := worker_pods(api, "gpt")) and len(p) == 2 and p, "2 worker pods", timeout=90)
    assert [(p["metadata"]["name"], p["spec"]["nodeName"]) for p in pods] == [
        ("gpt-g1-r0", "node-0"), ("gpt-g1-r1", "node-1")]
    # The rendezvous: rank 0 listens on its node's address (host network) at a port the pod's annotation records.
    envs = [{e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]} for p in pods]
    assert {e["MASTER_ADDR"] for e in envs} == {NODES["node-0"]} and envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    assert pods[0]["spec"]["hostNetwork"] and pods[0]["metadata"]["annotations"] == {
        ANNOTATION_MASTER_PORT: envs[0]["MASTER_PORT"], ANNOTATION_TEMPLATE: pods[1]["metadata"]["annotations"][
            ANNOTATION_TEMPLATE]}
    # The custom resource's status is written after the controller's own record: wait for it to catch up.
    ej = eventually(lambda: (s := api.get("elasticjobs", "gpt", NS)["status"]).get("gpus") == 2
                    and s.get("lastReconfiguration") and s, "the ElasticJob status to show the scale", timeout=90)
    assert ej["gpus"] == 2 and ej["lastReconfiguration"]["reason"] == "scale"
    assert ej["lastReconfiguration"]["from"]["gpus"] == 1 and ej["lastReconfiguration"]["to"]["gpus"] == 2

    # kubectl drain node-1: the job's PodDisruptionBudget refuses the evictions while its workers run there;
    # the scheduler sees the cordon, stops the workers at a step boundary, snapshots, copies the state to node-2
    # (a drain leaves the store pods running) and restarts there.
    evicted, blocked = api.evict_node_pods("node-1")
    assert evicted == [] and blocked == [f"{NS}/gpt-g1-r1"]
    st = wait_job(scheduler, "gpt", lambda s: s.phase == Phase.RUNNING and s.generation == 2 and s.step >= 15,
                  "training off the drained node", cluster=cluster)
    assert st.gpus == 2 and sorted(st.hosts) == ["node-0", "node-2"]
    assert eventually(lambda: (r := api.evict_node_pods("node-1"))[1] == [] and r, "the drain to go through", timeout=90)
    assert not [p for p in worker_pods(api, "gpt") if p["spec"]["nodeName"] == "node-1"]

    victim = next(p["metadata"]["name"] for p in worker_pods(api, "gpt") if p["spec"]["nodeName"] == "node-2")
    cluster.kubelets["node-2"].kill(victim)  # the process dies: the kubelet reports the pod Failed
    st = wait_job(scheduler, "gpt", lambda s: s.phase == Phase.SUCCEEDED, "recovering and finishing", cluster=cluster)
    assert st.step == STEPS

    assert len(st.history) == 3, "reconfigurations: " + "; ".join(
        f"{r.reason} {r.from_gpus}->{r.to_gpus} {r.from_hosts}->{r.to_hosts}: {r.error}" for r in st.history)
    scale, drain, failure = st.history
    assert (scale.reason, scale.from_gpus, scale.to_gpus, scale.steps_lost) == ("scale", 1, 2, 0)
    assert scale.bytes_remote == scale.lower_bound_bytes > 0  # node-1's replica came over the network, once
    assert drain.reason in ("node-drain", "redeploy") and drain.steps_lost == 0
    assert (drain.from_hosts, sorted(drain.to_hosts)) == (["node-0", "node-1"], ["node-0", "node-2"])
    assert drain.bytes_remote == drain.lower_bound_bytes > 0  # node-2's replica, in place before node-1's pods went
    # Seen first either as the pod's failure (the kubelet reports exit code 137) or as a peer's report of a
    # broken collective, whichever reaches the scheduler first.
    assert failure.reason == "failure"
    first_cause = (failure.error or "").split("; then ")[0]
    assert f"worker {victim} exited with code 137" in first_cause or "peer failure" in first_cause, failure.error
    # Recovery restarts from the newest snapshot every node store holds: the steps since then are lost, at most
    # two snapshot intervals (the killed rank may die while its newest snapshot is still being written).
    assert failure.to_gpus == 2 and 0 <= failure.steps_lost <= 2 * SNAPSHOT_EVERY
    assert failure.bytes_remote == failure.lower_bound_bytes  # same placement: every node restores its own shards
    assert failure.version_from is not None and failure.downtime_seconds is not None

    ej = eventually(lambda: (s := api.get("elasticjobs", "gpt", NS)["status"])["phase"] == "Succeeded" and s,
                    "the ElasticJob status Succeeded", timeout=90)
    assert ej["step"] == STEPS and ej["lastReconfiguration"]["reason"] == "failure"
    assert crd.elasticjob_errors(api.get("elasticjobs", "gpt", NS)) == []
    reasons = [e["reason"] for e in api.list("events", NS) if e["involvedObject"]["name"] == "gpt"]
    assert reasons.count("Reconfigured") == 3 and reasons.count("Succeeded") == 1, reasons
    _assert_the_daemons_moved_the_state(api, st.history, RecordingStoreClient.calls)


def _assert_the_daemons_moved_the_state(api: TestCluster, history: list[Any], calls: list[tuple[str, str]]) -> None:
    """Every reconfiguration's new version was built by the target nodes' store daemons (their transform
    records add up to the scheduler's record), and the scheduler only listed and deleted versions and sent plans."""
    records: dict[str, list[dict[str, Any]]] = {}
    for node, ip in NODES.items():
        port = api.get("pods", f"store-{node}", NS)["spec"]["containers"][0]["ports"][0]["hostPort"]
        with StoreClient(f"http://{ip}:{port}", TOKEN, timeout=10) as store:
            for t in store.request_json("GET", "/v1/jobs/gpt/transforms")["transforms"]:
                records.setdefault(t["version"], []).append(t)
    for rec in history:
        got = records.get(rec.version_to, [])
        assert sorted(t["host"] for t in got) == sorted(rec.to_hosts), (rec.version_to, got)
        assert all(t["state"] == "committed" for t in got)
        assert sum(t["report"]["bytes_remote"] for t in got) == rec.bytes_remote
        assert sum(t["report"]["bytes_local"] for t in got) == rec.bytes_local
    kinds = {(method, path.split("/")[4] if path.count("/") >= 4 else path) for method, path in calls}
    # Deleting a version is retention (the newest complete versions stay on each node): no bytes move.
    assert kinds <= {("GET", "versions"), ("DELETE", "versions"), ("POST", "transforms"), ("GET", "transforms"),
                     ("DELETE", "transforms")}, kinds
    assert ("POST", "transforms") in kinds


class RecordingStoreClient(StoreClient):
    """The scheduler's store client, remembering every request it makes (method, path)."""

    calls: list[tuple[str, str]] = []

    def _call(self, method: str, path: str, handle: Any, **kwargs: Any) -> Any:
        RecordingStoreClient.calls.append((method, path))
        return super()._call(method, path, handle, **kwargs)


def test_a_store_daemon_that_stops_answering_loses_its_host(api: TestCluster, cluster: Cluster,
                                                            scheduler: KubernetesScheduler) -> None:
    """node-1's store daemon hangs (SIGSTOP) while its pod stays Running: the kubelet's readiness probe fails,
    the store pod turns not Ready, node-1 is lost, its worker is stopped, and the dp2 job recovers from node-0's
    replica onto node-0 and node-2 well within its heartbeat timeout; no error reads "internal error"."""
    steps = 18
    job = elasticjob("gpt", 2, provider="example-gpt", model=MODEL, command=WORKER, steps=steps,
                     snapshot_every=SNAPSHOT_EVERY, max_gpus=2,
                     env=[{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "GLOO_SOCKET_IFNAME", "value": "lo"}])
    heartbeat_timeout = job["spec"]["training"]["heartbeatTimeoutSeconds"]
    api.create("elasticjobs", job, NS)
    st = wait_job(scheduler, "gpt", lambda s: s.phase == Phase.RUNNING and s.version is not None
                  and s.step >= 2 * SNAPSHOT_EVERY, "training dp2 with a committed snapshot", cluster=cluster)
    assert st.gpus == 2 and st.hosts == ["node-0", "node-1"]

    pid = cluster.kubelets["node-1"].pid("store-node-1")
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        eventually(lambda: not cluster.store_ready("node-1"), "node-1's store pod not Ready", timeout=30)
        store_pod_now = api.get("pods", "store-node-1", NS)
        assert store_pod_now["status"]["phase"] == "Running" and not store_pod_now["metadata"].get("deletionTimestamp")
        st = wait_job(scheduler, "gpt", lambda s: s.phase == Phase.RUNNING and s.generation >= 1 and s.history
                      and s.history[-1].finished_at is not None, "recovering off node-1", timeout=heartbeat_timeout,
                      cluster=cluster)
        assert sorted(st.hosts) == ["node-0", "node-2"], st.hosts
        # The cause is the host's loss (its store pod not Ready), not a heartbeat timeout of its worker.
        assert st.history[-1].reason == "failure" and st.history[-1].error == "host node-1 lost", st.history[-1]
        assert not scheduler.kube_backend.host("node-1").ready
        # Its worker was stopped: node-1's kubelet (its node is Ready) ended it and confirmed the deletion.
        assert not [p["metadata"]["name"] for p in worker_pods(api, "gpt") if p["spec"]["nodeName"] == "node-1"]
    finally:
        os.kill(pid, signal.SIGCONT)
    # The daemon answers again: its pod is Ready and node-1 a host like the others.
    eventually(lambda: cluster.store_ready("node-1"), "node-1's store pod Ready again", timeout=30)
    eventually(lambda: scheduler.kube_backend.host("node-1").ready, "node-1 ready again", timeout=30)

    st = wait_job(scheduler, "gpt", lambda s: s.phase == Phase.SUCCEEDED, "finishing", cluster=cluster)
    assert st.step == steps
    (failure,) = st.history
    assert failure.reason == "failure" and failure.error is not None
    assert failure.error == "host node-1 lost", failure.error  # and nothing else went wrong on the way back
    assert (failure.from_hosts, sorted(failure.to_hosts), failure.to_gpus) == (["node-0", "node-1"],
                                                                               ["node-0", "node-2"], 2)
    # From node-0's replica: the steps since its newest snapshot are lost (at most two intervals), and node-2,
    # which had nothing, pulled exactly the lower bound from node-0's store.
    assert failure.version_from is not None and 0 <= failure.steps_lost <= 2 * SNAPSHOT_EVERY
    assert failure.bytes_remote == failure.lower_bound_bytes > 0
    errors = [r.error or "" for r in st.history] + [st.message or ""]
    errors.append(json.dumps(api.get("elasticjobs", "gpt", NS).get("status") or {}))
    errors += [e.get("message", "") for e in api.list("events", NS) if e["involvedObject"]["name"] == "gpt"]
    assert not [e for e in errors if "internal error" in e], errors
    _assert_the_daemons_moved_the_state(api, st.history, RecordingStoreClient.calls)


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_multi_gpu_pods_train_scale_suspend_resume_and_complete(api: TestCluster, cluster: Cluster,
                                                                scheduler: KubernetesScheduler) -> None:
    steps = 18
    job = elasticjob("gpt", 2, provider="example-gpt", model=MODEL, command=WORKER, steps=steps,
                     snapshot_every=SNAPSHOT_EVERY, max_gpus=4, gpus_per_pod=2,
                     table=[{"gpus": 2, "dp": 2, "tp": 1, "pp": 1}, {"gpus": 4, "dp": 4, "tp": 1, "pp": 1}],
                     env=[{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "GLOO_SOCKET_IFNAME", "value": "lo"}])
    api.create("elasticjobs", job, NS)
    wait_job(scheduler, "gpt", lambda s: s.phase == Phase.RUNNING and s.step >= 3, "training on one 2-GPU pod")
    (pod,) = worker_pods(api, "gpt")
    assert (pod["metadata"]["name"], pod["spec"]["nodeName"], pod["metadata"]["labels"][LABEL_RANKS]) == (
        "gpt-g0-r0", "node-0", "0-1")
    assert pod["spec"]["containers"][0]["resources"]["limits"][crd.GPU_RESOURCE] == "2"
    launched = cluster.kubelets["node-0"].log_path("gpt-g0-r0").read_text()
    assert "started rank 0 (local rank 0)" in launched and "started rank 1 (local rank 1)" in launched

    with api.api_client() as api_client:
        client.CustomObjectsApi(api_client).patch_namespaced_custom_object_scale(
            crd.GROUP, crd.VERSION, NS, crd.PLURAL, "gpt", {"spec": {"replicas": 4}})
    st = wait_job(scheduler, "gpt", lambda s: s.phase == Phase.RUNNING and s.generation == 1, "training on 4 GPUs")
    assert st.gpus == 4 and st.hosts == ["node-0", "node-1"]
    pods = eventually(lambda: (p := worker_pods(api, "gpt")) and len(p) == 2 and p, "two 2-GPU pods", timeout=90)
    assert [(p["metadata"]["name"], p["spec"]["nodeName"], p["metadata"]["labels"][LABEL_RANKS]) for p in pods] == [
        ("gpt-g1-r0", "node-0", "0-1"), ("gpt-g1-r2", "node-1", "2-3")]

    # kubectl scale --replicas=0: a snapshot, then no pods and no GPUs; the state stays on the node stores.
    scale_to = lambda n: client.CustomObjectsApi(api_client).patch_namespaced_custom_object_scale(  # noqa: E731
        crd.GROUP, crd.VERSION, NS, crd.PLURAL, "gpt", {"spec": {"replicas": n}})
    with api.api_client() as api_client:
        scale_to(0)
        st = wait_job(scheduler, "gpt", lambda s: s.phase == Phase.SUSPENDED, "suspending", cluster=cluster)
        kept = st.version
        assert st.gpus == 0 and st.workers == [] and kept is not None and st.step < steps
        eventually(lambda: worker_pods(api, "gpt") == [], "no worker pods while suspended", timeout=90)
        ej = eventually(lambda: (s := api.get("elasticjobs", "gpt", NS)["status"])["phase"] == "Suspended" and s,
                        "the ElasticJob status Suspended", timeout=90)
        assert ej["gpus"] == 0 and ej["version"] == kept and ej["lastReconfiguration"]["reason"] == "suspend"
        scale_to(4)
    st = wait_job(scheduler, "gpt", lambda s: s.phase == Phase.SUCCEEDED, "resuming and finishing on 4 GPUs",
                  cluster=cluster)
    assert st.step == steps
    scale, suspend, resume = st.history
    assert (scale.reason, scale.from_gpus, scale.to_gpus, scale.steps_lost) == ("scale", 2, 4, 0)
    assert scale.bytes_remote == scale.lower_bound_bytes > 0  # node-1's ranks got their state over the network
    assert (suspend.reason, suspend.from_gpus, suspend.to_gpus, suspend.steps_lost) == ("suspend", 4, 0, 0)
    assert (resume.reason, resume.from_gpus, resume.to_gpus, resume.version_from) == ("resume", 0, 4, kept)
    assert resume.steps_lost == 0 and resume.bytes_remote == resume.lower_bound_bytes
    # Every rank exited 0, so did each pod's launcher.
    phases = eventually(lambda: (ph := [p["status"]["phase"] for p in worker_pods(api, "gpt")]) == ["Succeeded"] * 2
                        and ph, "both pods Succeeded", timeout=90)
    assert phases == ["Succeeded", "Succeeded"]


def kubectl(api: TestCluster, tmp_path: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    """kubectl as the cluster admin."""
    config = tmp_path / "kubeconfig"
    if not config.exists():
        config.write_text(yaml.safe_dump(api.kubeconfig(namespace=NS)))
    result = subprocess.run([str(tool("kubectl")), *args], capture_output=True, text=True, timeout=60,
                            env={"PATH": os.environ.get("PATH", ""), "KUBECONFIG": str(config), "HOME": str(tmp_path)})
    if ok:
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    return result


def test_standby_pods_run_the_next_generations_and_survive_a_scheduler_restart(
        api: TestCluster, cluster: Cluster, deployment: Deployment, tmp_path: Path) -> None:
    """A job with ``standby``: its worker pods outlive their generation. Scaled 1 -> 2, node-0's pod (the same
    pod, uid and all) runs generation 1's rank 0 while node-1 gets a new standby pod; scaled back to 1, node-1's
    pod is deleted and node-0's runs generation 2. ``kubectl apply`` of the job with a changed env var redeploys
    it: the workers stop at a step boundary, and generation 3 runs with the new env from that snapshot, in a new
    pod (the old spec's standby pod is not reused); an apply that changes the model is refused by the API server
    and the job trains on. The scheduler restarts, hears from the pod what it missed, and when that worker's
    process is killed inside its pod, recovers into the same pod, to the last step; then the job's pods are
    deleted."""
    sched = deployment.sched
    assert sched is not None
    steps = 36  # room for each of its five generations to train, also when kubectl is slow on a loaded machine
    job = elasticjob("gpt", 1, provider="example-gpt", model=MODEL, command=WORKER, steps=steps,
                     snapshot_every=SNAPSHOT_EVERY, max_gpus=2, standby=True,
                     env=[{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "GLOO_SOCKET_IFNAME", "value": "lo"}])
    manifest = tmp_path / "gpt.yaml"
    manifest.write_text(yaml.safe_dump(job))
    assert "elasticjob.tenplex.io/gpt created" in kubectl(api, tmp_path, "apply", "-f", str(manifest)).stdout
    wait_job(sched, "gpt", lambda s: s.phase == Phase.RUNNING and s.step >= 3, "training on 1 GPU", cluster=cluster)
    (first,) = worker_pods(api, "gpt")
    meta = first["metadata"]
    assert meta["name"] == "gpt-g0-r0" and meta["labels"][LABEL_STANDBY] == "true"
    assert meta["annotations"][ANNOTATION_WORKERS] == "gpt-g0-r0" and ANNOTATION_STANDBY_PORT in meta["annotations"]
    assert first["spec"]["containers"][0]["command"][1:5] == ["-m", "tenplex", "worker", "standby"]
    uid = meta["uid"]

    def scale(n: int) -> None:
        with api.api_client() as api_client:
            client.CustomObjectsApi(api_client).patch_namespaced_custom_object_scale(
                crd.GROUP, crd.VERSION, NS, crd.PLURAL, "gpt", {"spec": {"replicas": n}})

    def pods_of(generation: int, count: int) -> list[dict[str, Any]]:
        return eventually(lambda: (p := worker_pods(api, "gpt")) and len(p) == count and all(
            x["metadata"]["labels"][LABEL_GENERATION] == str(generation) for x in p) and p,
            f"{count} pods of generation {generation}", timeout=90)

    scale(2)
    wait_job(sched, "gpt", lambda s: s.phase == Phase.RUNNING and s.generation == 1 and s.step >= 9,
             "training on 2 GPUs", cluster=cluster)
    kept, new = pods_of(1, 2)
    assert (kept["metadata"]["uid"], kept["spec"]["nodeName"]) == (uid, "node-0")  # the same pod, given rank 0
    assert kept["metadata"]["annotations"][ANNOTATION_WORKERS] == "gpt-g1-r0"
    assert kept["metadata"]["annotations"][ANNOTATION_MASTER_PORT]  # rank 0's rendezvous port, for other jobs to avoid
    assert (new["metadata"]["name"], new["spec"]["nodeName"], new["metadata"]["labels"][LABEL_STANDBY]) == (
        "gpt-g1-r1", "node-1", "true")
    pod_log = cluster.kubelets["node-0"].log_path("gpt-g0-r0")
    assert "started worker gpt-g1-r0" in pod_log.read_text()

    scale(1)
    wait_job(sched, "gpt", lambda s: s.phase == Phase.RUNNING and s.generation == 2 and s.step >= 15,
             "training on 1 GPU again", cluster=cluster)
    (kept,) = pods_of(2, 1)
    assert kept["metadata"]["uid"] == uid and kept["metadata"]["annotations"][ANNOTATION_WORKERS] == "gpt-g2-r0"
    assert ANNOTATION_MASTER_PORT in kept["metadata"]["annotations"]

    # kubectl apply of a changed env var: a planned redeploy with the new spec, in the same layout.
    respec = {**job, "spec": {**job["spec"], "env": [*job["spec"]["env"], {"name": "TENPLEX_E2E_RUN", "value": "2"}]}}
    manifest.write_text(yaml.safe_dump(respec))
    applied = sched.get("gpt").status.step
    assert "elasticjob.tenplex.io/gpt configured" in kubectl(api, tmp_path, "apply", "-f", str(manifest)).stdout
    # kubectl apply of a changed model: the API server's transition rule refuses it; nothing happens to the job.
    changed_model = {**respec, "spec": {**respec["spec"], "layout": {**job["spec"]["layout"],
                                                                     "model": {**MODEL, "dim": 64}}}}
    manifest.write_text(yaml.safe_dump(changed_model))
    refused = kubectl(api, tmp_path, "apply", "-f", str(manifest), ok=False)
    assert refused.returncode != 0 and "spec.layout is immutable" in refused.stderr, refused.stderr
    st = wait_job(sched, "gpt", lambda s: s.phase == Phase.RUNNING and s.generation == 3 and s.step >= 21,
                  "training with the new spec", cluster=cluster)
    redeploy = st.history[-1]
    assert (redeploy.reason, redeploy.from_gpus, redeploy.to_gpus, redeploy.steps_lost) == ("spec", 1, 1, 0)
    assert redeploy.to_hosts == redeploy.from_hosts == ["node-0"] and redeploy.to_config == redeploy.from_config
    assert redeploy.bytes_remote == 0  # the state stayed where it was
    assert Version.parse(redeploy.version_from or "").step >= applied  # trained on from the stop step, not before
    assert st.spec_update is not None and st.spec_update["fields"] == ["env"] and st.spec_update["generation"] == 3
    (fresh,) = pods_of(3, 1)
    assert fresh["metadata"]["uid"] != uid and fresh["metadata"]["labels"][LABEL_STANDBY] == "true"
    assert {"name": "TENPLEX_E2E_RUN", "value": "2"} in fresh["spec"]["containers"][0]["env"]
    assert fresh["metadata"]["annotations"][ANNOTATION_TEMPLATE] != kept["metadata"]["annotations"][ANNOTATION_TEMPLATE]
    cond = eventually(lambda: next((c for c in api.get("elasticjobs", "gpt", NS)["status"].get("conditions", [])
                                    if c["type"] == "SpecUpdated" and c["status"] == "True"), None),
                      "the SpecUpdated condition", timeout=30)
    assert cond["reason"] == "Redeployed" and "changed env" in cond["message"], cond
    uid = fresh["metadata"]["uid"]
    pod_log = cluster.kubelets["node-0"].log_path("gpt-g3-r0")

    sched = deployment.restart()  # the pods go on; the new scheduler connects to them and hears everything again
    backend = sched.kube_backend
    pid = eventually(lambda: (link := backend.standbys.link(uid)) and link.greeted and link.pids.get("gpt-g3-r0"),
                     "the restarted scheduler to hear from the standby pod", timeout=180)  # a liveness deadline:
    # the new scheduler's start (informers, the Lease, the job resumed) and its reconnect back-off, on a loaded VM
    os.kill(pid, signal.SIGKILL)  # the worker dies in its pod; the pod and its standby live on
    st = wait_job(sched, "gpt", lambda s: s.phase == Phase.SUCCEEDED, "recovering and finishing", cluster=cluster)
    assert st.step == steps
    assert [(r.reason, r.from_gpus, r.to_gpus) for r in st.history] == [
        ("scale", 1, 2), ("scale", 2, 1), ("spec", 1, 1), ("failure", 1, 1)], _history(sched, "gpt")
    failure = st.history[-1]
    assert "gpt-g3-r0 exited with code 137" in (failure.error or ""), failure.error
    assert 0 <= failure.steps_lost <= 2 * SNAPSHOT_EVERY
    text = pod_log.read_text()
    assert "started worker gpt-g4-r0" in text  # recovered into the same pod
    # The job ended: no next generation to keep pods for.
    eventually(lambda: worker_pods(api, "gpt") == [], "the standby pods deleted", timeout=90)


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_multi_gpu_standby_pods_take_the_next_generations_ranks(api: TestCluster, cluster: Cluster,
                                                                 scheduler: KubernetesScheduler) -> None:
    """``gpusPerPod: 2`` with standby: the pod's standby forks both ranks of its first assignment, and on a
    scale 2 -> 4 the same pod is given ranks 0-1 of generation 1 (one request per rank) while node-1 gets a
    new pod for ranks 2-3; the job runs to its last step."""
    steps = 15
    job = elasticjob("gpt", 2, provider="example-gpt", model=MODEL, command=WORKER, steps=steps,
                     snapshot_every=SNAPSHOT_EVERY, max_gpus=4, gpus_per_pod=2, standby=True,
                     table=[{"gpus": 2, "dp": 2, "tp": 1, "pp": 1}, {"gpus": 4, "dp": 4, "tp": 1, "pp": 1}],
                     env=[{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "GLOO_SOCKET_IFNAME", "value": "lo"}])
    api.create("elasticjobs", job, NS)
    wait_job(scheduler, "gpt", lambda s: s.phase == Phase.RUNNING and s.step >= 3, "training on one 2-GPU pod",
             cluster=cluster)
    (pod,) = worker_pods(api, "gpt")
    assert pod["metadata"]["annotations"][ANNOTATION_WORKERS] == "gpt-g0-r0,gpt-g0-r1"
    with api.api_client() as api_client:
        client.CustomObjectsApi(api_client).patch_namespaced_custom_object_scale(
            crd.GROUP, crd.VERSION, NS, crd.PLURAL, "gpt", {"spec": {"replicas": 4}})
    st = wait_job(scheduler, "gpt", lambda s: s.phase == Phase.SUCCEEDED, "scaling to 4 GPUs and finishing",
                  cluster=cluster)
    assert st.step == steps and [(r.reason, r.from_gpus, r.to_gpus) for r in st.history] == [("scale", 2, 4)]
    log = cluster.kubelets["node-0"].log_path("gpt-g0-r0").read_text()  # generation 0's pod ran generation 1's ranks
    assert "started worker gpt-g1-r0" in log and "started worker gpt-g1-r1" in log, log[-2000:]
    assert "started worker gpt-g1-r2" in cluster.kubelets["node-1"].log_path("gpt-g1-r2").read_text()
    eventually(lambda: worker_pods(api, "gpt") == [], "the standby pods deleted once the job ended", timeout=90)


def test_a_standby_pod_that_stops_answering_when_given_workers_is_replaced_by_a_fresh_pod(
        api: TestCluster, cluster: Cluster, scheduler: KubernetesScheduler,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's idle standby pod on node-0 is chosen for generation 1 and its standby stops answering right
    then (SIGSTOP, after the choice, before the request): the launch waits its timeout, deletes the pod with no
    grace (the kubelet SIGKILLs it) and creates a fresh pod for the rank on the same GPU; the job trains on to
    its last step from the snapshot of the stop."""
    steps = 15
    job = elasticjob("gpt", 1, provider="example-gpt", model=MODEL, command=WORKER, steps=steps,
                     snapshot_every=SNAPSHOT_EVERY, max_gpus=2, standby=True,
                     env=[{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "GLOO_SOCKET_IFNAME", "value": "lo"}])
    api.create("elasticjobs", job, NS)
    wait_job(scheduler, "gpt", lambda s: s.phase == Phase.RUNNING and s.step >= 3, "training on 1 GPU",
             cluster=cluster)
    (first,) = worker_pods(api, "gpt")
    backend = scheduler.kube_backend
    choose = backend._standbys_for
    stalled: list[str] = []

    def chosen_then_stalled(job_name: str, groups: Any, template: str) -> dict[int, dict[str, Any]]:
        chosen = choose(job_name, groups, template)
        for pod in chosen.values():
            cluster.kubelets[pod["spec"]["nodeName"]].kill(pod["metadata"]["name"], sig=signal.SIGSTOP)
            stalled.append(pod["metadata"]["name"])
        return chosen

    monkeypatch.setattr(backend, "_standbys_for", chosen_then_stalled)
    with api.api_client() as api_client:
        client.CustomObjectsApi(api_client).patch_namespaced_custom_object_scale(
            crd.GROUP, crd.VERSION, NS, crd.PLURAL, "gpt", {"spec": {"replicas": 2}})
    wait_job(scheduler, "gpt", lambda s: s.phase == Phase.RUNNING and s.generation == 1 and s.step >= 9,
             "training on 2 GPUs after the replacement", cluster=cluster)
    assert stalled == ["gpt-g0-r0"]
    pods = {p["metadata"]["name"]: p for p in worker_pods(api, "gpt")}
    assert set(pods) == {"gpt-g1-r0", "gpt-g1-r1"}, sorted(pods)  # the stalled pod is gone
    assert first["metadata"]["uid"] not in {p["metadata"]["uid"] for p in pods.values()}
    assert pods["gpt-g1-r0"]["spec"]["nodeName"] == "node-0"  # its GPU, freed by the deletion
    assert all(p["metadata"]["labels"][LABEL_STANDBY] == "true" for p in pods.values())  # warm for the next change
    st = wait_job(scheduler, "gpt", lambda s: s.phase == Phase.SUCCEEDED, "finishing", cluster=cluster)
    assert st.step == steps and [(r.reason, r.from_gpus, r.to_gpus) for r in st.history] == [("scale", 1, 2)]
    eventually(lambda: worker_pods(api, "gpt") == [], "the standby pods deleted once the job ended", timeout=90)


def _relists(sched: KubernetesScheduler) -> list[int]:
    return [sched.index.relists, sched.kube_backend.nodes.relists, *(p.relists for p in sched.kube_backend.pods)]


def test_failures_while_pods_terminate(api: TestCluster, cluster: Cluster, deployment: Deployment) -> None:
    """What graceful deletion makes possible, on the reference job with real stores, nothing lost:

    a watch expires in the middle of a reconfiguration; then a worker dies while the kubelet of another is
    hung, so that worker's pod stays Terminating past its grace period holding its GPU; its node goes
    NotReady while the pod is Terminating; and the scheduler restarts while it still is. The job recovers
    from the survivors' state on GPUs no pod holds, and runs to its last step.
    """
    sched = deployment.sched
    assert sched is not None
    steps = 18
    job = elasticjob("gpt", 1, provider="example-gpt", model=MODEL, command=WORKER, steps=steps,
                     snapshot_every=SNAPSHOT_EVERY, max_gpus=2,
                     env=[{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "GLOO_SOCKET_IFNAME", "value": "lo"}])
    api.create("elasticjobs", job, NS)
    wait_job(sched, "gpt", lambda s: s.phase == Phase.RUNNING and s.step >= 3, "training on 1 GPU", cluster=cluster)

    # 1. A watch expires mid-reconfiguration: every informer lists again, and the change completes.
    before = _relists(sched)
    with api.api_client() as api_client:
        client.CustomObjectsApi(api_client).patch_namespaced_custom_object_scale(
            crd.GROUP, crd.VERSION, NS, crd.PLURAL, "gpt", {"spec": {"replicas": 2}})
    wait_job(sched, "gpt", lambda s: s.phase == Phase.RECONFIGURING, "the reconfiguration to start")
    api.expire_watches()  # kube-apiserver restarted, etcd compacted: every watch ends, resuming is 410 Gone
    st = wait_job(sched, "gpt", lambda s: s.phase == Phase.RUNNING and s.generation == 1 and s.step >= 9,
                  "training on 2 GPUs after the expired watches", cluster=cluster)
    assert sorted(st.hosts) == ["node-0", "node-1"]
    assert all(after > b for after, b in zip(_relists(sched), before, strict=True)), (before, _relists(sched))

    # 2. The kubelet of node-1 hangs on its worker; the worker on node-0 dies. The scheduler stops the survivor:
    #    its pod stays Terminating, past its grace period, holding node-1's GPU.
    stuck = next(p["metadata"]["name"] for p in worker_pods(api, "gpt") if p["spec"]["nodeName"] == "node-1")
    victim = next(p["metadata"]["name"] for p in worker_pods(api, "gpt") if p["spec"]["nodeName"] == "node-0")
    cluster.kubelets["node-1"].freeze(stuck)
    cluster.kubelets["node-0"].kill(victim)
    eventually(lambda: api.get("pods", stuck, NS)["metadata"].get("deletionTimestamp"), "the survivor's deletion",
               timeout=60)
    # 3. Its node goes NotReady while the pod is Terminating (the scheduler does not wait for a confirmation that
    #    cannot come), and 4. the scheduler restarts while it is still Terminating.
    api.set_node_ready("node-1", False)
    sched = deployment.restart()
    st = wait_job(sched, "gpt", lambda s: s.phase == Phase.RUNNING and s.generation >= 2 and s.step >= 12,
                  "recovering on the GPUs nobody holds", cluster=cluster)
    assert sorted(st.hosts) == ["node-0", "node-2"]
    assert api.get("pods", stuck, NS)["metadata"].get("deletionTimestamp"), "the stuck pod is still Terminating"

    # The node comes back: its GPU stays held while the pod is Terminating; once the runtime recovers, the kubelet
    # reports the pod's end and confirms its deletion, and the GPU is free again.
    api.set_node_ready("node-1", True)
    eventually(lambda: sched.kube_backend.host("node-1").ready, "node-1 Ready again")
    assert sched.kube_backend.host("node-1").gpus == 0
    cluster.kubelets["node-1"].thaw(stuck)
    eventually(lambda: api.find("pods", stuck, NS) is None, "the stuck pod gone once its kubelet confirms")
    eventually(lambda: sched.kube_backend.host("node-1").gpus == 1, "node-1's GPU free again")

    st = wait_job(sched, "gpt", lambda s: s.phase == Phase.SUCCEEDED, "finishing", cluster=cluster)
    assert st.step == steps
    scale, failure = st.history
    assert (scale.reason, scale.from_gpus, scale.to_gpus, scale.steps_lost) == ("scale", 1, 2, 0)
    assert failure.reason == "failure" and failure.to_gpus == 2 and sorted(failure.to_hosts) == ["node-0", "node-2"]
    assert failure.version_from is not None and 0 <= failure.steps_lost <= 2 * SNAPSHOT_EVERY
    # node-2 had nothing: it pulled its replica from node-0's store, exactly the lower bound.
    assert failure.bytes_remote == failure.lower_bound_bytes > 0
    _assert_the_daemons_moved_the_state(api, st.history, RecordingStoreClient.calls)
