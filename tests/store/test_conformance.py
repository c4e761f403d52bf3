"""One suite of store behaviours, run against every :class:`~tenplex.store.TensorStore` implementation.

zarr-python's ``StoreTests`` pattern: :class:`StoreTests` holds the behaviours every consumer relies on
(round trips of every dtype, assembly across shards, batch reads, atomic commits, links that share
files, verified reads of damaged shards, the same error classes for the same mistakes), and each
implementation subclasses it with a fixture that gives the store and its root on disk:

- :class:`TestLocalStore`: the store on this machine's disk, used in-process;
- :class:`TestClientOnDaemon`: the HTTP client of a node daemon (store and transform routes) in a thread;
- :class:`TestClientOnMultiprocessDaemon`: the client of ``tenplex store serve --workers 2``, two processes
  on one port sharing the root (requests land on either);
- and the persistent tier's store on ``file://`` and on moto's S3 server (``tests/store/test_persistent.py``).
- :class:`TestLocalStoreWithMemoryTier` and :class:`TestClientOnDaemonWithMemoryTier`: the same with a
  memory tier (versions written, committed and read in a tmpfs directory, spilled to disk in the
  background by the store's spiller while the tests run); ``root`` is then the memory root.

The daemons live for a whole class (each test uses a job of its own); a damaged shard is made by
flipping a byte of a chunk file in the root, as a failing disk would (:meth:`StoreTests.damage`, which a
store without a root directory overrides).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tenplex.core.version import Version
from tenplex.errors import (
    ChecksumMismatch,
    Conflict,
    InvalidInput,
    NotFound,
    RegionOutOfBounds,
    StateLost,
)
from tenplex.node.daemon import NodeDaemon
from tenplex.ptc.dtypes import DTYPES
from tenplex.ptc.region import Region
from tenplex.store import Manifest, RegionRead, StoreClient, TensorStore, open_store
from tenplex.store.local import LocalStore
from tenplex.store.memory import MemoryTier
from tenplex.store.names import region_key, tensor_dirname
from tenplex.store.persistent import PersistentStore
from tenplex.store.wire import MAX_BATCH_REGIONS
from tenplex.testing.processes import stop_processes

from .test_local import random_array, same_bits

TOKEN = "conformance-token"
CHUNK_BYTES = 4096  # small chunks: the test tensors span several chunk files
SHAPE = (50, 40)
FULL = np.arange(50 * 40, dtype=np.float32).reshape(SHAPE)
TILES = [Region((rows, cols)) for rows in ((0, 17), (17, 50)) for cols in ((0, 10), (10, 31), (31, 40))]


def chunk_files(root: Path, job: str, version: str, tensor: str, region: Region) -> list[Path]:
    shard = root / job / version / tensor_dirname(tensor) / region_key(region)
    return sorted(p for p in shard.rglob("*") if p.is_file() and p.name != "zarr.json")


def damage(root: Path, job: str, version: str, tensor: str, region: Region) -> None:
    """Flip one bit of the first chunk file of a stored shard in place (no truncation: a daemon may have it mapped)."""
    path = chunk_files(root, job, version, tensor, region)[0]
    with open(path, "r+b") as f:
        f.seek(5)
        byte = f.read(1)
        f.seek(5)
        f.write(bytes([byte[0] ^ 0x01]))


class StoreTests:
    """The behaviours; a subclass provides ``store`` (a :class:`TensorStore`) and ``root`` (its directory, or
    whatever its :meth:`damage` and :meth:`assert_shared` need)."""

    CHUNKS_ALWAYS_VERIFIED = False
    """Whether the store checks every chunk it reads whatever ``verify`` says (a codec of its format)."""

    def damage(self, root: Path, job: str, version: str, tensor: str, region: Region) -> None:
        """Flip one bit of a stored shard, as failing storage would."""
        damage(root, job, version, tensor, region)

    def assert_shared(self, root: Path, job: str, old: str, new: str, tensor: str, region: Region) -> None:
        """The linked shard's data in ``new`` is the old one's, not a copy made through the client."""
        old_files, new_files = chunk_files(root, job, old, tensor, region), chunk_files(root, job, new, tensor, region)
        assert len(old_files) > 1 and [p.stat().st_ino for p in old_files] == [p.stat().st_ino for p in new_files]  # hard links

    @pytest.fixture
    def job(self, request: pytest.FixtureRequest) -> str:
        """A job of this test's own (the daemons are shared by a class)."""
        return re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:100]

    def write_tiled(self, store: TensorStore, job: str, version: str = "s5-g0", tensor: str = "layers.0/w", *, commit: bool = True) -> None:
        """A 50x40 tensor as a 2x3 grid of uneven shards (a TP x PP-like tiling)."""
        for box in TILES:
            store.write_shard(job, version, tensor, box, np.ascontiguousarray(FULL[box.slices()]), dtype="float32", global_shape=SHAPE)
        if commit:
            store.commit(job, version)

    # -- where it is ------------------------------------------------------------------

    def test_url_opens_the_same_store(self, store: TensorStore, job: str) -> None:
        assert isinstance(store, TensorStore)
        assert store.url.startswith(("http://", "file://", "s3://", "/"))
        store.write_shard(job, "s1-g0", "w", Region.full((3,)), np.arange(3, dtype=np.int64), dtype="int64", global_shape=(3,))
        store.commit(job, "s1-g0")
        with open_store(store.url, TOKEN) as again:
            assert type(again) is type(store)
            assert again.read(job, "s1-g0", "w", Region.full((3,)), "int64").tolist() == [0, 1, 2]

    # -- round trips -------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", sorted(DTYPES))
    def test_every_dtype_round_trips_bit_exactly(self, store: TensorStore, job: str, dtype: str) -> None:
        data = random_array((37, 23), dtype)  # every bit pattern: NaN payloads, -0.0, subnormals
        region = Region.full(data.shape)
        info = store.write_shard(job, "s1-g0", "w", region, data, dtype=dtype, global_shape=data.shape)
        assert (info.tensor, info.region, info.dtype, info.nbytes) == ("w", region, dtype, data.nbytes)
        out = np.empty_like(data)
        store.read_into(job, "s1-g0", "w", region, out, uncommitted=True)
        assert same_bits(out, data)
        store.commit(job, "s1-g0")
        out = np.empty_like(data)
        store.read_into(job, Version(1, 0), "w", region, out)
        assert same_bits(out, data)
        assert same_bits(store.read(job, "s1-g0", "w", Region(((3, 30), (1, 22))), dtype), np.ascontiguousarray(data[3:30, 1:22]))

    def test_torch_buffers_in_and_out(self, store: TensorStore, job: str) -> None:
        t = torch.randn(9, 17, dtype=torch.bfloat16)
        store.write_shard(job, Version(3, 1), "emb", Region.full((9, 17)), t, dtype="bfloat16", global_shape=(9, 17))
        store.commit(job, "s3-g1")
        out = torch.empty(4, 5, dtype=torch.bfloat16)
        store.read_into(job, "s3-g1", "emb", Region(((2, 6), (10, 15))), out)
        assert torch.equal(out.view(torch.int16), t[2:6, 10:15].view(torch.int16))
        as_u16 = np.empty((9, 17), np.uint16)  # a numpy uint16 buffer is the stored form of bfloat16
        store.read_into(job, "s3-g1", "emb", Region.full((9, 17)), as_u16)
        assert as_u16.tobytes() == t.view(torch.int16).numpy().tobytes()

    def test_zero_dim_and_empty_tensors(self, store: TensorStore, job: str) -> None:
        store.write_shard(job, "s1-g0", "step", Region(()), np.array(7, np.int64), dtype="int64", global_shape=())
        store.write_shard(job, "s1-g0", "nothing", Region.full((0, 5)), np.empty((0, 5), np.float32), dtype="float32", global_shape=(0, 5))
        store.commit(job, "s1-g0")
        out = np.empty((), np.int64)
        store.read_into(job, "s1-g0", "step", Region(()), out)
        assert int(out) == 7
        store.read_into(job, "s1-g0", "nothing", Region.full((0, 5)), np.empty((0, 5), np.float32))
        assert store.manifest(job, "s1-g0").tensors == ["nothing", "step"]

    def test_any_covered_region_is_assembled_across_shards(self, store: TensorStore, job: str) -> None:
        self.write_tiled(store, job)
        for region in (Region.full(SHAPE), Region(((5, 45), (3, 38))), Region(((16, 18), (9, 32))), Region(((17, 17), (0, 40))),
                       Region(((0, 1), (39, 40))), *TILES):
            out = np.full(region.shape, -1, np.float32)
            store.read_into(job, "s5-g0", "layers.0/w", region, out)
            assert np.array_equal(out, FULL[region.slices()]), region

    def test_batch_reads_fill_every_buffer_in_order(self, store: TensorStore, job: str) -> None:
        self.write_tiled(store, job, version="s1-g0", tensor="w", commit=False)
        data = random_array((96,), "bfloat16", seed=2)
        store.write_shard(job, "s1-g0", "bias", Region.full((96,)), data, dtype="bfloat16", global_shape=(96,))
        store.commit(job, "s1-g0")
        wanted = [("w", box) for box in TILES] + [("bias", Region(((i, i + 1),))) for i in range(96)] * 3
        wanted += [("w", Region(((5, 45), (3, 38)))), ("bias", Region.full((96,)))]
        assert len(wanted) > MAX_BATCH_REGIONS  # the client cuts it into batches the daemon accepts
        reads = [RegionRead(t, r, np.empty(r.shape, np.float32 if t == "w" else np.uint16)) for t, r in wanted]
        store.read_regions(job, "s1-g0", reads)
        for r in reads:
            source = FULL if r.tensor == "w" else data
            assert r.out.tobytes() == np.ascontiguousarray(source[r.region.slices()]).tobytes(), (r.tensor, r.region)
        store.read_regions(job, "s1-g0", [])

    # -- versions ------------------------------------------------------------------------

    def test_uncommitted_versions_are_read_only_when_asked(self, store: TensorStore, job: str) -> None:
        store.write_shard(job, "s1-g0", "w", Region.full((4,)), np.ones(4, np.int32), dtype="int32", global_shape=(4,))
        with pytest.raises(NotFound, match="not committed"):
            store.read_into(job, "s1-g0", "w", Region.full((4,)), np.empty(4, np.int32))
        with pytest.raises(NotFound, match="not committed"):
            store.read_regions(job, "s1-g0", [RegionRead("w", Region.full((4,)), np.empty(4, np.int32))])
        out = np.empty(4, np.int32)
        store.read_into(job, "s1-g0", "w", Region.full((4,)), out, uncommitted=True)
        assert out.tolist() == [1, 1, 1, 1]

    def test_commit_is_atomic_idempotent_and_freezes_the_version(self, store: TensorStore, job: str) -> None:
        box = Region.full((3, 3))
        store.write_shard(job, "s1-g0", "w", box, np.zeros((3, 3), np.int32), dtype="int32", global_shape=(3, 3))
        store.write_shard(job, "s1-g0", "w", box, np.ones((3, 3), np.int32), dtype="int32", global_shape=(3, 3))  # replaces
        store.write_shard(job, "s1-g0", "b", Region.full((2,)), np.ones(2, np.int8), dtype="int8", global_shape=(2,))
        before = store.manifest(job, "s1-g0")
        assert not before.committed and len(before.shards) == 2
        manifest = store.commit(job, "s1-g0")
        assert isinstance(manifest, Manifest) and manifest.committed
        assert sorted((s.tensor, s.checksum) for s in manifest.shards) == sorted((s.tensor, s.checksum) for s in before.shards)
        assert store.commit(job, "s1-g0") == manifest == store.manifest(job, "s1-g0")
        with pytest.raises(Conflict, match="committed"):
            store.write_shard(job, "s1-g0", "w", box, np.full((3, 3), 2, np.int32), dtype="int32", global_shape=(3, 3))
        assert (store.read(job, "s1-g0", "w", box, "int32") == 1).all()
        with pytest.raises(NotFound):
            store.commit(job, "s2-g0")

    def test_is_committed_says_what_versions_says(self, store: TensorStore, job: str) -> None:
        assert not store.is_committed(job, "s1-g0")  # no such job yet
        store.write_shard(job, "s1-g0", "w", Region.full((2,)), np.zeros(2, np.int8), dtype="int8", global_shape=(2,))
        assert not store.is_committed(job, "s1-g0") and not store.is_committed(job, Version(2, 0))
        store.commit(job, "s1-g0")
        assert store.is_committed(job, "s1-g0") and store.is_committed(job, Version(1, 0))
        assert not store.is_committed(job, "s1-g1")
        store.delete(job, "s1-g0")
        assert not store.is_committed(job, "s1-g0")

    def test_a_wait_for_a_commit_ends_with_the_commit_or_its_timeout(self, store: TensorStore, job: str) -> None:
        assert store.wait_committed(job, "s1-g0", 0.0) is False  # no such job yet
        store.write_shard(job, "s1-g0", "w", Region.full((2,)), np.zeros(2, np.int8), dtype="int8", global_shape=(2,))
        assert store.wait_committed(job, "s1-g0", 0.05) is False
        answer: list[bool] = []
        waiter = threading.Thread(target=lambda: answer.append(store.wait_committed(job, "s1-g0", 30.0)))
        waiter.start()
        store.commit(job, "s1-g0")
        waiter.join(timeout=30)
        assert answer == [True] and store.wait_committed(job, Version(1, 0), 0.0) is True

    def test_versions_jobs_and_manifests(self, store: TensorStore, job: str) -> None:
        for v in ("s10-g0", "s2-g1", "s2-g0", "s10-g2"):
            store.write_shard(job, v, "a/b.c", Region.full((2,)), np.zeros(2, np.float64), dtype="float64", global_shape=(2,))
        store.commit(job, "s2-g1")
        infos = store.versions(job)
        assert [str(vi.version) for vi in infos] == ["s2-g0", "s2-g1", "s10-g0", "s10-g2"]
        assert [vi.committed for vi in infos] == [False, True, False, False]
        assert all(vi.nbytes == 16 for vi in infos)
        m = store.manifest(job, "s2-g1")
        assert m.committed and m.job == job and m.version == Version(2, 1) and m.nbytes == 16
        assert Manifest.from_json(m.to_json()) == m
        assert m.shards[0].tensor == "a/b.c" and m.shards[0].global_shape == (2,) and m.shards[0].checksum.startswith("crc32c:")
        assert job in store.jobs() and store.jobs() == sorted(store.jobs())
        with pytest.raises(NotFound):
            store.versions(job + "-none")
        with pytest.raises(NotFound):
            store.manifest(job, "s99-g0")

    def test_delete_removes_committed_and_uncommitted_versions(self, store: TensorStore, job: str) -> None:
        for v in ("s1-g0", "s2-g0"):
            store.write_shard(job, v, "w", Region.full((2,)), np.zeros(2, np.int8), dtype="int8", global_shape=(2,))
        store.commit(job, "s1-g0")
        store.delete(job, "s1-g0")
        store.delete(job, "s2-g0")
        assert store.versions(job) == []
        with pytest.raises(NotFound):
            store.delete(job, "s1-g0")
        with pytest.raises(NotFound):
            store.read_into(job, "s1-g0", "w", Region.full((2,)), np.empty(2, np.int8))

    def test_concurrent_writers_of_one_version(self, store: TensorStore, job: str) -> None:
        data = random_array((64, 32), "float32", seed=8)
        errors: list[BaseException] = []

        def write(i: int) -> None:
            try:
                box = Region(((8 * i, 8 * i + 8), (0, 32)))
                store.write_shard(job, "s1-g0", "w", box, np.ascontiguousarray(data[box.slices()]), dtype="float32", global_shape=data.shape)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert len(store.commit(job, "s1-g0").shards) == 8
        assert same_bits(store.read(job, "s1-g0", "w", Region.full(data.shape), "float32"), data)

    # -- links ---------------------------------------------------------------------------

    def test_link_shard_shares_the_files_and_survives_deleting_the_old_version(self, store: TensorStore, root: Path, job: str) -> None:
        data = random_array((300, 20), "float32", seed=3)
        top, bottom = Region(((0, 150), (0, 20))), Region(((150, 300), (0, 20)))
        for r in (top, bottom):
            store.write_shard(job, "s1-g0", "w", r, data[r.slices()], dtype="float32", global_shape=data.shape)
        recorded = {sh.region: sh.checksum for sh in store.commit(job, "s1-g0").shards}
        info = store.link_shard(job, "s1-g0", "w", top, "s2-g1")
        assert info.region == top and info.checksum == recorded[top]
        self.assert_shared(root, job, "s1-g0", "s2-g1", "w", top)
        store.write_shard(job, "s2-g1", "w", bottom, data[bottom.slices()], dtype="float32", global_shape=data.shape)
        assert {sh.region: sh.checksum for sh in store.commit(job, "s2-g1").shards} == recorded
        store.delete(job, "s1-g0")
        assert same_bits(store.read(job, "s2-g1", "w", Region.full(data.shape), "float32"), data)

    def test_link_shard_refusals(self, store: TensorStore, root: Path, job: str) -> None:
        data = random_array((64, 64), "float32", seed=4)
        whole = Region.full(data.shape)
        store.write_shard(job, "s1-g0", "w", whole, data, dtype="float32", global_shape=data.shape)
        store.commit(job, "s1-g0")
        with pytest.raises(NotFound, match="exactly region"):
            store.link_shard(job, "s1-g0", "w", Region(((0, 10), (0, 64))), "s2-g0")
        with pytest.raises(NotFound):
            store.link_shard(job, "s1-g1", "w", whole, "s2-g0")  # no such version
        store.write_shard(job, "s3-g0", "w", whole, data, dtype="float32", global_shape=data.shape)
        with pytest.raises(NotFound, match="not committed"):
            store.link_shard(job, "s3-g0", "w", whole, "s4-g0")
        store.commit(job, "s3-g0")
        with pytest.raises(Conflict, match="immutable"):
            store.link_shard(job, "s1-g0", "w", whole, "s3-g0")
        self.damage(root, job, "s1-g0", "w", whole)
        with pytest.raises(ChecksumMismatch, match="damaged"):
            store.link_shard(job, "s1-g0", "w", whole, "s2-g0")
        assert "s2-g0" not in [str(v.version) for v in store.versions(job)]  # nothing was installed
        store.link_shard(job, "s1-g0", "w", whole, "s2-g0", verify=False)  # the caller's choice
        assert [s.region for s in store.manifest(job, "s2-g0").shards] == [whole]

    # -- damage and mistakes -----------------------------------------------------------

    def test_a_damaged_shard_is_a_checksum_mismatch_whichever_side_reads_it(self, store: TensorStore, root: Path, job: str) -> None:
        data = random_array((64, 64), "float32", seed=5)
        whole = Region.full(data.shape)
        store.write_shard(job, "s1-g0", "w", whole, data, dtype="float32", global_shape=data.shape)
        store.commit(job, "s1-g0")
        self.damage(root, job, "s1-g0", "w", whole)
        with pytest.raises(ChecksumMismatch, match="crc32c"):
            store.read_into(job, "s1-g0", "w", whole, np.empty_like(data))
        with pytest.raises(ChecksumMismatch, match="crc32c"):
            store.read_regions(job, "s1-g0", [RegionRead("w", whole, np.empty_like(data))])
        out = np.empty_like(data)
        if self.CHUNKS_ALWAYS_VERIFIED:  # every chunk read is checked by the stored format itself
            with pytest.raises(ChecksumMismatch, match="crc32c"):
                store.read_into(job, "s1-g0", "w", whole, out, verify=False)
            return
        store.read_into(job, "s1-g0", "w", whole, out, verify=False)  # what is on the disk, unchecked
        assert not same_bits(out, data) and (out.view(np.uint8) != data.view(np.uint8)).sum() == 1

    def test_write_refusals_store_nothing(self, store: TensorStore, job: str) -> None:
        box = Region.full((4, 4))
        ok = np.zeros((4, 4), np.float32)
        store.write_shard(job, "s1-g0", "w", Region(((0, 2), (0, 4))), ok[:2], dtype="float32", global_shape=(4, 4))
        before = store.manifest(job, "s1-g0")
        for call, error, match in [
            (lambda: store.write_shard(job, "s1-g0", "w", box, ok.astype(np.float64), dtype="float32", global_shape=(4, 4)), InvalidInput, "float64"),
            (lambda: store.write_shard(job, "s1-g0", "w", box, np.zeros((4, 3), np.float32), dtype="float32", global_shape=(4, 4)), InvalidInput, "shape"),
            (lambda: store.write_shard(job, "s1-g0", "x", Region.full((5, 4)), np.zeros((5, 4), np.float32), dtype="float32", global_shape=(4, 4)), RegionOutOfBounds, None),
            (lambda: store.write_shard(job, "s1-g0", "w", box, ok, dtype="float8", global_shape=(4, 4)), InvalidInput, "dtype"),
            (lambda: store.write_shard(job, "s1-g0", "w", box, torch.zeros(4, 4), dtype="bfloat16", global_shape=(4, 4)), InvalidInput, "torch.float32"),
            (lambda: store.write_shard(job, "s1-g0", "w", box, ok.astype(np.float16), dtype="float16", global_shape=(4, 4)), Conflict, "float32"),
            (lambda: store.write_shard(job, "s1-g0", "w", box, ok, dtype="float32", global_shape=(8, 4)), Conflict, r"\[4, 4\]"),
            (lambda: store.write_shard("../x", "s1-g0", "w", box, ok, dtype="float32", global_shape=(4, 4)), InvalidInput, "job name"),
            (lambda: store.write_shard(job, "s1-g0", "a/../b", box, ok, dtype="float32", global_shape=(4, 4)), InvalidInput, "tensor name"),
            (lambda: store.write_shard(job, "../s1", "w", box, ok, dtype="float32", global_shape=(4, 4)), InvalidInput, "s<step>-g<generation>"),
        ]:
            with pytest.raises(error, match=match):
                call()
        assert store.manifest(job, "s1-g0") == before

    def test_read_refusals(self, store: TensorStore, job: str) -> None:
        self.write_tiled(store, job)
        store.write_shard(job, "s6-g0", "part", Region(((0, 10), (0, 4))), np.zeros((10, 4), np.float32), dtype="float32", global_shape=(20, 4))
        store.commit(job, "s6-g0")
        for call, error, match in [
            (lambda: store.read(job, "s5-g0", "layers.0/w", Region(((0, 51), (0, 1))), "float32"), RegionOutOfBounds, None),
            (lambda: store.read(job, "s5-g0", "layers.0/w", Region(((0, 2),)), "float32"), InvalidInput, None),
            (lambda: store.read_into(job, "s5-g0", "layers.0/w", Region(((0, 2), (0, 2))), np.empty((2, 3), np.float32)), InvalidInput, "shape"),
            (lambda: store.read_into(job, "s5-g0", "layers.0/w", Region(((0, 2), (0, 2))), np.empty((2, 2), np.float64)), InvalidInput, "8-byte"),
            (lambda: store.read_into(job, "s5-g0", "layers.0/w", Region(((0, 2), (0, 2))), np.empty((2, 4), np.float32)[:, ::2]), InvalidInput, "C-contiguous"),
            (lambda: store.read(job, "s5-g0", "nope", Region(((0, 1),)), "float32"), NotFound, "tensor"),
            (lambda: store.read(job, "s7-g0", "layers.0/w", Region(((0, 1), (0, 1))), "float32"), NotFound, "version"),
            (lambda: store.read(job + "-none", "s5-g0", "layers.0/w", Region(((0, 1), (0, 1))), "float32"), NotFound, "job"),
            (lambda: store.read(job, "s5-g0", "../x", Region(((0, 1),)), "float32"), InvalidInput, "tensor name"),
            (lambda: store.read(job, "s6-g0", "part", Region(((5, 15), (0, 4))), "float32"), StateLost, r"10:15,0:4"),
        ]:
            with pytest.raises(error, match=match):
                call()


