"""Helpers of the backend, operator and end-to-end tests: emulated GPU nodes, store pods, ElasticJobs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tenplex.k8s import crd
from tenplex.testing.k8s.emulator import ApiServerEmulator

NS = "default"
STORE_LABELS = {crd.LABEL_ROLE: crd.ROLE_STORE, "app.kubernetes.io/name": "tenplex"}
STORE_DAEMONSET = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "tenplex-store",
                   "uid": "8a6c4a47-0000-4000-8000-00000000d5e7", "controller": True, "blockOwnerDeletion": True}
"""The store pods' owner, as the chart's DaemonSet (kubectl drain --ignore-daemonsets leaves such pods alone)."""
MEGATRON_MODEL = {"num_layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32,
                  "make_vocab_size_divisible_by": 8}


def store_pod(node: str, *, port: int = crd.STORE_PORT, command: list[str] | None = None) -> dict[str, Any]:
    """A store pod as the chart's DaemonSet makes it (bound to ``node``, publishing the ``store`` port)."""
    container: dict[str, Any] = {"name": "store", "image": "tenplex:test",
                                 "ports": [{"name": "store", "containerPort": port, "hostPort": port}]}
    if command is not None:
        container["command"] = command
    return {"metadata": {"name": f"store-{node}", "namespace": NS, "labels": dict(STORE_LABELS),
                         "ownerReferences": [STORE_DAEMONSET]},
            "spec": {"nodeName": node, "containers": [container]}}


def add_gpu_node(api: ApiServerEmulator, name: str, address: str, *, gpus: int = 2, store_running: bool = True,
                 port: int = crd.STORE_PORT) -> None:
    """A GPU node with its store pod (Running unless told otherwise; nothing serves behind it)."""
    api.add_node(name, gpus=gpus, address=address)
    api.create("pods", store_pod(name, port=port), NS)
    if store_running:
        api.set_pod_running(f"store-{name}", NS)


def elasticjob(name: str, gpus: int, *, namespace: str = NS, provider: str = "megatron-gpt",
               model: dict[str, Any] | None = None, command: list[str] | None = None, steps: int = 1000,
               snapshot_every: int = 10, env: list[dict[str, Any]] | None = None, max_gpus: int = 4,
               table: list[dict[str, int]] | None = None, training: bool = True,
               gpus_per_pod: int | None = None, max_restarts: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "image": "tenplex:test",
        "command": command or ["python", "-m", "examples.gpt.train"],
        "gpus": gpus,
        "minGpus": 1,
        "maxGpus": max_gpus,
        "layout": {"provider": provider, "model": model or dict(MEGATRON_MODEL)},
        "env": env or [{"name": "OMP_NUM_THREADS", "value": "1"}],
    }
    if gpus_per_pod is not None:
        spec["gpusPerPod"] = gpus_per_pod
    if training:
        spec["training"] = {"steps": steps, "snapshotEvery": snapshot_every, "heartbeatTimeoutSeconds": 120,
                            "dataset": {"numSamples": 4096, "globalBatchSize": 8}}
        if max_restarts is not None:
            spec["training"]["maxRestarts"] = max_restarts
    if table:
        spec["policy"] = {"type": "table", "table": table}
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name, "namespace": namespace},
            "spec": spec}


def eventually(predicate: Callable[[], Any], what: str, timeout: float = 20.0, interval: float = 0.05) -> Any:
    """Poll until ``predicate()`` is truthy; fail naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {value!r})")


def worker_pods(api: ApiServerEmulator, job: str, namespace: str = NS) -> list[dict[str, Any]]:
    return sorted(api.list("pods", namespace, label_selector=crd.worker_selector(job)),
                  key=lambda p: p["metadata"]["name"])
