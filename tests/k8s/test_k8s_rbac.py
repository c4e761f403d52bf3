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

And by what fails (``test_every_rule_of_the_chart_is_needed``): each verb of each rule of the chart's Roles and
ClusterRoles is taken out on the real server, and the scheduler, driven through a short scenario until it gets
there, is refused (403) a request only that verb allowed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import ApiException

from tenplex.k8s import crd
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

LOG = logging.getLogger(__name__)
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
            # The first placement waits for the scheduler's first lists and the agents' first pods: a bound on a
            # hang, generous for a loaded 2-core machine (20 s ran out once in a clean-clone run beside other tests).
            eventually(lambda j=job, n=ns: [p["status"]["phase"] for p in live_worker_pods(api, j, n)] == ["Running"] * 2,
                       f"{job}'s pods", timeout=90)
            ctl = eventually(lambda j=job: sched.find(j), f"{job} known")
            eventually(lambda c=ctl: c.status.phase == Phase.RUNNING, f"{job} Running", timeout=90)
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


# --------------------------------------------------------------------------- every rule needed: remove it, see a 403

JOB_NS = JOB_NAMESPACES[0]
Atom = tuple[str, str]
"""(resource with subresource, verb): one verb of one rule of the chart (the granularity of the audit above)."""

REMOVAL_GROUPS: tuple[tuple[str, frozenset[Atom]], ...] = (
    # (how far the scenario must go, the verbs removed together); each removed verb's own request is refused
    ("lead", frozenset({("leases", "get")})),
    ("lead", frozenset({("leases", "create")})),
    ("lead", frozenset({("leases", "update")})),
    ("lead", frozenset({("elasticjobs", "list")})),
    ("lead", frozenset({("nodes", "list"), ("pods", "list")})),
    ("lead", frozenset({("nodes", "watch"), ("pods", "watch"), ("elasticjobs", "watch")})),
    ("launch", frozenset({("configmaps", "create"), ("poddisruptionbudgets", "create")})),
    ("launch", frozenset({("configmaps", "list")})),
    ("launch", frozenset({("configmaps", "patch")})),
    ("launch", frozenset({("pods", "create")})),
    ("launch", frozenset({("elasticjobs/status", "patch")})),
    ("launch", frozenset({("events", "create")})),
    ("relaunch", frozenset({("pods", "delete")})),
    ("restart", frozenset({("configmaps", "delete"), ("configmaps", "get")})),
)
NOT_REMOVED: dict[Atom, str] = {
    ("pods", "patch"): "only the standby path relabels a pod (it needs a real standby process in a kubelet-run pod); "
                       "test_the_charts_rbac_is_exactly_what_the_scheduler_uses shows the patch made and allowed",
}
STAGES = ("lead", "launch", "relaunch", "restart")


class Refused(Exception):
    """Every removed verb has had its 403: the scenario stops there."""


def _atoms(docs: tuple[dict[str, Any], ...]) -> dict[Atom, tuple[rbac.Grant, str, str | None, int]]:
    """Each verb of each rule of the chart's Roles and ClusterRoles: its one-verb grant (the scope it applies in)
    and where it is (kind and name, namespace, rule index)."""
    scopes = {id(g.rule): g for g in rbac.grants(docs, scheduler_user(RELEASE_NS))}
    out: dict[Atom, tuple[rbac.Grant, str, str | None, int]] = {}
    for doc in docs:
        if doc["kind"] not in ("Role", "ClusterRole"):
            continue
        for i, rule in enumerate(doc["rules"]):
            grant = scopes[id(rule)]
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    key = (resource, verb)
                    assert key not in out, f"{key} granted twice: the atoms are no longer one per rule verb"
                    one = {**rule, "resources": [resource], "verbs": [verb]}
                    out[key] = (rbac.Grant(grant.namespace, grant.source, one), f"{doc['kind']}/{doc['metadata']['name']}",
                                doc["metadata"].get("namespace"), i)
    return out


def _role_path(kind_name: str, namespace: str | None) -> str:
    kind, name = kind_name.split("/")
    plural = "roles" if kind == "Role" else "clusterroles"
    return TestCluster.resource(plural).path(namespace, name)


