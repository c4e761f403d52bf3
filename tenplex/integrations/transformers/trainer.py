"""``TenplexTrainer``: Hugging Face transformers 5.x's own ``Trainer``, elastic under Tenplex.

A training script swaps ``Trainer`` for ``TenplexTrainer`` and keeps its arguments::

    trainer = TenplexTrainer(model=model, args=TrainingArguments(...), train_dataset=data, data_collator=...)
    trainer.train()

Outside a Tenplex scheduler it *is* that ``Trainer``: nothing is overridden. Under one (the ``TENPLEX_*``
environment the scheduler starts each rank with), the constructor registers the worker, takes its
assignment, joins the job's process group (``RANK``/``WORLD_SIZE``/``MASTER_*`` from the assignment) and
sets the arguments the job decides: the per-device batch (the job's global batch / dp / gradient
accumulation) and ``max_steps`` (the job's steps). Then ``train()``

- trains with the Trainer's own data parallelism: DDP through accelerate (gloo on CPU, NCCL on CUDA),
  every dp rank a full replica (the job's policy must say ``"zero": 0``; the ``transformers`` layout
  provider refuses anything else when the job is created, :func:`~tenplex.integrations.transformers.layout.check_parallel`);
- takes its train sampler from Tenplex's elastic sample order (:class:`~tenplex.worker.ElasticSampler`
  from the version's consumed samples: a dp change neither repeats nor skips a sample) in a DataLoader
  that accelerate does not prepare (its ``BatchSamplerShard`` would split the rank's part again);
- once the Trainer has built the optimizer and LR scheduler (``_prepare_for_training``), checks the live
  model against the job's PTC (a disagreement fails the job with the tensor's name, before any step) and
  restores the assigned version: parameters, AdamW state, LR scheduler, RNG, step (the Trainer's
  ``global_step``) and data position;
- after every optimizer step (a ``TrainerCallback``'s ``on_step_end``) hands the step to
  :meth:`~tenplex.worker.ElasticWorker.step_done`: snapshots at the scheduler's cadence and at the agreed
  stop step, where it sets ``control.should_training_stop`` so the Trainer's loop ends cleanly and
  ``train()`` returns; the process then exits as after a normal run.

A collective that fails (a peer is gone) is reported to the scheduler as a peer failure, which recovers
the job from the newest version the survivors hold; a :class:`~tenplex.errors.TenplexError` of this job
(its model, its data) fails it with the message.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import TrainOutput

from tenplex.core import protocol
from tenplex.errors import InvalidConfig, TenplexError
from tenplex.integrations.transformers.layout import check_parallel
from tenplex.worker.sampler import ElasticSampler
from tenplex.worker.session import ElasticWorker

log = logging.getLogger(__name__)


class TenplexTrainer(Trainer):
    """``transformers.Trainer``, elastic under a Tenplex scheduler (see the module docstring); the same arguments."""

    def __init__(self, model: Any = None, args: TrainingArguments | None = None, *rest: Any, **kwargs: Any) -> None:
        self.tenplex: ElasticWorker | None = None
        if os.environ.get(protocol.ENV_SCHEDULER_URL):
            if args is None:
                raise InvalidConfig("TenplexTrainer under Tenplex needs TrainingArguments (args=...): the Trainer's "
                                    "default arguments write to ./tmp_trainer")
            self.tenplex = join(args)
        super().__init__(model, args, *rest, **kwargs)
        if self.tenplex is not None:
            if self.train_dataset is None or isinstance(self.train_dataset, IterableDataset) or not hasattr(
                    self.train_dataset, "__len__"):
                self._fail(InvalidConfig(
                    f"train_dataset is a {type(self.train_dataset).__name__}; the elastic sample order needs a "
                    "map-style data set (__len__ and __getitem__)"))
            dataset = self.tenplex.dataset
            assert dataset is not None  # join() refused a job without one
            if dataset.num_samples != len(self.train_dataset):
                self._fail(InvalidConfig(
                    f"the job's dataset state has {dataset.num_samples} samples, train_dataset has "
                    f"{len(self.train_dataset)}: the job's \"dataset\" must describe the data set the Trainer reads"))
            self.add_callback(_StepDone(self))

    # -- what changes under Tenplex --------------------------------------------------------

    @property
    def _start_step(self) -> int:
        assert self.tenplex is not None
        version = self.tenplex.setup.restore_version
        return 0 if version is None else version.step

    def get_train_dataloader(self) -> DataLoader:
        """Under Tenplex: the rank's part of the elastic sample order, in the Trainer's batches, not re-sharded."""
        if self.tenplex is None:
            return super().get_train_dataloader()
        dataset = self.train_dataset
        collator = self.data_collator
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="training")
            else:
                collator = self._get_collator_with_removed_columns(collator, description="training")
        except ImportError:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        return DataLoader(
            dataset,
            batch_size=self._train_batch_size,
            sampler=_ElasticOrder(self),
            collate_fn=collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers,
            prefetch_factor=self.args.dataloader_prefetch_factor,
        )

    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        out = super()._init_training_state(*args, **kwargs)
        if self.tenplex is not None:
            # the step of the version restored next: the loop, its LR schedule and its logs go on from there
            self.state.global_step = self._start_step
        return out

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        out = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self.tenplex is not None:
            self._restore()
        return out

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        opt = self.optimizer
        return getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps the torch optimizer

    def _restore(self) -> None:
        worker = self.tenplex
        assert worker is not None
        optimizer = self._inner_optimizer()
        try:
            worker.prepare(self.model, optimizer)  # the live model agrees with the job's PTC, or the tensor is named
        except InvalidConfig as exc:
            self._fail(exc)
        start = worker.restore(self.model, optimizer, self.lr_scheduler, seed=self.args.seed)
        if start != self._start_step:
            self._fail(InvalidConfig(f"the restored version is of step {start}, the assignment's of {self._start_step}"))
        log.info("TenplexTrainer: rank %d of %s from step %d (%s)", worker.setup.rank, worker.parallel.describe(),
                 start, worker.setup.restore_version or "fresh")

    def _fail(self, exc: TenplexError) -> None:
        """This job's own error: fail the worker with the message (the job's status shows it) and raise it."""
        assert self.tenplex is not None
        if self.tenplex.status == "running":
            self.tenplex.status = "failed"
            self.tenplex.finish(detail=f"{type(exc).__name__}: {exc}"[:500])
        raise exc

    def train(self, *args: Any, **kwargs: Any) -> TrainOutput:
        if self.tenplex is None:
            return super().train(*args, **kwargs)
        worker = self.tenplex
        if (args[0] if args else kwargs.get("resume_from_checkpoint")) not in (None, False):
            self._fail(InvalidConfig("train(resume_from_checkpoint=...) under Tenplex: the job restores the version "
                                     "the scheduler assigns; leave it unset"))
        try:
            out = super().train(*args, **kwargs)
        except BaseException as exc:
            if worker.status == "running":
                log.error("training failed after step %d: %s", worker.step, exc)
                if isinstance(exc, TenplexError):
                    worker.status = "failed"
                else:  # a collective failed, most likely because a peer is gone: the scheduler recovers the job
                    worker.peer_failure(exc)
                worker.finish(detail=f"{type(exc).__name__}: {exc}"[:500])
            raise
        worker.finish()
        return out


class _ElasticOrder(Sampler[int]):
    """This rank's sample ids for the steps left, from the restored position on (read when iterated: after the
    restore, which sets the position)."""

    def __init__(self, trainer: TenplexTrainer) -> None:
        super().__init__()
        worker = trainer.tenplex
        assert worker is not None and worker.dataset is not None and worker.setup.total_steps is not None
        self.worker = worker
        self.dp_rank = worker.parallel.coords(worker.setup.rank)["dp"]
        self.steps = max(0, worker.setup.total_steps - trainer._start_step)
        self.per_rank = worker.dataset.global_batch_size // worker.parallel.dp

    def __len__(self) -> int:
        return self.steps * self.per_rank

    def __iter__(self) -> Iterator[int]:
        assert self.worker.dataset is not None
        yield from ElasticSampler(self.worker.dataset, self.dp_rank, self.worker.parallel.dp, self.steps)


class _StepDone(TrainerCallback):
    """After every optimizer step: Tenplex's snapshot cadence and the agreed stop (the Trainer's loop ends)."""

    def __init__(self, trainer: TenplexTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> Any:
        trainer = self.trainer
        assert trainer.tenplex is not None
        if trainer.tenplex.step_done(state.global_step, None, trainer.model, trainer._inner_optimizer(),
                                     trainer.lr_scheduler):
            control.should_training_stop = True
        return control


def join(args: TrainingArguments) -> ElasticWorker:
    """Register with the scheduler, join the job's process group and set the arguments the job decides."""
    check_arguments(args)
    worker = ElasticWorker.from_scheduler()
    try:
        parallel, setup = worker.parallel, worker.setup
        check_parallel(parallel)
        if worker.dataset is None:
            raise InvalidConfig("the job's PTC has no dataset state: a TenplexTrainer job needs the job's \"dataset\" "
                                "(num_samples, seed, global_batch_size)")
        if setup.total_steps is None:
            raise InvalidConfig("the job has no \"steps\": TenplexTrainer trains the job's number of steps")
        accumulation = args.gradient_accumulation_steps
        per_rank = worker.dataset.global_batch_size // parallel.dp
        if per_rank % accumulation:
            raise InvalidConfig(f"the {per_rank} samples per rank and step (global batch "
                                f"{worker.dataset.global_batch_size} / dp {parallel.dp}) do not split into "
                                f"gradient_accumulation_steps={accumulation} batches")
        on_host = [d.id for d in setup.ptc.devices if d.host == setup.host]
        os.environ[protocol.ENV_LOCAL_RANK] = str(on_host.index(setup.rank))
        os.environ["LOCAL_WORLD_SIZE"] = str(len(on_host))
        import torch.distributed as dist

        if dist.is_initialized():
            # the scheduler started this rank with RANK/WORLD_SIZE/MASTER_* set, and TrainingArguments had
            # accelerate join the process group as they were made: it must be the assigned one
            if (dist.get_rank(), dist.get_world_size()) != (setup.rank, setup.world_size):
                raise InvalidConfig(f"this process joined a process group as rank {dist.get_rank()} of "
                                    f"{dist.get_world_size()} before Tenplex assigned rank {setup.rank} of "
                                    f"{setup.world_size}")
        else:
            worker.init_process_group(timeout_s=float(args.ddp_timeout))
            # TrainingArguments set up accelerate's process state when they were made, before this process knew
            # its rank; made again now, it takes the process group just joined (accelerate creates no other).
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state(reset_partial_state=True)
            args.__dict__.pop("_setup_devices", None)
        args.per_device_train_batch_size = per_rank // accumulation
        args.max_steps = setup.total_steps
        if args.world_size != parallel.world_size or args.process_index != setup.rank:
            raise InvalidConfig(f"accelerate sees rank {args.process_index} of {args.world_size}, Tenplex assigned "
                                f"rank {setup.rank} of {parallel.world_size}")
    except TenplexError as exc:
        worker.status = "failed"
        worker.finish(detail=f"{type(exc).__name__}: {exc}"[:500])
        raise
    log.info("transformers Trainer elastic under Tenplex: rank %d of %s, %d steps, global batch %d",
             setup.rank, parallel.describe(), setup.total_steps, worker.dataset.global_batch_size)
    return worker


