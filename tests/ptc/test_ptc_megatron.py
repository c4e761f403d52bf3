"""The Megatron GPT layout provider.

The main check is an independent simulation of what every Megatron rank
physically holds: each global tensor is filled with its element ids, every
rank's local tensor-parallel shards are cut with numpy, its distributed-optimizer
buffer is built by flattening and concatenating them, padded and sliced by dp
rank. The ids a rank ends up with must be exactly the ids of the PTC's shards
for that device.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenplex.errors import InvalidConfig
from tenplex.ptc import PTC, DatasetState, ParallelConfig, Region, TensorKind
from tenplex.ptc.megatron import GPTSpec, megatron_gpt_ptc

# -- the reference simulation ------------------------------------------------------


def _stage_params(spec: GPTSpec, vocab: int, layers: range, first: bool, last: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, global shape, how tp cuts it) in module order, written from Megatron's GPTModel."""
    h, f = spec.hidden, spec.ffn_hidden or 4 * spec.hidden
    kv = spec.kv_heads or spec.heads
    qkv = (spec.heads + 2 * kv) * (h // spec.heads)
    fc1 = "gated" if spec.gated_mlp else "col"
    out = []
    if first:
        out.append(("embedding.word_embeddings.weight", (vocab, h), "col"))
        if spec.seq_len:
            out.append(("embedding.position_embeddings.weight", (spec.seq_len, h), "rep"))
    for i in layers:
        p = f"layers.{i}."
        out += [(p + "input_layernorm.weight", (h,), "rep"), (p + "input_layernorm.bias", (h,), "rep")]
        out.append((p + "self_attention.linear_qkv.weight", (qkv, h), "col"))
        if spec.bias:
            out.append((p + "self_attention.linear_qkv.bias", (qkv,), "col"))
        out.append((p + "self_attention.linear_proj.weight", (h, h), "row"))
        if spec.bias:
            out.append((p + "self_attention.linear_proj.bias", (h,), "rep"))
        out += [(p + "pre_mlp_layernorm.weight", (h,), "rep"), (p + "pre_mlp_layernorm.bias", (h,), "rep")]
        out.append((p + "mlp.linear_fc1.weight", ((2 if spec.gated_mlp else 1) * f, h), fc1))
        if spec.bias:
            out.append((p + "mlp.linear_fc1.bias", ((2 if spec.gated_mlp else 1) * f,), fc1))
        out.append((p + "mlp.linear_fc2.weight", (h, f), "row"))
        if spec.bias:
            out.append((p + "mlp.linear_fc2.bias", (h,), "rep"))
    if last:
        out += [("final_layernorm.weight", (h,), "rep"), ("final_layernorm.bias", (h,), "rep")]
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


def simulate(spec: GPTSpec, par: ParallelConfig) -> dict[int, dict[str, np.ndarray]]:
    """rank -> tensor name -> sorted element ids it holds (params and optimizer state)."""
    dp, tp, pp = par.dp, par.tp, par.pp
    multiple = spec.make_vocab_size_divisible_by * tp
    vocab = (spec.vocab + multiple - 1) // multiple * multiple
    if pp == 1:
        sizes = [spec.num_layers]
    elif par.layers_per_stage:
        sizes = list(par.layers_per_stage)
    else:
        sizes = [spec.num_layers // pp + (1 if s < spec.num_layers % pp else 0) for s in range(pp)]
    bounds = np.cumsum([0, *sizes])
    held: dict[int, dict[str, list[np.ndarray]]] = defaultdict(lambda: defaultdict(list))
    for s in range(pp):
        params = _stage_params(spec, vocab, range(bounds[s], bounds[s + 1]), s == 0, s == pp - 1)
        for t in range(tp):
            locals_ = [(name, _local(np.arange(int(np.prod(shape))).reshape(shape), how, t, tp)) for name, shape, how in params]
            # the distributed optimizer's buffer: reverse module order, flattened, padded to dp
            order = list(reversed(locals_))
            flat = np.concatenate([a.reshape(-1) for _, a in order])
            owner = np.concatenate([np.full(a.size, i) for i, (_, a) in enumerate(order)])
            part = -(-flat.size // dp)
            for d in range(dp):
                rank = (s * dp + d) * tp + t
                own = slice(d * part, (d + 1) * part)
                for i, (name, a) in enumerate(order):
                    mine = flat[own][owner[own] == i]
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
    assert set(got) == set(expected) == set(range(par.world_size))
    for rank in expected:
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
    head_dim = draw(st.sampled_from([1, 2, 3]))
    layers = draw(st.integers(pp, pp + 3))
    split = None
    if pp > 1 and draw(st.booleans()):
        cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1)))
        split = tuple(b - a for a, b in zip([0, *cuts], [*cuts, layers], strict=True))
    spec = GPTSpec(
        num_layers=layers,
        hidden=heads * head_dim,
        heads=heads,
        kv_heads=kv if draw(st.booleans()) else None,
        vocab=draw(st.integers(1, 40)),
        ffn_hidden=tp * draw(st.integers(1, 3)) if draw(st.booleans()) else None,
        tied_embeddings=draw(st.booleans()),
        gated_mlp=draw(st.booleans()),
        seq_len=draw(st.sampled_from([0, 3])),
        make_vocab_size_divisible_by=draw(st.sampled_from([1, 4])),
        bias=draw(st.booleans()),
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


def test_golden_two_layer_gpt_dp2_tp2_zero1() -> None:
    """hidden 8, 2 heads, ffn 32, vocab 10 padded to 16, 6 positions, dp2 x tp2 x pp1, ZeRO-1.

    Ranks: dp0tp0=0, dp0tp1=1, dp1tp0=2, dp1tp1=3. Each tp rank's buffer, reverse module
    order: output_layer 64, final_layernorm 16, layer 1 460, layer 0 460 (fc2.bias at
    540..548, fc2.weight 548..676, ...), position embeddings 48, word embeddings 64:
    1112 elements, 556 per dp rank. The cut at 556 falls 8 elements into layer 0's local
    fc2.weight (8 x 16 per tp rank): its first row's first 8 columns belong to dp0.
    """
    spec = GPTSpec(num_layers=2, hidden=8, heads=2, vocab=10, seq_len=6, make_vocab_size_divisible_by=4)
    ptc = megatron_gpt_ptc(spec, ParallelConfig(dp=2, tp=2, pp=1, zero=1), gpus_per_node=4)

    def shards(name: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(s.region.format(), s.devices) for s in ptc.tensor(name).shards]

    assert ptc.config["padded_vocab"] == 16
    assert [(d.id, d.host, dict(d.coords)) for d in ptc.devices] == [
        (0, "node-0", {"dp": 0, "tp": 0, "pp": 0}),
        (1, "node-0", {"dp": 0, "tp": 1, "pp": 0}),
        (2, "node-0", {"dp": 1, "tp": 0, "pp": 0}),
        (3, "node-0", {"dp": 1, "tp": 1, "pp": 0}),
    ]
    # params: vocab-parallel, column-parallel, row-parallel, replicated
    assert shards("embedding.word_embeddings.weight") == [("0:8,0:8", (0, 2)), ("8:16,0:8", (1, 3))]
    assert shards("layers.0.self_attention.linear_qkv.weight") == [("0:12,0:8", (0, 2)), ("12:24,0:8", (1, 3))]
    assert shards("layers.1.self_attention.linear_proj.weight") == [("0:8,0:4", (0, 2)), ("0:8,4:8", (1, 3))]
    assert shards("layers.1.mlp.linear_fc2.weight") == [("0:8,0:16", (0, 2)), ("0:8,16:32", (1, 3))]
    assert shards("layers.0.input_layernorm.bias") == [("0:8", (0, 1, 2, 3))]
    assert ptc.tensor("layers.0.input_layernorm.bias").dtype == "bfloat16"
    # optimizer: the end of the buffer (output layer, layer 1) belongs to dp0 ...
    assert shards("optim/output_layer.weight/master") == [("0:8,0:8", (0,)), ("8:16,0:8", (1,))]
    assert shards("optim/layers.1.mlp.linear_fc1.weight/exp_avg") == [("0:16,0:8", (0,)), ("16:32,0:8", (1,))]
    assert shards("optim/layers.0.mlp.linear_fc2.bias/exp_avg_sq") == [("0:8", (0, 1))]
    # ... the cut falls inside layer 0's fc2.weight ...
    assert shards("optim/layers.0.mlp.linear_fc2.weight/exp_avg") == [
        ("0:1,0:8", (0,)),
        ("0:1,16:24", (1,)),
        ("0:1,8:16", (2,)),
        ("1:8,0:16", (2,)),
        ("0:1,24:32", (3,)),
        ("1:8,16:32", (3,)),
    ]
    # ... and the rest of layer 0 and the embeddings belong to dp1
    assert shards("optim/layers.0.input_layernorm.weight/exp_avg") == [("0:8", (2, 3))]
    assert shards("optim/embedding.word_embeddings.weight/exp_avg") == [("0:8,0:8", (2,)), ("8:16,0:8", (3,))]
    assert ptc.tensor("optim/layers.0.input_layernorm.weight/exp_avg").dtype == "float32"


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
