"""Zarr-backed shard storage on a node's local disk: the :class:`~tenplex.store.base.TensorStore` of this machine.

Layout under the root (every bookkeeping entry starts with a dot, which no
job name may)::

    <root>/<job>/<version>/zarr.json                 zarr group of one version
    <root>/<job>/<version>/<tensor>/zarr.json        zarr group per tensor ('/' encoded as %2F)
    <root>/<job>/<version>/<tensor>/r0-96_0-64/      zarr array per shard, attributes["tenplex"]
    <root>/<job>/<version>/<tensor>/r0-96_0-64/c.0.0 its chunk files (key separator '.')
    <root>/<job>/.commits/<version>.json             commit marker = the manifest at commit time
    <root>/<job>/.lock                               flock for structural changes
    <root>/.staging/<job>/                           shards being written, versions being deleted

Why this shape:

- A shard is written into ``.staging`` and renamed into place only when all
  its bytes and its checksum are on disk, so a reader never sees half a shard
  and a writer killed mid-shard leaves only garbage in ``.staging``.
- A version is committed by writing its manifest to a temporary file,
  fsyncing it and renaming it to ``.commits/<version>.json``; the rename is
  atomic, so a crash at any point leaves the version either committed with
  all its data (made durable first) or visibly uncommitted. Committed versions
  are immutable, which is what makes caching their metadata safe.
- Durability is established once, at commit: one ``syncfs`` of the store's
  file system before the marker (per-shard fsyncs cost thousands of calls per
  version for nothing, since an uncommitted version is never served as
  committed). After a machine crash an uncommitted version may hold torn
  shards: writers never resume one, they delete and redo it.
- Structural changes (installing a shard, committing, deleting) take an
  exclusive ``flock`` on the job's lock file, so several processes (workers
  writing directly, the node daemon) can share one root.
- Chunks are ~4 MiB, uncompressed (weights barely compress, codecs halve the
  read speed), bands of whole rows where a row fits
  (:func:`~tenplex.store.buffers.chunk_shape`); every chunk is written even
  when it equals the fill value so that -0.0 and NaN payloads round-trip
  bit-exactly. Chunk files are written with ``O_DIRECT`` (see
  :class:`~tenplex.store.rawchunks.RawChunkWriter`) and their crc32c is
  recorded next to the shard's.
- A shard that a new version keeps unchanged (a transform that leaves it on
  this node) is hard-linked into it (:meth:`LocalStore.link_shard`): committed
  versions are immutable and nothing writes a file in place, so the versions
  can share files.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import math
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr
import zarr.storage
from zarr.core.buffer.cpu import NDBuffer

from tenplex.core.files import atomic_write, fsync_path
from tenplex.core.units import human_bytes
from tenplex.core.version import Version
from tenplex.errors import (
    ChecksumMismatch,
    Conflict,
    InvalidInput,
    InvalidRegion,
    NotFound,
    StateLost,
    TenplexError,
)
from tenplex.ptc.dtypes import check_dtype, itemsize, storage_dtype
from tenplex.ptc.region import Region, subtract
from tenplex.store.base import COMMIT_RECHECK_S, RegionRead, TensorStore
from tenplex.store.buffers import (
    DEFAULT_CHUNK_BYTES,
    ReceivedCrcs,
    chunk_shape,
    crc32c_combine,
    crc_of,
    host_buffer,
    host_data,
    slabs,
)
from tenplex.store.model import Manifest, ShardInfo, VersionInfo, format_checksum
from tenplex.store.names import (
    check_job,
    check_shard_target,
    check_tensor,
    check_version,
    region_from_key,
    region_key,
    tensor_dirname,
    tensor_from_dirname,
)
from tenplex.store.rawchunks import (
    ChunkLayout,
    ChunkRun,
    RawChunkReader,
    RawChunkWriter,
    checksum_runs,
    direct_writes_work,
)
from tenplex.store.tiers import (
    DEFAULT_EVICT_GRACE_S,
    DEFAULT_SPILL_POLL_S,
    MemorySlots,
    MemoryTier,
    Spiller,
    check_memory_fs,
    copy_plain,
    copy_verified,
    flocked,
    matches,
    recorded_tier,
    slot_owner_dead,
    take_ownership,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ATTR = "tenplex"  # key of our record in each zarr node's attributes
CHUNK_CRCS = "tenplex_chunk_crc32c"  # attribute: each chunk file's crc32c, chunk-grid order (cheap whole-file checks)
_COMMITS = ".commits"
_STAGING = ".staging"
_LOCK = ".lock"
_CLAIMS = ".claims"  # memory tier: bytes claimed by the writers of each uncommitted version
_EVICTING = ".evicting"  # memory tier: markers of evicted versions, until their files are removed
_BUDGET_LOCK = ".budget.lock"  # memory tier: flock for placements, claims and evictions
_BUFFERS = ".buffers"  # memory tier: snapshot buffers of the writers (tenplex.store.tiers.MemorySlots)
_PIECE_BYTES = 32 << 20  # bounded buffers for streamed writes and verification
_MAX_PIECE_BYTES = 256 << 20  # ... grown up to this to hold whole bands of chunks
_ZARR_CONFIG = {"write_empty_chunks": True}
MIN_RUN_BYTES = 64 << 10
"""Regions whose chunk-file runs average less than this are copied out rather than served run by run."""


def _write_json_atomic(path: Path, obj: Any, *, durable: bool) -> None:
    # json.dumps, not json.dump into the file: that would run the pure-Python encoder
    atomic_write(path, json.dumps(obj, separators=(",", ":")), durable=durable)


def _version_markers(directory: Path) -> Iterator[tuple[Version, Path]]:
    """(version, path) of the ``<version>.json`` markers in ``directory`` (none when it does not exist); other
    names (temporary files, anything hidden) are skipped."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(".") or not name.endswith(".json"):
            continue
        try:
            yield Version.parse(name[:-5]), directory / name
        except InvalidInput:
            continue


