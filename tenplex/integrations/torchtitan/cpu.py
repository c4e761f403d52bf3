"""CPU-only substitutions that let torchtitan 0.3.0 train on CPU with gloo (tests, laptops).

torchtitan targets GPUs; three of its choices fail on a CPU-only machine with
the CPU build of torch. :func:`apply` replaces exactly those, and only when
there is no CUDA device (on a GPU machine it changes nothing). Everything else
(the model, its ``parallelize_llama`` TP/FSDP2 code, ``pipeline_llm``) is
torchtitan's own. (torchtitan imports triton when its model package is
imported, for its MoE kernels; triton is installed with the ``clients`` extra
and imports on a CPU, its kernels are never launched by the dense llama3.)

1. **device type**: ``torchtitan.tools.utils.device_type`` falls back to
   ``"cuda"`` when no accelerator is present, so ``ParallelDims.build_mesh``
   would build a CUDA mesh. It is set to ``"cpu"`` where torchtitan reads it,
   and its ``device_module`` to ``torch.cpu`` (device index 0).
2. **FlexAttention has no backward on CPU**. llama3's attention is flex or
   varlen only (``sdpa`` is refused for language models). Its forward is
   replaced by ``scaled_dot_product_attention`` with the dense boolean mask
   materialized from the same ``BlockMask``'s ``mask_mod`` (causal + packed
   documents), which computes the same attention.
3. **The block mask is built with ``torch.compile``** (inductor, a C++
   toolchain, tens of seconds per process on CPU). It is built eagerly.
4. **The Trainer's device memory monitor** reads ``torch.cuda``'s allocator
   statistics. On CPU it reports the process's peak resident memory and the
   machine's memory (:class:`HostMemoryMonitor`).

A fourth difference is applied to the modules, not to torchtitan:
:func:`force_sum_reductions` makes FSDP2 reduce gradients with plain sums,
because gloo rejects the ``PREMUL_SUM`` reduction FSDP2 uses by default.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

_applied = False


def cpu_only() -> bool:
    return not torch.cuda.is_available()


def apply() -> None:
    """Apply the substitutions this machine needs (idempotent); call before importing torchtitan's models."""
    global _applied
    if _applied:
        return
    if cpu_only():
        _cpu_device_type()
        _sdpa_instead_of_flex()
        _eager_block_mask()
        _host_memory_monitor()
        log.info("torchtitan CPU substitutions applied (cpu mesh, SDPA for FlexAttention, eager block masks, "
                 "host memory monitor)")
    _applied = True


def _cpu_device_type() -> None:
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils

    for module in (tools_utils, parallel_dims, dist_utils, metrics):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = _CpuDeviceModule()


class _CpuDeviceModule:
    """``torch.cpu`` where torchtitan expects ``torch.cuda``, with an integer ``current_device()`` (torchtitan
    passes it to ``barrier(device_ids=...)``, which takes integers; ``torch.cpu.current_device()`` is ``"cpu"``)."""

    def current_device(self) -> int:
        return 0

    def __getattr__(self, name: str) -> object:
        return getattr(torch.cpu, name)


def _sdpa_instead_of_flex() -> None:
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import BlockMask, create_mask
    from torchtitan.models.common.attention import FlexAttention

    def forward(
        self: nn.Module,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: BlockMask,
        score_mod: object | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform: object | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError("the CPU SDPA substitute for FlexAttention takes no score_mod or out_transform")
        if not isinstance(attention_masks, BlockMask):
            raise TypeError(f"attention_masks must be a BlockMask, got {type(attention_masks).__name__}")
        batch, q_len, kv_len = q_BLNH.shape[0], q_BLNH.shape[1], k_BLNH.shape[1]
        mask = create_mask(attention_masks.mask_mod, batch, 1, q_len, kv_len, device=q_BLNH.device)
        out = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2),
            k_BLNH.transpose(1, 2),
            v_BLNH.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)

    FlexAttention.forward = forward


def _eager_block_mask() -> None:
    import torchtitan.models.common.decoder as decoder
    from torch.nn.attention.flex_attention import create_block_mask

    decoder.create_attention_mask = create_block_mask


def _host_memory_monitor() -> None:
    import torchtitan.components.metrics as metrics

    metrics.build_device_memory_monitor = HostMemoryMonitor


class HostMemoryMonitor:
    """torchtitan's ``DeviceMemoryMonitor`` interface on CPU: this process's peak RSS of the machine's memory."""

    def __init__(self) -> None:
        import psutil

        self.device = torch.device("cpu")
        self.device_name = "cpu"
        self.device_index = 0
        self.device_capacity = psutil.virtual_memory().total
        self.device_capacity_gib = self.device_capacity / 2**30

    def get_peak_stats(self) -> object:
        import resource

        from torchtitan.components.metrics import DeviceMemStats

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
        gib, pct = peak / 2**30, 100 * peak / self.device_capacity
        return DeviceMemStats(gib, pct, gib, pct, 0, 0)

    def reset_peak_stats(self) -> None:
        """The peak RSS of a process cannot be reset; it stays the peak since the start."""


def force_sum_reductions(module: nn.Module) -> int:
    """gloo has no ``PREMUL_SUM``: make every FSDP2 module reduce with sums (same result). Returns how many."""
    from torch.distributed.fsdp import FSDPModule

    count = 0
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            count += 1
    return count