def _set_rules(api: TestCluster, docs: tuple[dict[str, Any], ...], removed: frozenset[Atom]) -> None:
    """Write the chart's Roles and ClusterRoles with the ``removed`` verbs taken out (a rule left with no verb
    goes), then wait until the real authorizer answers accordingly (a SubjectAccessReview per changed verb)."""
    atoms = _atoms(docs)
    for doc in docs:
        if doc["kind"] not in ("Role", "ClusterRole"):
            continue
        rules = []
        for rule in doc["rules"]:
            verbs = [v for v in rule["verbs"] if not any((r, v) in removed for r in rule["resources"])]
            if verbs:
                rules.append({**rule, "verbs": verbs})
        path = _role_path(f"{doc['kind']}/{doc['metadata']['name']}", doc["metadata"].get("namespace"))
        current = api.request("GET", path)
        if current.get("rules") != rules:
            api.request("PUT", path, {**current, "rules": rules})
    user = scheduler_user(RELEASE_NS)
    for key, (grant, *_) in atoms.items():
        resource, _, sub = key[0].partition("/")
        rule = grant.rule
        attrs = {"verb": key[1], "group": rule["apiGroups"][0], "resource": resource, "subresource": sub,
                 "namespace": grant.namespace or JOB_NS, "name": (rule.get("resourceNames") or [""])[0]}
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                  "spec": {"user": user.name, "groups": list(user.groups), "resourceAttributes": attrs}}
        eventually(lambda r=review, k=key: api.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                                                       r)["status"].get("allowed", False) == (k not in removed),
                   f"the authorizer to {'refuse' if key in removed else 'allow'} {key}", timeout=10)


def _refused(api: TestCluster, atoms: dict[Atom, tuple[rbac.Grant, str, str | None, int]],
             removed: frozenset[Atom]) -> dict[Atom, str]:
    """The removed verbs the scheduler was refused so far (403 in the audit log), with the request refused."""
    out: dict[Atom, str] = {}
    for access in api.accesses(scheduler_user(RELEASE_NS).name):
        if access.code != 403 or access.while_starting:
            continue
        for key in removed:
            if key not in out and atoms[key][0].allows(access):
                out[key] = str(access)
    return out


