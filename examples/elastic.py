"""The elastic training loop of the example jobs built on other libraries (torchtitan, transformers).

A job module supplies two functions: how to build this rank's part of the
model for a :class:`~tenplex.ptc.ParallelConfig` (an object with ``module``,
``optimizer``, ``dp_rank`` and ``train_step(tokens) -> loss``) and the PTC of
any configuration (its layout provider). :func:`elastic_main` does the rest
with :mod:`tenplex.worker`, as ``examples/gpt/train.py`` does for the reference
GPT: take the assignment from the scheduler (``TENPLEX_*`` environment) or,
standalone, from the command line (``--job``, ``--store``, ``--ptc``,
``--restore``); check the derived layout against the live model; restore;
train on the :class:`~examples.gpt.train.SyntheticTokens` sample order given by
the elastic sampler; snapshot; stop when asked.

``--results FILE`` (standalone) or ``--results-dir DIR`` (under a scheduler,
one file per generation and rank: ``g<generation>-r<rank>.json``) writes what
the tests check: the loss, the sample ids and the time of every step, and this rank's
state as it was snapshotted and as it was restored, tensor by tensor (:class:`Results`).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from examples.gpt.train import SyntheticTokens, log_loss
from tenplex.core import protocol
from tenplex.core.version import Version
from tenplex.errors import InvalidConfig
from tenplex.ptc import PTC, DatasetState, ParallelConfig, Placement
from tenplex.worker.session import ElasticWorker, WorkerSetup
from tenplex.worker.state import live_pieces

log = logging.getLogger(__name__)


class ElasticJob(Protocol):
    module: nn.Module
    optimizer: torch.optim.Optimizer | None

    @property
    def dp_rank(self) -> int: ...

    def train_step(self, tokens: torch.Tensor) -> float: ...


BuildJob = Callable[[ParallelConfig, int, bool], ElasticJob]
"""``(parallel, local_batch_size, init_values) -> job`` on the initialized default process group; ``init_values``
is False when a restore overwrites every value (the model may be built on ``meta`` and materialized without
values: :func:`tenplex.worker.state.materialize`)."""
BuildPTC = Callable[[ParallelConfig, Placement, DatasetState], PTC]
"""Picklable (a module-level function or a ``functools.partial`` of one): it runs in a subprocess."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The data, optimizer and Tenplex options every example job takes."""
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--zero", type=int, default=3, choices=(0, 3), help="3: FSDP2 across dp; 0: replicated")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    t = p.add_argument_group("Tenplex", "as examples/gpt/train.py: a scheduler's assignment, or --job standalone")
    t.add_argument("--job", default=None, help="job name: train elastically without a scheduler")
    t.add_argument("--generation", type=int, default=0)
    t.add_argument("--ptc", default=None, help="PTC JSON of this configuration (default: derived)")
    t.add_argument("--store", default=None, help="this node's store: URL of its daemon or its root directory")
    t.add_argument("--token", default=os.environ.get("TENPLEX_TOKEN"))
    t.add_argument("--restore", default=None, help="version to restore before training, e.g. s3-g1")
    t.add_argument("--snapshot-every", type=int, default=None)
    t.add_argument("--snapshot-at", type=int, action="append", default=[])
    t.add_argument("--stop-at", type=int, default=None)
    t.add_argument("--results", default=None, help="write this rank's losses, samples and state here (JSON)")
    t.add_argument("--results-dir", default=None, help="under a scheduler: g<generation>-r<rank>.json in this folder")


def _standalone_worker(args: argparse.Namespace, build_ptc: BuildPTC) -> ElasticWorker:
    if args.store is None:
        raise InvalidConfig("--job needs --store (the node's store URL or root directory)")
    parallel = ParallelConfig(dp=args.dp, tp=args.tp, pp=args.pp, zero=args.zero)
    if args.ptc is not None:
        ptc = PTC.load(args.ptc)
    else:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", parallel.world_size))
        dataset = DatasetState(num_samples=args.samples, seed=args.seed, global_batch_size=args.global_batch)
        # In a subprocess: a derivation leaves torch.distributed state behind that the job's own
        # meshes would pick up (see tenplex.ptc.torch_layout).
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            ptc = pool.submit(build_ptc, parallel, Placement.uniform(parallel.world_size, per_node), dataset).result()
    if ptc.dataset is None:
        raise InvalidConfig(f"the PTC {args.ptc} has no dataset state; the elastic job needs one")
    setup = WorkerSetup(
        job=args.job,
        generation=args.generation,
        rank=int(os.environ.get(protocol.ENV_RANK, "0")),
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


def elastic_main(args: argparse.Namespace, build_job: BuildJob, build_ptc: BuildPTC, vocab: int, seq_len: int) -> int:
    """Train under Tenplex: restore the assigned version, snapshot, obey stop requests, report."""
    if os.environ.get(protocol.ENV_SCHEDULER_URL):
        worker = ElasticWorker.from_scheduler(snapshot_every=args.snapshot_every)
    elif args.job is not None:
        worker = _standalone_worker(args, build_ptc)
    else:
        raise InvalidConfig("run under a Tenplex scheduler (TENPLEX_SCHEDULER_URL) or standalone with --job and --store")
    rank, generation = worker.setup.rank, worker.setup.generation
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    path = args.results or (os.path.join(args.results_dir, f"g{generation}-r{rank}.json") if args.results_dir else None)
    results = Results(path) if path else None
    try:
        worker.init_process_group()
        parallel = worker.parallel
        dataset = worker.dataset
        assert dataset is not None
        job = build_job(parallel, dataset.global_batch_size // parallel.dp, worker.needs_initial_values)
        if job.dp_rank != parallel.coords(rank)["dp"]:
            raise InvalidConfig(f"the job puts rank {rank} at dp {job.dp_rank}, Tenplex at {parallel.coords(rank)['dp']}")
        worker.prepare(job.module, job.optimizer)  # the derived PTC agrees with the live model, or fail here
        start = worker.restore(job.module, job.optimizer, seed=args.seed)
        if results is not None:
            results.data.update(parallel=parallel.to_json(), generation=generation, restored_step=start)
            if worker.restored is not None:
                results.dump_state("restored", job.module, job.optimizer)
            results.write()
        data = SyntheticTokens(dataset.num_samples, seq_len, vocab, seed=dataset.seed)
        for step, ids in worker.batches(job.dp_rank):
            t0 = time.perf_counter()
            try:
                loss = job.train_step(data.batch(ids))
            except RuntimeError as exc:  # a collective failed: a peer is gone or hung
                log.error("step %d failed: %s", step, exc)
                worker.peer_failure(exc)
                return worker.finish(detail=str(exc)[:500])
            seconds = time.perf_counter() - t0
            if rank == 0:
                log.info("step %d loss %.6f (%.0f ms, %s)", step, loss, 1e3 * seconds, parallel.describe())
                log_loss(step, loss, generation)
            if results is not None:
                results.data["losses"][step] = loss
                results.data["samples"][step] = ids.tolist()
                results.data["seconds"][step] = seconds
                results.write()  # every step: a process killed later leaves its record
            taken = len(worker.snapshots)
            if step in args.snapshot_at:
                worker.snapshot(step, job.module, job.optimizer)
            stop = worker.step_done(step, loss, job.module, job.optimizer)
            if results is not None and len(worker.snapshots) > taken:
                results.dump_state(f"s{step}", job.module, job.optimizer)  # what this step's snapshot copied
            if stop:
                break
        return worker.finish()
    finally:
        if results is not None:
            results.write()
        if dist.is_initialized():
            dist.destroy_process_group()


class Results:
    """What a test needs from one rank: losses, samples and step times (JSON), and the state it held.

    The state is written beside the JSON file with ``torch.save``, one file per
    occasion (``<file>.restored.pt``, ``<file>.s<step>.pt`` for each snapshot):
    ``{tensor name: {"region": [[start, stop], ...], "global_shape": [...], "tensor": local tensor}}``.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {"losses": {}, "samples": {}, "seconds": {}, "states": []}

    def dump_state(self, key: str, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        pieces = {
            piece.name: {
                "region": [list(b) for b in piece.region.bounds],
                "global_shape": list(piece.global_shape),
                "tensor": piece.local.detach().cpu().clone(),
            }
            for piece in live_pieces(module, optimizer)
        }
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(pieces, f"{self.path}.{key}.pt")
        self.data["states"].append(key)

    def write(self) -> None:
        """Replace the JSON file atomically (a reader never sees half of it)."""
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)
