"""torchtitan's llama3, built and parallelized by torchtitan's own functions for a Tenplex configuration.

For the ``(dp, tp, pp)`` Tenplex assigns, :func:`build_stage` sets up
torchtitan exactly as its ``Trainer`` would, minus the Trainer: a
``ParallelDims`` (``dp`` becomes ``data_parallel_shard_degree`` with
``zero=3``, FSDP2 as torchtitan does by default, or
``data_parallel_replicate_degree`` with ``zero=0``), its device mesh, the
llama3 model of the chosen flavor built on the meta device, then
``pipeline_llm`` (pp > 1) or ``parallelize_llama`` (TP through the model's
sharding config, FSDP2 through ``apply_fsdp_to_decoder``), materialized and
initialized with torchtitan's ``init_weights``. The optimizer is AdamW over the
stage's parameters; the loss is torchtitan's ``CrossEntropyLoss`` (sum over
tokens divided by the global number of label tokens, so the data-parallel
ranks' losses add up to the global mean).

The same function, called under ``derive_ptc_from_stages``'s meta device and
fake process group, gives the layout provider the stage's DTensors:
:func:`titan_ptc` is the job's PTC for any configuration.

What differs from torchtitan's Trainer, deliberately: the SPMD backend is
``partial_dtensor`` (0.3.0's default ``spmd_types`` backend rejects plain
parameters in ``fully_shard`` when built on the meta device under a fake
process group, and needs its type-checking context in the training step);
mixed precision is off (fp32 parameters and reductions, so a resharded
continuation matches bit for bit up to reduction order); no gradient clipping
and no LR schedule; ``update_from_config`` is replaced by the two things it
does for llama3 outside a Trainer (RoPE cache sized to ``seq_len``; the
sharding config), because it imports ``torchtitan.trainer`` for a type check,
which pulls in ``datasets``, ``pyarrow`` and ``tensorboard``. The CPU-only
substitutions are in :mod:`examples.torchtitan.cpu`.

Parameter names are ``named_parameters()`` of the torchtitan model (global
layer numbers: ``layers`` is a ``ModuleDict`` keyed by layer id, kept through
the pipeline split). torchtitan's checkpoints use other keys for the fused
QKV projection; :data:`DCP_KEY_MAPPING` says how they relate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from examples.torchtitan import cpu
from tenplex.errors import InvalidConfig
from tenplex.ptc import PTC, DatasetState, ParallelConfig, Placement
from tenplex.ptc.provider import layout_provider
from tenplex.ptc.torch_layout import derive_ptc_from_stages

cpu.apply()  # before torchtitan builds anything; changes nothing on GPU machines

from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed.pipeline_parallel import pipeline_llm  # noqa: E402
from torchtitan.distributed.utils import set_spmd_backend  # noqa: E402
from torchtitan.models.llama3 import llama3_configs, parallelize_llama  # noqa: E402
from torchtitan.models.llama3.sharding import set_llama3_sharding_config  # noqa: E402

SPMD_BACKEND = "partial_dtensor"
PIPELINE_SCHEDULE = "1F1B"

MESH_ROLES = {"pp": "pp", "dp_replicate": "dp_replicate", "fsdp": "dp_shard", "tp": "tp", "cp": "cp"}
"""torchtitan's ``partial_dtensor`` mesh (``pp, dp_replicate, fsdp, tp``; ``fsdp`` = dp_shard x cp)."""

DCP_KEY_MAPPING = """\
PTC tensor (named_parameters)                 torchtitan DCP checkpoint key (model state_dict)
tok_embeddings.weight                         tok_embeddings.weight
layers.<i>.attention.qkv_linear.wqkv.weight   layers.<i>.attention.qkv_linear.wq.weight, .wk.weight, .wv.weight
                                              (rows regrouped, see below)
every other parameter <name>                  <name> (same key; the model's keys are at the top level)
optim/<name>/exp_avg|exp_avg_sq|step          optimizer.state.<name>.exp_avg|exp_avg_sq|step, <name> as in
                                              named_parameters(): wqkv's optimizer state stays fused
                                              (torchtitan's get_flat_optim_state_dict keys it by FQN)

wqkv (shape [n_kv * (h + 2) * d, dim], h = n_heads // n_kv_heads, d = head_dim) holds, for every KV group
g in 0..n_kv-1, h query heads, then one key head, then one value head, d rows each. Row
((g * (h + 2)) + r) * d + j of wqkv is row (g * h + r) * d + j of wq for r < h, row g * d + j of wk for
r == h, and row g * d + j of wv for r == h + 1 (FusedQKVLinear._split_qkv_on_save / _merge_qkv_on_load)."""
"""How the PTC's names relate to torchtitan's checkpoint keys (for a DCP export or import)."""


