"""Planning time at GPT-3 175B scale (target: <= 1 s per plan; network / lower bound = 1.000).

Scenarios, both from tp8 x pp16 x dp8 (1024 GPUs, 128 hosts of 8):
  scale-down: to tp8 x pp12 x dp8 (768 GPUs, the first 96 hosts);
  host loss:  node-3 and node-77 fail; to tp8 x pp16 x dp7 (896 GPUs) on the first 112 survivors.

The PTCs are built by the Megatron layout provider before timing (the scheduler
builds them anyway); the timed part is make_plan, lower bound and checks included.

Run: .venv/bin/python benchmarks/plan_scale.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from tenplex.ptc import ParallelConfig
from tenplex.ptc.megatron import GPTSpec, megatron_gpt_ptc
from tenplex.transformer.plan import make_plan, plan_summary

GPT3_175B = GPTSpec(num_layers=96, hidden=12288, heads=96, vocab=50257, seq_len=2048)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per scenario (median reported)")
    args = parser.parse_args()

    hosts = [f"node-{i}" for i in range(128)]
    old = megatron_gpt_ptc(GPT3_175B, ParallelConfig(dp=8, tp=8, pp=16), hosts=hosts)
    dead = {"node-3", "node-77"}
    survivors = [h for h in hosts if h not in dead]
    scenarios = {
        "scale-down pp16->pp12 (1024->768 GPUs)": (
            megatron_gpt_ptc(GPT3_175B, ParallelConfig(dp=8, tp=8, pp=12), hosts=hosts[:96]),
            None,
        ),
        "loss of 2 hosts, dp8->dp7 (1024->896 GPUs)": (
            megatron_gpt_ptc(GPT3_175B, ParallelConfig(dp=7, tp=8, pp=16), hosts=survivors[:112]),
            set(survivors),
        ),
    }
    print(f"machine: nproc={os.cpu_count()}; model GPT-3 175B, {len(old.tensors)} tensors, "
          f"{sum(len(t.shards) for t in old.tensors)} old shards, {old.total_bytes / 2**40:.2f} TiB of state")
    for name, (new, alive) in scenarios.items():
        times = []
        plan = None
        for _ in range(args.repeat):
            start = time.perf_counter()
            plan = make_plan(old, new, job="gpt3", old_version="s100-g0", new_version="s100-g1", alive=alive)
            times.append(time.perf_counter() - start)
        assert plan is not None
        s = plan_summary(plan)
        ratio = s["network_bytes"] / s["lower_bound_bytes"]
        print(
            f"{name}: plan median {statistics.median(times):.3f} s (min {min(times):.3f}, max {max(times):.3f}, "
            f"n={len(times)}); {s['transfers']} transfers to {s['hosts']} hosts; network "
            f"{s['network_bytes'] / 2**30:.1f} GiB, lower bound {s['lower_bound_bytes'] / 2**30:.1f} GiB, "
            f"ratio {ratio:.3f}; local {s['local_bytes'] / 2**30:.1f} GiB; max send "
            f"{s['max_send_bytes'] / 2**30:.2f} GiB, max receive {s['max_receive_bytes'] / 2**30:.2f} GiB"
        )


if __name__ == "__main__":
    main()
