"""The test kubelet: pods bound to a node become local processes, with the kubelet's environment rules."""

from __future__ import annotations

import base64
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tenplex.k8s import crd
from tenplex.testing.k8s.emulator import ApiServerEmulator
from tenplex.testing.k8s.kubelet import LocalKubelet, expand, wait_for

from .conftest import Clients

NS = "default"


@pytest.fixture
def kubelet(api: ApiServerEmulator, k8s: Clients, tmp_path: Path) -> Iterator[LocalKubelet]:
    api.add_node("node-a", address="127.0.0.2")
    with LocalKubelet(k8s.api_client, "node-a", "127.0.0.2", tmp_path / "kubelet") as kl:
        yield kl


def python_pod(name: str, code: str, env: list[dict[str, Any]] | None = None, grace: int | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "ignored", "command": [sys.executable, "-c", code], "env": env or []}
    spec: dict[str, Any] = {"nodeName": "node-a", "containers": [container]}
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    return {"metadata": {"name": name, "labels": crd.job_labels("j")}, "spec": spec}


def phase(k8s: Clients, name: str) -> str:
    return k8s.core.read_namespaced_pod(name, NS).status.phase


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "x", "B": "y"}
    assert expand("$(A)-$(B)-$(C)-$$(A)", env) == "x-y-$(C)-$(A)"


