"""How the reference GPT is cut across devices: mesh, pipeline stages, TP, DP, schedule.

The steps follow TorchTitan and are applied in this order to one stage's module:

1. :func:`pipeline_stage_module` keeps only what the stage owns (its global
   layers; the embeddings on the first stage; norm and output on the last),
   so parameter names stay global.
2. :func:`apply_tp` turns the linear layers into DTensor column/row-parallel
   layers on the ``tp`` sub-mesh (Megatron's split, no sequence parallelism):

   ============================  ==========================================
   module                        plan
   ============================  ==========================================
   ``tok_embeddings``            rowwise: vocab-parallel embedding, output
                                 all-reduced to a replicated activation
   ``attention.wq/wk/wv``        colwise: heads split across tp ranks
   ``attention.wo``              rowwise: partial sums all-reduced
   ``feed_forward.w1`` (``w3``)  colwise
   ``feed_forward.w2``           rowwise
   ``output``                    colwise over the vocabulary, logits
                                 all-gathered (replicated) for the loss
   ``pos_embeddings``, norms     plain replicated tensors: every tp rank
                                 computes the same gradient for them
   ============================  ==========================================

3. :func:`apply_dp` adds data parallelism on the ``dp`` sub-mesh: ZeRO-3 is
   FSDP2 ``fully_shard`` (dim 0 of every parameter sharded over dp, on top of
   tp: a column-parallel weight becomes ``(_StridedShard(0), Shard(0))`` on
   the ``(dp, tp)`` mesh); ZeRO-0 is the FSDP2-based composable
   ``replicate`` (parameters become DTensors replicated over dp, gradients
   all-reduced in backward). ``DistributedDataParallel`` is not used: it
   rejects DTensor parameters (its initial broadcast fails with "got mixed
   torch.Tensor and DTensor"), and ``replicate`` also composes with the
   pipeline schedule the way FSDP2 does.
4. :func:`build_pipeline_schedule` wraps the stage in a
   ``torch.distributed.pipelining.PipelineStage`` on the ``pp`` sub-mesh and
   returns a GPipe or 1F1B schedule.

The device mesh is ``(pp, dp, tp)`` so that its coordinates are exactly
:meth:`tenplex.ptc.ParallelConfig.coords` of every rank (Megatron order).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from examples.gpt.model import GPT, GPTConfig
from tenplex.errors import InvalidConfig
from tenplex.ptc import ParallelConfig

log = logging.getLogger(__name__)

MESH_DIMS = ("pp", "dp", "tp")


def build_mesh(parallel: ParallelConfig, device_type: str) -> DeviceMesh:
    """The ``(pp, dp, tp)`` mesh over the default process group's ranks in Megatron order."""
    if dist.get_world_size() != parallel.world_size:
        raise InvalidConfig(
            f"{parallel.describe()} needs {parallel.world_size} processes, the process group has {dist.get_world_size()}"
        )
    return init_device_mesh(device_type, (parallel.pp, parallel.dp, parallel.tp), mesh_dim_names=MESH_DIMS)


def check_supported(cfg: GPTConfig, parallel: ParallelConfig) -> None:
    """Reject configurations this job cannot run, with the reason."""
    cfg.check_tp(parallel.tp)
    parallel.stage_layers(cfg.n_layers)  # raises when the split does not fit
    if parallel.zero not in (0, 3):
        raise InvalidConfig(
            f"zero={parallel.zero}: the PyTorch-native job supports ZeRO-0 (replicated) and ZeRO-3 (FSDP2) only"
        )
    if cfg.tied and (parallel.tp > 1 or parallel.pp > 1):
        raise InvalidConfig(
            f"tied embeddings need tp=1 and pp=1 (got {parallel.describe()}): "
            "the shared weight cannot live on two stages or take two TP plans"
        )


