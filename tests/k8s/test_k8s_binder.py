"""The kube-scheduler stand-in: GPU capacity, node selectors, taints, cordons, readiness."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from kubernetes import client

from tenplex.k8s import crd
from tenplex.testing.k8s.binder import PodBinder
from tenplex.testing.k8s.emulator import ApiServerEmulator
from tenplex.testing.k8s.kubelet import LocalKubelet, wait_for

from .conftest import Clients

NS = "default"


def gpu_pod(name: str, gpus: int, **spec: Any) -> dict[str, Any]:
    container = {"name": "worker", "image": "tenplex:test", "command": [sys.executable, "-c", "pass"],
                 "resources": {"limits": {crd.GPU_RESOURCE: str(gpus)}}}
    return {"metadata": {"name": name, "labels": crd.job_labels("j")}, "spec": {"containers": [container], **spec}}


def node_of(k8s: Clients, name: str) -> str | None:
    return k8s.core.read_namespaced_pod(name, NS).spec.node_name


def test_binds_by_gpu_capacity_bin_packing(api: ApiServerEmulator, k8s: Clients) -> None:
    api.add_node("big", gpus=8)
    api.add_node("small", gpus=2)
    binder = PodBinder(k8s.api_client)
    k8s.core.create_namespaced_pod(NS, gpu_pod("p2", 2))
    k8s.core.create_namespaced_pod(NS, gpu_pod("p8", 8))
    k8s.core.create_namespaced_pod(NS, gpu_pod("p1", 1))
    bound = dict(binder.bind_once())
    # Fewest free GPUs that still fit: p2 fills "small", p8 takes "big", p1 fits nowhere.
    assert bound == {"default/p2": "small", "default/p8": "big"}
    assert node_of(k8s, "p1") is None
    scheduled = [c for c in k8s.core.read_namespaced_pod("p1", NS).status.conditions if c.type == "PodScheduled"]
    assert scheduled[0].status == "False" and scheduled[0].reason == "Unschedulable"
    assert "big: needs 1 nvidia.com/gpu, 0 of 8 free" in scheduled[0].message

    api.fail_pod("p8", NS)  # a terminated pod frees its GPUs
    assert binder.bind_once() == [("default/p1", "big")]


def test_respects_selectors_taints_cordons_and_readiness(api: ApiServerEmulator, k8s: Clients) -> None:
    api.add_node("a", gpus=4, labels={"pool": "h100"})
    api.add_node("b", gpus=4, labels={"pool": "a100"})
    binder = PodBinder(k8s.api_client)
    k8s.core.create_namespaced_pod(NS, gpu_pod("sel", 1, nodeSelector={"pool": "a100"}))
    assert binder.bind_once() == [("default/sel", "b")]

    api.cordon_node("b")
    api.set_node_ready("a", False)
    k8s.core.create_namespaced_pod(NS, gpu_pod("none", 1))
    assert binder.bind_once() == []
    message = [c for c in k8s.core.read_namespaced_pod("none", NS).status.conditions if c.type == "PodScheduled"][0].message
    assert "a: node is not Ready" in message and "b: node is cordoned" in message

    api.set_node_ready("a", True)
    api.patch("nodes", "a", {"spec": {"taints": [{"key": crd.GPU_RESOURCE, "effect": "NoSchedule"}]}})
    assert binder.bind_once() == []
    k8s.core.create_namespaced_pod(NS, gpu_pod("tol", 1, tolerations=[{"key": crd.GPU_RESOURCE, "operator": "Exists",
                                                                       "effect": "NoSchedule"}]))
    assert binder.bind_once() == [("default/tol", "a")]


def test_binding_subresource_refuses_a_second_binding(k8s: Clients, api: ApiServerEmulator) -> None:
    api.add_node("a")
    k8s.core.create_namespaced_pod(NS, gpu_pod("p", 1))
    body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p"}, "target": {"kind": "Node", "name": "a"}}
    k8s.core.create_namespaced_pod_binding("p", NS, body, _preload_content=False)
    assert node_of(k8s, "p") == "a"
    try:
        k8s.core.create_namespaced_pod_binding("p", NS, body, _preload_content=False)
    except client.ApiException as exc:
        assert exc.status == 409
    else:
        raise AssertionError("a second binding must be refused")


def test_binder_and_kubelet_run_a_selected_pod(api: ApiServerEmulator, k8s: Clients, tmp_path: Path) -> None:
    api.add_node("node-a", gpus=2, address="127.0.0.2")
    api.add_node("node-b", gpus=2, address="127.0.0.3")
    with PodBinder(k8s.api_client), LocalKubelet(k8s.api_client, "node-b", "127.0.0.3", tmp_path):
        k8s.core.create_namespaced_pod(NS, gpu_pod("w", 2, nodeSelector={"kubernetes.io/hostname": "node-b"}))
        wait_for(lambda: k8s.core.read_namespaced_pod("w", NS).status.phase == "Succeeded", what="pod w Succeeded")
    pod = k8s.core.read_namespaced_pod("w", NS)
    assert pod.spec.node_name == "node-b" and pod.status.host_ip == "127.0.0.3"


def test_a_terminating_pods_gpus_stay_taken(api: ApiServerEmulator, k8s: Clients) -> None:
    """Until its kubelet confirms, a deleted pod may still run on its GPUs: the binder counts them."""
    api.add_node("only", gpus=2)
    binder = PodBinder(k8s.api_client)
    k8s.core.create_namespaced_pod(NS, gpu_pod("old", 2))
    assert binder.bind_once() == [("default/old", "only")]
    api.set_pod_running("old", NS)
    k8s.core.delete_namespaced_pod("old", NS)  # Terminating: no kubelet here to confirm
    k8s.core.create_namespaced_pod(NS, gpu_pod("new", 2))
    assert binder.bind_once() == []
    assert "only: needs 2 nvidia.com/gpu, 0 of 2 free" in [c for c in k8s.core.read_namespaced_pod("new", NS)
                                                           .status.conditions if c.type == "PodScheduled"][0].message
    api.force_delete("pods", "old", NS)
    assert binder.bind_once() == [("default/new", "only")]


def test_a_pending_pod_being_deleted_is_not_bound(api: ApiServerEmulator, k8s: Clients) -> None:
    api.add_node("n", gpus=1)
    body = gpu_pod("held", 1)
    body["metadata"]["finalizers"] = ["example.com/hold"]
    k8s.core.create_namespaced_pod(NS, body)
    k8s.core.delete_namespaced_pod("held", NS)
    assert PodBinder(k8s.api_client).bind_once() == []
