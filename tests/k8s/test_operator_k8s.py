"""The ElasticJob operator against the API server emulator over real HTTP.

The scheduler runs for real (job controllers, policy, layouts, state in
ConfigMaps and the ElasticJob status); no kubelet runs the pods, so the tests
play the kubelet's and node controller's part with the emulator's hooks.
Without store daemons nothing is ever committed, so a failure restarts the job
at step 0 as a new generation; tests that look at the Failed path set
``maxRestarts: 0``, so that the first failure ends the job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tenplex.errors import InvalidConfig, InvalidInput, NotLeader
from tenplex.k8s import crd
from tenplex.k8s.backend import ANNOTATION_WORKERS, LABEL_RANKS
from tenplex.k8s.jobstore import ptc_configmap, state_configmap
from tenplex.k8s.operator import (
    KubernetesScheduler,
    advertise_url,
    budget_name,
    job_spec_from_elasticjob,
)
from tenplex.k8s.settings import KubernetesSettings
from tenplex.launcher import ENV_POD_RANKS, parse_pod_ranks
from tenplex.scheduler.api import create_app
from tenplex.scheduler.controller import SchedulerSettings
from tenplex.scheduler.state import JobSpec, Phase
from tenplex.serving import BackgroundServer
from tenplex.testing.k8s.cluster import TestCluster

from .cluster import (
    NS,
    NodeAgents,
    add_gpu_node,
    assert_rbac_clean,
    elasticjob,
    eventually,
    scheduler_client,
    scheduler_user,
    worker_pods,
)


def make_scheduler(api: TestCluster, state: Path, identity: str = "sched-a", *,
                   leader_election: bool = False) -> KubernetesScheduler:
    """The scheduler as the chart deploys it: its ServiceAccount, with the chart's RBAC and nothing more."""
    settings = KubernetesSettings(namespace=NS, identity=identity, leader_election=leader_election,
                                  lease_duration_seconds=3, renew_deadline_seconds=2, retry_period_seconds=1)
    return KubernetesScheduler(scheduler_client(api), settings,
                               SchedulerSettings(url="http://127.0.0.1:9", poll_interval=0.1), state, watch_timeout=5)


@pytest.fixture
def cluster(api: TestCluster, agents: NodeAgents) -> Iterator[TestCluster]:
    add_gpu_node(api, "gpu-a", "127.0.0.2", agents=agents)
    add_gpu_node(api, "gpu-b", "127.0.0.3", agents=agents)
    yield api
    assert api.gpu_overbookings() == []
    if api.accesses(scheduler_user().name):
        assert_rbac_clean(api)


@pytest.fixture
def sched(cluster: TestCluster, tmp_path: Path) -> Iterator[KubernetesScheduler]:
    s = make_scheduler(cluster, tmp_path / "a")
    s.recover()
    try:
        yield s
    finally:
        s.close()


def job_configmaps(api: TestCluster) -> list[str]:
    """The ConfigMaps in the namespace but the one every namespace gets (``kube-root-ca.crt``)."""
    return [c["metadata"]["name"] for c in api.list("configmaps", NS) if c["metadata"]["name"] != "kube-root-ca.crt"]


def ej_status(api: TestCluster, name: str) -> dict[str, Any]:
    return api.get("elasticjobs", name, NS).get("status") or {}


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions", []) if c["type"] == kind)


def running_pods(api: TestCluster, job: str, count: int) -> list[dict[str, Any]]:
    return eventually(lambda: (pods := worker_pods(api, job)) and len(pods) == count and pods,
                      f"{count} worker pods of {job}")


def test_an_elasticjob_becomes_worker_pods_and_a_status(cluster: TestCluster,
                                                        sched: KubernetesScheduler) -> None:
    cluster.create("elasticjobs", elasticjob("gpt", 4, table=[{"gpus": 4, "dp": 2, "tp": 2, "pp": 1}]), NS)
    pods = running_pods(cluster, "gpt", 4)
    assert [(p["metadata"]["name"], p["spec"]["nodeName"]) for p in pods] == [
        ("gpt-g0-r0", "gpu-a"), ("gpt-g0-r1", "gpu-a"), ("gpt-g0-r2", "gpu-b"), ("gpt-g0-r3", "gpu-b")]
    envs = [{e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]} for p in pods]
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.2"}  # rank 0's node: the pods use the host network
    assert {e["TENPLEX_STORE_URL"] for e in envs} == {"http://127.0.0.2:7070", "http://127.0.0.3:7070"}
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert envs[0]["TENPLEX_SCHEDULER_URL"] == "http://127.0.0.1:9"

    status = eventually(lambda: (s := ej_status(cluster, "gpt")).get("phase") == "Running" and s, "status Running")
    assert status["gpus"] == 4 and status["parallel"] == {"dp": 2, "tp": 2, "pp": 1}
    assert status["selector"] == crd.worker_selector("gpt") and status["observedGeneration"] == 1
    assert condition(status, "Ready")["status"] == "True"
    assert crd.elasticjob_errors(cluster.get("elasticjobs", "gpt", NS)) == []  # the status obeys the CRD
    # The internal state and the generation's PTC are owned by the job: deleting it removes them.
    job = cluster.get("elasticjobs", "gpt", NS)
    for name in (state_configmap("gpt"), ptc_configmap("gpt", 0)):
        assert cluster.get("configmaps", name, NS)["metadata"]["ownerReferences"] == [crd.owner_reference(job)]
    cluster.delete("elasticjobs", "gpt", NS)
    eventually(lambda: not sched.list(), "the scheduler to forget the job")
    eventually(lambda: not worker_pods(cluster, "gpt") and not job_configmaps(cluster), "pods and state gone")