def _read_meta(node_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A zarr node's metadata document and our record in it (zarr v3 spec: ``attributes`` of zarr.json)."""
    meta = json.loads(_read_small(node_dir / "zarr.json"))
    rec = meta.get("attributes", {}).get(ATTR)
    if not isinstance(rec, dict):
        raise InvalidInput(f"{node_dir} is not a shard written by the tenplex store (no '{ATTR}' attribute)")
    return meta, rec


def _write_group(node_dir: Path, attributes: dict[str, Any]) -> None:
    """A zarr v3 group node (``zarr.json``), written directly: zarr's own path costs milliseconds per group.

    Written in place, not through a temporary file and a rename: the caller holds the job's lock (no other
    writer), the group is in an uncommitted version (not served; a torn one after a crash is redone with
    the version) and the commit's ``syncfs`` makes it durable. A transform creates one per tensor.
    """
    node_dir.mkdir(parents=True, exist_ok=True)
    doc = {"zarr_format": 3, "node_type": "group", "attributes": {ATTR: attributes}}
    _write_small(node_dir / "zarr.json", json.dumps(doc, separators=(",", ":")).encode())


def _read_small(path: Path) -> bytes:
    """A small file's bytes, without a Python file object (a metadata document per shard on every scan)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        parts = [os.read(fd, 1 << 16)]
        while parts[-1]:
            parts.append(os.read(fd, 1 << 16))
    finally:
        os.close(fd)
    return b"".join(parts)


def _write_small(path: Path, data: bytes) -> None:
    """A new small file with ``data``, without a Python file object (whose set-up costs four system calls)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _group_written(node_dir: Path) -> bool:
    """Whether a group's ``zarr.json`` is there and not empty (a writer killed between creating and writing
    it, see :func:`_write_group`, leaves it empty; one ``write`` of a small document is never half done
    by a process that dies)."""
    try:
        return os.stat(node_dir / "zarr.json").st_size > 0
    except FileNotFoundError:
        return False


@dataclass(frozen=True, slots=True)
class _StoredShard:
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
        shards: list[_StoredShard],
        executor: Executor | None = None,
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
        self._executor = executor
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
        stored = self._stored_shard(region)
        return stored.info if stored is not None else None

    def _stored_shard(self, region: Region) -> _StoredShard | None:
        return next((s for s in self._shards if s.info.region == region), None)

    def _array(self, shard: _StoredShard) -> RawChunkReader | zarr.Array:
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

    def plan(self, region: Region) -> list[tuple[_StoredShard, Region]]:
        """Which stored shard serves which part of ``region``; raises when the shards do not cover it."""
        region.check_within(self.global_shape)
        if region.empty:
            return []
        parts: list[tuple[_StoredShard, Region]] = []
        missing = [region]
        for s in self._shards:
            common = s.info.region.intersect(region)
            if common is None:
                continue
            if not any(m.overlaps(common) for m in missing):
                continue  # an overlapping shard already served this part
            parts.append((s, common))
            missing = [piece for m in missing for piece in subtract(m, common)]
        if missing:
            raise StateLost(
                f"tensor {self.tensor!r} (shape {list(self.global_shape)}) in version {self.version} of job "
                f"{self.job!r}: region {region.format()!r} is not covered by the shards on this node; missing "
                + ", ".join(m.format() for m in missing[:8])
                + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
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
                arr.read(src, dst, self._executor)
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

    def checksum(self, region: Region, piece_bytes: int = _PIECE_BYTES) -> int:
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


@dataclass
class ShardWriter:
    """A shard being written, piece by piece, in payload order; invisible until :meth:`finish`.

    The server feeds it from the request body stream (so a 2 GiB upload needs
    only two pieces of memory); :meth:`LocalStore.write_shard` feeds it one
    array. Pieces must come in the order of :attr:`pieces`.
    """

    store: LocalStore
    job: str
    version: Version
    tensor: str
    region: Region
    dtype: str
    global_shape: tuple[int, ...]
    staging: Path
    layout: ChunkLayout
    pieces: list[Region]
    raw: RawChunkWriter | None = None
    in_memory: bool = False
    """Whether ``staging`` is in the memory tier (where the version was placed when the writer opened)."""
    _zarr: zarr.Array | None = None
    _next: int = 0
    _crc: int = 0
    _done: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def nbytes(self) -> int:
        return self.region.volume * itemsize(self.dtype)

    def write_piece(self, index: int, data: np.ndarray) -> None:
        """Store piece ``index`` (a contiguous array of the piece's shape in the storage dtype)."""
        with self._lock:
            if self._done:
                raise Conflict(f"shard {self.tensor!r} {self.region.format()!r} is already finished or aborted")
            if index != self._next:
                raise InvalidInput(f"shard pieces must be written in order: expected piece {self._next}, got {index}")
            piece = self.pieces[index]
            if data.shape != piece.shape:
                raise InvalidInput(f"piece {index} has shape {list(data.shape)}, expected {list(piece.shape)}")
            crc = None
            if piece.volume:
                if self.raw is not None and self.raw.covers_whole_chunks(piece):
                    crc = self.raw.write(piece, data)  # from the chunk files' own checksums, when they give it
                else:
                    self._zarr_array().set_basic_selection(piece.slices(), data)
            if crc is None:
                self._crc = crc_of(data, self._crc)
            else:
                self._crc = crc32c_combine(self._crc, crc, data.nbytes)
            self._next += 1

    def _zarr_array(self) -> zarr.Array:
        """zarr's view of the staged array, for pieces the direct writer does not handle (made on first use)."""
        if self._zarr is None:
            _write_json_atomic(self.staging / "zarr.json", self.layout.metadata({}), durable=False)
            self._zarr = zarr.open_array(store=zarr.storage.LocalStore(self.staging), mode="r+", config=_ZARR_CONFIG)
        return self._zarr

    def finish(self) -> ShardInfo:
        """Record the checksum and move the shard into its version (replacing an earlier copy)."""
        with self._lock:
            if self._done:
                raise Conflict(f"shard {self.tensor!r} {self.region.format()!r} is already finished or aborted")
            if self._next != len(self.pieces):
                raise InvalidInput(
                    f"shard {self.tensor!r} {self.region.format()!r}: only {self._next} of {len(self.pieces)} pieces were written"
                )
            self._done = True
        info = ShardInfo(self.tensor, self.region, self.dtype, self.global_shape, format_checksum(self._crc), self.nbytes)
        try:
            # a plain write: the staging directory is this writer's alone and is renamed into place after
            attributes: dict[str, Any] = {ATTR: info.to_json()}
            chunk_crcs = self.raw.chunk_checksums() if self.raw is not None and self._zarr is None else None
            if chunk_crcs is not None:
                attributes[CHUNK_CRCS] = chunk_crcs
            _write_small(self.staging / "zarr.json", json.dumps(self.layout.metadata(attributes), separators=(",", ":")).encode())
            self.store._install(self.job, self.version, info, self.staging, self.in_memory)
        except BaseException:
            shutil.rmtree(self.staging, ignore_errors=True)
            raise
        return info

    def abort(self) -> None:
        """Throw the partial shard away (nothing of it was ever visible)."""
        with self._lock:
            self._done = True
        shutil.rmtree(self.staging, ignore_errors=True)


class LocalStore(TensorStore):
    """Zarr-backed shard storage under one root directory; one zarr group per (job, version).

    Thread-safe and safe to share between processes on one root. ``durable``
    fsyncs a version's files before its commit marker (turn it off only for
    scratch stores). ``cache_size`` bounds the metadata cache of committed
    (immutable) versions. ``read_threads`` > 1 reads the chunks of one large
    region in parallel. ``map_chunks`` (default) copies all but small parts
    of chunks through a memory map (huge pages where the kernel allows),
    measured 1.4-1.7x faster than reading their rows with ``preadv`` (what
    ``False`` does) and no more daemon CPU.
    ``direct_writes`` (default, where the file system allows it) writes
    chunk files with ``O_DIRECT``, past the page cache: see
    :class:`~tenplex.store.rawchunks.RawChunkWriter` for why and what it measured.

    **Memory tier** (:mod:`tenplex.store.tiers`). With a memory root (a tmpfs
    directory, same layout as the root) and a budget, new versions are written
    there while they fit the budget, committed there (a marker, no fsync: not
    durable yet) and read from there, peers included; the one *owner* of the
    tier (``spill=True``: the node daemon) copies each committed memory version
    to the disk root in the background (every chunk file checked against its
    recorded crc32c, synced, then the disk marker: now durable) and records the
    tier in the root, so that other processes opening the root (workers writing
    snapshots directly) use the same memory root and budget. When a version
    needs room, the oldest versions that are on disk already are evicted from
    memory (their reads go to disk; their files go after ``evict_grace_s``). A
    version that does not fit even then is written to disk, as without a tier.
    :meth:`versions` and :meth:`manifest` say which versions are durable.
    Within a tier, kept shards are hard links; across tiers they are copied.

    - ``memory_root`` with ``memory_bytes``: this tier (the owner's, or one of
      this process's own when the root records none).
    - ``memory_root`` alone: the root's recorded tier at this path (a container
      that mounts it elsewhere); without a record the tier is not used (its
      daemon would neither serve nor spill what is written there), with a warning.
    - neither: the root's recorded tier, if any. ``spill=True`` without
      ``memory_root`` records that the root has none.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        durable: bool = True,
        cache_size: int = 1024,
        read_threads: int = 1,
        map_chunks: bool = True,
        direct_writes: bool = True,
        memory_root: str | Path | None = None,
        memory_bytes: int | None = None,
        spill: bool = False,
        evict_grace_s: float | None = None,
        spill_poll_s: float = DEFAULT_SPILL_POLL_S,
        spill_interval_s: float = 0.0,
    ) -> None:
        if chunk_bytes < 64:
            raise InvalidInput(f"chunk_bytes must be at least 64, got {chunk_bytes}")
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = str(self.root)  # a path: open_store() gives a LocalStore back (file:// URLs are persistent tiers)
        self.chunk_bytes = chunk_bytes
        self.durable = durable
        self._cache: OrderedDict[tuple[str, Version, str], TensorReader] = OrderedDict()
        self._cache_size = cache_size
        self._cache_lock = threading.Lock()

        self._pool: ThreadPoolExecutor | None = None
        if read_threads < 1:
            raise InvalidInput(f"read_threads must be >= 1, got {read_threads}")
        self._read_threads = read_threads
        self.map_chunks = map_chunks
        self.direct_writes = direct_writes and direct_writes_work(self.root)

        self.memory: MemoryTier | None = self._memory_tier(memory_root, memory_bytes, evict_grace_s, owner=spill)
        self._mroot: Path | None = self.memory.root if self.memory is not None else None
        self._marker_sizes: dict[Path, tuple[int, int, int]] = {}
        self._slot_sets: list[MemorySlots] = []
        self._spiller: Spiller | None = None
        self._commits = threading.Condition()
        """Notified at every commit by this object: what :meth:`wait_committed` waits on."""
        if spill and self.memory is not None:
            self._spiller = Spiller(self, poll_s=spill_poll_s, interval_s=spill_interval_s).start()
            log.info("memory tier of %s: %s, budget %s", self.root, self.memory.root, human_bytes(self.memory.budget))

    @property
    def spiller(self) -> Spiller | None:
        """This process's spiller (the memory tier's owner has one), if any."""
        return self._spiller

    def _memory_tier(self, memory_root: str | Path | None, memory_bytes: int | None, grace: float | None, *,
                     owner: bool) -> MemoryTier | None:
        if memory_bytes is not None and memory_root is None:
            raise InvalidInput("memory_bytes needs memory_root (the memory tier's directory)")
        grace_s = DEFAULT_EVICT_GRACE_S if grace is None else grace
        if owner:
            if memory_root is None:
                take_ownership(self.root, None)
                return None
            if memory_bytes is None:
                raise InvalidInput("the owner of a memory tier (spill=True) needs memory_bytes, its budget")
            mroot = Path(memory_root)
            mroot.mkdir(parents=True, exist_ok=True)
            check_memory_fs(mroot)
            return take_ownership(self.root, MemoryTier(mroot.resolve(), memory_bytes, grace_s))
        recorded = recorded_tier(self.root)
        if recorded is None:
            if memory_root is None:
                return None
            if memory_bytes is None:
                log.warning("%s records no memory tier (its daemon runs without one): writing to disk, not to %s",
                            self.root, memory_root)
                return None
            mroot = Path(memory_root)
            mroot.mkdir(parents=True, exist_ok=True)
            return MemoryTier(mroot.resolve(), memory_bytes, grace_s)
        tier = MemoryTier(
            Path(memory_root).resolve() if memory_root is not None else recorded.root,
            memory_bytes if memory_bytes is not None else recorded.budget,
            recorded.evict_grace_s if grace is None else grace,
            recorded.tier_id,
        )
        if not matches(tier):
            log.warning("%s is not the memory root that %s records (a reboot emptied it, or another mount): "
                        "writing to disk only", tier.root, self.root)
            return None
        return tier

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})" if self._mroot is None else f"LocalStore({str(self.root)!r}, memory {str(self._mroot)!r})"

    def _read_pool(self) -> ThreadPoolExecutor | None:
        """Threads that read the chunks of one large region in parallel (the copies release the GIL).

        Off by default: on a busy 2-core node one thread was as fast as two or
        four (the copy is memory-bound); raise ``read_threads`` on big nodes.
        """
        if self._read_threads == 1:
            return None
        with self._cache_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._read_threads, thread_name_prefix="tenplex-store-read")
            return self._pool

    def close(self) -> None:
        """Stop the read threads, the spiller and this process's snapshot buffers (the store stays usable for
        reads and writes; read threads restart on demand)."""
        with self._cache_lock:
            pool, self._pool = self._pool, None
            slot_sets, self._slot_sets = self._slot_sets, []
        if pool is not None:
            pool.shutdown(wait=True)
        spiller, self._spiller = self._spiller, None
        if spiller is not None:
            spiller.stop()
        for slots in slot_sets:
            slots.close()

    # -- paths and locks ----------------------------------------------------

    def _job_dir(self, job: str) -> Path:
        return self.root / check_job(job)

    def _version_dir(self, job: str, version: Version) -> Path:
        return self._job_dir(job) / str(version)

    def _staging(self, job: str) -> Path:
        """Where shards are written before they are renamed into place (same file system, not inside the job)."""
        return self.root / _STAGING / check_job(job)

    def _marker(self, job: str, version: Version) -> Path:
        """The disk commit marker: the version is committed and durable."""
        return self._job_dir(job) / _COMMITS / f"{version}.json"

    def _mem(self) -> Path:
        assert self._mroot is not None
        return self._mroot

    def _mjob(self, job: str) -> Path:
        return self._mem() / check_job(job)

    def _mvdir(self, job: str, version: Version) -> Path:
        return self._mjob(job) / str(version)

    def _mmarker(self, job: str, version: Version) -> Path:
        """The memory commit marker: the version is committed in memory (durable once the disk marker exists)."""
        return self._mjob(job) / _COMMITS / f"{version}.json"

    def _mclaim(self, job: str, version: Version) -> Path:
        return self._mjob(job) / _CLAIMS / f"{version}.json"

    def _mevicting(self, job: str, version: Version) -> Path:
        return self._mjob(job) / _EVICTING / f"{version}.json"

    def _mstaging(self, job: str) -> Path:
        return self._mem() / _STAGING / check_job(job)

    @contextlib.contextmanager
    def _locked(self, job: str, *, create: bool = False) -> Iterator[None]:
        """The job's lock (in the disk root, for both tiers). Lock order: the budget lock before any job's."""
        job_dir = self._job_dir(job)
        try:  # the common case first: the job's directory is there (one system call, not three)
            fd = os.open(job_dir / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            if not (create or (self._mroot is not None and self._mjob(job).is_dir())):
                raise NotFound(f"job {job!r} is not in this store") from None
            job_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(job_dir / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def _budget_locked(self) -> contextlib.AbstractContextManager[None]:
        """The memory tier's lock: placements, claims and evictions, across the processes sharing the tier."""
        return flocked(self._mem() / _BUDGET_LOCK)

    def _is_committed(self, job: str, version: Version) -> bool:
        return self._marker(job, version).is_file() or (self._mroot is not None and self._mmarker(job, version).is_file())

    def _committed_dir(self, job: str, version: Version) -> tuple[Path, bool] | None:
        """(directory, in memory) of a committed version, read from memory while it is there; None if not committed."""
        if self._mroot is not None and self._mmarker(job, version).is_file():
            return self._mvdir(job, version), True
        if self._marker(job, version).is_file():
            return self._version_dir(job, version), False
        return None

    def _working_dir(self, job: str, version: Version) -> tuple[Path, bool]:
        """(directory, in memory) of an uncommitted version: the tier it was placed in (disk when in none)."""
        if self._mroot is not None:
            mdir = self._mvdir(job, version)
            if mdir.is_dir() and not self._mevicting(job, version).exists():
                return mdir, True
        return self._version_dir(job, version), False

    def _job_exists(self, job: str) -> bool:
        return self._job_dir(job).is_dir() or (self._mroot is not None and self._mjob(job).is_dir())

    # -- the memory budget ----------------------------------------------------

    def _memory_jobs(self) -> list[str]:
        if self._mroot is None:
            return []
        try:
            entries = os.listdir(self._mroot)
        except FileNotFoundError:
            return []
        out = []
        for entry in entries:
            if entry.startswith("."):
                continue
            try:
                out.append(check_job(entry))
            except InvalidInput:
                continue
        return out

    def _marker_nbytes(self, marker: Path) -> int | None:
        """A commit marker's byte count (markers are immutable: parsed once per file), None when it is absent."""
        try:
            st = os.stat(marker)
        except FileNotFoundError:
            return None
        cached = self._marker_sizes.get(marker)
        if cached is not None and cached[0] == st.st_ino and cached[1] == st.st_mtime_ns:
            return cached[2]
        try:
            with open(marker, encoding="utf-8") as f:
                nbytes = int(json.load(f)["nbytes"])
        except FileNotFoundError:
            return None
        if len(self._marker_sizes) > 4096:
            self._marker_sizes.clear()
        self._marker_sizes[marker] = (st.st_ino, st.st_mtime_ns, nbytes)
        return nbytes

    def _read_claim(self, job: str, version: Version) -> tuple[int, int] | None:
        """(bytes reserved, bytes claimed by its writers) of an uncommitted memory version, if recorded."""
        try:
            with open(self._mclaim(job, version), encoding="utf-8") as f:
                obj = json.load(f)
            return int(obj["reserved"]), int(obj["used"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the damaged claim of %s of job %s: %s", version, job, exc)
            return None

    def _write_claim(self, job: str, version: Version, reserved: int, used: int) -> None:
        path = self._mclaim(job, version)
        path.parent.mkdir(exist_ok=True)
        _write_json_atomic(path, {"reserved": reserved, "used": used}, durable=False)

    def memory_used(self) -> int:
        """Bytes of the memory tier's versions: committed ones (their manifests) and those being written
        (what their writers reserved or claimed, the larger). Evicted versions no longer count."""
        total = 0
        for job in self._memory_jobs():
            try:
                names = os.listdir(self._mjob(job))
            except FileNotFoundError:
                continue
            for name in names:
                if name.startswith("."):
                    continue
                try:
                    v = Version.parse(name)
                except InvalidInput:
                    continue
                n = self._marker_nbytes(self._mmarker(job, v))
                if n is None:
                    claim = self._read_claim(job, v)
                    n = max(claim) if claim is not None else 0
                total += n
        return total

    def _predicted_bytes(self, job: str) -> int:
        """The size of the job's newest committed version here: what its next version will most likely need."""
        best: tuple[Version, Path] | None = None
        dirs = [self._job_dir(job) / _COMMITS] + ([self._mjob(job) / _COMMITS] if self._mroot is not None else [])
        for cdir in dirs:
            for v, marker in _version_markers(cdir):
                if best is None or v > best[0]:
                    best = (v, marker)
        if best is None:
            return 0
        return self._marker_nbytes(best[1]) or 0

    def _memory_versions(self, *, spilled: bool | None = None) -> list[tuple[float, str, Version]]:
        """(commit time, job, version) of the versions committed in memory, oldest first; with ``spilled``,
        only those with (True) or without (False) a disk copy."""
        out = []
        for job in self._memory_jobs():
            for v, marker in _version_markers(self._mjob(job) / _COMMITS):
                try:
                    mtime = os.stat(marker).st_mtime
                except FileNotFoundError:
                    continue
                if spilled is None or self._marker(job, v).is_file() == spilled:
                    out.append((mtime, job, v))
        out.sort()
        return out

    def _make_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit the budget, evicting the oldest spilled versions as needed (budget lock held)."""
        assert self.memory is not None
        budget = self.memory.budget
        if nbytes > budget:
            return False
        used = self.memory_used()
        if used + nbytes <= budget:
            return True
        for _mtime, job, v in self._memory_versions(spilled=True):
            freed = self._evict(job, v)
            if freed is not None:
                used -= freed
                if used + nbytes <= budget:
                    return True
        return False

    def _evict(self, job: str, version: Version) -> int | None:
        """Take a spilled version out of memory: reads go to its disk copy from now on; its memory files are
        removed after the grace period (:meth:`reap_evicted`). Its bytes, or None when it is not evictable."""
        with self._locked(job):
            marker, disk = self._mmarker(job, version), self._marker(job, version)
            if not (marker.is_file() and disk.is_file()):
                return None
            nbytes = self._marker_nbytes(marker) or 0
            record = self._mevicting(job, version)
            record.parent.mkdir(exist_ok=True)
            os.rename(marker, record)
            os.utime(record)  # the grace period runs from now
        self._drop_cached(job, version)
        log.info("evicted version %s of job %s from memory (%s); it is read from disk now", version, job, human_bytes(nbytes))
        return nbytes

    def _place(self, job: str, version: Version, nbytes: int) -> bool:
        """Where ``nbytes`` more of an uncommitted version go: True for memory (claimed in the budget), False for disk.

        A version lives in one tier. Its first writer places it: in memory when
        the job's last version (or these bytes, if more) fits the budget after
        evicting what is spilled already, else on disk (pinned there by its
        directory). Writers of a memory version claim their bytes; a claim the
        budget cannot hold moves the version to disk (:meth:`_demote`).
        """
        if self._mroot is None:
            return False
        with self._budget_locked():
            with self._locked(job, create=True):
                if self._is_committed(job, version):
                    raise Conflict(f"version {version} of job {job!r} is committed; committed versions are immutable")
                vdir, in_memory = self._working_dir(job, version)
                exists = vdir.is_dir()
                claim = self._read_claim(job, version) if in_memory else None
            if exists and not in_memory:
                return False
            if not exists:
                want = max(nbytes, self._predicted_bytes(job))
                fits = self._make_room(want)
                with self._locked(job, create=True):
                    if fits:
                        _write_group(self._mvdir(job, version), {"job": job, "version": str(version)})
                        self._write_claim(job, version, want, nbytes)
                    else:
                        _write_group(self._version_dir(job, version), {"job": job, "version": str(version)})
                if not fits:
                    log.info("version %s of job %s (%s expected) does not fit the memory budget (%s): written to disk",
                             version, job, human_bytes(want), human_bytes(self.memory.budget if self.memory else 0))
                return fits
            reserved, used = claim if claim is not None else (0, 0)
            extra = max(reserved, used + nbytes) - max(reserved, used)
            if extra and not self._make_room(extra):
                self._demote(job, version)
                return False
            with self._locked(job, create=True):
                self._write_claim(job, version, reserved, used + nbytes)
            return True

    def _demote(self, job: str, version: Version) -> None:
        """Move an uncommitted memory version to disk: it outgrew the budget (budget lock held)."""
        trash = None
        with self._locked(job):
            mdir = self._mvdir(job, version)
            if mdir.is_dir():
                staging = self._staging(job) / f"demote-{uuid.uuid4().hex}"
                staging.parent.mkdir(parents=True, exist_ok=True)
                _copy_tree(mdir, staging)
                vdir = self._version_dir(job, version)
                if vdir.exists():
                    old = self._staging(job) / f"replaced-{uuid.uuid4().hex}"
                    os.rename(vdir, old)
                    shutil.rmtree(old, ignore_errors=True)
                os.rename(staging, vdir)
                trash = self._mstaging(job) / f"deleted-{version}-{uuid.uuid4().hex}"
                trash.parent.mkdir(parents=True, exist_ok=True)
                os.rename(mdir, trash)
            self._mclaim(job, version).unlink(missing_ok=True)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        log.info("version %s of job %s outgrew the memory budget while being written: moved to disk", version, job)

    # -- spilling and evicting ------------------------------------------------

    def unspilled(self) -> list[tuple[str, Version]]:
        """(job, version) of the versions committed in memory without a disk copy, newest first."""
        return [(job, v) for _t, job, v in reversed(self._memory_versions(spilled=False))]

    def spill(self, job: str, version: Version | str) -> int | None:
        """Copy a version committed in memory to disk and make that copy its durable one; its bytes, or None
        when there was nothing to do (not in memory, spilled already, deleted meanwhile).

        Every chunk file is checksummed as it is written and compared with the
        crc32c recorded when it was written (shards without recorded chunk
        checksums are checked whole, read back); a mismatch stops the spill.
        The copy is synced, renamed into place and then the disk marker is
        written, so a crash leaves either no durable copy or a complete one.
        Chunk files shared by hard links with another version already spilled
        (a transform kept the shard) are linked to that version's disk copy.
        """
        if self._mroot is None:
            return None
        v = check_version(version)
        marker, disk_marker = self._mmarker(job, v), self._marker(job, v)
        try:
            with open(marker, encoding="utf-8") as f:
                manifest = Manifest.from_json(json.load(f))
        except FileNotFoundError:
            return None
        if disk_marker.is_file():
            return None
        staging = self._staging(job) / f"spill-{uuid.uuid4().hex}"
        staging.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            try:
                copied = self._spill_copy(job, v, staging)
            except FileNotFoundError:  # deleted (or its files disappeared) while being copied
                if not marker.is_file():
                    return None
                raise
            if self.durable:
                _sync_tree(staging)
            with self._locked(job):
                if not marker.is_file() or disk_marker.is_file():
                    return None
                vdir = self._version_dir(job, v)
                if vdir.exists():  # what a spill killed before its marker left
                    old = self._staging(job) / f"replaced-{uuid.uuid4().hex}"
                    os.rename(vdir, old)
                    shutil.rmtree(old, ignore_errors=True)
                os.rename(staging, vdir)
                if self.durable:
                    fsync_path(vdir.parent, directory=True)
                disk_marker.parent.mkdir(exist_ok=True)
                _write_json_atomic(disk_marker, replace(manifest, durable=True).to_json(), durable=self.durable)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info("spilled version %s of job %s to disk: %s (%s copied) in %.2f s; durable", v, job,
                 human_bytes(manifest.nbytes), human_bytes(copied), time.perf_counter() - t0)
        return manifest.nbytes

    def _spill_copy(self, job: str, version: Version, dst: Path) -> int:
        """Copy the memory version's tree to ``dst`` on disk, verifying every shard; bytes copied (not linked)."""
        src = self._mvdir(job, version)
        # older versions in memory and on disk: their disk files are where hard-linked (kept) shards go
        spilled = [(self._mvdir(job, w), self._version_dir(job, w)) for _t, j, w in self._memory_versions(spilled=True)
                   if j == job and w != version]
        dst.mkdir(parents=True, exist_ok=True)
        copy_plain(src / "zarr.json", dst / "zarr.json")
        copied = 0
        for tname in sorted(os.listdir(src)):
            tsrc = src / tname
            if not tsrc.is_dir():
                continue
            (dst / tname).mkdir()
            copy_plain(tsrc / "zarr.json", dst / tname / "zarr.json")
            for sname in sorted(os.listdir(tsrc)):
                if (tsrc / sname).is_dir():
                    copied += self._spill_shard(job, version, tsrc / sname, dst / tname / sname, f"{tname}/{sname}", spilled)
        return copied

    def _spill_shard(self, job: str, version: Version, src: Path, dst: Path, rel: str,
                     spilled: Sequence[tuple[Path, Path]]) -> int:
        meta, rec = _read_meta(src)
        info = ShardInfo.from_json(rec)
        layout = ChunkLayout.from_metadata(meta)
        crcs = meta["attributes"].get(CHUNK_CRCS)
        expected: dict[str, int] = {}
        if layout is not None and isinstance(crcs, list) and len(crcs) == len(layout.chunk_coords()):
            expected = {layout.chunk_key(c): int(crc) for c, crc in zip(layout.chunk_coords(), crcs, strict=True)}
        copied = 0
        for dirpath, _dirs, files in os.walk(src):
            here = Path(dirpath)
            sub = os.path.relpath(dirpath, src)
            out = dst / sub
            out.mkdir(parents=True, exist_ok=True)
            for name in files:
                key = name if sub == "." else f"{sub}/{name}"
                if key == "zarr.json":
                    copy_plain(here / name, out / name)
                elif not _link_kept(here / name, f"{rel}/{key}", spilled, out / name):
                    copy_verified(here / name, out / name, expected.get(key), direct=self.direct_writes)
                    copied += os.stat(out / name).st_size
        if not expected:  # written through zarr (no chunk checksums): check the copy whole
            stored = _StoredShard(info, dst, layout, None)
            problem = _damage(TensorReader(job, version, info.tensor, False, [stored]), stored, info.region)
            if problem is not None:
                raise ChecksumMismatch(f"spilling {info.tensor!r} {info.region.format()} of {version} of job {job!r}: "
                                       f"{problem}: the memory copy is damaged")
        return copied

    def reap_evicted(self) -> int:
        """Remove the memory files of evicted versions whose grace period has passed; how many versions."""
        if self.memory is None:
            return 0
        now = time.time()
        done = 0
        for job in self._memory_jobs():
            for v, marker in _version_markers(self._mjob(job) / _EVICTING):
                try:
                    if os.stat(marker).st_mtime + self.memory.evict_grace_s > now:
                        continue
                except FileNotFoundError:
                    continue
                trash = None
                with self._locked(job):
                    record = self._mevicting(job, v)
                    if not record.is_file():
                        continue
                    mdir = self._mvdir(job, v)
                    if mdir.is_dir():
                        trash = self._mstaging(job) / f"deleted-{v}-{uuid.uuid4().hex}"
                        trash.parent.mkdir(parents=True, exist_ok=True)
                        os.rename(mdir, trash)
                    record.unlink()
                if trash is not None:
                    shutil.rmtree(trash, ignore_errors=True)
                done += 1
        return done

    def memory_stats(self) -> dict[str, float]:
        """The memory tier now: budget, bytes used, versions committed there, how many of them are not durable
        and ``spill_lag``: seconds since the oldest of those was committed (0 when all are durable)."""
        if self.memory is None:
            return {}
        versions = self._memory_versions()
        unspilled = [t for t, job, v in versions if not self._marker(job, v).is_file()]
        return {"budget": self.memory.budget, "used": self.memory_used(), "versions": len(versions),
                "unspilled": len(unspilled), "spill_lag": max(0.0, time.time() - min(unspilled)) if unspilled else 0.0}

    # -- snapshot buffers ---------------------------------------------------------

    def snapshot_buffers(self, job: str) -> MemorySlots | None:
        """With a memory tier: buffers in it that a snapshot copies into and then stores without copying again
        (:class:`~tenplex.store.tiers.MemorySlots`); None without one."""
        if self._mroot is None or sys.byteorder != "little":
            return None
        owner = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        slots = MemorySlots(self, check_job(job), self._mem() / _BUFFERS / check_job(job) / owner)
        with self._cache_lock:
            self._slot_sets.append(slots)
        return slots

    def adopt_slot(self, job: str, version: Version | str, tensor: str, region: Region, dtype: str,
                   global_shape: Sequence[int], path: Path, data: np.ndarray, *, crc: int | None = None) -> ShardInfo:
        """Store a snapshot buffer (:class:`~tenplex.store.tiers.MemorySlots`: the memory file ``path``, mapped
        as ``data``) as the shard ``region`` of ``tensor``: hard-linked as the shard's one chunk file when the
        version is in memory, else written from ``data`` like any shard. ``crc``: the buffer's crc32c when the
        writer computed it already (the snapshot does, to find unchanged shards); else computed here."""
        v = check_version(version)
        check_tensor(tensor)
        check_dtype(dtype)
        gshape = tuple(int(n) for n in global_shape)
        region.check_within(gshape)
        st = storage_dtype(dtype)
        nbytes = region.volume * st.itemsize
        arr = data[:nbytes].view(st).reshape(region.shape)
        if region.empty or not region.shape or sys.byteorder != "little" or not self._place_for_slot(job, v, tensor, dtype, gshape, nbytes):
            return self.write_shard(job, v, tensor, region, arr, dtype=dtype, global_shape=gshape)
        if crc is None:
            crc = crc_of(arr)
        info = ShardInfo(tensor, region, dtype, gshape, format_checksum(crc), nbytes)
        layout = ChunkLayout(region.shape, region.shape, st)
        staging = self._mstaging(job) / f"shard-{uuid.uuid4().hex}"
        try:
            staging.mkdir()
        except FileNotFoundError:
            staging.parent.mkdir(parents=True, exist_ok=True)
            staging.mkdir()
        try:
            os.link(path, staging / layout.chunk_key((0,) * len(region.shape)))
            with open(staging / "zarr.json", "w", encoding="utf-8") as f:
                f.write(json.dumps(layout.metadata({ATTR: info.to_json(), CHUNK_CRCS: [crc]}), separators=(",", ":")))
            self._install(job, v, info, staging, True)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return info

    def _place_for_slot(self, job: str, v: Version, tensor: str, dtype: str, gshape: tuple[int, ...], nbytes: int) -> bool:
        if self._is_committed(job, v):
            raise Conflict(f"version {v} of job {job!r} is committed; committed versions are immutable")
        self._check_tensor_consistent(job, v, tensor, dtype, gshape)
        return self._place(job, v, nbytes)

    def reap_dead_slots(self) -> int:
        """Remove the snapshot buffers of writers that are gone (their lock is free); versions keep their links."""
        if self._mroot is None:
            return 0
        base = self._mem() / _BUFFERS
        done = 0
        try:
            jobs = os.listdir(base)
        except FileNotFoundError:
            return 0
        for job in jobs:
            try:
                owners = os.listdir(base / job)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for owner in owners:
                d = base / job / owner
                try:
                    young = time.time() - os.stat(d).st_mtime < 60
                except FileNotFoundError:
                    continue
                if not (d / ".lock").exists() and young:
                    continue  # being created
                if slot_owner_dead(d):
                    shutil.rmtree(d, ignore_errors=True)
                    done += 1
        return done

    # -- writing ------------------------------------------------------------

    def open_writer(
        self,
        job: str,
        version: Version | str,
        tensor: str,
        region: Region,
        *,
        dtype: str,
        global_shape: Sequence[int],
        piece_bytes: int = _PIECE_BYTES,
        check_tensor: bool = True,
    ) -> ShardWriter:
        """Start writing a shard; check everything that can be checked before any byte arrives.

        ``check_tensor=False`` leaves the tensor's dtype and global shape to the check made when the shard
        is installed (under the job's lock, where it counts): for callers whose bytes are in memory already,
        which lose nothing but the write when it fails there (one directory scan and one metadata read
        less per shard).
        """
        v, gshape = check_shard_target(job, version, tensor, dtype, global_shape, region)
        if self._is_committed(job, v):
            raise Conflict(f"version {v} of job {job!r} is committed; committed versions are immutable")
        if check_tensor:
            self._check_tensor_consistent(job, v, tensor, dtype, gshape)
        st = storage_dtype(dtype)
        in_memory = self._place(job, v, region.volume * st.itemsize)

        staging_root = self._mstaging(job) if in_memory else self._staging(job)
        staging = staging_root / f"shard-{uuid.uuid4().hex}"
        chunks = chunk_shape(region.shape, st.itemsize, self.chunk_bytes)
        layout = ChunkLayout(region.shape, chunks, st)
        try:
            staging.mkdir()
        except FileNotFoundError:  # the job's first shard here
            staging_root.mkdir(parents=True, exist_ok=True)
            staging.mkdir()
        # a piece must hold whole bands of chunks, or zarr reads back and rewrites chunks it already wrote
        band = chunks[0] * math.prod(region.shape[1:]) * st.itemsize if chunks else st.itemsize
        pieces = list(slabs(region.shape, st.itemsize, max(piece_bytes, min(band, _MAX_PIECE_BYTES)), align=chunks))
        # chunk files are the raw little-endian elements (what ChunkLayout.metadata declares) on a little-endian
        # host; memory files are written through the page cache (they are page cache: O_DIRECT is only a detour)
        raw = RawChunkWriter(staging, layout, direct=self.direct_writes and not in_memory) if sys.byteorder == "little" else None
        return ShardWriter(self, job, v, tensor, region, dtype, gshape, staging, layout, pieces, raw, in_memory)

    def write_shard(
        self,
        job: str,
        version: Version | str,
        tensor: str,
        region: Region,
        data: np.ndarray | torch.Tensor,
        *,
        dtype: str,
        global_shape: Sequence[int],
        received: ReceivedCrcs | None = None,
    ) -> ShardInfo:
        """Store ``data`` (shape ``region.shape``; numpy in the storage dtype or a torch tensor of ``dtype``).

        Rewriting the same region of an uncommitted version replaces it;
        writing into a committed version raises :class:`Conflict`. With
        ``received`` (the crc32c prefixes of ``data`` recorded as it was
        received) the chunk files' and the shard's crc32c come from them, not
        from another pass over the bytes.
        """
        check_dtype(dtype)
        arr = host_data(data, dtype, what=f"data for tensor {tensor!r}")
        if not isinstance(region, Region):
            raise InvalidInput(f"region must be a Region, got {type(region).__name__}")
        if arr.shape != region.shape:
            raise InvalidInput(f"data has shape {list(arr.shape)}, region {region.format()!r} has shape {list(region.shape)}")
        writer = self.open_writer(job, version, tensor, region, dtype=dtype, global_shape=global_shape, check_tensor=False)
        if received is not None and writer.raw is not None:
            if received.base != arr.ctypes.data or received.nbytes != arr.nbytes:
                writer.abort()
                raise InvalidInput(f"the received crc32c of shard {tensor!r} {region.format()!r} describe another buffer")
            writer.raw.received = received
        try:
            for i, piece in enumerate(writer.pieces):
                writer.write_piece(i, arr[piece.slices()])
            return writer.finish()
        except BaseException:
            writer.abort()
            raise

    def _check_tensor_consistent(self, job: str, version: Version, tensor: str, dtype: str, gshape: tuple[int, ...]) -> None:
        vdir, _in_memory = self._working_dir(job, version)
        for shard in self._scan_tensor(vdir / tensor_dirname(tensor), tensor, limit=1):
            if shard.info.dtype != dtype or shard.info.global_shape != gshape:
                raise Conflict(
                    f"tensor {tensor!r} in version {version} of job {job!r} is already stored as {shard.info.dtype} "
                    f"{list(shard.info.global_shape)}; got {dtype} {list(gshape)}"
                )

    def link_shard(
        self, job: str, from_version: Version | str, tensor: str, region: Region, to_version: Version | str,
        *, verify: bool = True,
    ) -> ShardInfo:
        """Put the shard ``region`` of ``tensor`` of committed ``from_version`` into ``to_version`` without copying it.

        The new shard's files are hard links to the old one's: a transform that
        keeps a shard on its host costs a few metadata operations instead of
        reading and writing its bytes. Sharing is safe because committed
        versions are immutable and the store never writes a file in place
        (every write makes new files and renames them), and deleting either
        version leaves the other's links intact. :class:`NotFound` when
        ``from_version`` holds no shard with exactly this region (the caller
        copies the bytes instead); the recorded checksum carries over.
        ``verify`` first checks the old shard against its checksum (one read
        pass, no write), so that a shard damaged on disk is not carried into
        the new version: :class:`ChecksumMismatch`, and the caller fetches a replica.
        With a memory tier, links are made within a tier; a shard of a version
        in the other tier is copied (its bytes read and written once, locally).
        """
        reader = self.open_tensor(job, from_version, tensor)
        src = reader._stored_shard(region)
        if src is None:
            raise NotFound(
                f"version {reader.version} of job {job!r} has no shard of {tensor!r} with exactly region {region.format()!r}"
            )
        v = check_version(to_version)
        if self._is_committed(job, v):
            raise Conflict(f"version {v} of job {job!r} is committed; committed versions are immutable")
        info = src.info
        self._check_tensor_consistent(job, v, tensor, info.dtype, info.global_shape)
        if verify:
            problem = _damage(reader, src, region)
            if problem is not None:
                raise ChecksumMismatch(
                    f"shard {tensor!r} {region.format()!r} of version {reader.version} of job {job!r} in "
                    f"{self._mroot if reader.in_memory else self.root}: {problem}: it is damaged "
                    + ("in memory" if reader.in_memory else "on disk")
                )
        in_memory = self._place(job, v, info.nbytes)
        staging = (self._mstaging(job) if in_memory else self._staging(job)) / f"shard-{uuid.uuid4().hex}"
        staging.parent.mkdir(parents=True, exist_ok=True)
        try:
            if reader.in_memory == in_memory:
                _link_tree(src.path, staging)
            else:
                _copy_tree(src.path, staging)
            self._install(job, v, info, staging, in_memory)
        except FileNotFoundError:
            shutil.rmtree(staging, ignore_errors=True)
            raise NotFound(
                f"shard {tensor!r} {region.format()!r} of version {reader.version} of job {job!r} disappeared while being linked"
            ) from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return info

    def _install(self, job: str, version: Version, info: ShardInfo, staging: Path, staged_in_memory: bool = False) -> None:
        """Rename a complete shard from staging into its version, replacing an earlier copy of the same region.

        The version is in one tier (see :meth:`_place`); a shard staged in the
        other one (the version moved to disk while it was being written) is
        copied across first.
        """
        # No fsync here: an uncommitted version is never served as committed, and a crash before the
        # commit leaves it for the writer to redo. Durability is established once, at commit.
        old = None
        with self._locked(job, create=True):
            if self._is_committed(job, version):
                raise Conflict(
                    f"version {version} of job {job!r} was committed while shard "
                    f"{info.tensor!r} {info.region.format()!r} was being written"
                )
            vdir, in_memory = self._working_dir(job, version)
            if not vdir.is_dir() and staged_in_memory and self._mroot is not None:
                vdir, in_memory = self._mvdir(job, version), True  # deleted meanwhile: made anew where it was staged
            if in_memory != staged_in_memory:
                moved = (self._mstaging(job) if in_memory else self._staging(job)) / f"shard-{uuid.uuid4().hex}"
                moved.parent.mkdir(parents=True, exist_ok=True)
                _copy_tree(staging, moved)
                shutil.rmtree(staging, ignore_errors=True)
                staging = moved
            tdir = vdir / tensor_dirname(info.tensor)
            target = tdir / region_key(info.region)
            self._check_tensor_consistent(job, version, info.tensor, info.dtype, info.global_shape)
            if not _group_written(vdir):
                _write_group(vdir, {"job": job, "version": str(version)})
            if not _group_written(tdir):
                _write_group(tdir, {"tensor": info.tensor})
            if target.exists():
                old = staging.with_name(f"replaced-{uuid.uuid4().hex}")
                os.rename(target, old)
            os.rename(staging, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        log.debug("stored %s %s %s of job %s (%d bytes)", version, info.tensor, info.region, job, info.nbytes)

    # -- reading ------------------------------------------------------------

    def _scan_tensor(self, tdir: Path, tensor: str, limit: int | None = None) -> list[_StoredShard]:
        out: list[_StoredShard] = []
        try:
            entries = sorted(os.listdir(tdir))
        except FileNotFoundError:
            return out
        for name in entries:
            region = region_from_key(name)
            if region is None:
                continue
            try:
                meta, rec = _read_meta(tdir / name)
            except FileNotFoundError:
                continue  # replaced or deleted while we looked
            info = ShardInfo.from_json(rec)
            if info.tensor != tensor or info.region != region:
                raise InvalidInput(f"shard {tdir / name} records tensor {info.tensor!r} region {info.region}; the store is corrupt")
            crcs = meta["attributes"].get(CHUNK_CRCS)
            chunk_crcs = tuple(int(c) for c in crcs) if isinstance(crcs, list) else None
            out.append(_StoredShard(info, tdir / name, ChunkLayout.from_metadata(meta), chunk_crcs))
            if limit is not None and len(out) >= limit:
                break
        return out

    def cached_tensor(self, job: str, version: Version, tensor: str) -> TensorReader | None:
        """The cached reader of a committed version's tensor, or None; no file system access for a version on
        disk, one ``stat`` for one in memory (still there, not evicted: else None).

        What :meth:`open_tensor` would return from its cache: the server looks
        here first so that a read of a committed version needs no thread hop
        just to find its reader. The names must have been checked.
        """
        key = (job, version, tensor)
        with self._cache_lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is not None and cached.in_memory and not self._mmarker(job, version).is_file():
            self._drop_cached(job, version)  # evicted (by this or another process): read from disk from now on
            return None
        return cached

    def _drop_cached(self, job: str, version: Version) -> None:
        with self._cache_lock:
            for key in [k for k in self._cache if k[0] == job and k[1] == version]:
                del self._cache[key]

    def open_tensor(self, job: str, version: Version | str, tensor: str, *, committed_only: bool = True) -> TensorReader:
        """A reader for one tensor; :class:`NotFound` for an unknown job, version or tensor."""
        check_job(job)
        v = check_version(version)
        check_tensor(tensor)
        cached = self.cached_tensor(job, v, tensor)
        if cached is not None:
            return cached
        found = self._committed_dir(job, v)
        if found is not None:
            vdir, in_memory = found
            committed = True
        else:
            vdir, in_memory = self._working_dir(job, v)
            committed = self._is_committed(job, v)  # committed (or spilled) meanwhile
            if committed:
                return self.open_tensor(job, v, tensor, committed_only=committed_only)
        if not vdir.is_dir():
            if not self._job_exists(job):
                raise NotFound(f"job {job!r} is not in this store")
            raise NotFound(f"version {v} of job {job!r} is not in this store")
        if committed_only and not committed:
            raise NotFound(f"version {v} of job {job!r} is not committed (it is being written or was torn)")
        shards = self._scan_tensor(vdir / tensor_dirname(tensor), tensor)
        if not shards:
            raise NotFound(f"tensor {tensor!r} is not in version {v} of job {job!r}")
        reader = TensorReader(job, v, tensor, committed, shards, self._read_pool(), map_chunks=self.map_chunks,
                              in_memory=in_memory)
        if committed:
            with self._cache_lock:
                self._cache[(job, v, tensor)] = reader
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return reader

    def preload(self, job: str, version: Version | str, threads: int = 8) -> int:
        """Open every tensor of a committed version into the reader cache, ``threads`` at a time; how many.

        Why: a transform asks a node's daemon for pieces of hundreds of tensors
        right after a snapshot, and opening a tensor reads its metadata files,
        cold on disk then (about a second for the ~300 tensors of the 1 GB
        reshard benchmark, one request after the other). Reading them ahead,
        several at once, keeps that off the requests. Tensors that cannot be
        opened are skipped (a request for one reports why).
        """
        v = check_version(version)
        tensors = sorted({info.tensor for info in self.manifest(job, v).shards})
        todo = [t for t in tensors if self.cached_tensor(job, v, t) is None]

        def one(tensor: str) -> bool:
            try:
                self.open_tensor(job, v, tensor)
                return True
            except TenplexError as exc:
                log.debug("preload of %s %s %s skipped: %s", job, v, tensor, exc)
                return False

        if not todo:
            return 0
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(todo))), thread_name_prefix="tenplex-store-preload") as pool:
            return sum(pool.map(one, todo))

    def read_into(
        self,
        job: str,
        version: Version | str,
        tensor: str,
        region: Region,
        out: np.ndarray | torch.Tensor,
        *,
        verify: bool = True,
        uncommitted: bool = False,
    ) -> None:
        """Fill ``out`` (C-contiguous, shape ``region.shape``) with the region, assembled from the local shards.

        Raises :class:`StateLost` when the shards here do not cover it. With ``verify``, a region that is
        exactly a stored shard is checked against its recorded crc32c after the read (one pass over the
        bytes just copied, still in the cache): the check the daemon's client makes of the bytes it is sent.
        A version evicted from memory while it was being read is read again from disk.
        """
        reader = self.open_tensor(job, version, tensor, committed_only=not uncommitted)
        if not isinstance(region, Region):
            raise InvalidInput(f"region must be a Region, got {type(region).__name__}")
        with host_buffer(out, reader.dtype, what=f"output buffer for {tensor!r}") as view:
            try:
                reader.read(region, view)
            except NotFound:
                if not (reader.in_memory and reader.committed):
                    raise
                self._drop_cached(job, reader.version)  # evicted and removed meanwhile: its disk copy is durable
                reader = self.open_tensor(job, reader.version, tensor)
                reader.read(region, view)
            shard = reader.exact_shard(region) if verify else None
            if shard is not None and format_checksum(crc_of(view)) != shard.checksum:
                raise ChecksumMismatch(
                    f"tensor {tensor!r} region {region.format()!r} of version {reader.version} of job {job!r} in "
                    f"{self._mroot if reader.in_memory else self.root} read back with crc32c "
                    f"{format_checksum(crc_of(view))}, recorded {shard.checksum}: it is damaged "
                    + ("in memory" if reader.in_memory else "on disk")
                )

    def read_regions(self, job: str, version: Version | str, reads: Sequence[RegionRead], *, verify: bool = True) -> None:
        """Fill every read's ``out`` with its region of one committed version (:meth:`read_into` each, in order)."""
        v = check_version(version)
        check_job(job)
        for r in reads:
            self.read_into(job, v, r.tensor, r.region, r.out, verify=verify)

    # -- versions -----------------------------------------------------------

    def _scan_manifest(self, job: str, version: Version, vdir: Path, committed: bool, *, durable: bool = False) -> Manifest:
        shards: list[ShardInfo] = []
        try:
            entries = sorted(os.listdir(vdir))
        except FileNotFoundError:
            raise NotFound(f"version {version} of job {job!r} is not in this store") from None
        for name in entries:
            if name == "zarr.json" or not (vdir / name).is_dir():
                continue
            tensor = tensor_from_dirname(name)
            shards.extend(s.info for s in self._scan_tensor(vdir / name, tensor))
        return Manifest(job, version, committed, shards, durable)

    def manifest(self, job: str, version: Version | str) -> Manifest:
        """Everything this store holds of one version; ``durable`` once it is committed on disk."""
        v = check_version(version)
        check_job(job)
        markers = [self._marker(job, v)] + ([self._mmarker(job, v)] if self._mroot is not None else [])
        for marker in markers:  # committed on disk, else in memory; neither: still being written, or unknown
            with contextlib.suppress(FileNotFoundError), open(marker, encoding="utf-8") as f:
                return Manifest.from_json(json.load(f))
        if not self._job_exists(job):
            raise NotFound(f"job {job!r} is not in this store")
        vdir, _in_memory = self._working_dir(job, v)
        if self._is_committed(job, v):  # committed while we looked
            return self.manifest(job, v)
        return self._scan_manifest(job, v, vdir, committed=False)

    def jobs(self) -> list[str]:
        out = set()
        for entry in sorted(os.listdir(self.root)):
            if entry.startswith(".") or not (self.root / entry).is_dir():
                continue
            try:
                out.add(check_job(entry))
            except InvalidInput:
                log.warning("ignoring %s: not a job directory of this store", self.root / entry)
        out.update(self._memory_jobs())
        return sorted(out)

    def _version_names(self, job: str) -> list[Version]:
        dirs = [self._job_dir(job)] + ([self._mjob(job)] if self._mroot is not None else [])
        if not any(d.is_dir() for d in dirs):
            raise NotFound(f"job {job!r} is not in this store")
        found = set()
        for jdir in dirs:
            try:
                entries = os.listdir(jdir)
            except FileNotFoundError:
                continue
            for entry in entries:
                if entry.startswith(".") or not (jdir / entry).is_dir():
                    continue
                try:
                    found.add(Version.parse(entry))
                except InvalidInput:
                    log.warning("ignoring %s: not a version directory", jdir / entry)
        return sorted(found)

    def versions(self, job: str) -> list[VersionInfo]:
        """All versions of a job here, committed or not, ordered by (step, generation); which are durable
        (committed on disk) and which are in memory."""
        out = []
        for v in self._version_names(job):
            try:
                m = self.manifest(job, v)
            except NotFound:
                continue  # deleted while we looked
            if self._mroot is None:
                in_memory = False
            elif m.committed:
                in_memory = self._mmarker(job, v).is_file()
            else:
                in_memory = self._working_dir(job, v)[1]
            out.append(VersionInfo(v, m.committed, m.nbytes, durable=m.committed and m.durable, in_memory=in_memory))
        return out

    def is_committed(self, job: str, version: Version | str) -> bool:
        """A stat of the version's commit marker (or its memory tier's): :meth:`versions` would scan every
        shard of a version still being written, which is exactly when waiting workers ask."""
        v = check_version(version)
        check_job(job)
        return self._is_committed(job, v)

    def wait_committed(self, job: str, version: Version | str, timeout_s: float) -> bool:
        """Woken by this object's own commits (the daemon's transforms and commit requests, at once); a commit
        by another process sharing the root is seen within :data:`COMMIT_RECHECK_S`."""
        v = check_version(version)
        check_job(job)
        deadline = time.monotonic() + timeout_s
        with self._commits:
            while not self._is_committed(job, v):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._commits.wait(min(COMMIT_RECHECK_S, left))
        return True

    def commit(self, job: str, version: Version | str) -> Manifest:
        """Make a version visible as committed, atomically; a no-op on a committed version.

        A version on disk is synced first and committed durable; a version in
        memory is committed by its marker there (readable now, durable once
        the daemon's spiller has copied it to disk).
        """
        v = check_version(version)
        with self._locked(job):
            if self._is_committed(job, v):
                return self.manifest(job, v)
            vdir, in_memory = self._working_dir(job, v)
            if not vdir.is_dir():
                raise NotFound(f"version {v} of job {job!r} is not in this store; nothing to commit")
            manifest = self._scan_manifest(job, v, vdir, committed=True, durable=not in_memory)
            if in_memory:
                marker = self._mmarker(job, v)
                marker.parent.mkdir(exist_ok=True)
                _write_json_atomic(marker, manifest.to_json(), durable=False)
                self._mclaim(job, v).unlink(missing_ok=True)
            else:
                if self.durable:
                    _sync_tree(vdir)
                marker = self._marker(job, v)
                marker.parent.mkdir(exist_ok=True)
                _write_json_atomic(marker, manifest.to_json(), durable=self.durable)
        with self._commits:
            self._commits.notify_all()
        if in_memory and self._spiller is not None:
            self._spiller.wake()
        log.info("committed version %s of job %s%s: %d shards, %d bytes", v, job, " in memory" if in_memory else "",
                 len(manifest.shards), manifest.nbytes)
        return manifest

    def delete(self, job: str, version: Version | str) -> None:
        """Remove a version (committed or not) from both tiers: the markers first, then the data, so it never
        looks committed and partial."""
        v = check_version(version)
        trash: list[Path] = []
        with self._locked(job):
            markers = [self._marker(job, v)]
            dirs = [(self._version_dir(job, v), self._staging(job))]
            if self._mroot is not None:
                markers += [self._mmarker(job, v), self._mevicting(job, v), self._mclaim(job, v)]
                dirs.append((self._mvdir(job, v), self._mstaging(job)))
            if not any(m.exists() for m in markers) and not any(d.exists() for d, _s in dirs):
                raise NotFound(f"version {v} of job {job!r} is not in this store")
            for marker in markers:
                with contextlib.suppress(FileNotFoundError):
                    marker.unlink()
            for vdir, staging in dirs:
                if vdir.exists():
                    t = staging / f"deleted-{v}-{uuid.uuid4().hex}"
                    t.parent.mkdir(parents=True, exist_ok=True)
                    os.rename(vdir, t)
                    trash.append(t)
        self._drop_cached(job, v)
        for t in trash:
            shutil.rmtree(t, ignore_errors=True)
        log.info("deleted version %s of job %s", v, job)

    def gc(self, job: str, keep_last: int, *, stale_staging_s: float = 3600.0) -> list[Version]:
        """Delete all but the newest ``keep_last`` committed versions, and uncommitted ones older than the newest committed.

        Uncommitted versions newer than every committed one may still be being
        written and are kept. Also clears leftovers of killed writers: deleted
        or replaced copies, and shards left in staging that nothing has
        written to for ``stale_staging_s`` seconds; and removes evicted memory
        versions whose grace period has passed.
        """
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise InvalidInput(f"keep_last must be an integer >= 1 (the newest committed version is never collected), got {keep_last!r}")
        infos = self.versions(job)
        committed = [vi.version for vi in infos if vi.committed]
        keep = set(committed[-keep_last:])
        newest = committed[-1] if committed else None
        doomed = [
            vi.version
            for vi in infos
            if vi.version not in keep and (vi.committed or (newest is not None and vi.version < newest))
        ]
        for v in doomed:
            with contextlib.suppress(NotFound):
                self.delete(job, v)
        self._clean_staging(self._staging(job), stale_staging_s)
        if self._mroot is not None:
            self._clean_staging(self._mstaging(job), stale_staging_s)
            self.reap_evicted()
        if doomed:
            log.info("gc of job %s deleted %s", job, ", ".join(map(str, doomed)))
        return doomed

    def _clean_staging(self, staging: Path, stale_s: float) -> None:
        """Remove deleted versions, replaced shards and abandoned partial shards, spills and moves left by crashes."""
        if not staging.is_dir():
            return
        now = time.time()
        for entry in os.listdir(staging):
            path = staging / entry
            if entry.startswith(("deleted-", "replaced-")):
                shutil.rmtree(path, ignore_errors=True)
            elif entry.startswith(("shard-", "spill-", "demote-")) and now - _newest_mtime(path) > stale_s:
                log.info("removing %s: a partial write nothing has written to for %.0f s", path, now - _newest_mtime(path))
                shutil.rmtree(path, ignore_errors=True)

    def verify(self, job: str, version: Version | str) -> list[str]:
        """Re-read every shard and compare its crc32c with the recorded one; the problems found (empty = intact)."""
        v = check_version(version)
        manifest = self.manifest(job, v)
        problems = []
        for info in manifest.shards:
            try:
                reader = self.open_tensor(job, v, info.tensor, committed_only=False)
                crc = reader.checksum(info.region)
            except Exception as exc:  # report every broken shard, not just the first
                problems.append(f"{info.tensor} {info.region.format()}: unreadable: {exc}")
                continue
            if format_checksum(crc) != info.checksum:
                problems.append(f"{info.tensor} {info.region.format()}: checksum {format_checksum(crc)} != recorded {info.checksum}")
        return problems

    def nbytes(self, job: str, version: Version | str) -> int:
        return self.manifest(job, version).nbytes


