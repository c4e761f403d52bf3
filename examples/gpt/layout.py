"""The reference GPT's PTC, derived from its own model and parallelize code.

The scheduler (through the layout provider :data:`example_gpt_layout`, registered
as ``example-gpt`` by the ``tenplex-examples`` distribution) and the tests call
:func:`gpt_ptc` for any configuration; it hands :func:`examples.gpt.parallelize.parallelize` and a meta-device stage
builder to :func:`tenplex.ptc.torch_layout.derive_ptc`, so the PTC is what
the live job holds, by construction (and the gloo tests check it).
"""

from __future__ import annotations

import dataclasses
from functools import partial

from examples.gpt.model import GPT, GPTConfig
from examples.gpt.parallelize import check_supported, parallelize, pipeline_stage_module
from tenplex.ptc import PTC, DatasetState, ParallelConfig, Placement
from tenplex.ptc.provider import layout_provider
from tenplex.ptc.torch_layout import derive_ptc


def meta_stage(cfg: GPTConfig, parallel: ParallelConfig, stage: int, num_stages: int) -> GPT:
    """Pipeline stage ``stage`` on the caller's default device (``meta`` inside ``derive_ptc``)."""
    layers = parallel.stage_layers(cfg.n_layers)[stage]
    return pipeline_stage_module(GPT(cfg, layer_ids=layers), stage, num_stages, parallel)


def gpt_ptc(
    cfg: GPTConfig,
    parallel: ParallelConfig,
    placement: Placement,
    *,
    dataset: DatasetState | None = None,
    optimizer: str = "adamw",
) -> PTC:
    """The PTC of the reference GPT job (parameters and AdamW state) in configuration ``parallel``."""
    check_supported(cfg, parallel)
    return derive_ptc(
        partial(meta_stage, cfg, parallel),
        parallelize,
        parallel,
        placement,
        optimizer=optimizer,
        dataset=dataset,
        model={"name": "examples.gpt", **dataclasses.asdict(cfg)},
    )


@layout_provider(GPTConfig)
def example_gpt_layout(cfg: GPTConfig, parallel: ParallelConfig, placement: Placement, dataset: DatasetState | None,
                       precision: str) -> PTC:
    """The ``example-gpt`` layout provider: the job trains in fp32 whatever the spec's precision says."""
    return gpt_ptc(cfg, parallel, placement, dataset=dataset)
