"""torchtitan 0.3.0's own ``Trainer``, elastic under Tenplex.

A user's config registry (what ``python -m torchtitan.train --module <pkg> --config <fn>`` calls) adds one
line, ``return elastic(my_config())``. Under a Tenplex scheduler (the ``TENPLEX_*`` environment),
:func:`elastic` registers the worker, takes its assignment and gives back the config with

- the parallel degrees of the assignment: dp as FSDP's ``data_parallel_shard_degree`` (``zero=3``) or as
  ``data_parallel_replicate_degree`` (``zero=0``), tp, pp; the global batch of the job's dataset state with
  no gradient accumulation (``local_batch_size`` = global batch / dp), the job's step count;
- :class:`TenplexCheckpointManager` in place of the checkpoint manager (torchtitan's
  ``BaseCheckpointManager``): ``load`` restores the assigned version into the model part, its optimizer,
  the LR schedulers (and the learning rate of the next step) and the train state (step); ``save`` snapshots at the scheduler's cadence and at the
  agreed stop step, after which it ends the Trainer's own loop (its bound, ``training.steps``, becomes the
  step just saved), so ``torchtitan.train`` closes and exits as after a normal run;
- the data position of :class:`ElasticDataLoader` (the job's dataloader: torchtitan's own streams an
  iterable data set and refuses a dp change) set to the version's consumed samples, so a change of dp
  neither repeats nor skips a sample.

Outside a scheduler the config is returned as it is. Either way the process gets what torchtitan 0.3.0
needs on this machine: torch 2.13's names for two calls (:mod:`~tenplex.integrations.torchtitan.compat`) and,
without CUDA, the CPU substitutions of :mod:`~tenplex.integrations.torchtitan.cpu` (torchtitan assumes a GPU).

What Tenplex stores is the PTC's: the parameters and the optimizer state by ``named_parameters()``,
plus each rank's small record (RNG, step, data position). So one model part per rank (a pipeline schedule
with one stage per rank: ``1F1B`` or ``GPipe``) and one optimizer over it; anything else is refused by the
layout provider when the job is created, and by :class:`TenplexCheckpointManager` at start-up.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

import torch
import tyro
from torch import nn
from torch.utils.data import IterableDataset
from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.components.dataloader import BaseDataLoader

from tenplex import registry
from tenplex.core import protocol
from tenplex.errors import InvalidConfig, TenplexError
from tenplex.integrations.torchtitan import compat, cpu
from tenplex.ptc import DatasetState, ParallelConfig
from tenplex.worker.sampler import ElasticSampler
from tenplex.worker.session import ElasticWorker

log = logging.getLogger(__name__)

SINGLE_STAGE_SCHEDULES = ("1F1B", "GPipe")
"""Pipeline schedules with one model part per rank (the PTC names the parameters of one module per rank)."""

SPMD_BACKENDS = ("partial_dtensor", "full_dtensor")
"""torchtitan's SPMD backends whose parameters are DTensors (``spmd_types`` keeps plain local tensors)."""

_deriving: contextvars.ContextVar[bool] = contextvars.ContextVar("tenplex_torchtitan_deriving", default=False)


@contextlib.contextmanager
def deriving() -> Iterator[None]:
    """While the layout provider calls a config function: :func:`elastic` changes nothing, registers nothing."""
    token = _deriving.set(True)
    try:
        yield
    finally:
        _deriving.reset(token)


