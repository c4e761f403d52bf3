"""Reading the shards of a node store: what a tensor's directory holds and reads of any region they cover.

Shard I/O one floor below both :class:`~tenplex.store.local.LocalStore` (which
opens readers, caches those of committed versions and writes shards) and
:class:`~tenplex.store.memory.MemoryTier` (which checks the shards it spills):
a version's files in either tier are read the same way.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr
import zarr.storage
from zarr.core.buffer.cpu import NDBuffer

from tenplex.core.version import Version
from tenplex.errors import InvalidInput, InvalidRegion, NotFound, StateLost
from tenplex.ptc.dtypes import itemsize, storage_dtype
from tenplex.ptc.region import Region
from tenplex.store.buffers import crc32c_combine, crc_of, slabs
from tenplex.store.layout import CHUNK_CRCS, read_meta
from tenplex.store.model import ShardInfo, cover, format_checksum
from tenplex.store.names import region_from_key
from tenplex.store.rawchunks import ChunkLayout, ChunkRun, RawChunkReader, checksum_runs

PIECE_BYTES = 32 << 20
"""Bounded buffers for streamed writes and verification."""
MIN_RUN_BYTES = 64 << 10
"""Regions whose chunk-file runs average less than this are copied out rather than served run by run."""


@dataclass(frozen=True, slots=True)
class StoredShard:
    info: ShardInfo
    path: Path
    layout: ChunkLayout | None
    """None when the array's chunks are not raw little-endian elements (read through zarr then)."""
    chunk_crcs: tuple[int, ...] | None = None
    """crc32c of each chunk file as written (chunk-grid order), when the writer recorded them."""


class TensorReader:
    """The shards of one tensor in one version on this node, and reads of any region they cover.

    Opened zarr arrays are kept, so repeated range reads of a committed
    version (the transformer pulls many pieces) skip the metadata reads.
    """

    def __init__(
        self,
        job: str,
        version: Version,
        tensor: str,
        committed: bool,
        shards: list[StoredShard],
        map_chunks: bool = True,
        in_memory: bool = False,
    ) -> None:
        if not shards:
            raise NotFound(f"tensor {tensor!r} has no shards in version {version} of job {job!r}")
        self.job = job
        self.version = version
        self.tensor = tensor
        self.committed = committed
        self._shards = shards
        first = shards[0].info
        self.dtype = first.dtype
        self.global_shape = first.global_shape
        self._arrays: dict[Path, RawChunkReader | zarr.Array] = {}
        self._lock = threading.Lock()
        self._map_chunks = map_chunks
        self.in_memory = in_memory
        """Whether the shards are read from the store's memory tier (see :mod:`tenplex.store.tiers`)."""

    @property
    def shards(self) -> list[ShardInfo]:
        return [s.info for s in self._shards]

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    def parse_region(self, text: str) -> Region:
        """The HTTP form ``a:b,c:d`` (``:`` = whole dimension) checked against this tensor's shape."""
        return Region.parse(text, self.global_shape)

    def exact_shard(self, region: Region) -> ShardInfo | None:
        """The stored shard whose region is exactly ``region``, if any (its checksum is then known)."""
        stored = self.stored_shard(region)
        return stored.info if stored is not None else None

    def stored_shard(self, region: Region) -> StoredShard | None:
        return next((s for s in self._shards if s.info.region == region), None)

    def _array(self, shard: StoredShard) -> RawChunkReader | zarr.Array:
        """The direct chunk reader of a shard, or zarr's array for a layout the direct path does not know."""
        with self._lock:
            found = self._arrays.get(shard.path)
            if found is None:
                if shard.layout is not None:
                    found = RawChunkReader(shard.path, shard.layout, map_chunks=self._map_chunks,
                                           chunk_crcs=shard.chunk_crcs)
                else:
                    try:
                        found = zarr.open_array(store=zarr.storage.LocalStore(shard.path, read_only=True), mode="r")
                    except FileNotFoundError:
                        raise NotFound(
                            f"a shard of tensor {self.tensor!r} in version {self.version} of job {self.job!r} "
                            "disappeared (the version was deleted or the shard replaced)"
                        ) from None
                self._arrays[shard.path] = found
            return found

    def plan(self, region: Region) -> list[tuple[StoredShard, Region]]:
        """Which stored shard serves which part of ``region``; raises when the shards do not cover it."""
        region.check_within(self.global_shape)
        if region.empty:
            return []
        parts, missing = cover(self._shards, lambda s: s.info.region, region)
        if missing:
            raise StateLost(
                f"tensor {self.tensor!r} (shape {list(self.global_shape)}) in version {self.version} of job "
                f"{self.job!r}: region {region.format()!r} is not covered by the shards on this node; missing {missing}"
            )
        return parts

    def read(self, region: Region, out: np.ndarray) -> None:
        """Fill ``out`` (storage dtype, shape ``region.shape``) from the shards; reads only the chunks the region touches."""
        if out.shape != region.shape:
            raise InvalidRegion(f"output buffer has shape {list(out.shape)}, region {region.format()!r} has {list(region.shape)}")
        for shard, common in self.plan(region):
            src = common.relative_to(shard.info.region)
            dst = out[common.relative_to(region).slices()] if region.ndim else out  # out[()] would be a copy
            arr = self._array(shard)
            if isinstance(arr, RawChunkReader):
                arr.read(src, dst)
            else:
                arr.get_basic_selection(src.slices(), out=NDBuffer.from_numpy_array(dst))

    def runs(self, region: Region, min_run_bytes: int = MIN_RUN_BYTES) -> list[ChunkRun] | None:
        """The region's payload as runs of chunk-file bytes (see :meth:`RawChunkReader.runs`), or None.

        None when the region is not inside one shard with raw chunk files, or
        when its runs would average under ``min_run_bytes`` (small regions, or
        row segments of chunks narrower than the region: copying those out is
        cheaper than mapping and handling each run). Raises like :meth:`plan`
        when the shards do not cover the region.
        """
        parts = self.plan(region)
        if not parts:
            return []
        if len(parts) != 1:
            return None
        shard, _common = parts[0]
        arr = self._array(shard)
        if not isinstance(arr, RawChunkReader):
            return None
        sel = region.relative_to(shard.info.region)
        if arr.run_count(sel) * min_run_bytes > region.volume * self.itemsize:
            return None
        return arr.runs(sel)

    def recorded_checksum(self, runs: Sequence[ChunkRun]) -> int | None:
        """The crc32c of a payload of whole chunk files from the checksums recorded when they were
        written (combined, no pass over the bytes), or None when some run is part of a chunk or its
        shard recorded none. Like a whole shard's recorded checksum, it describes the bytes written:
        damage on this disk shows up as a mismatch where the payload is verified."""
        crc: int | None = None
        for run in runs:
            recorded = run.reader.recorded_crc(run.coords) if run.offset == 0 else None
            if recorded is None or run.nbytes != run.reader.chunk_bytes:
                return None
            crc = recorded if crc is None else crc32c_combine(crc, recorded, run.nbytes)
        return crc

    def checksum(self, region: Region, piece_bytes: int = PIECE_BYTES) -> int:
        """crc32c of the region's C-order bytes.

        Read in place from the page cache (no copy, ``piece_bytes`` mapped at a
        time) when the region is runs of chunk files; otherwise copied through
        one bounded buffer.
        """
        runs = self.runs(region)
        if runs is not None:
            return checksum_runs(runs, piece_bytes)
        crc = 0
        st = storage_dtype(self.dtype)
        pieces = list(slabs(region.shape, self.itemsize, piece_bytes))
        flat = np.empty(max(p.volume for p in pieces), st)  # one buffer for every piece: no page faults after the first
        for piece in pieces:
            buf = flat[: piece.volume].reshape(piece.shape)
            self.read(piece.shift(region.start), buf)
            crc = crc_of(buf, crc)
        return crc


