"""One rank of the reference GPT job, run by tests/examples/test_gpt_parallel.py.

Started like torchrun starts a worker (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` in the environment). For every
configuration in the JSON spec it builds the job, records what this rank
holds of every parameter (global offset, local shape, local values), runs
training steps on a fixed global batch, records the losses and the
optimizer-state shapes, and saves it all to ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from examples.gpt.model import GPTConfig
from examples.gpt.train import SyntheticTokens, build_job
from tenplex.ptc import DatasetState, ParallelConfig


def local_view(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """(global offset, local shape, local values) of a parameter or optimizer state tensor."""
    if isinstance(p, DTensor):
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        local = p.to_local()
        if tuple(local.shape) != tuple(shape):
            raise AssertionError(f"to_local() shape {tuple(local.shape)} != computed {tuple(shape)}")
        return tuple(offset), tuple(shape), local.detach().clone()
    return (0,) * p.dim(), tuple(p.shape), p.detach().clone()


def run_config(spec: dict, rank: int) -> dict:
    cfg = GPTConfig(**spec["model"])
    parallel = ParallelConfig.from_json(spec["parallel"])
    job = build_job(cfg, parallel, seed=spec["seed"], lr=spec["lr"], schedule=spec.get("schedule", "1f1b"))
    held = {name: local_view(p) for name, p in job.module.named_parameters()}
    data = SyntheticTokens(spec["samples"], cfg.seq_len, cfg.vocab, seed=spec["seed"])
    state = DatasetState(spec["samples"], spec["seed"], spec["global_batch"])
    losses = []
    for step in range(spec["steps"]):
        ids = state.rank_batch(step, job.coords["dp"], parallel.dp)
        losses.append(job.train_step(data.batch(ids)))
    optim = {}
    for name, p in job.module.named_parameters():
        st = job.optimizer.state[p]
        optim[name] = {
            "exp_avg": local_view(st["exp_avg"])[:2],
            "exp_avg_sq": local_view(st["exp_avg_sq"])[:2],
            "step": tuple(st["step"].shape),
        }
    return {"coords": job.coords, "held": held, "losses": losses, "optim": optim}


def main() -> int:
    spec_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    specs = json.loads(spec_path.read_text())
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    rank = dist.get_rank()
    results: dict[str, dict] = {}
    try:
        for key, spec in specs.items():
            try:
                results[key] = run_config(spec, rank)
            except Exception:
                results[key] = {"error": traceback.format_exc()}
                raise
            dist.barrier()
    finally:
        torch.save(results, out_dir / f"rank{rank}.pt")
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
