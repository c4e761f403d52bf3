"""Snapshots: this rank's part of the job state into the node-local store, off the critical path.

``Snapshotter.snapshot(step, ...)`` runs at a step boundary. It copies this
rank's shards out of the live tensors into host buffers it keeps between
snapshots (pinned when the tensors are on an accelerator) and returns; a
background thread writes the copies into the node-local store as version
``s<step>-g<generation>``. The next training step therefore waits only for
the copy. Calling ``snapshot`` again, or :meth:`Snapshotter.wait`, joins the
previous write and raises its error, if any.

Where the node store has a memory tier (a worker writing into the node's
store root directly, :mod:`tenplex.store.tiers`), the host buffers are the
store's own memory files (:meth:`~tenplex.store.TensorStore.snapshot_buffers`):
the copy-out lands where the version's shards will be, and the background
write only links the files into the version and records their checksums, so
the version is committed (readable by peers) a checksum pass after the copy,
and the node's daemon makes it durable on disk later.

Which rank writes what: a shard held by several devices of one host (data-
parallel replicas on one node) is written once, by the lowest device id on
that host that holds it (known from the PTC, so no coordination is needed).

Commit without a barrier: after its writes, each rank reads the version's
manifest from its host store; if every shard the PTC places on this host, and
every rank's trainer-state record, is there, it commits. Commit is
idempotent, so two ranks finishing together both committing is fine; the
last rank to finish always sees everything (its manifest read happens after
all writes have returned), so a host's version is always committed once
complete.

Unchanged shards are not written again: a shard whose bytes have the same
crc32c as what this rank wrote for it in its previous snapshot (frozen
parameters, non-trainable buffers, a stop right after a periodic snapshot)
is hard-linked from that version into the new one by the store (which checks
the old files against their recorded checksums first); only if that fails is
it written. Linking costs a checksum of the copy, far less than a write.

On a GPU the copy-out does not hold the training loop either. The device
tensors are copied into page-locked host memory made once and reused
(:class:`~tenplex.worker.pinned.HostArena`), on a side stream that first
waits, on the GPU, for the work the step queued (its optimizer step): the
call only queues the copies and returns. The next step's forward and backward
then run while the copies do; its optimizer step, which overwrites what is
being copied, waits for them on the GPU (a step pre-hook that every torch
optimizer of the process runs, made once per snapshot; no device-wide
synchronize anywhere). The background write waits for the copies' event
before it reads the host memory. A loop that writes the parameters or the
optimizer state outside an optimizer step right after a snapshot passes
``overlap_copies=False``: the training stream then waits for the copies at
once (still without blocking the host).

Besides the PTC's tensors, each rank writes one small ``extra/rank<r>/state``
record (see :mod:`tenplex.worker.trainer_state`): RNG states, LR scheduler,
optimizer hyper-parameters, step, dataset position and user extras.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from tenplex.core.buffers import aligned_empty
from tenplex.core.version import Version
from tenplex.errors import InvalidConfig, NotFound, TenplexError
from tenplex.ptc import PTC, DatasetState, Region, TensorKind
from tenplex.store import SnapshotBuffers, TensorStore
from tenplex.store.buffers import crc_of
from tenplex.store.model import format_checksum
from tenplex.worker import trainer_state
from tenplex.worker.pinned import HostArena
from tenplex.worker.state import LocalPiece, check_layout, live_pieces, named_parameters

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Copy:
    name: str
    region: Region
    global_shape: tuple[int, ...]
    dtype: str
    data: torch.Tensor
    in_store: bool = False
    """``data`` is one of the store's snapshot buffers: stored by a link, not written."""


@dataclass(frozen=True, slots=True)
class _Flight:
    """The device-to-host copies of one snapshot on one GPU, queued on its side stream."""

    device: torch.device
    start: torch.cuda.Event
    done: torch.cuda.Event
    nbytes: int
    sources: tuple[torch.Tensor, ...]
    """The tensors being copied, held until the copies are done: none is freed (and its memory reused) before."""


