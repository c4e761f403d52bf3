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
   parameter / optimizer-state storage (no intermediate copy on CPU; through
   a pinned buffer on an accelerator), checksums verified by the store
   client; over HTTP the CPU tensors go in batch reads (``read_regions``: a
   model's hundreds of small biases and norms in a few requests);
4. puts back or derives the trainer state (:mod:`tenplex.worker.trainer_state`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from tenplex.core.version import Version
from tenplex.errors import Conflict, NotFound
from tenplex.ptc import PTC, DatasetState, Region
from tenplex.store import Manifest, RegionRead, TensorStore
from tenplex.worker import trainer_state
from tenplex.worker.state import check_layout, ensure_optimizer_state, live_pieces

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
) -> RestoreResult:
    """Load ``version`` of ``job`` from ``store`` (this rank's host store) into ``model`` and ``optimizer``."""
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
    with torch.no_grad():
        for piece in pieces:
            if piece.region.volume == 0:
                continue  # an empty local shard: nothing stored, nothing to read
            out = piece.local.detach()
            if out.device.type == "cpu" and out.is_contiguous():
                batch.append(RegionRead(piece.name, piece.region, out))
            else:
                staging = torch.empty(out.shape, dtype=out.dtype, pin_memory=out.device.type == "cuda")
                store.read_into(job, v, piece.name, piece.region, staging, verify=verify)
                out.copy_(staging)
            nbytes += out.numel() * out.element_size()
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


def _read_record(store: TensorStore, job: str, version: Version, manifest: Manifest, rank: int, verify: bool) -> dict | None:
    name = trainer_state.record_name(rank)
    shards = manifest.shards_of(name)
    if not shards:
        return None
    size = shards[0].global_shape[0]
    buf = torch.empty(size, dtype=torch.uint8)
    store.read_into(job, version, name, Region.full((size,)), buf, verify=verify)
    return trainer_state.load(buf.numpy().tobytes())
