"""A test kubelet whose containers are simulated ranks: the Kubernetes side of ``benchmarks/control_plane_k8s.py``.

:class:`SimulatedRanksKubelet` is the test kubelet of :mod:`tenplex.testing.k8s.kubelet` (it watches its node's
pods through the real API server, admits them against the node's GPUs, reports their status, and confirms a
deletion only once their containers have ended) with a different container runtime: a worker pod's ranks are
run by a simulated-worker agent (:mod:`tenplex.testing.simworkers`, over its HTTP routes), from the environment
the pod's spec gives them, resolved as the kubelet resolves it (plain values, the downward API's
``status.hostIP``/``metadata.name``/``metadata.namespace``, and for a multi-rank pod ``TENPLEX_POD_RANKS`` split
into one environment per rank as ``tenplex worker launch`` splits it). A store pod (``tenplex.io/role=store``)
runs nothing here: the node's store is a simulated node agent (:mod:`tenplex.testing.simnodes`) that listens on
the port the pod publishes; the kubelet reports the pod Running and Ready.

The pod ends when all its ranks have: Succeeded when every one exited 0, else Failed with the first failing
rank's code (a rank ended by a signal reads as 128 + the signal, as a container runtime reports a process killed
by it). Deleting the pod stops its ranks (:meth:`_begin_termination`); a rank that outlives the deletion's grace
period is not killed harder, as the agent's stop is a cancellation that cannot be refused.

:class:`AgentLink` is the one connection all of a process's kubelets share to the agent: it launches and stops
ranks and follows the agent's exit events (one long poll), handing each exit to the kubelet of its pod.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

from tenplex.core.commands import ENV_POD_RANKS, parse_pod_ranks, pod_rank_env
from tenplex.core.protocol import ENV_JOB, ENV_LOCAL_RANK, ENV_RANK, ENV_WORKER_ID
from tenplex.errors import InvalidInput, TenplexError
from tenplex.k8s import crd

from ..simworkers import AgentClient
from .kubelet import _Kubelet, _Pod

log = logging.getLogger(__name__)


def signal_exit(code: int) -> int:
    """A rank's exit code as a container runtime reports it: a process ended by signal N (the agent says -N)
    exits 128 + N."""
    return 128 - code if code < 0 else code


def pod_environment(pod: client.V1Pod, host_ip: str) -> dict[str, str]:
    """The first container's environment as the kubelet gives it: plain values and the downward API's fields
    this benchmark's pods use; a reference to anything else is an error (no Secret reads: the pods of a
    scheduler without an auth Secret carry their token as a value)."""
    fields = {"status.hostIP": host_ip, "status.podIP": host_ip, "metadata.name": pod.metadata.name,
              "metadata.namespace": pod.metadata.namespace, "spec.nodeName": pod.spec.node_name}
    env: dict[str, str] = {}
    for var in pod.spec.containers[0].env or []:
        if var.value_from is None:
            env[var.name] = var.value or ""
        elif var.value_from.field_ref is not None and var.value_from.field_ref.field_path in fields:
            env[var.name] = fields[var.value_from.field_ref.field_path]
        else:
            raise InvalidInput(f"pod {pod.metadata.name}: env {var.name} comes from {var.value_from}, which the "
                               "simulated kubelet does not resolve")
    return env


def pod_ranks(pod: client.V1Pod, host_ip: str) -> list[dict[str, Any]]:
    """The ranks a worker pod runs, as the agent's ``/launch`` takes them (one for a single-rank pod)."""
    env = pod_environment(pod, host_ip)
    node = pod.spec.node_name
    if ENV_POD_RANKS not in env:
        return [{"worker_id": env[ENV_WORKER_ID], "rank": int(env[ENV_RANK]), "host": node,
                 "local_rank": int(env.get(ENV_LOCAL_RANK, "0")), "env": env, "store_root": ""}]
    ranks = parse_pod_ranks(env[ENV_POD_RANKS])
    out = []
    for r in ranks:
        own = pod_rank_env(env, r, len(ranks))
        out.append({"worker_id": own[ENV_WORKER_ID], "rank": r.rank, "host": node, "local_rank": r.local_rank,
                    "env": own, "store_root": ""})
    return out


