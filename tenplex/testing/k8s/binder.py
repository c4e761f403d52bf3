"""A test stand-in for kube-scheduler: binds pending pods to nodes that can take them.

The API emulator runs no controllers. A backend that leaves placement to
Kubernetes (``nodeSelector`` / affinity on ``kubernetes.io/hostname`` instead
of setting ``spec.nodeName`` itself) needs something to bind its pods; this
binder does the part of kube-scheduler's filtering that matters for GPU jobs:

* the node is Ready and not cordoned (``spec.unschedulable``);
* the pod's ``nodeSelector`` matches the node's labels;
* every NoSchedule/NoExecute taint of the node is tolerated by the pod;
* the node's allocatable ``nvidia.com/gpu`` minus what its non-terminated pods
  request covers the pod's request (a Terminating pod's GPUs count until it is
  gone: its containers may still run).

Pods are taken first come, first served (creation time, then resourceVersion,
as timestamps have one-second resolution). Among the nodes that pass, it picks the one with the fewest free GPUs that
still fit (bin packing, so whole nodes stay free for large pods), ties broken
by name. A pod no node can take gets ``PodScheduled=False`` with the reason
for every node, as ``kubectl describe pod`` would show, and is retried.
Bindings go through the ``pods/binding`` subresource over HTTP.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from tenplex.k8s.crd import GPU_RESOURCE
from tenplex.testing.k8s.kubelet import pod_gpus

LOG = logging.getLogger(__name__)


def _tolerates(tolerations: Sequence[client.V1Toleration], taint: client.V1Taint) -> bool:
    for tol in tolerations:
        if tol.effect and tol.effect != taint.effect:
            continue
        if tol.operator == "Exists" and (tol.key is None or tol.key == taint.key):
            return True
        if tol.key == taint.key and (tol.value or "") == (taint.value or ""):
            return True
    return False


def unfit_reason(pod: client.V1Pod, node: client.V1Node, used_gpus: int) -> str | None:
    """Why ``pod`` cannot go to ``node`` (``None`` when it can)."""
    ready = [c.status for c in (node.status.conditions or []) if c.type == "Ready"]
    if ready != ["True"]:
        return "node is not Ready"
    if node.spec is not None and node.spec.unschedulable:
        return "node is cordoned"
    labels = node.metadata.labels or {}
    for key, value in (pod.spec.node_selector or {}).items():
        if labels.get(key) != value:
            return f"nodeSelector {key}={value} does not match (node has {labels.get(key)!r})"
    for taint in (node.spec.taints if node.spec is not None else None) or []:
        if taint.effect in ("NoSchedule", "NoExecute") and not _tolerates(pod.spec.tolerations or [], taint):
            return f"untolerated taint {taint.key}:{taint.effect}"
    allocatable = int((node.status.allocatable or {}).get(GPU_RESOURCE, 0))
    wanted = pod_gpus(pod)
    if wanted > allocatable - used_gpus:
        return f"needs {wanted} {GPU_RESOURCE}, {allocatable - used_gpus} of {allocatable} free"
    return None


class PodBinder:
    """Binds pending, unbound pods every ``interval`` seconds (see the module docstring)."""

    def __init__(self, api_client: client.ApiClient, interval: float = 0.1) -> None:
        self._core = client.CoreV1Api(api_client)
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported: dict[str, str] = {}

    def start(self) -> PodBinder:
        self._thread = threading.Thread(target=self._loop, name="pod-binder", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> PodBinder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.bind_once()
            except Exception as exc:  # the API server may be gone at shutdown; keep trying until stopped
                if not self._stop.is_set():
                    LOG.warning("pod binder: pass failed (%s), retrying", exc)
            self._stop.wait(self._interval)

    def bind_once(self) -> list[tuple[str, str]]:
        """One scheduling pass; returns ``(namespace/pod, node)`` for every binding made."""
        pods = self._core.list_pod_for_all_namespaces().items
        nodes = sorted(self._core.list_node().items, key=lambda n: n.metadata.name)
        used: dict[str, int] = {}
        for pod in pods:
            if pod.spec.node_name and pod.status.phase not in ("Succeeded", "Failed"):
                used[pod.spec.node_name] = used.get(pod.spec.node_name, 0) + pod_gpus(pod)
        pending = sorted((p for p in pods if not p.spec.node_name and p.status.phase == "Pending"
                          and p.metadata.deletion_timestamp is None),
                         key=lambda p: (p.metadata.creation_timestamp or datetime.min.replace(tzinfo=UTC),
                                        int(p.metadata.resource_version or 0)))
        bound = []
        for pod in pending:
            reasons = {n.metadata.name: unfit_reason(pod, n, used.get(n.metadata.name, 0)) for n in nodes}
            fits = [n for n in nodes if reasons[n.metadata.name] is None]
            key = f"{pod.metadata.namespace}/{pod.metadata.name}"
            if not fits:
                self._unschedulable(pod, reasons)
                continue
            node = min(fits, key=lambda n: int((n.status.allocatable or {}).get(GPU_RESOURCE, 0)) - used.get(n.metadata.name, 0))
            try:
                self._core.create_namespaced_pod_binding(pod.metadata.name, pod.metadata.namespace, {
                    "apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod.metadata.name},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node.metadata.name}}, _preload_content=False)
            except client.ApiException as exc:
                if exc.status in (404, 409):  # deleted or bound meanwhile
                    continue
                raise
            used[node.metadata.name] = used.get(node.metadata.name, 0) + pod_gpus(pod)
            self._reported.pop(key, None)
            bound.append((key, node.metadata.name))
            LOG.info("pod binder: %s -> %s", key, node.metadata.name)
        return bound

    def _unschedulable(self, pod: client.V1Pod, reasons: Mapping[str, str | None]) -> None:
        message = f"0/{len(reasons)} nodes are available: " + "; ".join(f"{n}: {r}" for n, r in reasons.items())
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"
        if self._reported.get(key) == message:
            return
        self._reported[key] = message
        condition: dict[str, Any] = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                     "message": message, "lastTransitionTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
        try:
            self._core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace,
                                                   {"status": {"conditions": [condition]}})
        except client.ApiException as exc:
            if exc.status != 404:
                raise
