"""The README's kubectl commands, run with the real kubectl (from `make tools`) against the test cluster's kube-apiserver."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tenplex.k8s import crd
from tenplex.testing.k8s.cluster import TestCluster

from .cluster import NodeAgents
from .conftest import REPO, tool

EXAMPLE = REPO / "deploy" / "examples" / "elasticjob-example-gpt.yaml"


@pytest.fixture
def kubectl(api: TestCluster, tmp_path: Path):  # type: ignore[no-untyped-def]
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump(api.kubeconfig()))
    env = {"PATH": os.environ.get("PATH", ""), "KUBECONFIG": str(config), "HOME": str(tmp_path)}
    binary = str(tool("kubectl"))

    def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([binary, *args], capture_output=True, text=True, env=env, timeout=60)
        if ok:
            assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result

    return run


def test_submit_scale_and_watch_columns(api: TestCluster, kubectl) -> None:  # type: ignore[no-untyped-def]
    kubectl("create", "namespace", "tenplex")
    # kubectl's own validation (strict: the server's field validation against the CRD's schema) passes.
    assert "elasticjob.tenplex.io/gpt-small created" in kubectl("apply", "-f", str(EXAMPLE)).stdout
    api.patch("elasticjobs", "gpt-small", {"status": crd.ElasticJobStatus(
        phase=crd.Phase.RUNNING, gpus=4, parallel=crd.Parallel(2, 2, 1), step=120, version="s120-g1",
        selector=crd.worker_selector("gpt-small")).to_dict()}, namespace="tenplex", subresource="status")

    table = kubectl("get", "elasticjobs", "-n", "tenplex").stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "GPUS", "DP", "TP", "PP", "STEP", "AGE"]
    assert table[1].split()[:7] == ["gpt-small", "Running", "4", "2", "2", "1", "120"]
    wide = kubectl("get", "ej", "-n", "tenplex", "-o", "wide").stdout.splitlines()
    assert wide[0].split()[:4] == ["NAME", "PHASE", "GPUS", "DESIRED"] and "VERSION" in wide[0]
    assert "s120-g1" in wide[1]

    assert "scaled" in kubectl("scale", "elasticjob/gpt-small", "-n", "tenplex", "--replicas=8").stdout
    assert api.get("elasticjobs", "gpt-small", "tenplex")["spec"]["gpus"] == 8
    assert kubectl("get", "ej", "gpt-small", "-n", "tenplex", "-o", "jsonpath={.spec.gpus}").stdout == "8"

    refused = kubectl("scale", "elasticjob/gpt-small", "-n", "tenplex", "--replicas=7", ok=False)
    assert refused.returncode != 0 and "multiple of gpusPerPod" in refused.stderr
    refused = kubectl("scale", "elasticjob/gpt-small", "-n", "tenplex", "--replicas=10", ok=False)
    assert refused.returncode != 0 and "must not exceed maxGpus" in refused.stderr
    assert api.get("elasticjobs", "gpt-small", "tenplex")["spec"]["gpus"] == 8


def test_cordon_and_drain(api: TestCluster, agents: NodeAgents, kubectl) -> None:  # type: ignore[no-untyped-def]
    api.add_node("gpu-1")
    api.add_node("gpu-2")
    agents.start("gpu-1")  # the evicted pods are gone once their kubelet confirms: kubectl drain waits for that
    agents.start("gpu-2")
    for i, node in enumerate(("gpu-1", "gpu-1", "gpu-2")):
        api.create("pods", {"metadata": {"name": f"w{i}", "labels": crd.job_labels("j")},
                            "spec": {"nodeName": node, "containers": [{"name": "worker", "image": "tenplex:test"}]}})
    assert "cordoned" in kubectl("cordon", "gpu-2").stdout
    assert api.get("nodes", "gpu-2")["spec"]["unschedulable"] is True
    assert "uncordoned" in kubectl("uncordon", "gpu-2").stdout

    drained = kubectl("drain", "gpu-1", "--ignore-daemonsets", "--force", "--timeout=30s")
    assert "node/gpu-1 drained" in drained.stdout
    assert api.get("nodes", "gpu-1")["spec"]["unschedulable"] is True
    assert [p["metadata"]["name"] for p in api.list("pods")] == ["w2"]