@dataclass
class _Running:
    kubelet: SimulatedRanksKubelet
    entry: _Pod
    job: str
    workers: list[str]
    codes: dict[str, int] = field(default_factory=dict)


class AgentLink:
    """The kubelets' shared link to a simulated-worker agent at ``url`` (see the module docstring)."""

    def __init__(self, url: str) -> None:
        self._agent = AgentClient(url)
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], _Running] = {}
        """(job, worker id) -> the pod that runs it."""
        self._early: dict[tuple[str, str], int] = {}
        self._seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="sim-kubelet-exits", daemon=True)
        self._thread.start()

    def run(self, kubelet: SimulatedRanksKubelet, entry: _Pod, ranks: list[dict[str, Any]]) -> None:
        job = ranks[0]["env"][ENV_JOB]
        running = _Running(kubelet, entry, job, [r["worker_id"] for r in ranks])
        with self._lock:
            for wid in running.workers:
                self._pods[(job, wid)] = running
        self._agent.call("POST", "/launch", {"job": job, "workers": ranks})

    def stop(self, entry: _Pod) -> bool:
        """Stop the pod's ranks still running; False when it runs none (never launched, or all ended)."""
        with self._lock:
            running = next((r for r in self._pods.values() if r.entry is entry), None)
            left = [w for w in running.workers if w not in running.codes] if running is not None else []
        if running is None or not left:
            return False
        self._agent.call("POST", "/stop", {"job": running.job, "worker_ids": left})
        return True

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._agent.call("GET", f"/exits?after={self._seen}&wait=1.0", timeout=10.0)
            except TenplexError as exc:
                log.warning("%s", exc)
                self._stop.wait(0.5)
                continue
            ended: list[tuple[_Running, int]] = []
            with self._lock:
                for job, wid, code in events["exits"]:
                    running = self._pods.get((job, wid))
                    if running is None:
                        continue
                    running.codes[wid] = signal_exit(int(code))
                    if len(running.codes) == len(running.workers):
                        for w in running.workers:
                            self._pods.pop((job, w), None)
                        failed = [running.codes[w] for w in running.workers if running.codes[w] != 0]
                        ended.append((running, failed[0] if failed else 0))
                self._seen = events["next"]
            for running, code in ended:
                running.kubelet.ranks_ended(running.entry, code)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


class SimulatedRanksKubelet(_Kubelet):
    """A test kubelet running its worker pods' ranks in a simulated-worker agent (see the module docstring)."""

    def __init__(self, api_client: client.ApiClient, node: str, host_ip: str, agent: AgentLink, *,
                 heartbeat_seconds: float = 10.0) -> None:
        super().__init__(api_client, node, host_ip, heartbeat_seconds=heartbeat_seconds)
        self.agent = agent

    def _start(self, pod: client.V1Pod, entry: _Pod) -> None:
        labels: Mapping[str, str] = pod.metadata.labels or {}
        entry.started = True
        if labels.get(crd.LABEL_ROLE) == crd.ROLE_WORKER:
            try:
                self.agent.run(self, entry, pod_ranks(pod, self.host_ip))
            except TenplexError as exc:
                log.warning("kubelet %s: pod %s could not start: %s", self.node, entry.name, exc)
                self._ended(entry, 128)
                return
        self._report(entry.namespace, entry.name, self._running_status(entry))

    def _begin_termination(self, entry: _Pod) -> None:
        if self._frozen_now(entry) or entry.ended.is_set():
            return
        try:
            stopping = self.agent.stop(entry)
        except TenplexError as exc:
            log.warning("kubelet %s: stopping pod %s: %s", self.node, entry.name, exc)
            stopping = False
        if not stopping:  # nothing of it runs (a store pod; ranks that all ended): the container has ended
            self._ended(entry, 143 if entry.exit_code is None else entry.exit_code)

    def ranks_ended(self, entry: _Pod, code: int) -> None:
        """Every rank of the pod has exited (from :class:`AgentLink`)."""
        if not entry.ended.is_set():
            self._ended(entry, code)
