"""Restore: load this rank's shards of a version into the already parallelized model and optimizer.

The training script builds its model for the assigned configuration (pipeline
stage, DTensor TP, FSDP2 or replicate DP) and its optimizer, then calls
:func:`restore`. It

1. creates the optimizer state the PTC names if the optimizer has not taken a
   step yet (AdamW creates ``exp_avg`` etc. lazily);
2. checks that the live shard layout (each DTensor's local region, plain
   tensors whole) is exactly this device's part of the PTC; a mismatch is an
   :class:`~tenplex.errors.InvalidConfig` naming the first differing tensor
   and both layouts, raised before any byte is read;
3. reads every local shard from the node-local store straight into the
   parameter / optimizer-state storage (no intermediate copy on CPU),
   checksums verified by the store client; over HTTP the CPU tensors go in
   batch reads (``read_regions``: a model's hundreds of small biases and norms
   in a few requests). GPU tensors go through a few page-locked host slots
   (:class:`~tenplex.worker.pinned.HostArena`, a bounded amount whatever the
   state's size): ``read_concurrency`` threads each read a whole shard (so its
   checksum is verified) into a free slot and queue its host-to-device copy on
   a side stream; a slot is refilled once its copy's event has fired. Reads
   from the store and copies over the bus overlap, and the host synchronizes
   once per device at the end;
4. puts back or derives the trainer state (:mod:`tenplex.worker.trainer_state`).
"""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from tenplex.core.version import Version
from tenplex.errors import Conflict, InvalidConfig, NotFound
from tenplex.ptc import PTC, DatasetState, Region
from tenplex.store import Manifest, RegionRead, TensorStore
from tenplex.worker import trainer_state
from tenplex.worker.pinned import HostArena
from tenplex.worker.state import LocalPiece, check_layout, ensure_optimizer_state, live_pieces

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RestoreResult:
    version: Version
    step: int
    """Steps completed in the restored state: the training loop continues with step ``step + 1``."""
    dataset: DatasetState | None
    """Where the data order stands (drive the :class:`~tenplex.worker.ElasticSampler` with it)."""
    extra: dict
    exact: bool
    """The rank's own trainer-state record was applied (same layout): RNG states are exact."""
    tensors: int
    bytes_read: int
    seconds: float


def restore(
    store: TensorStore,
    job: str,
    version: Version | str,
    ptc: PTC,
    rank: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    lr_scheduler: object | None = None,
    seed: int = 0,
    verify: bool = True,
    read_concurrency: int = 8,
    staging_bytes: int = 2 << 30,
) -> RestoreResult:
    """Load ``version`` of ``job`` from ``store`` (this rank's host store) into ``model`` and ``optimizer``.

    GPU tensors: ``read_concurrency`` reader threads and about ``staging_bytes`` of page-locked host memory
    (at least two shards' worth), see the module docstring."""
    if read_concurrency < 1 or staging_bytes < 1:
        raise InvalidConfig(f"read_concurrency ({read_concurrency}) and staging_bytes ({staging_bytes}) must be >= 1")
    v = version if isinstance(version, Version) else Version.parse(version)
    t0 = time.perf_counter()
    try:
        manifest = store.manifest(job, v)
    except NotFound:
        raise NotFound(f"version {v} of job {job!r} is not in this host's store") from None
    if not manifest.committed:
        raise Conflict(f"version {v} of job {job!r} is not committed in this host's store; it cannot be restored")
    if optimizer is not None:
        created = ensure_optimizer_state(model, optimizer, ptc, zeros=False)  # all overwritten below
        if created:
            log.debug("rank %d: created %d optimizer state tensors to restore into", rank, created)
    pieces = live_pieces(model, optimizer)
    check_layout(pieces, ptc, rank)
    nbytes = 0
    batch: list[RegionRead] = []
    on_gpu: list[LocalPiece] = []
    with torch.no_grad():
        for piece in pieces:
            if piece.region.volume == 0:
                continue  # an empty local shard: nothing stored, nothing to read
            out = piece.local.detach()
            if out.device.type == "cuda":
                on_gpu.append(piece)
            elif out.device.type == "cpu" and out.is_contiguous():
                batch.append(RegionRead(piece.name, piece.region, out))
            else:
                staging = torch.empty(out.shape, dtype=out.dtype)
                store.read_into(job, v, piece.name, piece.region, staging, verify=verify)
                out.copy_(staging)
            nbytes += out.numel() * out.element_size()
        if on_gpu:
            _copy_in_devices(store, job, v, on_gpu, verify, read_concurrency, staging_bytes)
        if batch:
            store.read_regions(job, v, batch, verify=verify)
    record = _read_record(store, job, v, manifest, rank, verify)
    state = trainer_state.apply(
        record,
        step=v.step,
        rank=rank,
        parallel=dict(ptc.config),
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        dataset=ptc.dataset,
        seed=seed,
    )
    seconds = time.perf_counter() - t0
    log.info(
        "rank %d restored %s: %d tensors, %.1f MB in %.2fs (%s trainer state)",
        rank,
        v,
        len(pieces),
        nbytes / 1e6,
        seconds,
        "exact" if state.exact else "derived",
    )
    return RestoreResult(v, state.step, state.dataset, state.extra, state.exact, len(pieces), nbytes, seconds)


def _copy_in_devices(store: TensorStore, job: str, version: Version, pieces: list[LocalPiece], verify: bool,
                     concurrency: int, staging_bytes: int) -> None:
    """Read these GPU tensors' shards through page-locked host slots (see the module docstring)."""
    sizes = [p.local.numel() * p.local.element_size() for p in pieces]
    largest = max(sizes)
    slots = min(len(pieces), max(2, min(concurrency, staging_bytes // largest)))
    arena = HostArena([largest] * slots, pin=True)
    free: queue.SimpleQueue[tuple[int, torch.cuda.Event | None]] = queue.SimpleQueue()
    for slot in range(slots):
        free.put((slot, None))
    streams: dict[torch.device, torch.cuda.Stream] = {}
    for device in {p.local.device for p in pieces}:
        streams[device] = torch.cuda.Stream(device)
        streams[device].wait_stream(torch.cuda.current_stream(device))  # after what made the live tensors

    def one(piece: LocalPiece) -> None:
        slot, copied = free.get()  # as many threads as slots: one is free
        try:
            if copied is not None:
                copied.synchronize()  # the slot's previous copy to the device is done
            out = piece.local.detach()
            buf = arena.slice(slot, out.shape, out.dtype)
            store.read_into(job, version, piece.name, piece.region, buf, verify=verify)
            stream = streams[out.device]
            with torch.cuda.device(out.device), torch.cuda.stream(stream):
                out.copy_(buf, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
        finally:
            free.put((slot, copied))

    order = sorted(range(len(pieces)), key=lambda i: sizes[i], reverse=True)
    pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="tenplex-restore")
    try:
        for f in [pool.submit(one, pieces[i]) for i in order]:
            f.result()  # the first failure ends the restore (the reads not started are cancelled)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for stream in streams.values():
            stream.synchronize()  # every copy is done before the slots go (and before training reads them)
        arena.close()


def _read_record(store: TensorStore, job: str, version: Version, manifest: Manifest, rank: int, verify: bool) -> dict | None:
    name = trainer_state.record_name(rank)
    shards = manifest.shards_of(name)
    if not shards:
        return None
    size = shards[0].global_shape[0]
    buf = torch.empty(size, dtype=torch.uint8)
    store.read_into(job, version, name, Region.full((size,)), buf, verify=verify)
    return trainer_state.load(buf.numpy().tobytes())