class TestLocalStore(StoreTests):
    @pytest.fixture
    def root(self, tmp_path: Path) -> Path:
        return tmp_path / "root"

    @pytest.fixture
    def store(self, root: Path) -> Iterator[LocalStore]:
        with LocalStore(root, chunk_bytes=CHUNK_BYTES) as s:
            yield s  # type: ignore[misc]


MEMORY_BUDGET = 64 << 20  # every test version fits: they are written, linked and damaged in memory


def tier_owner(disk: Path, memory_root: Path) -> LocalStore:
    """A store whose memory tier it owns, as the node daemon's: the tier's spiller runs while the tests do."""
    tier = MemoryTier.open(disk, memory_root, MEMORY_BUDGET, owner=True)
    assert tier is not None
    tier.start_spilling(poll_s=0.02)
    return LocalStore(disk, chunk_bytes=CHUNK_BYTES, memory=tier)


class TestLocalStoreWithMemoryTier(StoreTests):
    @pytest.fixture
    def root(self, memory_root: Path) -> Path:
        return memory_root

    @pytest.fixture
    def store(self, root: Path, tmp_path: Path) -> Iterator[LocalStore]:
        with tier_owner(tmp_path / "disk", root) as s:
            yield s  # type: ignore[misc]


@pytest.fixture(scope="module")
def node_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeDaemon]:
    root = tmp_path_factory.mktemp("daemon")
    with NodeDaemon(root, token=TOKEN, store=LocalStore(root, chunk_bytes=CHUNK_BYTES)) as d:
        yield d


