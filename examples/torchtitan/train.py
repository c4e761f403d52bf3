"""torchtitan's llama3 as an elastic Tenplex job (synthetic token ids; no tokenizer, no data set download).

Under a Tenplex scheduler (what a job spec's ``command`` runs)::

    python -m examples.torchtitan.train --layers 2 --seq-len 32 --samples 4096 --global-batch 8

Standalone, like ``examples/gpt/train.py`` (torchrun sets RANK, WORLD_SIZE, MASTER_*)::

    torchrun --nproc-per-node 2 -m examples.torchtitan.train --dp 2 --steps 6 \
        --job tt --store /tmp/store --snapshot-at 3
    torchrun --nproc-per-node 2 -m examples.torchtitan.train --tp 2 --steps 6 \
        --job tt --store /tmp/store --restore s3-g1 --generation 1 --ptc new.json

The model, TP/FSDP2 and pipeline code are torchtitan's (:mod:`examples.torchtitan.job`);
the CPU-only substitutions are in :mod:`examples.torchtitan.cpu`; the loop is
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
from examples.torchtitan.job import TitanConfig, build_stage, llama3_configs, titan_ptc
from tenplex.ptc import PTC, DatasetState, ParallelConfig, Placement


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train torchtitan's llama3 elastically under Tenplex.")
    p.add_argument("--flavor", default="debugmodel", choices=sorted(llama3_configs))
    p.add_argument("--layers", type=int, default=None, help="keep the flavor's first N transformer layers")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--microbatch-size", type=int, default=1)
    add_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = TitanConfig(flavor=args.flavor, n_layers=args.layers, seq_len=args.seq_len, microbatch_size=args.microbatch_size)

    def build_job(parallel: ParallelConfig, local_batch_size: int, init_values: bool):
        # init_values is not used: see build_stage.
        return build_stage(cfg, parallel, local_batch_size=local_batch_size, seed=args.seed, lr=args.lr)

    vocab = llama3_configs[cfg.flavor](attn_backend="flex").vocab_size
    return elastic_main(args, build_job, partial(_ptc, cfg), vocab=vocab, seq_len=cfg.seq_len)


def _ptc(cfg: TitanConfig, parallel: ParallelConfig, placement: Placement, dataset: DatasetState) -> PTC:
    return titan_ptc(cfg, parallel, placement, dataset=dataset)


if __name__ == "__main__":
    sys.exit(main())
