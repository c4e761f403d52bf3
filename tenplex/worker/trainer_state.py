"""The small per-rank state outside the PTC's tensors: RNG, LR scheduler, step, data position.

Each rank stores one record, ``extra/rank<r>/state`` (the bytes of a
``torch.save``'d dict, loaded back with ``weights_only=True``), in the version
it snapshots. What survives what:

- **Restored in the same configuration** (same parallel config and rank, e.g.
  a restart after a failure without a layout change): everything is put back
  exactly, the RNG states included.
- **Restored after a configuration change**: the records are not part of the
  PTC, so the state transformer does not carry them, and a per-rank RNG state
  has no meaning for a different rank anyway. What matters is global and
  follows from the version and the PTC: the step is the version's step; the
  data position is the new PTC's dataset state (the scheduler sets its
  ``consumed_samples`` to the snapshot's, which every SnapshotReport carries); the LR scheduler is replayed
  to the step (it must be stepped once per training step, as usual); the
  optimizer hyper-parameters are those the training script configures. The
  RNGs are re-seeded deterministically from ``(seed, step, rank)``, so a
  re-run of the same change is reproducible.
"""

from __future__ import annotations

import hashlib
import io
import logging
import random
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tenplex.errors import InvalidInput
from tenplex.ptc import DatasetState

log = logging.getLogger(__name__)

RECORD_PREFIX = "extra/rank"
FORMAT = 1


def record_name(rank: int) -> str:
    """Store tensor name of a rank's trainer-state record."""
    return f"{RECORD_PREFIX}{rank}/state"


@dataclass(frozen=True, slots=True)
class TrainerState:
    """What :func:`apply` restored or derived, for the training loop to continue from."""

    step: int
    dataset: DatasetState | None
    extra: dict[str, Any]
    exact: bool
    """True when the rank's own record was found and applied (RNG states included)."""


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This rank's device only (the current one): a rank trains on one GPU, and reading every visible
        # device's generator (get_rng_state_all) would make a CUDA context on each of them, in every rank.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])  # into the current device: this rank's (see _rng_state)


def reseed(seed: int, step: int, rank: int) -> int:
    """Seed every RNG from ``(seed, step, rank)``; returns the derived seed."""
    digest = hashlib.blake2b(f"tenplex-rng:{seed}:{step}:{rank}".encode(), digest_size=8).digest()
    derived = int.from_bytes(digest, "little") & ((1 << 63) - 1)
    torch.manual_seed(derived)  # also seeds every CUDA device
    np.random.seed(derived & 0xFFFFFFFF)
    random.seed(derived)
    return derived


def capture(
    *,
    step: int,
    rank: int,
    parallel: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Any | None,
    dataset: DatasetState | None,
    extra: Mapping[str, Any] | None,
) -> bytes:
    """The record's bytes. ``extra`` must hold only what ``torch.load(weights_only=True)`` accepts."""
    record = {
        "format": FORMAT,
        "step": step,
        "rank": rank,
        "parallel": dict(parallel),
        "rng": _rng_state(),
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "param_groups": (
            [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] if optimizer is not None else None
        ),
        "dataset": dataset.to_json() if dataset is not None else None,
        "extra": dict(extra or {}),
    }
    buf = io.BytesIO()
    torch.save(record, buf)
    return buf.getvalue()


def load(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        record = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    except Exception as exc:  # torch raises several types for malformed input
        raise InvalidInput(f"trainer-state record is not readable: {exc}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise InvalidInput(f"trainer-state record has an unknown format {record.get('format') if isinstance(record, dict) else record!r}")
    return record


def replay_lr_scheduler(lr_scheduler: Any, optimizer: torch.optim.Optimizer | None, steps: int) -> None:
    """Step a freshly built LR scheduler ``steps`` times (without training) so its LR is that of step ``steps``.

    Works for every torch scheduler, chained ones included, because it runs
    the same code as training did. The optimizer's learning rates are reset to
    their initial values first, in case the scheduler was stepped already.
    """
    if optimizer is not None:
        for g in optimizer.param_groups:
            if "initial_lr" in g:
                g["lr"] = g["initial_lr"]
    lr_scheduler.last_epoch = 0
    lr_scheduler._step_count = 1
    with warnings.catch_warnings():
        # "Detected call of lr_scheduler.step() before optimizer.step()": intended here.
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            lr_scheduler.step()


def apply(
    record: Mapping[str, Any] | None,
    *,
    step: int,
    rank: int,
    parallel: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Any | None,
    dataset: DatasetState | None,
    seed: int,
) -> TrainerState:
    """Put back (or derive, see the module docstring) the trainer state for ``step`` on ``rank``."""
    if record is not None and record.get("step") != step:
        raise InvalidInput(f"trainer-state record is of step {record.get('step')}, the version of step {step}")
    same_layout = record is not None and record.get("rank") == rank and dict(record.get("parallel", {})) == dict(parallel)
    if same_layout:
        assert record is not None
        _set_rng_state(record["rng"])
    else:
        reseed(seed, step, rank)
    if lr_scheduler is not None:
        if record is not None and record.get("lr_scheduler") is not None:
            lr_scheduler.load_state_dict(record["lr_scheduler"])
        else:
            replay_lr_scheduler(lr_scheduler, optimizer, step)
    if optimizer is not None and record is not None and record.get("param_groups") is not None:
        saved = record["param_groups"]
        if len(saved) != len(optimizer.param_groups):
            raise InvalidInput(
                f"the record has {len(saved)} optimizer parameter groups, the optimizer {len(optimizer.param_groups)}"
            )
        for group, values in zip(optimizer.param_groups, saved, strict=True):
            group.update(values)
    saved_ds = record.get("dataset") if record is not None else None
    if saved_ds is not None:
        recorded = DatasetState.from_json(saved_ds)
        if dataset is not None and dataset != recorded:
            # The record was written with this very version: it is the truth. A PTC reused from
            # an earlier generation (e.g. consumed_samples still 0) is only stale, not wrong.
            log.warning("the PTC's dataset state %s differs from the snapshot's %s; using the snapshot's", dataset.to_json(), recorded.to_json())
        dataset = recorded
    return TrainerState(step=step, dataset=dataset, extra=dict(record.get("extra", {})) if record else {}, exact=same_layout)
