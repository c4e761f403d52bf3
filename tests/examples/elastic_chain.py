"""Run an example job of another library through a chain of layouts, as the scheduler would, and check it.

Each generation is one process per rank (gloo, real store daemons per emulated
host). Between generations the state transformer turns the last snapshot
(layout A, on A's hosts' stores) into the next layout's version, exactly as
the scheduler's transfer stage does (``make_plan`` + ``execute_host_plan``).
An uninterrupted run in the first layout is the baseline.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tenplex.core.version import Version
from tenplex.ptc import PTC, DatasetState, ParallelConfig, Placement
from tenplex.sockets import free_port
from tenplex.store.client import StoreClient
from tenplex.store.server import StoreServer
from tenplex.transformer import make_plan
from tenplex.transformer.execute import execute_host_plan
from tests.ranks import rank_env, run_rank_processes

GPUS_PER_NODE = 2
LayoutFn = Callable[[ParallelConfig, Placement, DatasetState], PTC]


def placement(parallel: ParallelConfig) -> Placement:
    return Placement.uniform(parallel.world_size, GPUS_PER_NODE)


def run_ranks(module: str, job_args: list[str], parallel: ParallelConfig, ptc: PTC, job: str, generation: int,
              stores: dict[str, StoreServer], out: Path, steps: int, *, restore: Version | None = None,
              snapshot_at: int | None = None) -> list[dict]:
    """One process per rank of ``parallel``; each rank's results (losses, samples, seconds, dumped states)."""
    out.mkdir(parents=True, exist_ok=True)
    ptc.save(out / "ptc.json")
    port = free_port()
    argvs = []
    for rank in range(parallel.world_size):
        args = [sys.executable, "-m", module, *job_args,
                "--dp", str(parallel.dp), "--tp", str(parallel.tp), "--pp", str(parallel.pp), "--zero", str(parallel.zero),
                "--steps", str(steps), "--job", job, "--generation", str(generation), "--ptc", str(out / "ptc.json"),
                "--store", stores[ptc.device(rank).host].url, "--results", str(out / f"r{rank}.json")]
        if restore is not None:
            args += ["--restore", str(restore)]
        if snapshot_at is not None:
            args += ["--snapshot-at", str(snapshot_at)]
        argvs.append(args)
    world = parallel.world_size
    run_rank_processes(argvs, [rank_env(r, world, port, GPUS_PER_NODE) for r in range(world)],
                       [out / f"r{r}.log" for r in range(world)], what=f"ranks of {parallel.describe()}")
    return [{**json.loads((out / f"r{r}.json").read_text()), "path": str(out / f"r{r}.json")}
            for r in range(parallel.world_size)]


def load_state(result: dict, key: str) -> dict[str, dict]:
    return torch.load(f"{result['path']}.{key}.pt", weights_only=True)


def assemble(results: list[dict], key: str) -> dict[str, np.ndarray]:
    """Whole tensors from every rank's dumped pieces (as raw bytes: bit-exact comparisons)."""
    full: dict[str, np.ndarray] = {}
    for res in results:
        for name, piece in load_state(res, key).items():
            raw = _raw(piece["tensor"])
            arr = full.setdefault(name, np.zeros(piece["global_shape"], dtype=raw.dtype))
            arr[tuple(slice(a, b) for a, b in piece["region"])] = raw
    return full


def _raw(t: torch.Tensor) -> np.ndarray:
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


def assert_restored_equals_snapshot(snapshot_ranks: list[dict], snapshot_key: str, restored_ranks: list[dict]) -> int:
    """Every tensor every rank restored equals the snapshot bit for bit; returns the number of pieces compared."""
    snapped = assemble(snapshot_ranks, snapshot_key)
    names: set[str] = set()
    count = 0
    for res in restored_ranks:
        for name, piece in load_state(res, "restored").items():
            raw = _raw(piece["tensor"])
            want = snapped[name][tuple(slice(a, b) for a, b in piece["region"])]
            assert raw.tobytes() == np.ascontiguousarray(want).tobytes(), (name, piece["region"])
            names.add(name)
            count += 1
    assert names == set(snapped), set(snapped) ^ names
    return count


