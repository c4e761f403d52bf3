"""The executor: runs one target host's part of a plan against the stores.

Every store is a :class:`~tenplex.store.base.TensorStore`: the target is
normally the node's own :class:`~tenplex.store.local.LocalStore` (the daemon
runs its host's part, :mod:`tenplex.node.transforms`: local pieces and the
new shards never cross a socket), the sources are the other daemons'
clients; any store works in either role.

For each destination shard one buffer of exactly the shard's size is filled
from its pieces: local pieces are read from the host's own store (old
version), remote ones from their planned source, padding is zero-filled.
A piece that is contiguous in the destination (whole trailing rows) is read
straight into the buffer; any other piece lands in a piece-sized temporary and
is copied in: never whole-tensor staging. Contiguous remote pieces of one
source are pulled in batch reads (one request for up to 64 MiB of them): a
transform's hundreds of small shards would otherwise cost a request each.
The client verifies each payload's checksum, and each piece goes on as soon
as its part of the batch is in (:attr:`RegionRead.done`). A finished shard is uploaded
into the target store's *new* version and its buffer goes back to a pool for
the next shards; buffers in flight are bounded by what the fetchers and
writers can use at once (and by ``max_buffer_bytes``), so a transform
touches little fresh memory.
When every shard is stored the new version is committed. A destination
shard that is exactly a shard the target host already holds (a layout change
that keeps it in place) is not copied: the target store links it into the new
version (:meth:`~tenplex.store.base.TensorStore.link_shard`: its chunk files
checked against their recorded checksums and hard-linked, on the node).

Failures: a source that stops answering (:class:`StoreUnavailable` after the
client's retries) is marked dead for the rest of the transform, and its pieces
(the failed one and those not yet fetched) move to the next alive alternative
holder the planner recorded, then to the persistent checkpoint when the plan
has one. A checksum mismatch is retried once at the same source before moving
on. When some piece has no source left, or the target store fails, nothing is
committed: the partial new version is deleted, the old version is untouched,
and :class:`TransformFailed` says what failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import tenacity
from prometheus_client import CollectorRegistry, Counter, Histogram

from tenplex.core.buffers import PAGE_BYTES, aligned_empty
from tenplex.errors import (
    ChecksumMismatch,
    InvalidInput,
    NotFound,
    StoreUnavailable,
    TenplexError,
    TransformCancelled,
    TransformFailed,
)
from tenplex.ptc.dtypes import storage_dtype
from tenplex.store.base import RegionRead, TensorStore
from tenplex.store.buffers import ReceivedCrcs
from tenplex.store.wire import MAX_BATCH_REGIONS
from tenplex.transformer.plan import CHECKPOINT, DestShard, HostPlan, Plan, Transfer

log = logging.getLogger(__name__)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)

DEFAULT_MAX_BUFFER_BYTES = 2 << 30
"""The most destination-buffer memory a host's transform holds at once (a larger shard still runs, alone)."""
_MIN_WORKING_BYTES = 64 << 20
_WRITERS = 4  # threads storing finished shards: several overlap the per-shard file creation and fsync waits
DEFAULT_BATCH_BYTES = 64 << 20
"""Remote pieces of one source go in batch reads of up to this many bytes (see :func:`_fetch_batch`): each
request costs the source daemon about a millisecond of CPU (benchmarks/datapath_cpu.py: 16 MiB batches took
0.20 core-s/GiB on the sending daemon, 64 MiB ones 0.13), and each piece goes to the writers as soon as its
bytes are in, not when its whole batch is (:attr:`~tenplex.store.base.RegionRead.done`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TransformReport:
    host: str
    bytes_local: int
    bytes_remote: int
    bytes_zero: int
    seconds: float
    requests: int
    replanned_pieces: int
    shards: int = 0
    bytes_checkpoint: int = 0
    """Part of ``bytes_remote`` read from the persistent checkpoint."""
    bytes_linked: int = 0
    """Part of ``bytes_local``: whole shards kept on this host, linked into the new version (read only
    to verify their checksums, never copied or written)."""
    fresh_buffer_bytes: int = 0
    """Destination buffers this transform took from fresh memory (each page faulted in and zeroed by the
    kernel during the transform), not from the daemon's pool or its resident bytes."""

    @property
    def bytes_total(self) -> int:
        return self.bytes_local + self.bytes_remote + self.bytes_zero

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TransformReport:
        """The report a daemon's transform record holds (fields a record of an older daemon lacks: their defaults)."""
        return cls(**{f.name: obj[f.name] for f in dataclasses.fields(cls) if f.name in obj})


