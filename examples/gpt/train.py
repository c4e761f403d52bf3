"""The reference GPT training job: build a parallelized stage, train it, print the loss.

Launch with torchrun (gloo on CPU, NCCL when CUDA is present)::

    torchrun --nproc-per-node 4 examples/gpt/train.py --dp 1 --tp 2 --pp 2 --steps 5

The pieces are importable so that the Tenplex worker integration and the
tests build exactly the same job: :func:`build_job` makes a :class:`GPTJob`
(mesh, this rank's pipeline stage with TP and DP applied, AdamW, the pipeline
schedule) and :meth:`GPTJob.train_step` runs one optimizer step on this data
rank's batch. The data set is :class:`SyntheticTokens`, generated from a seed
(no downloads), read in the order of a :class:`tenplex.ptc.DatasetState` so
that changing the data-parallel size neither repeats nor skips a sample.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

if __package__ in (None, ""):  # run as a script by torchrun: make `examples` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.gpt.model import GPT, GPTConfig, cross_entropy_loss
from examples.gpt.parallelize import (
    build_mesh,
    build_pipeline_schedule,
    check_supported,
    parallelize,
    pipeline_stage_module,
)
from tenplex.errors import InvalidConfig
from tenplex.ptc import DatasetState, ParallelConfig

log = logging.getLogger("examples.gpt.train")


@dataclass(frozen=True, slots=True)
class SyntheticTokens:
    """A deterministic, learnable token data set: noisy arithmetic progressions mod ``vocab``.

    Sample ``i`` depends only on ``(seed, i)``, so any rank can produce any
    sample without coordination. Each sample has ``seq_len + 1`` tokens
    (inputs and the shifted targets).
    """

    num_samples: int
    seq_len: int
    vocab: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_samples < 1 or self.seq_len < 1 or self.vocab < 2:
            raise InvalidConfig(
                f"SyntheticTokens needs num_samples >= 1, seq_len >= 1, vocab >= 2; got "
                f"{self.num_samples}, {self.seq_len}, {self.vocab}"
            )

    def sample(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_samples:
            raise InvalidConfig(f"sample {index} is outside 0..{self.num_samples - 1}")
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(0, self.vocab, (1,), generator=gen))
        stride = int(torch.randint(1, 4, (1,), generator=gen))
        tokens = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab
        noise = torch.rand(self.seq_len + 1, generator=gen) < 0.05
        tokens[noise] = torch.randint(0, self.vocab, (int(noise.sum()),), generator=gen)
        return tokens

    def batch(self, indices: torch.Tensor | list[int]) -> torch.Tensor:
        """``(len(indices), seq_len + 1)`` int64 tokens."""
        return torch.stack([self.sample(int(i)) for i in indices])


@dataclass
class GPTJob:
    """One rank's part of the job: its stage module (parallelized), optimizer and schedule."""

    cfg: GPTConfig
    parallel: ParallelConfig
    mesh: DeviceMesh
    coords: dict[str, int]
    module: GPT
    optimizer: torch.optim.Optimizer
    schedule: object | None
    """The pipeline schedule when pp > 1, else ``None``."""
    device: torch.device

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.parallel.pp - 1

    def train_step(self, tokens: torch.Tensor) -> float:
        """Forward, backward and one AdamW step on this data rank's ``(batch, seq+1)`` tokens.

        Returns the loss of the whole global batch (the mean over micro-batches
        and data-parallel ranks), the same value on every rank.
        """
        tokens = tokens.to(self.device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        self.optimizer.zero_grad(set_to_none=True)
        if self.schedule is None:
            loss = cross_entropy_loss(self.module(inputs), targets)
            loss.backward()
            local = loss.detach().float()
        else:
            losses: list[torch.Tensor] = []
            if self.is_first_stage:
                self.schedule.step(inputs)
            elif self.is_last_stage:
                self.schedule.step(target=targets, losses=losses)
            else:
                self.schedule.step()
            local = (
                torch.stack([x.detach().float() for x in losses]).mean()
                if self.is_last_stage
                else torch.zeros((), device=self.device)
            )
        self.optimizer.step()
        return self._global_loss(local)

    def _global_loss(self, local: torch.Tensor) -> float:
        """Average over dp, then take the last stage's value on every stage."""
        local = local.reshape(1).clone()
        if self.parallel.dp > 1:
            dist.all_reduce(local, group=self.mesh["dp"].get_group())
            local /= self.parallel.dp
        if self.parallel.pp > 1:
            pp_group = self.mesh["pp"].get_group()
            last = dist.get_global_rank(pp_group, self.parallel.pp - 1)
            dist.broadcast(local, src=last, group=pp_group)
        return float(local.item())


def build_stage(cfg: GPTConfig, parallel: ParallelConfig, stage: int, *, seed: int, device: torch.device | str) -> GPT:
    """Pipeline stage ``stage`` of the model with the global initial values (before TP/DP).

    The whole model is made on ``device`` and pruned; on the meta device this
    costs nothing, on a real device it is the simple way to get
    configuration-independent values (fine for the reference job's sizes).
    """
    model = GPT(cfg, seed=seed, device=device)
    return pipeline_stage_module(model, stage, parallel.pp, parallel)


def build_job(
    cfg: GPTConfig,
    parallel: ParallelConfig,
    *,
    seed: int = 0,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    n_microbatches: int | None = None,
    schedule: str = "1f1b",
    device: torch.device | None = None,
) -> GPTJob:
    """Build this rank's part of the job on an initialized default process group."""
    check_supported(cfg, parallel)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = build_mesh(parallel, device.type)
    coords = parallel.coords(dist.get_rank())
    module = build_stage(cfg, parallel, coords["pp"], seed=seed, device=device)
    parallelize(module, mesh, parallel)
    optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay)
    sched = None
    if parallel.pp > 1:
        sched = build_pipeline_schedule(
            module,
            coords["pp"],
            parallel.pp,
            mesh["pp"],
            device,
            n_microbatches=n_microbatches or parallel.pp,
            loss_fn=cross_entropy_loss,
            schedule=schedule,
        )
    return GPTJob(cfg, parallel, mesh, coords, module, optimizer, sched, device)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train the reference GPT with DP/TP/PP on torchrun.")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--zero", type=int, default=0, choices=(0, 3))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(message)s")
    try:
        cfg = GPTConfig(vocab=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len)
        parallel = ParallelConfig(dp=args.dp, tp=args.tp, pp=args.pp, zero=args.zero)
        job = build_job(
            cfg, parallel, seed=args.seed, lr=args.lr, n_microbatches=args.microbatches, schedule=args.schedule
        )
        data = SyntheticTokens(args.samples, cfg.seq_len, cfg.vocab, seed=args.seed)
        state = DatasetState(num_samples=args.samples, seed=args.seed, global_batch_size=args.global_batch)
        state.check_dp(parallel.dp)
        for step in range(args.steps):
            t0 = time.perf_counter()
            ids = state.rank_batch(step, job.coords["dp"], parallel.dp)
            loss = job.train_step(data.batch(ids))
            if rank == 0:
                log.info("step %d loss %.5f (%.0f ms, %s)", step, loss, 1e3 * (time.perf_counter() - t0), parallel.describe())
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