def split_wqkv(wqkv: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchtitan's checkpoint tensors ``wq``, ``wk``, ``wv`` of a fused ``wqkv`` (:data:`DCP_KEY_MAPPING`)."""
    h = n_heads // n_kv_heads
    rows = wqkv.shape[0]
    d = rows // (n_kv_heads * (h + 2))
    w = wqkv.reshape(n_kv_heads, h + 2, d, *wqkv.shape[1:])
    tail = tuple(wqkv.shape[1:])
    return (
        w[:, :h].reshape(n_kv_heads * h * d, *tail),
        w[:, h].reshape(n_kv_heads * d, *tail),
        w[:, h + 1].reshape(n_kv_heads * d, *tail),
    )


@dataclass(frozen=True)
class TitanConfig:
    """Which llama3 and how the job feeds it."""

    flavor: str = "debugmodel"
    n_layers: int | None = None
    """Keep the flavor's first ``n_layers`` transformer layers (``None``: all of them)."""
    seq_len: int = 32
    microbatch_size: int = 1
    """Pipeline micro-batch size (``pipeline_parallel_microbatch_size``)."""

    def __post_init__(self) -> None:
        if self.flavor not in llama3_configs:
            raise InvalidConfig(f"unknown llama3 flavor {self.flavor!r}; known: {', '.join(llama3_configs)}")
        if self.n_layers is not None and (isinstance(self.n_layers, bool) or not isinstance(self.n_layers, int) or self.n_layers < 1):
            raise InvalidConfig(f"n_layers must be a positive integer or null, got {self.n_layers!r}")
        for name in ("seq_len", "microbatch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidConfig(f"{name} must be a positive integer, got {value!r}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def model_config(cfg: TitanConfig, parallel: ParallelConfig) -> Any:
    """The llama3 ``Llama3Model.Config`` of ``cfg``, prepared for ``parallel`` as the Trainer prepares it."""
    mc = llama3_configs[cfg.flavor](attn_backend="flex")
    if cfg.n_layers is not None:
        if cfg.n_layers > len(mc.layers):
            raise InvalidConfig(f"llama3 {cfg.flavor} has {len(mc.layers)} layers, n_layers is {cfg.n_layers}")
        mc = dataclasses.replace(mc, layers=list(mc.layers[: cfg.n_layers]))
    attention = mc.layers[0].attention
    n_kv = getattr(attention, "n_kv_heads", None) or attention.n_heads
    if attention.n_heads % parallel.tp or n_kv % parallel.tp:
        raise InvalidConfig(f"tp={parallel.tp} must divide llama3 {cfg.flavor}'s {attention.n_heads} heads and {n_kv} KV heads")
    if len(mc.layers) < parallel.pp:
        raise InvalidConfig(f"{len(mc.layers)} layers cannot fill {parallel.pp} pipeline stages")
    if parallel.zero not in (0, 3):
        raise InvalidConfig(f"the torchtitan job runs zero=3 (FSDP2) or zero=0 (replicated); got zero={parallel.zero}")
    for layer in mc.layers:  # what Decoder.Config.update_from_config does for a Trainer config
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=cfg.seq_len)
    set_llama3_sharding_config(mc, enable_sp=parallelism_config(cfg, parallel).enable_sequence_parallel)
    return mc


def parallelism_config(cfg: TitanConfig, parallel: ParallelConfig) -> ParallelismConfig:
    replicate, shard = (1, parallel.dp) if parallel.zero == 3 else (parallel.dp, 1)
    return ParallelismConfig(
        data_parallel_replicate_degree=replicate,
        data_parallel_shard_degree=shard,
        tensor_parallel_degree=parallel.tp,
        pipeline_parallel_degree=parallel.pp,
        pipeline_parallel_schedule=PIPELINE_SCHEDULE,
        pipeline_parallel_microbatch_size=cfg.microbatch_size,
        spmd_backend=SPMD_BACKEND,
    )


def training_config(cfg: TitanConfig, local_batch_size: int) -> TrainingConfig:
    return TrainingConfig(
        local_batch_size=local_batch_size,
        seq_len=cfg.seq_len,
        dtype="float32",
        mixed_precision_param="float32",
        mixed_precision_reduce="float32",
    )


@dataclass
class TitanStage:
    """This rank's part of the job: its model part, schedule, meshes and loss."""

    cfg: TitanConfig
    parallel: ParallelConfig
    parallel_dims: ParallelDims
    module: nn.Module
    schedule: Any | None
    has_first: bool
    has_last: bool
    loss_fn: Any
    optimizer: torch.optim.Optimizer | None = None

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel coordinate (torchtitan's ``batch`` mesh)."""
        mesh = self.parallel_dims.get_optional_mesh("batch")
        return 0 if mesh is None else mesh.get_local_rank()

    def train_step(self, tokens: torch.Tensor) -> float:
        """Forward, backward and one AdamW step on this data rank's ``(batch, seq+1)`` tokens; the global mean loss."""
        assert self.optimizer is not None
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        batch, seq = inputs.shape
        positions = torch.arange(seq).unsqueeze(0).expand(batch, seq).contiguous()
        masks = self.module.get_attention_masks(positions=positions)
        # torchtitan's normalization: the sum of token losses over the global number of label tokens.
        global_tokens = torch.tensor(float(labels.numel() * self.parallel.dp))
        self.optimizer.zero_grad(set_to_none=True)
        if self.schedule is None:
            pred = self.module(inputs, positions=positions, attention_masks=masks)
            loss, _ = self.loss_fn(pred, labels, global_tokens)
            loss.backward()
            local = loss.detach()
        else:
            losses: list[torch.Tensor] | None = [] if self.has_last else None
            args = (inputs,) if self.has_first else ()
            self.schedule.step(
                *args,
                target=labels if self.has_last else None,
                losses=losses,
                loss_kwargs={"global_valid_tokens": global_tokens},
                return_outputs=False,
                positions=positions,
                attention_masks=masks,
            )
            local = torch.stack(losses).sum() if losses else torch.zeros(())
        self.optimizer.step()
        return self._global_loss(local)

    def _global_loss(self, local: torch.Tensor) -> float:
        out = local.detach().float().reshape(1).clone()
        batch = self.parallel_dims.get_optional_mesh("batch")
        if batch is not None:
            dist.all_reduce(out, group=batch.get_group())
        if self.parallel.pp > 1:
            pp_group = self.parallel_dims.get_mesh("pp").get_group()
            dist.broadcast(out, src=dist.get_global_rank(pp_group, self.parallel.pp - 1), group=pp_group)
        return float(out.item())


def build_stage(
    cfg: TitanConfig,
    parallel: ParallelConfig,
    *,
    local_batch_size: int,
    device: torch.device | str = "cpu",
    seed: int = 0,
    lr: float = 1e-3,
) -> TitanStage:
    """This rank's stage, parallelized by torchtitan on the initialized default process group.

    On ``device="meta"`` nothing is materialized (the layout provider's use);
    otherwise the parameters are materialized and initialized by torchtitan
    from ``seed``, FSDP2 is told to reduce with sums on CPU, and AdamW is built.

    A worker that restores runs this too: the model is built on ``meta`` and
    materialized with ``to_empty`` either way (no values drawn before), and
    ``init_weights`` stays because it is torchtitan's one public way to set the
    RoPE cache, a buffer no restore sets; the parameters it initializes in the
    same pass (drawn shard by shard; torchtitan debugmodel-sized here) are then
    overwritten.
    """
    device = torch.device(device)
    set_spmd_backend(SPMD_BACKEND)
    mc = model_config(cfg, parallel)
    par = parallelism_config(cfg, parallel)
    training = training_config(cfg, local_batch_size)
    parallel_dims = ParallelDims.from_config(par, parallel.world_size)
    parallel_dims.build_mesh()
    loss_fn = CrossEntropyLoss.Config().build(compile_config=CompileConfig())
    with torch.device("meta"):
        model = mc.build()
    common = {
        "parallel_dims": parallel_dims,
        "training": training,
        "parallelism": par,
        "compile_config": CompileConfig(),
        "ac_config": None,
        "dump_folder": "",
    }
    if parallel.pp > 1:
        schedule, parts, has_first, has_last = pipeline_llm(
            model, device=device, model_config=mc, parallelize_fn=parallelize_llama, loss_fn=loss_fn, **common
        )
        if len(parts) != 1:
            raise InvalidConfig(f"the {PIPELINE_SCHEDULE} schedule should give one model part per rank, got {len(parts)}")
        module = parts[0]
    else:
        schedule, has_first, has_last = None, True, True
        module = parallelize_llama(model, **common)
    stage = TitanStage(cfg, parallel, parallel_dims, module, schedule, has_first, has_last, loss_fn)
    if device.type == "meta":
        return stage
    module.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        module.init_weights(buffer_device=None)
    module.train()
    if device.type == "cpu" and cpu.cpu_only():
        cpu.force_sum_reductions(module)
    stage.optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0)
    return stage


def meta_stage(cfg: TitanConfig, stage: int, parallel: ParallelConfig) -> nn.Module:
    """Pipeline stage ``stage`` on meta for the layout provider (called inside its fake process group)."""
    return build_stage(cfg, parallel, local_batch_size=parallel.pp * cfg.microbatch_size, device="meta").module


def titan_ptc(
    cfg: TitanConfig,
    parallel: ParallelConfig,
    placement: Placement,
    *,
    dataset: DatasetState | None = None,
    optimizer: str = "adamw",
) -> PTC:
    """The PTC of the torchtitan job (parameters and AdamW state) in configuration ``parallel``."""
    model_config(cfg, parallel)  # clear errors before the fake process group
    return derive_ptc_from_stages(
        partial(meta_stage, cfg),
        parallel,
        placement,
        optimizer=optimizer,
        dataset=dataset,
        model={"name": "examples.torchtitan", "library": "torchtitan==0.3.0", **cfg.to_json()},
        mesh_roles=MESH_ROLES,
    )


@layout_provider(TitanConfig)
def example_torchtitan_layout(cfg: TitanConfig, parallel: ParallelConfig, placement: Placement,
                              dataset: DatasetState | None, precision: str) -> PTC:
    """The ``example-torchtitan`` layout provider (the job trains in fp32)."""
    return titan_ptc(cfg, parallel, placement, dataset=dataset)