class TransformMetrics:
    """Prometheus metrics of transforms, registered in the caller's registry (none is global)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.bytes = Counter(
            "tenplex_transform_bytes",
            "Bytes placed into new shards, by how they were obtained",
            ["kind"],  # local | remote | checkpoint | zero
            registry=self.registry,
        )
        self.requests = Counter("tenplex_transform_requests", "Piece reads issued", registry=self.registry)
        self.replanned = Counter(
            "tenplex_transform_replanned_pieces",
            "Pieces moved to another holder after their source failed",
            registry=self.registry,
        )
        self.transforms = Counter(
            "tenplex_transforms", "Host transforms finished, by outcome", ["outcome"], registry=self.registry
        )
        self.seconds = Histogram(
            "tenplex_transform_seconds",
            "Duration of host transforms",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
            registry=self.registry,
        )


class _State:
    """What all worker threads of one transform share: dead sources, counters, progress."""

    def __init__(
        self, total: int, progress: Callable[[int, int], None] | None, metrics: TransformMetrics | None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.lock = threading.Lock()
        self.cancel = cancel
        self.dead: set[str] = set()
        self.total = total
        self.done = 0
        self.progress = progress
        self.metrics = metrics
        self.bytes = {"local": 0, "remote": 0, "checkpoint": 0, "zero": 0}
        self.linked = 0
        self.requests = 0
        self.replanned = 0
        self.fresh = 0
        self.failed = threading.Event()

    def cancelled(self) -> bool:
        """Whether the caller asked to stop; the first time it is seen, every thread is told to stop too."""
        if self.cancel is None or not self.cancel.is_set():
            return False
        self.failed.set()
        return True

    def add(self, kind: str, nbytes: int, *, request: bool) -> None:
        with self.lock:
            self.bytes[kind] += nbytes
            self.done += nbytes
            if request:
                self.requests += 1
            done = self.done
        if self.metrics is not None:
            self.metrics.bytes.labels(kind).inc(nbytes)
            if request:
                self.metrics.requests.inc()
        if self.progress is not None:
            self.progress(done, self.total)

    def add_fresh(self, nbytes: int) -> None:
        with self.lock:
            self.fresh += nbytes

    def mark_dead(self, source: str, exc: BaseException) -> None:
        with self.lock:
            new = source not in self.dead
            self.dead.add(source)
        if new:
            log.warning("source %s failed (%s); re-planning its remaining pieces onto other holders", source, exc)

    def replan(self) -> None:
        with self.lock:
            self.replanned += 1
        if self.metrics is not None:
            self.metrics.replanned.inc()


class BufferPool:
    """Destination buffers handed back after their shard is stored, for the next shards of any shape.

    A buffer is page-aligned memory of a size class (whole 2 MiB huge pages
    above 2 MiB, powers of two below) and serves any shard that fits its
    class, viewed in the shard's shape and dtype. Why: fresh memory costs a
    page fault and the zeroing of every page (on the 2-core VM, zeroing
    fresh pages ran at ~1.6 GB/s and was a quarter of a transform's CPU),
    while the shards of a transform are a few sizes that repeat layer after
    layer. With the in-flight budget bounding what is allocated at once, a
    transform touches about that budget of fresh memory, not its whole state.

    A daemon keeps one pool for all its transforms (``keep_s`` > 0): the
    transforms of a reconfiguration (and the next reconfigurations of a burst:
    a scale-up, then a failure) reuse the memory the first one faulted in,
    where a transform's own pool would pay the zeroing of its whole working set
    (192 MiB for a 1.3 GiB GPT state: 0.3 core-s/GiB of the receiving daemon in
    benchmarks/datapath_cpu.py). The free buffers are let go ``keep_s`` seconds
    after the last transform holding the pool (:meth:`hold`) ended, so an idle
    daemon holds none of them.

    ``resident`` bytes are different: one anonymous mapping, faulted in once by
    :meth:`prefault` (the daemon runs it in the background at start-up) and
    held for the pool's life. Why: a daemon's first transform is usually the
    one that matters (a reconfiguration reaches every node's daemon once), and
    on a VM that reports free pages to its host the kernel zeroes each fresh
    page on first touch inside that transform (36% of the daemons' CPU in the
    8-host tp-pp case of benchmarks/cluster_reshard.py). Buffers are carved
    from it (page-aligned: every size class is a multiple of 4 KiB) before any
    fresh memory is taken, go back to the free lists like any other, and are
    never unmapped or advised away, so a reused one is not faulted again. When
    the last transform ends (every executor thread has been joined by then)
    the carving starts over, so that the next transform cuts the mapping to
    its own shard sizes. The resident bytes plus the free fresh buffers kept
    stay within ``limit``.
    """

    def __init__(self, limit: int, *, keep_s: float = 0.0, resident: int = 0) -> None:
        if resident < 0:
            raise InvalidInput(f"resident buffer bytes must be >= 0, got {resident}")
        self._free: dict[int, list[np.ndarray]] = {}
        self._bytes = 0  # free fresh (not resident) buffers, held within limit - resident
        self._resident = min(resident, limit) // PAGE_BYTES * PAGE_BYTES
        self._limit = limit - self._resident
        self._lock = threading.Lock()
        self._keep_s = keep_s
        self._users = 0
        self._generation = 0
        self._arena: mmap.mmap | None = None
        self._arena_at = 0  # its address
        self._carved = 0  # bytes of the resident mapping cut into buffers since the carving started over
        self._lent: dict[int, np.ndarray] = {}  # resident buffers handed out since the carving started over, by id
        self.fresh = 0
        """Bytes of fresh memory allocated (each page of it zeroed by the kernel on first touch)."""
        self.prefaulted = threading.Event()
        """Set once :meth:`prefault` has faulted the resident bytes in (at once when there are none)."""
        if self._resident:
            self._arena = mmap.mmap(-1, self._resident, flags=mmap.MAP_PRIVATE)
            if _MADV_HUGEPAGE is not None:  # as aligned_empty: 512x fewer faults, no later collapse by khugepaged
                with contextlib.suppress(OSError):
                    self._arena.madvise(_MADV_HUGEPAGE)
            self._arena_at = np.frombuffer(self._arena, np.uint8, count=1).ctypes.data
        else:
            self.prefaulted.set()

    @property
    def resident_bytes(self) -> int:
        """Bytes held for the pool's life (faulted in by :meth:`prefault`)."""
        return self._resident

    def prefault(self) -> None:
        """Fault the resident bytes in (and zero them) now, not in the first transform.

        ``madvise(MADV_POPULATE_WRITE)`` through ctypes, which lets go of the GIL
        for the call (the daemon keeps serving meanwhile); on a kernel without it
        (before Linux 5.14) one byte per page is written, 64 MiB at a time.
        """
        if self._arena is None or self.prefaulted.is_set():
            return
        start = time.perf_counter()
        try:
            err = 0
            for off in range(0, self._resident, _PREFAULT_STEP):  # in steps: each call holds the process's
                # mmap lock, which every allocation of the daemon's other threads (uvicorn starting) waits for
                err = _libc_madvise(self._arena_at + off, min(_PREFAULT_STEP, self._resident - off),
                                    _MADV_POPULATE_WRITE)
                if err:
                    break
            if err in (errno.EINVAL, errno.ENOSYS):  # a kernel without it
                touch = np.frombuffer(self._arena, np.uint8)
                for off in range(0, self._resident, 64 << 20):
                    touch[off: off + (64 << 20): PAGE_BYTES] = 0
                del touch
            elif err:  # ENOMEM and the like: left to fault in as used (touching it now could wake the OOM killer)
                log.warning("transform buffers: %d MiB resident could not be faulted in (%s); the first transform "
                            "faults them in", self._resident >> 20, os.strerror(err))
                return
        finally:
            self.prefaulted.set()
        log.info("transform buffers: %d MiB resident, faulted in in %.2f s", self._resident >> 20,
                 time.perf_counter() - start)

    @property
    def free_bytes(self) -> int:
        """Free fresh buffers held (the resident bytes are held regardless, see :attr:`resident_bytes`)."""
        with self._lock:
            return self._bytes

    @contextlib.contextmanager
    def hold(self) -> Iterator[BufferPool]:
        """Use the pool for one transform; the last user out lets the free buffers go (after ``keep_s``)."""
        with self._lock:
            self._users += 1
            self._generation += 1
        try:
            yield self
        finally:
            with self._lock:
                self._users -= 1
                idle, generation = self._users == 0, self._generation
                if idle:
                    self._recarve()
            if idle:
                if self._keep_s <= 0:
                    self._expire(generation)
                else:
                    timer = threading.Timer(self._keep_s, self._expire, args=(generation,))
                    timer.daemon = True
                    timer.start()

    def _recarve(self) -> None:
        """(Under the lock, no transform running.) Forget the resident buffers: the next ones are cut anew."""
        if not self._carved:
            return
        for cls in list(self._free):
            kept = [b for b in self._free[cls] if not self._is_resident(b)]
            if kept:
                self._free[cls] = kept
            else:
                del self._free[cls]
        self._carved = 0
        self._lent.clear()  # a buffer not put back (its transform failed) is garbage: no thread uses it now

    def _is_resident(self, flat: np.ndarray) -> bool:
        return self._arena_at <= flat.ctypes.data < self._arena_at + self._resident

    def _expire(self, generation: int) -> None:
        """Drop the free fresh buffers if no transform used the pool since ``generation`` (their memory is unmapped)."""
        with self._lock:
            if self._users or generation != self._generation:
                return
            for cls in list(self._free):
                kept = [b for b in self._free[cls] if self._is_resident(b)]
                if kept:
                    self._free[cls] = kept
                else:
                    del self._free[cls]
            self._bytes = 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        if nbytes <= 2 << 20:
            return 1 << max(12, (nbytes - 1).bit_length())
        return -(-nbytes // (2 << 20)) * (2 << 20)

    def get(self, shape: tuple[int, ...], dtype: np.dtype, *, fresh: Callable[[int], None] | None = None) -> np.ndarray:
        """A buffer for a shard of ``shape``: a free one, else cut from the resident bytes, else fresh memory
        (``fresh`` is told how many bytes of it)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return np.empty(shape, dtype=dtype)
        size = self.size_class(nbytes)
        flat = None
        with self._lock:
            # best fit: the smallest free buffer that holds the shard, up to 4x its class (a transform's
            # shards are a few sizes; a buffer of another class beats the zeroing of fresh pages, which
            # was a third of a receiving daemon's CPU in benchmarks/datapath_cpu.py)
            for cls in sorted(c for c in self._free if size <= c <= 4 * size):
                free = self._free[cls]
                flat = free.pop()
                if not free:
                    del self._free[cls]
                if not self._is_resident(flat):
                    self._bytes -= flat.nbytes
                break
            if flat is None and self._arena is not None and self._carved + size <= self._resident:
                # its own array over the mapping (base: the mmap, not an array), so put() finds this buffer
                flat = np.frombuffer(self._arena, np.uint8, count=size, offset=self._carved)
                self._carved += size
            if flat is not None and self._is_resident(flat):
                self._lent[id(flat)] = flat  # held here too, so that its id names no other array meanwhile
        if flat is None:
            # page-aligned: a shard's chunk files are then written with O_DIRECT straight from it
            flat = aligned_empty((size,), np.uint8)
            with self._lock:
                self.fresh += size
            if fresh is not None:
                fresh(size)
        return flat[:nbytes].view(dtype).reshape(shape)

    def put(self, buf: np.ndarray) -> None:
        flat = buf.base if isinstance(buf.base, np.ndarray) else None
        while flat is not None and isinstance(flat.base, np.ndarray):  # the whole buffer, not this shard's view
            flat = flat.base
        if flat is None or flat.ndim != 1 or flat.dtype != np.uint8 or flat.nbytes != self.size_class(flat.nbytes):
            return  # not one of ours (a 0-size shard)
        with self._lock:
            if self._is_resident(flat):
                # lent since the carving last started over: else its bytes may have been cut anew already
                if self._lent.get(id(flat)) is flat:
                    del self._lent[id(flat)]
                    self._free.setdefault(flat.nbytes, []).append(flat)
            elif self._bytes + flat.nbytes <= self._limit:
                self._free.setdefault(flat.nbytes, []).append(flat)
                self._bytes += flat.nbytes


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.11's mmap lacks the name
_PREFAULT_STEP = 8 << 20


def _libc_madvise(address: int, length: int, advice: int) -> int:
    """madvise(2) on raw memory (mmap.madvise holds the GIL for the call): 0, else the errno."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return errno.ENOSYS
    if madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), ctypes.c_int(advice)) == 0:
        return 0
    return ctypes.get_errno() or errno.EINVAL


class _Shard:
    """A destination shard being assembled: its buffer and how many pieces are still missing."""

    __slots__ = ("buf", "dest", "index", "missing", "pool", "received")

    def __init__(self, index: int, dest: DestShard, pieces: int, pool: BufferPool,
                 fresh: Callable[[int], None] | None = None) -> None:
        self.index = index
        self.dest = dest
        self.pool = pool
        self.buf = pool.get(dest.region.shape, storage_dtype(dest.dtype), fresh=fresh)
        self.missing = pieces
        self.received: ReceivedCrcs | None = None
        """Set when one batch read fills the whole buffer: its receive pass's crc32c prefixes, which the
        store takes the chunk files' checksums from (one pass over the bytes, not two)."""


def execute_host_plan(
    plan: Plan,
    host: str,
    *,
    target: TensorStore,
    sources: Mapping[str, TensorStore],
    concurrency: int = 8,
    progress: Callable[[int, int], None] | None = None,
    metrics: TransformMetrics | None = None,
    max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    cancel: threading.Event | None = None,
    buffers: BufferPool | None = None,
) -> TransformReport:
    """Fill and commit ``host``'s shards of ``plan.new_version`` in its store (``target``).

    ``sources`` maps source host names (and :data:`CHECKPOINT`) to clients;
    the target host's own pieces are read through ``target``. A source the
    plan names but ``sources`` lacks counts as failed. ``progress`` is called
    with (bytes done, bytes total) from worker threads. Remote pieces of one
    source are pulled in batch reads of up to ``batch_bytes`` (0: each piece
    its own request). Setting ``cancel`` stops the transform at the next piece: nothing is
    committed, the partial version is deleted and :class:`TransformCancelled` is raised. ``buffers``: the
    caller's pool of destination buffers (a daemon's, shared by its transforms); else one of its own.
    """
    if concurrency < 1:
        raise InvalidInput(f"concurrency must be >= 1, got {concurrency}")
    if batch_bytes < 0:
        raise InvalidInput(f"batch_bytes must be >= 0, got {batch_bytes}")
    if max_buffer_bytes < 1:
        raise InvalidInput(f"max_buffer_bytes must be >= 1, got {max_buffer_bytes}")
    hp = plan.host(host)
    start = time.perf_counter()
    state = _State(hp.bytes_total, progress, metrics, cancel)
    clients: dict[str, TensorStore] = dict(sources)
    clients[host] = target
    try:
        _prepare_target(plan, target)  # before anything is written: a committed new version stays untouched
    except TenplexError as exc:
        if metrics is not None:
            metrics.transforms.labels("failed").inc()
        if isinstance(exc, TransformFailed):
            raise
        raise TransformFailed(f"host {host}: cannot prepare {target.url} for {plan.new_version}: {exc.detail}") from exc
    cancelled_detail = (f"transform of host {host} to {plan.new_version} was cancelled; nothing was committed, "
                        f"{plan.old_version} is intact")
    try:
        if buffers is None:
            _run(plan, hp, clients, state, concurrency, max_buffer_bytes, batch_bytes, None)
        else:
            with buffers.hold():
                _run(plan, hp, clients, state, concurrency, max_buffer_bytes, batch_bytes, buffers)
        if state.cancelled():
            raise TransformCancelled(cancelled_detail)
        target.commit(plan.job, plan.new_version)
    except BaseException as exc:
        state.failed.set()
        _discard(plan, target)
        cancelled = isinstance(exc, TransformCancelled) or (cancel is not None and cancel.is_set())
        if metrics is not None:
            metrics.transforms.labels("cancelled" if cancelled else "failed").inc()
        if cancelled and not isinstance(exc, TransformCancelled):
            # Reads cut short by the cancel fail in their own ways: what happened is the cancel.
            raise TransformCancelled(cancelled_detail) from exc
        if isinstance(exc, TransformFailed):
            raise
        if isinstance(exc, TenplexError):
            raise TransformFailed(
                f"transform of host {host} to {plan.new_version} failed ({exc.code}: {exc.detail}); "
                f"nothing was committed, {plan.old_version} is intact"
            ) from exc
        raise
    seconds = time.perf_counter() - start
    if metrics is not None:
        metrics.transforms.labels("ok").inc()
        metrics.seconds.observe(seconds)
    b = state.bytes
    report = TransformReport(
        host=host,
        bytes_local=b["local"],
        bytes_remote=b["remote"] + b["checkpoint"],
        bytes_zero=b["zero"],
        seconds=seconds,
        requests=state.requests,
        replanned_pieces=state.replanned,
        shards=len(hp.shards),
        bytes_checkpoint=b["checkpoint"],
        bytes_linked=state.linked,
        fresh_buffer_bytes=state.fresh,
    )
    log.info(
        "host %s: %s committed in %.2f s (%d local (%d linked), %d remote, %d zero bytes; %d requests, %d re-planned; "
        "%d MiB of fresh buffers)",
        host, plan.new_version, seconds, report.bytes_local, report.bytes_linked, report.bytes_remote,
        report.bytes_zero, report.requests, report.replanned_pieces, report.fresh_buffer_bytes >> 20,
    )
    return report


def _prepare_target(plan: Plan, target: TensorStore) -> None:
    """Drop a leftover uncommitted new version (an earlier, failed attempt); refuse to overwrite a committed one."""
    try:
        versions = target.versions(plan.job)
    except NotFound:
        return
    for v in versions:
        if v.version == plan.new_version:
            if v.committed:
                raise TransformFailed(
                    f"version {plan.new_version} of job {plan.job!r} is already committed at {target.url}; "
                    "a plan must write a new version"
                )
            log.info("deleting the uncommitted leftover of %s at %s before the transform", plan.new_version, target.url)
            target.delete(plan.job, plan.new_version)


def _discard(plan: Plan, target: TensorStore) -> None:
    try:
        target.delete(plan.job, plan.new_version)
    except TenplexError as exc:
        if exc.code != "not_found":
            log.warning("could not delete the partial version %s at %s: %s", plan.new_version, target.url, exc.detail)


def _run(
    plan: Plan,
    hp: HostPlan,
    clients: Mapping[str, TensorStore],
    state: _State,
    concurrency: int,
    max_buffer_bytes: int,
    batch_bytes: int,
    buffers: BufferPool | None,
) -> None:
    by_shard: list[list[Transfer]] = [[] for _ in hp.shards]
    for tr in hp.transfers:
        by_shard[tr.shard].append(tr)
    linked = _link_kept_shards(plan, hp, by_shard, clients[hp.host], state)
    budget = threading.Condition()
    in_flight = [0]  # bytes of buffers allocated and not yet stored

    def stored(nbytes: int) -> None:
        with budget:
            in_flight[0] -= nbytes
            budget.notify_all()

    futures: list[Future[None]] = []
    errors: list[BaseException] = []
    # Buffers in flight: enough for every fetcher and writer to hold the largest shard, not more (up to the
    # caller's bound), so that buffers are recycled from shard to shard instead of all being fresh memory.
    largest = max((d.nbytes for i, d in enumerate(hp.shards) if i not in linked), default=0)
    max_buffer_bytes = min(max_buffer_bytes, max(_MIN_WORKING_BYTES, (concurrency + _WRITERS) * largest))
    if buffers is None:
        buffers = BufferPool(max_buffer_bytes)  # kept on top of the in-flight budget

    def check(f: Future[None]) -> None:
        exc = None if f.cancelled() else f.exception()
        if exc is not None:
            with state.lock:
                errors.append(exc)
            state.failed.set()
            with budget:
                budget.notify_all()

    writes: list[Future[None]] = []
    batches: dict[str, list[tuple[_Shard, Transfer]]] = {}  # per source, pieces not yet submitted
    pending_bytes: dict[str, int] = {}
    held: dict[int, int] = {}  # shards with a piece in a batch not yet submitted: index -> how many such pieces
    with (
        ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"tenplex-transform-{hp.host}") as pool,
        ThreadPoolExecutor(max_workers=_WRITERS, thread_name_prefix=f"tenplex-transform-{hp.host}-write") as writer,
    ):

        def finish(shard: _Shard) -> None:
            """Hand a complete shard to the writers, so that the readers go on fetching meanwhile."""
            f = writer.submit(_store, plan, hp, shard, clients, state, stored)
            f.add_done_callback(check)
            with state.lock:
                writes.append(f)

        def submit(fn: Callable[..., None], *args: Any) -> None:
            futures.append(pool.submit(fn, *args))
            futures[-1].add_done_callback(check)

        def flush(source: str) -> None:
            items = batches.pop(source, [])
            pending_bytes.pop(source, None)
            for shard, _tr in items:
                held[shard.index] -= 1
                if not held[shard.index]:
                    del held[shard.index]
            if items:
                submit(_fetch_batch, plan, hp, source, items, clients, state, finish)

        for idx, dest in enumerate(hp.shards):
            if idx in linked:
                continue
            if state.cancelled():
                break
            nbytes = dest.nbytes
            if in_flight[0] + nbytes > max_buffer_bytes and sum(hp.shards[i].nbytes for i in held) + nbytes > max_buffer_bytes:
                # About to wait for budget that only the shards held back for batches could free: they must be
                # on their way first. Otherwise the wait ends when submitted work is stored, and the batches
                # keep filling up to batch_bytes: a flush per wait cut a transform's batches to a few MiB on
                # average (150 requests instead of 86 for 1.3 GiB; each costs the source daemon about a
                # millisecond of CPU, benchmarks/datapath_cpu.py). (Only this thread adds to in_flight and
                # held, so a shard that fits here still fits under the lock below.)
                for source in list(batches):
                    flush(source)
            with budget:
                # One shard larger than the budget still runs, alone.
                while in_flight[0] and in_flight[0] + nbytes > max_buffer_bytes and not state.failed.is_set():
                    budget.wait(0.5)
                    state.cancelled()
                if state.failed.is_set():
                    break
                in_flight[0] += nbytes
            shard = _Shard(idx, dest, len(by_shard[idx]), buffers, state.add_fresh)
            if not by_shard[idx]:  # an empty shard (0-size tensor): store it as is
                finish(shard)
            for tr in by_shard[idx]:
                source = tr.source
                if (
                    source is None or source == hp.host or tr.nbytes > batch_bytes or source not in clients
                    or not shard.buf[tr.region.relative_to(dest.region).slices()].flags.c_contiguous
                ):
                    submit(_piece, plan, hp, shard, tr, clients, state, finish)
                    continue
                if pending_bytes.get(source, 0) + tr.nbytes > batch_bytes or len(batches.get(source, ())) >= MAX_BATCH_REGIONS:
                    flush(source)
                batches.setdefault(source, []).append((shard, tr))
                pending_bytes[source] = pending_bytes.get(source, 0) + tr.nbytes
                held[idx] = held.get(idx, 0) + 1
        for source in list(batches):
            if state.failed.is_set():
                break
            flush(source)
        _wait_all(futures, state)
        # Every fetch has finished, so no more writes are being added.
        with state.lock:
            pending_writes = list(writes)
        _wait_all(pending_writes, state)
    log.debug("host %s: in-flight budget %d bytes; the buffer pool has faulted in %d bytes of fresh memory so far",
              hp.host, max_buffer_bytes, buffers.fresh)
    if errors:
        # A TransformFailed names the piece; prefer it over secondary errors.
        first = next((e for e in errors if isinstance(e, TransformFailed)), errors[0])
        raise first


