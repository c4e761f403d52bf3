"""Snapshot and restore in one process against a real LocalStore (and the HTTP store when present).

The multi-process, multi-configuration cases are in test_continuity.py; these pin down the
mechanics: copy-out semantics, the commit protocol among ranks of one host, layout checks,
bit-exact restore of parameters and AdamW state, and the trainer-state record.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tenplex.core.version import Version
from tenplex.errors import Conflict, InvalidConfig, NotFound, TenplexError
from tenplex.node.store_routes import StoreServer
from tenplex.ptc import PTC, Device, Region, TensorKind, build_tensor
from tenplex.store import TensorStore
from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore
from tenplex.worker import trainer_state
from tenplex.worker.restore import restore
from tenplex.worker.snapshot import Snapshotter
from tenplex.worker.state import check_layout, live_pieces

JOB = "unit"


class Tiny(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 3, bias=False).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(torch.relu(self.fc1(x))).to(torch.bfloat16)).float()


def make(seed: int = 0, optimizer: str = "adamw") -> tuple[Tiny, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    model = Tiny(seed)
    if optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def train(model: nn.Module, opt: torch.optim.Optimizer, sched: object, steps: int, seed: int = 1) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 6, generator=gen)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()  # type: ignore[attr-defined]
        losses.append(loss.item())
    return losses


def replicated_ptc(model: nn.Module, devices: list[Device], with_optim: bool = True, optimizer: str = "adamw") -> PTC:
    """Every device holds every tensor whole (data parallelism)."""
    ids = tuple(d.id for d in devices)
    tensors = []
    for name, p in model.named_parameters():
        dtype = str(p.dtype).removeprefix("torch.")
        tensors.append(build_tensor(name, p.shape, dtype, TensorKind.PARAM, [(Region.full(p.shape), ids)]))
        if with_optim and optimizer == "sgd":
            tensors.append(build_tensor(f"optim/{name}/momentum_buffer", p.shape, dtype, TensorKind.OPTIMIZER, [(Region.full(p.shape), ids)]))
        elif with_optim:
            for key in ("exp_avg", "exp_avg_sq"):
                tensors.append(build_tensor(f"optim/{name}/{key}", p.shape, dtype, TensorKind.OPTIMIZER, [(Region.full(p.shape), ids)]))
            tensors.append(build_tensor(f"optim/{name}/step", (), "float32", TensorKind.OPTIMIZER, [(Region.full(()), ids)]))
    return PTC(config={"dp": len(devices)}, devices=tuple(devices), tensors=tuple(tensors))


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {p.name: p.local.clone() for p in live_pieces(model, opt)}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8) if a[k].dim() else a[k], b[k].view(torch.uint8) if b[k].dim() else b[k]), k


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store", durable=False)


@pytest.fixture
def http_store(tmp_path: Path) -> Iterator[TensorStore]:
    """The node-local store through its HTTP daemon, as a worker on another machine sees it."""
    local = LocalStore(tmp_path / "store", durable=False)
    with StoreServer(tmp_path / "store", store=local, token="tok") as server:
        client = StoreClient(server.url, token="tok")
        yield client
        client.close()


@pytest.mark.parametrize(("kind", "optimizer"), [("direct", "adamw"), ("direct", "sgd"), ("http", "adamw")])
def test_snapshot_then_restore_is_bit_exact_and_training_continues_identically(
    request: pytest.FixtureRequest, kind: str, optimizer: str
) -> None:
    store = request.getfixturevalue("store" if kind == "direct" else "http_store")
    model, opt, sched = make(optimizer=optimizer)
    train(model, opt, sched, 3)
    ptc = replicated_ptc(model, [Device(0, "h0")], optimizer=optimizer)
    snap = Snapshotter(store, JOB, ptc, rank=0)
    saved = state_of(model, opt)
    v = snap.snapshot(3, 0, model, opt, lr_scheduler=sched, extra={"note": "hello"})
    result = snap.wait()
    assert v == Version(3, 0) and result is not None and result.committed
    assert store.manifest(JOB, v).committed

    model2, opt2, sched2 = make(seed=99, optimizer=optimizer)  # different values, optimizer never stepped
    batches: list[int] = []
    if kind == "http":  # the CPU tensors come in one batch read, not a request each
        real = store._fetch_batch
        store._fetch_batch = lambda job, v, batch, verify: batches.append(len(batch)) or real(job, v, batch, verify)
    restored = restore(store, JOB, v, ptc, 0, model2, opt2, lr_scheduler=sched2)
    if kind == "http":
        assert batches == [len([p for p in live_pieces(model2, opt2) if p.region.volume])]
    assert restored.step == 3 and restored.exact and restored.extra == {"note": "hello"}
    assert_bitwise_equal(saved, state_of(model2, opt2))
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert train(model, opt, sched, 2, seed=5) == train(model2, opt2, sched2, 2, seed=5)


def test_copy_out_happens_at_snapshot_time(store: LocalStore) -> None:
    model, opt, sched = make()
    train(model, opt, sched, 1)
    ptc = replicated_ptc(model, [Device(0, "h0")])
    snap = Snapshotter(store, JOB, ptc, rank=0)
    saved = state_of(model, opt)
    snap.snapshot(1, 0, model, opt)
    with torch.no_grad():  # the next step changes the live tensors while the write may still run
        for p in model.parameters():
            p.add_(1)
    snap.wait()
    model2, opt2, _ = make(seed=5)
    restore(store, JOB, Version(1, 0), ptc, 0, model2, opt2)
    assert_bitwise_equal(saved, state_of(model2, opt2))


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_replicas_on_one_host_write_once_and_the_last_finisher_commits(store: LocalStore, order: tuple[int, int]) -> None:
    model, opt, sched = make()
    train(model, opt, sched, 1)
    ptc = replicated_ptc(model, [Device(0, "h0"), Device(1, "h0")])
    snaps = {r: Snapshotter(store, JOB, ptc, rank=r) for r in (0, 1)}
    first, second = order
    snaps[first].snapshot(1, 0, model, opt)
    r1 = snaps[first].wait()
    assert r1 is not None and not r1.committed
    assert not store.manifest(JOB, Version(1, 0)).committed
    snaps[second].snapshot(1, 0, model, opt)
    r2 = snaps[second].wait()
    assert r2 is not None and r2.committed
    manifest = store.manifest(JOB, Version(1, 0))
    assert manifest.committed
    # rank 0 (lowest on the host) wrote every tensor once; rank 1 only its record
    assert (r1 if first == 0 else r2).shards_written == len(ptc.tensors) + 1
    assert (r1 if first == 1 else r2).shards_written == 1
    names = [s.tensor for s in manifest.shards]
    assert sorted(names) == sorted([t.name for t in ptc.tensors] + [trainer_state.record_name(0), trainer_state.record_name(1)])


def test_restore_refuses_uncommitted_and_missing_versions(store: LocalStore) -> None:
    model, opt, sched = make()
    train(model, opt, sched, 1)
    ptc = replicated_ptc(model, [Device(0, "h0"), Device(1, "h0")])
    snap = Snapshotter(store, JOB, ptc, rank=0)
    snap.snapshot(1, 0, model, opt)
    snap.wait()
    with pytest.raises(Conflict, match="s1-g0 .* not committed"):
        restore(store, JOB, "s1-g0", ptc, 0, model, opt)
    with pytest.raises(NotFound, match="s7-g0"):
        restore(store, JOB, "s7-g0", ptc, 0, model, opt)


def test_layout_mismatch_names_the_first_differing_tensor() -> None:
    model, opt, sched = make()
    train(model, opt, sched, 1)
    pieces = live_pieces(model, opt)
    devices = (Device(0, "h0"), Device(1, "h0"))
    good = replicated_ptc(model, list(devices))
    check_layout(pieces, good, 0)
    # fc1.weight split by rows in the PTC, whole in the live model
    split = [
        build_tensor("fc1.weight", (8, 6), "float32", TensorKind.PARAM, [(Region.of([[0, 4], [0, 6]]), (0,)), (Region.of([[4, 8], [0, 6]]), (1,))])
        if t.name == "fc1.weight"
        else t
        for t in good.tensors
    ]
    bad = PTC(config={}, devices=devices, tensors=tuple(split))
    with pytest.raises(InvalidConfig, match=r"'fc1.weight': live \[0:8, 0:6\] of \[8, 6\] float32, PTC \[0:4, 0:6\] of \[8, 6\] float32"):
        check_layout(pieces, bad, 0)
    missing = PTC(config={}, devices=devices, tensors=good.tensors + (build_tensor("fc3.weight", (2,), "float32", TensorKind.PARAM, [(Region.full((2,)), (0, 1))]),))
    with pytest.raises(InvalidConfig, match="'fc3.weight'.*no such tensor"):
        check_layout(pieces, missing, 0)
    fewer = PTC(config={}, devices=devices, tensors=tuple(t for t in good.tensors if t.name != "norm.bias"))
    with pytest.raises(InvalidConfig, match="live tensor 'norm.bias' .* is not in the PTC"):
        check_layout(pieces, fewer, 1)
    dtype = PTC(config={}, devices=devices, tensors=tuple(
        build_tensor(t.name, t.shape, "float32", t.kind, [(s.region, s.devices) for s in t.shards]) if t.name == "fc2.weight" else t
        for t in good.tensors
    ))
    with pytest.raises(InvalidConfig, match="'fc2.weight': live .* bfloat16, PTC .* float32"):
        check_layout(pieces, dtype, 0)


def test_empty_local_shards_need_no_ptc_entry() -> None:
    """An uneven FSDP2 split leaves some rank an empty local shard; the PTC lists none for it."""
    from tenplex.worker.state import LocalPiece

    devices = (Device(0, "h0"), Device(1, "h0"))
    ptc = PTC(config={}, devices=devices, tensors=(build_tensor("b", (1, 4), "float32", TensorKind.PARAM, [(Region.of([[0, 1], [0, 4]]), (0,))]),))
    empty = LocalPiece("b", TensorKind.PARAM, (1, 4), "float32", Region.of([[1, 1], [0, 4]]), torch.empty(0, 4))
    check_layout([empty], ptc, 1)
    full = LocalPiece("b", TensorKind.PARAM, (1, 4), "float32", Region.of([[0, 1], [0, 4]]), torch.empty(1, 4))
    with pytest.raises(InvalidConfig, match="'b' .* is not held by this device"):
        check_layout([full], ptc, 1)


def test_restore_checks_layout_before_reading(store: LocalStore) -> None:
    model, opt, sched = make()
    train(model, opt, sched, 1)
    ptc = replicated_ptc(model, [Device(0, "h0")])
    snap = Snapshotter(store, JOB, ptc, rank=0)
    snap.snapshot(1, 0, model, opt)
    snap.wait()

    class Wider(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(6, 9)

    wide = Wider()
    with pytest.raises(InvalidConfig, match="'fc1.weight': live \\[0:9, 0:6\\]"):
        restore(store, JOB, "s1-g0", ptc, 0, wide, torch.optim.AdamW(wide.parameters()))


def test_changed_layout_derives_lr_and_reseeds_rng(store: LocalStore) -> None:
    model, opt, sched = make()
    train(model, opt, sched, 4)
    ptc = replicated_ptc(model, [Device(0, "h0")])
    snap = Snapshotter(store, JOB, ptc, rank=0)
    snap.snapshot(4, 0, model, opt, lr_scheduler=sched)
    snap.wait()
    # a "transformed" copy: same tensors, no trainer-state record (the transformer moves PTC tensors only)
    manifest = store.manifest(JOB, Version(4, 0))
    v1 = Version(4, 1)
    for s in manifest.shards:
        if s.tensor.startswith("extra/"):
            continue
        buf = torch.empty(s.region.shape, dtype=getattr(torch, s.dtype))
        store.read_into(JOB, "s4-g0", s.tensor, s.region, buf)
        store.write_shard(JOB, v1, s.tensor, s.region, buf, dtype=s.dtype, global_shape=s.global_shape)
    store.commit(JOB, v1)
    ptc2 = PTC(config={"dp": 1, "note": "new layout"}, devices=ptc.devices, tensors=ptc.tensors)
    model2, opt2, sched2 = make(seed=3)
    torch.manual_seed(1234)
    res = restore(store, JOB, v1, ptc2, 0, model2, opt2, lr_scheduler=sched2, seed=7)
    assert not res.exact and res.step == 4
    assert sched2.get_last_lr() == pytest.approx(sched.get_last_lr())
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    after_restore = torch.rand(3)
    trainer_state.reseed(7, 4, 0)
    assert torch.equal(after_restore, torch.rand(3))


def test_same_layout_restores_rng_exactly(store: LocalStore) -> None:
    model, opt, sched = make()
    train(model, opt, sched, 1)
    ptc = replicated_ptc(model, [Device(0, "h0")])
    torch.manual_seed(42)
    np.random.seed(42)
    random.seed(42)
    snap = Snapshotter(store, JOB, ptc, rank=0)
    snap.snapshot(1, 0, model, opt)
    expected = (torch.rand(2), np.random.rand(2), random.random())
    snap.wait()
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    restore(store, JOB, "s1-g0", ptc, 0, model, opt)
    got = (torch.rand(2), np.random.rand(2), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


def test_background_errors_surface_on_wait_and_next_snapshot(tmp_path: Path) -> None:
    model, opt, sched = make()
    train(model, opt, sched, 1)
    ptc = replicated_ptc(model, [Device(0, "h0")])
    store = LocalStore(tmp_path / "s", durable=False)
    snap = Snapshotter(store, JOB, ptc, rank=0)
    snap.snapshot(1, 0, model, opt)
    snap.wait()
    snap.snapshot(1, 0, model, opt)  # version s1-g0 is committed: rewriting it must fail, loudly
    with pytest.raises(Conflict, match="committed"):
        snap.wait()
    assert snap.wait() is not None  # the error is reported once


def test_snapshot_before_the_first_step_names_the_missing_state(store: LocalStore) -> None:
    model, opt, _ = make()
    ptc = replicated_ptc(model, [Device(0, "h0")])
    with pytest.raises(InvalidConfig, match="no such tensor"):
        Snapshotter(store, JOB, ptc, rank=0).snapshot(0, 0, model, opt)
    # without optimizer state in the PTC, a step-0 snapshot of the parameters works
    ptc0 = replicated_ptc(model, [Device(0, "h0")], with_optim=False)
    snap = Snapshotter(store, JOB, ptc0, rank=0)
    snap.snapshot(0, 0, model, None)
    assert snap.wait().committed  # type: ignore[union-attr]


def test_trainer_state_record_errors() -> None:
    with pytest.raises(TenplexError, match="not readable"):
        trainer_state.load(b"garbage")


def test_unchanged_shards_are_linked_from_the_previous_snapshot_not_written(tmp_path: Path) -> None:
    """A frozen parameter (and everything, when nothing trained in between) is linked into the next version:
    the same inode, verified, no bytes written; what changed is written."""
    model, opt, sched = make()
    model.fc1.weight.requires_grad_(False)  # frozen: it never changes
    train(model, opt, sched, 2)
    store = LocalStore(tmp_path / "store")
    ptc = replicated_ptc(model, [Device(0, "h0")], with_optim=False)
    snap = Snapshotter(store, JOB, ptc, 0)
    snap.snapshot(2, 0, model, None)
    first = snap.wait()
    assert first is not None and first.shards_linked == 0
    train(model, opt, sched, 1)
    snap.snapshot(3, 0, model, None)
    second = snap.wait()
    assert second is not None and second.shards_linked == 1
    assert second.bytes_linked == model.fc1.weight.numel() * 4
    assert store.verify(JOB, "s3-g0") == []

    def files(version: str, tensor: str) -> set[int]:
        return {p.stat().st_ino for p in (tmp_path / "store" / JOB / version).rglob("*")
                if p.is_file() and tensor in str(p.parent) and p.name.startswith("c")}

    assert files("s2-g0", "fc1.weight") == files("s3-g0", "fc1.weight")  # hard links: no bytes written
    assert files("s2-g0", "fc2.weight").isdisjoint(files("s3-g0", "fc2.weight"))  # it trained: written again
    # restored bit for bit from the linked version
    fresh, _, _ = make(seed=5)
    restore(store, JOB, "s3-g0", ptc, 0, fresh, None)
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a.detach().view(torch.uint8) if a.dtype == torch.bfloat16 else a.detach(),
                           b.detach().view(torch.uint8) if b.dtype == torch.bfloat16 else b.detach()), name
    # a previous version no longer there: written after all
    store.delete(JOB, "s3-g0")
    snap.snapshot(4, 0, model, None)
    third = snap.wait()
    assert third is not None and third.shards_linked == 0 and store.verify(JOB, "s4-g0") == []


class Tied(nn.Module):
    """A tied embedding and two buffers: one the model computes (non-persistent), one it stores."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.out = nn.Linear(4, 5, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("scale", torch.arange(4.0))
        self.register_buffer("cache", torch.ones(3), persistent=False)


