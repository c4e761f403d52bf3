"""A version on several hosts' stores to export and import: sharded, replicated, bf16 + fp32 + 0-d."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tenplex.node.store_routes import StoreServer
from tenplex.ptc import (
    PTC,
    DatasetState,
    Device,
    Region,
    TensorKind,
    build_tensor,
    flat_range_boxes,
)
from tenplex.ptc.dtypes import torch_dtype
from tenplex.store import TensorStore
from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore
from tenplex.worker import trainer_state

TOKEN = "dcp-token"
JOB = "job-a"
VERSION = "s7-g2"
DATASET = DatasetState(num_samples=1000, seed=5, global_batch_size=16, consumed_samples=0)
RECORDED = DatasetState(num_samples=1000, seed=5, global_batch_size=16, consumed_samples=112)


def random_tensor(shape: tuple[int, ...], dtype: str, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns for bf16 (NaN payloads and -0.0 included), random normals otherwise."""
    if dtype == "bfloat16":
        bits = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, generator=gen)
        return bits.view(torch.bfloat16)
    return torch.randn(shape, generator=gen).to(torch_dtype(dtype))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits, for bit-for-bit comparison (NaN == NaN)."""
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(bits(got), bits(want)), f"{what}: bits differ"


def source_ptc() -> PTC:
    """3 hosts, 6 devices: tp2 x dp3 with dp replicas on different hosts; bf16, fp32, a flat (ZeRO) partition, 0-d."""
    devices = tuple(Device(i, f"h{i // 2}", {"dp": i // 2, "tp": i % 2}) for i in range(6))
    tp0, tp1 = (0, 2, 4), (1, 3, 5)
    zero = flat_range_boxes((5, 3), 0, 7), flat_range_boxes((5, 3), 7, 15)
    tensors = (
        build_tensor("layers.0.w", (8, 6), "float32", TensorKind.PARAM,
                     [(Region(((0, 4), (0, 6))), tp0), (Region(((4, 8), (0, 6))), tp1)]),
        build_tensor("emb.weight", (10, 4), "bfloat16", TensorKind.PARAM,
                     [(Region(((0, 10), (0, 3))), (0,)), (Region(((0, 10), (3, 4))), (3, 5))]),
        build_tensor("norm.weight", (6,), "bfloat16", TensorKind.PARAM, [(Region(((0, 6),)), tuple(range(6)))]),
        build_tensor("zero.w", (5, 3), "float32", TensorKind.PARAM,
                     [(b, (0, 1)) for b in zero[0]] + [(b, (2, 3, 4, 5)) for b in zero[1]]),
        build_tensor("optim/layers.0.w/exp_avg", (8, 6), "float32", TensorKind.OPTIMIZER,
                     [(Region(((0, 4), (0, 6))), tp0), (Region(((4, 8), (0, 6))), tp1)]),
        build_tensor("optim/layers.0.w/step", (), "float32", TensorKind.OPTIMIZER, [(Region(()), tuple(range(6)))]),
    )
    return PTC({"dp": 3, "tp": 2, "pp": 1}, devices, tensors, DATASET)


def target_ptc() -> PTC:
    """Another layout on 2 hosts (4 devices): columns and halves where the source cut rows, dp2."""
    devices = tuple(Device(i, f"n{i // 2}", {"dp": i // 2, "tp": i % 2}) for i in range(4))
    a, b = (0, 2), (1, 3)
    tensors = (
        build_tensor("layers.0.w", (8, 6), "float32", TensorKind.PARAM,
                     [(Region(((0, 8), (0, 3))), a), (Region(((0, 8), (3, 6))), b)]),
        build_tensor("emb.weight", (10, 4), "bfloat16", TensorKind.PARAM,
                     [(Region(((0, 5), (0, 4))), (0,)), (Region(((5, 10), (0, 4))), (1, 2, 3))]),
        build_tensor("norm.weight", (6,), "bfloat16", TensorKind.PARAM,
                     [(Region(((0, 2),)), a), (Region(((2, 6),)), b)]),
        build_tensor("zero.w", (5, 3), "float32", TensorKind.PARAM, [(Region(((0, 5), (0, 3))), (0, 1, 2, 3))]),
        build_tensor("optim/layers.0.w/exp_avg", (8, 6), "float32", TensorKind.OPTIMIZER,
                     [(Region(((0, 8), (0, 3))), a), (Region(((0, 8), (3, 6))), b)]),
        build_tensor("optim/layers.0.w/step", (), "float32", TensorKind.OPTIMIZER, [(Region(()), (0, 1, 2, 3))]),
    )
    return PTC({"dp": 2, "tp": 2, "pp": 1}, devices, tensors, DatasetState(1000, 5, 32, 0))


def write_version(ptc: PTC, stores: dict[str, TensorStore], state: dict[str, torch.Tensor], job: str, version: str,
                  record_dataset: DatasetState | None = None) -> None:
    """Each host's store gets the shards its devices hold (and rank 0's trainer-state record), then commits."""
    for host in ptc.hosts:
        for t, s in ptc.shards_on_host(host):
            data = state[t.name][s.region.slices()].contiguous()
            stores[host].write_shard(job, version, t.name, s.region, data, dtype=t.dtype, global_shape=t.shape)
    if record_dataset is not None:
        rank0 = ptc.device(0).host
        record = trainer_state.capture(step=int(version[1:].split("-")[0]), rank=0, parallel=dict(ptc.config),
                                       optimizer=None, lr_scheduler=None, dataset=record_dataset, extra=None)
        stores[rank0].write_shard(job, version, trainer_state.record_name(0), Region.full((len(record),)),
                                  np.frombuffer(record, np.uint8).copy(), dtype="uint8", global_shape=(len(record),))
    for host in ptc.hosts:
        stores[host].commit(job, version)


def random_state(ptc: PTC, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {t.name: random_tensor(tuple(t.shape), t.dtype, gen) for t in ptc.tensors}


@dataclass
class Cluster:
    """Host stores: ``h0`` and ``h2`` local roots (used in-process), ``h1`` a real store daemon over HTTP."""

    roots: dict[str, Path]
    server: StoreServer
    client: StoreClient

    def stores(self) -> dict[str, TensorStore]:
        out: dict[str, TensorStore] = {h: LocalStore(r) for h, r in self.roots.items() if h != "h1"}
        out["h1"] = self.client
        return out


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    roots = {h: tmp_path / "stores" / h for h in ("h0", "h1", "h2")}
    for r in roots.values():
        r.mkdir(parents=True)
    server = StoreServer(roots["h1"], token=TOKEN, store=LocalStore(roots["h1"], chunk_bytes=256))
    with server, StoreClient(server.url, TOKEN, retries=1, backoff=0.01) as client:
        yield Cluster(roots, server, client)
