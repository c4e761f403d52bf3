"""Benchmark: build, validate, serialize and load the PTC of GPT-3 175B.

The layout is the one of issue 2: 96 layers, hidden 12288, 96 heads, vocab 51200,
bf16 with ZeRO-1 (distributed optimizer) at tp8 x pp16 x dp8 = 1024 devices,
8 per node. The scheduler computes such a layout for every reconfiguration
before the new workers start, so it must be cheap.

Targets (this machine): build + validate <= 1 s, JSON <= 20 MB.

Baselines measured in the same run: ``json.loads`` of the PTC's own JSON text
(the least any reader of the layout pays) and ``json.dumps`` of its prebuilt
dictionary (the least any writer pays); the ratios say how much the PTC work
costs on top of plain JSON handling.

    .venv/bin/python benchmarks/ptc_build.py [--runs 7] [--zero 1] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from tenplex.ptc import PTC, ParallelConfig
from tenplex.ptc.megatron import GPTSpec, megatron_gpt_ptc

BUILD_TARGET_S = 1.0
JSON_TARGET_MB = 20.0

GPT3_175B = GPTSpec(num_layers=96, hidden=12288, heads=96, vocab=51200)


def median_time(fn: Callable[[], Any], runs: int) -> tuple[float, Any]:
    """Median wall time of ``runs`` calls (after one warm-up) and the last result."""
    result = fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs per measurement (median; default 7)")
    parser.add_argument("--zero", type=int, default=1, choices=range(4), help="ZeRO stage (default 1, the target)")
    parser.add_argument("--out", help="also write the numbers as JSON to this file")
    args = parser.parse_args(argv)

    parallel = ParallelConfig(dp=8, tp=8, pp=16, zero=args.zero)
    print(f"GPT-3 175B, {parallel.describe()}, bf16, 8 GPUs per node; {args.runs} runs, medians", flush=True)

    def build() -> PTC:
        return megatron_gpt_ptc(GPT3_175B, parallel, gpus_per_node=8, precision="bf16")

    build_s, ptc = median_time(build, args.runs)
    validate_s, _ = median_time(lambda: PTC(ptc.config, ptc.devices, ptc.tensors, ptc.dataset), args.runs)
    serialize_s, text = median_time(ptc.dumps, args.runs)
    load_s, loaded = median_time(lambda: PTC.loads(text), args.runs)
    assert loaded.to_json() == ptc.to_json(), "the JSON round trip changed the layout"
    obj = ptc.to_json()
    dumps_s, _ = median_time(lambda: json.dumps(obj, separators=(",", ":")), args.runs)
    loads_s, _ = median_time(lambda: json.loads(text), args.runs)

    shards = sum(len(t.shards) for t in ptc.tensors)
    size_mb = len(text.encode()) / 1e6
    results = {
        "layout": f"GPT-3 175B {parallel.describe()} bf16",
        "devices": len(ptc.devices),
        "hosts": len(ptc.hosts),
        "tensors": len(ptc.tensors),
        "shards": shards,
        "build_validate_s": build_s,
        "validate_only_s": validate_s,
        "shards_per_s": shards / build_s,
        "json_mb": size_mb,
        "serialize_s": serialize_s,
        "load_s": load_s,
        "baseline_json_dumps_s": dumps_s,
        "baseline_json_loads_s": loads_s,
        "build_vs_json_loads": build_s / loads_s,
        "serialize_vs_json_dumps": serialize_s / dumps_s,
        "load_vs_json_loads": load_s / loads_s,
        "build_target_pass": build_s <= BUILD_TARGET_S,
        "json_target_pass": size_mb <= JSON_TARGET_MB,
        "machine": f"{platform.machine()}, nproc {os.cpu_count()}, Python {platform.python_version()}",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    print(f"{len(ptc.tensors)} tensors, {shards} shards, {len(ptc.devices)} devices on {len(ptc.hosts)} hosts")
    print(f"build + validate   {build_s:7.3f} s   target <= {BUILD_TARGET_S} s   {verdict(results['build_target_pass'])}"
          f"   ({shards / build_s:,.0f} shards/s; validation alone {validate_s:.3f} s)")
    print(f"JSON size          {size_mb:7.2f} MB  target <= {JSON_TARGET_MB} MB  {verdict(results['json_target_pass'])}")
    print(f"serialize          {serialize_s:7.3f} s   {serialize_s / dumps_s:.2f}x json.dumps of the same dict ({dumps_s:.3f} s)")
    print(f"load (parse+valid) {load_s:7.3f} s   {load_s / loads_s:.2f}x json.loads of the same text ({loads_s:.3f} s)")
    print(f"build + validate = {build_s / loads_s:.2f}x json.loads of the result")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if results["build_target_pass"] and results["json_target_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
