"""The memory tier under interleaved reserve / write / commit / evict / spill / restart (hypothesis stateful).

The model is zarr-python's ``stateful.py``: a :class:`RuleBasedStateMachine` drives real stores on real
files (a tmpfs memory root where there is one, a disk root) and keeps a model of what must be there; the
invariants are checked after every step:

- the tier's budget is never exceeded (committed versions in memory plus what writers reserved/claimed);
- nothing committed is lost, and a committed version reads back bit-identical (checksums verified) from
  whichever tier holds it, through the daemon's store and through a worker's store sharing the root;
- nothing uncommitted is served as committed;
- the store's listing of versions (committed, durable, in memory) agrees with the tier.

A restart is a new tier object and new stores over the same directories (the daemon's process died and
came back; a worker's store opened again). Writers are the owner's store and a worker's store that
found the tier through the root's record, as on a node; snapshot buffers (linked into versions without a
copy) are one of the ways a shard is written.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tenplex.core.version import Version
from tenplex.errors import Conflict, NotFound
from tenplex.ptc import Region
from tenplex.store.local import LocalStore
from tenplex.store.memory import MemoryTier, Spiller
from tests.conftest import memory_dir

JOB = "j"
ROWS = 16
COLS = 64  # 4 KiB of float32 per shard of the widest tensor
TENSORS = {"a": (ROWS, COLS), "b": (ROWS, COLS // 2)}
"""Two tensors of two shards each (rows 0-8 and 8-16): a version holds 6 KiB to 12 KiB."""
BUDGET = 26 << 10  # two or three versions fit: eviction, demotion and writes to disk all happen
VERSIONS = [Version(step, 0) for step in range(1, 7)]

Shard = tuple[str, int]  # (tensor, first row)


def region(shard: Shard) -> Region:
    tensor, row = shard
    return Region.of([(row, row + ROWS // 2), (0, TENSORS[tensor][1])])


def payload(shard: Shard, seed: int) -> np.ndarray:
    shape = region(shard).shape
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


class TierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._stack = contextlib.ExitStack()
        self.base = Path(tempfile.mkdtemp(prefix="tenplex-tier-stateful-"))
        self._stack.callback(shutil.rmtree, self.base, ignore_errors=True)
        self.disk = self.base / "disk"
        self.mem = self._stack.enter_context(memory_dir(self.base / "memory"))
        self.written: dict[Version, dict[Shard, np.ndarray]] = {}
        """Uncommitted versions: what their writers stored."""
        self.committed: dict[Version, dict[Shard, np.ndarray]] = {}
        self._open()

    def _open(self) -> None:
        """The node's processes (again): the daemon owns the tier; a worker finds it in the root's record."""
        tier = MemoryTier.open(self.disk, self.mem, BUDGET, evict_grace_s=0.0, owner=True, durable=False)
        assert tier is not None
        self.tier = tier
        self.spiller = Spiller(tier)  # run by the rules, not by a thread: the machine chooses when
        self.daemon = LocalStore(self.disk, memory=tier, chunk_bytes=2048, durable=False)
        self.worker = LocalStore(self.disk, chunk_bytes=2048, durable=False)
        assert self.worker.memory is not None and self.worker.memory.settings.tier_id == tier.settings.tier_id

    def _close(self) -> None:
        self.worker.close()
        self.daemon.close()

    def teardown(self) -> None:
        self._close()
        self._stack.close()

    def _store(self, by_worker: bool) -> LocalStore:
        return self.worker if by_worker else self.daemon

    # -- rules ------------------------------------------------------------------------------------

    @rule(version=st.sampled_from(VERSIONS), shard=st.sampled_from([(t, r) for t in TENSORS for r in (0, ROWS // 2)]),
          seed=st.integers(0, 3), by_worker=st.booleans(), by_slot=st.booleans())
    def write(self, version: Version, shard: Shard, seed: int, by_worker: bool, by_slot: bool) -> None:
        """Reserve room (the version's first write places it) and write one shard, directly or through a
        snapshot buffer linked into the version."""
        store = self._store(by_worker)
        data = payload(shard, seed)
        tensor = shard[0]
        if version in self.committed:
            with pytest.raises(Conflict):
                store.write_shard(JOB, version, tensor, region(shard), data, dtype="float32", global_shape=TENSORS[tensor])
            return
        if by_slot:
            slots = store.snapshot_buffers(JOB)
            assert slots is not None
            try:
                buf = slots.acquire(tensor, region(shard), "float32", data.nbytes)
                buf[:] = data.view(np.uint8).reshape(-1)
                slots.store(version, tensor, region(shard), "float32", TENSORS[tensor])
            finally:
                slots.close()
        else:
            store.write_shard(JOB, version, tensor, region(shard), data, dtype="float32", global_shape=TENSORS[tensor])
        self.written.setdefault(version, {})[shard] = data
        event("written into memory" if self.tier.working_dir(JOB, version) is not None else "written to disk")

    @rule(version=st.sampled_from(VERSIONS), kib=st.integers(0, 12), by_worker=st.booleans())
    def reserve(self, version: Version, kib: int, by_worker: bool) -> None:
        """A snapshot's room reserved up front (one placement): that store's writes take from it, and ask
        again only for what outgrows it or once the version was moved to disk or deleted."""
        store = self._store(by_worker)
        if version in self.committed:
            with pytest.raises(Conflict):
                store.reserve(JOB, version, kib << 10)
            return
        store.reserve(JOB, version, kib << 10)
        self.written.setdefault(version, {})
        event("reserved in memory" if self.tier.working_dir(JOB, version) is not None else "reserved on disk")

    @precondition(lambda self: bool(self.written))
    @rule(data=st.data(), by_worker=st.booleans())
    def commit(self, data: st.DataObject, by_worker: bool) -> None:
        version = data.draw(st.sampled_from(sorted(self.written)))
        manifest = self._store(by_worker).commit(JOB, version)
        assert manifest.committed
        self.committed[version] = self.written.pop(version)

    @rule()
    def spill(self) -> None:
        """One round of the owner's spiller: every unspilled version to disk, verified."""
        unspilled = len(self.tier.unspilled())
        assert self.spiller.run_once() == unspilled
        event(f"spilled {min(unspilled, 2)}{'+' if unspilled > 2 else ''}")
        assert self.tier.unspilled() == []

    @precondition(lambda self: bool(self.committed))
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        """Evict a committed version from memory: only a spilled one goes (reads then go to disk)."""
        version = data.draw(st.sampled_from(sorted(self.committed)))
        durable = self.daemon.manifest(JOB, version).durable
        was_in_memory = self.tier.committed(JOB, version)
        freed = self.tier.evict(JOB, version)
        assert (freed is not None) == (was_in_memory and durable)
        event("evicted" if freed is not None else "not evictable")

    @rule()
    def reap(self) -> None:
        self.tier.reap_evicted()
        self.tier.reap_dead_slots()

    @precondition(lambda self: bool(self.committed) or bool(self.written))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        version = data.draw(st.sampled_from(sorted({*self.committed, *self.written})))
        self.daemon.delete(JOB, version)
        self.committed.pop(version, None)
        self.written.pop(version, None)

    @rule()
    def restart(self) -> None:
        """The daemon and the worker start again over the same directories: a new tier object."""
        self._close()
        self._open()

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def budget_is_kept(self) -> None:
        assert self.tier.used() <= BUDGET

    @invariant()
    def committed_versions_read_back_bit_identical(self) -> None:
        for i, (version, shards) in enumerate(sorted(self.committed.items())):
            store = self.worker if i % 2 else self.daemon
            manifest = store.manifest(JOB, version)
            assert manifest.committed
            assert {(s.tensor, s.region.start[0]) for s in manifest.shards} == set(shards)
            for shard, expected in shards.items():
                out = np.empty_like(expected)
                store.read_into(JOB, version, shard[0], region(shard), out)  # verified against its checksum
                assert out.tobytes() == expected.tobytes()

    @invariant()
    def nothing_uncommitted_is_served(self) -> None:
        for version, shards in self.written.items():
            assert not self.daemon.is_committed(JOB, version) and not self.worker.is_committed(JOB, version)
            for tensor in {t for t, _r in shards}:
                with pytest.raises(NotFound):
                    self.daemon.open_tensor(JOB, version, tensor)

    @invariant()
    def listing_agrees_with_the_tier(self) -> None:
        if not self.committed and not self.written:
            return
        listed = {vi.version: vi for vi in self.daemon.versions(JOB)}
        assert {v for v, vi in listed.items() if vi.committed} == set(self.committed)
        assert set(self.written) <= {v for v, vi in listed.items() if not vi.committed}
        unspilled = {v for _j, v in self.tier.unspilled()}
        for v in self.committed:
            vi = listed[v]
            assert vi.in_memory == self.tier.committed(JOB, v)
            assert vi.durable == (v not in unspilled)
            assert vi.in_memory or vi.durable  # held by a tier


TierMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_the_memory_tier_under_interleaved_operations = TierMachine.TestCase
