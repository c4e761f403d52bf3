"""Emulated hosts for transformer tests: one real node daemon per host on 127.0.0.2..5.

Each host is a :class:`~tenplex.node.daemon.NodeDaemon` (store and transforms,
uvicorn in a thread) bound to its own loopback address on an ephemeral port,
over a LocalStore in a temporary directory. Old states are cut from random
full tensors and written into each host's store per the old PTC, then
committed. :func:`transform_all` runs the executor in the test process (its
unit tests); :func:`transform_on_daemons` has the daemons do it, as the
scheduler does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from tenplex.node.daemon import NodeDaemon
from tenplex.ptc import PTC
from tenplex.ptc.dtypes import storage_dtype
from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore
from tenplex.transformer.execute import TransformReport, execute_host_plan
from tenplex.transformer.plan import CHECKPOINT, Plan

HOST_ADDRESSES = {f"h{i}": f"127.0.0.{i + 2}" for i in range(4)}


@dataclass
class Cluster:
    """Host name -> running store daemon, with clients."""

    root: Path
    servers: dict[str, NodeDaemon] = field(default_factory=dict)
    clients: dict[str, StoreClient] = field(default_factory=dict)

    def start(self, host: str) -> None:
        root = self.root / host
        server = NodeDaemon(root, host=HOST_ADDRESSES[host], store=LocalStore(root, durable=False)).start()
        self.servers[host] = server
        # Few retries with short backoff: a stopped server should be given up on quickly in tests.
        self.clients[host] = StoreClient(server.url, retries=1, backoff=0.05, timeout=10)

    def stop(self, host: str) -> None:
        self.servers[host].stop()

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        for s in self.servers.values():
            s.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    for host in HOST_ADDRESSES:
        c.start(host)
    try:
        yield c
    finally:
        c.close()


def random_state(ptc: PTC, seed: int) -> dict[str, np.ndarray]:
    """Full tensors (storage dtype) with random bits: bit-exact comparisons cover every pattern but NaN payload quirks."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in ptc.tensors:
        st = storage_dtype(t.dtype)
        if st.kind == "f":
            out[t.name] = rng.standard_normal(t.shape).astype(st)
        else:
            out[t.name] = rng.integers(0, 1 << 15, size=t.shape, dtype=st)  # bf16 bit patterns, finite
    return out


def populate(cluster: Cluster, ptc: PTC, state: dict[str, np.ndarray], job: str, version: str) -> None:
    """Write each host's distinct shards of ``ptc`` (cut from ``state``) into its store and commit."""
    for host in ptc.hosts:
        store = cluster.servers[host].store
        for t, s in ptc.shards_on_host(host):
            store.write_shard(
                job, version, t.name, s.region, state[t.name][s.region.slices()].copy(),
                dtype=t.dtype, global_shape=t.shape,
            )
        store.commit(job, version)


def transform_all(
    cluster: Cluster, plan: Plan, *, checkpoint: StoreClient | None = None, concurrency: int = 4
) -> dict[str, TransformReport]:
    reports = {}
    for host in plan.hosts:
        sources = {h: c for h, c in cluster.clients.items() if h != host}
        if checkpoint is not None:
            sources[CHECKPOINT] = checkpoint
        reports[host] = execute_host_plan(
            plan, host, target=cluster.clients[host], sources=sources, concurrency=concurrency
        )
    return reports


def transform_on_daemons(cluster: Cluster, plan: Plan, *, hosts: list[str] | None = None) -> dict[str, TransformReport]:
    """Every target host's daemon runs its part (pulling from the others), as the scheduler has them do."""
    from tenplex.transformer.remote import PlanRun

    alive = hosts if hosts is not None else list(cluster.servers)
    run = PlanRun(plan, {h: cluster.servers[h].url for h in alive}, token=None,
                  client_for=lambda url: next(c for c in cluster.clients.values() if c.url == url))
    return run.wait(poll_interval=0.05, timeout=120)


def expected_slice(state: dict[str, np.ndarray], name: str, region, shape) -> np.ndarray:
    """The new shard's content: the old tensor's values, zeros where the new shape exceeds the old."""
    full = state[name]
    out = np.zeros(region.shape, dtype=full.dtype)
    clipped = tuple(slice(a, min(b, n)) for (a, b), n in zip(region.bounds, full.shape, strict=True))
    if all(s.start < s.stop for s in clipped):
        rel = tuple(slice(0, s.stop - s.start) for s in clipped)
        out[rel] = full[clipped]
    return out


def check_new_state(cluster: Cluster, new: PTC, state: dict[str, np.ndarray], job: str, version: str) -> int:
    """Every device's shards in the new version equal the original tensors' slices, bit for bit."""
    checked = 0
    for host in new.hosts:
        client = cluster.clients[host]
        # The devices of a host share its store: read each distinct shard once, check it for all of them.
        wanted = {(t.name, s.region): t for dev in new.devices_on_host(host) for t, s in new.shards_of_device(dev.id)}
        for (name, region), t in wanted.items():
            got = client.read(job, version, name, region, t.dtype)
            want = expected_slice(state, name, region, t.shape)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes(), f"{host}: {name} {region} differs"  # bit for bit
            checked += 1
        assert {(s.tensor, s.region) for s in client.manifest(job, version).shards} == set(wanted), (
            f"{host}: the new version holds other shards than its devices need"
        )
    return checked
