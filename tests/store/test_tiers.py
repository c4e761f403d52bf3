"""The node store's memory tier (tenplex.store.tiers) with real files: a tmpfs memory root and a disk root.

Commit -> readable from memory at once; spill -> a disk copy checked chunk by chunk; eviction within the
budget (only what is durable); a restarted daemon finds the memory versions and spills the unspilled; a
memory root that is not the tier's (foreign, emptied by a reboot) is never used; snapshots of a worker
land in the tier's memory files; the daemon's flags and metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tenplex.core.version import Version
from tenplex.errors import ChecksumMismatch, InvalidInput, StoreUnavailable
from tenplex.node.store_routes import StoreServer
from tenplex.ptc import PTC, Device, Region, build_tensor
from tenplex.store.client import StoreClient
from tenplex.store.layout import BUDGET_LOCK, flocked
from tenplex.store.local import LocalStore
from tenplex.store.memory import MemoryTier, Spiller
from tenplex.store.tiers import RECORD, TIER_ID, recorded_tier
from tenplex.worker.snapshot import Snapshotter
from tenplex.worker.state import live_pieces

JOB = "j"
SHAPE = (64, 256)  # 64 KiB of float32
NBYTES = SHAPE[0] * SHAPE[1] * 4
WHOLE = Region.full(SHAPE)


def data(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def owned(disk: Path, memory_root: Path, budget: int, *, poll_s: float = 0.02, **options: Any) -> LocalStore:
    """The tier's owner, as the node daemon: it makes the tier, records it in the root and runs its spiller."""
    tier = MemoryTier.open(disk, memory_root, budget, owner=True)
    assert tier is not None
    tier.start_spilling(poll_s=poll_s)
    return LocalStore(disk, memory=tier, **options)


def put(store: LocalStore, version: str, seed: int, *, commit: bool = True) -> None:
    store.write_shard(JOB, version, "w", WHOLE, data(seed), dtype="float32", global_shape=SHAPE)
    if commit:
        store.commit(JOB, version)


def read(store: LocalStore, version: str) -> np.ndarray:
    out = np.empty(SHAPE, dtype=np.float32)
    store.read_into(JOB, version, "w", WHOLE, out)
    return out


def chunk_files(vdir: Path) -> list[Path]:
    return sorted(Path(d) / f for d, _s, files in os.walk(vdir) for f in files if f != "zarr.json")


def info(store: LocalStore, version: str):  # noqa: ANN201
    return next(v for v in store.versions(JOB) if str(v.version) == version)


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    return tmp_path / "disk"


@pytest.fixture
def owner(disk: Path, memory_root: Path) -> Iterator[LocalStore]:
    """The tier's owner (as the daemon), its spiller not running: the tests spill when they choose."""
    with owned(disk, memory_root, 3 * NBYTES + 4096, poll_s=3600, chunk_bytes=16 << 10) as s:
        assert s.memory.spiller is not None
        s.memory.spiller.stop()
        yield s  # type: ignore[misc]


def test_a_committed_version_is_read_from_memory_and_not_durable_until_spilled(owner: LocalStore, memory_root: Path,
                                                                             disk: Path) -> None:
    put(owner, "s1-g0", 1)
    vi = info(owner, "s1-g0")
    assert vi.committed and vi.in_memory and not vi.durable
    assert not owner.manifest(JOB, "s1-g0").durable
    assert np.array_equal(read(owner, "s1-g0"), data(1))
    assert chunk_files(memory_root / JOB / "s1-g0") and not (disk / JOB / "s1-g0").exists()
    stats = owner.memory.stats()
    assert stats.pop("spill_lag") >= 0
    assert stats == {"budget": 3 * NBYTES + 4096, "used": NBYTES, "versions": 1, "unspilled": 1}
    assert owner.memory.unspilled() == [(JOB, Version.parse("s1-g0"))]

    assert owner.memory.spill(JOB, "s1-g0") == NBYTES
    assert owner.memory.spill(JOB, "s1-g0") is None  # nothing left to do
    vi = info(owner, "s1-g0")
    assert vi.committed and vi.in_memory and vi.durable
    mem, dsk = chunk_files(memory_root / JOB / "s1-g0"), chunk_files(disk / JOB / "s1-g0")
    assert [p.relative_to(memory_root) for p in mem] == [p.relative_to(disk) for p in dsk]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(mem, dsk, strict=True))
    assert owner.verify(JOB, "s1-g0") == []
    assert owner.memory.stats()["unspilled"] == 0 and owner.memory.stats()["spill_lag"] == 0


