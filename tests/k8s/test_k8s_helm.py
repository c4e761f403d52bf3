"""``helm install`` of the chart into the test cluster, and an ElasticJob driven with kubectl.

Everything the chart makes is created by helm in the real API server (the CRD is the cluster's already, as
on a second install), and the cluster's own controllers take it from there: the Deployment controller makes
the scheduler's ReplicaSet and pod, kube-scheduler binds that pod to the CPU node, the DaemonSet controller
makes a store pod for the GPU node (the chart's nodeSelector and toleration), and the test kubelets run both
as processes from the pod specs the chart rendered (``tenplex`` being the image's entry point). The
scheduler pod talks to the API server as the chart's ServiceAccount, with a token its kubelet requested for
it, so the real RBAC authorizer judges every call it makes against the chart's rules. ``helm install --wait``
returns once the scheduler and the store pass their readiness probes.

Then, as a user would: ``kubectl apply`` an ElasticJob, restart the scheduler by deleting its pod (the
ReplicaSet makes another, which takes the Lease and resumes the job from the API server), and ``kubectl
delete`` the job: the garbage collector takes its pods. Its workers only sleep: without cluster DNS they
cannot reach the scheduler at its Service's name, so nothing that needs them to report (a resize, a
redeploy) is driven here; the end-to-end tests do that with the scheduler in the test process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml

from tenplex.k8s import crd
from tenplex.sockets import free_port
from tenplex.testing.k8s.cluster import TestCluster
from tenplex.testing.k8s.controlplane import User
from tenplex.testing.k8s.kubelet import LocalKubelet

from .cluster import (
    CHART,
    RELEASE,
    SERVICE_ACCOUNT,
    assert_rbac_clean,
    eventually,
    live_worker_pods,
    tool,
)

pytestmark = pytest.mark.slow

NS = "tenplex"
TOKEN = "helm-test-token"
NODES = {"cpu-0": ("127.0.8.1", 0, {"tenplex.test/role": "cpu"}),
         "gpu-0": ("127.0.8.2", 2, {"nvidia.com/gpu.present": "true"})}
IMAGE = "tenplex:0.1.0"
"""The chart's image (its appVersion); the kubelets run this venv's ``tenplex`` for its entry point."""

Run = Callable[..., subprocess.CompletedProcess[str]]


def tools(api: TestCluster, tmp_path: Path) -> tuple[Run, Run]:
    """helm and kubectl as the cluster admin."""
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump(api.kubeconfig(namespace=NS)))
    env = {"PATH": os.environ.get("PATH", ""), "KUBECONFIG": str(config), "HOME": str(tmp_path),
           "HELM_CACHE_HOME": str(tmp_path / "helm-cache"), "HELM_CONFIG_HOME": str(tmp_path / "helm-config"),
           "HELM_DATA_HOME": str(tmp_path / "helm-data")}

    def runner(binary: str) -> Run:
        def run(*args: str, ok: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
            result = subprocess.run([binary, *args], capture_output=True, text=True, env=env, timeout=timeout)
            if ok:
                assert result.returncode == 0, f"{Path(binary).name} {' '.join(args)}: {result.stderr}"
            return result
        return run

    return runner(str(tool("helm"))), runner(str(tool("kubectl")))


def job_manifest(gpus: int, command: list[str]) -> dict[str, Any]:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "sleeper", "namespace": NS},
            "spec": {"image": IMAGE, "command": command, "gpus": gpus, "minGpus": 1, "maxGpus": 2,
                     "layout": {"provider": "megatron-gpt", "model": {"num_layers": 2, "hidden": 64, "heads": 4,
                                                                        "vocab": 128, "seq_len": 32}},
                     "training": {"steps": 1000, "snapshotEvery": 10, "heartbeatTimeoutSeconds": 600,
                                  "dataset": {"numSamples": 4096, "globalBatchSize": 8}}}}


@pytest.fixture
def kubelets(api: TestCluster, tmp_path: Path) -> Iterator[dict[str, LocalKubelet]]:
    """One test kubelet per node, each registering its Node (as the node) and running what is bound to it."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    entry = [str(Path(sys.executable).parent / "tenplex")]
    with ExitStack() as stack:
        out = {}
        for node, (ip, gpus, labels) in NODES.items():
            kubelet = LocalKubelet(stack.enter_context(api.api_client(User.node(node))), node, ip,
                                   tmp_path / "nodes" / node, base_env=env, entrypoints={IMAGE: entry},
                                   probe_period_scale=0.2, gpus=gpus)
            out[node] = stack.enter_context(kubelet)
            api.kubelets[node] = kubelet
            api.patch("nodes", node, {"metadata": {"labels": labels}})
        yield out


