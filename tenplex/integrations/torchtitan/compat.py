"""torchtitan 0.3.0 on the torch Tenplex pins (2.13.0): the two calls that differ.

1. After its first step the Trainer shortens every process group's timeout with
   ``torch.distributed.set_timeout(timeout, group)``, a public name newer torch
   builds have; torch 2.13 has the same operation as
   ``torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)``.
2. With pipeline parallelism the Trainer hands the schedule its micro-batches
   already split, ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``;
   torch 2.13's ``step`` takes the whole batch and splits it itself, while its
   ``_step_microbatches`` takes exactly those lists. ``step`` is given the
   keywords and passes pre-split micro-batches to ``_step_microbatches`` (the
   whole-batch call is unchanged).

:func:`apply` does both, only where torch lacks them (on any device).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

_applied = False


def apply() -> None:
    """Idempotent; changes nothing on a torch that has ``set_timeout`` and micro-batch lists in ``step``."""
    global _applied
    if _applied:
        return
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout
    import inspect

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    if "arg_mbs" not in inspect.signature(PipelineScheduleSingle.step).parameters:
        PipelineScheduleSingle.step = _with_microbatch_lists(PipelineScheduleSingle.step)
    _applied = True


def _with_microbatch_lists(step: Any) -> Any:
    @functools.wraps(step)
    def wrapped(self: Any, *args: Any, target: Any = None, losses: list | None = None, return_outputs: bool = True,
                loss_kwargs: dict[str, Any] | None = None, arg_mbs: list | None = None,
                kwarg_mbs: list | None = None, target_mbs: list | None = None, **kwargs: Any) -> Any:
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return step(self, *args, target=target, losses=losses, return_outputs=return_outputs,
                        loss_kwargs=loss_kwargs, **kwargs)
        if args or kwargs or target is not None:
            raise TypeError("pass either the whole batch or the micro-batch lists, not both")
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("step() requires gradients to be enabled for backward computation")
        self._stage.has_backward = self._has_backward  # as torch's own step does before the micro-batches
        self._stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        if self._stage.is_last and return_outputs:
            return self._merge_outputs(self._stage.output_chunks)
        return None

    return wrapped