def _wait_all(futures: Sequence[Future[None]], state: _State) -> None:
    """Wait for ``futures``; once the transform has failed or is cancelled, those not started are dropped."""
    pending = set(futures)
    while pending:
        if state.failed.is_set() or state.cancelled():
            for f in pending:
                f.cancel()
        _done, pending = wait(pending, timeout=0.2)


def _link_kept_shards(
    plan: Plan, hp: HostPlan, by_shard: Sequence[Sequence[Transfer]], target: TensorStore, state: _State
) -> set[int]:
    """Link the destination shards that are exactly a shard this host already holds; their indices.

    Such a shard (same tensor, same region: a layout change that keeps it on
    this host) needs none of its bytes moved: the target store links it from
    the old version (hard links on the node; a daemon does it on its own disk
    when the target is remote). A shard the old version turns out not to hold
    exactly, or holds damaged, is left to the ordinary copy.
    """
    candidates = [
        idx for idx, trs in enumerate(by_shard)
        if len(trs) == 1 and trs[0].source == hp.host and trs[0].region == hp.shards[idx].region
    ]
    if not candidates:
        return set()

    def one(idx: int) -> bool:
        dest = hp.shards[idx]
        try:
            target.link_shard(plan.job, plan.old_version, dest.tensor, dest.region, plan.new_version)
        except TenplexError as exc:
            if exc.code not in ("not_found", "state_lost", "checksum_mismatch"):
                raise TransformFailed(
                    f"host {hp.host}: linking {dest.tensor} {dest.region} into {plan.new_version} failed "
                    f"({exc.code}: {exc.detail}); nothing was committed, {plan.old_version} is intact"
                ) from exc
            log.log(
                logging.WARNING if exc.code == "checksum_mismatch" else logging.DEBUG,
                "host %s: %s %s is not linkable (%s); copying it", hp.host, dest.tensor, dest.region, exc.detail,
            )
            return False
        with state.lock:
            state.linked += dest.nbytes
        state.add("local", dest.nbytes, request=False)
        return True

    with ThreadPoolExecutor(max_workers=_WRITERS, thread_name_prefix=f"tenplex-transform-{hp.host}-link") as pool:
        done = list(pool.map(one, candidates))
    return {idx for idx, ok in zip(candidates, done, strict=True) if ok}