def _link_kept(src: Path, rel: str, spilled: Sequence[tuple[Path, Path]], dst: Path) -> bool:
    """Link ``dst`` to the disk copy of a spilled version whose memory file is ``src``'s very file (a shard a
    transform kept by a hard link): the same bytes, verified when that version was spilled."""
    ino = os.stat(src).st_ino
    for mdir, ddir in spilled:
        try:
            if os.stat(mdir / rel).st_ino == ino:
                os.link(ddir / rel, dst)
                return True
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:  # no hard links there: copy
            return False
    return False


def _newest_mtime(path: Path) -> float:
    """Latest modification time of anything under ``path`` (a partial shard being written keeps changing)."""
    newest = 0.0
    for dirpath, _dirs, files in os.walk(path):
        for name in (dirpath, *(os.path.join(dirpath, f) for f in files)):
            with contextlib.suppress(FileNotFoundError):
                newest = max(newest, os.stat(name).st_mtime)
    return newest


def _damage(reader: TensorReader, shard: _StoredShard, region: Region) -> str | None:
    """What is wrong with a stored shard's bytes, or None: each chunk file against its recorded crc32c
    where the writer recorded them (whole files, sequential, no copies), else one pass against the
    shard's checksum."""
    if shard.chunk_crcs is not None and shard.layout is not None:
        return RawChunkReader(shard.path, shard.layout).verify_chunks(shard.chunk_crcs)
    crc = format_checksum(reader.checksum(region))
    return None if crc == shard.info.checksum else f"crc32c {crc}, recorded {shard.info.checksum}"


