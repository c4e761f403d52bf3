"""A user's Hugging Face training script, as the tests run it: ``python -m tests.integrations.hf_job``.

A tiny Qwen2 (``Qwen2ForCausalLM``: 2 layers, width 32, grouped-query attention), fp32, trained by
:class:`~tenplex.integrations.transformers.TenplexTrainer` on synthetic token ids (no download). The job's
layout is ``{"provider": "transformers", "model": MODEL}``. What the tests read is recorded from the Trainer's
own run: its data collator notes the ids of the samples in each batch it collates (sample ``i``'s first token
is ``i``), and a callback writes each step's loss as the Trainer logs it (``logs["loss"]``: its mean over the
ranks) with those ids to ``$HF_RESULTS/g<generation>-r<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import (
    Qwen2Config,
    Qwen2ForCausalLM,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

from tenplex.integrations.transformers import TenplexTrainer

SEQ, VOCAB, SAMPLES = 16, 128, 64
MODEL = {"architecture": "Qwen2ForCausalLM",
         "config": {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": SEQ,
                    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0}}


class Tokens(torch.utils.data.Dataset):
    """Sample ``i``: ``SEQ`` token ids drawn from ``i``; its first token is ``i`` (a batch says which samples it holds)."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(1000 + i))
        tokens[0] = i
        return {"input_ids": tokens, "labels": tokens.clone()}


class Recorder(TrainerCallback):
    """The collator's sample ids per step and the Trainer's logged loss, in this rank's JSON file."""

    def __init__(self) -> None:
        self.collated: list[int] = []
        self.samples: dict[int, list[int]] = {}

    def collate(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        self.collated += [int(f["input_ids"][0]) for f in features]
        return default_data_collator(features)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.samples[state.global_step] = self.collated
        self.collated = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        out = os.environ.get("HF_RESULTS")
        if not out or not logs or "loss" not in logs:
            return
        step = state.global_step
        path = Path(out) / f"g{os.environ.get('TENPLEX_GENERATION', '0')}-r{args.process_index}.json"
        data = json.loads(path.read_text()) if path.exists() else {"losses": {}, "samples": {}}
        data["losses"][str(step)] = float(logs["loss"])
        data["samples"][str(step)] = self.samples.get(step, [])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)


def build_model(layers: int = 2) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**{**MODEL["config"], "num_hidden_layers": layers}))


def main() -> int:
    recorder = Recorder()
    args = TrainingArguments(
        output_dir=os.environ.get("HF_OUT", "/tmp/hf-job"),
        per_device_train_batch_size=4,
        max_steps=12,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = TenplexTrainer(model=build_model(int(os.environ.get("HF_LAYERS", "2"))), args=args,
                             train_dataset=Tokens(), data_collator=recorder.collate, callbacks=[recorder])
    trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