def _piece(
    plan: Plan,
    hp: HostPlan,
    shard: _Shard,
    tr: Transfer,
    clients: Mapping[str, TensorStore],
    state: _State,
    finish: Callable[[_Shard], None],
) -> None:
    if state.failed.is_set():
        return
    rel = tr.region.relative_to(shard.dest.region)
    view = shard.buf[rel.slices()]
    if tr.source is None:
        view[...] = 0
        state.add("zero", tr.nbytes, request=False)
    else:
        _fetch(plan, hp, tr, view, clients, state)
    _piece_done(shard, state, finish)


def _fetch_batch(
    plan: Plan,
    hp: HostPlan,
    source: str,
    items: Sequence[tuple[_Shard, Transfer]],
    clients: Mapping[str, TensorStore],
    state: _State,
    finish: Callable[[_Shard], None],
) -> None:
    """Pull contiguous pieces of one source with batch reads; any failure sends each piece its own way.

    On a failure (the source dead, a checksum mismatch, a region it lacks)
    every piece of the batch goes through :func:`_piece`, which retries and
    moves to the other holders exactly as for a piece fetched alone.
    """
    if state.failed.is_set():
        return
    client = clients.get(source)
    delivered = [False] * len(items)
    if client is not None and source not in state.dead:
        kind = "checkpoint" if source == CHECKPOINT else "remote"

        def done(i: int) -> None:
            """Piece ``i`` is in and verified: its shard goes to the writers while the batch's next pieces arrive."""
            delivered[i] = True
            state.add(kind, items[i][1].nbytes, request=i == 0)
            _piece_done(items[i][0], state, finish)

        reads = []
        for i, (shard, tr) in enumerate(items):
            # a read of the whole region fills the buffer alone (a shard's transfers are disjoint)
            shard.received = ReceivedCrcs(shard.buf) if tr.region == shard.dest.region else None
            reads.append(RegionRead(tr.tensor, tr.region, shard.buf[tr.region.relative_to(shard.dest.region).slices()],
                                    shard.received, functools.partial(done, i)))
        try:
            client.read_regions(plan.source_job, plan.old_version, reads)
        except StoreUnavailable as exc:
            state.mark_dead(source, exc)
        except TenplexError as exc:
            log.info("batch read of %d pieces from %s failed (%s: %s); fetching them one by one", len(items), source, exc.code, exc.detail)
        else:
            for i in range(len(items)):  # those the store did not report one by one
                if not delivered[i]:
                    done(i)
            return
    for (shard, tr), ok in zip(items, delivered, strict=True):
        if ok:
            continue  # stored or being stored: the store reported it complete
        shard.received = None  # what the failed batch recorded need not be what the retry receives
        _piece(plan, hp, shard, tr, clients, state, finish)