def _copy_tree(src: Path, dst: Path) -> None:
    """Recreate the directory tree ``src`` at ``dst`` with copies of its files (a shard moving between tiers)."""
    if not src.is_dir():
        raise FileNotFoundError(src)
    for dirpath, _dirs, files in os.walk(src):
        out = dst / os.path.relpath(dirpath, src)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            shutil.copyfile(os.path.join(dirpath, name), out / name)


def _link_tree(src: Path, dst: Path) -> None:
    """Recreate the directory tree ``src`` at ``dst`` with hard links to its files (copies where links fail)."""
    for dirpath, _dirs, files in os.walk(src):
        out = dst / os.path.relpath(dirpath, src)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            try:
                os.link(os.path.join(dirpath, name), out / name)
            except FileNotFoundError:
                raise
            except OSError:  # a file system without hard links, or the link limit: copy this one
                shutil.copyfile(os.path.join(dirpath, name), out / name)
    if not dst.is_dir():  # os.walk yields nothing for a source that is gone
        raise FileNotFoundError(src)


def _sync_tree(path: Path) -> None:
    """Make every file and directory entry under ``path`` durable before the commit marker is written.

    One ``syncfs(2)`` of the store's file system (Linux) flushes them all in a single call; a version
    of a few hundred shards would otherwise cost thousands of fsyncs. Elsewhere, fsync each one.
    """
    if _syncfs(path):
        return
    _fsync_tree(path)


def _syncfs(path: Path) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except (OSError, AttributeError):
        return False
    try:
        return libc.syncfs(fd) == 0
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath), directory=True)

