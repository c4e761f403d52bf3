"""A tiny random Hugging Face ``LlamaForCausalLM``, parallelized by transformers itself for a Tenplex configuration.

The model is built from a ``LlamaConfig`` in code (no download) and
initialized by transformers from a seed on CPU, so every configuration starts
from the same values. :func:`build_stage` hands it to transformers' own
distribution path, the one ``from_pretrained(..., distributed_config=...)``
takes: ``prepare_distribute_model`` builds the device mesh
(``initialize_distributed_mesh``: ``pp, dp_replicate, fsdp, tp``) and
``maybe_distribute_model`` applies the model's TP plan (``tp_plan="auto"``,
``base_model_tp_plan``) and then FSDP2 (``fsdp_size`` = dp with ``zero=3``; with
``zero=0`` the dp ranks are FSDP2 replicas, ``dp_replicate_size`` = dp). The
values are kept (it distributes the initialized weights). Training is
``model(input_ids, labels=...)`` (transformers' mean cross entropy) and AdamW.

Parameter names are ``named_parameters()`` of the model, which are also its
checkpoint keys (``save_pretrained`` / safetensors; a tied ``lm_head.weight``
is stored once, under ``model.embed_tokens.weight``, as here).
transformers' pipeline parallelism is not used: ``pp`` must be 1.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import partial
from typing import Any

# The model is built from a config in code: nothing is needed from the Hugging Face Hub. Without this,
# transformers' tensor-parallel path tries to reach the Hub and, with no network, waits for minutes.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

from tenplex.errors import InvalidConfig  # noqa: E402
from tenplex.ptc import PTC, DatasetState, ParallelConfig, Placement  # noqa: E402
from tenplex.ptc.provider import layout_provider  # noqa: E402
from tenplex.ptc.torch_layout import TRANSFORMERS_MESH_ROLES, derive_ptc_from_stages  # noqa: E402
from tenplex.worker.state import materialize  # noqa: E402

MESH_ROLES = {name: role.value for name, role in TRANSFORMERS_MESH_ROLES.items()}
"""transformers 5.x's mesh names (``pp, dp_replicate, fsdp, tp``; ``efsdp``/``ep`` refused)."""