def elastic(config: Any) -> Any:
    """``config`` (a ``torchtitan.trainer.Trainer.Config``) made elastic under Tenplex; unchanged outside one.

    See the module docstring for what changes. Errors in the config that Tenplex cannot run (another
    dataloader, several model parts per rank, context or expert parallelism) are :class:`InvalidConfig`
    naming the field, before anything registers.
    """
    compat.apply()
    if cpu.cpu_only():
        cpu.apply()
    if _deriving.get() or not os.environ.get(protocol.ENV_SCHEDULER_URL):
        return config
    check_config(config)
    worker = ElasticWorker.from_scheduler()
    parallel, setup = worker.parallel, worker.setup
    if worker.dataset is None:
        raise InvalidConfig("the job's PTC has no dataset state: a torchtitan job under Tenplex needs the job's "
                            "\"dataset\" (num_samples, seed, global_batch_size)")
    apply_parallel(config, parallel, worker.dataset.global_batch_size)
    if setup.total_steps is not None:
        config.training.steps = setup.total_steps
    seed = config.debug.seed if config.debug.seed is not None else 0
    config.checkpoint = TenplexCheckpointManager.Config(worker=lambda: worker, seed=seed)
    # torchtitan initializes torch.distributed from the environment (env://); Tenplex's assignment says where.
    os.environ[protocol.ENV_MASTER_ADDR] = setup.master_addr
    os.environ[protocol.ENV_MASTER_PORT] = str(setup.master_port)
    os.environ[protocol.ENV_RANK] = str(setup.rank)
    os.environ[protocol.ENV_WORLD_SIZE] = str(setup.world_size)
    on_host = [d.id for d in setup.ptc.devices if d.host == setup.host]
    os.environ[protocol.ENV_LOCAL_RANK] = str(on_host.index(setup.rank))
    os.environ["LOCAL_WORLD_SIZE"] = str(len(on_host))
    log.info("torchtitan Trainer elastic under Tenplex: rank %d of %s, %d steps, global batch %d",
             setup.rank, parallel.describe(), config.training.steps, config.training.global_batch_size)
    return config


def check_config(config: Any) -> None:
    """What Tenplex needs of a torchtitan config before any degree is set; :class:`InvalidConfig` if not."""
    if not isinstance(config.dataloader, ElasticDataLoader.Config):
        raise InvalidConfig(
            f"the config's dataloader is {type(config.dataloader).__qualname__}; under Tenplex it must be "
            "tenplex.integrations.torchtitan.ElasticDataLoader.Config(dataset=\"module:function\") over a "
            "map-style data set, so that the data position is exact when dp changes (an iterable, streamed "
            "data set cannot be re-split)"
        )
    par = config.parallelism
    if par.spmd_backend not in SPMD_BACKENDS:
        raise InvalidConfig(
            f"parallelism.spmd_backend is {par.spmd_backend!r}; Tenplex reads and restores the model's DTensors: "
            f"use one of {', '.join(SPMD_BACKENDS)}"
        )
    for name in ("context_parallel_degree", "expert_parallel_degree", "expert_tensor_parallel_degree"):
        value = getattr(par, name, 1)
        if value not in (1, -1, None):
            raise InvalidConfig(f"parallelism.{name} is {value}; Tenplex assigns dp, tp and pp only")
    schedule = par.pipeline_parallel_schedule
    if schedule not in SINGLE_STAGE_SCHEDULES:
        raise InvalidConfig(
            f"parallelism.pipeline_parallel_schedule is {schedule!r}; Tenplex stores one model part per rank: "
            f"use one of {', '.join(SINGLE_STAGE_SCHEDULES)}"
        )


def apply_parallel(config: Any, parallel: ParallelConfig, global_batch_size: int) -> None:
    """Set the config's parallel degrees and batch sizes to ``parallel`` (what Tenplex assigned)."""
    if parallel.zero == 3:
        replicate, shard = 1, parallel.dp
    elif parallel.zero == 0:
        replicate, shard = parallel.dp, 1
    else:
        raise InvalidConfig(f"a torchtitan job runs zero=3 (FSDP2) or zero=0 (replicas), not zero={parallel.zero}")
    par = config.parallelism
    par.data_parallel_replicate_degree = replicate
    par.data_parallel_shard_degree = shard
    par.tensor_parallel_degree = parallel.tp
    par.pipeline_parallel_degree = parallel.pp
    if global_batch_size % parallel.dp:
        raise InvalidConfig(f"the global batch of {global_batch_size} samples does not split over dp={parallel.dp}")
    local = global_batch_size // parallel.dp
    if parallel.pp > 1:
        micro = par.pipeline_parallel_microbatch_size
        if local % micro:
            raise InvalidConfig(f"the local batch of {local} samples (global {global_batch_size} / dp {parallel.dp}) "
                                f"does not split into pipeline micro-batches of {micro}")
        config.training.disable_cuda_graphs = True  # torchtitan's own rule: no CUDA graphs with pipelines
    config.training.global_batch_size = global_batch_size
    config.training.local_batch_size = local