def check_arguments(args: TrainingArguments) -> None:
    """What Tenplex needs of the Trainer's arguments before anything registers; :class:`InvalidConfig` if not."""
    if args.fsdp:
        raise InvalidConfig(f"TrainingArguments.fsdp is {args.fsdp!r}; under Tenplex the job's policy decides the "
                            "parallelism and TenplexTrainer runs the Trainer's DDP (zero=0): leave fsdp unset")
    if args.parallelism_config is not None:
        raise InvalidConfig("TrainingArguments.parallelism_config is set; under Tenplex the job's policy decides the "
                            "parallelism and TenplexTrainer runs the Trainer's DDP: leave it unset")
    if args.deepspeed:
        raise InvalidConfig("TrainingArguments.deepspeed is set; TenplexTrainer stores the state of the Trainer's "
                            "own torch optimizer under DDP: leave deepspeed unset")
    if args.train_sampling_strategy not in ("random", "sequential"):
        raise InvalidConfig(f"TrainingArguments.train_sampling_strategy is {args.train_sampling_strategy!r}; under "
                            "Tenplex the samples come in the job's elastic order")
    if args.auto_find_batch_size:
        raise InvalidConfig("TrainingArguments.auto_find_batch_size is set; under Tenplex the batch is the job's")


__all__ = ["TenplexTrainer", "check_arguments", "join"]