def scan_tensor(tdir: Path, tensor: str, limit: int | None = None) -> list[StoredShard]:
    """The shards stored in a tensor's directory (at most ``limit``), in name order; shards replaced or deleted
    meanwhile are skipped."""
    out: list[StoredShard] = []
    try:
        entries = sorted(os.listdir(tdir))
    except FileNotFoundError:
        return out
    for name in entries:
        region = region_from_key(name)
        if region is None:
            continue
        try:
            meta, rec = read_meta(tdir / name)
        except FileNotFoundError:
            continue  # replaced or deleted while we looked
        info = ShardInfo.from_json(rec)
        if info.tensor != tensor or info.region != region:
            raise InvalidInput(f"shard {tdir / name} records tensor {info.tensor!r} region {info.region}; the store is corrupt")
        crcs = meta["attributes"].get(CHUNK_CRCS)
        chunk_crcs = tuple(int(c) for c in crcs) if isinstance(crcs, list) else None
        out.append(StoredShard(info, tdir / name, ChunkLayout.from_metadata(meta), chunk_crcs))
        if limit is not None and len(out) >= limit:
            break
    return out


def damage(reader: TensorReader, shard: StoredShard, region: Region) -> str | None:
    """What is wrong with a stored shard's bytes, or None: each chunk file against its recorded crc32c
    where the writer recorded them (whole files, sequential, no copies), else one pass against the
    shard's checksum."""
    if shard.chunk_crcs is not None and shard.layout is not None:
        return RawChunkReader(shard.path, shard.layout).verify_chunks(shard.chunk_crcs)
    crc = format_checksum(reader.checksum(region))
    return None if crc == shard.info.checksum else f"crc32c {crc}, recorded {shard.info.checksum}"
