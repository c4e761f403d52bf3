"""Key maps: built-in maps, validation, the registry, the fused-QKV split with grouped-query attention."""

from __future__ import annotations

import pytest
import torch

from tenplex.errors import InvalidConfig, InvalidInput
from tenplex.interop import keymap as km
from tenplex.ptc import PTC, Device, Region, TensorKind, build_tensor
from tenplex.transformer.cli import parse_pairs


def _ptc(*tensors) -> PTC:
    return PTC({}, (Device(0, "h0"),), tuple(tensors))


def _t(name: str, shape: tuple[int, ...], dtype: str = "float32", kind: TensorKind = TensorKind.PARAM):
    return build_tensor(name, shape, dtype, kind, [(Region.full(shape), (0,))])


def test_identity_maps_every_tensor_whole_but_extra_records() -> None:
    ptc = _ptc(_t("a.weight", (4, 2)), _t("optim/a.weight/step", (), kind=TensorKind.OPTIMIZER),
               _t("extra/rank0/state", (9,), "uint8", TensorKind.EXTRA))
    kmap = km.build("identity", ptc)
    assert [e.fqn for e in kmap.entries] == ["a.weight", "optim/a.weight/step"]
    assert kmap.uncovered(ptc) == []
    with pytest.raises(InvalidConfig, match="has no option"):
        km.build("identity", ptc, {"n_heads": "2"})


def test_torchtitan_splits_a_gqa_fused_qkv_as_its_save_hook_does() -> None:
    """2 kv heads, 2 query heads per kv head, head_dim 3: rows [kv, (q0, q1, k, v), 3], 4 columns; bias too."""
    n_kv, hpk, hd, dim = 2, 2, 3, 4
    rows = n_kv * (hpk + 2) * hd
    pre = "layers.1.attention.qkv_linear."
    ptc = _ptc(_t(pre + "wqkv.weight", (rows, dim)), _t(pre + "wqkv.bias", (rows,)),
               _t("layers.1.attention.wo.weight", (dim, n_kv * hpk * hd)),
               _t(f"optim/{pre}wqkv.weight/exp_avg", (rows, dim), kind=TensorKind.OPTIMIZER))
    kmap = km.build("torchtitan", ptc, {"head_dim": str(hd)})
    fused = torch.arange(rows * dim, dtype=torch.float32).reshape(rows, dim)
    w = fused.reshape(n_kv, hpk + 2, hd, dim)  # what FusedQKVLinear._split_qkv_on_save computes
    want = {"wq": w[:, :hpk].reshape(-1, dim), "wk": w[:, hpk].reshape(-1, dim), "wv": w[:, hpk + 1].reshape(-1, dim)}
    entries = kmap.by_fqn()
    for key, expected in want.items():
        e = entries[f"{pre}{key}.weight"]
        got = torch.full(e.shape, -1.0)
        for p in e.pieces:
            got[p.target.slices()] = fused[p.source.slices()]
        assert torch.equal(got, expected), key
        assert entries[f"{pre}{key}.bias"].shape == (expected.shape[0],)
    # the optimizer keeps the fused parameter's name, as torchtitan's flat optimizer state does
    assert entries[f"optimizer.state.{pre}wqkv.weight.exp_avg"].path == ("optimizer", f"state.{pre}wqkv.weight.exp_avg")
    assert km.build("torchtitan", ptc, {"n_heads": str(n_kv * hpk)}).by_fqn().keys() == entries.keys()
    with pytest.raises(InvalidConfig, match="no \\[n_kv"):
        km.build("torchtitan", ptc, {"head_dim": "5"})
    with pytest.raises(InvalidConfig, match="not an integer"):
        km.build("torchtitan", ptc, {"head_dim": "three"})


