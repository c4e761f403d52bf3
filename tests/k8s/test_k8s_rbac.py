"""RBAC proven both ways: the chart grants the scheduler everything it calls, and nothing it does not.

The scheduler runs as the chart's ServiceAccount (a real token) against the test cluster's
kube-apiserver, which holds the chart's rendered ServiceAccount, Roles and ClusterRoles (as ``helm install``
creates them), and its RBAC authorizer decides every request. One run goes through
every kind of call the scheduler makes: leader election, two ElasticJobs in
two namespaces (pods, budgets, state ConfigMaps, status, Events), failures
that relaunch workers and prune old PTCs, a job with standby pods whose
failure gives its live pod the next generation (a real standby process, run
by a test kubelet, relabelled by the scheduler), a restart that resumes the
jobs from the API server, and the jobs' deletion. Then the requests the API server's audit log recorded (verb,
group, resource, subresource, namespace) are compared with the rendered rules:
none refused (nothing missing) and every granted verb used (least privilege),
for both namespace modes of the chart. Every other operator and end-to-end
test checks the first half too (``assert_rbac_clean``).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest

from tenplex.k8s.operator import KubernetesScheduler
from tenplex.k8s.settings import KubernetesSettings
from tenplex.scheduler.controller import SchedulerSettings
from tenplex.scheduler.state import Phase
from tenplex.sockets import free_port
from tenplex.testing.k8s.cluster import TestCluster
from tenplex.testing.k8s.controlplane import User
from tenplex.testing.k8s.kubelet import LocalKubelet

from . import rbac_audit as rbac
from .cluster import (
    NodeAgents,
    chart_rbac,
    elasticjob,
    eventually,
    live_worker_pods,
    scheduler_client,
    scheduler_user,
    store_daemonset,
    store_pod,
)

REPO = Path(__file__).resolve().parents[2]
RELEASE_NS = "tenplex"
JOB_NAMESPACES = ("ml", "research")
IDENTITY = "rel-tenplex-scheduler-6d5f7c9b8-abcde"


def start_scheduler(api: TestCluster, state: Path, watch: tuple[str, ...]) -> KubernetesScheduler:
    settings = KubernetesSettings(namespace=RELEASE_NS, identity=IDENTITY, watch_namespaces=watch,
                                  lease_duration_seconds=3, renew_deadline_seconds=2, retry_period_seconds=1)
    # Ports no concurrent test's rendezvous can hold (a TCPStore binds every address): the standby pods' too.
    base = free_port("0.0.0.0", 20)
    sched = KubernetesScheduler(scheduler_client(api, RELEASE_NS, watch), settings,
                                SchedulerSettings(url="http://127.0.0.1:9", poll_interval=0.1), state, watch_timeout=5,
                                master_ports=(base, base + 19))
    sched.recover()
    assert sched.operator.leading.wait(20), "the scheduler never took the Lease"
    return sched


def standby_jobs(api: TestCluster, sched: KubernetesScheduler, stack: ExitStack, tmp_path: Path) -> None:
    """A node of its own with a test kubelet that runs its pods (a real store daemon, the jobs' standby pods);
    in each job namespace a job with ``standby`` whose worker dies in its pod: the pod is given generation 1
    (patched)."""
    node, ip = "gpu-c", "127.0.0.4"
    api.add_node(node, gpus=len(JOB_NAMESPACES), address=ip)
    kubelet = LocalKubelet(stack.enter_context(api.api_client(User.node(node))), node, ip, tmp_path / node,
                           base_env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    stack.enter_context(kubelet)
    api.kubelets[node] = kubelet
    with socket.socket() as probe:
        probe.bind((ip, 0))
        port = probe.getsockname()[1]
    api.create("pods", store_pod(node, store_daemonset(api, RELEASE_NS), namespace=RELEASE_NS, port=port, command=[
        sys.executable, "-m", "tenplex", "store", "serve", "--root", str(tmp_path / node / "store"), "--host", ip,
        "--port", str(port)]), RELEASE_NS)
    for ns in JOB_NAMESPACES:  # one after the other, as above
        name = f"sb-{ns}"
        api.create("elasticjobs", elasticjob(name, 1, namespace=ns, standby=True, max_restarts=5,
                                             command=[sys.executable, "-m", "tests.standby_fixture"],
                                             env=[{"name": "SLEEP", "value": "600"}]), ns)
        (pod,) = eventually(lambda j=name, n=ns: (p := live_worker_pods(api, j, n)) and p[0]["status"]["phase"]
                            == "Running" and p, f"{name}'s standby pod running", timeout=60)
        uid = pod["metadata"]["uid"]
        pid = eventually(lambda u=uid, j=name: (link := sched.kube_backend.standbys.link(u)) and link.pids.get(f"{j}-g0-r0"),
                         f"{name}'s worker in its standby pod", timeout=60)
        os.kill(pid, signal.SIGKILL)
        eventually(lambda u=uid, j=name, n=ns: [(p["metadata"]["uid"], p["metadata"]["labels"]["tenplex.io/generation"])
                                               for p in live_worker_pods(api, j, n)] == [(u, "1")],
                   f"{name}'s pod given generation 1", timeout=60)


def run_everything(api: TestCluster, agents: NodeAgents, tmp_path: Path, watch: tuple[str, ...]) -> None:
    """Every path of the scheduler that talks to the API server."""
    stack = ExitStack()
    with stack:
        _run_everything(api, agents, tmp_path, watch, stack)


def _run_everything(api: TestCluster, agents: NodeAgents, tmp_path: Path, watch: tuple[str, ...],
                    stack: ExitStack) -> None:
    api.create_namespace(RELEASE_NS)
    for ns in JOB_NAMESPACES:
        api.create_namespace(ns)
    owner = store_daemonset(api, RELEASE_NS)
    for i, node in enumerate(("gpu-a", "gpu-b")):
        api.add_node(node, gpus=2, address=f"127.0.0.{2 + i}")
        api.create("pods", store_pod(node, owner, namespace=RELEASE_NS), RELEASE_NS)
        api.set_pod_running(f"store-{node}", RELEASE_NS)
        agents.start(node, run_pods=True)

    sched = start_scheduler(api, tmp_path / "a", watch)
    try:
        for ns in JOB_NAMESPACES:  # one after the other: two jobs placed at the same moment race (see README)
            job = f"gpt-{ns}"
            api.create("elasticjobs", elasticjob(job, 2, namespace=ns, max_restarts=5), ns)
            eventually(lambda j=job, n=ns: [p["status"]["phase"] for p in live_worker_pods(api, j, n)] == ["Running"] * 2,
                       f"{job}'s pods")
            ctl = eventually(lambda j=job: sched.find(j), f"{job} known")
            eventually(lambda c=ctl: c.status.phase == Phase.RUNNING, f"{job} Running")
        for ns in JOB_NAMESPACES:
            job = f"gpt-{ns}"
            ctl = sched.get(job)
            # Two failures before any snapshot: the job starts again as generations 1 and 2; generation 0's PTC
            # is no longer referenced and is deleted.
            for generation in (1, 2):
                victim = live_worker_pods(api, job, ns)[0]["metadata"]["name"]
                api.fail_pod(victim, ns)
                eventually(lambda j=job, n=ns, g=generation: [(p["metadata"]["name"], p["status"]["phase"])
                                                              for p in live_worker_pods(api, j, n)]
                           == [(f"{j}-g{g}-r0", "Running"), (f"{j}-g{g}-r1", "Running")],
                           f"{job} relaunched as generation {generation}", timeout=30)
        # Each job got a node of its own: the other's GPUs were held.
        nodes = {p["spec"]["nodeName"] for ns in JOB_NAMESPACES for p in live_worker_pods(api, f"gpt-{ns}", ns)}
        assert nodes == {"gpu-a", "gpu-b"}
        standby_jobs(api, sched, stack, tmp_path)
    finally:
        sched.close()

    sched = start_scheduler(api, tmp_path / "b", watch)  # a restart: the jobs are resumed from the API server
    try:
        for ns in JOB_NAMESPACES:
            ctl = eventually(lambda n=ns: sched.find(f"gpt-{n}"), f"gpt-{ns} resumed")
            assert ctl.status.generation == 2
        for ns in JOB_NAMESPACES:
            api.delete("elasticjobs", f"gpt-{ns}", ns)
            api.delete("elasticjobs", f"sb-{ns}", ns)
        eventually(lambda: not sched.list(), "the jobs deleted")
        for ns in JOB_NAMESPACES:
            eventually(lambda n=ns: not live_worker_pods(api, f"gpt-{n}", n), f"gpt-{ns}'s pods gone")
            eventually(lambda n=ns: not live_worker_pods(api, f"sb-{n}", n), f"sb-{ns}'s standby pod gone", timeout=60)
    finally:
        sched.close()
    assert api.gpu_overbookings() == []


@pytest.mark.slow
@pytest.mark.parametrize("watch", [(), JOB_NAMESPACES], ids=["all-namespaces", "watched-namespaces"])
def test_the_charts_rbac_is_exactly_what_the_scheduler_uses(api: TestCluster, agents: NodeAgents,
                                                            tmp_path: Path, watch: tuple[str, ...]) -> None:
    run_everything(api, agents, tmp_path, watch)
    user = scheduler_user(RELEASE_NS)
    calls = [a for a in api.accesses(user.name) if not a.while_starting]
    assert calls and all(a.allowed for a in calls), sorted({str(a) for a in calls if not a.allowed})
    audit = rbac.audit(chart_rbac(RELEASE_NS, watch), user, calls)
    assert audit.ok, "the chart's RBAC is not exactly what the scheduler uses:\n" + audit.report()