def test_a_damaged_memory_copy_is_not_made_durable(owner: LocalStore, memory_root: Path, disk: Path) -> None:
    put(owner, "s1-g0", 1)
    victim = chunk_files(memory_root / JOB / "s1-g0")[0]
    raw = bytearray(victim.read_bytes())
    raw[7] ^= 0xFF
    victim.write_bytes(raw)
    with pytest.raises(ChecksumMismatch, match="memory copy is damaged"):
        owner.memory.spill(JOB, "s1-g0")
    assert not owner.manifest(JOB, "s1-g0").durable and not (disk / JOB / "s1-g0").exists()
    # a spiller round counts the failure and retries the version later, with a growing delay
    spiller = Spiller(owner.memory)
    assert spiller.run_once() == 0 and spiller.failures == 1
    assert spiller.run_once() == 0 and spiller.failures == 1  # not retried at once


def test_eviction_keeps_the_tier_within_its_budget_and_only_evicts_durable_versions(owner: LocalStore) -> None:
    budget = owner.memory.budget  # type: ignore[union-attr]
    for i in range(1, 4):
        put(owner, f"s{i}-g0", i)
    assert owner.memory.used() == 3 * NBYTES <= budget
    # nothing is durable yet: a fourth version does not fit and nothing may be evicted -> it goes to disk
    put(owner, "s4-g0", 4)
    vi = info(owner, "s4-g0")
    assert vi.committed and vi.durable and not vi.in_memory
    assert owner.memory.used() == 3 * NBYTES

    owner.memory.spill(JOB, "s1-g0")
    owner.memory.spill(JOB, "s2-g0")
    put(owner, "s5-g0", 5)  # the oldest durable one (s1) makes room
    assert info(owner, "s5-g0").in_memory and not info(owner, "s1-g0").in_memory
    assert owner.memory.used() <= budget
    for i in range(1, 6):  # every version still reads right, from wherever it is
        assert np.array_equal(read(owner, f"s{i}-g0"), data(i))
    # the evicted version's memory files go after the grace period
    owner.memory.settings = replace(owner.memory.settings, evict_grace_s=0.0)  # type: ignore[union-attr]
    assert owner.memory.reap_evicted() == 1
    assert not (owner.memory.root / JOB / "s1-g0").exists()
    assert np.array_equal(read(owner, "s1-g0"), data(1))


def test_a_version_larger_than_the_budget_is_written_to_disk(owner: LocalStore) -> None:
    big = (4 * SHAPE[0], SHAPE[1])
    owner.write_shard(JOB, "s1-g0", "big", Region.full(big), np.zeros(big, np.float32), dtype="float32", global_shape=big)
    owner.commit(JOB, "s1-g0")
    vi = info(owner, "s1-g0")
    assert vi.durable and not vi.in_memory and owner.memory.used() == 0


def test_a_restarted_daemon_finds_its_memory_versions_and_spills_the_unspilled(disk: Path, memory_root: Path) -> None:
    first = owned(disk, memory_root, 8 * NBYTES, poll_s=3600)
    assert first.memory.spiller is not None
    first.memory.spiller.stop()  # killed before it spilled anything
    put(first, "s1-g0", 1)
    put(first, "s2-g0", 2)
    first.close()
    tier_id = (memory_root / TIER_ID).read_text()

    with owned(disk, memory_root, 8 * NBYTES) as again:
        assert again.memory is not None and again.memory.settings.tier_id == tier_id  # the same tier, kept across the restart
        assert [str(v.version) for v in again.versions(JOB)] == ["s1-g0", "s2-g0"]
        deadline = time.monotonic() + 30
        while again.memory.unspilled() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert again.memory.unspilled() == []
        assert all(v.durable and v.in_memory for v in again.versions(JOB))
    # what is on disk alone is the same state: a store without the tier reads both versions
    (disk / RECORD).unlink()
    plain = LocalStore(disk)
    assert plain.memory is None
    assert np.array_equal(read(plain, "s1-g0"), data(1)) and np.array_equal(read(plain, "s2-g0"), data(2))


def test_a_memory_root_that_is_not_the_tiers_is_not_used(disk: Path, memory_root: Path, tmp_path: Path) -> None:
    with owned(disk, memory_root, 8 * NBYTES):
        recorded = recorded_tier(disk)
        assert recorded is not None and recorded.root == memory_root.resolve()
        # a worker that sees the tier where it was recorded, or mounted elsewhere with the same id: used
        worker = LocalStore(disk)
        assert worker.memory is not None and worker.memory.root == memory_root.resolve()
        # a foreign directory given as the memory root (no id, or another tier's): not used, writes go to disk
        foreign = tmp_path / "foreign"
        foreign.mkdir()
        stray = LocalStore(disk, memory_root=foreign)
        assert stray.memory is None
        (foreign / TIER_ID).write_text("someone-else")
        assert LocalStore(disk, memory_root=foreign).memory is None
        put(stray, "s1-g0", 1)
        assert info(stray, "s1-g0").durable and not list(foreign.glob(f"{JOB}/*"))
    # the node rebooted: tmpfs is empty, the record in the disk root names a tier that is gone
    for p in memory_root.iterdir():
        if p.is_file():
            p.unlink()
    assert LocalStore(disk).memory is None
    # a root whose daemon runs without a tier: a worker's memory root is not used either
    MemoryTier.open(disk, owner=True)
    assert recorded_tier(disk) is None and LocalStore(disk, memory_root=memory_root).memory is None