def test_helm_install_then_kubectl_apply_restart_and_delete(
        api: TestCluster, kubelets: dict[str, LocalKubelet], tmp_path: Path) -> None:
    helm, kubectl = tools(api, tmp_path)
    sched_port, store_port = free_port("0.0.0.0"), free_port("0.0.0.0")
    store = tmp_path / "store"
    installed = helm(
        "install", RELEASE, str(CHART), "--namespace", NS, "--create-namespace", "--wait", "--timeout", "180s",
        "--set", f"auth.token={TOKEN}", "--set", f"scheduler.port={sched_port}",
        "--set", "scheduler.nodeSelector.tenplex\\.test/role=cpu",
        "--set", "scheduler.leaderElection.leaseDurationSeconds=15",
        "--set", "scheduler.leaderElection.renewDeadlineSeconds=10",
        "--set", "scheduler.leaderElection.retryPeriodSeconds=2",
        "--set", f"store.port={store_port}", "--set", f"store.root={store}", "--set", f"store.hostPath={store}",
        "--set", "store.fixPermissions=false", timeout=240)
    assert "STATUS: deployed" in installed.stdout

    # The chart's NetworkPolicies (on by default) are accepted by the real API server as rendered; nothing here
    # enforces them (the test cluster has no CNI).
    policies = {p["metadata"]["name"]: p["spec"] for p in api.list("networkpolicies", NS)}
    assert sorted(policies) == [f"{RELEASE}-tenplex-scheduler", f"{RELEASE}-tenplex-store"], sorted(policies)
    assert all(spec["policyTypes"] == ["Ingress"] and spec["ingress"] for spec in policies.values())

    # What the cluster made of it: the scheduler pod on the CPU node, a store pod on the GPU node only.
    # Exactly one runs. A scheduler process that exited (a pod of the test kubelet is never restarted: on a loaded
    # machine a missed Lease renewal ends it) leaves a Failed pod that its ReplicaSet has replaced, as a kubelet
    # would restart the container; the message shows such a pod's log.
    sched_pods = api.list("pods", NS, label_selector="tenplex.io/role=scheduler")
    live = [p for p in sched_pods if (p.get("status") or {}).get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")]
    exited = {p["metadata"]["name"]: kubelets["cpu-0"].log_path(p["metadata"]["name"], NS).read_text()[-3000:]
              for p in sched_pods if p not in live}
    assert len(live) == 1, f"scheduler pods running: {[p['metadata']['name'] for p in live]}; exited: {exited}"
    sched_pod = live[0]
    assert sched_pod["spec"]["nodeName"] == "cpu-0" and sched_pod["spec"]["serviceAccountName"] == SERVICE_ACCOUNT
    stores = api.list("pods", NS, label_selector=f"{crd.LABEL_ROLE}={crd.ROLE_STORE}")
    assert [p["spec"]["nodeName"] for p in stores] == ["gpu-0"]
    assert stores[0]["metadata"]["ownerReferences"][0]["kind"] == "DaemonSet"

    # A job, applied.
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(job_manifest(1, sleep)))
    assert "elasticjob.tenplex.io/sleeper created" in kubectl("apply", "-f", str(manifest)).stdout

    def running(count: int) -> Callable[[], Any]:
        return lambda: (pods := live_worker_pods(api, "sleeper", NS)) and len(pods) == count and all(
            (p.get("status") or {}).get("phase") == "Running" for p in pods) and pods

    def status() -> dict[str, Any]:
        return api.get("elasticjobs", "sleeper", NS).get("status") or {}

    (first,) = eventually(running(1), "the job's worker pod Running", timeout=90)
    assert first["spec"]["nodeName"] == "gpu-0"
    eventually(lambda: status().get("phase") == "Running", "the job Running in its status", timeout=60)
    # The scheduler's pod deleted: its ReplicaSet makes another, which takes the Lease and resumes the job
    # from the API server (its worker pod kept).
    kubectl("delete", "pod", sched_pod["metadata"]["name"], "--wait=false")
    eventually(lambda: [p for p in api.list("pods", NS, label_selector="tenplex.io/role=scheduler")
                        if p["metadata"]["uid"] != sched_pod["metadata"]["uid"]
                        and (p.get("status") or {}).get("phase") == "Running"], "a new scheduler pod", timeout=90)
    holder = api.get("leases", "tenplex-scheduler", NS)["spec"]["holderIdentity"]
    eventually(lambda: api.get("leases", "tenplex-scheduler", NS)["spec"]["holderIdentity"] != holder,
               "the new scheduler pod holding the Lease", timeout=60)
    eventually(lambda: status().get("phase") == "Running", "the job still Running", timeout=30)
    assert [p["metadata"]["uid"] for p in running(1)()] == [first["metadata"]["uid"]]

    kubectl("delete", "elasticjob", "sleeper", "--wait=true", "--timeout=90s", timeout=120)
    eventually(lambda: not live_worker_pods(api, "sleeper", NS), "the job's pods collected", timeout=60)
    assert_rbac_clean(api, NS)
    helm("uninstall", RELEASE, "--namespace", NS, "--wait", "--timeout", "60s", timeout=90)
