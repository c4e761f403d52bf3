"""The test kubelet: pods bound to a node become local processes, with the kubelet's environment rules."""

from __future__ import annotations

import base64
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tenplex.k8s import crd
from tenplex.sockets import free_port
from tenplex.testing.k8s.cluster import TestCluster
from tenplex.testing.k8s.kubelet import LocalKubelet, ReadinessProbe, expand, wait_for

from .conftest import Clients

NS = "default"


@pytest.fixture
def kubelet(api: TestCluster, k8s: Clients, tmp_path: Path) -> Iterator[LocalKubelet]:
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


def test_pod_runs_with_downward_api_secret_and_expansion(api: TestCluster, k8s: Clients,
                                                         kubelet: LocalKubelet, tmp_path: Path) -> None:
    api.create("secrets", {"metadata": {"name": "tenplex-auth"}, "data": {"token": base64.b64encode(b"s3cret").decode()}})
    out = tmp_path / "env.txt"
    code = ("import os; open(os.environ['OUT'], 'w').write('|'.join(os.environ[k] for k in "
            "('TENPLEX_STORE_URL', 'TENPLEX_TOKEN', 'POD', 'JOB')))")
    env = [{"name": "TENPLEX_NODE_IP", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.hostIP"}}},
           {"name": "TENPLEX_STORE_URL", "value": "http://$(TENPLEX_NODE_IP):7070"},
           {"name": "TENPLEX_TOKEN", "valueFrom": {"secretKeyRef": {"name": "tenplex-auth", "key": "token"}}},
           {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "JOB", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['tenplex.io/job']"}}},
           {"name": "OUT", "value": str(out)}]
    k8s.core.create_namespaced_pod(NS, python_pod("w0", code, env))
    wait_for(lambda: phase(k8s, "w0") == "Succeeded", what="pod w0 Succeeded")
    assert out.read_text() == "http://127.0.0.2:7070|s3cret|w0|j"
    pod = k8s.core.read_namespaced_pod("w0", NS)
    assert pod.status.host_ip == "127.0.0.2"
    assert pod.status.container_statuses[0].state.terminated.exit_code == 0


def test_an_exit_during_an_api_server_outage_is_reported_when_it_is_back(api: TestCluster, k8s: Clients,
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
    wait_for(lambda: not k8s.core.list_namespaced_pod(NS).items, what="the pod gone once the kubelet confirmed")


def test_kubelet_survives_watch_expiry(api: TestCluster, k8s: Clients, kubelet: LocalKubelet) -> None:
    wait_for(lambda: api.open_watches() >= 1, what="the kubelet's watch")
    api.expire_watches()
    k8s.core.create_namespaced_pod(NS, python_pod("after", "pass"))
    wait_for(lambda: phase(k8s, "after") == "Succeeded", what="a pod created after the watch expired")


def test_pods_of_other_nodes_and_bad_env_are_handled(api: TestCluster, k8s: Clients, kubelet: LocalKubelet) -> None:
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


def test_graceful_deletion_sigterm_report_then_confirm(api: TestCluster, k8s: Clients, kubelet: LocalKubelet,
                                                        tmp_path: Path) -> None:
    """The pod stays (Terminating) while its process handles SIGTERM; the kubelet reports the exit, then deletes the
    pod with grace period 0; a process ignoring SIGTERM gets SIGKILL once the grace period is over."""
    marker, handling = tmp_path / "terminated", tmp_path / "handling"
    code = (f"import pathlib, signal, sys, time\n"
            f"def bye(*_):\n    time.sleep(0.5); pathlib.Path({str(marker)!r}).touch(); sys.exit(143)\n"
            f"signal.signal(signal.SIGTERM, bye)\npathlib.Path({str(handling)!r}).touch()\n"
            f"while True: time.sleep(0.05)")
    k8s.core.create_namespaced_pod(NS, python_pod("polite", code, grace=10))
    wait_for(lambda: phase(k8s, "polite") == "Running", what="pod polite Running")
    wait_for(handling.exists, what="pod polite handling SIGTERM")  # Running is reported before Python starts
    k8s.core.delete_namespaced_pod("polite", NS)
    assert k8s.core.read_namespaced_pod("polite", NS).metadata.deletion_timestamp is not None
    wait_for(lambda: not k8s.core.list_namespaced_pod(NS, field_selector="metadata.name=polite").items, timeout=15,
             what="pod polite gone after its process ended")
    assert marker.exists(), "the pod must not be gone before its process has ended"

    ready = tmp_path / "ignoring"
    k8s.core.create_namespaced_pod(NS, python_pod("stubborn", f"import pathlib, signal, time\nsignal.signal("
                                                  f"signal.SIGTERM, signal.SIG_IGN)\npathlib.Path({str(ready)!r})"
                                                  f".touch()\nwhile True: time.sleep(0.05)", grace=1))
    pid = wait_for(lambda: kubelet.pid("stubborn"), what="process of pod stubborn")
    wait_for(ready.exists, what="pod stubborn ignoring SIGTERM")
    started = time.monotonic()
    k8s.core.delete_namespaced_pod("stubborn", NS)
    wait_for(lambda: not k8s.core.list_namespaced_pod(NS, field_selector="metadata.name=stubborn").items, timeout=15,
             what="pod stubborn gone after SIGKILL")
    assert time.monotonic() - started >= 1.0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_hung_runtime_keeps_the_pod_terminating_and_its_gpus(api: TestCluster, k8s: Clients,
                                                                tmp_path: Path) -> None:
    api.add_node("gpu-node", gpus=1, address="127.0.0.5")
    with LocalKubelet(k8s.api_client, "gpu-node", "127.0.0.5", tmp_path / "kl") as kl:
        first = python_pod("first", "import time; time.sleep(600)", grace=1)
        first["spec"].update(nodeName="gpu-node")
        first["spec"]["containers"][0]["resources"] = {"limits": {crd.GPU_RESOURCE: "1"}}
        k8s.core.create_namespaced_pod(NS, first)
        wait_for(lambda: phase(k8s, "first") == "Running", what="pod first Running")
        kl.freeze("first")
        k8s.core.delete_namespaced_pod("first", NS)
        time.sleep(2.0)  # past its 1 s grace period
        assert k8s.core.read_namespaced_pod("first", NS).metadata.deletion_timestamp is not None
        assert kl.pid("first") is not None and kl.used_gpus() == 1
        # Its GPU is still in use: the kubelet refuses a pod that would need it.
        second = {**first, "metadata": {"name": "second"}}
        k8s.core.create_namespaced_pod(NS, second)
        wait_for(lambda: phase(k8s, "second") == "Failed", what="pod second rejected")
        rejected = k8s.core.read_namespaced_pod("second", NS).status
        assert rejected.reason == f"OutOf{crd.GPU_RESOURCE}"
        assert rejected.message == ("Pod was rejected: Node didn't have enough resource: nvidia.com/gpu, requested: 1, "
                                    "used: 1, capacity: 1")
        kl.thaw("first")
        wait_for(lambda: not k8s.core.list_namespaced_pod(NS, field_selector="metadata.name=first").items,
                 timeout=15, what="pod first gone once its runtime recovered")
        assert kl.used_gpus() == 0
        k8s.core.create_namespaced_pod(NS, {**first, "metadata": {"name": "third"}})
        wait_for(lambda: phase(k8s, "third") == "Running", what="pod third admitted on the freed GPU")


# -- readiness probes ----------------------------------------------------------------------------------

HEALTH_SERVER = """
import http.server, os
go, log = os.environ['GO'], os.environ['PROBES']
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        code = 200 if self.path == '/healthz' and os.path.exists(go) else 503
        with open(log, 'a') as f:
            f.write(f'{code}\\n')
        self.send_response(code)
        self.send_header('Content-Length', '0')
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer((os.environ['HOST'], int(os.environ['PORT'])), Health).serve_forever()
"""


def ready_state(k8s: Clients, name: str) -> tuple[str, dict[str, str], bool]:
    """The pod's phase, its conditions (type -> status) and its container's ``ready``."""
    status = k8s.core.read_namespaced_pod(name, NS).status
    conditions = {c.type: c.status for c in status.conditions or []}
    return status.phase, conditions, bool(status.container_statuses and status.container_statuses[0].ready)


def is_ready(k8s: Clients, name: str) -> bool:
    phase_, conditions, container_ready = ready_state(k8s, name)
    assert phase_ == "Running", f"pod {name} is {phase_}: a readiness change must leave it Running"
    assert conditions.get("Ready") == conditions.get("ContainersReady"), conditions
    assert (conditions.get("Ready") == "True") == container_ready, (conditions, container_ready)
    return conditions.get("Ready") == "True"


def answers(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def test_readiness_probe_thresholds_and_a_hung_server(api: TestCluster, k8s: Clients, tmp_path: Path) -> None:
    """A real HTTP server as the pod's container, probed on its named port: not Ready until successThreshold
    probes passed, not Ready again after failureThreshold failed (answered 503, or not answered at all while the
    process is stopped), Ready once it answers again; the pod stays Running throughout."""
    host = "127.0.0.6"
    port, go, log = free_port(host), tmp_path / "go", tmp_path / "probes.log"
    api.add_node("node-p", address=host)
    container = {"name": "server", "image": "ignored", "command": [sys.executable, "-c", HEALTH_SERVER],
                 "env": [{"name": "GO", "value": str(go)}, {"name": "PROBES", "value": str(log)},
                         {"name": "HOST", "value": host}, {"name": "PORT", "value": str(port)}],
                 "ports": [{"name": "health", "containerPort": port, "hostPort": port}],
                 "readinessProbe": {"httpGet": {"path": "/healthz", "port": "health"}, "periodSeconds": 5,
                                    "timeoutSeconds": 1, "successThreshold": 2, "failureThreshold": 3}}
    pod = {"metadata": {"name": "health"}, "spec": {"nodeName": "node-p", "containers": [container]}}
    # Periods of 5 s scaled to 0.2 s; the timeouts stay 1 s.
    with LocalKubelet(k8s.api_client, "node-p", host, tmp_path / "kl", probe_period_scale=0.04) as kl:
        k8s.core.create_namespaced_pod(NS, pod)
        pid = wait_for(lambda: kl.pid("health"), what="the server's process")
        try:
            # Probed and failing (503): Running, not Ready.
            wait_for(lambda: answers(log).count("503") >= 3, timeout=30, what="three failed probes")
            assert not is_ready(k8s, "health")
            assert ready_state(k8s, "health")[1]["PodScheduled"] == "True"

            go.touch()
            wait_for(lambda: is_ready(k8s, "health"), timeout=30, what="Ready once the probes pass")
            assert answers(log).count("200") >= 2, "Ready after successThreshold=2 passed probes, not before"

            before = len(answers(log))
            go.unlink()
            wait_for(lambda: not is_ready(k8s, "health"), timeout=30, what="not Ready once the probes fail")
            assert answers(log)[before:].count("503") >= 3, "not Ready after failureThreshold=3 failed probes"
            go.touch()
            wait_for(lambda: is_ready(k8s, "health"), timeout=30, what="Ready again")

            # A server that hangs (its process stopped): the probes time out and the pod is not Ready.
            os.kill(pid, signal.SIGSTOP)
            wait_for(lambda: not is_ready(k8s, "health"), timeout=30, what="not Ready while the server is stopped")
            assert kl.pid("health") == pid
            os.kill(pid, signal.SIGCONT)
            wait_for(lambda: is_ready(k8s, "health"), timeout=30, what="Ready once the server answers again")
        finally:
            os.kill(pid, signal.SIGCONT)
        k8s.core.delete_namespaced_pod("health", NS, grace_period_seconds=1)
        wait_for(lambda: not k8s.core.list_namespaced_pod(NS, field_selector="metadata.name=health").items,
                 timeout=15, what="the pod gone")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_readiness_probe_resolution(k8s: Clients, kubelet: LocalKubelet) -> None:
    """Ports by number or name, the kubelet's defaults, the node's address; a pod without a probe is Ready as it
    runs; a probe naming a port the container lacks is a configuration error."""
    named = client.V1Container(name="c", ports=[client.V1ContainerPort(name="store", container_port=7070)],
                               readiness_probe=client.V1Probe(http_get=client.V1HTTPGetAction(port="store")))
    assert ReadinessProbe.of(named, "10.0.0.1") == ReadinessProbe(scheme="HTTP", host="10.0.0.1", port=7070, path="/")
    numbered = client.V1Container(name="c", readiness_probe=client.V1Probe(
        tcp_socket=client.V1TCPSocketAction(port=8080), period_seconds=5, failure_threshold=2, timeout_seconds=3))
    assert ReadinessProbe.of(numbered, "10.0.0.1") == ReadinessProbe(
        scheme="TCP", host="10.0.0.1", port=8080, timeout=3.0, period=5.0, failure_threshold=2)
    assert ReadinessProbe.of(client.V1Container(name="c"), "10.0.0.1") is None
    with pytest.raises(ValueError, match="exec"):
        ReadinessProbe.of(client.V1Container(name="c", readiness_probe=client.V1Probe(
            _exec=client.V1ExecAction(command=["true"]))), "10.0.0.1")

    k8s.core.create_namespaced_pod(NS, python_pod("plain", "import time; time.sleep(600)"))
    wait_for(lambda: phase(k8s, "plain") == "Running", what="pod plain Running")
    assert is_ready(k8s, "plain")
    bad = python_pod("badport", "import time; time.sleep(600)")
    bad["spec"]["containers"][0]["readinessProbe"] = {"httpGet": {"path": "/healthz", "port": "nope"}}
    k8s.core.create_namespaced_pod(NS, bad)
    wait_for(lambda: phase(k8s, "badport") == "Failed", what="pod badport Failed")
    status = k8s.core.read_namespaced_pod("badport", NS).status
    assert status.reason == "CreateContainerConfigError" and "'nope'" in status.message
