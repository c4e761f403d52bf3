"""Region reads and writes straight to the chunk files of uncompressed zarr v3 arrays.

zarr-python decodes each chunk into a fresh buffer and then copies the
selected part into the output: two copies plus per-chunk asyncio overhead,
about a third of ``numpy.copyto`` speed. For the arrays this store writes
(zarr v3, regular chunk grid, the ``bytes`` codec only, little endian) the
zarr v3 specification fixes the chunk file format: the chunk's elements in C
order at the full chunk shape (edge chunks padded). So a region can be
copied from each chunk file directly into the caller's buffer: one copy from
the page cache, no intermediate buffer, and only the chunks the region
touches. A part of a chunk of 64 KiB or more, or of more than a few row
segments, is copied with numpy from a map of the chunk file that asks for
huge pages (see :func:`_map_file`; a 1/4-width column slice of whole-row
chunks: 6.2 GB/s mapped vs 3.7 GB/s with a ``preadv`` per row segment); a
small part, or any part with ``map_chunks=False``, is read with ``preadv``
straight into the destination rows (one iovec per row). Arrays with any other
codec or layout fall back to zarr's own reader.

A region's payload can also be described as *runs*: byte ranges of chunk
files in payload order (:meth:`RawChunkReader.runs`). For the store's
whole-row chunks any band of rows is one run per chunk, so the server sends
such regions from maps of the chunk files without copying them
(:func:`map_runs`), and checksums are computed in place
(:func:`checksum_runs`).

A missing or short chunk file is an error here (zarr would silently return
fill values): this store writes every chunk, so it means damage.

Writes are the mirror image: a piece of a shard that covers whole chunks is
written with ``writev`` from the rows of the caller's array (edge chunks
padded with zeros, as the format requires), about 10x faster than zarr's
per-chunk encode path. The array's ``zarr.json`` is written from a
:class:`ChunkLayout` too (creating it through zarr costs milliseconds of
asyncio round trips per shard, which dominated storing a few hundred small
shards); zarr still writes any piece that does not cover whole chunks, and
opens every array the store writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import math
import mmap
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import numpy as np

from tenplex.core.buffers import PAGE_BYTES, byte_view
from tenplex.errors import NotFound, StateLost
from tenplex.ptc.region import Region
from tenplex.store.buffers import ReceivedCrcs, crc32c_combine

log = logging.getLogger(__name__)

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_mincore: Any = getattr(ctypes.CDLL(None, use_errno=True), "mincore", None) if sys.platform.startswith("linux") else None
_COLD_READERS = 4  # threads reading the cold chunk runs of one batch (disk reads in flight at once)
_MADV_POPULATE_READ = 22  # Linux <uapi/asm-generic/mman-common.h>; not in Python 3.11's mmap module
_MAP_MIN_BYTES = 64 << 10  # parts of a chunk at least this big are copied through a map, smaller ones with preadv ...
_PREADV_MAX_SEGMENTS = 8  # ... unless they are more ranges of the file than this (one preadv each; a map copies all at once)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_DIRECT_ALIGN = PAGE_BYTES  # O_DIRECT buffer address, file offset and length: a multiple of the logical block size
_bounce = threading.local()
MAX_MAPS = 256
"""Chunk files mapped at a time by one batch of runs (4 MiB chunks: 1 GiB; each map holds a descriptor)."""


def _bounce_buffer(size: int) -> mmap.mmap:
    """This thread's page-aligned buffer of at least ``size`` bytes, kept for the next chunk (no page faults)."""
    buf = getattr(_bounce, "buf", None)
    if buf is None or len(buf) < size:
        buf = mmap.mmap(-1, size)
        _bounce.buf = buf
    return buf


