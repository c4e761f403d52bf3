"""The reference GPT in one process: global names, configuration-independent values, data."""

from __future__ import annotations

import pytest
import torch

from examples.gpt.model import GPT, GPTConfig, cross_entropy_loss
from examples.gpt.parallelize import check_supported, pipeline_stage_module
from examples.gpt.train import SyntheticTokens, build_stage
from tenplex.errors import InvalidConfig
from tenplex.ptc import ParallelConfig

CFG = GPTConfig(vocab=50, dim=24, n_layers=5, n_heads=3, ffn_dim=40, seq_len=8, gated=True)


def test_stages_keep_global_names_and_the_full_models_values() -> None:
    full = dict(GPT(CFG, seed=3).named_parameters())
    parallel = ParallelConfig(pp=3, layers_per_stage=(1, 3, 1))
    seen: dict[str, torch.Tensor] = {}
    for stage in range(3):
        module = build_stage(CFG, parallel, stage, seed=3, device="cpu")
        names = dict(module.named_parameters())
        assert not set(names) & set(seen), "a parameter is on two stages"
        seen.update(names)
    assert set(seen) == set(full)
    for name, p in seen.items():
        assert torch.equal(p, full[name]), name
    middle = build_stage(CFG, parallel, 1, seed=3, device="cpu")
    assert list(middle.layers.keys()) == ["1", "2", "3"]
    assert middle.tok_embeddings is None and middle.output is None and middle.norm is None


def test_values_depend_on_the_seed_only() -> None:
    a = dict(GPT(CFG, seed=1).named_parameters())
    b = dict(GPT(CFG, seed=1, layer_ids=[4]).named_parameters())
    c = dict(GPT(CFG, seed=2).named_parameters())
    assert torch.equal(a["layers.4.attention.wq.weight"], b["layers.4.attention.wq.weight"])
    assert not torch.equal(a["layers.4.attention.wq.weight"], c["layers.4.attention.wq.weight"])
    assert torch.equal(a["layers.0.attention_norm.weight"], torch.ones(CFG.dim))
    # distinct generators per parameter: same-shaped weights differ
    assert not torch.equal(a["layers.0.attention.wq.weight"], a["layers.0.attention.wk.weight"])


def test_pipeline_of_stages_computes_the_full_forward() -> None:
    tokens = SyntheticTokens(16, CFG.seq_len, CFG.vocab, seed=5).batch(range(4))
    full = GPT(CFG, seed=9)
    parallel = ParallelConfig(pp=2)
    h = tokens[:, :-1]
    for stage in range(2):
        h = build_stage(CFG, parallel, stage, seed=9, device="cpu")(h)
    torch.testing.assert_close(h, full(tokens[:, :-1]), rtol=0, atol=0)
    loss = cross_entropy_loss(h, tokens[:, 1:])
    assert loss.shape == () and 2.0 < loss.item() < 6.0  # about ln(50) at init


def test_tied_embeddings_share_one_parameter() -> None:
    model = GPT(GPTConfig(vocab=20, dim=8, n_layers=1, n_heads=2, tied=True), seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in dict(model.named_parameters())


def test_synthetic_tokens_are_deterministic_and_in_range() -> None:
    data = SyntheticTokens(100, 12, 30, seed=4)
    a, b = data.batch([3, 7]), SyntheticTokens(100, 12, 30, seed=4).batch([3, 7])
    assert a.shape == (2, 13) and a.dtype == torch.int64
    assert torch.equal(a, b)
    assert not torch.equal(a[0], a[1])
    assert int(a.min()) >= 0 and int(a.max()) < 30
    with pytest.raises(InvalidConfig, match="sample 100 is outside 0..99"):
        data.sample(100)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dim": 10, "n_heads": 3}, "dim 10 is not divisible by n_heads 3"),
        ({"vocab": 0}, "vocab must be a positive integer, got 0"),
        ({"ffn_dim": -1}, "ffn_dim must be a positive integer, got -1"),
    ],
)
def test_bad_model_configs(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        GPTConfig(**kwargs)


def test_bad_stage_and_layer_requests() -> None:
    with pytest.raises(InvalidConfig, match=r"layer ids \[5\] are outside 0..4"):
        GPT(CFG, layer_ids=[5])
    with pytest.raises(InvalidConfig, match="stage 2 is outside 0..1"):
        pipeline_stage_module(GPT(CFG), 2, 2, ParallelConfig(pp=2))
    with pytest.raises(InvalidConfig, match="zero=2"):
        check_supported(CFG, ParallelConfig(dp=2, zero=2))