def global_batches(results: list[dict], parallel: ParallelConfig) -> dict[int, list[int]]:
    """step -> the samples all dp ranks consumed, in dp order (from the tp 0, pp 0 rank of each)."""
    out: dict[int, list[int]] = {}
    for dp in range(parallel.dp):
        for step, ids in results[parallel.rank(dp, 0, 0)]["samples"].items():
            out.setdefault(int(step), []).extend(ids)
    return out


def transform(ptc_a: PTC, ptc_b: PTC, job: str, old: Version, new: Version, stores: dict[str, StoreServer]) -> None:
    clients = {h: StoreClient(s.url) for h, s in stores.items()}
    plan = make_plan(ptc_a, ptc_b, job=job, old_version=old, new_version=new)
    for host in ptc_b.hosts:
        execute_host_plan(plan, host, target=clients[host], sources={h: clients[h] for h in ptc_a.hosts})


def run_chain(module: str, job_args: list[str], layout: LayoutFn, chain: list[ParallelConfig], *, steps_each: int,
              dataset: DatasetState, stores: dict[str, StoreServer], tmp: Path, job: str) -> dict:
    """Baseline in ``chain[0]`` for all steps, then the chain, ``steps_each`` steps per layout; checks and measures.

    Returns the measurements: per step the baseline's and the chain's loss, their relative difference,
    the layout, and the median step time per layout.
    """
    total = steps_each * len(chain)
    ds0 = DatasetState(dataset.num_samples, dataset.seed, dataset.global_batch_size)
    base = run_ranks(module, job_args, chain[0], layout(chain[0], placement(chain[0]), ds0), f"{job}-base", 0, stores,
                     tmp / "base", total)
    runs: list[tuple[ParallelConfig, list[dict]]] = []
    ptc_prev: PTC | None = None
    for gen, parallel in enumerate(chain):
        k = gen * steps_each
        ds = DatasetState(dataset.num_samples, dataset.seed, dataset.global_batch_size, k * dataset.global_batch_size)
        ptc = layout(parallel, placement(parallel), ds)
        restore = None
        if gen:
            assert ptc_prev is not None
            restore = Version(k, gen)
            transform(ptc_prev, ptc, job, Version(k, gen - 1), restore, stores)
        res = run_ranks(module, job_args, parallel, ptc, job, gen, stores, tmp / f"g{gen}-{parallel.describe()}",
                        k + steps_each, restore=restore, snapshot_at=k + steps_each if gen < len(chain) - 1 else None)
        if gen:
            prev_parallel, prev = runs[-1]
            assert all(r["restored_step"] == k for r in res)
            assert_restored_equals_snapshot(prev, f"s{k}", res)
        runs.append((parallel, res))
        ptc_prev = ptc

    # the sample order, exactly, across every change
    order = DatasetState(dataset.num_samples, dataset.seed, dataset.global_batch_size).samples(
        0, total * dataset.global_batch_size).tolist()
    consumed: dict[int, list[int]] = {}
    for parallel, res in runs:
        consumed.update(global_batches(res, parallel))
    assert sorted(consumed) == list(range(1, total + 1))
    assert sum((consumed[s] for s in sorted(consumed)), []) == order
    assert global_batches(base, chain[0]) == consumed  # the baseline consumed the same batches

    # the loss, against the uninterrupted run in the first layout
    base_loss = {int(s): v for s, v in base[0]["losses"].items()}
    rows = []
    for parallel, res in runs:
        assert all(r["losses"] == res[0]["losses"] for r in res)  # every rank agrees
        for s, v in res[0]["losses"].items():
            step = int(s)
            rows.append({"step": step, "layout": parallel.describe(), "loss": v, "baseline": base_loss[step],
                         "rel_diff": abs(v - base_loss[step]) / abs(base_loss[step])})
    times = {parallel.describe(): float(np.median([float(t) for t in res[0]["seconds"].values()]))
             for parallel, res in runs}
    return {"rows": sorted(rows, key=lambda r: r["step"]), "step_seconds": times,
            "baseline_step_seconds": float(np.median([float(t) for t in base[0]["seconds"].values()]))}
