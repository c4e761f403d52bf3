"""DCP export and import of a version, against DCP's own save and load of the same tensors held in memory.

A state of ``--mb`` MiB (bf16 and fp32 matrices, tp2 x dp2 on two hosts' local stores, every shard on
both hosts) is written as a version; then, each ``--runs`` times (medians reported):

- baseline save: ``dcp.save`` of the whole tensors from memory (DCP's writer alone, nothing to read);
- export: ``export_dcp`` from the stores (each shard read once from one holder, saved as a chunk; 2 writer
  threads, the CLI default);
- baseline load: ``dcp.load`` of the export into whole plain tensors;
- import: ``import_dcp`` into another layout (columns instead of rows, 3 hosts), written and committed.

Usage: ``.venv/bin/python benchmarks/dcp_roundtrip.py [--mb 512] [--runs 3]``. No issue sets a target;
the numbers say what an export or import costs next to DCP itself.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from tenplex.interop.dcp import export_dcp, import_dcp
from tenplex.ptc import PTC, Device, Region, TensorKind, build_tensor
from tenplex.store.local import LocalStore


def layout(shapes: dict[str, tuple[tuple[int, int], str]], hosts: int, by_rows: bool) -> PTC:
    devices = tuple(Device(i, f"h{i // 2}", {"tp": i % 2}) for i in range(2 * hosts))
    tensors = []
    for name, (shape, dtype) in shapes.items():
        halves = Region.full(shape).split(0 if by_rows else 1, 2)
        tensors.append(build_tensor(name, shape, dtype, TensorKind.PARAM,
                                    [(r, tuple(d for d in range(2 * hosts) if d % 2 == i)) for i, r in enumerate(halves)]))
    return PTC({"tp": 2, "dp": hosts}, devices, tuple(tensors))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows = 2048
    per = 4 << 20  # 4 MiB tensors of 2048 x 512 fp32 / 2048 x 1024 bf16
    n = max(2, (args.mb << 20) // per)
    shapes = {f"layers.{i}.w": ((rows, 512), "float32") if i % 2 else ((rows, 1024), "bfloat16") for i in range(n)}
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=gen).to(getattr(torch, d)) for k, (s, d) in shapes.items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    src, dst = layout(shapes, 2, True), layout(shapes, 3, False)
    tmp = Path(tempfile.mkdtemp(prefix="tenplex-dcp-bench-"))
    try:
        stores = {h: LocalStore(tmp / "src" / h) for h in src.hosts}
        for h in src.hosts:
            for t, s in src.shards_on_host(h):
                stores[h].write_shard("j", "s1-g0", t.name, s.region, state[t.name][s.region.slices()].contiguous(),
                                      dtype=t.dtype, global_shape=t.shape)
            stores[h].commit("j", "s1-g0")
        times: dict[str, list[float]] = {k: [] for k in ("baseline save", "export", "baseline load", "import")}
        for run in range(args.runs):
            base, out = tmp / f"base{run}", tmp / f"out{run}"
            os.sync()  # each phase starts without the previous one's dirty pages being written back under it
            t0 = time.perf_counter()
            dcp.save(state, checkpoint_id=base, no_dist=True)
            times["baseline save"].append(time.perf_counter() - t0)
            os.sync()
            t0 = time.perf_counter()
            export_dcp("j", "s1-g0", src, stores, out, threads=2)  # the CLI default
            times["export"].append(time.perf_counter() - t0)
            back = {k: torch.empty_like(v) for k, v in state.items()}
            os.sync()
            t0 = time.perf_counter()
            dcp.load(back, checkpoint_id=out, no_dist=True)
            times["baseline load"].append(time.perf_counter() - t0)
            assert all(torch.equal(back[k].view(torch.int16 if v.element_size() == 2 else torch.int32),
                                   v.view(torch.int16 if v.element_size() == 2 else torch.int32)) for k, v in state.items())
            targets = {h: LocalStore(tmp / f"dst{run}" / h) for h in dst.hosts}
            os.sync()
            t0 = time.perf_counter()
            import_dcp(out, dst, "j", "s1-g0", targets)
            times["import"].append(time.perf_counter() - t0)
            shutil.rmtree(base)
            shutil.rmtree(tmp / f"dst{run}")
        print(f"state {nbytes / 2**20:.0f} MiB in {len(state)} tensors; medians of {args.runs} runs")
        for k, v in times.items():
            m = statistics.median(v)
            ref = statistics.median(times["baseline load" if k in ("baseline load", "import") else "baseline save"])
            print(f"{k:14s} {m:7.3f} s  {nbytes / m / 1e9:6.2f} GB/s of state  ({m / ref:.2f}x its baseline)")
        print(f"(import writes every shard to each of the {len(dst.hosts)} hosts holding it: "
              f"{3 * nbytes / 2**20:.0f} MiB written, committed)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