def test_materialize_allocates_meta_modules_keeps_ties_and_buffers_and_names_buffers_left_unset() -> None:
    from tenplex.worker.state import materialize

    with torch.device("meta"):
        model = Tied()
    with pytest.raises(InvalidConfig, match=r"buffers \['cache', 'scale'\] .* init_buffers"):
        materialize(model, "cpu")
    assert all(t.is_meta for t in model.state_dict().values())  # refused before anything was allocated

    def init_buffers(m: nn.Module) -> None:
        m.scale.copy_(torch.arange(4.0))
        m.cache.fill_(1.0)

    assert materialize(model, "cpu", init_buffers=init_buffers) == 3  # the tied weight once, two buffers
    assert model.out.weight is model.emb.weight and model.emb.weight.device.type == "cpu"
    assert torch.equal(model.scale, torch.arange(4.0)) and torch.equal(model.cache, torch.ones(3))

    with torch.device("meta"):
        kept = Tied()
    kept.scale = torch.full((4,), 7.0)  # buffers with values are kept; only those on meta need init_buffers
    kept.cache = torch.zeros(3)
    assert materialize(kept, "cpu") == 3
    assert torch.equal(kept.scale, torch.full((4,), 7.0)) and torch.equal(kept.cache, torch.zeros(3))

    real, *_ = make()
    before = {k: v.clone() for k, v in real.state_dict().items()}
    assert materialize(real, "cpu") == 0  # nothing on meta: values left as they are
    assert all(torch.equal(before[k], v) for k, v in real.state_dict().items())
