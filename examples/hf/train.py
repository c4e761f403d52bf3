"""A tiny random Hugging Face LlamaForCausalLM as an elastic Tenplex job (TP plan and FSDP2 by transformers).

Under a Tenplex scheduler (what a job spec's ``command`` runs)::

    python -m examples.hf.train --samples 4096 --global-batch 8

Standalone (torchrun sets RANK, WORLD_SIZE, MASTER_*)::

    torchrun --nproc-per-node 2 -m examples.hf.train --tp 2 --steps 6 --job hf --store /tmp/store --snapshot-at 3

The model and its parallelization are :mod:`examples.hf.job`; the loop is
:func:`examples.elastic.elastic_main`.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.elastic import add_arguments, elastic_main
from examples.hf.job import HFConfig, build_stage, hf_ptc
from tenplex.ptc import PTC, DatasetState, ParallelConfig, Placement


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a tiny random LlamaForCausalLM elastically under Tenplex.")
    defaults = HFConfig()
    p.add_argument("--vocab", type=int, default=defaults.vocab_size)
    p.add_argument("--hidden", type=int, default=defaults.hidden_size)
    p.add_argument("--intermediate", type=int, default=defaults.intermediate_size)
    p.add_argument("--layers", type=int, default=defaults.num_hidden_layers)
    p.add_argument("--heads", type=int, default=defaults.num_attention_heads)
    p.add_argument("--kv-heads", type=int, default=defaults.num_key_value_heads)
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    add_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = HFConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        seq_len=args.seq_len,
    )

    def build_job(parallel: ParallelConfig, local_batch_size: int, init_values: bool):
        return build_stage(cfg, parallel, seed=args.seed, lr=args.lr, init_values=init_values)

    return elastic_main(args, build_job, partial(_ptc, cfg), vocab=cfg.vocab_size, seq_len=cfg.seq_len)


def _ptc(cfg: HFConfig, parallel: ParallelConfig, placement: Placement, dataset: DatasetState) -> PTC:
    return hf_ptc(cfg, parallel, placement, dataset=dataset)


if __name__ == "__main__":
    sys.exit(main())