def direct_writes_work(directory: Path) -> bool:
    """Whether files in ``directory`` accept an ``O_DIRECT`` write of one aligned block (tmpfs does not)."""
    if not _O_DIRECT:
        return False
    probe = directory / f".direct-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
        try:
            os.write(fd, memoryview(mmap.mmap(-1, _DIRECT_ALIGN)))
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def _map_file(fd: int, nbytes: int) -> mmap.mmap:
    """A read-only shared map of a file's first ``nbytes``, asking for huge pages (``MADV_HUGEPAGE``).

    Why huge pages: where the file system keeps files in large page-cache
    folios (ext4 on Linux 6.x does) and transparent huge pages are enabled
    (``always`` or ``madvise``), the first read of a chunk through such a map
    fills the page cache with 2 MiB folios, and every later map of the chunk
    then costs two page-table entries instead of a thousand. Measured on the
    2-core VM (4 MiB chunk files written with ``O_DIRECT``): crc32c through a
    map ran at 12 GB/s when the first read had gone through a huge-page map,
    4-5 GB/s when it had gone through ``pread`` or a plain map; mapping 64 MiB
    took 0.3 ms instead of 7 ms. Without THP the advice is ignored. No
    ``MAP_POPULATE``: pages are mapped as they are touched, after the advice.
    """
    m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    if _MADV_HUGEPAGE is not None and nbytes >= 2 << 20:
        with contextlib.suppress(OSError):  # a kernel without THP
            m.madvise(_MADV_HUGEPAGE)
    return m


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """How an uncompressed zarr v3 array lies in its chunk files: all that direct reads and writes need.

    The store writes its arrays' ``zarr.json`` from this itself (one small
    file, no zarr round trip per shard) and reads it back from the same
    document, so that opening a shard costs one JSON parse. The documents are
    ordinary zarr v3 array metadata: zarr opens every array the store writes.
    """

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype
    separator: str = "."
    """Of the ``default`` chunk key encoding: ``.`` keeps the chunk files in the array's directory
    (``c.1.0``; no directory per chunk row to create), ``/`` nests them (zarr's default, read too)."""

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def chunk_bytes(self) -> int:
        return math.prod(self.chunks) * self.itemsize

    def chunk_coords(self) -> list[tuple[int, ...]]:
        """Every chunk's grid coordinates, in chunk-grid (C) order: the order recorded checksums follow."""
        return list(itertools.product(*(range(-(-n // c)) for n, c in zip(self.shape, self.chunks, strict=True))))

    def chunk_key(self, coords: Sequence[int]) -> str:
        """The chunk file of ``coords`` under the ``default`` chunk key encoding (``c.1.0``; ``c`` for 0-d)."""
        return "c" + "".join(f"{self.separator}{k}" for k in coords)

    def metadata(self, attributes: dict[str, Any], *, checksum: bool = False) -> dict[str, Any]:
        """The array's ``zarr.json`` document (zarr v3: regular grid, ``bytes`` codec, no compression; with
        ``checksum`` each chunk carries its crc32c too, zarr's ``crc32c`` codec: the persistent tier's chunks)."""
        codec: dict[str, Any] = {"name": "bytes"}
        if self.itemsize > 1:
            codec["configuration"] = {"endian": "little"}
        kind = self.dtype.kind
        fill: Any = False if kind == "b" else (0.0 if kind == "f" else 0)
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": self.dtype.name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(self.chunks)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": self.separator}},
            "fill_value": fill,
            "codecs": [codec, {"name": "crc32c"}] if checksum else [codec],
            "attributes": attributes,
            "storage_transformers": [],
        }

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> ChunkLayout | None:
        """The layout of an array whose chunk files are raw little-endian C-order elements, else None.

        None (the caller falls back to zarr's own reader) for anything else:
        another codec or compression, another grid or key encoding, a
        big-endian host, a data type numpy does not name the same way.
        """
        try:
            if meta.get("zarr_format") != 3 or meta.get("node_type") != "array" or sys.byteorder != "little":
                return None
            if meta.get("storage_transformers") not in (None, []):
                return None
            codecs = meta["codecs"]
            if len(codecs) != 1 or codecs[0].get("name") != "bytes":
                return None
            endian = (codecs[0].get("configuration") or {}).get("endian", "little")
            grid, keys = meta["chunk_grid"], meta["chunk_key_encoding"]
            if grid.get("name") != "regular" or keys.get("name") != "default":
                return None
            separator = (keys.get("configuration") or {}).get("separator", "/")
            dtype = np.dtype(meta["data_type"])
            if dtype.name != meta["data_type"] or (endian != "little" and dtype.itemsize > 1):
                return None
            shape = tuple(int(n) for n in meta["shape"])
            chunks = tuple(int(n) for n in grid["configuration"]["chunk_shape"])
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        if len(chunks) != len(shape) or any(c < 1 for c in chunks) or separator not in ("/", "."):
            return None
        return cls(shape, chunks, dtype, separator)


@dataclass(frozen=True, slots=True)
class ChunkRun:
    """Bytes ``[offset, offset + nbytes)`` of one chunk file: one contiguous run of a region's C-order payload."""

    reader: RawChunkReader
    coords: tuple[int, ...]
    offset: int
    nbytes: int


class RawChunkReader:
    """Reads regions of one array with a :class:`ChunkLayout` by ``preadv`` into the destination."""

    def __init__(
        self, path: Path, layout: ChunkLayout, *, map_chunks: bool = True, chunk_crcs: Sequence[int] | None = None
    ) -> None:
        self.path = path
        self.layout = layout
        self.shape = layout.shape
        self.chunks = layout.chunks
        self.itemsize = layout.itemsize
        self._encode = layout.chunk_key
        self.chunk_bytes = layout.chunk_bytes
        # byte strides of a chunk file
        strides = [self.itemsize] * len(self.chunks)
        for d in range(len(self.chunks) - 2, -1, -1):
            strides[d] = strides[d + 1] * self.chunks[d + 1]
        self._strides = strides
        self._use_mmap = map_chunks and self.chunk_bytes > 0 and self.itemsize in _UINT
        self._chunk_crcs: dict[tuple[int, ...], int] | None = None
        if chunk_crcs is not None:
            keys = layout.chunk_coords()
            if len(keys) == len(chunk_crcs):
                self._chunk_crcs = dict(zip(keys, chunk_crcs, strict=True))

    def recorded_crc(self, coords: tuple[int, ...]) -> int | None:
        """The crc32c recorded for chunk file ``coords`` when it was written, if any."""
        return None if self._chunk_crcs is None else self._chunk_crcs.get(coords)

    def chunk_jobs(self, sel: Region) -> list[tuple[tuple[int, ...], Region]]:
        """The chunks ``sel`` touches, each with the part of ``sel`` inside it (array coordinates)."""
        if sel.empty:
            return []
        ranges = [range(a // c, (b - 1) // c + 1) for (a, b), c in zip(sel.bounds, self.chunks, strict=True)]
        jobs = []
        for coords in itertools.product(*ranges):
            box = Region(tuple((k * c, min((k + 1) * c, n)) for k, c, n in zip(coords, self.chunks, self.shape, strict=True)))
            common = box.intersect(sel) if sel.ndim else sel
            if common is not None:
                jobs.append((coords, common))
        return jobs

    def runs(self, sel: Region) -> list[ChunkRun]:
        """``sel``'s C-order payload as byte runs of chunk files, in payload order.

        Wherever the selection takes exactly one whole chunk (inside the array)
        in every dimension after some dimension ``d``, a run spans all of
        those dimensions: for the store's whole-row chunks any band of rows is
        one run per chunk it touches, and a whole chunk is one run. Otherwise
        the runs are the selection's row segments (short: the caller decides
        from their number whether runs are worth it).
        """
        if sel.empty:
            return []
        if not self.shape:
            return [ChunkRun(self, (), 0, self.itemsize)]
        d = self._run_dim(sel)
        fixed = tuple(a // c for (a, _b), c in zip(sel.bounds[d + 1 :], self.chunks[d + 1 :], strict=True))
        stride = self._strides[d]
        a_d, b_d = sel.bounds[d]
        c_d = self.chunks[d]
        along = [(k, max(a_d, k * c_d), min(b_d, (k + 1) * c_d)) for k in range(a_d // c_d, (b_d - 1) // c_d + 1)]
        out: list[ChunkRun] = []
        for idx in itertools.product(*(range(a, b) for a, b in sel.bounds[:d])):
            lead = tuple(i // c for i, c in zip(idx, self.chunks, strict=False))
            base = sum((i - k * c) * s for i, k, c, s in zip(idx, lead, self.chunks, self._strides, strict=False))
            for k, lo, hi in along:
                coords = (*lead, k, *fixed)
                offset = base + (lo - k * c_d) * stride
                nbytes = (hi - lo) * stride
                last = out[-1] if out else None
                if last is not None and last.coords == coords and last.offset + last.nbytes == offset:
                    out[-1] = ChunkRun(self, coords, last.offset, last.nbytes + nbytes)  # adjacent in the file too
                else:
                    out.append(ChunkRun(self, coords, offset, nbytes))
        return out

    def _run_dim(self, sel: Region) -> int:
        """The first dimension of a run: every later one is exactly one whole chunk of ``sel``, inside the array."""
        d = len(self.shape) - 1
        while d > 0:
            a, b = sel.bounds[d]
            c = self.chunks[d]
            if not (a % c == 0 and b - a == c and b <= self.shape[d]):
                break
            d -= 1
        return d

    def run_count(self, sel: Region) -> int:
        """How many runs :meth:`runs` returns for ``sel`` at most (adjacent ones merge), without listing them."""
        if sel.empty or not self.shape:
            return 0 if sel.empty else 1
        d = self._run_dim(sel)
        a, b = sel.bounds[d]
        return math.prod(sel.shape[:d]) * ((b - 1) // self.chunks[d] - a // self.chunks[d] + 1)

    def open_chunk(self, coords: tuple[int, ...]) -> tuple[int, Path]:
        """An open descriptor of a chunk file whose size has been checked (the caller closes it)."""
        name = self.path / self._encode(coords)
        try:
            fd = os.open(name, os.O_RDONLY)
        except FileNotFoundError:
            if not (self.path / "zarr.json").exists():
                raise NotFound(f"shard {self.path} was deleted (its version was deleted or the shard replaced)") from None
            raise StateLost(f"chunk file {name} is missing: the shard is damaged") from None
        try:
            size = os.fstat(fd).st_size
            if size != self.chunk_bytes:
                raise StateLost(f"chunk file {name} has {size} bytes, expected {self.chunk_bytes}: the shard is damaged")
        except BaseException:
            os.close(fd)
            raise
        return fd, name

    def map_chunk(self, coords: tuple[int, ...]) -> mmap.mmap:
        """A read-only shared map of a whole chunk file: its page-cache pages, nothing copied."""
        fd, _name = self.open_chunk(coords)
        try:
            return _map_file(fd, self.chunk_bytes)
        finally:
            os.close(fd)  # the map keeps its own reference to the file

    def read_chunk(self, coords: tuple[int, ...], part: Region, sel: Region, dst: np.ndarray) -> None:
        """Copy ``part`` (inside chunk ``coords``) into ``dst`` (the destination of all of ``sel``)."""
        fd, name = self.open_chunk(coords)
        try:
            origin = [k * c for k, c in zip(coords, self.chunks, strict=True)]
            local = [(a - o, b - o) for (a, b), o in zip(part.bounds, origin, strict=True)]
            view = dst[part.relative_to(sel).slices()] if sel.ndim else dst
            if self._use_mmap and (
                part.volume * self.itemsize >= min(_MAP_MIN_BYTES, self.chunk_bytes // 2) or self._segments(local) > _PREADV_MAX_SEGMENTS
            ):
                self._copy_mapped(fd, local, view)
            else:
                self._copy(fd, local, view, name)
        finally:
            os.close(fd)

    def _segments(self, local: Sequence[tuple[int, int]]) -> int:
        """How many contiguous byte ranges of the chunk file a part (in chunk coordinates) is."""
        if len(local) < 2:
            return 1
        rows_adjacent = local[-1] == (0, self.chunks[-1])
        return math.prod(b - a for a, b in local[: -2 if rows_adjacent else -1])

    def _copy_mapped(self, fd: int, local: Sequence[tuple[int, int]], view: np.ndarray) -> None:
        """Most of a chunk: map it pre-faulted (one syscall) and copy the part with numpy (user-space memcpy)."""
        m = _map_file(fd, self.chunk_bytes)
        try:
            raw = _UINT[self.itemsize]
            src = np.ndarray(self.chunks, dtype=raw, buffer=m)
            np.copyto(view.view(raw), src[tuple(slice(a, b) for a, b in local)])
            del src
        finally:
            m.close()

    def _copy(self, fd: int, local: Sequence[tuple[int, int]], view: np.ndarray, name: Path) -> None:
        n = len(local)
        if n == 0:
            self._preadv(fd, [view], 0, self.itemsize, name)
            return
        if n == 1:
            a, b = local[0]
            self._preadv(fd, [view], a * self.itemsize, (b - a) * self.itemsize, name)
            return
        # rows = the last dimension's runs; loop over all but the last two dimensions
        (r0, r1), (c0, c1) = local[-2], local[-1]
        row_bytes = (c1 - c0) * self.itemsize
        full_rows = c0 == 0 and c1 == self.chunks[-1]
        lead = [range(a, b) for a, b in local[:-2]]
        for idx in itertools.product(*lead):
            plane = view[tuple(i - a for i, (a, _b) in zip(idx, local[:-2], strict=True))] if idx else view
            base = sum(i * s for i, s in zip(idx, self._strides, strict=False))
            if full_rows:  # the rows are adjacent in the file: one preadv for many rows
                rows = list(plane)
                for k in range(0, len(rows), _IOV_MAX):
                    batch = rows[k : k + _IOV_MAX]
                    offset = base + (r0 + k) * self._strides[-2]
                    self._preadv(fd, batch, offset, row_bytes * len(batch), name)
            else:
                for r, row in zip(range(r0, r1), plane, strict=True):
                    self._preadv(fd, [row], base + r * self._strides[-2] + c0 * self.itemsize, row_bytes, name)

    @staticmethod
    def _preadv(fd: int, buffers: list[np.ndarray], offset: int, nbytes: int, name: Path) -> None:
        got = os.preadv(fd, buffers, offset)
        if got != nbytes:  # regular files return everything unless the file is short
            raise StateLost(f"chunk file {name}: read {got} of {nbytes} bytes at offset {offset}: the shard is damaged")

    def verify_chunks(self, crcs: Sequence[int]) -> str | None:
        """Check every chunk file against its recorded crc32c (chunk-grid order); the first problem, or None.

        Each file is read whole with one ``readv`` into a reused buffer and
        checksummed: no gather into C order, and the read goes through the
        page cache on purpose. A shard is verified before it is linked into a
        new version that the restarting workers read next; they then find it
        in memory. Measured on the 2-core VM for a survivor's 0.56 GB, cold:
        ``read`` ~1 GB/s (and cached afterwards), ``O_DIRECT`` ~1.2 GB/s (but
        the restore reads it from disk again), a crc32c pass over a memory map
        ~0.23 GB/s (page faults).
        """
        keys = self.layout.chunk_coords()
        if len(keys) != len(crcs):
            return f"{len(crcs)} chunk checksums recorded for {len(keys)} chunks"
        buf = memoryview(_bounce_buffer(max(self.chunk_bytes + 1, 1)))[: self.chunk_bytes + 1]
        for coords, want in zip(keys, crcs, strict=True):
            name = self.path / self._encode(coords)
            try:
                fd = os.open(name, os.O_RDONLY)
            except FileNotFoundError:
                return f"chunk file {name.name} is missing"
            try:
                got = 0
                while got < len(buf):  # one byte more than a chunk: a long file shows up too
                    n = os.readv(fd, [buf[got:]])
                    if n == 0:
                        break
                    got += n
            finally:
                os.close(fd)
            if got != self.chunk_bytes:
                return f"chunk file {name.name} has {got if got <= self.chunk_bytes else 'more'} bytes, expected {self.chunk_bytes}"
            crc = crc32c.crc32c(buf[: self.chunk_bytes])
            if crc != want:
                return f"chunk file {name.name}: crc32c {crc:08x}, recorded {want:08x}"
        return None

    def read(self, sel: Region, dst: np.ndarray) -> None:
        """Fill ``dst`` (shape ``sel.shape``, any strides with contiguous rows) with ``sel`` of the array, chunk by
        chunk in this thread (the copy is memory-bound: on a busy 2-core node more threads were no faster)."""
        for coords, part in self.chunk_jobs(sel):
            self.read_chunk(coords, part, sel, dst)


def split_runs(runs: Sequence[ChunkRun], max_bytes: int) -> Iterator[ChunkRun]:
    """The runs, each cut into runs of at most ``max_bytes`` (bounds what one batch maps)."""
    for run in runs:
        if run.nbytes <= max_bytes:
            yield run
            continue
        for start in range(0, run.nbytes, max_bytes):
            yield ChunkRun(run.reader, run.coords, run.offset + start, min(max_bytes, run.nbytes - start))


def map_runs(runs: Sequence[ChunkRun], *, fault_in: bool = True) -> list[memoryview]:
    """Read-only views of the runs' bytes where they lie in the page cache, in order; nothing is copied.

    Each chunk file is mapped once (see :func:`_map_file`). A view keeps its
    map alive: a map is unmapped when its last view is released (for a
    response body: when the transport has sent it), so the memory this holds
    is bounded by what the caller keeps. ``fault_in`` maps every page now,
    reading cold ones from disk (:func:`_populate`, :func:`_read_cold`);
    leave it off when the caller's next step reads every byte anyway in a
    call that releases the GIL (a crc32c pass).
    """
    maps: dict[tuple[int, tuple[int, ...]], mmap.mmap] = {}
    views: dict[tuple[int, tuple[int, ...]], memoryview] = {}
    out = []
    cold: list[memoryview] = []
    for run in runs:
        key = (id(run.reader), run.coords)
        if key not in maps:
            maps[key] = run.reader.map_chunk(run.coords)
            views[key] = memoryview(maps[key])
        view = views[key][run.offset : run.offset + run.nbytes]
        if fault_in:
            if _first_page_cached(view):
                _populate(maps[key], run.offset, view.nbytes)
            else:
                cold.append(view)
        out.append(view)
    _read_cold(cold)
    return out


def _first_page_cached(view: memoryview) -> bool:
    """Whether the first page of a view of a file map is in the page cache (``mincore``; True where unknown)."""
    if _mincore is None or not view.nbytes:
        return True
    addr = int(np.frombuffer(view, np.uint8, count=1).ctypes.data)
    vec = (ctypes.c_ubyte * 1)()
    if _mincore(ctypes.c_void_p(addr - addr % mmap.PAGESIZE), ctypes.c_size_t(mmap.PAGESIZE), vec) != 0:
        return True
    return bool(vec[0] & 1)


def _populate(m: mmap.mmap, offset: int, nbytes: int) -> None:
    """Map the (cached) pages of bytes ``[offset, offset + nbytes)`` of ``m`` now, in one call.

    So that whoever maps runs pays the page faults, not whoever touches the
    pages first: for a response body that would be the event loop, inside
    its socket write. ``MADV_POPULATE_READ`` (Linux 5.14); on older kernels
    the pages are mapped when first touched.
    """
    start = offset - offset % mmap.PAGESIZE
    with contextlib.suppress(OSError):
        m.madvise(_MADV_POPULATE_READ, start, offset + nbytes - start)


def _read_cold(views: list[memoryview]) -> None:
    """Read runs that are not in the page cache from disk now, several at a time.

    Each is touched by a crc32c pass (result unused), in up to
    ``_COLD_READERS`` threads: crc32c releases the GIL, so the event loop
    keeps running while the disk reads (``madvise`` would hold the GIL), and
    several chunk files are read at once. Touching goes through the page
    fault path, so a huge-page map reads a cold chunk as huge folios (see
    :func:`_map_file`). Not ``MADV_WILLNEED``: it read cold chunks faster, but
    into 4 KiB folios, and every later read of them then ran at about half
    speed.
    """
    if len(views) <= 1:
        for view in views:
            crc32c.crc32c(view)
        return
    groups = [views[k :: _COLD_READERS] for k in range(min(_COLD_READERS, len(views)))]
    threads = [threading.Thread(target=crc_of_views, args=(group,), name="tenplex-store-cold-read") for group in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def chunks_of(runs: Sequence[ChunkRun]) -> int:
    """How many distinct chunk files the runs lie in (each is one map, and one descriptor, while mapped)."""
    return len({(id(run.reader), run.coords) for run in runs})


def run_batches(runs: Sequence[ChunkRun], batch_bytes: int, max_files: int = MAX_MAPS) -> Iterator[list[ChunkRun]]:
    """The runs in consecutive batches of at most ``batch_bytes`` in at most ``max_files`` chunk files.

    Both bounds hold for any region: the bytes mapped (or sent) at a time, and
    the chunk files open at once (Python's ``mmap`` keeps a descriptor per map).
    """
    batch: list[ChunkRun] = []
    files: set[tuple[int, tuple[int, ...]]] = set()
    size = 0
    for run in split_runs(runs, batch_bytes):
        key = (id(run.reader), run.coords)
        if batch and (size + run.nbytes > batch_bytes or (key not in files and len(files) >= max_files)):
            yield batch
            batch, size = [], 0
            files.clear()
        batch.append(run)
        files.add(key)
        size += run.nbytes
    if batch:
        yield batch


def mapped_batches(
    runs: Sequence[ChunkRun], batch_bytes: int, max_maps: int = MAX_MAPS, *, fault_in: bool = True
) -> Iterator[list[memoryview]]:
    """:func:`map_runs` over the batches of :func:`run_batches`."""
    for batch in run_batches(runs, batch_bytes, max_maps):
        yield map_runs(batch, fault_in=fault_in)


def open_runs(runs: Sequence[ChunkRun], fds: dict[tuple[int, tuple[int, ...]], int]) -> list[tuple[int, int, int]]:
    """``(fd, offset, nbytes)`` of each run, each chunk file opened once (sizes checked) into ``fds``.

    The caller closes what ``fds`` holds, also when this raises (a missing or
    damaged chunk file) part way.
    """
    out = []
    for run in runs:
        key = (id(run.reader), run.coords)
        fd = fds.get(key)
        if fd is None:
            fd = fds[key] = run.reader.open_chunk(run.coords)[0]
        out.append((fd, run.offset, run.nbytes))
    return out


def crc_of_views(views: Sequence[memoryview], crc: int = 0) -> int:
    """crc32c of the views' bytes one after the other, continuing from ``crc``."""
    for view in views:
        crc = crc32c.crc32c(view, crc)
    return crc


def checksum_runs(runs: Sequence[ChunkRun], batch_bytes: int, crc: int = 0) -> int:
    """crc32c of the runs' bytes read in place (no copy), at most ``batch_bytes`` mapped at a time."""
    for views in mapped_batches(runs, batch_bytes, fault_in=False):  # the crc32c pass itself reads them, off the GIL
        crc = crc_of_views(views, crc)
        del views  # unmap this batch before mapping the next
    return crc


class RawChunkWriter:
    """Writes pieces that cover whole chunks of an eligible, freshly created array.

    ``direct`` writes each chunk file with ``O_DIRECT`` instead of through the
    page cache: straight from the caller's buffer when the chunk is a whole
    number of pages lying contiguous and page-aligned in it (a band of whole
    rows of a buffer from :func:`~tenplex.core.buffers.aligned_empty`), otherwise from a page-aligned
    bounce buffer (one copy, reused per thread). Chunk files that are not a
    whole number of pages (small tensors) are written through the page cache.
    Why: a buffered write of new file pages costs the page cache allocation
    and, under the dirty-page limits, throttling; measured on the 2-core VM, 512 MiB of new chunk files took 1.16 s buffered (+0.25 s for
    the commit's ``syncfs``) and 0.31 s direct (commit flush ~0). It also
    keeps snapshots from pushing a training job's own data out of memory.
    A file system without ``O_DIRECT`` (tmpfs) gets buffered writes.
    """

    def __init__(self, path: Path, layout: ChunkLayout, *, direct: bool = False) -> None:
        self.reader = RawChunkReader(path, layout)
        self.path = path
        self.layout = layout
        self.direct = direct and bool(_O_DIRECT)
        self._nested = layout.separator == "/" and len(layout.chunks) > 0  # chunk files in subdirectories
        self.chunk_crcs: dict[tuple[int, ...], int] = {}
        """crc32c of each chunk file written (its full bytes, padding included), by chunk coordinates."""
        self.received: ReceivedCrcs | None = None
        """The crc32c prefixes of the caller's buffer from the pass that received it (set by the store): the
        checksums of whole chunks lying in it come from there instead of a pass over their bytes."""

    def _crc(self, view: memoryview, crc: int = 0) -> int:
        """crc32c of ``view``'s bytes (continuing from ``crc``), from :attr:`received` where it covers them."""
        known = self.received.crc_of(view) if self.received is not None else None
        if known is None:
            return crc32c.crc32c(view, crc)
        return crc32c_combine(crc, known, view.nbytes) if crc else known

    def chunk_checksums(self) -> list[int] | None:
        """Every chunk file's crc32c in chunk-grid order, when this writer wrote them all (else None)."""
        keys = self.layout.chunk_coords()
        if any(k not in self.chunk_crcs for k in keys):
            return None
        return [self.chunk_crcs[k] for k in keys]

    def covers_whole_chunks(self, piece: Region) -> bool:
        r = self.reader
        return all(
            a % c == 0 and (b % c == 0 or b == n) for (a, b), c, n in zip(piece.bounds, r.chunks, r.shape, strict=True)
        )

    def write(self, piece: Region, data: np.ndarray) -> int | None:
        """Write ``data`` (C-contiguous, shape ``piece.shape``); ``piece`` must cover whole chunks.

        Returns the crc32c of ``data``'s bytes when the chunk files' crc32c give it without another pass
        (:meth:`_payload_crc`), else None.
        """
        if piece.empty:
            return None
        self._write(piece, data)
        return self._payload_crc(piece, data)

    def _payload_crc(self, piece: Region, data: np.ndarray) -> int | None:
        """crc32c of ``data`` (just written) from its chunk files' crc32c, combined (no pass over the bytes).

        Possible where the chunk files are consecutive runs of the payload: every dimension after the last
        one the chunks cut is whole (the store's whole-row chunks). An edge chunk's file is padded, so its
        data part is checksummed itself (one chunk at most per band of chunks).
        """
        r = self.reader
        cut = [d for d, (c, n) in enumerate(zip(r.chunks, r.shape, strict=True)) if c < n]
        if cut and any(c != n for c, n in zip(r.chunks[cut[-1] + 1 :], r.shape[cut[-1] + 1 :], strict=True)):
            return None
        crc = 0
        for coords, part in r.chunk_jobs(piece) if r.shape else [((), piece)]:
            if part.shape == r.chunks:
                known = self.chunk_crcs.get(coords)
                if known is None:
                    return None
                crc = crc32c_combine(crc, known, r.chunk_bytes)
            else:
                block = data[part.relative_to(piece).slices()]
                if not block.flags.c_contiguous:
                    return None
                crc = self._crc(byte_view(block), crc) if block.size else crc
        return crc

    def _write(self, piece: Region, data: np.ndarray) -> None:
        r = self.reader
        # Chunk files that are not whole pages (small tensors: biases, norms) go through the page cache: an
        # O_DIRECT write would need padding and a truncation afterwards (the truncations were ~8% of the
        # writer threads' time in a profile of the reshard benchmark), and the commit's syncfs flushes them.
        if self.direct and r.chunk_bytes % _DIRECT_ALIGN == 0 and self._write_direct(piece, data):
            return
        if r.shape == ():
            self._write_file((), [data])
            return
        zero = bytes(r.chunks[-1] * r.itemsize)
        for coords, part in r.chunk_jobs(piece):
            block = data[part.relative_to(piece).slices()]
            if block.shape == r.chunks and block.flags.c_contiguous:
                # a whole chunk lying contiguous in the piece (a band of the store's whole-row chunks): one
                # buffer, not a view per row (a memory-tier transform spent more CPU making row views than
                # writing: benchmarks/datapath_cpu.py)
                self._write_file(coords, [byte_view(block)])
                continue
            buffers: list[Any] = []
            pad_cols = (r.chunks[-1] - block.shape[-1]) * r.itemsize
            pad = memoryview(zero)[:pad_cols]
            if block.ndim <= 2:  # the common case, without a Python-level loop per row
                rows = list(block) if block.ndim == 2 else [block]
                if pad_cols:
                    buffers = [x for row in rows for x in (row, pad)]
                else:
                    buffers = rows
                missing_rows = (r.chunks[0] - block.shape[0]) if block.ndim == 2 else 0
                buffers.extend([zero] * missing_rows)
            else:
                for idx in itertools.product(*(range(c) for c in r.chunks[:-1])):
                    if all(i < s for i, s in zip(idx, block.shape[:-1], strict=True)):
                        buffers.append(block[idx])
                        if pad_cols:
                            buffers.append(pad)
                    else:
                        buffers.append(zero)
            self._write_file(coords, buffers)

    def _write_direct(self, piece: Region, data: np.ndarray) -> bool:
        """Write the chunks of ``piece`` with ``O_DIRECT``; False (nothing written) where the file system refuses it."""
        r = self.reader
        raw = _UINT.get(r.itemsize)
        if raw is None:
            return False
        size = r.chunk_bytes  # whole pages (see write)
        bounce = _bounce_buffer(size)
        chunk = np.ndarray(r.chunks, dtype=raw, buffer=bounce)
        src = data.view(raw)
        for coords, part in r.chunk_jobs(piece) if r.shape else [((), piece)]:
            block = src[part.relative_to(piece).slices()] if r.shape else src
            if block.shape == r.chunks and block.flags.c_contiguous and block.ctypes.data % _DIRECT_ALIGN == 0:
                payload = memoryview(block).cast("B")  # e.g. a band of whole rows of a page-aligned buffer: no copy
            else:
                if block.shape != r.chunks:
                    chunk[...] = 0  # edge chunk: the format pads it to the full chunk shape
                    chunk[tuple(slice(0, n) for n in block.shape)] = block
                else:
                    np.copyto(chunk, block)
                payload = memoryview(bounce)[:size]
            self.chunk_crcs[coords] = self._crc(payload)
            name = self.path / self.reader._encode(coords)
            if self._nested:
                name.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
                try:
                    done = 0
                    while done < size:
                        done += os.write(fd, payload[done:])
                finally:
                    os.close(fd)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # This file system refuses O_DIRECT (tmpfs) or its alignment: buffered from now on; the
                # caller writes the whole piece again, chunk files already written included.
                log.info("%s: O_DIRECT refused (%s); writing through the page cache", self.path, exc)
                self.direct = False
                return False
        return True

    def _write_file(self, coords: tuple[int, ...], buffers: list[object]) -> None:
        name = self.path / self.reader._encode(coords)
        if self._nested:
            name.parent.mkdir(parents=True, exist_ok=True)
        crc = 0
        for b in buffers:
            crc = self._crc(memoryview(b).cast("B"), crc)  # type: ignore[arg-type]
        self.chunk_crcs[coords] = crc
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            written = 0
            for k in range(0, len(buffers), _IOV_MAX):
                batch = buffers[k : k + _IOV_MAX]
                expected = sum(memoryview(b).nbytes for b in batch)  # type: ignore[arg-type]
                got = os.writev(fd, batch)  # type: ignore[arg-type]
                while got < expected:  # short writes are legal; finish the batch
                    flat = b"".join(bytes(memoryview(b).cast("B")) for b in batch)  # type: ignore[arg-type]
                    got += os.write(fd, flat[got:])
                written += expected
            if written != self.reader.chunk_bytes:
                raise StateLost(f"chunk file {name}: wrote {written} bytes, a chunk has {self.reader.chunk_bytes}")
        finally:
            os.close(fd)