@pytest.fixture(scope="module")
def multiprocess_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """``tenplex store serve --workers 2`` in a process of its own: its URL and root."""
    root = tmp_path_factory.mktemp("multiprocess")
    port_file = root.parent / f"{root.name}.port"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tenplex", "--log-level", "WARNING", "store", "serve", "--root", str(root),
         "--port-file", str(port_file), "--workers", "2", "--token", TOKEN, "--chunk-bytes", str(CHUNK_BYTES)],
        env=env,
    )
    try:
        deadline = time.monotonic() + 90
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        with StoreClient(url, TOKEN) as c:
            while not c.health():
                assert proc.poll() is None and time.monotonic() < deadline, "the daemon does not answer"
                time.sleep(0.05)
        yield url, root
    finally:
        stop_processes([proc])


class TestClientOnDaemon(StoreTests):
    @pytest.fixture
    def root(self, node_daemon: NodeDaemon) -> Path:
        return node_daemon.store.root

    @pytest.fixture
    def store(self, node_daemon: NodeDaemon) -> Iterator[StoreClient]:
        with StoreClient(node_daemon.url, TOKEN, retries=1, backoff=0.01) as c:
            yield c


@pytest.fixture(scope="module")
def memory_daemon(tmp_path_factory: pytest.TempPathFactory, module_memory_root: Path) -> Iterator[NodeDaemon]:
    root = tmp_path_factory.mktemp("memory-daemon")
    with NodeDaemon(root, token=TOKEN, store=tier_owner(root, module_memory_root)) as d:
        yield d


