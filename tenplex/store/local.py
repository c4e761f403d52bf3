"""Zarr-backed shard storage on a node's local disk: the :class:`~tenplex.store.base.TensorStore` of this machine.

The files under the root are described in :mod:`tenplex.store.layout`; the
memory tier beside it is :class:`~tenplex.store.memory.MemoryTier`, which this
store asks where a version goes. Why this shape:

- A shard is written into ``.staging`` and renamed into place only when all
  its bytes and its checksum are on disk, so a reader never sees half a shard
  and a writer killed mid-shard leaves only garbage in ``.staging``.
- A version is committed by writing its manifest to a temporary file,
  fsyncing it and renaming it to ``.commits/<version>.json``; the rename is
  atomic, so a crash at any point leaves the version either committed with
  all its data (made durable first) or visibly uncommitted. Committed versions
  are immutable, which is what makes caching their metadata safe (a cached
  reader is checked against its commit marker: a version another process
  deleted, or wrote again under its name, is opened anew).
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
import json
import logging
import math
import os
import shutil
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tenplex.core.version import Version
from tenplex.errors import (
    ChecksumMismatch,
    Conflict,
    InvalidInput,
    NotFound,
    StoreUnavailable,
    TenplexError,
)
from tenplex.ptc.dtypes import check_dtype, storage_dtype
from tenplex.ptc.region import Region
from tenplex.store.base import COMMIT_RECHECK_S, RegionRead, TensorStore
from tenplex.store.buffers import (
    DEFAULT_CHUNK_BYTES,
    ReceivedCrcs,
    chunk_shape,
    crc_of,
    host_buffer,
    host_data,
    slabs,
)
from tenplex.store.layout import (
    ATTR,
    CHUNK_CRCS,
    Root,
    clean_staging,
    copy_tree,
    group_written,
    link_tree,
    sync_tree,
    write_group,
    write_json_atomic,
)
from tenplex.store.memory import MemoryTier, Placement
from tenplex.store.model import Manifest, ShardInfo, VersionInfo, format_checksum
from tenplex.store.names import (
    check_job,
    check_shard_target,
    check_tensor,
    check_version,
    region_key,
    tensor_dirname,
    tensor_from_dirname,
)
from tenplex.store.rawchunks import (
    ChunkLayout,
    RawChunkWriter,
    direct_writes_work,
)
from tenplex.store.reader import (
    PIECE_BYTES,
    TensorReader,
    damage,
    scan_tensor,
)
from tenplex.store.tiers import MemorySlots
from tenplex.store.writer import ShardWriter

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_MAX_PIECE_BYTES = 256 << 20  # ... grown up to this to hold whole bands of chunks


class LocalStore(TensorStore):
    """Zarr-backed shard storage under one root directory; one zarr group per (job, version).

    Thread-safe and safe to share between processes on one root. ``durable``
    fsyncs a version's files before its commit marker (turn it off only for
    scratch stores). ``cache_size`` bounds the metadata cache of committed
    (immutable) versions. ``map_chunks`` (default) copies all but small parts
    of chunks through a memory map (huge pages where the kernel allows),
    measured 1.4-1.7x faster than reading their rows with ``preadv`` (what
    ``False`` does) and no more daemon CPU.
    ``direct_writes`` (default, where the file system allows it) writes
    chunk files with ``O_DIRECT``, past the page cache: see
    :class:`~tenplex.store.rawchunks.RawChunkWriter` for why and what it measured.

    **Memory tier** (:class:`~tenplex.store.memory.MemoryTier`, :attr:`memory`). With a memory root (a
    tmpfs directory, same layout as the root) and a budget, new versions are written there while they fit,
    committed there (a marker, no fsync: not durable yet) and read from there, peers included, until the
    tier's owner (the node daemon) has spilled them to disk and evicted them; :meth:`versions` and
    :meth:`manifest` say which versions are durable. Within a tier, kept shards are hard links; across
    tiers they are copied. ``memory``: the tier (its owner, the node daemon, makes it with
    :meth:`MemoryTier.open` ``owner=True``); else the root's recorded tier, as :meth:`MemoryTier.open`
    finds it from ``memory_root`` and ``memory_bytes`` (none: the tier the root records, if any).
    :meth:`close` closes the tier too. ``placement``: who places versions in the tier (default: the tier,
    in this process); a worker sharing the daemon's root gives the daemon's
    :class:`~tenplex.store.client.StoreClient`, so that only the daemon takes the tier's budget lock, evicts
    and moves versions (:meth:`reserve`).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        durable: bool = True,
        cache_size: int = 1024,
        map_chunks: bool = True,
        direct_writes: bool = True,
        memory: MemoryTier | None = None,
        memory_root: str | Path | None = None,
        memory_bytes: int | None = None,
        placement: Placement | None = None,
    ) -> None:
        if chunk_bytes < 64:
            raise InvalidInput(f"chunk_bytes must be at least 64, got {chunk_bytes}")
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = str(self.root)  # a path: open_store() gives a LocalStore back (file:// URLs are persistent tiers)
        self.chunk_bytes = chunk_bytes
        self.durable = durable
        self._cache: OrderedDict[tuple[str, Version, str], tuple[TensorReader, str, tuple[int, int]]] = OrderedDict()
        """Readers of committed tensors, each with the commit marker it was opened under: its path and identity."""
        self._cache_size = cache_size
        self._cache_lock = threading.Lock()
        self.map_chunks = map_chunks
        self.direct_writes = direct_writes and direct_writes_work(self.root)

        if memory is None:
            memory = MemoryTier.open(self.root, memory_root, memory_bytes, durable=durable, direct_writes=self.direct_writes)
        elif memory_root is not None or memory_bytes is not None:
            raise InvalidInput("give a store either its memory tier or the tier's memory_root/memory_bytes, not both")
        self.memory = memory
        """The memory tier, if any (what the daemon's spiller, metrics and the tests ask about the tier)."""
        self._disk = Root(self.root)
        self._mem: Root | None = memory.mem if memory is not None else None
        self._placement: Placement | None = placement if placement is not None else memory
        self._reserved: dict[tuple[str, Version], tuple[bool, int]] = {}
        """(job, version) -> (in memory, bytes reserved and not yet written) of this store's writers."""
        self._commits = threading.Condition()
        """Notified at every commit by this object: what :meth:`wait_committed` waits on."""

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})" if self._mem is None else f"LocalStore({str(self.root)!r}, memory {str(self._mem.path)!r})"

    def close(self) -> None:
        """Stop the memory tier's spiller and snapshot buffers of this process (the store stays usable)."""
        if self.memory is not None:
            self.memory.close()

    # -- where a version is ---------------------------------------------------

    def _locked(self, job: str, *, create: bool = False) -> contextlib.AbstractContextManager[None]:
        """The job's lock (in the disk root, for both tiers). Lock order: the tier's budget lock before any job's."""
        memory = self.memory
        return self._disk.locked(job, create=create or (lambda: memory is not None and memory.holds_job(job)))

    def _is_committed(self, job: str, version: Version) -> bool:
        return self._disk.marker(job, version).is_file() or (self.memory is not None and self.memory.committed(job, version))

    def _committed_dir(self, job: str, version: Version) -> tuple[Path, bool] | None:
        """(directory, in memory) of a committed version, read from memory while it is there; None if not committed."""
        if self._mem is not None and self._mem.marker(job, version).is_file():
            return self._mem.version(job, version), True
        if self._disk.marker(job, version).is_file():
            return self._disk.version(job, version), False
        return None

    def _working_dir(self, job: str, version: Version) -> tuple[Path, bool]:
        """(directory, in memory) of an uncommitted version: the tier it was placed in (disk when in none)."""
        mdir = self.memory.working_dir(job, version) if self.memory is not None else None
        return (mdir, True) if mdir is not None else (self._disk.version(job, version), False)

    def _roots(self) -> list[Root]:
        """The disk root, then the memory root where there is a tier."""
        return [self._disk] if self._mem is None else [self._disk, self._mem]

    def reserve(self, job: str, version: Version | str, nbytes: int) -> None:
        """Place an uncommitted version and claim ``nbytes`` for this store's writers, in one call to the
        placement (the daemon's API for a worker): its shards then take from that room without asking again,
        and only what outgrows it is asked for shard by shard."""
        v = check_version(version)
        check_job(job)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidInput(f"nbytes must be an integer >= 0, got {nbytes!r}")
        if self.memory is None:
            return
        in_memory = self._ask_placement(job, v, nbytes)
        with self._cache_lock:
            for key in [k for k in self._reserved if k[0] == job and k != (job, v)]:
                del self._reserved[key]  # one version of a job is written at a time: the older ones are done
            held = self._reserved.get((job, v), (in_memory, 0))[1] if in_memory else 0
            self._reserved[(job, v)] = (in_memory, held + nbytes)

    def _place(self, job: str, version: Version, nbytes: int) -> bool:
        """Whether ``nbytes`` more of an uncommitted version go to memory (the placement's decision) or to
        disk: from this store's reservation while it lasts and the version is still where it was placed (a
        version placed on disk stays there; one in memory may have been deleted or moved to disk since)."""
        if self.memory is None:
            return False
        with self._cache_lock:
            held = self._reserved.get((job, version))
            if held is not None and (not held[0] or held[1] >= nbytes):
                self._reserved[(job, version)] = (held[0], held[1] - nbytes if held[0] else 0)
            else:
                held = None
        if held is not None and (not held[0] or self.memory.working_dir(job, version) is not None):
            return held[0]
        return self._ask_placement(job, version, nbytes)

    def _ask_placement(self, job: str, version: Version, nbytes: int) -> bool:
        """The placement's answer; where the daemon cannot be reached, the version goes to disk (pinned
        there by its directory: it cannot take memory the daemon does not know of), unless the daemon placed
        it in memory already: then :class:`StoreUnavailable` (writing there unclaimed would overrun the budget)."""
        assert self._placement is not None
        try:
            return self._placement.place(job, version, nbytes)
        except StoreUnavailable as exc:
            with self._locked(job, create=True):
                if self._is_committed(job, version) or self._working_dir(job, version)[1]:
                    raise StoreUnavailable(f"version {version} of job {job!r} is in the memory tier and its daemon, "
                                           f"which places it, cannot be reached: {exc.detail}") from exc
                vdir = self._disk.version(job, version)
                if not group_written(vdir):
                    write_group(vdir, {"job": job, "version": str(version)})
            log.warning("the store daemon cannot be reached to place version %s of job %s in memory (%s): "
                        "writing it to disk", version, job, exc.detail)
            return False

    def _staging_root(self, job: str, in_memory: bool) -> Path:
        return self._mem.staging(job) if in_memory and self._mem is not None else self._disk.staging(job)

    def _job_exists(self, job: str) -> bool:
        return self._disk.job(job).is_dir() or (self.memory is not None and self.memory.holds_job(job))

    # -- snapshot buffers ---------------------------------------------------------

    def snapshot_buffers(self, job: str) -> MemorySlots | None:
        """With a memory tier: buffers in it that a snapshot copies into and then stores without copying again
        (:class:`~tenplex.store.tiers.MemorySlots`); None without one."""
        if self.memory is None or sys.byteorder != "little":
            return None
        return self.memory.slots(job, self.adopt_slot)

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
        assert self._mem is not None  # placed in memory
        staging = self._mem.staging(job) / f"shard-{uuid.uuid4().hex}"
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
        piece_bytes: int = PIECE_BYTES,
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

        staging_root = self._staging_root(job, in_memory)
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
        return ShardWriter(self._install, job, v, tensor, region, dtype, gshape, staging, layout, pieces, raw, in_memory)

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
        """See :meth:`TensorStore.write_shard <tenplex.store.base.TensorStore.write_shard>`: with ``received`` the
        chunk files' and the shard's crc32c come from those prefixes, not from another pass over the bytes."""
        arr = host_data(data, dtype, tensor, region)
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
        for shard in scan_tensor(vdir / tensor_dirname(tensor), tensor, limit=1):
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
        src = reader.stored_shard(region)
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
            problem = damage(reader, src, region)
            if problem is not None:
                raise ChecksumMismatch(
                    f"shard {tensor!r} {region.format()!r} of version {reader.version} of job {job!r} in "
                    f"{self._mem.path if reader.in_memory and self._mem else self.root}: {problem}: it is damaged "
                    + ("in memory" if reader.in_memory else "on disk")
                )
        in_memory = self._place(job, v, info.nbytes)
        staging = self._staging_root(job, in_memory) / f"shard-{uuid.uuid4().hex}"
        staging.parent.mkdir(parents=True, exist_ok=True)
        try:
            if reader.in_memory == in_memory:
                link_tree(src.path, staging)
            else:
                copy_tree(src.path, staging)
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
            if not vdir.is_dir() and staged_in_memory and self._mem is not None:
                vdir, in_memory = self._mem.version(job, version), True  # deleted meanwhile: made anew where it was staged
            if in_memory != staged_in_memory:
                moved = self._staging_root(job, in_memory) / f"shard-{uuid.uuid4().hex}"
                moved.parent.mkdir(parents=True, exist_ok=True)
                copy_tree(staging, moved)
                shutil.rmtree(staging, ignore_errors=True)
                staging = moved
            tdir = vdir / tensor_dirname(info.tensor)
            target = tdir / region_key(info.region)
            self._check_tensor_consistent(job, version, info.tensor, info.dtype, info.global_shape)
            if not group_written(vdir):
                write_group(vdir, {"job": job, "version": str(version)})
            if not group_written(tdir):
                write_group(tdir, {"tensor": info.tensor})
            if target.exists():
                old = staging.with_name(f"replaced-{uuid.uuid4().hex}")
                os.rename(target, old)
            os.rename(staging, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        log.debug("stored %s %s %s of job %s (%d bytes)", version, info.tensor, info.region, job, info.nbytes)

    # -- reading ------------------------------------------------------------

    def cached_tensor(self, job: str, version: Version, tensor: str) -> TensorReader | None:
        """The cached reader of a committed version's tensor, or None; one ``stat``: its commit marker must be
        the one it was opened under (else the version was evicted, or deleted, perhaps written anew under its
        name, by this or another process sharing the root: None, and it is opened again).

        What :meth:`open_tensor` would return from its cache: the server looks
        here first so that a read of a committed version needs no thread hop
        just to find its reader. The names must have been checked.
        """
        key = (job, version, tensor)
        with self._cache_lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            return None
        if _file_id(cached[1]) != cached[2]:
            self._drop_cached(job, version)  # evicted (then read from disk) or deleted
            return None
        return cached[0]

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
        marker: tuple[str, tuple[int, int] | None] | None = None
        if found is not None:
            vdir, in_memory = found
            committed = True
            path = str((self._mem if in_memory and self._mem is not None else self._disk).marker(job, v))
            marker = (path, _file_id(path))  # before the scan: a change after it is seen next time
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
        shards = scan_tensor(vdir / tensor_dirname(tensor), tensor)
        if not shards:
            raise NotFound(f"tensor {tensor!r} is not in version {v} of job {job!r}")
        reader = TensorReader(job, v, tensor, committed, shards, map_chunks=self.map_chunks,
                              in_memory=in_memory)
        if marker is not None and marker[1] is not None:
            with self._cache_lock:
                self._cache[(job, v, tensor)] = (reader, marker[0], marker[1])
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
        """Assembled from the local shards; the ``verify`` pass runs over the bytes just copied, still in the
        cache. A version evicted from memory while it was being read is read again from disk."""
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
                    f"{self._mem.path if reader.in_memory and self._mem else self.root} read back with crc32c "
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
            shards.extend(s.info for s in scan_tensor(vdir / name, tensor))
        return Manifest(job, version, committed, shards, durable)

    def manifest(self, job: str, version: Version | str) -> Manifest:
        """Everything this store holds of one version; ``durable`` once it is committed on disk."""
        v = check_version(version)
        check_job(job)
        markers = [root.marker(job, v) for root in self._roots()]
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
        return sorted({job for root in self._roots() for job in root.jobs()})

    def _version_names(self, job: str) -> list[Version]:
        if not any(root.job(job).is_dir() for root in self._roots()):
            raise NotFound(f"job {job!r} is not in this store")
        return sorted(set().union(*(root.versions(job) for root in self._roots())))

    def versions(self, job: str) -> list[VersionInfo]:
        """All versions of a job here, committed or not, ordered by (step, generation); which are durable
        (committed on disk) and which are in memory."""
        out = []
        for v in self._version_names(job):
            try:
                m = self.manifest(job, v)
            except NotFound:
                continue  # deleted while we looked
            if self.memory is None:
                in_memory = False
            elif m.committed:
                in_memory = self.memory.committed(job, v)
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
            if in_memory and self.memory is not None:
                self.memory.commit(job, v, manifest)
            else:
                if self.durable:
                    sync_tree(vdir)
                marker = self._disk.marker(job, v)
                marker.parent.mkdir(exist_ok=True)
                write_json_atomic(marker, manifest.to_json(), durable=self.durable)
        with self._commits:
            self._commits.notify_all()
        log.info("committed version %s of job %s%s: %d shards, %d bytes", v, job, " in memory" if in_memory else "",
                 len(manifest.shards), manifest.nbytes)
        return manifest

    def delete(self, job: str, version: Version | str) -> None:
        """Remove a version (committed or not) from both tiers: the markers first, then the data, so it never
        looks committed and partial."""
        v = check_version(version)
        with self._locked(job):
            markers = [self._disk.marker(job, v)]
            if self._mem is not None:
                markers += [self._mem.marker(job, v), self._mem.evicting(job, v), self._mem.claim(job, v)]
            dirs = [(root, root.version(job, v)) for root in self._roots()]
            if not any(m.exists() for m in markers) and not any(d.exists() for _r, d in dirs):
                raise NotFound(f"version {v} of job {job!r} is not in this store")
            for marker in markers:
                with contextlib.suppress(FileNotFoundError):
                    marker.unlink()
            trash = [root.set_aside(job, vdir, f"deleted-{v}") for root, vdir in dirs if vdir.exists()]
        self._drop_cached(job, v)
        with self._cache_lock:
            self._reserved.pop((job, v), None)
        for t in trash:
            shutil.rmtree(t, ignore_errors=True)
        log.info("deleted version %s of job %s", v, job)

    def gc(self, job: str, keep_last: int, *, stale_staging_s: float = 3600.0) -> list[Version]:
        """:meth:`TensorStore.gc <tenplex.store.base.TensorStore.gc>`, then the leftovers of killed writers:
        deleted or replaced copies, and shards left in staging that nothing has written to for
        ``stale_staging_s`` seconds; and evicted memory versions whose grace period has passed."""
        doomed = super().gc(job, keep_last)
        for root in self._roots():
            clean_staging(root.staging(job), stale_staging_s)
        if self.memory is not None:
            self.memory.reap_evicted()
        if doomed:
            log.info("gc of job %s deleted %s", job, ", ".join(map(str, doomed)))
        return doomed

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


def _file_id(path: str) -> tuple[int, int] | None:
    """(inode, mtime) of a commit marker (markers are renamed into place: a new file each time), None if absent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns
