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

Under Tenplex (:func:`elastic_main`): launched by the scheduler (``TENPLEX_*``
environment) the job registers, takes its assignment (configuration, version
to restore, stop step), checks that the PTC derived by
:mod:`examples.gpt.layout` agrees with the live model, restores, trains with
the elastic sampler, snapshots, and stops when asked. ``--job`` runs the same
standalone, from a PTC file and a store address::

    torchrun --nproc-per-node 2 examples/gpt/train.py --dp 2 --steps 6 \
        --job demo --store /tmp/store --snapshot-at 3
    torchrun --nproc-per-node 2 examples/gpt/train.py --dp 1 --tp 2 --steps 6 \
        --job demo --store /tmp/store --restore s3-g1 --generation 1 --ptc new.json
"""

from __future__ import annotations

import argparse
import json
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

from examples.gpt.layout import gpt_ptc
from examples.gpt.model import GPT, GPTConfig, cross_entropy_loss
from examples.gpt.parallelize import (
    build_mesh,
    build_pipeline_schedule,
    check_supported,
    parallelize,
    pipeline_stage_module,
)
from tenplex.core import protocol
from tenplex.core.version import Version
from tenplex.errors import InvalidConfig
from tenplex.ptc import PTC, DatasetState, ParallelConfig, Placement
from tenplex.ptc.dtypes import storage_dtype
from tenplex.worker.session import ElasticWorker, WorkerSetup
from tenplex.worker.state import live_pieces, materialize

log = logging.getLogger("examples.gpt.train")


LOSS_LOG_ENV = "TENPLEX_LOSS_LOG"
"""When set, rank 0 appends ``{"step", "loss", "generation"}`` as one JSON line per step (for plots)."""


def log_loss(step: int, loss: float, generation: int = 0) -> None:
    """Append one step's loss to ``$TENPLEX_LOSS_LOG`` (a small O_APPEND write: lines never interleave)."""
    path = os.environ.get(LOSS_LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "loss": loss, "generation": generation}) + "\n")


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
    n_microbatches: int = 1

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
        if tokens.shape[0] % self.n_microbatches:
            raise InvalidConfig(
                f"a batch of {tokens.shape[0]} samples cannot be cut into {self.n_microbatches} micro-batches"
            )
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

    Only the stage's layers are built; every parameter's initial value is
    drawn from its own name-seeded generator, so it does not depend on which
    other layers exist.
    """
    model = GPT(cfg, seed=seed, device=device, layer_ids=parallel.stage_layers(cfg.n_layers)[stage])
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
    init_values: bool = True,
) -> GPTJob:
    """Build this rank's part of the job on an initialized default process group.

    ``init_values=False`` (a worker that restores: every value is overwritten)
    builds and parallelizes the stage on the ``meta`` device and allocates it
    on ``device`` without values (:func:`tenplex.worker.state.materialize`):
    no full-size random draws, no scatter of them from tensor-parallel rank 0.
    The model has no buffers, so nothing else needs a value.
    """
    check_supported(cfg, parallel)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = build_mesh(parallel, device.type)
    coords = parallel.coords(dist.get_rank())
    module = build_stage(cfg, parallel, coords["pp"], seed=seed, device=device if init_values else torch.device("meta"))
    parallelize(module, mesh, parallel)
    if not init_values:
        materialize(module, device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay)
    sched = None
    micro = (n_microbatches or parallel.pp) if parallel.pp > 1 else 1
    if parallel.pp > 1:
        sched = build_pipeline_schedule(
            module,
            coords["pp"],
            parallel.pp,
            mesh["pp"],
            device,
            n_microbatches=micro,
            loss_fn=cross_entropy_loss,
            schedule=schedule,
        )
    return GPTJob(cfg, parallel, mesh, coords, module, optimizer, sched, device, micro)


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
    t = p.add_argument_group(
        "Tenplex",
        "Under a Tenplex scheduler (TENPLEX_SCHEDULER_URL set) the assignment decides the parallel "
        "configuration, the version to restore and when to stop. Without one, --job turns on the same "
        "elastic machinery standalone: the PTC and store are given here.",
    )
    t.add_argument("--job", default=None, help="job name: train elastically without a scheduler")
    t.add_argument("--generation", type=int, default=0, help="layout generation (names the versions written)")
    t.add_argument("--ptc", default=None, help="PTC JSON of this configuration (default: derived with examples.gpt.layout)")
    t.add_argument("--gpus-per-node", type=int, default=None, help="for the derived PTC's placement (default: LOCAL_WORLD_SIZE or world size)")
    t.add_argument("--store", default=None, help="this node's store: http(s) URL of its daemon or its root directory")
    t.add_argument("--token", default=os.environ.get("TENPLEX_TOKEN"), help="store bearer token (default $TENPLEX_TOKEN)")
    t.add_argument("--restore", default=None, help="version to restore before training, e.g. s120-g1")
    t.add_argument("--snapshot-every", type=int, default=None, help="snapshot every N steps")
    t.add_argument("--snapshot-at", type=int, action="append", default=[], help="snapshot after this step (repeatable)")
    t.add_argument("--stop-at", type=int, default=None, help="snapshot this step and exit (as a scheduler's stop request)")
    t.add_argument("--results", default=None, help="write this rank's losses, samples and dumped state here (JSON, for tests)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if os.environ.get(protocol.ENV_SCHEDULER_URL) or args.job is not None:
        return elastic_main(args)
    return plain_main(args)


def _model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len)


def plain_main(args: argparse.Namespace) -> int:
    """Train without Tenplex: a fixed configuration from the command line."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(message)s")
    try:
        cfg = _model_config(args)
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
                log_loss(step + 1, loss)  # the elastic loop counts completed steps
    finally:
        dist.destroy_process_group()
    return 0