def test_scale_subresource_becomes_a_scale_request_once(cluster: TestCluster, sched: KubernetesScheduler) -> None:
    cluster.create("elasticjobs", elasticjob("gpt", 2), NS)
    running_pods(cluster, "gpt", 2)
    with cluster.api_client() as api_client:
        custom = client.CustomObjectsApi(api_client)
        custom.patch_namespaced_custom_object_scale(crd.GROUP, crd.VERSION, NS, crd.PLURAL, "gpt",
                                                    {"spec": {"replicas": 4}})
        ctl = sched.get("gpt")
        eventually(lambda: ctl.status.requested_gpus == 4 and ctl.status.pending_reason == "scale", "scale request")
        eventually(lambda: ej_status(cluster, "gpt").get("observedGeneration") == 2, "observedGeneration 2")
        # Back to 2 before the workers ever stepped: the request is withdrawn, and replays do not bring it back.
        custom.patch_namespaced_custom_object_scale(crd.GROUP, crd.VERSION, NS, crd.PLURAL, "gpt",
                                                    {"spec": {"replicas": 2}})
        eventually(lambda: ctl.status.requested_gpus is None and ctl.status.pending_reason is None, "withdrawn")
        cluster.expire_watches()
        eventually(lambda: sched.index.relists >= 2, "the ElasticJob relist")
        sched.operator.reconcile(cluster.get("elasticjobs", "gpt", NS))
        assert ctl.status.requested_gpus is None and ctl.status.pending_reason is None

        # Outside minGpus..maxGpus the API server itself refuses (the CRD's CEL rules).
        with pytest.raises(client.ApiException) as refused:
            custom.patch_namespaced_custom_object_scale(crd.GROUP, crd.VERSION, NS, crd.PLURAL, "gpt",
                                                        {"spec": {"replicas": 8}})
        assert refused.value.status == 422
        # 0 replicas: a suspend request (carried out once the workers train: they never do here).
        custom.patch_namespaced_custom_object_scale(crd.GROUP, crd.VERSION, NS, crd.PLURAL, "gpt",
                                                    {"spec": {"replicas": 0}})
        eventually(lambda: ctl.status.requested_gpus == 0 and ctl.status.pending_reason == "scale", "suspend request")
        cond = eventually(lambda: next((c for c in ej_status(cluster, "gpt").get("conditions", [])
                                        if c["type"] == "ScaleRejected" and c.get("observedGeneration") == 4), None),
                          "the scale request's condition")
        assert (cond["status"], cond["reason"], cond["message"]) == ("False", "Accepted", "spec.gpus 0")
    assert [w.generation for w in ctl.status.workers] == [0, 0]


def test_a_changed_spec_is_taken_persisted_and_waits_for_the_workers_to_step(cluster: TestCluster,
                                                                            sched: KubernetesScheduler) -> None:
    """An apply that changes env, maxRestarts and gpus: the job's spec is the new one (in its record in the API
    server too), a scale request and a redeploy are pending as one change (begun once the workers step: they
    never do here), and condition SpecUpdated says so. A change of the model that reaches the scheduler (a
    cluster whose CRD lacks the transition rules) is refused in the condition and changes nothing."""
    cluster.create("elasticjobs", elasticjob("gpt", 2), NS)
    running_pods(cluster, "gpt", 2)
    ctl = sched.get("gpt")
    live = cluster.get("elasticjobs", "gpt", NS)
    env = [*live["spec"]["env"], {"name": "LR", "value": "0.1"}]
    cluster.patch("elasticjobs", "gpt", {"spec": {"gpus": 4, "env": env, "training": {"maxRestarts": 5}}}, NS)
    eventually(lambda: ctl.status.redeploy_pending and ctl.status.requested_gpus == 4, "the spec change taken")
    assert ctl.spec.env["LR"] == "0.1" and ctl.spec.max_restarts == 5 and ctl.status.pending_reason == "scale"
    assert ctl.status.spec_update["fields"] == ["env", "max_restarts"]
    stored, _ = sched.jobstore.load("gpt")  # what a restarted scheduler resumes with
    assert stored.env["LR"] == "0.1" and stored.max_restarts == 5
    cond = eventually(lambda: next((c for c in ej_status(cluster, "gpt").get("conditions", [])
                                    if c["type"] == "SpecUpdated"), None), "condition SpecUpdated")
    assert (cond["status"], cond["reason"]) == ("False", "RedeployPending")
    assert cond["message"].startswith("changed env, training.maxRestarts:"), cond
    assert [w.generation for w in ctl.status.workers] == [0, 0]

    obj = cluster.get("elasticjobs", "gpt", NS)
    old_crd = {**obj, "metadata": {**obj["metadata"], "generation": obj["metadata"]["generation"] + 1},
               "spec": {**obj["spec"], "layout": {**obj["spec"]["layout"], "model": {
                   **obj["spec"]["layout"]["model"], "num_layers": 4}}}}
    sched.operator.reconcile(old_crd)
    assert ctl.spec.layout.model["num_layers"] == 2
    cond = condition(sched.jobstore.status_view("gpt", ctl.status, obj.get("status") or {}).to_dict(), "SpecUpdated")
    assert (cond["status"], cond["reason"]) == ("False", "Refused") and "spec.layout is immutable" in cond["message"]


def test_a_failed_worker_pod_before_any_snapshot_restarts_the_job_until_max_restarts(
        cluster: TestCluster, sched: KubernetesScheduler) -> None:
    cluster.create("elasticjobs", elasticjob("gpt", 2, max_restarts=1), NS)
    for pod in running_pods(cluster, "gpt", 2):
        cluster.set_pod_running(pod["metadata"]["name"], NS)
    ctl = sched.get("gpt")
    eventually(lambda: ctl.status.phase == Phase.RUNNING, "Running")
    # No version is committed anywhere yet: nothing to recover from, so the job starts again at step 0.
    cluster.fail_pod("gpt-g0-r1", NS, exit_code=139, reason="Error")
    eventually(lambda: "no snapshot yet: restarted from step 0" in ctl.status.message, "the restart")  # after the pods
    pods = eventually(lambda: (p := worker_pods(cluster, "gpt")) and all("-g1-" in x["metadata"]["name"] for x in p)
                      and len(p) == 2 and p, "the generation-1 pods alone")
    assert [p["metadata"]["name"] for p in pods] == ["gpt-g1-r0", "gpt-g1-r1"]
    assert ctl.status.phase == Phase.RUNNING and ctl.status.generation == 1 and ctl.status.step == 0
    (rec,) = ctl.status.history
    assert rec.reason == "failure" and rec.error == "worker gpt-g0-r1 exited with code 139"
    assert ctl.status.failures_without_progress == 1
    # A second failure with still no newer snapshot is over maxRestarts (1): the crash loop ends in Failed.
    for pod in pods:
        cluster.set_pod_running(pod["metadata"]["name"], NS)
    cluster.fail_pod("gpt-g1-r0", NS, exit_code=1, reason="Error")
    eventually(lambda: ctl.status.phase == Phase.FAILED, "Failed", timeout=30)
    assert ctl.status.message.startswith("giving up after 2 failures in a row without a newer snapshot "
                                         "(max_restarts 1)"), ctl.status.message
    assert "worker gpt-g1-r0 exited with code 1" in ctl.status.message
    assert worker_pods(cluster, "gpt") == []