def test_torchtitan_param_groups_follow_recorded_param_names() -> None:
    ptc = _ptc(_t("a", (2,)), _t("b", (2,)), _t("optim/a/exp_avg", (2,), kind=TensorKind.OPTIMIZER),
               _t("optim/b/exp_avg", (2,), kind=TensorKind.OPTIMIZER))
    kmap = km.build("torchtitan", ptc)
    named = ({"lr": 0.1, "param_names": ["a"]}, {"lr": 0.2, "param_names": ["b"]})
    out = kmap.extras(km.ExportContext(3, None, named))
    assert out[("optimizer", "param_groups.a.lr")] == 0.1 and out[("optimizer", "param_groups.b.lr")] == 0.2
    assert out[("lr_scheduler", "last_epoch")] == 3 and ("train_state", "step") not in out
    one = kmap.extras(km.ExportContext(3, None, ({"lr": 0.3, "betas": (0.9, 0.95)},)))
    assert one[("optimizer", "param_groups.b.betas")] == (0.9, 0.95)


def user_map(ptc: PTC, options):
    """A user map: everything under ``model/``."""
    return km.KeyMap("user", tuple(km.Entry(("model", t.name), t.shape, t.dtype, (km.Piece(t.region, t.name, t.region),))
                                   for t in ptc.tensors))


def bad_map(ptc: PTC, options):
    t = ptc.tensors[0]
    half = Region(((0, t.shape[0] // 2), *((0, n) for n in t.shape[1:])))
    return km.KeyMap("bad", (km.Entry(("x",), t.shape, t.dtype, (km.Piece(half, t.name, half),)),))


def test_registry_resolves_names_and_module_functions() -> None:
    ptc = _ptc(_t("a.weight", (4, 2)))
    assert km.build(f"{__name__}:user_map", ptc).entries[0].fqn == "model.a.weight"
    with pytest.raises(InvalidConfig, match="cover 4 of 8"):
        km.build(f"{__name__}:bad_map", ptc)
    with pytest.raises(InvalidConfig, match="unknown key map 'nope'"):
        km.resolve("nope")
    with pytest.raises(InvalidConfig, match="cannot import"):
        km.resolve("no_such_module_xyz:f")
    with pytest.raises(InvalidConfig, match="has no function"):
        km.resolve(f"{__name__}:missing")
    assert parse_pairs(["a=1", "b=x=y"], "--key-map-option") == {"a": "1", "b": "x=y"}
    for bad in (["a"], ["=1"], ["a=1", "a=2"]):
        with pytest.raises(InvalidInput):
            parse_pairs(bad, "--key-map-option")


def test_validation_names_the_problem() -> None:
    ptc = _ptc(_t("a", (4,)), _t("b", (4,), "bfloat16"))
    full = Region.full((4,))

    def check(entries, match):
        with pytest.raises(InvalidConfig, match=match):
            km.validate(km.KeyMap("m", tuple(entries)), ptc)

    check([km.Entry(("x",), (4,), "float32", (km.Piece(full, "zz", full),))], "not in the PTC")
    check([km.Entry(("x",), (4,), "float32", (km.Piece(full, "b", full),))], "is float32, its piece of 'b' is bfloat16")
    check([km.Entry(("x",), (4,), "float32", (km.Piece(full, "a", full),)),
           km.Entry(("x",), (4,), "float32", (km.Piece(full, "a", full),))], "appears twice")
    half = Region(((0, 2),))
    check([km.Entry(("x",), (4,), "float32", (km.Piece(full, "a", full), km.Piece(half, "a", half)))], "cover 6 of 4")
    check([km.Entry(("x",), (4,), "float32", (km.Piece(half, "a", Region(((0, 3),))), km.Piece(Region(((2, 4),)), "a", half)))],
          "differ in shape")
    uncovered = km.KeyMap("m", (km.Entry(("x",), (2,), "float32", (km.Piece(half, "a", half),)),))
    assert km.validate(uncovered, ptc).uncovered(ptc) == [("a", Region(((2, 4),))), ("b", full)]