def test_bad_memory_tier_settings_are_clear_errors(disk: Path, memory_root: Path) -> None:
    with pytest.raises(InvalidInput, match="needs memory_root"):
        LocalStore(disk, memory_bytes=1 << 20)
    with pytest.raises(InvalidInput, match="needs memory_bytes"):
        MemoryTier.open(disk, memory_root, owner=True)
    for bad in (0, -5):
        with pytest.raises(InvalidInput, match="budget must be a positive number of bytes"):
            MemoryTier.open(disk, memory_root, bad, owner=True)


def test_snapshots_land_in_the_memory_tier_and_unchanged_shards_are_linked(disk: Path, memory_root: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))
    model[1].weight.requires_grad_(False)  # frozen: unchanged between snapshots
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    def train() -> None:
        loss = model(torch.randn(4, 32)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    train()
    pieces = live_pieces(model, opt)
    ptc = PTC(config={"dp": 1}, devices=(Device(0, "node-0"),),
              tensors=tuple(build_tensor(p.name, p.global_shape, p.dtype, p.kind, [(Region.full(p.global_shape), (0,))])
                            for p in pieces))
    with owned(disk, memory_root, 64 << 20) as daemon, StoreServer(disk, store=daemon) as srv, \
            StoreClient(srv.url) as client:
        # as a worker with the store root mounted: it finds the tier in the root, and the daemon places its versions
        worker = LocalStore(disk, placement=client)
        assert worker.memory is not None
        snap = Snapshotter(worker, JOB, ptc, rank=0)
        try:
            snap.snapshot(1, 0, model, opt)
            first = snap.wait()
            assert first is not None and first.committed and first.readable_seconds is not None
            assert first.shards_linked == 0
            train()
            snap.snapshot(2, 0, model, opt)
            second = snap.wait()
            assert second is not None and second.committed and second.shards_linked >= 1  # the frozen weight
        finally:
            snap.close()
        assert not (memory_root / ".buffers" / JOB).exists() or not any((memory_root / ".buffers" / JOB).iterdir())
        # one reservation per snapshot, whatever its number of shards
        assert len(pieces) > 2 and 'tenplex_store_reservations_total{tier="memory"} 2.0' in client.metrics()
        for vi in daemon.versions(JOB):
            assert vi.committed and vi.in_memory
        # the version's shards are the snapshot's memory files, read back from memory by a peer's daemon
        w = model[0].weight.detach().numpy()
        out = np.empty_like(w)
        daemon.read_into(JOB, second.version, "0.weight", Region.full(w.shape), out)
        assert np.array_equal(out, w)
        deadline = time.monotonic() + 30
        while daemon.memory.unspilled() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(v.durable for v in daemon.versions(JOB))


def test_a_worker_writes_into_room_the_daemon_reserved_and_never_takes_the_budget_lock(disk: Path,
                                                                                      memory_root: Path) -> None:
    with owned(disk, memory_root, 3 * NBYTES + 4096, poll_s=3600) as daemon:
        srv = StoreServer(disk, store=daemon).start()
        client = StoreClient(srv.url, retries=0)
        worker = LocalStore(disk, placement=client)
        worker.reserve(JOB, "s1-g0", 2 * NBYTES)
        claim = json.loads((memory_root / JOB / ".claims" / "s1-g0.json").read_text())
        assert claim == {"reserved": 2 * NBYTES, "used": 2 * NBYTES} and daemon.memory.used() == 2 * NBYTES
        restarted = MemoryTier.open(disk)  # a daemon started again reads the reservation from the tier's files
        assert restarted is not None and restarted.used() == 2 * NBYTES

        def write(version: str, names: list[str]) -> None:
            for i, name in enumerate(names):
                worker.write_shard(JOB, version, name, WHOLE, data(i), dtype="float32", global_shape=SHAPE)

        with flocked(memory_root / BUDGET_LOCK):  # the reserved room is written without the budget lock
            writer = threading.Thread(target=write, args=("s1-g0", ["a", "b"]))
            writer.start()
            writer.join(60)
            assert not writer.is_alive()
        worker.commit(JOB, "s1-g0")
        assert info(daemon, "s1-g0").in_memory and daemon.memory.used() == 2 * NBYTES
        out = np.empty(SHAPE, np.float32)
        daemon.read_into(JOB, "s1-g0", "b", WHOLE, out)
        assert np.array_equal(out, data(1))

        daemon.memory.spill(JOB, "s1-g0")
        worker.reserve(JOB, "s2-g0", NBYTES)  # in memory: s1-g0, spilled, is evicted to make room
        assert info(daemon, "s2-g0").in_memory and not info(daemon, "s1-g0").in_memory
        daemon.delete(JOB, "s2-g0")  # by another process meanwhile: the room goes with the version
        write("s2-g0", ["a"])  # placed anew by the daemon, not written unclaimed into the room of before
        claim = json.loads((memory_root / JOB / ".claims" / "s2-g0.json").read_text())
        assert claim == {"reserved": 2 * NBYTES, "used": NBYTES}
        worker.reserve(JOB, "s2-g0", NBYTES)
        srv.stop()
        write("s2-g0", ["b"])  # within the reservation: no call
        with pytest.raises(StoreUnavailable, match="in the memory tier and its daemon"):
            write("s2-g0", ["c"])  # more than reserved, the daemon is gone: not written unclaimed
        worker.reserve(JOB, "s3-g0", NBYTES)  # a new version while the daemon is down: on disk, pinned there
        write("s3-g0", ["a"])
        worker.commit(JOB, "s3-g0")
        assert info(worker, "s3-g0").durable and not info(worker, "s3-g0").in_memory
        assert daemon.memory.used() <= daemon.memory.budget
        client.close()


def test_the_daemon_takes_the_tier_from_its_flags_and_reports_it_in_metrics(tmp_path: Path, memory_root: Path) -> None:
    root, port_file = tmp_path / "root", tmp_path / "port"
    base = [sys.executable, "-m", "tenplex", "store", "serve", "--root", str(root), "--port", "0"]
    bad = subprocess.run([*base, "--memory-root", str(memory_root)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "memory" in bad.stderr
    proc = subprocess.Popen([*base, "--port-file", str(port_file), "--memory-root", str(memory_root),
                             "--memory-bytes", "8Mi"], env={**os.environ, "TENPLEX_TOKEN": ""})
    try:
        deadline = time.monotonic() + 180  # generous: a loaded 2-core machine starts Python slowly
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        assert json.loads((root / RECORD).read_text())["budget"] == 8 << 20
        worker = LocalStore(root)
        put(worker, "s1-g0", 1)  # a worker writing directly: into the daemon's memory; the daemon spills it
        from tenplex.store.client import StoreClient

        with StoreClient(url) as client:
            deadline = time.monotonic() + 120
            while not client.manifest(JOB, "s1-g0").durable:
                assert time.monotonic() < deadline, "the daemon did not spill the version"
                time.sleep(0.05)
            [vi] = client.versions(JOB)
            assert vi.in_memory and vi.durable
            metrics = client.metrics()
        values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
        assert float(values["tenplex_store_memory_budget_bytes"]) == 8 << 20
        assert float(values["tenplex_store_memory_used_bytes"]) == NBYTES
        assert float(values["tenplex_store_memory_versions"]) == 1
        assert float(values["tenplex_store_memory_unspilled_versions"]) == 0
        assert float(values["tenplex_store_memory_spill_lag_seconds"]) == 0
        assert float(values["tenplex_store_spilled_versions_total"]) == 1
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_spill_interval_spills_the_newest_version_and_skips_the_ones_in_between(owner: LocalStore) -> None:
    with pytest.raises(InvalidInput, match="spill interval"):
        Spiller(owner.memory, interval_s=-1)
    spiller = Spiller(owner.memory, interval_s=3600)
    put(owner, "s1-g0", 1)
    assert spiller.run_once() == 1  # the first one at once
    put(owner, "s2-g0", 2)
    put(owner, "s3-g0", 3)
    assert spiller.run_once() == 0  # within the interval: both wait, in memory, readable
    assert [v.durable for v in owner.versions(JOB)] == [True, False, False]
    assert np.array_equal(read(owner, "s3-g0"), data(3))
    spiller._last_spill.clear()  # the interval has passed
    assert spiller.run_once() == 1
    assert [v.durable for v in owner.versions(JOB)] == [True, False, True]  # the newest; s2 was superseded
    every = Spiller(owner.memory)  # interval 0: everything left, at once
    assert every.run_once() == 1 and all(v.durable for v in owner.versions(JOB))