def test_a_failed_worker_pod_triggers_failure_handling(cluster: TestCluster, sched: KubernetesScheduler) -> None:
    cluster.create("elasticjobs", elasticjob("gpt", 2, max_restarts=0), NS)
    for pod in running_pods(cluster, "gpt", 2):
        cluster.set_pod_running(pod["metadata"]["name"], NS)
    ctl = sched.get("gpt")
    cluster.fail_pod("gpt-g0-r1", NS, exit_code=139, reason="Error")
    eventually(lambda: ctl.status.phase == Phase.FAILED, "failure handling", timeout=30)
    assert "worker gpt-g0-r1 exited with code 139" in ctl.status.message
    assert worker_pods(cluster, "gpt") == []  # the survivors were stopped
    status = eventually(lambda: (s := ej_status(cluster, "gpt")).get("phase") == "Failed" and s, "status Failed")
    assert condition(status, "Failed")["status"] == "True"
    assert "gpt-g0-r1" in condition(status, "Failed")["message"]
    assert status["gpus"] == 0
    # kubectl describe shows the story as Events on the ElasticJob.
    def job_events() -> list[tuple[str, str, str]] | None:
        found = sorted((e["type"], e["reason"], e["message"]) for e in cluster.list("events", NS)
                       if e["involvedObject"]["name"] == "gpt" and e["involvedObject"]["kind"] == crd.KIND)
        return found if len(found) >= 2 else None  # the Failed event is published after the phase

    events = eventually(job_events, "both events", timeout=10)
    assert [(kind, reason) for kind, reason, _ in events] == [("Normal", "Running"), ("Warning", "Failed")]
    assert events[0][2].startswith("started in dp1 x tp2 x pp1")
    assert "worker gpt-g0-r1 exited with code 139" in events[1][2]


def test_multi_gpu_pods_and_a_failed_pod_fails_all_its_ranks(cluster: TestCluster,
                                                             sched: KubernetesScheduler) -> None:
    cluster.create("elasticjobs", elasticjob("gpt", 4, gpus_per_pod=2, table=[{"gpus": 4, "dp": 2, "tp": 2, "pp": 1}],
                                             max_restarts=0), NS)
    pods = running_pods(cluster, "gpt", 2)
    assert [(p["metadata"]["name"], p["spec"]["nodeName"], p["metadata"]["labels"][LABEL_RANKS],
             p["metadata"]["annotations"][ANNOTATION_WORKERS]) for p in pods] == [
        ("gpt-g0-r0", "gpu-a", "0-1", "gpt-g0-r0,gpt-g0-r1"), ("gpt-g0-r2", "gpu-b", "2-3", "gpt-g0-r2,gpt-g0-r3")]
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["limits"][crd.GPU_RESOURCE] == "2"
        env = {e["name"]: e.get("value") for e in container["env"]}
        first = int(pod["metadata"]["labels"]["tenplex.io/rank"])
        assert [(r.rank, r.local_rank, r.env["TENPLEX_WORKER_ID"]) for r in parse_pod_ranks(env[ENV_POD_RANKS])] == \
            [(first, 0, f"gpt-g0-r{first}"), (first + 1, 1, f"gpt-g0-r{first + 1}")]
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
        cluster.set_pod_running(pod["metadata"]["name"], NS)
    ctl = sched.get("gpt")
    eventually(lambda: ctl.status.phase == Phase.RUNNING, "Running")
    assert [(w.worker_id, w.host) for w in ctl.status.workers] == [
        ("gpt-g0-r0", "gpu-a"), ("gpt-g0-r1", "gpu-a"), ("gpt-g0-r2", "gpu-b"), ("gpt-g0-r3", "gpu-b")]
    # What the controller's poll gets from the backend once the watch has seen the pod Failed (asked from the
    # watch's own listener, so before the controller's stop of the survivors can reach the cache).
    ids = [w.worker_id for w in ctl.status.workers]
    seen: list[dict[str, int | None]] = []
    sched.kube_backend.add_listener(
        lambda e: seen.append(sched.kube_backend.exited("gpt", ids)) if e.kind == "worker-exited" else None)
    cluster.fail_pod("gpt-g0-r2", NS, exit_code=134)
    # (Later ones follow as the scheduler stops the survivors: their kubelet reports them ended, 143, before they go.)
    assert eventually(lambda: seen, "the pod's failure seen")[0] == {"gpt-g0-r2": 134, "gpt-g0-r3": 134}
    eventually(lambda: ctl.status.phase == Phase.FAILED, "failure handling", timeout=30)
    assert "worker gpt-g0-r2 exited with code 134" in ctl.status.message
    assert worker_pods(cluster, "gpt") == []  # the survivors' pod was stopped


def test_a_not_ready_node_is_a_lost_host(cluster: TestCluster, sched: KubernetesScheduler) -> None:
    cluster.create("elasticjobs", elasticjob("gpt", 4, table=[{"gpus": 4, "dp": 4, "tp": 1, "pp": 1}]), NS)
    running_pods(cluster, "gpt", 4)
    ctl = sched.get("gpt")
    eventually(lambda: ctl.status.phase == Phase.RUNNING, "Running")
    cluster.set_node_ready("gpu-b", False)
    eventually(lambda: ctl.status.phase == Phase.FAILED, "failure handling", timeout=30)
    assert "host gpu-b lost" in ctl.status.message
    assert ctl.status.history[-1].reason == "failure"


