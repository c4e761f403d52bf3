"""KubernetesBackend against the API server emulator over real HTTP: hosts, worker pods, exits, watches."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tenplex.errors import Conflict, InvalidConfig, InvalidInput, NotFound
from tenplex.k8s import crd
from tenplex.k8s.backend import (
    ANNOTATION_MASTER_PORT,
    ANNOTATION_STANDBY_PORT,
    ANNOTATION_TEMPLATE,
    ANNOTATION_WORKERS,
    LABEL_RANKS,
    LABEL_STANDBY,
    ClusterEvent,
    KubernetesBackend,
    pod_groups,
    template_digest,
)
from tenplex.k8s.settings import KubernetesSettings
from tenplex.launcher import ENV_POD_RANKS, parse_pod_ranks
from tenplex.scheduler.backend import HostInfo, WorkerLaunch
from tenplex.testing.k8s.cluster import TestCluster

from .cluster import (
    NS,
    NodeAgents,
    add_gpu_node,
    assert_rbac_clean,
    elasticjob,
    eventually,
    scheduler_client,
    store_daemonset,
    store_pod,
    worker_pods,
)

SETTINGS = KubernetesSettings(namespace=NS, identity="test", leader_election=False, auth_secret="tenplex-auth")


@pytest.fixture
def backend(api: TestCluster, agents: NodeAgents) -> Iterator[KubernetesBackend]:
    add_gpu_node(api, "gpu-a", "127.0.0.2", agents=agents)
    add_gpu_node(api, "gpu-b", "127.0.0.3", port=7171, agents=agents)
    api.add_node("cpu-only", gpus=0, address="127.0.0.9")
    api.create("elasticjobs", elasticjob("gpt", 2), NS)
    with scheduler_client(api) as api_client:
        be = KubernetesBackend(api_client, SETTINGS, lambda name: api.get("elasticjobs", name, NS),
                               master_ports=(29500, 29502), watch_timeout=5, stop_margin=2.0).start()
        try:
            yield be
        finally:
            be.close()
    assert api.gpu_overbookings() == []
    assert_rbac_clean(api)


def launches(job: str, generation: int, hosts: list[str], env: dict[str, str] | None = None) -> list[WorkerLaunch]:
    return [WorkerLaunch(f"{job}-g{generation}-r{rank}", rank, host, 0,
                         {"RANK": str(rank), "MASTER_ADDR": "127.0.0.2", "MASTER_PORT": "29500", "LOCAL_RANK": "1",
                          "LOCAL_WORLD_SIZE": "2", "TENPLEX_TOKEN": "s3cret",
                          "TENPLEX_GENERATION": str(generation), **(env or {})})
            for rank, host in enumerate(hosts)]


def test_cordon_comes_from_the_cluster_not_from_the_schedulers_api(backend: KubernetesBackend) -> None:
    with pytest.raises(InvalidInput, match="kubernetes backend takes cordon from the cluster itself"):
        backend.set_schedulable("gpu-a", False)
    assert backend.host("gpu-a").schedulable


def test_hosts_are_gpu_nodes_with_a_running_store(api: TestCluster, backend: KubernetesBackend) -> None:
    hosts = backend.hosts()
    assert hosts == [
        HostInfo("gpu-a", 2, "http://127.0.0.2:7070", "127.0.0.2", ready=True, schedulable=True),
        HostInfo("gpu-b", 2, "http://127.0.0.3:7171", "127.0.0.3", ready=True, schedulable=True),
    ]
    api.cordon_node("gpu-a")
    eventually(lambda: not backend.host("gpu-a").schedulable, "gpu-a unschedulable")
    assert backend.host("gpu-a").ready
    api.set_node_ready("gpu-b", False)
    eventually(lambda: not backend.host("gpu-b").ready, "gpu-b NotReady")

    # A node whose store pod is not Running is not usable; one that disappears stays known, as lost.
    add_gpu_node(api, "gpu-c", "127.0.0.4", store_running=False)
    eventually(lambda: any(h.name == "gpu-c" for h in backend.hosts()), "gpu-c listed")
    assert not backend.host("gpu-c").ready
    api.delete("nodes", "gpu-c")
    eventually(lambda: backend.host("gpu-c").schedulable is False, "gpu-c lost")
    assert not backend.host("gpu-c").ready
    with pytest.raises(NotFound, match="cpu-only"):
        backend.host("cpu-only")


def test_a_host_whose_store_pod_is_not_ready_is_lost_until_it_is_ready_again(api: TestCluster,
                                                                             backend: KubernetesBackend) -> None:
    """A store daemon that stops answering its readiness probe while its pod stays Running: its kubelet reports
    the pod not Ready, and the host is lost (not ready) until the pod is Ready again."""
    events: list[ClusterEvent] = []
    backend.add_listener(events.append)
    api.set_pod_ready("store-gpu-b", False, NS)
    eventually(lambda: not backend.host("gpu-b").ready, "gpu-b lost")
    assert api.get("pods", "store-gpu-b", NS)["status"]["phase"] == "Running"
    assert backend.host("gpu-a").ready and backend.host("gpu-b").schedulable

    def store_events() -> list[tuple[str, str | None, str]]:
        """gpu-b's store pod events (a "node-changed" of its Node object, e.g. an earlier test's update that the
        watch delivers late, is another stream and says nothing of the store)."""
        return [(e.kind, e.node, e.detail) for e in events if e.node == "gpu-b" and e.kind.startswith("store-")]

    assert store_events() == [
        ("store-lost", "gpu-b", "store pod store-gpu-b of node gpu-b is not Ready (its daemon does not answer its "
                                "readiness probe)")]
    api.set_pod_ready("store-gpu-b", True, NS)
    eventually(lambda: backend.host("gpu-b").ready, "gpu-b ready again")
    assert [(kind, detail) for kind, _node, detail in store_events()][1:] == [
        ("store-changed", "store pod store-gpu-b: MODIFIED Running, Ready")]

    # A store pod that is being deleted is not usable either (a DaemonSet's rolling update).
    api.delete("pods", "store-gpu-a", NS)
    eventually(lambda: not backend.host("gpu-a").ready, "gpu-a lost while its store pod is deleted")
    assert ("store-lost", "gpu-a") in [(e.kind, e.node) for e in events]


def test_a_standby_pod_runs_the_standby_on_a_port_no_other_pod_of_its_node_takes(
        api: TestCluster, backend: KubernetesBackend, tmp_path: Path) -> None:
    api.patch("elasticjobs", "gpt", {"spec": {"standby": True}}, NS)
    backend.launch("gpt", ["python", "-m", "examples.gpt.train"], launches("gpt", 0, ["gpu-a"]), tmp_path)
    (pod,) = eventually(lambda: worker_pods(api, "gpt"), "the standby pod")
    meta, (container,) = pod["metadata"], pod["spec"]["containers"]
    port = int(meta["annotations"][ANNOTATION_STANDBY_PORT])
    # 29500 is rank 0's rendezvous (announced by the same pod): the standby takes the next free port
    assert (port, meta["annotations"][ANNOTATION_MASTER_PORT]) == (29501, "29500")
    assert container["command"] == ["python", "-m", "tenplex", "worker", "standby", "--port", "29501", "--",
                                    "python", "-m", "examples.gpt.train"]
    # (with the host network, the API server defaults hostPort to the containerPort)
    assert container["ports"] == [{"name": "standby", "containerPort": 29501, "hostPort": 29501, "protocol": "TCP"}]
    assert meta["labels"][LABEL_STANDBY] == "true" and meta["annotations"][ANNOTATION_WORKERS] == "gpt-g0-r0"
    # The pod is the job's: its GPU counts as free to the job's next placement, and the third port of the
    # range is all the node has left.
    assert backend.gpus_held_by("gpt", []) == {"gpu-a": 1}
    assert backend.master_port(backend.host("gpu-a")) == 29502
    with pytest.raises(InvalidConfig, match="no free port on node gpu-a"):
        backend.master_port(backend.host("gpu-a"))
    # Its standby does not answer (nothing runs behind this test's pods): a stop deletes the pod instead.
    assert backend.standby_ready("gpt") == 0 and backend.keep_standby("gpt", ["python"], {}, tmp_path) == 1
    backend.stop("gpt", ["gpt-g0-r0"], grace=1)
    assert worker_pods(api, "gpt") == []


def test_worker_pods_are_pinned_owned_and_get_the_worker_environment(api: TestCluster,
                                                                     backend: KubernetesBackend, tmp_path: Path) -> None:
    ids_command = ["python", "-m", "examples.gpt.train", "--steps", "5"]
    ids = backend.launch("gpt", ids_command, launches("gpt", 0, ["gpu-a", "gpu-b"]), tmp_path)
    assert ids == {"gpt-g0-r0": None, "gpt-g0-r1": None}
    pods = worker_pods(api, "gpt")
    assert [p["metadata"]["name"] for p in pods] == ["gpt-g0-r0", "gpt-g0-r1"]
    job = api.get("elasticjobs", "gpt", NS)
    r0, r1 = pods
    assert r0["spec"]["nodeName"] == "gpu-a" and r1["spec"]["nodeName"] == "gpu-b"
    assert r0["spec"]["hostNetwork"] is True and r0["spec"]["restartPolicy"] == "Never"
    assert r0["metadata"]["ownerReferences"] == [crd.owner_reference(job)]
    assert r0["metadata"]["labels"] == {**crd.job_labels("gpt"), "tenplex.io/generation": "0", "tenplex.io/rank": "0"}
    # The pods of one spec carry one digest of it (a standby pod of another was made for an older spec).
    digest = template_digest(crd.parse_spec(job), ids_command)
    assert r0["metadata"]["annotations"] == {ANNOTATION_MASTER_PORT: "29500", ANNOTATION_TEMPLATE: digest}
    assert r1["metadata"]["annotations"] == {ANNOTATION_TEMPLATE: digest}
    changed = crd.parse_spec({**job, "spec": {**job["spec"], "env": [{"name": "X", "value": "1"}]}})
    assert template_digest(changed, ids_command) != digest
    (container,) = r0["spec"]["containers"]
    assert container["image"] == "tenplex:test"
    assert container["command"] == ["python", "-m", "examples.gpt.train", "--steps", "5"]
    assert container["resources"]["limits"][crd.GPU_RESOURCE] == "1"
    assert container["resources"]["requests"][crd.GPU_RESOURCE] == "1"
    env = {e["name"]: e for e in container["env"]}
    assert env["MASTER_ADDR"]["value"] == "127.0.0.2" and env["RANK"]["value"] == "0"
    # One GPU per pod: the process's device is its only one.
    assert env["LOCAL_RANK"]["value"] == "0" and env["LOCAL_WORLD_SIZE"]["value"] == "1"
    # The local backend's loopback setting is dropped, and the token comes from the Secret, not the pod spec.
    assert "GLOO_SOCKET_IFNAME" not in env
    assert env["TENPLEX_TOKEN"] == {"name": "TENPLEX_TOKEN",
                                    "valueFrom": {"secretKeyRef": {"name": "tenplex-auth", "key": "token"}}}
    assert env[crd.ENV_NODE_IP]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    # Without the store's node directory in the settings, workers upload to the daemon: nothing is mounted.
    assert "TENPLEX_STORE_ROOT" not in env and "volumes" not in r0["spec"] and "volumeMounts" not in container

    # Launching again (a scheduler restarted mid-launch) takes the existing pods; deleting the job deletes them.
    backend.launch("gpt", ["python"], launches("gpt", 0, ["gpu-a", "gpu-b"]), tmp_path)
    with pytest.raises(Conflict, match="not generation 1"):
        backend.launch("gpt", ["python"], [WorkerLaunch("gpt-g0-r0", 0, "gpu-a", 0, {"TENPLEX_GENERATION": "1"})],
                       tmp_path)
    api.delete("elasticjobs", "gpt", NS)
    eventually(lambda: not worker_pods(api, "gpt"), "the garbage collector to delete the job's pods")


def test_job_env_keeps_gloo_interface_when_the_job_sets_it(api: TestCluster, backend: KubernetesBackend,
                                                           tmp_path: Path) -> None:
    api.create("elasticjobs", elasticjob("lo", 1, env=[{"name": "GLOO_SOCKET_IFNAME", "value": "lo"}]), NS)
    # The controller puts the job's own env into every worker's launch env.
    backend.launch("lo", ["python"], launches("lo", 0, ["gpu-a"], env={"GLOO_SOCKET_IFNAME": "lo"}), tmp_path)
    (pod,) = worker_pods(api, "lo")
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["GLOO_SOCKET_IFNAME"] == "lo"


def test_exited_follows_pod_phases_and_deletions(api: TestCluster, backend: KubernetesBackend,
                                                 tmp_path: Path) -> None:
    events: list[ClusterEvent] = []
    backend.add_listener(events.append)
    ids = ["gpt-g0-r0", "gpt-g0-r1", "gpt-g0-r2"]
    backend.launch("gpt", ["python"], launches("gpt", 0, ["gpu-a", "gpu-a", "gpu-b"]), tmp_path)
    for name in ids:
        api.set_pod_running(name, NS)
    eventually(lambda: backend.exited("gpt", ids) == {}, "all running")
    api.set_pod_succeeded("gpt-g0-r0", NS)
    api.fail_pod("gpt-g0-r1", NS, exit_code=3)
    api.delete("pods", "gpt-g0-r2", NS)
    assert eventually(lambda: len(e := backend.exited("gpt", ids)) == 3 and e["gpt-g0-r2"] is None and e,
                      "three exits, the deleted pod gone") == {"gpt-g0-r0": 0, "gpt-g0-r1": 3, "gpt-g0-r2": None}
    kinds = sorted((e.kind, e.detail) for e in events if e.job == "gpt")
    # The deleted pod was Running: its kubelet stopped its container (SIGTERM: 143) and reported that, then
    # confirmed the deletion, which is when the pod left the API.
    assert kinds == [("worker-deleted", "worker pod gpt-g0-r2 was deleted"),
                     ("worker-exited", "worker pod gpt-g0-r0 Succeeded (exit code 0)"),
                     ("worker-exited", "worker pod gpt-g0-r1 Failed (exit code 3)"),
                     ("worker-exited", "worker pod gpt-g0-r2 Failed (exit code 143)")]

    backend.stop("gpt", ids, grace=1)
    assert worker_pods(api, "gpt") == []
    assert backend.exited("gpt", ids) == dict.fromkeys(ids)


def test_master_ports_are_unique_per_node_among_live_jobs(api: TestCluster, backend: KubernetesBackend,
                                                          tmp_path: Path) -> None:
    a = backend.host("gpu-a")
    first = backend.master_port(a)
    second = backend.master_port(a)
    assert {first, second} == {29500, 29501}
    assert backend.master_port(backend.host("gpu-b")) == 29500  # another node: its own ports
    backend.launch("gpt", ["python"], launches("gpt", 0, ["gpu-a"], {"MASTER_PORT": "29502"}), tmp_path)
    eventually(lambda: worker_pods(api, "gpt"), "the rank-0 pod")
    with pytest.raises(InvalidConfig, match=r"no free port on node gpu-a: all of 29500-29502"):
        backend.master_port(a)


def test_watch_expiry_relists_and_replays_are_not_reported_twice(api: TestCluster, backend: KubernetesBackend,
                                                                 tmp_path: Path) -> None:
    events: list[ClusterEvent] = []
    backend.add_listener(events.append)
    backend.launch("gpt", ["python"], launches("gpt", 0, ["gpu-a"]), tmp_path)
    api.set_pod_running("gpt-g0-r0", NS)
    eventually(lambda: api.open_watches() >= 2, "the backend's watches")
    relists = [inf.relists for inf in (backend.nodes, *backend.pods)]
    api.expire_watches()
    # While no watch is open, the pod fails and a node turns NotReady: the relist must show both.
    api.fail_pod("gpt-g0-r0", NS, exit_code=137)
    api.set_node_ready("gpu-b", False)
    assert eventually(lambda: backend.exited("gpt", ["gpt-g0-r0"]), "the failure after 410", timeout=120) == {"gpt-g0-r0": 137}
    eventually(lambda: not backend.host("gpu-b").ready, "gpu-b NotReady after 410", timeout=60)
    eventually(lambda: [inf.relists for inf in (backend.nodes, *backend.pods)] > relists, "relists", timeout=60)
    assert all(after > before for after, before in zip(
        [inf.relists for inf in (backend.nodes, *backend.pods)], relists, strict=True))
    api.expire_watches()  # a second expiry replays nothing new
    eventually(lambda: api.open_watches() >= 2, "watches resumed", timeout=60)
    exits = [e for e in events if e.kind == "worker-exited"]
    lost = [e for e in events if e.kind == "node-lost"]
    assert len(exits) == 1 and len(lost) == 1, events


def test_store_pod_address_and_port_come_from_the_store_pod(api: TestCluster, backend: KubernetesBackend) -> None:
    api.add_node("gpu-d", gpus=4, address="10.1.0.4")
    api.create("pods", store_pod("gpu-d", store_daemonset(api), port=7272), NS)
    api.set_pod_running("store-gpu-d", NS, pod_ip="10.244.0.7")
    eventually(lambda: any(h.name == "gpu-d" and h.ready for h in backend.hosts()), "gpu-d ready")
    assert backend.host("gpu-d") == HostInfo("gpu-d", 4, "http://10.1.0.4:7272", "10.1.0.4")


def node_launches(job: str, generation: int, hosts: list[str]) -> list[WorkerLaunch]:
    """What the controller launches: ranks in host order, local ranks counted per host."""
    out: list[WorkerLaunch] = []
    for rank, host in enumerate(hosts):
        local = sum(1 for w in out if w.host == host)
        wid = f"{job}-g{generation}-r{rank}"
        out.append(WorkerLaunch(wid, rank, host, local, {
            "RANK": str(rank), "WORLD_SIZE": str(len(hosts)), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.2", "MASTER_PORT": "29501", "TENPLEX_WORKER_ID": wid, "TENPLEX_TOKEN": "s3cret",
            "TENPLEX_STORE_URL": f"http://{host}:7070", "TENPLEX_GENERATION": str(generation)}))
    return out


def test_multi_gpu_pods_run_their_nodes_ranks_under_the_launcher(api: TestCluster, backend: KubernetesBackend,
                                                                 tmp_path: Path) -> None:
    api.create("elasticjobs", elasticjob("mp", 4, gpus_per_pod=2), NS)
    events: list[ClusterEvent] = []
    backend.add_listener(events.append)
    ids = backend.launch("mp", ["python", "-m", "examples.gpt.train"],
                         node_launches("mp", 0, ["gpu-a", "gpu-a", "gpu-b", "gpu-b"]), tmp_path)
    assert ids == dict.fromkeys(["mp-g0-r0", "mp-g0-r1", "mp-g0-r2", "mp-g0-r3"])
    pods = worker_pods(api, "mp")
    assert [(p["metadata"]["name"], p["spec"]["nodeName"]) for p in pods] == [("mp-g0-r0", "gpu-a"),
                                                                              ("mp-g0-r2", "gpu-b")]
    first, second = pods
    assert first["metadata"]["labels"] == {**crd.job_labels("mp"), "tenplex.io/generation": "0", "tenplex.io/rank": "0",
                                           LABEL_RANKS: "0-1"}
    assert second["metadata"]["labels"][LABEL_RANKS] == "2-3"
    digest = first["metadata"]["annotations"].pop(ANNOTATION_TEMPLATE)
    assert first["metadata"]["annotations"] == {ANNOTATION_MASTER_PORT: "29501", ANNOTATION_WORKERS: "mp-g0-r0,mp-g0-r1"}
    assert second["metadata"]["annotations"] == {ANNOTATION_WORKERS: "mp-g0-r2,mp-g0-r3", ANNOTATION_TEMPLATE: digest}
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert container["command"] == ["tenplex", "worker", "launch", "--", "python", "-m", "examples.gpt.train"]
        assert container["resources"]["requests"][crd.GPU_RESOURCE] == "2"
        assert container["resources"]["limits"][crd.GPU_RESOURCE] == "2"
    env = {e["name"]: e for e in first["spec"]["containers"][0]["env"]}
    # Shared by the pod's ranks: one environment; per rank: the launcher's list, local ranks within the pod.
    assert env["LOCAL_WORLD_SIZE"]["value"] == "2" and env["WORLD_SIZE"]["value"] == "4"
    assert "RANK" not in env and "LOCAL_RANK" not in env and "TENPLEX_WORKER_ID" not in env
    assert env["TENPLEX_TOKEN"] == {"name": "TENPLEX_TOKEN",
                                    "valueFrom": {"secretKeyRef": {"name": "tenplex-auth", "key": "token"}}}
    second_env = {e["name"]: e.get("value") for e in second["spec"]["containers"][0]["env"]}
    assert second_env["TENPLEX_STORE_URL"] == "http://gpu-b:7070"
    assert json.loads(second_env[ENV_POD_RANKS]) == [
        {"RANK": "2", "LOCAL_RANK": "0", "TENPLEX_WORKER_ID": "mp-g0-r2"},
        {"RANK": "3", "LOCAL_RANK": "1", "TENPLEX_WORKER_ID": "mp-g0-r3"}]
    # The launcher reads exactly that: its ranks and their environment.
    assert [(r.rank, r.local_rank) for r in parse_pod_ranks(second_env[ENV_POD_RANKS])] == [(2, 0), (3, 1)]

    # A pod's outcome is each of its ranks'; stopping any rank of a pod stops the pod.
    all_ids = list(ids)
    for pod in pods:
        api.set_pod_running(pod["metadata"]["name"], NS)
    eventually(lambda: backend.exited("mp", all_ids) == {}, "all running")
    api.fail_pod("mp-g0-r2", NS, exit_code=3)
    assert eventually(lambda: backend.exited("mp", all_ids) or None, "the failed pod") == {"mp-g0-r2": 3, "mp-g0-r3": 3}
    assert [e.detail for e in events if e.kind == "worker-exited"] == ["worker pod mp-g0-r2 Failed (exit code 3)"]
    backend.stop("mp", ["mp-g0-r1"], grace=1)
    assert [p["metadata"]["name"] for p in worker_pods(api, "mp")] == ["mp-g0-r2"]
    assert backend.exited("mp", all_ids) == {"mp-g0-r0": None, "mp-g0-r1": None, "mp-g0-r2": 3, "mp-g0-r3": 3}

    # Scaled to 2 GPUs: one pod. A scheduler restarted meanwhile finds the pod of each worker from the annotation.
    backend.stop("mp", all_ids, grace=1)
    backend.launch("mp", ["python"], node_launches("mp", 1, ["gpu-a", "gpu-a"]), tmp_path)
    (pod,) = worker_pods(api, "mp")
    assert pod["metadata"]["name"] == "mp-g1-r0" and pod["metadata"]["labels"][LABEL_RANKS] == "0-1"
    with api.api_client() as api_client:
        restarted = KubernetesBackend(api_client, SETTINGS, lambda name: api.get("elasticjobs", name, NS),
                                      watch_timeout=5).start()
        try:
            api.set_pod_succeeded("mp-g1-r0", NS)
            assert eventually(lambda: restarted.exited("mp", ["mp-g1-r0", "mp-g1-r1"]) or None, "the exits") == {
                "mp-g1-r0": 0, "mp-g1-r1": 0}
            restarted.stop("mp", ["mp-g1-r1"], grace=1)
            assert worker_pods(api, "mp") == []
        finally:
            restarted.close()


def test_ranks_that_cannot_be_cut_into_pods_are_refused(api: TestCluster, backend: KubernetesBackend,
                                                        tmp_path: Path) -> None:
    api.create("elasticjobs", elasticjob("mp", 4, gpus_per_pod=2), NS)
    with pytest.raises(InvalidConfig, match=r"node gpu-b was given 1 ranks \[2\], not a multiple of gpusPerPod=2"):
        backend.launch("mp", ["python"], node_launches("mp", 0, ["gpu-a", "gpu-a", "gpu-b"]), tmp_path)
    with pytest.raises(InvalidConfig, match=r"ranks of one worker pod must be consecutive, got \[0, 2\]"):
        backend.launch("mp", ["python"], node_launches("mp", 0, ["gpu-a", "gpu-b", "gpu-a", "gpu-b"]), tmp_path)
    assert worker_pods(api, "mp") == []  # nothing is created unless every pod can be
    assert [[w.rank for w in g] for g in pod_groups(node_launches("mp", 0, ["gpu-a"] * 4), 2)] == [[0, 1], [2, 3]]


def test_worker_pods_mount_the_node_store_when_configured(api: TestCluster, tmp_path: Path) -> None:
    # The chart passes the store DaemonSet's hostPath: worker pods mount it where the daemon sees it and
    # snapshot into it directly (TENPLEX_STORE_ROOT), sharing the node's store with the daemon.
    api.create("elasticjobs", elasticjob("mnt", 1), NS)
    settings = replace(SETTINGS, store_root="/var/lib/tenplex/store", store_host_path="/mnt/nvme/tenplex")
    with api.api_client() as api_client:
        be = KubernetesBackend(api_client, settings, lambda name: api.get("elasticjobs", name, NS))
        pod = be.pod_manifest(api.get("elasticjobs", "mnt", NS), ["python"], launches("mnt", 0, ["gpu-a"]))
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TENPLEX_STORE_ROOT"] == "/var/lib/tenplex/store"
    assert container["volumeMounts"] == [{"name": "tenplex-store", "mountPath": "/var/lib/tenplex/store"}]
    assert pod["spec"]["volumes"] == [
        {"name": "tenplex-store", "hostPath": {"path": "/mnt/nvme/tenplex", "type": "Directory"}}
    ]
    with pytest.raises(InvalidConfig, match="TENPLEX_STORE_HOST_PATH must be an absolute path"):
        replace(SETTINGS, store_host_path="relative/dir")
    # with the store's memory tier, the node's tmpfs directory too, where the daemon sees it
    memory = replace(settings, store_memory_host_path="/dev/shm/tenplex", store_memory_root="/var/lib/tenplex/memory")
    with api.api_client() as api_client:
        be = KubernetesBackend(api_client, memory, lambda name: api.get("elasticjobs", name, NS))
        pod = be.pod_manifest(api.get("elasticjobs", "mnt", NS), ["python"], launches("mnt", 0, ["gpu-a"]))
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TENPLEX_STORE_MEMORY_ROOT"] == "/var/lib/tenplex/memory"
    assert {"name": "tenplex-store-memory", "mountPath": "/var/lib/tenplex/memory"} in container["volumeMounts"]
    assert {"name": "tenplex-store-memory", "hostPath": {"path": "/dev/shm/tenplex", "type": "Directory"}} in pod["spec"]["volumes"]


def test_placement_counts_the_gpus_of_pods_still_running_or_terminating(api: TestCluster,
                                                                         backend: KubernetesBackend,
                                                                         agents: NodeAgents, tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    backend.launch("gpt", ["python"], launches("gpt", 0, ["gpu-a"]), tmp_path)
    api.set_pod_running("gpt-g0-r0", NS)
    eventually(lambda: backend.host("gpu-a").gpus == 1, "gpu-a: one of two GPUs held")
    assert backend.held_gpus() == {"gpu-a": 1}
    agents["gpu-a"].freeze("gpt-g0-r0")  # its runtime hangs: the deleted pod stays Terminating
    with caplog.at_level(logging.WARNING, logger="tenplex.k8s.backend"):
        backend.stop("gpt", ["gpt-g0-r0"], grace=1)  # gives up after the grace period and the margin
    # It returned by giving up (the frozen pod can never go on its own), after waiting out the whole period.
    assert "pods ['gpt-g0-r0'] still terminating 3s after deletion" in caplog.text, caplog.text
    assert api.get("pods", "gpt-g0-r0", NS)["metadata"]["deletionTimestamp"]
    assert backend.host("gpu-a").gpus == 1, "a Terminating pod still holds its GPU"
    # Relaunching a worker of that name waits for the old pod to go (not taken as already launched).
    threading.Timer(0.5, agents["gpu-a"].thaw, args=("gpt-g0-r0", NS)).start()
    backend.launch("gpt", ["python"], launches("gpt", 0, ["gpu-a"]), tmp_path)
    new = api.get("pods", "gpt-g0-r0", NS)
    assert not new["metadata"].get("deletionTimestamp") and new["status"]["phase"] == "Pending"
    # Worker pods carry no API token: they do not talk to the API server.
    assert new["spec"]["automountServiceAccountToken"] is False
    assert not [v for v in new["spec"].get("volumes") or [] if v["name"].startswith("kube-api-access-")]


def test_stop_does_not_wait_for_pods_on_a_node_that_is_not_ready(api: TestCluster, backend: KubernetesBackend,
                                                                  agents: NodeAgents, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    backend.launch("gpt", ["python"], launches("gpt", 0, ["gpu-a", "gpu-b"]), tmp_path)
    for name in ("gpt-g0-r0", "gpt-g0-r1"):
        api.set_pod_running(name, NS)
    agents["gpu-b"].stop()  # the node's kubelet is gone...
    api.set_node_ready("gpu-b", False)  # ... and the node controller notices
    eventually(lambda: not backend.host("gpu-b").ready, "gpu-b NotReady")
    with caplog.at_level(logging.WARNING, logger="tenplex.k8s.backend"):
        backend.stop("gpt", ["gpt-g0-r0", "gpt-g0-r1"], grace=30)
    # It returned once the pod on the Ready node was gone, not at the end of the grace period.
    assert "pods ['gpt-g0-r1'] are on nodes that are not Ready" in caplog.text, caplog.text
    assert "still terminating" not in caplog.text, caplog.text
    assert [p["metadata"]["name"] for p in worker_pods(api, "gpt")] == ["gpt-g0-r1"]  # Terminating on gpu-b
    assert backend.held_gpus() == {"gpu-b": 1}