@dataclass(frozen=True, slots=True)
class SnapshotResult:
    """The outcome of one background write."""

    version: Version
    host: str
    shards_written: int
    bytes_written: int
    copy_seconds: float
    write_seconds: float
    committed: bool
    """Whether this rank found its host's copy complete and committed it."""
    consumed_samples: int | None = None
    """The dataset position stored with the version, when the snapshot was given one."""
    shards_linked: int = 0
    """Shards unchanged since this rank's previous snapshot, linked from it instead of written."""
    bytes_linked: int = 0
    readable_seconds: float | None = None
    """From the snapshot call (the step's end) to this rank's commit, when it committed: the time until
    peers can read the version on this host."""
    device_bytes: int = 0
    """Bytes copied from GPUs into host memory (the rest were host tensors)."""
    device_copy_seconds: float | None = None
    """How long the device-to-host copies took on their side stream, timed by the GPU (the slowest device);
    they overlap the next step (``copy_seconds`` is what the caller waited)."""


class Snapshotter:
    """Takes snapshots of one rank; one instance per training process.

    ``store`` is the node-local store of ``host`` (the host of ``rank`` in
    ``ptc``). ``on_done`` is called in the background thread with each
    finished :class:`SnapshotResult` (e.g. to report it to the scheduler).
    The writer thread runs ``writer_nice`` steps nicer than training, so
    that where CPU cores are scarce the write waits, not the next step.
    ``store_buffers`` (default) copies into the store's snapshot buffers where
    it offers them (a memory tier); :meth:`close` lets them go.
    ``overlap_copies`` (default) lets the next step run during a GPU's
    copy-out until its optimizer step (see the module docstring).
    """

    def __init__(
        self,
        store: TensorStore,
        job: str,
        ptc: PTC,
        rank: int,
        *,
        on_done: Callable[[SnapshotResult], None] | None = None,
        check: bool = True,
        writer_nice: int = 10,
        write_concurrency: int = 4,
        store_buffers: bool = True,
        overlap_copies: bool = True,
    ) -> None:
        if write_concurrency < 1:
            raise InvalidConfig(f"write_concurrency must be >= 1, got {write_concurrency}")
        self.store = store
        self.job = job
        self.ptc = ptc
        self.rank = rank
        self.host = ptc.device(rank).host
        self._on_done = on_done
        self._check = check
        self._writer_nice = writer_nice
        self._write_concurrency = write_concurrency
        self._thread: threading.Thread | None = None
        self._result: SnapshotResult | None = None
        self._error: BaseException | None = None
        host_ids = {d.id for d in ptc.devices_on_host(self.host)}
        # (tensor, region) this rank writes: the shards where it is the lowest holder on its host.
        self._mine: set[tuple[str, Region]] = set()
        self._host_needs: set[tuple[str, Region]] = set()
        self._host_records = {trainer_state.record_name(d) for d in host_ids}
        for t, s in ptc.shards_on_host(self.host):
            if t.kind == TensorKind.EXTRA:
                continue
            self._host_needs.add((t.name, s.region))
            if min(d for d in s.devices if d in host_ids) == rank:
                self._mine.add((t.name, s.region))
        self._layout_checked = False
        self._buffers: dict[tuple[str, Region], torch.Tensor] = {}
        self._use_store_buffers = store_buffers
        self._store_buffers: SnapshotBuffers | None = None
        self._store_buffers_asked = False
        self._written: dict[tuple[str, Region], tuple[Version, str]] = {}
        """(tensor, region) -> the version this rank last stored it in and its recorded checksum."""
        self._overlap = overlap_copies
        self._arena: HostArena | None = None
        self._arena_layout: tuple[tuple[str, Region, tuple[int, ...], torch.dtype], ...] = ()
        self._device_buffers: dict[tuple[str, Region], torch.Tensor] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._fence_handle: Any = None
        self._pieces_of: tuple[list[tuple[Any, Any]], list[Any], list[tuple[Any, ...]]] | None = None
        """Weak references to the state's tensors (and DTensors' local tensors), their shapes, and their
        pieces' names and regions: see :meth:`_live_pieces`."""

    # -- public -------------------------------------------------------------------

    def snapshot(
        self,
        step: int,
        generation: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        lr_scheduler: Any | None = None,
        dataset: DatasetState | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Version:
        """Copy this rank's shards out now; write and commit them in the background.

        Returns the version being written. Raises the previous snapshot's
        error, if it failed, before starting (a failed snapshot must not go
        unnoticed until the job needs it).
        """
        self.wait()
        version = Version(step, generation)
        t0 = time.perf_counter()
        pieces = self._live_pieces(model, optimizer)
        if self._check and not self._layout_checked:
            check_layout(pieces, self.ptc, self.rank)
            self._layout_checked = True
        mine = [p for p in pieces if (p.name, p.region) in self._mine]
        missing = self._mine - {(p.name, p.region) for p in mine}
        if missing:
            name, region = sorted(missing, key=str)[0]
            raise InvalidConfig(
                f"rank {self.rank} must write {name!r} {region} for host {self.host}, but the live state has no such "
                "tensor (has the optimizer taken a step?)"
            )
        # GPU tensors first: their copies are only queued, and run while the host copies its own tensors.
        flights = self._copy_out_devices([p for p in mine if p.local.device.type == "cuda"])
        buffers = self._buffers_of_store()
        copies = []
        for piece in mine:
            key = (piece.name, piece.region)
            if piece.local.device.type == "cuda":
                copies.append(_Copy(piece.name, piece.region, piece.global_shape, piece.dtype, self._device_buffers[key]))
                continue
            buf = self._store_buffer(buffers, piece) if buffers is not None else None
            in_store = buf is not None
            if buf is None:
                buf = self._staging_buffer(piece.name, piece.region, piece.local)
            buf.copy_(piece.local.detach())
            copies.append(_Copy(piece.name, piece.region, piece.global_shape, piece.dtype, buf, in_store))
        self._fence(flights)
        record = trainer_state.capture(
            step=step,
            rank=self.rank,
            parallel=dict(self.ptc.config),
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dataset=dataset,
            extra=extra,
        )
        copy_s = time.perf_counter() - t0
        consumed = dataset.consumed_samples if dataset is not None else None
        self._thread = threading.Thread(
            target=self._write, args=(version, copies, record, copy_s, consumed, t0, flights),
            name=f"tenplex-snapshot-{version}", daemon=True,
        )
        self._thread.start()
        return version

    def _live_pieces(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[LocalPiece]:
        """:func:`live_pieces`, with the names and regions reused while the state is the same tensor objects
        of the same shapes as at the previous snapshot (the usual case: parameters and optimizer state are
        updated in place). Naming and placing a large model's thousand tensors costs milliseconds of Python on
        every snapshot; checking that they are the same objects (a DTensor's local tensor included) costs a
        walk. The check holds weak references only: a replaced tensor is neither kept alive nor mistaken for
        its successor."""
        tensors = [p for _, p in named_parameters(model)]
        if optimizer is not None:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    tensors += [v for v in optimizer.state.get(param, {}).values() if isinstance(v, torch.Tensor)]
        locals_ = [getattr(t, "_local_tensor", None) for t in tensors]  # a DTensor's; None for a plain tensor
        shapes = [t.shape for t in tensors]
        cached = self._pieces_of
        if cached is not None:
            refs, cached_shapes, meta = cached
            if (cached_shapes == shapes and len(refs) == len(tensors)
                    and all(r[0]() is t and (r[1] is None) == (lt is None) and (r[1] is None or r[1]() is lt)
                            for r, t, lt in zip(refs, tensors, locals_, strict=True))):
                return [LocalPiece(*m, local=t if lt is None else lt) for m, t, lt in zip(meta, tensors, locals_,
                                                                                           strict=True)]
        pieces = live_pieces(model, optimizer)
        if len(pieces) == len(tensors):  # one piece per tensor, in this order (live_pieces walks the same way)
            refs = [(weakref.ref(t), None if lt is None else weakref.ref(lt)) for t, lt in zip(tensors, locals_,
                                                                                                strict=True)]
            meta = [(p.name, p.kind, p.global_shape, p.dtype, p.region) for p in pieces]
            self._pieces_of = (refs, shapes, meta)
        return pieces

    def _copy_out_devices(self, pieces: list[LocalPiece]) -> list[_Flight]:
        """Queue the copies of these GPU tensors into their host buffers, one side stream per device, each
        after the work already queued on the device's current stream; the copies' events."""
        if not pieces:
            return []
        self._device_staging(pieces)
        by_device: dict[torch.device, list[LocalPiece]] = {}
        for piece in pieces:
            by_device.setdefault(piece.local.device, []).append(piece)
        flights = []
        for device, group in by_device.items():
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = torch.cuda.Stream(device)
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            side.wait_stream(torch.cuda.current_stream(device))  # after the step's last writes (its optimizer)
            sources = tuple(piece.local.detach() for piece in group)
            with torch.cuda.device(device), torch.cuda.stream(side):
                start.record(side)
                # one call for hundreds of tensors: the per-copy dispatch stays in C++
                torch._foreach_copy_([self._device_buffers[(p.name, p.region)] for p in group], list(sources),
                                     non_blocking=True)
                done.record(side)
            nbytes = sum(t.numel() * t.element_size() for t in sources)
            flights.append(_Flight(device, start, done, nbytes, sources))
        return flights

    def _device_staging(self, pieces: list[LocalPiece]) -> None:
        """Page-locked host buffers for these GPU tensors: one arena, made at the first snapshot and reused
        (the previous snapshot's write has been joined, so its copies are done), made again only when the
        tensors change shape or dtype."""
        layout = tuple((p.name, p.region, tuple(p.local.shape), p.local.dtype) for p in pieces)
        if layout == self._arena_layout and self._arena is not None:
            return
        if self._arena is not None:
            for side in self._streams.values():  # a snapshot that failed after queueing its copies left them
                side.synchronize()
            self._arena.close()
        sizes = [p.local.numel() * p.local.element_size() for p in pieces]
        started = time.perf_counter()
        self._arena = HostArena(sizes, pin=True)
        self._arena_layout = layout
        self._device_buffers = {
            (p.name, p.region): self._arena.slice(i, p.local.shape, p.local.dtype) for i, p in enumerate(pieces)
        }
        log.info("rank %d: %.1f MB of page-locked host memory for the copy-out of %d GPU tensors (%.2f s, once)",
                 self.rank, self._arena.nbytes / 1e6, len(pieces), time.perf_counter() - started)

    def _fence(self, flights: list[_Flight]) -> None:
        """Keep the live tensors unchanged until their copies are done: the next optimizer step waits for them
        on the GPU (or, without ``overlap_copies``, everything queued from now on does)."""
        if not flights:
            return
        if not self._overlap:
            for f in flights:
                torch.cuda.current_stream(f.device).wait_event(f.done)
            return

        pending = list(flights)

        def before_step(*_: Any) -> None:
            # Once; the hook itself stays until the write is joined (torch iterates over its hooks here).
            while pending:
                f = pending.pop()
                torch.cuda.current_stream(f.device).wait_event(f.done)

        self._drop_fence()
        self._fence_handle = torch.optim.optimizer.register_optimizer_step_pre_hook(before_step)

    def _drop_fence(self) -> None:
        handle, self._fence_handle = self._fence_handle, None
        if handle is not None:
            handle.remove()

    def _buffers_of_store(self) -> SnapshotBuffers | None:
        if not self._store_buffers_asked:
            self._store_buffers_asked = True
            if self._use_store_buffers:
                self._store_buffers = self.store.snapshot_buffers(self.job)
                if self._store_buffers is not None:
                    log.info("rank %d snapshots into the node store's memory tier", self.rank)
        return self._store_buffers

    @staticmethod
    def _store_buffer(buffers: SnapshotBuffers, piece: Any) -> torch.Tensor | None:
        """The store's buffer for one host tensor (None for accelerator tensors: they keep pinned buffers of
        their own, and for empty and 0-d ones: nothing to save there)."""
        local = piece.local
        if local.device.type != "cpu" or local.numel() == 0 or local.dim() == 0:
            return None
        nbytes = local.numel() * local.element_size()
        arr = buffers.acquire(piece.name, piece.region, piece.dtype, nbytes)
        return torch.from_numpy(arr).view(local.dtype).view(local.shape)

    def close(self) -> None:
        """Join the last write and let the store's snapshot buffers and the page-locked memory go (versions
        keep what they hold)."""
        try:
            self.wait()
        finally:
            buffers, self._store_buffers = self._store_buffers, None
            if buffers is not None:
                buffers.close()
            arena, self._arena = self._arena, None
            if arena is not None:
                arena.close()
            self._arena_layout, self._device_buffers = (), {}

    def _staging_buffer(self, name: str, region: Region, local: torch.Tensor) -> torch.Tensor:
        """This rank's host buffer for one shard, kept from snapshot to snapshot.

        Reusing it is safe because :meth:`snapshot` joins the previous write
        before copying, and it saves the page faults of fresh memory on every
        snapshot: the copy runs at memory bandwidth. The buffers hold one copy
        of the rank's state. (GPU tensors have page-locked ones: :meth:`_device_staging`.)
        """
        key = (name, region)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            if local.numel() == 0:
                buf = torch.empty(local.shape, dtype=local.dtype)
            else:  # page-aligned: the store writes its chunk files with O_DIRECT straight from it
                buf = torch.from_numpy(aligned_empty((local.numel() * local.element_size(),), np.uint8))
                buf = buf.view(local.dtype).view(local.shape)
            self._buffers[key] = buf
        return buf

    def wait(self) -> SnapshotResult | None:
        """Join the background write; return its result or raise its error."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
            self._drop_fence()  # the write waited for the copies: nothing left to protect
        error, self._error = self._error, None
        if error is not None:
            if isinstance(error, TenplexError):
                raise error
            raise TenplexError(f"snapshot write failed: {error!r}") from error
        return self._result

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- background -------------------------------------------------------------------

    def _write(self, version: Version, copies: list[_Copy], record: bytes, copy_s: float, consumed: int | None,
               started: float, flights: list[_Flight]) -> None:
        t0 = time.perf_counter()
        _lower_priority(self._writer_nice)
        try:
            for f in flights:  # the host buffers of GPU tensors hold their bytes once the copies are done
                f.done.synchronize()
            device_s = max((f.start.elapsed_time(f.done) / 1e3 for f in flights), default=None)
            nbytes = sum(c.data.numel() * c.data.element_size() for c in copies)
            self.store.reserve(self.job, version, nbytes + len(record))  # placed once, not shard by shard
            linked, linked_bytes = self._write_all(version, copies)
            rec = torch.frombuffer(bytearray(record), dtype=torch.uint8)
            self.store.write_shard(
                self.job,
                version,
                trainer_state.record_name(self.rank),
                Region.full((len(record),)),
                rec,
                dtype="uint8",
                global_shape=(len(record),),
            )
            nbytes += len(record)
            committed = self._commit_if_complete(version)
            readable = time.perf_counter() - started if committed else None
            self._result = SnapshotResult(
                version, self.host, len(copies) + 1, nbytes, copy_s, time.perf_counter() - t0, committed, consumed,
                linked, linked_bytes, readable, sum(f.nbytes for f in flights), device_s,
            )
            if self._store_buffers is not None:  # buffers for the next snapshot, made now rather than in its copy-out
                self._store_buffers.prepare()
            log.info(
                "rank %d wrote %s: %d shards, %.1f MB in %.2fs (copy %.3fs)%s%s",
                self.rank,
                version,
                len(copies) + 1,
                nbytes / 1e6,
                self._result.write_seconds,
                copy_s,
                f"; {linked} unchanged ones ({linked_bytes / 1e6:.1f} MB) linked" if linked else "",
                f"; committed {self.host}" if committed else "",
            )
            if self._on_done is not None:
                self._on_done(self._result)
        except BaseException as exc:  # surfaced by wait()
            log.error("rank %d: snapshot %s failed: %s", self.rank, version, exc)
            self._error = exc

    def _write_all(self, version: Version, copies: list[_Copy]) -> tuple[int, int]:
        """Store the copies, a few at a time: a store spends most of a small shard's time waiting
        (file creation, fsync, a round trip), which concurrent writes overlap. Largest first. An unchanged
        shard is linked from the previous snapshot instead (see the module doc); (shards, bytes) linked."""
        linked = [0, 0]
        lock = threading.Lock()

        def write(c: _Copy) -> None:
            key = (c.name, c.region)
            previous = self._written.get(key)
            crc = None
            if previous is not None:
                prev_version, prev_checksum = previous
                crc = crc_of(c.data.contiguous().view(-1).view(torch.uint8).numpy())
                if format_checksum(crc) == prev_checksum:
                    try:
                        info = self.store.link_shard(self.job, prev_version, c.name, c.region, version)
                    except TenplexError as exc:  # not committed, collected, damaged: write it after all
                        log.debug("rank %d: %s %s not linked from %s (%s); writing it", self.rank, c.name, c.region,
                                  prev_version, exc.detail)
                    else:
                        with lock:
                            self._written[key] = (version, info.checksum)
                            linked[0] += 1
                            linked[1] += c.data.numel() * c.data.element_size()
                        return
            if c.in_store:  # the copy is in the store's memory file already: linked into the version
                assert self._store_buffers is not None
                info = self._store_buffers.store(version, c.name, c.region, c.dtype, c.global_shape, crc=crc)
            else:
                info = self.store.write_shard(self.job, version, c.name, c.region, c.data, dtype=c.dtype,
                                              global_shape=c.global_shape)
            with lock:
                self._written[key] = (version, info.checksum)

        ordered = sorted(copies, key=lambda c: c.data.numel() * c.data.element_size(), reverse=True)
        if self._write_concurrency == 1 or len(ordered) < 2:
            for c in ordered:
                write(c)
            return linked[0], linked[1]
        with ThreadPoolExecutor(
            max_workers=self._write_concurrency,
            thread_name_prefix=f"tenplex-snapshot-{version}",
            initializer=_lower_priority,
            initargs=(self._writer_nice,),
        ) as pool:
            futures = [pool.submit(write, c) for c in ordered]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                for f in futures:
                    f.cancel()
                raise failed[0].exception()  # type: ignore[misc]
        return linked[0], linked[1]

    def _commit_if_complete(self, version: Version) -> bool:
        try:
            manifest = self.store.manifest(self.job, version)
        except NotFound:
            return False
        if manifest.committed:
            return False
        have = {(s.tensor, s.region) for s in manifest.shards}
        have_names = {s.tensor for s in manifest.shards}
        if not (self._host_needs <= have and self._host_records <= have_names):
            left = len(self._host_needs - have) + len(self._host_records - have_names)
            log.debug("rank %d: %s on %s still misses %d shards; leaving the commit to the last writer", self.rank, version, self.host, left)
            return False
        self.store.commit(self.job, version)
        return True


def _lower_priority(nice: int) -> None:
    """Make the calling thread yield the CPU to training (Linux: niceness is per thread)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:  # not permitted or not supported: the write just competes normally
        log.debug("could not lower the snapshot writer's priority: %s", exc)