@dataclass(frozen=True)
class HFConfig:
    """The ``LlamaConfig`` fields the job sets (everything else is transformers' default)."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    seq_len: int = 32
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "tie_word_embeddings":
                if not isinstance(value, bool):
                    raise InvalidConfig(f"tie_word_embeddings must be true or false, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidConfig(f"{f.name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise InvalidConfig("num_attention_heads must divide hidden_size, num_key_value_heads num_attention_heads")

    def llama(self) -> LlamaConfig:
        lc = LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.seq_len,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        lc._attn_implementation = "sdpa"
        return lc

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def distributed_config(cfg: HFConfig, parallel: ParallelConfig) -> DistributedConfig:
    if parallel.pp != 1:
        raise InvalidConfig(f"the Hugging Face job runs dp and tp only; {parallel.describe()} has pp={parallel.pp}")
    if parallel.zero not in (0, 3):
        raise InvalidConfig(f"the Hugging Face job runs zero=3 (FSDP2) or zero=0 (replicas); got zero={parallel.zero}")
    for name in ("num_attention_heads", "num_key_value_heads"):
        if getattr(cfg, name) % parallel.tp:
            raise InvalidConfig(f"tp={parallel.tp} must divide {name}={getattr(cfg, name)}")
    replicate, shard = (1, parallel.dp) if parallel.zero == 3 else (parallel.dp, 1)
    return DistributedConfig(
        tp_size=parallel.tp,
        tp_plan="auto" if parallel.tp > 1 else None,
        fsdp_size=shard,
        dp_replicate_size=replicate,
        pp_size=1,
    )


@dataclass
class HFStage:
    cfg: HFConfig
    parallel: ParallelConfig
    module: nn.Module
    mesh: Any | None
    """transformers' ``TransformersDeviceMesh`` (``None`` on one device)."""
    optimizer: torch.optim.Optimizer | None = None

    def _local_rank(self, dim: str) -> int:
        if self.mesh is None:
            return 0
        return self.mesh.get_mesh(dim).get_local_rank()

    @property
    def dp_rank(self) -> int:
        fsdp = 1 if self.mesh is None else self.mesh.get_mesh("fsdp").size()
        return self._local_rank("dp_replicate") * fsdp + self._local_rank("fsdp")

    def train_step(self, tokens: torch.Tensor) -> float:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        out = self.module(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
        out.loss.backward()
        self.optimizer.step()
        loss = out.loss.detach().float().reshape(1).clone()
        if self.parallel.dp > 1:  # every dp rank's mean over its own tokens; the batches are the same size
            assert self.mesh is not None
            dist.all_reduce(loss, group=self.mesh.get_mesh(("dp_replicate", "fsdp"))._flatten().get_group())
            loss /= self.parallel.dp
        return float(loss.item())


def build_stage(
    cfg: HFConfig,
    parallel: ParallelConfig,
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
    lr: float = 1e-3,
    init_values: bool = True,
) -> HFStage:
    """The model as transformers distributes it on the initialized default process group (``meta``: not materialized).

    ``init_values=False`` (a worker that restores every value) builds and
    distributes it on ``meta`` and allocates it on ``device`` without values
    (:func:`tenplex.worker.state.materialize`); the rotary embedding's
    ``inv_freq`` buffers, which no restore sets, are computed by transformers'
    own ``_init_weights``.
    """
    dc, _, mesh = LlamaForCausalLM.prepare_distribute_model(distributed_config(cfg, parallel))
    torch.manual_seed(seed)
    build_on = device if init_values else "meta"
    with torch.device(build_on):
        model = LlamaForCausalLM(cfg.llama())
    model = LlamaForCausalLM.maybe_distribute_model(model, dc, mesh)
    stage = HFStage(cfg, parallel, model, mesh)
    if torch.device(device).type == "meta":
        return stage
    if not init_values:
        materialize(model, device, init_buffers=_init_buffers)
    model.train()
    if not torch.cuda.is_available():  # gloo has no PREMUL_SUM (CPU only)
        from tenplex.integrations.torchtitan.cpu import force_sum_reductions

        force_sum_reductions(model)
    stage.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    return stage


def _init_buffers(model: nn.Module) -> None:
    """Set the buffers of a model materialized without values: transformers' initialisation of each module that
    owns buffers (the rotary embeddings' ``inv_freq``; their parameters, if any, are restored afterwards)."""
    init_module = model._init_weights  # the PreTrainedModel hook that also sets rotary buffers
    for module in model.modules():
        if next(module.buffers(recurse=False), None) is not None:
            init_module(module)


def meta_stage(cfg: HFConfig, stage: int, parallel: ParallelConfig) -> nn.Module:
    return build_stage(cfg, parallel, device="meta").module


def hf_ptc(
    cfg: HFConfig,
    parallel: ParallelConfig,
    placement: Placement,
    *,
    dataset: DatasetState | None = None,
    optimizer: str = "adamw",
) -> PTC:
    """The PTC of the Hugging Face job (parameters and AdamW state) in configuration ``parallel``."""
    distributed_config(cfg, parallel)  # clear errors before the fake process group
    return derive_ptc_from_stages(
        partial(meta_stage, cfg),
        parallel,
        placement,
        optimizer=optimizer,
        dataset=dataset,
        model={"name": "examples.hf", "library": "transformers==5.24.0", **cfg.to_json()},
        mesh_roles=MESH_ROLES,
    )


@layout_provider(HFConfig)
def example_hf_layout(cfg: HFConfig, parallel: ParallelConfig, placement: Placement, dataset: DatasetState | None,
                      precision: str) -> PTC:
    """The ``example-hf`` layout provider (the job trains in fp32)."""
    return hf_ptc(cfg, parallel, placement, dataset=dataset)
