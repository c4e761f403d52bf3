"""Benchmark: how long the PyTorch-derived layout provider takes, against the rule-based one.

``tenplex.ptc.torch_layout.derive_ptc`` runs the job's own model and
parallelize code on the meta device under a fake process group, once per
pipeline stage, then turns the DTensor placements into shards. The scheduler
calls it for every reconfiguration of a PyTorch-native job, so its cost
matters. The baseline, measured in the same run, is the rule-based
Megatron provider (``megatron_gpt_ptc``, fp32) for the same dimensions and
parallel configuration: the same question answered from rules instead of by
running torch. (The two layouts are not identical: Megatron fuses QKV and pads
the vocabulary; the tensor counts are printed.)

Reported per case: median wall time of the derivation, the median of its
first phase alone (reading the stages: meta build + TP/DP, torch's own work;
the rest is turning placements into shards and validating the PTC), the number of tensors and shards, the JSON size, and the ratio to the
rule-based provider. No target is set by an issue; the numbers tell the
scheduler what to expect.

    .venv/bin/python benchmarks/torch_layout_build.py [--runs 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: examples/

from examples.gpt.layout import meta_stage  # noqa: E402
from examples.gpt.model import GPTConfig  # noqa: E402
from examples.gpt.parallelize import parallelize  # noqa: E402
from tenplex.ptc import ParallelConfig, Placement  # noqa: E402
from tenplex.ptc.megatron import GPTSpec, megatron_gpt_ptc  # noqa: E402
from tenplex.ptc.torch_layout import derive_ptc, read_stage_layouts  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ptc_build import median_time  # noqa: E402  (the sibling benchmark; one timing helper)


@dataclass(frozen=True)
class Case:
    label: str
    cfg: GPTConfig
    parallel: ParallelConfig
    gpus_per_node: int


CASES = [
    Case("test-size GPT, dp2 tp2 pp2 zero3 (8 GPUs)",
         GPTConfig(vocab=66, dim=32, n_layers=4, n_heads=4, ffn_dim=48, seq_len=16),
         ParallelConfig(dp=2, tp=2, pp=2, zero=3), 4),
    Case("GPT 1.3B, dp4 tp4 pp2 zero3 (32 GPUs)",
         GPTConfig(vocab=50304, dim=2048, n_layers=24, n_heads=16, seq_len=2048),
         ParallelConfig(dp=4, tp=4, pp=2, zero=3), 8),
    Case("GPT-3 175B, dp8 tp8 pp16 zero0 (1024 GPUs)",
         GPTConfig(vocab=51200, dim=12288, n_layers=96, n_heads=96, seq_len=2048),
         ParallelConfig(dp=8, tp=8, pp=16, zero=0), 8),
    Case("GPT-3 175B, dp8 tp8 pp16 zero3 (1024 GPUs)",
         GPTConfig(vocab=51200, dim=12288, n_layers=96, n_heads=96, seq_len=2048),
         ParallelConfig(dp=8, tp=8, pp=16, zero=3), 8),
]


def run_case(case: Case, runs: int) -> dict[str, Any]:
    placement = Placement.uniform(case.parallel.world_size, case.gpus_per_node)
    build = partial(meta_stage, case.cfg, case.parallel)
    t_derive, ptc = median_time(lambda: derive_ptc(build, parallelize, case.parallel, placement), runs)
    t_read, _ = median_time(lambda: read_stage_layouts(build, parallelize, case.parallel), runs)
    spec = GPTSpec(num_layers=case.cfg.n_layers, hidden=case.cfg.dim, heads=case.cfg.n_heads, vocab=case.cfg.vocab,
                   ffn_hidden=case.cfg.hidden_ffn, seq_len=case.cfg.seq_len, bias=False, make_vocab_size_divisible_by=1)
    t_rule, rule = median_time(
        lambda: megatron_gpt_ptc(spec, case.parallel, gpus_per_node=case.gpus_per_node, precision="fp32"), runs
    )
    return {
        "case": case.label,
        "derive_s": t_derive,
        "read_stages_s": t_read,
        "tensors": len(ptc.tensors),
        "shards": sum(len(t.shards) for t in ptc.tensors),
        "json_mb": len(ptc.dumps()) / 1e6,
        "rule_s": t_rule,
        "rule_tensors": len(rule.tensors),
        "ratio": t_derive / t_rule,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="skip the 1024-GPU cases")
    args = p.parse_args(argv)
    cases = CASES[:2] if args.quick else CASES
    print(f"# torch_layout_build  {datetime.now(UTC):%Y-%m-%d %H:%M} UTC  nproc={os.cpu_count()}  "
          f"python {platform.python_version()}  load {os.getloadavg()[0]:.1f}")
    print("| case | derive (median) | meta build + TP/DP alone (read_stage_layouts, own median) | tensors | shards | JSON | rule-based (Megatron provider) | derived / rule-based |")
    print("|---|---|---|---|---|---|---|---|")
    for case in cases:
        r = run_case(case, args.runs)
        print(f"| {r['case']} | {r['derive_s']:.3f} s | {r['read_stages_s']:.3f} s | {r['tensors']} | {r['shards']} | "
              f"{r['json_mb']:.2f} MB | {r['rule_s']:.3f} s ({r['rule_tensors']} tensors) | {r['ratio']:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
