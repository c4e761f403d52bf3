"""CPU-only substitutions that let torchtitan 0.3.0 train on CPU with gloo (tests, laptops).

torchtitan targets GPUs; four of its choices fail on a CPU-only machine with
the CPU build of torch. :func:`apply` replaces exactly those, and only when
there is no CUDA device (on a GPU machine it changes nothing but the first,
and that only where triton is missing). Everything else (the model, its
``parallelize_llama`` TP/FSDP2 code, ``pipeline_llm``) is torchtitan's own.

1. **triton is not installed** (the CPU torch wheel has none; it is a 280 MB
   download). torchtitan imports the triton kernels of its MoE expert-parallel
   token dispatch (``torchtitan.distributed.minimal_async_ep.kernels``) when
   the model package is imported. The dense llama3 never calls them; the
   module is replaced by one whose kernels raise if anything ever does.
2. **device type**: ``torchtitan.tools.utils.device_type`` falls back to
   ``"cuda"`` when no accelerator is present, so ``ParallelDims.build_mesh``
   would build a CUDA mesh. It is set to ``"cpu"`` where torchtitan reads it.
3. **FlexAttention has no backward on CPU**. llama3's attention is flex or
   varlen only (``sdpa`` is refused for language models). Its forward is
   replaced by ``scaled_dot_product_attention`` with the dense boolean mask
   materialized from the same ``BlockMask``'s ``mask_mod`` (causal + packed
   documents), which computes the same attention.
4. **The block mask is built with ``torch.compile``** (inductor, a C++
   toolchain, tens of seconds per process on CPU). It is built eagerly.

A fifth difference is applied to the modules, not to torchtitan:
:func:`force_sum_reductions` makes FSDP2 reduce gradients with plain sums,
because gloo rejects the ``PREMUL_SUM`` reduction FSDP2 uses by default.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types

import torch
from torch import nn

log = logging.getLogger(__name__)

_EP_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_EP_KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel",
    "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel",
    "topk_scores_grad_kernel",
)
_applied = False


def cpu_only() -> bool:
    return not torch.cuda.is_available()


def apply() -> None:
    """Apply the substitutions this machine needs (idempotent); call before importing torchtitan's models."""
    global _applied
    if _applied:
        return
    if importlib.util.find_spec("triton") is None and _EP_KERNELS not in sys.modules:
        sys.modules[_EP_KERNELS] = _missing_triton_kernels()
    if cpu_only():
        _cpu_device_type()
        _sdpa_instead_of_flex()
        _eager_block_mask()
        log.info("torchtitan CPU substitutions applied (cpu mesh, SDPA for FlexAttention, eager block masks)")
    _applied = True


def _missing_triton_kernels() -> types.ModuleType:
    module = types.ModuleType(_EP_KERNELS)
    module.__doc__ = "CPU-only substitute: triton is not installed; MinimalAsyncEP's GPU kernels are unavailable."

    def unavailable(*args: object, **kwargs: object) -> None:
        raise RuntimeError("torchtitan's MinimalAsyncEP kernels need triton and a GPU (see examples/torchtitan/cpu.py)")

    for name in _EP_KERNEL_NAMES:
        setattr(module, name, unavailable)
    return module


def _cpu_device_type() -> None:
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils

    for module in (tools_utils, parallel_dims, dist_utils):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = torch.cpu


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


def force_sum_reductions(module: nn.Module) -> int:
    """gloo has no ``PREMUL_SUM``: make every FSDP2 module reduce with sums (same result). Returns how many."""
    from torch.distributed.fsdp import FSDPModule

    count = 0
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            count += 1
    return count