def pipeline_stage_module(model: GPT, stage: int, num_stages: int, parallel: ParallelConfig) -> GPT:
    """Prune ``model`` in place to pipeline stage ``stage`` of ``num_stages`` and return it."""
    if num_stages != parallel.pp:
        raise InvalidConfig(f"num_stages {num_stages} differs from pp={parallel.pp}")
    if not 0 <= stage < num_stages:
        raise InvalidConfig(f"stage {stage} is outside 0..{num_stages - 1}")
    if num_stages == 1:
        return model
    if model.cfg.tied:
        raise InvalidConfig("tied embeddings cannot be split across pipeline stages")
    keep = parallel.stage_layers(model.cfg.n_layers)[stage]
    for name in list(model.layers.keys()):
        if int(name) not in keep:
            del model.layers[name]
    if stage > 0:
        model.tok_embeddings = None
        model.pos_embeddings = None
    if stage < num_stages - 1:
        model.norm = None
        model.output = None
    return model


def apply_tp(module: GPT, tp_mesh: DeviceMesh) -> GPT:
    """Megatron-style tensor parallelism with DTensor (see the module docstring for the plan)."""
    if tp_mesh.size() == 1:
        return module
    plan: dict[str, object] = {}
    if module.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if module.output is not None:
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    for name, block in module.layers.items():
        prefix = f"layers.{name}"
        plan[f"{prefix}.attention.wq"] = ColwiseParallel()
        plan[f"{prefix}.attention.wk"] = ColwiseParallel()
        plan[f"{prefix}.attention.wv"] = ColwiseParallel()
        plan[f"{prefix}.attention.wo"] = RowwiseParallel()
        plan[f"{prefix}.feed_forward.w1"] = ColwiseParallel()
        if block.feed_forward.w3 is not None:
            plan[f"{prefix}.feed_forward.w3"] = ColwiseParallel()
        plan[f"{prefix}.feed_forward.w2"] = RowwiseParallel()
    parallelize_module(module, tp_mesh, plan)
    return module


def apply_dp(module: GPT, dp_mesh: DeviceMesh, zero: int) -> GPT:
    """Data parallelism: FSDP2 ``fully_shard`` for ZeRO-3, FSDP2-based ``replicate`` for ZeRO-0.

    Each block is wrapped first, then the root (embeddings, norm, output),
    so that collectives run one block at a time and overlap with compute.
    With one data-parallel rank the module is left as it is.
    """
    if dp_mesh.size() == 1:
        return module
    if zero not in (0, 3):
        raise InvalidConfig(f"zero={zero} is not supported by the PyTorch-native job (use 0 or 3)")
    wrap = fully_shard if zero == 3 else replicate
    for block in module.layers.values():
        wrap(block, mesh=dp_mesh)
    wrap(module, mesh=dp_mesh)
    return module


def parallelize(module: GPT, mesh: DeviceMesh, parallel: ParallelConfig) -> GPT:
    """TP then DP on one pipeline stage's module (the function handed to the layout provider)."""
    apply_tp(module, mesh["tp"])
    apply_dp(module, mesh["dp"], parallel.zero)
    log.debug("parallelized layers %s for %s", list(module.layers.keys()), parallel.describe())
    return module


def build_pipeline_schedule(
    stage_module: nn.Module,
    stage_index: int,
    num_stages: int,
    pp_mesh: DeviceMesh,
    device: torch.device,
    *,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    schedule: str = "1f1b",
) -> ScheduleGPipe | Schedule1F1B:
    """A ``torch.distributed.pipelining`` schedule for one stage.

    Call ``schedule.step(tokens)`` on the first stage,
    ``schedule.step(target=targets, losses=losses)`` on the last and
    ``schedule.step()`` on the others; the loss function sees one
    micro-batch's logits and targets and the schedule scales the gradients
    by ``1 / n_microbatches``.
    """
    if n_microbatches < 1:
        raise InvalidConfig(f"n_microbatches must be >= 1, got {n_microbatches}")
    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if schedule not in kinds:
        raise InvalidConfig(f"unknown pipeline schedule {schedule!r}; choose one of {sorted(kinds)}")
    stage = PipelineStage(stage_module, stage_index, num_stages, device, group=pp_mesh.get_group())
    return kinds[schedule](stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