def _standalone_worker(args: argparse.Namespace, cfg: GPTConfig) -> ElasticWorker:
    """The elastic worker without a scheduler: torchrun's environment plus the command line."""
    if args.store is None:
        raise InvalidConfig("--job needs --store (the node's store URL or root directory)")
    parallel = ParallelConfig(dp=args.dp, tp=args.tp, pp=args.pp, zero=args.zero)
    rank = int(os.environ.get(protocol.ENV_RANK, "0"))
    if args.ptc is not None:
        ptc = PTC.load(args.ptc)
    else:
        per_node = args.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", parallel.world_size))
        dataset = DatasetState(num_samples=args.samples, seed=args.seed, global_batch_size=args.global_batch)
        ptc = gpt_ptc(cfg, parallel, Placement.uniform(parallel.world_size, per_node), dataset=dataset)
    if ptc.dataset is None:
        raise InvalidConfig(f"the PTC {args.ptc} has no dataset state; the elastic job needs one")
    setup = WorkerSetup(
        job=args.job,
        generation=args.generation,
        rank=rank,
        ptc=ptc,
        store=args.store,
        parallel=parallel,
        master_addr=os.environ.get(protocol.ENV_MASTER_ADDR, "127.0.0.1"),
        master_port=int(os.environ.get(protocol.ENV_MASTER_PORT, "29500")),
        restore_version=Version.parse(args.restore) if args.restore else None,
        stop_at_step=args.stop_at,
        total_steps=args.steps,
        token=args.token,
    )
    return ElasticWorker(setup, snapshot_every=args.snapshot_every)


def elastic_main(args: argparse.Namespace) -> int:
    """Train under Tenplex: restore the assigned version, snapshot, obey stop requests, report."""
    cfg = _model_config(args)
    if os.environ.get(protocol.ENV_SCHEDULER_URL):
        worker = ElasticWorker.from_scheduler(snapshot_every=args.snapshot_every)
    else:
        worker = _standalone_worker(args, cfg)
    rank = worker.setup.rank
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get(protocol.ENV_LOCAL_RANK, "0")))
    results = _Results(args.results) if args.results else None
    try:
        worker.init_process_group()
        parallel = worker.parallel
        job = build_job(
            cfg, parallel, seed=args.seed, lr=args.lr, n_microbatches=args.microbatches, schedule=args.schedule,
            init_values=worker.needs_initial_values,
        )
        worker.prepare(job.module, job.optimizer)  # the derived PTC agrees with the live model, or fail here
        start = worker.restore(job.module, job.optimizer, seed=args.seed)
        if results is not None and worker.restored is not None:
            results.dump_state("restored", job)
            results.data["restored_step"] = start
        data = SyntheticTokens(args.samples, cfg.seq_len, cfg.vocab, seed=args.seed)
        for step, ids in worker.batches(job.coords["dp"]):
            t0 = time.perf_counter()
            try:
                loss = job.train_step(data.batch(ids))
            except RuntimeError as exc:  # a collective failed: a peer is gone or hung
                log.error("step %d failed: %s", step, exc)
                worker.peer_failure(exc)
                return worker.finish(detail=str(exc)[:500])
            if rank == 0:
                log.info("step %d loss %.5f (%.0f ms, %s)", step, loss, 1e3 * (time.perf_counter() - t0), parallel.describe())
                log_loss(step, loss, worker.setup.generation)
            if results is not None:
                results.data["losses"][step] = loss
                results.data["samples"][step] = ids.tolist()
            if step in args.snapshot_at:
                worker.snapshot(step, job.module, job.optimizer)
                if results is not None:
                    results.dump_state("snapshot", job)
            if worker.step_done(step, loss, job.module, job.optimizer):
                break
        return worker.finish()
    finally:
        if results is not None:
            results.write()
        if dist.is_initialized():
            dist.destroy_process_group()


class _Results:
    """What a test needs from one rank: losses and samples per step, and the state it held."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.data: dict = {"losses": {}, "samples": {}}

    def dump_state(self, key: str, job: GPTJob) -> None:
        pieces = {}
        for piece in live_pieces(job.module, job.optimizer):
            local = piece.local.detach().cpu().contiguous()
            raw = local.view(torch.uint16) if local.dtype == torch.bfloat16 else local
            pieces[piece.name] = {
                "region": [list(b) for b in piece.region.bounds],
                "global_shape": list(piece.global_shape),
                "storage_dtype": str(storage_dtype(piece.dtype)),
                "data": raw.numpy().tobytes().hex(),
            }
        self.data[key] = pieces

    def write(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.data, f)


if __name__ == "__main__":
    sys.exit(main())
