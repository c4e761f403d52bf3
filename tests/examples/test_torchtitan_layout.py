"""torchtitan's llama3 layouts as Tenplex derives them (meta device, fake process group), and its checkpoint keys."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is installed by `make test` (.[clients])")

from examples.torchtitan.job import TitanConfig, model_config, split_wqkv, titan_ptc  # noqa: E402
from tenplex.errors import InvalidConfig  # noqa: E402
from tenplex.ptc import ParallelConfig, Placement, TensorKind  # noqa: E402

CFG = TitanConfig(n_layers=2, seq_len=32)
QKV = "layers.{}.attention.qkv_linear.wqkv.weight"


def _ptc(parallel: ParallelConfig):
    return titan_ptc(CFG, parallel, Placement.uniform(parallel.world_size, 4))


def _full_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = model_config(CFG, ParallelConfig()).build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def test_names_are_torchtitans_parameters_in_every_layout() -> None:
    full = {n: tuple(p.shape) for n, p in _full_model().named_parameters()}
    assert QKV.format(0) in full and "lm_head.weight" in full and len(full) == 2 + 2 * 7 + 1
    for parallel in (ParallelConfig(dp=2, zero=3), ParallelConfig(tp=2), ParallelConfig(pp=2),
                     ParallelConfig(dp=2, tp=2, zero=3), ParallelConfig(dp=2), ParallelConfig(tp=2, pp=2)):
        ptc = _ptc(parallel)  # constructing it checks that every tensor is tiled exactly
        assert {t.name: t.shape for t in ptc.tensors if t.kind is TensorKind.PARAM} == full, parallel.describe()
        assert ptc.config["mesh_roles"]["fsdp"] == "dp_shard"


def test_regions_follow_torchtitans_tp_fsdp_and_pipeline_split() -> None:
    qkv = QKV.format(0)
    tp = _ptc(ParallelConfig(tp=2)).tensor(qkv)  # ColwiseParallel: rows split over tp
    assert [(str(s.region), s.devices) for s in tp.shards] == [("[0:384, 0:256]", (0,)), ("[384:768, 0:256]", (1,))]
    both = _ptc(ParallelConfig(dp=2, tp=2, zero=3)).tensor(qkv)  # FSDP2 inside each TP half (_StridedShard)
    assert [(str(s.region), s.devices) for s in both.shards] == [
        ("[0:192, 0:256]", (0,)), ("[384:576, 0:256]", (1,)), ("[192:384, 0:256]", (2,)), ("[576:768, 0:256]", (3,))]
    replicated = _ptc(ParallelConfig(dp=2)).tensor(qkv)  # zero=0: dp_replicate, whole copies
    assert [s.devices for s in replicated.shards] == [(0, 1)]
    pp = _ptc(ParallelConfig(pp=2))  # pipeline_llm's split: embeddings and layer 0, then layer 1, norm, head
    assert pp.tensor("tok_embeddings.weight").shards[0].devices == (0,)
    assert pp.tensor(qkv).shards[0].devices == (0,)
    assert pp.tensor(QKV.format(1)).shards[0].devices == (1,)
    assert pp.tensor("lm_head.weight").shards[0].devices == (1,)


def test_unsupported_configurations_are_clear_errors() -> None:
    with pytest.raises(InvalidConfig, match="tp=3 must divide"):
        _ptc(ParallelConfig(tp=3))
    with pytest.raises(InvalidConfig, match="2 layers cannot fill 4 pipeline stages"):
        _ptc(ParallelConfig(pp=4))
    with pytest.raises(InvalidConfig, match="zero=1"):
        _ptc(ParallelConfig(dp=2, zero=1))
    with pytest.raises(InvalidConfig, match="unknown llama3 flavor"):
        TitanConfig(flavor="tiny")


def test_the_checkpoint_key_mapping_is_torchtitans_own() -> None:
    """``split_wqkv`` (the documented mapping) gives what torchtitan's state-dict hook saves as wq/wk/wv."""
    model = _full_model()
    params = dict(model.named_parameters())
    sd = model.state_dict()
    attention = model_config(CFG, ParallelConfig()).layers[0].attention
    n_kv = getattr(attention, "n_kv_heads", None) or attention.n_heads
    for i in range(CFG.n_layers):
        prefix = f"layers.{i}.attention.qkv_linear."
        assert f"{prefix}wqkv.weight" not in sd
        wq, wk, wv = split_wqkv(params[f"{prefix}wqkv.weight"].detach(), attention.n_heads, n_kv)
        assert torch.equal(sd[f"{prefix}wq.weight"], wq)
        assert torch.equal(sd[f"{prefix}wk.weight"], wk)
        assert torch.equal(sd[f"{prefix}wv.weight"], wv)
    others = {n for n in params if "wqkv" not in n}
    assert others <= set(sd) and all(torch.equal(sd[n], params[n]) for n in others)