def test_pod_runs_with_downward_api_secret_and_expansion(api: ApiServerEmulator, k8s: Clients,
                                                         kubelet: LocalKubelet, tmp_path: Path) -> None:
    api.create("secrets", {"metadata": {"name": "tenplex-auth"}, "data": {"token": base64.b64encode(b"s3cret").decode()}})
    out = tmp_path / "env.txt"
    code = ("import os; open(os.environ['OUT'], 'w').write('|'.join(os.environ[k] for k in "
            "('TENPLEX_STORE_URL', 'TENPLEX_TOKEN', 'POD', 'JOB')))")
    env = [*crd.store_env(7070), {"name": "TENPLEX_TOKEN", "valueFrom": {"secretKeyRef": {"name": "tenplex-auth", "key": "token"}}},
           {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "JOB", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['tenplex.io/job']"}}},
           {"name": "OUT", "value": str(out)}]
    k8s.core.create_namespaced_pod(NS, python_pod("w0", code, env))
    wait_for(lambda: phase(k8s, "w0") == "Succeeded", what="pod w0 Succeeded")
    assert out.read_text() == "http://127.0.0.2:7070|s3cret|w0|j"
    pod = k8s.core.read_namespaced_pod("w0", NS)
    assert pod.status.host_ip == "127.0.0.2"
    assert pod.status.container_statuses[0].state.terminated.exit_code == 0


def test_an_exit_during_an_api_server_outage_is_reported_when_it_is_back(api: ApiServerEmulator, k8s: Clients,
                                                                          kubelet: LocalKubelet, tmp_path: Path) -> None:
    go = tmp_path / "go"
    code = f"import os, sys, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.02)\nsys.exit(4)"
    k8s.core.create_namespaced_pod(NS, python_pod("w", code))
    wait_for(lambda: phase(k8s, "w") == "Running", what="pod w Running")
    with api.outage():
        go.touch()
        wait_for(lambda: kubelet.pid("w") is None, what="the process to exit")
        time.sleep(0.5)  # the kubelet's first reports fail meanwhile
    wait_for(lambda: phase(k8s, "w") == "Failed", timeout=30, what="pod w Failed once the API server is back")
    assert k8s.core.read_namespaced_pod("w", NS).status.container_statuses[0].state.terminated.exit_code == 4


def test_exit_code_and_crash_are_reported_failed(k8s: Clients, kubelet: LocalKubelet) -> None:
    k8s.core.create_namespaced_pod(NS, python_pod("bad", "import sys; print('boom'); sys.exit(3)"))
    wait_for(lambda: phase(k8s, "bad") == "Failed", what="pod bad Failed")
    terminated = k8s.core.read_namespaced_pod("bad", NS).status.container_statuses[0].state.terminated
    assert terminated.exit_code == 3 and terminated.reason == "Error"
    assert "boom" in kubelet.log_path("bad").read_text()

    k8s.core.create_namespaced_pod(NS, python_pod("long", "import time; time.sleep(600)"))
    wait_for(lambda: kubelet.pid("long"), what="process of pod long")
    wait_for(lambda: phase(k8s, "long") == "Running", what="pod long Running")
    kubelet.kill("long")
    wait_for(lambda: phase(k8s, "long") == "Failed", what="pod long Failed after SIGKILL")
    terminated = k8s.core.read_namespaced_pod("long", NS).status.container_statuses[0].state.terminated
    assert terminated.exit_code == 137


def test_deleting_the_pod_terminates_the_process(k8s: Clients, kubelet: LocalKubelet) -> None:
    k8s.core.create_namespaced_pod(NS, python_pod("w1", "import time; time.sleep(600)", grace=2))
    pid = wait_for(lambda: kubelet.pid("w1"), what="process of pod w1")
    k8s.core.delete_namespaced_pod("w1", NS)
    wait_for(lambda: kubelet.pid("w1") is None, what="process of deleted pod w1 to end")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_kubelet_survives_watch_expiry(api: ApiServerEmulator, k8s: Clients, kubelet: LocalKubelet) -> None:
    wait_for(lambda: api.open_watches() >= 1, what="the kubelet's watch")
    api.expire_watches()
    k8s.core.create_namespaced_pod(NS, python_pod("after", "pass"))
    wait_for(lambda: phase(k8s, "after") == "Succeeded", what="a pod created after the watch expired")


def test_pods_of_other_nodes_and_bad_env_are_handled(api: ApiServerEmulator, k8s: Clients, kubelet: LocalKubelet) -> None:
    api.add_node("node-b")
    other = python_pod("elsewhere", "pass")
    other["spec"]["nodeName"] = "node-b"
    k8s.core.create_namespaced_pod(NS, other)
    k8s.core.create_namespaced_pod(NS, python_pod("nosecret", "pass", [
        {"name": "T", "valueFrom": {"secretKeyRef": {"name": "missing", "key": "token"}}}]))
    wait_for(lambda: phase(k8s, "nosecret") == "Failed", what="pod with a missing secret Failed")
    assert k8s.core.read_namespaced_pod("nosecret", NS).status.reason == "CreateContainerConfigError"
    assert phase(k8s, "elsewhere") == "Pending" and kubelet.pid("elsewhere") is None


@pytest.mark.slow
def test_a_multi_rank_pods_ranks_end_with_its_killed_launcher(k8s: Clients, kubelet: LocalKubelet, tmp_path: Path) -> None:
    """As a container ends with its main process: the ranks the launcher started do not outlive it."""
    out = tmp_path / "ranks"
    out.mkdir()
    code = ("import os, pathlib, time; pathlib.Path(os.environ['OUT'], os.environ['RANK']).write_text(str(os.getpid()));"
            " time.sleep(600)")
    pod = python_pod("ranks", code, [{"name": "OUT", "value": str(out)}, {"name": "TENPLEX_POD_RANKS", "value":
                      '[{"RANK":"0","LOCAL_RANK":"0"},{"RANK":"1","LOCAL_RANK":"1"}]'}])
    container = pod["spec"]["containers"][0]
    container["command"] = [sys.executable, "-m", "tenplex", "worker", "launch", "--", *container["command"]]
    k8s.core.create_namespaced_pod(NS, pod)
    pids = wait_for(lambda: len(found := [int(p.read_text() or 0) for p in sorted(out.iterdir())]) == 2
                    and all(found) and found, timeout=30, what="both ranks of pod ranks")
    kubelet.kill("ranks")  # the launcher only
    wait_for(lambda: phase(k8s, "ranks") == "Failed", what="pod ranks Failed")
    assert k8s.core.read_namespaced_pod("ranks", NS).status.container_statuses[0].state.terminated.exit_code == 137
    for pid in pids:
        wait_for(lambda p=pid: not _alive(p), what=f"rank process {pid} to end with its pod")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