class ElasticDataLoader(BaseDataLoader):
    """The Trainer's batches from a map-style data set, in Tenplex's elastic sample order.

    ``dataset`` names a function ``(tokenizer, seq_len, dataset_path) -> data set`` whose items are
    ``seq_len + 1`` token ids (a 1-D integer tensor: inputs and the shifted labels). Each training step
    takes the next global batch of the order (a permutation per epoch from the seed); data-parallel rank
    ``r`` of ``d`` takes the ``r``-th of ``d`` equal parts (:class:`~tenplex.worker.ElasticSampler`), in
    micro-batches of the size the Trainer asks for. So where the next step starts follows from the number
    of samples consumed, whatever dp was: a dp change neither repeats nor skips a sample.

    Under Tenplex the order and the position are the job's (:meth:`follow`, called by
    :class:`TenplexCheckpointManager` after the restore). Without it, the order is seeded with ``seed``
    and the position is this loader's ``state_dict`` (torchtitan's own checkpoints keep it).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = ""
        """``module:function`` returning the map-style data set (see the class docstring)."""

        seed: int = 0
        """The sample order's seed outside a Tenplex job (under one, the job's dataset state has it)."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = None,
    ) -> None:
        factory = registry.load_spec(config.dataset, "dataloader.dataset")
        if not callable(factory):
            raise InvalidConfig(f"dataloader.dataset {config.dataset!r} is not a function")
        dataset = factory(tokenizer=tokenizer, seq_len=seq_len, dataset_path=config.dataset_path)
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise InvalidConfig(f"dataloader.dataset {config.dataset!r} returned a {type(dataset).__name__}; "
                                "the elastic order needs a map-style data set (__len__ and __getitem__)")
        self.dataset = dataset
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.batch_size = local_batch_size
        self.state = DatasetState(num_samples=len(dataset), seed=config.seed,
                                  global_batch_size=local_batch_size * dp_world_size)
        self._taken = 0  # micro-batches handed out since ``state``

    def follow(self, state: DatasetState) -> None:
        """Take the job's sample order from ``state`` on (its consumed samples are the position)."""
        state.check_dp(self.dp_world_size)
        if state.num_samples != len(self.dataset):
            raise InvalidConfig(f"the job's dataset state has {state.num_samples} samples, the data set "
                                f"{type(self.dataset).__name__} has {len(self.dataset)}: the job's \"dataset\" must "
                                "describe the data set the dataloader reads")
        per_rank = state.global_batch_size // self.dp_world_size
        if per_rank % self.batch_size:
            raise InvalidConfig(f"the {per_rank} samples per rank and step do not split into batches of "
                                f"{self.batch_size}")
        self.state = state
        self._taken = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        sampler = ElasticSampler(self.state, self.dp_rank, self.dp_world_size)
        skip = self._taken
        positions = torch.arange(self.seq_len).unsqueeze(0).expand(self.batch_size, self.seq_len).contiguous()
        index = 0
        for ids in sampler.batches():
            for start in range(0, len(ids), self.batch_size):
                index += 1
                if index <= skip:
                    continue
                tokens = torch.stack([torch.as_tensor(self.dataset[int(i)]) for i in ids[start:start + self.batch_size]])
                if tokens.shape[1] != self.seq_len + 1:
                    raise InvalidConfig(f"sample {int(ids[start])} has {tokens.shape[1]} tokens, the loader needs "
                                        f"seq_len + 1 = {self.seq_len + 1}")
                self._taken = index
                yield {"input": tokens[:, :-1], "positions": positions}, tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"dataset": self.state.to_json(), "taken": self._taken}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self.state = DatasetState.from_json(state_dict["dataset"])
        self._taken = int(state_dict["taken"])


class TenplexCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager interface over Tenplex's snapshots and restores (see the module docstring).

    Built by the Trainer after the model, optimizers, LR schedulers and dataloader: it checks the live
    model part against the job's PTC (a disagreement is an error naming the tensor, before any step), and
    on CPU makes FSDP2 reduce with sums (gloo has no ``PREMUL_SUM``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        enable: bool = True
        worker: Annotated[Callable[[], Any] | None, tyro.conf.Suppress] = None
        """Returns the registered :class:`~tenplex.worker.ElasticWorker` (set by :func:`elastic`). A function,
        not the worker itself: torchtitan parses the whole config with tyro, which would take the worker's
        constructor apart into command-line fields."""
        seed: int = 0
        """RNGs are reseeded from (seed, step, rank) after a restore into another layout."""

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future = None
        if not self.enable:
            return
        worker = config.worker() if config.worker is not None else None
        if not isinstance(worker, ElasticWorker):
            raise InvalidConfig("TenplexCheckpointManager is put in by tenplex.integrations.torchtitan.elastic(config) "
                                "under a Tenplex scheduler, not configured by hand")
        if len(model_parts) != 1:
            raise InvalidConfig(f"this rank holds {len(model_parts)} model parts; Tenplex stores one per rank "
                                f"(pipeline schedules {', '.join(SINGLE_STAGE_SCHEDULES)})")
        inner = list(getattr(optimizers, "optimizers", [optimizers]))
        if len(inner) != 1:
            raise InvalidConfig(f"this rank has {len(inner)} optimizers; Tenplex stores the state of one")
        if not isinstance(dataloader, ElasticDataLoader):
            raise InvalidConfig(f"the dataloader is a {type(dataloader).__name__}, not an ElasticDataLoader")
        trainer = states.get("train_state")
        if trainer is None or not hasattr(trainer, "step"):
            raise InvalidConfig("the Trainer did not hand its train state to the checkpoint manager")
        self.worker: ElasticWorker = worker
        self.seed = config.seed
        self.model = model_parts[0]
        self.optimizer: torch.optim.Optimizer = inner[0]
        self.lr_schedulers = lr_schedulers
        self.dataloader = dataloader
        self.trainer = trainer
        if cpu.cpu_only():
            cpu.force_sum_reductions(self.model)
        # the derived PTC agrees with the live model, or an error naming the first tensor that differs, which the
        # scheduler is told (the job's message names it) before the Trainer gives up
        try:
            self.worker.prepare(self.model, self.optimizer)
        except InvalidConfig as exc:
            self.worker.status = "failed"
            self.worker.finish(detail=f"{type(exc).__name__}: {exc}"[:500])
            raise

    def _load(self, step: int = -1) -> bool:
        start = self.worker.restore(self.model, self.optimizer, seed=self.seed)
        dataset = self.worker.dataset
        assert dataset is not None  # elastic() refused a job without one
        self.dataloader.follow(dataset)
        self.trainer.step = start
        # torchtitan's own LR schedules are functions of the step count (its checkpoints keep only that); the
        # optimizer's groups get the rate of the next step now, as a scheduler's step() would have set them
        self.lr_schedulers.load_state_dict({"last_epoch": start})
        for scheduler in self.lr_schedulers.schedulers:
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
        # tokens this rank has seen, as if it had trained in this layout from the start (metrics only)
        self.trainer.ntokens_seen = start * dataset.global_batch_size // self.dataloader.dp_world_size * self.dataloader.seq_len
        return self.worker.restored is not None

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        taken = len(self.worker.snapshots)
        stop = self.worker.step_done(curr_step, None, self.model, self.optimizer)
        if stop:
            # The Trainer's loop runs while step < training.steps: it ends after this step, as at its last.
            self.trainer.config.training.steps = curr_step
        return len(self.worker.snapshots) > taken

    def _maybe_wait_for_staging(self) -> None:
        """Snapshots copy the state before the step returns (the store write runs on): nothing to wait for."""

    def _wait_for_saving(self) -> None:
        self.worker.snapshotter.wait()

    def _close(self) -> None:
        exc = sys.exc_info()[1]  # torchtitan.train closes the Trainer inside its `except` when training failed
        if exc is not None and self.worker.status == "running":
            log.error("training failed after step %d: %s", self.worker.step, exc)
            if isinstance(exc, TenplexError):  # this job's own error (its config, its data): no peer is to blame
                self.worker.status = "failed"
            else:  # a collective failed, most likely because a peer is gone: the scheduler recovers the job
                self.worker.peer_failure(exc)
            self.worker.finish(detail=f"{type(exc).__name__}: {exc}"[:500])
        else:
            self.worker.finish()


__all__ = ["ElasticDataLoader", "TenplexCheckpointManager", "check_config", "deriving", "elastic"]