def test_a_store_pod_that_is_not_ready_is_a_lost_host(cluster: TestCluster, sched: KubernetesScheduler) -> None:
    """The store daemon of gpu-b stops answering its readiness probe: its pod stays Running but turns not Ready,
    which loses the host as a NotReady node does; the workers are stopped (no internal error on the way)."""
    cluster.create("elasticjobs", elasticjob("gpt", 4, table=[{"gpus": 4, "dp": 4, "tp": 1, "pp": 1}]), NS)
    for pod in running_pods(cluster, "gpt", 4):
        cluster.set_pod_running(pod["metadata"]["name"], NS)
    ctl = sched.get("gpt")
    eventually(lambda: ctl.status.phase == Phase.RUNNING, "Running")
    cluster.set_pod_ready("store-gpu-b", False, NS)
    eventually(lambda: ctl.status.phase == Phase.FAILED, "failure handling", timeout=30)
    assert "host gpu-b lost" in ctl.status.message and "internal error" not in ctl.status.message
    assert ctl.status.history[-1].reason == "failure"
    assert (ctl.status.history[-1].error or "").startswith("host gpu-b lost; ")  # then: nowhere to restart
    # The workers were stopped, gpu-b's included: its kubelet confirmed their end (its node is Ready).
    assert worker_pods(cluster, "gpt") == []


def test_a_drain_waits_while_the_scheduler_redeploys_off_the_node(cluster: TestCluster,
                                                                  sched: KubernetesScheduler) -> None:
    cluster.create("elasticjobs", elasticjob("gpt", 2), NS)
    for pod in running_pods(cluster, "gpt", 2):
        cluster.set_pod_running(pod["metadata"]["name"], NS)
    ctl = sched.get("gpt")
    eventually(lambda: ctl.status.phase == Phase.RUNNING, "Running")
    assert ctl.status.hosts == ["gpu-a"]
    budget = cluster.get("poddisruptionbudgets", budget_name("gpt"), NS)
    assert budget["spec"] == {"maxUnavailable": 0, "selector": {"matchLabels": crd.job_labels("gpt")}}
    assert budget["metadata"]["ownerReferences"] == [crd.owner_reference(cluster.get("elasticjobs", "gpt", NS))]

    cluster.cordon_node("gpu-b")  # not the job's node: nothing to do
    # kubectl drain: cordon, then evictions, which the budget refuses while the workers run there.
    evicted, blocked = cluster.evict_node_pods("gpu-a")
    assert evicted == [] and blocked == [f"{NS}/gpt-g0-r0", f"{NS}/gpt-g0-r1"]
    with cluster.api_client() as api_client, pytest.raises(client.ApiException) as refused:
        client.CoreV1Api(api_client).create_namespaced_pod_eviction(
            "gpt-g0-r0", NS, {"metadata": {"name": "gpt-g0-r0", "namespace": NS}})
    assert refused.value.status == 429 and "disruption budget" in refused.value.body
    # Instead the scheduler is asked to move the job off gpu-a (a planned reconfiguration: snapshot, then move).
    eventually(lambda: ctl.status.pending_reason in ("node-drain", "redeploy"), "a redeployment off gpu-a")
    # Pods that no longer run (stopped by the scheduler) are evicted at the drain's next pass.
    # (The scheduler, seeing a worker end, may stop the other one meanwhile: it is then evicted too, or gone.)
    cluster.set_pod_succeeded("gpt-g0-r0", NS)
    evicted, blocked = cluster.evict_node_pods("gpu-a")
    assert f"{NS}/gpt-g0-r0" not in blocked and set(blocked) <= {f"{NS}/gpt-g0-r1"}
    assert f"{NS}/gpt-g0-r0" in evicted or cluster.find("pods", "gpt-g0-r0", NS) is None


def test_a_redeploy_request_off_no_unschedulable_node_is_dropped(cluster: TestCluster,
                                                                  sched: KubernetesScheduler) -> None:
    """A cordon seen while the job ran on that node can reach the controller after it moved off (or after an
    uncordon): acting on it would restart the job for nothing, so the controller drops it."""
    cluster.create("elasticjobs", elasticjob("gpt", 2), NS)
    running_pods(cluster, "gpt", 2)
    ctl = sched.get("gpt")
    eventually(lambda: ctl.status.phase == Phase.RUNNING, "Running")
    ctl.request_redeploy("node-drain")  # late: no node of the job is cordoned
    eventually(lambda: ctl.status.pending_reason is None, "the stale request dropped")
    assert ctl.status.phase == Phase.RUNNING and ctl.status.history == []
    cluster.cordon_node("gpu-a")  # a real one stays until acted on
    eventually(lambda: ctl.status.pending_reason in ("node-drain", "redeploy"), "a redeployment off gpu-a")


def job_state(sched: KubernetesScheduler, job: str) -> str:
    """What a failure message should show of a job: its controller's record and the worker pods as cached."""
    st = sched.get(job).status
    pods = [(p["metadata"]["name"], (p.get("status") or {}).get("phase"), bool(p["metadata"].get("deletionTimestamp")))
            for p in sched.kube_backend.job_pods(job)]
    return (f"job {job}: {st.phase.value}{f'/{st.stage.value}' if st.stage else ''} ({st.message!r}), requested "
            f"{st.requested_gpus} ({st.pending_reason}), workers {[w.worker_id for w in st.workers]}; cached pods "
            f"(name, phase, terminating): {sorted(pods)}; relists: elasticjobs {sched.index.relists}, pods "
            f"{[p.relists for p in sched.kube_backend.pods]}")


def test_expired_watches_do_not_lose_events(cluster: TestCluster, sched: KubernetesScheduler) -> None:
    """A running job's ElasticJob changes and one of its pods fails while no watch can resume (kube-apiserver
    restarted, etcd's history compacted: 410 Gone): both are seen through the informers' lists."""
    cluster.create("elasticjobs", elasticjob("gpt", 2, max_restarts=0), NS)
    running_pods(cluster, "gpt", 2)
    ctl = sched.get("gpt")
    # Running first: a start cut short by the restart is another test's subject (a first launch cut short).
    eventually(lambda: ctl.status.phase == Phase.RUNNING, "Running", detail=lambda: job_state(sched, "gpt"))
    eventually(lambda: cluster.open_watches() >= 5, "the operator's watches (and the two kubelets')")
    cluster.expire_watches()
    cluster.patch("elasticjobs", "gpt", {"spec": {"gpus": 3}}, NS)
    cluster.fail_pod("gpt-g0-r0", NS)
    eventually(lambda: ctl.status.phase == Phase.FAILED and ctl.status, "the failure seen through a relist", timeout=120,
               detail=lambda: job_state(sched, "gpt"))
    assert "gpt-g0-r0" in ctl.status.message
    eventually(lambda: sched.index.relists >= 2 and all(p.relists >= 2 for p in sched.kube_backend.pods),
               "every watch listed again", timeout=60, detail=lambda: job_state(sched, "gpt"))