def _piece_done(shard: _Shard, state: _State, finish: Callable[[_Shard], None]) -> None:
    with state.lock:
        shard.missing -= 1
        last = shard.missing == 0
    if last:
        finish(shard)


def _candidates(plan: Plan, tr: Transfer) -> list[str]:
    out = [tr.source, *tr.alternatives] if tr.source is not None else list(tr.alternatives)
    if plan.checkpoint is not None and CHECKPOINT not in out:
        out.append(CHECKPOINT)
    return [s for s in out if s is not None]


_REREAD_ON_MISMATCH = tenacity.Retrying(retry=tenacity.retry_if_exception_type(ChecksumMismatch),
                                        stop=tenacity.stop_after_attempt(2), reraise=True)
"""A piece whose checksum does not match is read once more from the same source (a bit flipped on the way)
before its next holder is tried. (One Retrying for all threads: it keeps each call's state thread-local.)"""


def _fetch(
    plan: Plan, hp: HostPlan, tr: Transfer, view: np.ndarray, clients: Mapping[str, TensorStore], state: _State
) -> None:
    """Read one piece into its place, moving to the next holder when a source fails."""
    direct = view.flags.c_contiguous
    out = view if direct else np.empty(view.shape, dtype=view.dtype)
    errors: list[str] = []
    for i, source in enumerate(_candidates(plan, tr)):
        client = clients.get(source)
        if client is None:
            state.mark_dead(source, KeyError("no client given for it"))
            errors.append(f"{source}: no store URL given")
            continue
        if source in state.dead:
            errors.append(f"{source}: failed earlier")
            continue
        if i:  # not the planned source
            state.replan()
            log.info("piece %s %s of host %s: now from %s", tr.tensor, tr.region, hp.host, source)
        try:
            _REREAD_ON_MISMATCH(client.read_into, plan.source_job, plan.old_version, tr.tensor, tr.region, out)
        except ChecksumMismatch as exc:
            errors.append(f"{source}: {exc.detail} (read twice)")
            continue
        except StoreUnavailable as exc:
            state.mark_dead(source, exc)
            errors.append(f"{source}: {exc.detail}")
            continue
        except TenplexError as exc:  # NotFound and the like: this holder does not have it after all
            errors.append(f"{source}: {exc.code}: {exc.detail}")
            continue
        if not direct:
            view[...] = out
        kind = "local" if source == hp.host else ("checkpoint" if source == CHECKPOINT else "remote")
        state.add(kind, tr.nbytes, request=True)
        return
    raise TransformFailed(
        f"host {hp.host}: no source could deliver {tr.tensor} {tr.region} ({tr.nbytes} bytes) of "
        f"{plan.old_version}: " + "; ".join(errors)
        + f". Nothing was committed; {plan.old_version} is intact"
    )


def _store(
    plan: Plan,
    hp: HostPlan,
    shard: _Shard,
    clients: Mapping[str, TensorStore],
    state: _State,
    stored: Callable[[int], None],
) -> None:
    dest = shard.dest
    try:
        if state.failed.is_set():
            return
        try:
            received = shard.received if shard.received is not None and shard.received.complete else None
            clients[hp.host].write_shard(
                plan.job, plan.new_version, dest.tensor, dest.region, shard.buf,
                dtype=dest.dtype, global_shape=dest.global_shape, received=received,
            )
        except TenplexError as exc:
            raise TransformFailed(
                f"host {hp.host}: storing {dest.tensor} {dest.region} into {plan.new_version} failed "
                f"({exc.code}: {exc.detail}); nothing was committed, {plan.old_version} is intact"
            ) from exc
    finally:
        if not state.failed.is_set():
            shard.pool.put(shard.buf)  # stored (synchronously): the next shard of this shape may reuse it
        shard.buf = None  # type: ignore[assignment]
        stored(dest.nbytes)
