"""The ``transformers`` layout provider and :class:`TenplexTrainer` outside a scheduler (in-process, fast).

The provider builds the model with transformers itself on the meta device; checked on three families
(GPT-2, Llama, Qwen2): the PTC agrees with a live model of the same config as a worker checks it
(``ElasticWorker.prepare``'s functions), a live model that differs is refused naming the tensor, and bad
models and layouts the Trainer cannot run are refused naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is installed by `make test` (.[clients])")

import torch  # noqa: E402

from tenplex.errors import InvalidConfig  # noqa: E402
from tenplex.ptc import DatasetState, ParallelConfig, Placement  # noqa: E402
from tenplex.scheduler.layouts import LayoutSpec, registered_providers  # noqa: E402
from tenplex.worker.state import check_layout, ensure_optimizer_state, live_pieces  # noqa: E402

DATASET = DatasetState(num_samples=64, seed=0, global_batch_size=8)
GPT2 = {"architecture": "GPT2LMHeadModel",
        "config": {"vocab_size": 96, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 16,
                   "bos_token_id": 0, "eos_token_id": 0}}
LLAMA = {"architecture": "LlamaForCausalLM",
         "config": {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2}}
QWEN2 = {"architecture": "Qwen2ForCausalLM",
         "config": {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}}


def layout(model: dict, parallel: ParallelConfig = ParallelConfig(dp=2), precision: str = "fp32"):
    spec = LayoutSpec.from_json({"provider": "transformers", "model": model, "precision": precision})
    return spec.build(parallel, Placement.uniform(parallel.world_size, 2), DATASET)


def live(model: dict, **changes) -> torch.nn.Module:
    import transformers

    cls = getattr(transformers, model["architecture"])
    return cls(cls.config_class(**{**model["config"], **changes}))


@pytest.mark.parametrize("model", [GPT2, LLAMA, QWEN2], ids=["gpt2", "llama", "qwen2"])
def test_the_ptc_is_the_live_models_on_every_dp_rank(model: dict) -> None:
    assert "transformers" in registered_providers()
    ptc = layout(model)
    net = live(model)
    params = dict(net.named_parameters())  # a tied output embedding appears once, under its first name
    assert {t.name for t in ptc.tensors if not t.name.startswith("optim/")} == set(params)
    for t in ptc.tensors:  # DDP: every dp rank holds every tensor whole
        assert [(s.region.bounds, s.devices) for s in t.shards] == [(tuple((0, n) for n in t.shape), (0, 1))], t.name
    assert ptc.config["model"]["architecture"] == model["architecture"]
    for rank in (0, 1):
        opt = torch.optim.AdamW(net.parameters())
        ensure_optimizer_state(net, opt, ptc)
        check_layout(live_pieces(net, opt), ptc, rank)


def test_a_live_model_that_differs_is_refused_naming_the_tensor() -> None:
    ptc = layout(GPT2)
    net = live(GPT2, n_layer=3)
    opt = torch.optim.AdamW(net.parameters())
    with pytest.raises(InvalidConfig, match=r"live tensor 'transformer\.h\.2\."):
        ensure_optimizer_state(net, opt, ptc)
        check_layout(live_pieces(net, opt), ptc, 0)
    bf16 = layout(LLAMA, precision="bf16")
    assert {t.dtype for t in bf16.tensors if not t.name.endswith("/step")} == {"bfloat16"}
    with pytest.raises(InvalidConfig, match="model.embed_tokens.weight"):
        check_layout(live_pieces(live(LLAMA), None), bf16, 0)  # an fp32 model under a bf16 layout


def test_a_pretrained_directory(tmp_path: Path) -> None:
    import transformers

    config = transformers.Qwen2Config(**QWEN2["config"], architectures=["Qwen2ForCausalLM"])
    config.save_pretrained(tmp_path)
    ptc = layout({"pretrained": str(tmp_path)})
    assert {t.name for t in ptc.tensors} == {t.name for t in layout(QWEN2).tensors}
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((tmp_path / "config.json").read_text()),
                                                      "architectures": ["Qwen2Model"]}))
    with pytest.raises(InvalidConfig, match="architectures 'Qwen2Model' is not a causal LM"):
        layout({"pretrained": str(tmp_path)})
    with pytest.raises(InvalidConfig, match="not a local directory with a config.json"):
        layout({"pretrained": str(tmp_path / "missing")})


@pytest.mark.parametrize(("model", "parallel", "match"), [
    ({"architecture": "LlamaForCausalLm", "config": {}}, None, "did you mean one of .*LlamaForCausalLM"),
    ({"architecture": "LlamaForCausalLM", "config": {"hiden_size": 32}}, None, "LlamaConfig has no field 'hiden_size'"),
    ({"architecture": "LlamaForCausalLM", "config": {"hidden_size": 30, "num_attention_heads": 4}}, None,
     "hidden size .30. is not a multiple"),
    ({"architecture": "LlamaForCausalLM", "config": {}, "pretrained": "/x"}, None, "either"),
    ({}, None, "needs \"architecture\""),
    (LLAMA, ParallelConfig(tp=2), "tp=2; TenplexTrainer runs data parallelism only"),
    (LLAMA, ParallelConfig(pp=2), "pp=2"),
    (LLAMA, ParallelConfig(dp=2, zero=3), "zero=3"),
], ids=["architecture", "field", "invalid", "both", "none", "tp", "pp", "fsdp"])
def test_bad_models_and_layouts_are_refused_naming_the_field(model: dict, parallel: ParallelConfig | None,
                                                            match: str) -> None:
    with pytest.raises(InvalidConfig, match=match):
        layout(model, parallel or ParallelConfig(dp=2))


def test_outside_a_scheduler_it_is_the_plain_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import TrainingArguments

    from tenplex.integrations.transformers import TenplexTrainer
    from tenplex.integrations.transformers.trainer import _ElasticOrder, check_arguments
    from tests.integrations.hf_job import Recorder, Tokens, build_model

    monkeypatch.delenv("TENPLEX_SCHEDULER_URL", raising=False)
    recorder = Recorder()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, use_cpu=True,
                             report_to="none", save_strategy="no", disable_tqdm=True, seed=0)
    trainer = TenplexTrainer(model=build_model(), args=args, train_dataset=Tokens(), data_collator=recorder.collate,
                             callbacks=[recorder])
    assert trainer.tenplex is None
    loader = trainer.get_train_dataloader()  # the Trainer's own: prepared (sharded) by accelerate, random order
    assert type(loader).__module__.startswith("accelerate") and not isinstance(loader.sampler, _ElasticOrder)
    out = trainer.train()
    assert out.global_step == 2 and sorted(recorder.samples) == [1, 2]  # (accelerate's loader collates one ahead)
    args.auto_find_batch_size = True
    with pytest.raises(InvalidConfig, match="auto_find_batch_size"):
        check_arguments(args)  # what a job cannot run is refused before the worker registers


def test_a_policy_table_entry_the_trainer_cannot_run_refuses_the_job() -> None:
    from tenplex.scheduler.state import JobSpec

    def job(table: dict) -> JobSpec:
        return JobSpec.from_json({"name": "hf", "layout": {"provider": "transformers", "model": LLAMA},
                                  "dataset": DATASET.to_json(), "command": ["python", "train.py"], "gpus": 2,
                                  "policy": {"table": table}})

    assert job({"2": {"dp": 2, "zero": 0}}).policy.table[2] == ParallelConfig(dp=2)
    with pytest.raises(InvalidConfig, match="entry for 4 GPUs cannot run: dp4 .*zero=3"):
        job({"2": {"dp": 2, "zero": 0}, "4": {"dp": 4, "zero": 3}})
    with pytest.raises(InvalidConfig, match="entry for 2 GPUs cannot run: .*tp=2"):
        job({"2": {"dp": 1, "tp": 2, "zero": 0}})