class TestClientOnDaemonWithMemoryTier(StoreTests):
    @pytest.fixture
    def root(self, memory_daemon: NodeDaemon) -> Path:
        assert memory_daemon.store.memory is not None
        return memory_daemon.store.memory.root

    @pytest.fixture
    def store(self, memory_daemon: NodeDaemon) -> Iterator[StoreClient]:
        with StoreClient(memory_daemon.url, TOKEN, retries=1, backoff=0.01) as c:
            yield c


@pytest.mark.slow
class TestClientOnMultiprocessDaemon(StoreTests):
    @pytest.fixture
    def root(self, multiprocess_daemon: tuple[str, Path]) -> Path:
        return multiprocess_daemon[1]

    @pytest.fixture
    def store(self, multiprocess_daemon: tuple[str, Path]) -> Iterator[StoreClient]:
        # a few pooled connections, new ones per test: requests are spread over both processes
        with StoreClient(multiprocess_daemon[0], TOKEN, retries=1, backoff=0.01, max_connections=4) as c:
            yield c


def test_open_store_chooses_the_implementation_by_the_address(tmp_path: Path) -> None:
    odd = tmp_path / "a dir with %20 and spaces"
    local = open_store(odd)
    assert isinstance(local, LocalStore) and local.root == odd.resolve()
    again = open_store(local.url)  # a node store's url is its directory
    assert isinstance(again, LocalStore) and again.root == local.root
    assert isinstance(open_store(str(odd)), LocalStore)
    persistent = open_store(odd.as_uri())  # file:// URLs (quoted) are persistent locations
    assert isinstance(persistent, PersistentStore) and persistent.root == odd
    assert isinstance(open_store("s3://bucket-name/some/prefix"), PersistentStore)
    with open_store("http://127.0.0.1:9", "tok") as remote:
        assert isinstance(remote, StoreClient) and remote.url == "http://127.0.0.1:9"
    for bad, match in (("ftp://host/x", "http"), ("file://otherhost/x", "this machine"), ("", "empty")):
        with pytest.raises(InvalidInput, match=match):
            open_store(bad)