def refuse_pod_creation(api: TestCluster, pod: str) -> str:
    """Have the API server answer the creation of pod ``pod`` with 500, as a restarting or overloaded server may:
    a validating webhook, for that name alone, at an address where nothing listens, with failurePolicy Fail.
    Returns the webhook configuration's name (deleting it lets the pod be created)."""
    name = f"refuse-{pod}"
    api.create("validatingwebhookconfigurations", {"metadata": {"name": name}, "webhooks": [{
        "name": "refuse.tenplex.test", "admissionReviewVersions": ["v1"], "sideEffects": "None",
        "failurePolicy": "Fail", "timeoutSeconds": 1, "clientConfig": {"url": "https://127.0.0.1:9/refuse"},
        "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}],
        "matchConditions": [{"name": "this-pod", "expression": f"object.metadata.name == '{pod}'"}]}]})
    probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "namespace": NS},
             "spec": {"containers": [{"name": "c", "image": "none"}]}}

    def refused() -> bool:  # the server applies the webhook once its informer has it
        try:
            api.request("POST", TestCluster.resource("pods").path(NS), probe, query={"dryRun": "All"})
        except client.ApiException as exc:
            return exc.status == 500
        return False

    eventually(refused, f"the API server to refuse pod {pod} with 500")
    return name


def test_a_first_launch_cut_short_is_finished_as_decided(cluster: TestCluster, sched: KubernetesScheduler) -> None:
    """The API server fails the job's first start halfway (its first pod made, the second answered 500), and
    keeps failing it while the ElasticJob asks for 3 GPUs. The controller retries the launch it began, as it
    decided it (configuration, placement, one rendezvous for every rank): deciding again would see its own pod's
    GPU as taken and the new request, and could wait Pending with that pod unwatched, or adopt it into another
    layout. The request is acted on once the job runs, and a worker's failure is seen."""
    webhook = refuse_pod_creation(cluster, "gpt-g0-r1")
    cluster.create("elasticjobs", elasticjob("gpt", 2, max_restarts=0), NS)
    ctl = eventually(lambda: sched.list() and sched.get("gpt"), "the job's controller")
    eventually(lambda: [p["metadata"]["name"] for p in worker_pods(cluster, "gpt")] == ["gpt-g0-r0"]
               and [w.worker_id for w in ctl.status.workers] == ["gpt-g0-r0", "gpt-g0-r1"], "the launch cut short")
    cluster.patch("elasticjobs", "gpt", {"spec": {"gpus": 3}}, NS)
    eventually(lambda: ctl.status.requested_gpus == 3, "the scale request")
    assert ctl.status.phase == Phase.PENDING, ctl.status.message  # the 500s are retried, not the job's failure
    cluster.delete("validatingwebhookconfigurations", webhook)

    eventually(lambda: ctl.status.phase != Phase.PENDING, "the launch finished", timeout=60,
               detail=lambda: job_state(sched, "gpt"))
    assert (ctl.status.gpus, ctl.status.hosts, ctl.status.generation) == (2, ["gpu-a"], 0), ctl.status.message
    assert [(w.worker_id, w.host) for w in ctl.status.workers] == [("gpt-g0-r0", "gpu-a"), ("gpt-g0-r1", "gpu-a")]
    pods = running_pods(cluster, "gpt", 2)
    assert [(p["metadata"]["name"], p["spec"]["nodeName"]) for p in pods] == [("gpt-g0-r0", "gpu-a"),
                                                                             ("gpt-g0-r1", "gpu-a")]
    envs = [{e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]} for p in pods]
    assert [(e["RANK"], e["WORLD_SIZE"], e["MASTER_PORT"]) for e in envs] == [
        ("0", "2", str(ctl.status.master_port)), ("1", "2", str(ctl.status.master_port))]
    assert ctl.status.requested_gpus == 3 or ctl.status.history, "the request is kept for the running job"
    cluster.fail_pod("gpt-g0-r0", NS)
    eventually(lambda: ctl.status.phase == Phase.FAILED, "the failure seen", timeout=60,
               detail=lambda: job_state(sched, "gpt"))
    assert "gpt-g0-r0" in ctl.status.message


def test_a_restarted_scheduler_resumes_the_job_from_the_api_server(cluster: TestCluster, tmp_path: Path) -> None:
    first = make_scheduler(cluster, tmp_path / "a")
    first.recover()
    cluster.create("elasticjobs", elasticjob("gpt", 2), NS)
    pods = running_pods(cluster, "gpt", 2)
    eventually(lambda: first.get("gpt").status.phase == Phase.RUNNING, "Running")
    uids = [p["metadata"]["uid"] for p in pods]
    first.close()

    second = make_scheduler(cluster, tmp_path / "b", identity="sched-b")
    second.recover()
    try:
        ctl = eventually(lambda: second.list() and second.get("gpt"), "the job resumed")
        assert ctl.status.phase == Phase.RUNNING and ctl.status.generation == 0
        assert [w.worker_id for w in ctl.status.workers] == ["gpt-g0-r0", "gpt-g0-r1"]
        assert ctl.ptc(0).hosts == ("gpu-a",)
        assert [p["metadata"]["uid"] for p in worker_pods(cluster, "gpt")] == uids  # adopted, not relaunched
        cluster.fail_pod("gpt-g0-r0", NS)
        # Acting: nothing was snapshotted yet, so the job starts again at step 0 as generation 1.
        eventually(lambda: [p["metadata"]["name"] for p in worker_pods(cluster, "gpt")] == ["gpt-g1-r0", "gpt-g1-r1"],
                   "the resumed controller acting")
        assert ctl.status.history[-1].reason == "failure" and "gpt-g0-r0" in (ctl.status.history[-1].error or "")
    finally:
        second.close()


