"""The Megatron GPT layout provider.

The main check is an independent simulation of what every Megatron rank
physically holds: each global tensor is filled with its element ids, every
rank's local tensor-parallel shards are cut with numpy, its distributed-optimizer
buffer is built by flattening them in reverse registration order at 64-element
aligned offsets, cut into buckets (a bucket size, the tied embedding of a
pipelined job alone), each bucket padded to ``lcm(dp, 128)`` and sliced by dp
rank, as megatron-core 0.19.2 does. The ids a rank ends up with must be
exactly the ids of the PTC's shards for that device. (That megatron-core
itself does this is checked on real processes in test_ptc_megatron_core.py.)
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenplex.errors import InvalidConfig, InvalidInput
from tenplex.ptc import PTC, DatasetState, ParallelConfig, Region, TensorKind
from tenplex.ptc.megatron import (
    GPTSpec,
    buffer_layout,
    core_checkpoint_key,
    megatron_gpt_ptc,
    tensor_name_from_core_key,
)

# -- the reference simulation ------------------------------------------------------


def _stage_params(spec: GPTSpec, vocab: int, layers: range, first: bool, last: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, global shape, how tp cuts it) in registration order, written from megatron-core's GPTModel."""
    h, f = spec.hidden, spec.ffn_hidden or 4 * spec.hidden
    kv = spec.kv_heads or spec.heads
    qkv = (spec.heads + 2 * kv) * (h // spec.heads)
    fc1 = "gated" if spec.gated_mlp else "col"
    core = spec.naming == "megatron-core"
    norms = ("weight", "bias") if spec.normalization == "LayerNorm" else ("weight",)
    out = []
    if first:
        out.append(("embedding.word_embeddings.weight", (vocab, h), "col"))
        if spec.seq_len:
            out.append(("embedding.position_embeddings.weight", (spec.seq_len, h), "rep"))
    for i in layers:
        p = f"decoder.layers.{i}." if core else f"layers.{i}."
        out += [(p + "input_layernorm." + w, (h,), "rep") for w in norms]
        out.append((p + "self_attention.linear_proj.weight", (h, h), "row"))
        if spec.bias:
            out.append((p + "self_attention.linear_proj.bias", (h,), "rep"))
        out.append((p + "self_attention.linear_qkv.weight", (qkv, h), "col"))
        if spec.bias:
            out.append((p + "self_attention.linear_qkv.bias", (qkv,), "col"))
        out += [(p + "pre_mlp_layernorm." + w, (h,), "rep") for w in norms]
        out.append((p + "mlp.linear_fc1.weight", ((2 if spec.gated_mlp else 1) * f, h), fc1))
        if spec.bias:
            out.append((p + "mlp.linear_fc1.bias", ((2 if spec.gated_mlp else 1) * f,), fc1))
        out.append((p + "mlp.linear_fc2.weight", (h, f), "row"))
        if spec.bias:
            out.append((p + "mlp.linear_fc2.bias", (h,), "rep"))
    if last:
        out += [(("decoder.final_layernorm." if core else "final_layernorm.") + w, (h,), "rep") for w in norms]
        if not spec.tied_embeddings:
            out.append(("output_layer.weight", (vocab, h), "col"))
        elif not first:
            out.append(("embedding.word_embeddings.weight", (vocab, h), "col"))
    return out


def _local(ids: np.ndarray, how: str, t: int, tp: int) -> np.ndarray:
    if how == "rep":
        return ids
    if how == "col":
        return np.split(ids, tp, axis=0)[t]
    if how == "row":
        return np.split(ids, tp, axis=1)[t]
    gate, up = np.split(ids, 2, axis=0)
    return np.concatenate([np.split(gate, tp, axis=0)[t], np.split(up, tp, axis=0)[t]])


def _buffer(sizes: list[int], alone: list[bool], dp: int, bucket_size: int | None) -> tuple[list[int], list[tuple[int, int]]]:
    """Offsets of the (already reversed) parameters and the padded buckets, one bucket at a time."""
    multiple = dp * 128 // math.gcd(dp, 128)
    offsets: list[int] = []
    buckets: list[tuple[int, int]] = []
    members: list[int] = []  # parameters of the open bucket
    pos = bucket_start = 0
    for i, size in enumerate(sizes):
        pos = -(-pos // 64) * 64
        if alone[i] and members:  # the tied embedding never shares a bucket
            buckets.append((bucket_start, -(-pos // multiple) * multiple))
            pos = bucket_start = buckets[-1][1]
            members = []
        offsets.append(pos)
        members.append(i)
        pos += size
        if alone[i] or (bucket_size is not None and pos - bucket_start >= bucket_size):
            buckets.append((bucket_start, -(-pos // multiple) * multiple))
            pos = bucket_start = buckets[-1][1]
            members = []
    if members:
        buckets.append((bucket_start, -(-pos // multiple) * multiple))
    return offsets, buckets


def simulate(spec: GPTSpec, par: ParallelConfig) -> dict[int, dict[str, np.ndarray]]:
    """rank -> tensor name -> sorted element ids it holds (params and optimizer state)."""
    dp, tp, pp = par.dp, par.tp, par.pp
    multiple = spec.make_vocab_size_divisible_by * tp
    vocab = (spec.vocab + multiple - 1) // multiple * multiple if spec.pad_vocab else spec.vocab
    if pp == 1:
        sizes = [spec.num_layers]
    elif par.layers_per_stage:
        sizes = list(par.layers_per_stage)
    else:
        sizes = [spec.num_layers // pp + (1 if s < spec.num_layers % pp else 0) for s in range(pp)]
    bounds = np.cumsum([0, *sizes])
    bucket_size = None
    if spec.overlap_grad_reduce:
        bucket_size = spec.ddp_bucket_size or max(40_000_000, 1_000_000 * dp)
    held: dict[int, dict[str, list[np.ndarray]]] = defaultdict(lambda: defaultdict(list))
    for s in range(pp):
        params = _stage_params(spec, vocab, range(bounds[s], bounds[s + 1]), s == 0, s == pp - 1)
        for t in range(tp):
            locals_ = [(name, _local(np.arange(int(np.prod(shape))).reshape(shape), how, t, tp)) for name, shape, how in params]
            # the distributed optimizer's buffer: reverse registration order
            order = list(reversed(locals_))
            alone = [spec.tied_embeddings and pp > 1 and name == "embedding.word_embeddings.weight" for name, _ in order]
            offsets, buckets = _buffer([a.size for _, a in order], alone, dp, bucket_size if s == 0 else None)
            flat = np.full(buckets[-1][1], -1)
            owner = np.full(buckets[-1][1], -1)
            for i, ((_, a), off) in enumerate(zip(order, offsets, strict=True)):
                flat[off:off + a.size] = a.reshape(-1)
                owner[off:off + a.size] = i
            for d in range(dp):
                rank = (s * dp + d) * tp + t
                own = np.zeros(flat.size, dtype=bool)
                for start, end in buckets:
                    part = (end - start) // dp
                    own[start + d * part:start + (d + 1) * part] = True
                for i, (name, a) in enumerate(order):
                    mine = flat[own & (owner == i)]
                    param_ids = mine if par.zero == 3 else a.reshape(-1)
                    optim_ids = mine if par.zero else a.reshape(-1)
                    held[rank][name].append(param_ids)
                    held[rank]["optim/" + name].append(optim_ids)
    out: dict[int, dict[str, np.ndarray]] = {}
    for rank, tensors in held.items():
        out[rank] = {name: np.sort(np.concatenate(parts)) for name, parts in tensors.items()}
        out[rank] = {k: v for k, v in out[rank].items() if v.size}
    return out


def ptc_holdings(ptc: PTC) -> dict[int, dict[str, np.ndarray]]:
    """The same view read from a PTC (optimizer tensors merged per parameter)."""
    acc: dict[int, dict[str, list[np.ndarray]]] = defaultdict(lambda: defaultdict(list))
    for tensor in ptc.tensors:
        ids = np.arange(tensor.numel).reshape(tensor.shape)
        if tensor.kind is TensorKind.OPTIMIZER:
            name, suffix = tensor.name.rsplit("/", 1)
            if suffix != "exp_avg":
                continue  # master and exp_avg_sq are laid out exactly like exp_avg (checked separately)
        else:
            name = tensor.name
        for shard in tensor.shards:
            for d in shard.devices:
                acc[d][name].append(ids[shard.region.slices()].reshape(-1))
    return {d: {k: np.sort(np.concatenate(v)) for k, v in t.items()} for d, t in acc.items()}


def check_layout(spec: GPTSpec, par: ParallelConfig, precision: str, gpus_per_node: int = 8) -> PTC:
    ptc = megatron_gpt_ptc(spec, par, precision=precision, gpus_per_node=gpus_per_node)
    # every tensor's shards tile it exactly (checked independently of PTC validation)
    for t in ptc.tensors:
        cover = np.zeros(t.shape, dtype=np.int64)
        for s in t.shards:
            cover[s.region.slices()] += 1
        assert (cover == 1).all(), t.name
    expected = simulate(spec, par)
    got = ptc_holdings(ptc)
    assert set(expected) == set(range(par.world_size))
    assert set(got) <= set(expected)  # a ZeRO-3 rank of a tiny model may own only bucket padding
    for rank in expected:
        got.setdefault(rank, {})
        assert set(got[rank]) == set(expected[rank]), rank
        for name, ids in expected[rank].items():
            assert np.array_equal(got[rank][name], ids), (rank, name)
    # optimizer tensors: the right set and dtypes; master/exp_avg_sq sharded like exp_avg
    pdtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[precision]
    suffixes = ["exp_avg", "exp_avg_sq"] if precision == "fp32" else ["master", "exp_avg", "exp_avg_sq"]
    params = [t for t in ptc.tensors if t.kind is TensorKind.PARAM]
    assert all(t.dtype == pdtype for t in params)
    for p in params:
        ref = ptc.tensor(f"optim/{p.name}/exp_avg")
        for suffix in suffixes:
            o = ptc.tensor(f"optim/{p.name}/{suffix}")
            assert (o.shape, o.dtype, o.shards) == (p.shape, "float32", ref.shards)
    assert len(ptc.tensors) == len(params) * (1 + len(suffixes))
    # bytes per device: the simulation's element counts times the item sizes
    per_device = ptc.bytes_per_device()
    psize = {"bfloat16": 2, "float16": 2, "float32": 4}[pdtype]
    for rank, tensors in expected.items():
        want = sum(
            ids.size * (4 * len(suffixes) if name.startswith("optim/") else psize) for name, ids in tensors.items()
        )
        assert per_device[rank] == want
    return ptc


@st.composite
def configs(draw: st.DrawFn) -> tuple[GPTSpec, ParallelConfig, str]:
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.integers(1, 3))
    dp = draw(st.integers(1, 3))
    kv = draw(st.sampled_from([tp, 2 * tp]))
    heads = kv * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([1, 2, 3, 12]))  # 12: parameters beyond the 64-element alignment
    layers = draw(st.integers(pp, pp + 3))
    split = None
    if pp > 1 and draw(st.booleans()):
        cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1)))
        split = tuple(b - a for a, b in zip([0, *cuts], [*cuts, layers], strict=True))
    pad_vocab = draw(st.booleans())
    overlap = draw(st.booleans())
    spec = GPTSpec(
        num_layers=layers,
        hidden=heads * head_dim,
        heads=heads,
        kv_heads=kv if draw(st.booleans()) else None,
        vocab=draw(st.integers(1, 40)) if pad_vocab else tp * draw(st.integers(1, 10)),
        ffn_hidden=tp * draw(st.integers(1, 3)) if draw(st.booleans()) else None,
        tied_embeddings=draw(st.booleans()),
        gated_mlp=draw(st.booleans()),
        seq_len=draw(st.sampled_from([0, 3])),
        make_vocab_size_divisible_by=draw(st.sampled_from([1, 4])),
        bias=draw(st.booleans()),
        normalization=draw(st.sampled_from(["LayerNorm", "RMSNorm"])),
        naming=draw(st.sampled_from(["megatron-lm", "megatron-core"])),
        pad_vocab=pad_vocab,
        overlap_grad_reduce=overlap,
        ddp_bucket_size=draw(st.integers(1, 2000)) if overlap else None,
    )
    par = ParallelConfig(dp=dp, tp=tp, pp=pp, zero=draw(st.integers(0, 3)), layers_per_stage=split)
    return spec, par, draw(st.sampled_from(["bf16", "fp16", "fp32"]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_random_layouts_match_the_simulation(case: tuple[GPTSpec, ParallelConfig, str]) -> None:
    spec, par, precision = case
    check_layout(spec, par, precision, gpus_per_node=4)


@pytest.mark.parametrize(
    ("spec", "par"),
    [
        # tied embeddings across stages with a dp cut inside the shared embedding on one stage only
        (GPTSpec(3, 8, 2, 30, tied_embeddings=True, seq_len=5, make_vocab_size_divisible_by=1), ParallelConfig(dp=3, tp=2, pp=2, zero=1)),
        (GPTSpec(4, 8, 4, 17, kv_heads=2, gated_mlp=True, tied_embeddings=True, seq_len=0), ParallelConfig(dp=4, tp=2, pp=3, zero=3, layers_per_stage=(1, 2, 1))),
        (GPTSpec(2, 4, 2, 9, bias=False), ParallelConfig(dp=5, tp=1, pp=1, zero=2)),
    ],
)
def test_chosen_layouts_match_the_simulation(spec: GPTSpec, par: ParallelConfig) -> None:
    check_layout(spec, par, "bf16", gpus_per_node=8)


# -- golden layout, checked by hand ------------------------------------------------


def test_golden_two_layer_gpt_dp3_tp2_zero1() -> None:
    """hidden 8, 2 heads, ffn 16, vocab 10 padded to 16, 6 positions, dp3 x tp2 x pp1, ZeRO-1.

    Ranks: dp0tp0=0, dp0tp1=1, dp1tp0=2, ..., dp2tp1=5. Each tp rank's buffer, reverse
    registration order, every parameter at a multiple of 64: output_layer [0, 64),
    final_layernorm bias [64, 72) and weight [128, 136), layer 1 from fc2.bias [192, 200)
    to input_layernorm.weight [960, 968), layer 0 from fc2.bias [1024, 1032), ...,
    linear_qkv.weight [1472, 1568) (12 x 8 per tp rank), linear_proj.bias [1600, 1608), ...,
    position embeddings [1856, 1904), word embeddings [1920, 1984). 1984 elements padded to
    a multiple of lcm(3, 128) = 384: 2304, 768 per dp rank. The cut at 768 falls between
    layer 1's linear_qkv.weight (dp0) and its linear_proj.bias (dp1: megatron-core registers
    linear_proj before linear_qkv, so qkv comes first in the reversed buffer); the cut at
    1536 falls 64 elements (8 rows) into layer 0's local linear_qkv.weight.
    """
    spec = GPTSpec(num_layers=2, hidden=8, heads=2, vocab=10, ffn_hidden=16, seq_len=6, make_vocab_size_divisible_by=4)
    ptc = megatron_gpt_ptc(spec, ParallelConfig(dp=3, tp=2, pp=1, zero=1), gpus_per_node=8)

    def shards(name: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(s.region.format(), s.devices) for s in ptc.tensor(name).shards]

    assert ptc.config["padded_vocab"] == 16 and ptc.config["naming"] == "megatron-lm"
    assert [(d.id, d.host, dict(d.coords)) for d in ptc.devices][:3] == [
        (0, "node-0", {"dp": 0, "tp": 0, "pp": 0}),
        (1, "node-0", {"dp": 0, "tp": 1, "pp": 0}),
        (2, "node-0", {"dp": 1, "tp": 0, "pp": 0}),
    ]
    # params: vocab-parallel, column-parallel, row-parallel, replicated
    assert shards("embedding.word_embeddings.weight") == [("0:8,0:8", (0, 2, 4)), ("8:16,0:8", (1, 3, 5))]
    assert shards("layers.0.self_attention.linear_qkv.weight") == [("0:12,0:8", (0, 2, 4)), ("12:24,0:8", (1, 3, 5))]
    assert shards("layers.1.self_attention.linear_proj.weight") == [("0:8,0:4", (0, 2, 4)), ("0:8,4:8", (1, 3, 5))]
    assert shards("layers.1.mlp.linear_fc2.weight") == [("0:8,0:8", (0, 2, 4)), ("0:8,8:16", (1, 3, 5))]
    assert shards("layers.0.input_layernorm.bias") == [("0:8", (0, 1, 2, 3, 4, 5))]
    assert ptc.tensor("layers.0.input_layernorm.bias").dtype == "bfloat16"
    # optimizer: the end of the buffer (output layer, final norm, layer 1 up to its qkv) is dp0's ...
    assert shards("optim/output_layer.weight/master") == [("0:8,0:8", (0,)), ("8:16,0:8", (1,))]
    assert shards("optim/layers.1.mlp.linear_fc1.weight/exp_avg") == [("0:8,0:8", (0,)), ("8:16,0:8", (1,))]
    assert shards("optim/layers.1.self_attention.linear_qkv.weight/exp_avg") == [("0:12,0:8", (0,)), ("12:24,0:8", (1,))]
    # ... from layer 1's linear_proj to layer 0's first 8 qkv rows of each tp rank dp1's ...
    assert shards("optim/layers.1.self_attention.linear_proj.bias/exp_avg_sq") == [("0:8", (2, 3))]
    assert shards("optim/layers.0.mlp.linear_fc2.weight/exp_avg") == [("0:8,0:8", (2,)), ("0:8,8:16", (3,))]
    assert shards("optim/layers.0.self_attention.linear_qkv.weight/exp_avg") == [
        ("0:8,0:8", (2,)),
        ("12:20,0:8", (3,)),
        ("8:12,0:8", (4,)),
        ("20:24,0:8", (5,)),
    ]
    # ... and the rest of layer 0 and the embeddings dp2's
    assert shards("optim/layers.0.input_layernorm.weight/exp_avg") == [("0:8", (4, 5))]
    assert shards("optim/embedding.word_embeddings.weight/exp_avg") == [("0:8,0:8", (4,)), ("8:16,0:8", (5,))]
    assert ptc.tensor("optim/layers.0.input_layernorm.weight/exp_avg").dtype == "float32"


def test_golden_pp2_dp2_recorded_from_megatron_core() -> None:
    """The flat ranges megatron-core 0.19.2 itself gave each rank (``_build_gbuf_range_map``).

    hidden 8, 2 heads, ffn 32, vocab 16, 6 positions, pp2 x dp2, megatron-core names. Recorded
    on 4 gloo processes: rank 0 (pp0 dp0) owns layer 0's pre_mlp_layernorm and MLP; rank 1
    (pp0 dp1) its attention, input_layernorm and the embeddings; rank 2 (pp1 dp0) the output
    layer, the final norm, layer 1's fc2 and fc1.bias and flat [0, 128) of the 32 x 8
    fc1.weight; rank 3 (pp1 dp1) fc1.weight [128, 256) and the rest of layer 1, linear_qkv
    included (the provider used to order qkv after proj and give rank 2 the wrong range).
    """
    spec = GPTSpec(num_layers=2, hidden=8, heads=2, vocab=16, seq_len=6, naming="megatron-core")
    ptc = megatron_gpt_ptc(spec, ParallelConfig(dp=2, pp=2, zero=1), gpus_per_node=4)
    owned: dict[int, set[str]] = defaultdict(set)
    for t in ptc.tensors:
        if t.name.endswith("/exp_avg"):
            for shard in t.shards:
                owned[shard.devices[0]].add(t.name.removeprefix("optim/").removesuffix("/exp_avg"))
            assert all(len(shard.devices) == 1 for shard in t.shards)
    mlp = {"pre_mlp_layernorm.bias", "pre_mlp_layernorm.weight", "mlp.linear_fc1.bias", "mlp.linear_fc1.weight",
           "mlp.linear_fc2.bias", "mlp.linear_fc2.weight"}
    attention = {"input_layernorm.bias", "input_layernorm.weight", "self_attention.linear_qkv.bias",
                 "self_attention.linear_qkv.weight", "self_attention.linear_proj.bias", "self_attention.linear_proj.weight"}
    assert owned[0] == {f"decoder.layers.0.{n}" for n in mlp}
    assert owned[1] == {f"decoder.layers.0.{n}" for n in attention} | {
        "embedding.word_embeddings.weight", "embedding.position_embeddings.weight"}
    assert owned[2] == {"output_layer.weight", "decoder.final_layernorm.bias", "decoder.final_layernorm.weight"} | {
        f"decoder.layers.1.mlp.{n}" for n in ("linear_fc2.bias", "linear_fc2.weight", "linear_fc1.bias", "linear_fc1.weight")}
    assert owned[3] == {f"decoder.layers.1.{n}" for n in attention | {"pre_mlp_layernorm.bias", "pre_mlp_layernorm.weight",
                                                                    "mlp.linear_fc1.weight"}}
    fc1 = ptc.tensor("optim/decoder.layers.1.mlp.linear_fc1.weight/exp_avg")
    assert [(s.region.format(), s.devices) for s in fc1.shards] == [("0:16,0:8", (2,)), ("16:32,0:8", (3,))]


def test_golden_tied_gated_pp2() -> None:
    """Tied embeddings live on the first and the last stage; the gated fc1 of a tp rank is
    its slice of the gate rows and its slice of the up rows."""
    spec = GPTSpec(num_layers=2, hidden=4, heads=2, vocab=8, ffn_hidden=4, tied_embeddings=True, gated_mlp=True,
                   seq_len=0, make_vocab_size_divisible_by=4)
    ptc = megatron_gpt_ptc(spec, ParallelConfig(dp=1, tp=2, pp=2), gpus_per_node=2, hosts=["a", "b"])
    assert [d.host for d in ptc.devices] == ["a", "a", "b", "b"]
    emb = ptc.tensor("embedding.word_embeddings.weight")
    assert [(s.region.format(), s.devices) for s in emb.shards] == [("0:4,0:4", (0, 2)), ("4:8,0:4", (1, 3))]
    assert not ptc.has_tensor("output_layer.weight")
    assert not ptc.has_tensor("embedding.position_embeddings.weight")
    fc1 = ptc.tensor("layers.1.mlp.linear_fc1.weight")
    assert fc1.shape == (8, 4)
    assert [(s.region.format(), s.devices) for s in fc1.shards] == [
        ("0:2,0:4", (2,)), ("4:6,0:4", (2,)), ("2:4,0:4", (3,)), ("6:8,0:4", (3,)),
    ]
    assert [s.devices for s in ptc.tensor("final_layernorm.weight").shards] == [(2, 3)]
    assert [s.devices for s in ptc.tensor("layers.0.input_layernorm.weight").shards] == [(0, 1)]


def test_gpt3_175b_shape_and_bytes() -> None:
    """The benchmark layout: 1024 devices, every tensor tiled, the known parameter count."""
    spec = GPTSpec(num_layers=96, hidden=12288, heads=96, vocab=51200)
    ptc = megatron_gpt_ptc(spec, ParallelConfig(dp=8, tp=8, pp=16, zero=1))
    assert len(ptc.devices) == 1024 and len(ptc.hosts) == 128
    params = sum(t.numel for t in ptc.tensors if t.kind is TensorKind.PARAM)
    assert params == spec.num_params(8) and 174e9 < params < 176e9
    per_device = ptc.bytes_per_device()
    # bf16 params (2 B) replicated across dp8, fp32 master + 2 moments (12 B) split across dp;
    # layer norms and row-parallel biases have one such copy on each of the 8 tp ranks
    want = 0
    for t in ptc.tensors:
        if t.kind is TensorKind.PARAM:
            tp_copies = 1 if len(t.shards) == 8 else 8
            want += t.numel * tp_copies * (2 * 8 + 12)
    assert sum(per_device.values()) == want
    assert max(per_device.values()) < 5.2e9  # about 175e9 * (2 + 12 / 8) / 128
    assert ptc.dataset is None
    again = PTC.loads(ptc.dumps())
    assert again.to_json() == ptc.to_json()


# -- invalid combinations ----------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: GPTSpec(2, 10, 3, 10), "hidden 10 is not divisible by heads 3"),
        (lambda: GPTSpec(2, 8, 4, 10, kv_heads=3), "heads 4 must be a multiple of kv_heads 3"),
        (lambda: GPTSpec(2, 8, 4, 10, kv_heads=8), "heads 4 must be a multiple of kv_heads 8"),
        (lambda: GPTSpec(0, 8, 4, 10), "num_layers must be an integer >= 1, got 0"),
        (lambda: GPTSpec(2, 8, 4, 10, seq_len=-1), "seq_len must be an integer >= 0, got -1"),
        (lambda: GPTSpec(2, 8, 4, 10, tied_embeddings=1), "tied_embeddings must be true or false, got 1"),
        (lambda: GPTSpec(2, 8, 4, 10, ffn_hidden=0), "ffn_hidden must be an integer >= 1, got 0"),
        (lambda: GPTSpec(2, 8, 4, 10, naming="hf"), "naming must be one of megatron-lm, megatron-core, got 'hf'"),
        (lambda: GPTSpec(2, 8, 4, 10, normalization="rms"), "normalization must be one of LayerNorm, RMSNorm, got 'rms'"),
        (lambda: GPTSpec(2, 8, 4, 10, pad_vocab="no"), "pad_vocab must be true or false, got 'no'"),
        (lambda: GPTSpec(2, 8, 4, 10, ddp_bucket_size=0), "ddp_bucket_size must be an integer >= 1, got 0"),
    ],
)
def test_invalid_specs(make: object, message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        make()  # type: ignore[operator]


SPEC = GPTSpec(num_layers=4, hidden=16, heads=4, kv_heads=2, vocab=50, ffn_hidden=24)


@pytest.mark.parametrize(
    ("par", "kwargs", "message"),
    [
        (ParallelConfig(tp=8), {}, r"tp=8 does not divide the model: heads 4 % tp 8 = 4; kv_heads 2 % tp 8 = 2$"),
        (ParallelConfig(tp=4), {}, r"kv_heads 2 % tp 4 = 2"),
        (ParallelConfig(pp=5), {}, "4 layers cannot fill 5 pipeline stages"),
        (ParallelConfig(pp=2, layers_per_stage=(1, 2)), {}, r"layers_per_stage \[1, 2\] sums to 3, the model has 4 layers"),
        (ParallelConfig(tp=2), {"gpus_per_node": 3}, "tp=2 must divide the 3 GPUs per node"),
        (ParallelConfig(dp=4, tp=2), {"gpus_per_node": 4, "hosts": ["a"]}, "needs 8 GPUs; 1 hosts x 4 have 4"),
        (ParallelConfig(dp=2), {"hosts": ["a", "a"]}, "host names must be distinct"),
        (ParallelConfig(), {"precision": "fp8"}, "precision must be one of bf16, fp16, fp32, got 'fp8'"),
        (ParallelConfig(dp=3), {"dataset": DatasetState(100, 0, 8)}, "global batch size 8 is not divisible by data-parallel size 3"),
    ],
)
def test_invalid_combinations_name_the_values(par: ParallelConfig, kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        megatron_gpt_ptc(SPEC, par, **kwargs)


def test_padded_vocab_and_dataset() -> None:
    spec = GPTSpec(num_layers=1, hidden=4, heads=1, vocab=50257)
    assert spec.padded_vocab(1) == 50304
    assert spec.padded_vocab(8) == 51200
    with pytest.raises(InvalidConfig, match="tp must be an integer >= 1, got 0"):
        spec.padded_vocab(0)
    data = DatasetState(1000, 5, 8, 64)
    ptc = megatron_gpt_ptc(spec, ParallelConfig(dp=4), dataset=data)
    assert ptc.dataset == data
    assert PTC.loads(ptc.dumps()).dataset == data
    # the config records the model, so the layout can be rebuilt from the PTC alone
    assert GPTSpec(**ptc.config["model"]) == spec
    assert ParallelConfig.from_json({k: ptc.config[k] for k in ("dp", "tp", "pp", "zero")}) == ParallelConfig(dp=4)
    # the layout is a pure function of its inputs
    assert megatron_gpt_ptc(spec, ParallelConfig(dp=4), dataset=data).to_json() == ptc.to_json()
    assert Region.full(ptc.tensor("embedding.word_embeddings.weight").shape) == Region(((0, 50304), (0, 4)))


# -- conventions: megatron-core names, vocabulary padding, checkpoint keys ---------


def test_megatron_core_naming_and_no_padding() -> None:
    """GPTModel's own names (decoder. prefix, global layer numbers) and its unpadded vocabulary."""
    spec = GPTSpec(num_layers=4, hidden=8, heads=4, vocab=50, kv_heads=2, gated_mlp=True, normalization="RMSNorm",
                   bias=False, seq_len=0, naming="megatron-core")
    assert spec.pad_vocab is False  # the convention's default, recorded resolved
    ptc = megatron_gpt_ptc(spec, ParallelConfig(tp=2, pp=2), gpus_per_node=4)
    params = [t.name for t in ptc.tensors if t.kind is TensorKind.PARAM]
    assert params[:7] == [
        "embedding.word_embeddings.weight",
        "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
    ]
    assert params[-2:] == ["decoder.final_layernorm.weight", "output_layer.weight"]
    assert "decoder.layers.3.mlp.linear_fc1.weight" in params  # global layer numbers on the last stage
    assert ptc.tensor("embedding.word_embeddings.weight").shape == (50, 8)
    assert ptc.config["padded_vocab"] == 50 and ptc.config["naming"] == "megatron-core"
    # Megatron-LM's script: the same names, the vocabulary padded to 128 * tp
    padded = megatron_gpt_ptc(replace(spec, pad_vocab=True), ParallelConfig(tp=2, pp=2), gpus_per_node=4)
    assert padded.tensor("output_layer.weight").shape == (256, 8)
    # megatron-lm naming pads by default and has no prefix
    lm = GPTSpec(num_layers=2, hidden=8, heads=4, vocab=50)
    assert lm.pad_vocab is True and lm.padded_vocab(2) == 256
    assert megatron_gpt_ptc(lm, ParallelConfig()).has_tensor("layers.1.self_attention.linear_qkv.bias")
    assert GPTSpec(num_layers=2, hidden=8, heads=4, vocab=50, pad_vocab=False).padded_vocab(2) == 50


def test_unpadded_vocabulary_must_divide_by_tp() -> None:
    spec = GPTSpec(num_layers=2, hidden=8, heads=4, vocab=51, naming="megatron-core")
    with pytest.raises(InvalidConfig, match=r"tp=2 does not divide the model: vocab 51 % tp 2 = 1 \(not padded\)"):
        megatron_gpt_ptc(spec, ParallelConfig(tp=2))
    megatron_gpt_ptc(spec, ParallelConfig(dp=2))  # tp 1 takes any vocabulary


@pytest.mark.parametrize(
    ("name", "key", "layer"),
    [
        ("decoder.layers.7.self_attention.linear_qkv.weight", "decoder.layers.self_attention.linear_qkv.weight", 7),
        ("layers.7.self_attention.linear_qkv.weight", "decoder.layers.self_attention.linear_qkv.weight", 7),
        ("decoder.layers.0.input_layernorm.weight", "decoder.layers.self_attention.linear_qkv.layer_norm_weight", 0),
        ("decoder.layers.3.input_layernorm.bias", "decoder.layers.self_attention.linear_qkv.layer_norm_bias", 3),
        ("layers.12.pre_mlp_layernorm.weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight", 12),
        ("decoder.layers.1.mlp.linear_fc2.bias", "decoder.layers.mlp.linear_fc2.bias", 1),
        ("decoder.final_layernorm.weight", "decoder.final_layernorm.weight", None),
        ("final_layernorm.bias", "decoder.final_layernorm.bias", None),
        ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight", None),
        ("output_layer.weight", "output_layer.weight", None),
    ],
)
def test_core_checkpoint_keys(name: str, key: str, layer: int | None) -> None:
    assert core_checkpoint_key(name) == (key, layer)
    naming = "megatron-core" if name.startswith(("decoder.", "embedding.", "output_layer.")) else "megatron-lm"
    assert tensor_name_from_core_key(key, layer, naming) == name


def test_every_provider_name_has_a_checkpoint_key() -> None:
    for naming in ("megatron-lm", "megatron-core"):
        spec = GPTSpec(num_layers=3, hidden=8, heads=2, vocab=16, naming=naming)
        for t in megatron_gpt_ptc(spec, ParallelConfig()).tensors:
            if t.kind is TensorKind.PARAM:
                assert tensor_name_from_core_key(*core_checkpoint_key(t.name), naming) == t.name


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: core_checkpoint_key("optim/layers.0.mlp.linear_fc1.weight/master"), "is not a Megatron GPT parameter name"),
        (lambda: core_checkpoint_key(3), "tensor name must be a string, got int"),
        (lambda: tensor_name_from_core_key("decoder.layers.mlp.linear_fc1.weight", None), "a layer index >= 0 is needed, got None"),
        (lambda: tensor_name_from_core_key("output_layer.weight", 2), "is not stacked over layers, got layer 2"),
        (lambda: tensor_name_from_core_key("model.embed_tokens.weight", None), "is not a megatron-core GPT checkpoint key"),
        (lambda: tensor_name_from_core_key("output_layer.weight", None, "hf"), "naming must be one of megatron-lm, megatron-core"),
    ],
)
def test_checkpoint_key_errors(call: object, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        call()  # type: ignore[operator]


def test_ddp_buckets() -> None:
    """Buckets only with overlap_grad_reduce, on the first stage; megatron-core's default size."""
    spec = GPTSpec(num_layers=2, hidden=8, heads=2, vocab=16, seq_len=0, overlap_grad_reduce=True, ddp_bucket_size=300)
    assert spec.bucket_size(4) == 300
    assert replace(spec, ddp_bucket_size=None).bucket_size(64) == 64_000_000
    assert replace(spec, ddp_bucket_size=None).bucket_size(4) == 40_000_000
    assert replace(spec, overlap_grad_reduce=False).bucket_size(4) is None
    # reverse order, 64-aligned starts, a bucket closed at >= 300 elements, ends padded to lcm(dp, 128)
    placed, buckets = buffer_layout([100, 10, 250, 70, 5], [False] * 5, 3, 300)
    assert placed == [(832, 1), (768, 1), (192, 0), (64, 0), (0, 0)]
    assert buckets == [(0, 768), (768, 1152)]
    # a tied embedding of a pipelined job sits in a bucket of its own, even without bucketing
    placed, buckets = buffer_layout([64, 10, 20], [True, False, False], 2, None)
    assert placed == [(128, 1), (64, 0), (0, 0)]
    assert buckets == [(0, 128), (128, 256)]
    with pytest.raises(InvalidConfig, match="dp must be an integer >= 1, got 0"):
        buffer_layout([1], [False], 0, None)
    with pytest.raises(InvalidConfig, match="2 parameter sizes but 1 shared-embedding flags"):
        buffer_layout([1, 2], [False], 1, None)
