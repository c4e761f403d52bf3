"""A user's torchtitan config registry, as the tests run it: ``python -m torchtitan.train --module
tests.integrations.titan_job --config llama3_tiny`` (the layout: ``{"provider": "torchtitan", "model":
{"module": "tests.integrations.titan_job", "config": "llama3_tiny"}}``).

torchtitan 0.3.0's llama3 debug model cut to 2 layers, fp32, deterministic, on synthetic token ids (no
download). What the tests read is recorded from the Trainer's own run: a ``MetricsProcessor`` that also
writes each step's loss (the Trainer's ``global_avg_loss``) and the ids of the samples the Trainer's
dataloader fetched for that step to ``$TITAN_RESULTS/g<generation>-r<rank>.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer

from tenplex.integrations.torchtitan import ElasticDataLoader, elastic

ASSETS = Path(__file__).resolve().parent / "assets" / "tokenizer"
LAYERS, SEQ, VOCAB = 2, 32, 2048

_fetched: list[int] = []  # sample ids the dataloader took since the last logged step (this process)


@dataclass(frozen=True)
class Tokens:
    """Sample ``i``: ``SEQ + 1`` token ids drawn from ``(seed, i)``; its first token is ``i`` (so a batch says
    which samples it holds)."""

    num_samples: int
    seq_len: int

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + i)
        tokens = torch.randint(0, VOCAB, (self.seq_len + 1,), generator=g)
        tokens[0] = i
        _fetched.append(i)
        return tokens


def tokens(*, tokenizer: Any, seq_len: int, dataset_path: str | None) -> Tokens:
    return Tokens(num_samples=64, seq_len=seq_len)


class RecordingMetrics(MetricsProcessor):
    """torchtitan's metrics, plus this rank's losses and samples per step in a JSON file."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
        out = os.environ.get("TITAN_RESULTS")
        if not out:
            return
        ids = [int(t) for t in _fetched]
        _fetched.clear()
        gen = os.environ.get("TENPLEX_GENERATION", "0")
        path = Path(out) / f"g{gen}-r{torch.distributed.get_rank()}.json"
        data = json.loads(path.read_text()) if path.exists() else {"losses": {}, "samples": {}}
        data["losses"][str(step)] = float(global_avg_loss)
        data["samples"][str(step)] = ids
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)


def llama3_tiny() -> Trainer.Config:
    spec = model_registry("debugmodel")
    spec.model = dataclasses.replace(spec.model, layers=list(spec.model.layers[:LAYERS]))
    return elastic(Trainer.Config(
        model_spec=spec,
        hf_assets_path=str(ASSETS),
        loss=CrossEntropyLoss.Config(),
        optimizer=default_adamw(lr=1e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                  min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=4, seq_len=SEQ, steps=12, dtype="float32",
                                mixed_precision_param="float32", mixed_precision_reduce="float32",
                                disable_cuda_graphs=True, max_norm=1.0),
        dataloader=ElasticDataLoader.Config(dataset="tests.integrations.titan_job:tokens"),
        metrics=RecordingMetrics.Config(log_freq=1),
        parallelism=ParallelismConfig(pipeline_parallel_schedule="1F1B", spmd_backend="partial_dtensor"),
        compile=CompileConfig(enable=False),
        validator=Validator.Config(enable=False),
        debug=DebugConfig(seed=0, deterministic=True),
        dump_folder=os.environ.get("TITAN_DUMP", "/tmp/titan-outputs"),
    ))


def llama3_tiny_3_layers() -> Trainer.Config:
    """The same job with one more layer: a worker running it under ``llama3_tiny``'s layout disagrees with it."""
    config = llama3_tiny()
    spec = model_registry("debugmodel")
    config.model_spec.model = dataclasses.replace(spec.model, layers=list(spec.model.layers[:LAYERS + 1]))
    return config


def llama3_streamed() -> Trainer.Config:
    """torchtitan's own streamed text dataloader: its position cannot follow a dp change, so Tenplex refuses it."""
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    config = llama3_tiny()
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test")
    return config


def llama3_interleaved() -> Trainer.Config:
    """Two model parts per rank (an interleaved pipeline schedule): Tenplex stores one, so it refuses this."""
    config = llama3_tiny()
    config.parallelism.pipeline_parallel_schedule = "Interleaved1F1B"
    return config