def test_bad_and_duplicate_elasticjobs_are_refused_in_their_status(cluster: TestCluster,
                                                                   sched: KubernetesScheduler) -> None:
    cluster.create("elasticjobs", elasticjob("untrained", 2, training=False), NS)
    status = eventually(lambda: (s := ej_status(cluster, "untrained")).get("phase") == "Failed" and s, "refusal")
    cond = condition(status, "Failed")
    assert cond["reason"] == "InvalidSpec" and "spec.training" in cond["message"]
    assert not worker_pods(cluster, "untrained")

    cluster.create("elasticjobs", elasticjob("gpt", 2), NS)
    running_pods(cluster, "gpt", 2)
    cluster.create_namespace("other")
    cluster.create("elasticjobs", elasticjob("gpt", 2, namespace="other"), "other")
    other = eventually(lambda: (cluster.get("elasticjobs", "gpt", "other").get("status") or {}).get("phase") == "Failed"
                       and cluster.get("elasticjobs", "gpt", "other")["status"], "duplicate refused")
    assert "already used by the ElasticJob in namespace default" in condition(other, "Failed")["message"]
    assert [p["metadata"]["namespace"] for p in cluster.list("pods", label_selector=crd.worker_selector("gpt"))] == \
        [NS, NS]
    # Deleting the refused duplicate leaves the real job alone.
    cluster.delete("elasticjobs", "gpt", "other")
    with pytest.raises(AssertionError):
        eventually(lambda: not sched.list() or sched.get("gpt") is None, "the job to vanish", timeout=1.0)

    # Jobs are ElasticJobs on Kubernetes: the REST API cannot create one without it.
    spec = job_spec_from_elasticjob(cluster.get("elasticjobs", "gpt", NS))
    with pytest.raises(InvalidConfig, match="submit one with kubectl apply"):
        sched.create(JobSpec.from_json({**spec.to_json(), "name": "rest-made"}))


def test_advertised_url_is_the_scheduler_service() -> None:
    settings = KubernetesSettings(namespace="tenplex", identity="rel-tenplex-scheduler-5d9c7b6f4-x2x7q")
    assert advertise_url(settings, 8080, "http://127.0.0.1:8080") == "http://rel-tenplex-scheduler.tenplex.svc:8080"
    told = KubernetesSettings.from_env({"POD_NAMESPACE": "tenplex", "POD_NAME": "laptop",
                                        "TENPLEX_ADVERTISE_URL": "http://sched:1/"})
    assert advertise_url(told, 8080, "x") == "http://sched:1"
    odd = KubernetesSettings(namespace="tenplex", identity="laptop")
    assert advertise_url(odd, 8080, "http://127.0.0.1:8080") == "http://127.0.0.1:8080"


@pytest.mark.slow
def test_only_the_lease_holder_acts_and_a_follower_takes_over(cluster: TestCluster, tmp_path: Path) -> None:
    a = make_scheduler(cluster, tmp_path / "a", "sched-a", leader_election=True)
    a.recover()
    assert a.operator.leading.wait(15), "sched-a never led"
    b = make_scheduler(cluster, tmp_path / "b", "sched-b", leader_election=True)
    b.recover()
    try:
        cluster.create("elasticjobs", elasticjob("gpt", 2), NS)
        pods = running_pods(cluster, "gpt", 2)
        assert not b.operator.leading.wait(3) and b.list() == []  # the follower stays idle
        # Workers that reach the follower (the Service spreads requests) are told to retry, not that the job is gone.
        with pytest.raises(NotLeader, match="sched-b does not lead"):
            b.get("gpt")
        server = BackgroundServer(create_app(b, token=None)).start()
        try:
            with urllib.request.urlopen(f"{server.url}/v1/jobs/gpt", timeout=10) as resp:
                raise AssertionError(f"the follower answered {resp.status}")
        except urllib.error.HTTPError as exc:
            assert exc.code == 503 and json.loads(exc.read())["error"] == "not_leader"
        finally:
            server.stop()
        assert cluster.get("leases", crd.LEADER_LEASE, NS)["spec"]["holderIdentity"] == "sched-a"
        a.close()  # stops renewing; b takes the lease after it expires and resumes the job
        assert b.operator.leading.wait(20), "sched-b never took over"
        ctl = eventually(lambda: b.list() and b.get("gpt"), "the job resumed by sched-b")
        assert ctl.status.phase == Phase.RUNNING
        assert [p["metadata"]["uid"] for p in worker_pods(cluster, "gpt")] == [p["metadata"]["uid"] for p in pods]
        assert cluster.get("leases", crd.LEADER_LEASE, NS)["spec"]["holderIdentity"] == "sched-b"
    finally:
        b.close()
        a.close()