def _scenario(api: TestCluster, tmp_path: Path, last: str, done: Callable[[], bool]) -> None:
    """The short scenario, up to stage ``last``, as the leader: take the Lease and sync (lead); one ElasticJob
    of 2 GPUs running (launch); a worker failing twice, relaunched as generations 1 and 2, generation 0's PTC
    pruned (relaunch); a second scheduler resuming it (restart). Raises :class:`Refused` as soon as ``done()``."""

    def until(predicate: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
        return eventually(lambda: done() or predicate(), what, timeout=timeout) if not done() else None

    def check() -> None:
        if done():
            raise Refused

    def start(state: Path) -> KubernetesScheduler:
        settings = KubernetesSettings(namespace=RELEASE_NS, identity=IDENTITY, lease_duration_seconds=3,
                                      renew_deadline_seconds=2, retry_period_seconds=1)
        base = free_port("0.0.0.0", 20)
        sched = KubernetesScheduler(scheduler_client(api, RELEASE_NS), settings,
                                    SchedulerSettings(url="http://127.0.0.1:9", poll_interval=0.1), state,
                                    watch_timeout=5, master_ports=(base, base + 19))
        sched.recover()
        return sched

    job = "rm"
    sched = start(tmp_path / "a")
    try:
        until(sched.operator.leading.is_set, "the scheduler leading")
        check()
        if last == "lead":
            # The informers' watches follow their lists: give them a renewal period to be refused or not.
            until(lambda: False, "every removed verb refused", timeout=10)
            return
        api.create("elasticjobs", elasticjob(job, 2, namespace=JOB_NS, max_restarts=5), JOB_NS)
        until(lambda: [p["status"]["phase"] for p in live_worker_pods(api, job, JOB_NS)] == ["Running"] * 2, "pods")
        check()
        ctl = until(lambda: sched.find(job), f"{job} known")
        until(lambda: ctl.status.phase == Phase.RUNNING, f"{job} Running")
        check()
        if STAGES.index(last) >= STAGES.index("relaunch"):
            for generation in (1, 2):
                api.fail_pod(live_worker_pods(api, job, JOB_NS)[0]["metadata"]["name"], JOB_NS)
                until(lambda g=generation: [p["metadata"]["name"] for p in live_worker_pods(api, job, JOB_NS)
                                            if p["status"].get("phase") == "Running"] == [f"{job}-g{g}-r0", f"{job}-g{g}-r1"],
                      f"generation {generation}")
                check()
    finally:
        # A controller refused a deletion waits for its pods to go before it lets the scheduler close: they go.
        api.request("DELETE", TestCluster.resource("pods").path(JOB_NS), {"gracePeriodSeconds": 0})
        sched.close()
    if last == "restart":
        sched = start(tmp_path / "b")
        try:
            until(lambda: sched.operator.leading.is_set() and sched.find(job), f"{job} resumed")
        finally:
            sched.close()


def _clean(api: TestCluster) -> None:
    """What one removal's run left: the ElasticJob (its ConfigMaps and budget go with it), its pods (at once) and
    the Lease, so that the next run starts as the first."""
    with contextlib.suppress(ApiException):
        api.delete("elasticjobs", "rm", JOB_NS)
    api.request("DELETE", TestCluster.resource("pods").path(JOB_NS), {"gracePeriodSeconds": 0})
    with contextlib.suppress(ApiException):
        api.delete("leases", "tenplex-scheduler", RELEASE_NS)
    eventually(lambda: not api.list("pods", JOB_NS) and not api.list("configmaps", JOB_NS,
                                                                      label_selector=crd.LABEL_JOB),
               "the removal run's pods and ConfigMaps gone")


def test_every_rule_of_the_chart_is_needed(api: TestCluster, agents: NodeAgents, tmp_path: Path) -> None:
    """Least privilege by what fails: with one verb of one rule of the chart's Roles and ClusterRoles taken out
    (several at once where the scenario reaches each anyway), the scheduler, as the chart's ServiceAccount, is
    refused (403 from the real authorizer) a request that verb would have allowed. Each run stops at the first
    point where every removed verb has been refused. Every verb the chart grants is in a group or in
    ``NOT_REMOVED`` with the reason."""
    docs = chart_rbac(RELEASE_NS)
    atoms = _atoms(docs)
    grouped = [a for _, g in REMOVAL_GROUPS for a in g]
    assert len(grouped) == len(set(grouped)), "a verb is removed in two groups"
    assert set(grouped) | set(NOT_REMOVED) == set(atoms), (
        f"not placed: {sorted(set(atoms) - set(grouped) - set(NOT_REMOVED))}; "
        f"not in the chart: {sorted((set(grouped) | set(NOT_REMOVED)) - set(atoms))}")
    for ns in (RELEASE_NS, JOB_NS):
        api.create_namespace(ns)
    api.add_node("gpu-a", gpus=2, address="127.0.0.2")
    api.create("pods", store_pod("gpu-a", store_daemonset(api, RELEASE_NS), namespace=RELEASE_NS), RELEASE_NS)
    api.set_pod_running("store-gpu-a", RELEASE_NS)
    agents.start("gpu-a", run_pods=True)
    scheduler_client(api, RELEASE_NS).close()  # the chart's ServiceAccount and RBAC, installed
    missed = {}
    for i, (stage, removed) in enumerate(REMOVAL_GROUPS):
        began = time.monotonic()
        _set_rules(api, docs, removed)
        api.plane.clear_accesses()
        try:
            with contextlib.suppress(Refused):
                _scenario(api, tmp_path / str(i), stage,
                          lambda r=removed: len(_refused(api, atoms, r)) == len(r))
        except AssertionError as exc:  # a wait timed out: the removal did not stop it, or it stopped it before
            LOG.info("removal %s: %s", sorted(removed), exc)
        refused = _refused(api, atoms, removed)
        LOG.info("removed %s: refused %s (%.1fs)", sorted(removed), refused, time.monotonic() - began)
        missed.update({f"{key} ({atoms[key][1]} rule {atoms[key][3]})": stage for key in removed - set(refused)})
        _set_rules(api, docs, frozenset())
        _clean(api)
    assert not missed, f"removed, yet nothing the scenario did was refused (the verb looks unneeded): {missed}"
