"""The chart's store pod, exactly as rendered, runs on an emulated node and serves what its probes ask for."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tenplex.k8s import crd
from tenplex.sockets import free_port
from tenplex.testing.k8s.cluster import TestCluster
from tenplex.testing.k8s.kubelet import LocalKubelet, wait_for

from .conftest import Clients
from .test_k8s_chart import one, render

IMAGE = "tenplex:test"
NS = "tenplex"


def http_status(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


@pytest.mark.slow
def test_rendered_store_pod_serves_health_and_metrics(api: TestCluster, k8s: Clients, tmp_path: Path) -> None:
    port, root = free_port("0.0.0.0"), tmp_path / "store"
    docs = render("--set", f"store.root={root}", "--set", f"store.hostPath={root}", "--set", f"store.port={port}",
                  "--set", "store.fixPermissions=false", "--set", "auth.token=t0ken",
                  "--set", "image.repository=tenplex", "--set", "image.tag=test",
                  # only the token's Secret is made here; the key set's Secret volume is exercised by
                  # test_k8s_helm.py, the daemons' key sets by tests/test_security.py
                  "--set", "auth.jobCredentials.enabled=false")
    api.create_namespace(NS)
    secret = one(docs, "Secret")
    api.create("secrets", {"metadata": {"name": secret["metadata"]["name"]}, "data": secret["data"]}, namespace=NS)
    template = one(docs, "DaemonSet")["spec"]["template"]
    pod = {"metadata": {"name": "store-node-a", "labels": template["metadata"]["labels"]},
           "spec": {**template["spec"], "nodeName": "node-a"}}
    assert pod["spec"]["containers"][0]["image"] == IMAGE and "command" not in pod["spec"]["containers"][0]

    api.add_node("node-a", address="127.0.0.2")
    entrypoint = [str(Path(sys.executable).parent / "tenplex")]  # the image's ENTRYPOINT ["tenplex"]
    with LocalKubelet(k8s.api_client, "node-a", "127.0.0.2", tmp_path / "kubelet", entrypoints={IMAGE: entrypoint},
                      probe_period_scale=0.2) as kubelet:
        k8s.core.create_namespaced_pod(NS, pod)
        base = f"http://127.0.0.2:{port}"
        try:
            wait_for(lambda: http_status(f"{base}/healthz") == 200, timeout=60, what="the store's /healthz")
        except TimeoutError:
            pytest.fail(f"the store never became healthy; its log:\n{kubelet.log_path('store-node-a', NS).read_text()}")
        assert http_status(f"{base}/metrics") == 401
        assert http_status(f"{base}/metrics", token="t0ken") == 200
        assert root.is_dir()
        running = k8s.core.read_namespaced_pod("store-node-a", NS)
        assert running.status.phase == "Running" and running.metadata.labels[crd.LABEL_ROLE] == crd.ROLE_STORE
        # The chart's readiness probe (/healthz on the port named "store") passes: the kubelet reports it Ready.
        wait_for(lambda: any(c.type == "Ready" and c.status == "True" for c in
                             k8s.core.read_namespaced_pod("store-node-a", NS).status.conditions or []),
                 timeout=30, what="the store pod Ready by its readiness probe")

        k8s.core.delete_namespaced_pod("store-node-a", NS)
        wait_for(lambda: kubelet.pid("store-node-a", NS) is None, timeout=30, what="the store to stop")
    assert http_status(f"{base}/healthz") == 0