@pytest.mark.slow
def test_scheduler_serve_with_the_kubernetes_backend(cluster: TestCluster, tmp_path: Path) -> None:
    """The chart's command line, run as a process against the emulator: it leads, runs the job, and exits when it
    loses the Lease (Kubernetes then restarts it as a follower)."""
    kubeconfig = tmp_path / "kubeconfig"
    scheduler_client(cluster).close()  # the chart's RBAC, installed
    kubeconfig.write_text(yaml.safe_dump(cluster.kubeconfig(scheduler_user())))
    port_file = tmp_path / "port"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "POD_NAME": "tenplex-scheduler-5d9c7b6f4-x2x7q",
           "POD_NAMESPACE": NS, "TENPLEX_LEASE_DURATION_SECONDS": "3", "TENPLEX_RENEW_DEADLINE_SECONDS": "2",
           "TENPLEX_RETRY_PERIOD_SECONDS": "1", "TENPLEX_TOKEN": "t0k3n"}
    env.pop("TENPLEX_ADVERTISE_URL", None)
    cluster.create("elasticjobs", elasticjob("gpt", 2), NS)
    log = tmp_path / "scheduler.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tenplex", "scheduler", "serve", "--backend", "kubernetes",
                                 "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
                                 "--state-dir", str(tmp_path / "state")], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        pods = eventually(lambda: proc.poll() is None and len(worker_pods(cluster, "gpt")) == 2
                          and worker_pods(cluster, "gpt"), "the job's pods", timeout=90)
        port = int(port_file.read_text())
        env_of = {e["name"]: e.get("value") for e in pods[0]["spec"]["containers"][0]["env"]}
        assert env_of["TENPLEX_SCHEDULER_URL"] == f"http://tenplex-scheduler.{NS}.svc:{port}"
        assert cluster.get("leases", crd.LEADER_LEASE, NS)["spec"]["holderIdentity"] == env["POD_NAME"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as resp:
            assert resp.status == 200
        # Another replica holds the Lease now (as after a partition): this one must stop acting and exit.
        cluster.patch("leases", crd.LEADER_LEASE, {"spec": {"holderIdentity": "intruder", "leaseDurationSeconds": 60,
                                                            "renewTime": datetime.now(UTC).strftime(
                                                                "%Y-%m-%dT%H:%M:%S.%fZ")}}, NS)
        assert proc.wait(timeout=30) == 1
        assert "lost the Lease" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_job_spec_follows_the_elasticjob() -> None:
    obj = elasticjob("gpt", 4, table=[{"gpus": 4, "dp": 2, "tp": 2, "pp": 1}, {"gpus": 2, "dp": 1, "tp": 2, "pp": 1}],
                     env=[{"name": "A", "value": "1"},
                          {"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}])
    obj["spec"]["args"] = ["--steps", "5"]
    obj["spec"]["policy"]["zero"] = 1
    spec = job_spec_from_elasticjob(obj)
    assert spec.command == ("python", "-m", "examples.gpt.train", "--steps", "5")
    assert (spec.gpus, spec.min_gpus, spec.max_gpus, spec.steps, spec.snapshot_every) == (4, 1, 4, 1000, 10)
    assert spec.heartbeat_timeout == 120.0 and spec.image == "tenplex:test"
    assert dict(spec.env) == {"A": "1"}  # Secret and downward-API entries go into the pod spec as they are
    assert (spec.dataset.num_samples, spec.dataset.global_batch_size, spec.dataset.seed) == (4096, 8, 0)
    assert {g: c.describe() for g, c in spec.policy.table.items()} == {4: "dp2 x tp2 x pp1", 2: "dp1 x tp2 x pp1"}
    assert spec.policy.zero == 1 and spec.layout.provider == "megatron-gpt"
    with pytest.raises(InvalidInput, match="gpus must be a multiple of gpusPerPod"):
        job_spec_from_elasticjob({**obj, "spec": {**obj["spec"], "gpusPerPod": 3}})


def test_the_chart_names_the_service_like_the_deployment() -> None:
    """advertise_url derives the scheduler Service from the pod name: the chart must keep the two names equal."""
    from .test_k8s_chart import one, render

    docs = render()
    deployment = one(docs, "Deployment")
    service = one(docs, "Service", deployment["metadata"]["name"])
    assert deployment["metadata"]["name"] == service["metadata"]["name"] == "rel-tenplex-scheduler"
    settings = KubernetesSettings(namespace="tenplex", identity=f"{deployment['metadata']['name']}-7f9c6d5b8-q4x2z")
    port = service["spec"]["ports"][0]["port"]
    assert advertise_url(settings, port, "unused") == f"http://rel-tenplex-scheduler.tenplex.svc:{port}"
    # The chart says it outright, too: the Service's name and port, which is what the workers reach.
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TENPLEX_ADVERTISE_URL"] == f"http://{service['metadata']['name']}.tenplex.svc:{port}"


def test_pods_of_two_gpus_on_nodes_of_three_use_two_gpus_of_each(api: TestCluster, agents: NodeAgents,
                                                                  tmp_path: Path) -> None:
    """A node's GPUs count in whole pods: 3 GPUs hold one 2-GPU pod, so 4 GPUs take two nodes, 2 ranks each."""
    add_gpu_node(api, "gpu-a", "127.0.0.2", gpus=3, agents=agents)
    add_gpu_node(api, "gpu-b", "127.0.0.3", gpus=3, agents=agents)
    sched = make_scheduler(api, tmp_path / "a")
    sched.recover()
    try:
        api.create("elasticjobs", elasticjob("gpt", 4, gpus_per_pod=2, max_gpus=6,
                                             table=[{"gpus": 4, "dp": 2, "tp": 2, "pp": 1}]), NS)
        pods = running_pods(api, "gpt", 2)
        assert [(p["metadata"]["name"], p["spec"]["nodeName"], p["metadata"]["labels"][LABEL_RANKS]) for p in pods] == [
            ("gpt-g0-r0", "gpu-a", "0-1"), ("gpt-g0-r2", "gpu-b", "2-3")]
        ctl = sched.get("gpt")
        assert ctl.status.gpus_per_node == 2 and ctl.spec.gpus_per_pod == 2
        # A count that is not whole pods is refused with the reason.
        with pytest.raises(InvalidConfig, match="multiple of gpus_per_pod 2"):
            ctl.request_scale(5)
    finally:
        sched.close()


def test_a_job_suspended_before_it_started_starts_at_step_0_when_scaled_up(api: TestCluster, agents: NodeAgents,
                                                                          tmp_path: Path) -> None:
    sched = make_scheduler(api, tmp_path / "a")
    sched.recover()
    try:
        api.create("elasticjobs", elasticjob("gpt", 2), NS)  # no GPU node yet: Pending
        ctl = eventually(lambda: sched.list() and sched.get("gpt"), "the job")
        eventually(lambda: ctl.status.phase == Phase.PENDING and "waiting" in ctl.status.message, "waiting for GPUs")
        with api.api_client() as api_client:
            custom = client.CustomObjectsApi(api_client)
            custom.patch_namespaced_custom_object_scale(crd.GROUP, crd.VERSION, NS, crd.PLURAL, "gpt",
                                                        {"spec": {"replicas": 0}})
            eventually(lambda: ctl.status.phase == Phase.SUSPENDED, "Suspended")
            assert ctl.status.message == "suspended before its first snapshot: a scale up starts it at step 0"
            status = eventually(lambda: (s := ej_status(api, "gpt")).get("phase") == "Suspended" and s, "status")
            assert status["gpus"] == 0 and condition(status, "Ready")["reason"] == "Suspended"
            add_gpu_node(api, "gpu-a", "127.0.0.2", agents=agents)
            assert ctl.status.phase == Phase.SUSPENDED and worker_pods(api, "gpt") == []
            custom.patch_namespaced_custom_object_scale(crd.GROUP, crd.VERSION, NS, crd.PLURAL, "gpt",
                                                        {"spec": {"replicas": 2}})
            pods = running_pods(api, "gpt", 2)
        assert [p["metadata"]["name"] for p in pods] == ["gpt-g0-r0", "gpt-g0-r1"]
        eventually(lambda: ctl.status.phase == Phase.RUNNING and ctl.status.gpus == 2, "Running on 2 GPUs")
    finally:
        sched.close()


def test_a_failure_while_suspending_still_ends_suspended(cluster: TestCluster, sched: KubernetesScheduler) -> None:
    from tenplex.core.protocol import HeartbeatRequest, RegisterRequest

    cluster.create("elasticjobs", elasticjob("gpt", 2), NS)
    for pod in running_pods(cluster, "gpt", 2):
        cluster.set_pod_running(pod["metadata"]["name"], NS)
    ctl = sched.get("gpt")
    eventually(lambda: ctl.status.phase == Phase.RUNNING, "Running")
    for wid in ("gpt-g0-r0", "gpt-g0-r1"):  # what the workers' REST calls do: they train
        ctl.register(RegisterRequest(worker_id=wid))
        ctl.heartbeat(wid, HeartbeatRequest(generation=0, step=5))
    ctl.request_scale(0)
    eventually(lambda: ctl.status.phase == Phase.RECONFIGURING and ctl.status.stage is not None
               and ctl.status.stage.value == "stopping", "stopping for the suspend")
    assert ctl.status.history[-1].reason == "suspend" and ctl.status.stop_at_step is not None
    cluster.fail_pod("gpt-g0-r1", NS, exit_code=139, reason="Error")  # dies before its stop snapshot
    # Nothing was ever committed (no stores here): nothing to restart from or to keep, and no restart wanted.
    eventually(lambda: ctl.status.phase == Phase.SUSPENDED, "Suspended despite the failure", timeout=30)
    assert ctl.status.gpus == 0 and ctl.status.workers == [] and ctl.status.version is None
    eventually(lambda: worker_pods(cluster, "gpt") == [], "no worker pods")
    suspend, failure = ctl.status.history
    assert suspend.reason == "suspend" and failure.reason == "failure" and failure.to_gpus == 0
    # The suspend record is closed, saying what ended it.
    assert suspend.finished_at is not None and suspend.error.startswith("interrupted by a failure: workers exited")
    assert "gpt-g0-r1" in suspend.error
    wanted = {("Warning", "ReconfigurationInterrupted"), ("Normal", "Suspended")}
    eventually(lambda: wanted <= {(e["type"], e["reason"]) for e in cluster.list("events", NS)
                                  if e["involvedObject"]["name"] == "gpt"}, "the interruption and the suspend as Events")
    assert "gpt-g0-r1" in (failure.error or "")


def test_an_elasticjob_being_deleted_stops_its_job_and_makes_no_more_pods(
        cluster: TestCluster, sched: KubernetesScheduler) -> None:
    """An ElasticJob that is being deleted (a finalizer of another controller holds it, or ``kubectl delete
    --cascade=foreground`` waits for its pods) is the end of the job for the scheduler, not a failure to recover
    from with new pods that its deletion would then have to wait for."""
    cluster.create("elasticjobs", elasticjob("gpt", 2), NS)
    for pod in running_pods(cluster, "gpt", 2):
        cluster.set_pod_running(pod["metadata"]["name"], NS)
    ctl = sched.get("gpt")
    eventually(lambda: ctl.status.phase == Phase.RUNNING, "Running")
    cluster.patch("elasticjobs", "gpt", {"metadata": {"finalizers": ["example.com/audit"]}}, NS)
    cluster.delete("elasticjobs", "gpt", NS, propagation="Foreground")
    assert cluster.get("elasticjobs", "gpt", NS)["metadata"]["finalizers"] == ["example.com/audit", "foregroundDeletion"]
    eventually(lambda: not sched.list(), "the job stopped")
    eventually(lambda: worker_pods(cluster, "gpt") == [], "its pods gone")
    time.sleep(3)  # long enough for a failure recovery to have made new pods
    creates = [a for a in cluster.accesses(scheduler_user().name) if a.verb == "create" and a.resource == "pods"]
    assert len(creates) == 2 and worker_pods(cluster, "gpt") == []
    assert cluster.get("elasticjobs", "gpt", NS)["metadata"]["deletionTimestamp"]
    kept = [f for f in cluster.get("elasticjobs", "gpt", NS)["metadata"].get("finalizers", []) if f != "example.com/audit"]
    cluster.patch("elasticjobs", "gpt", {"metadata": {"finalizers": kept or None}}, NS)  # the other controller is done
    eventually(lambda: cluster.find("elasticjobs", "gpt", NS) is None, "the ElasticJob gone")
    eventually(lambda: job_configmaps(cluster) == [], "its state collected")


def test_a_namespace_that_forbids_host_networking_fails_the_job_saying_why(
        api: TestCluster, agents: NodeAgents, tmp_path: Path) -> None:
    """Worker pods use the host network (and hostPath for the node's store): PodSecurity level baseline or
    restricted refuses them. The job fails with the API server's reason in its status."""
    add_gpu_node(api, "gpu-a", "127.0.0.2", agents=agents)
    api.create_namespace("locked", {"pod-security.kubernetes.io/enforce": "baseline"})
    sched = make_scheduler(api, tmp_path / "a")
    sched.recover()
    try:
        api.create("elasticjobs", elasticjob("gpt", 2, namespace="locked"), "locked")
        status = eventually(lambda: (s := api.get("elasticjobs", "gpt", "locked").get("status") or {})
                            .get("phase") == "Failed" and s, "the job failed", timeout=30)
        message = condition(status, "Failed")["message"]
        assert 'violates PodSecurity "baseline:latest": host namespaces (hostNetwork=true)' in message, message
        assert api.list("pods", "locked") == []
    finally:
        sched.close()
