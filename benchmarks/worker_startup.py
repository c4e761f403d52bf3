"""A new worker's start-up, piece by piece, outside the scheduler (issue 18: what the downtime's fixed part is made of).

Four measurements, each with real gloo processes on this machine, repeated; medians are printed:

- ``rendezvous``: N ranks forked at once (as a warm standby forks them), rank 0 (which hosts torch's
  ``TCPStore``) arriving ``late`` seconds after the others. Timed: from rank 0's arrival until every
  rank's ``init_process_group`` returned, with torch's own connect (a client that finds nothing listening
  backs off) and with the worker's wait for the port first (:func:`tenplex.worker.session.wait_for_listener`).
- ``reinit``: a surviving process re-initialises its process group for a new generation
  (``destroy_process_group`` + ``init_process_group`` with a new world size, rank and master port, then a
  ``(pp, dp, tp)`` DeviceMesh and a checked all-reduce), against what a fresh process pays before it can
  start its rendezvous (interpreter and ``import torch.distributed``).
- ``build``: the reference GPT's stage (``examples/gpt/train.py`` ``build_job``) for dp1 x tp2 on two ranks,
  with its seeded values (random draws, DTensor's scatter of them) and on the meta device materialized
  without values (what a worker that restores does).
- ``steps``: the first training steps after a restore-like fill of every value, against the steady ones:
  wall time, CPU time and minor page faults per step (rank 0).

Run: .venv/bin/python benchmarks/worker_startup.py [--parts rendezvous reinit build steps] [--repeat 5]
     [--model large|demo] [--json OUT]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODELS = {
    "demo": {"vocab": 64, "dim": 32, "n_layers": 4, "n_heads": 4, "seq_len": 16},
    "large": {"vocab": 8192, "dim": 1024, "n_layers": 6, "n_heads": 8, "seq_len": 16},  # ~1 GB with AdamW
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_DIST_INIT_BARRIER="0",
                      OMP_NUM_THREADS="1")


def _init(rank: int, world: int, port: int, wait: bool) -> None:
    import torch.distributed as dist

    from tenplex.worker.session import wait_for_listener

    _env(port)
    if wait and rank != 0:
        wait_for_listener("127.0.0.1", port, 60.0)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))


# -- rendezvous ---------------------------------------------------------------------------------------------

def _rendezvous_rank(rank: int, world: int, port: int, go: float, late: float, wait: bool, q: Any) -> None:
    import torch.distributed as dist

    while time.time() < go + (late if rank == 0 else 0.0):
        time.sleep(0.0005)
    _init(rank, world, port, wait)
    q.put(time.time())
    dist.destroy_process_group()


def rendezvous(repeat: int) -> list[dict[str, Any]]:
    import torch.distributed  # noqa: F401  (imported before the fork, as in a standby)

    import tenplex.worker.session  # noqa: F401

    ctx = mp.get_context("fork")
    rows = []
    for world in (2, 4):
        for late in (0.0, 0.02, 0.2):
            for wait in (False, True):
                samples = []
                for _ in range(repeat):
                    q = ctx.Queue()
                    port, go = free_port(), time.time() + 0.3
                    procs = [ctx.Process(target=_rendezvous_rank, args=(r, world, port, go, late, wait, q))
                             for r in range(world)]
                    for p in procs:
                        p.start()
                    ready = max(q.get(timeout=120) for _ in procs)
                    for p in procs:
                        p.join()
                    samples.append(ready - (go + late))
                rows.append({"world": world, "rank0_late_s": late, "wait_for_listener": wait,
                             "ready_after_rank0_s": round(statistics.median(samples), 3),
                             "max_s": round(max(samples), 3)})
                print(f"rendezvous world {world} rank 0 late {late:.2f} s, "
                      f"{'waits for the port' if wait else 'torch connect   '}: group up {rows[-1]['ready_after_rank0_s']:.3f} s "
                      f"after rank 0 arrived (max {rows[-1]['max_s']:.3f})", flush=True)
    return rows


# -- re-initialisation --------------------------------------------------------------------------------------

def _generation(rank: int, world: int, port: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    t0 = time.perf_counter()
    _init(rank, world, port, wait=True)
    t1 = time.perf_counter()
    mesh = init_device_mesh("cpu", (1, world // 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    x = torch.ones(1)
    dist.all_reduce(x, group=mesh["tp"].get_group())
    if x.item() != 2:
        raise AssertionError(f"a tp all-reduce after re-initialisation gave {x.item()}, not 2")
    t2 = time.perf_counter()
    dist.destroy_process_group()
    return {"init_s": t1 - t0, "mesh_s": t2 - t1, "destroy_s": time.perf_counter() - t2}


def _survivor(rank: int, plan: list[tuple[int, int, float]], q: Any) -> None:
    out = []
    for gen, (world, port, go) in enumerate(plan):
        while time.time() < go:
            time.sleep(0.0005)
        out.append(_generation(1 - rank if gen % 2 else rank, world, port))  # ranks swap every other generation
    q.put(out)


def _joiner(rank: int, world: int, port: int, go: float, q: Any) -> None:
    while time.time() < go:
        time.sleep(0.0005)
    _generation(rank, world, port)


def reinit(repeat: int) -> dict[str, Any]:
    import torch.distributed  # noqa: F401  (imported before the fork, as in a standby)
    from torch.distributed.device_mesh import init_device_mesh  # noqa: F401

    import tenplex.worker.session  # noqa: F401

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    now = time.time() + 1.0
    plan = [(2 if g % 2 == 0 else 4, free_port(), now + 1.5 * g) for g in range(2 * repeat)]
    procs = [ctx.Process(target=_survivor, args=(r, plan, q)) for r in (0, 1)]
    procs += [ctx.Process(target=_joiner, args=(r, world, port, go, q))
              for world, port, go in plan if world == 4 for r in (2, 3)]
    for p in procs:
        p.start()
    gens = [g for _ in range(2) for g in q.get(timeout=300)]
    for p in procs:
        p.join()
    later = gens[1:]  # a process's first initialisation is not a re-initialisation
    fresh = []
    code = "import torch, torch.distributed; from torch.distributed.device_mesh import init_device_mesh"
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        fresh.append(time.perf_counter() - t)
    out = {key: round(statistics.median(g[key] for g in later), 3) for key in ("init_s", "mesh_s", "destroy_s")}
    out["fresh_interpreter_and_imports_s"] = round(statistics.median(fresh), 3)
    print(f"reinit: destroy {out['destroy_s']:.3f} s + init {out['init_s']:.3f} s + mesh and all-reduce "
          f"{out['mesh_s']:.3f} s in a surviving process; a fresh one first pays "
          f"{out['fresh_interpreter_and_imports_s']:.3f} s of interpreter and imports", flush=True)
    return out


# -- model build and first steps ----------------------------------------------------------------------------

def _job_rank(rank: int, world: int, port: int, part: str, model: dict[str, int], q: Any) -> None:
    import torch
    import torch.distributed as dist

    from examples.gpt.model import GPTConfig
    from examples.gpt.train import SyntheticTokens, build_job
    from tenplex.ptc import DatasetState, ParallelConfig
    from tenplex.worker.state import ensure_optimizer_state, live_pieces

    torch.set_num_threads(1)
    _init(rank, world, port, wait=True)
    cfg, parallel = GPTConfig(**model), ParallelConfig(tp=world)
    out: dict[str, Any] = {}
    if part == "build":
        for values in (True, False, True, False):
            dist.barrier()
            t = time.perf_counter()
            build_job(cfg, parallel, init_values=values)
            out.setdefault("values" if values else "meta", []).append(time.perf_counter() - t)
    else:
        job = build_job(cfg, parallel, init_values=False)
        from examples.gpt.layout import gpt_ptc
        from tenplex.ptc import Placement

        ensure_optimizer_state(job.module, job.optimizer, gpt_ptc(cfg, parallel, Placement.uniform(world, world)),
                               zeros=False)
        gen = torch.Generator().manual_seed(rank)
        with torch.no_grad():  # what a restore leaves: every value written, AdamW one step in
            for piece in live_pieces(job.module, job.optimizer):
                if piece.name.endswith("/step"):
                    piece.local.fill_(1.0)
                elif piece.name.endswith("exp_avg_sq"):
                    piece.local.uniform_(0.0, 1e-6, generator=gen)
                else:
                    piece.local.normal_(0.0, 0.02, generator=gen)
        data = SyntheticTokens(100_000, cfg.seq_len, cfg.vocab)
        order = DatasetState(num_samples=100_000, seed=0, global_batch_size=8)
        dist.barrier()
        steps = []
        for step in range(6):
            tokens = data.batch(order.rank_batch(step, 0, 1))
            r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
            job.train_step(tokens)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            steps.append({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                          "minor_faults": r1.ru_minflt - r0.ru_minflt})
        out["steps"] = steps
    q.put((rank, out))
    dist.destroy_process_group()


def _run_job(part: str, model: dict[str, int]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_job_rank, args=(r, 2, port, part, model, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return res[0]


def build(repeat: int, model: dict[str, int]) -> dict[str, Any]:
    runs = [_run_job("build", model) for _ in range(max(1, repeat // 2))]
    out = {k: round(statistics.median(t for r in runs for t in r[k]), 3) for k in ("values", "meta")}
    print(f"build (dp1 x tp2, rank 0): with values {out['values']:.3f} s, on meta and materialized "
          f"{out['meta']:.3f} s", flush=True)
    return out


def steps(repeat: int, model: dict[str, int]) -> dict[str, Any]:
    runs = [_run_job("steps", model)["steps"] for _ in range(max(1, repeat // 2))]
    first = [r[0] for r in runs]
    steady = [s for r in runs for s in r[2:]]
    out = {f"{which}_{key}": round(statistics.median(s[key] for s in rows), 3)
           for which, rows in (("first", first), ("steady", steady)) for key in ("wall_s", "cpu_s", "minor_faults")}
    print(f"steps (dp1 x tp2, rank 0): first {out['first_wall_s']:.3f} s ({out['first_cpu_s']:.3f} s CPU, "
          f"{out['first_minor_faults']:.0f} page faults), steady {out['steady_wall_s']:.3f} s "
          f"({out['steady_cpu_s']:.3f} s CPU, {out['steady_minor_faults']:.0f} page faults)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=("rendezvous", "reinit", "build", "steps"),
                    default=["rendezvous", "reinit", "build", "steps"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--model", choices=sorted(MODELS), default="large")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    results: dict[str, Any] = {"model": args.model}
    if "rendezvous" in args.parts:
        results["rendezvous"] = rendezvous(args.repeat)
    if "reinit" in args.parts:
        results["reinit"] = reinit(args.repeat)
    if "build" in args.parts:
        results["build"] = build(args.repeat, MODELS[args.model])
    if "steps" in args.parts:
        results["steps"] = steps(args.repeat, MODELS[args.model])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
