"""Planner properties on random PTC pairs, checked against brute-force element painting.

Every element of every destination shard must be written by exactly one
transfer; the plan's network bytes must equal both the planner's lower bound
and an element-by-element count of what each target host needs and does not
hold; sources are only alive hosts holding the old version; when the planner
reports lost state, some needed element really is held by no source.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenplex.core.version import Version
from tenplex.errors import InvalidInput, StateLost
from tenplex.ptc import PTC, Device, Region, Shard, Tensor, TensorKind, flat_range_boxes
from tenplex.transformer import part
from tenplex.transformer.plan import CHECKPOINT, make_plan

HOSTS = [f"h{i}" for i in range(5)]
OLD_V = Version(10, 0)
NEW_V = Version(10, 1)


@st.composite
def tilings(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Region]:
    """A grid split, or (rank >= 1) a flat row-major partition as ZeRO-1 makes."""
    full = Region.full(shape)
    if len(shape) >= 1 and draw(st.booleans()):
        numel = full.volume
        cuts = sorted(set(draw(st.lists(st.integers(1, max(numel - 1, 1)), max_size=3))) - {numel})
        edges = [0, *cuts, numel]
        out: list[Region] = []
        for a, b in zip(edges, edges[1:], strict=False):
            out.extend(flat_range_boxes(shape, a, b))
        return out
    regions = [full]
    for dim, n in enumerate(shape):
        parts = draw(st.integers(1, min(3, n)))
        regions = [piece for r in regions for piece in r.split(dim, parts)]
    return regions


@st.composite
def ptcs(draw: st.DrawFn, shapes: dict[str, tuple[int, ...]], dtype: dict[str, str]) -> PTC:
    ndev = draw(st.integers(1, 8))
    devices = tuple(Device(i, draw(st.sampled_from(HOSTS))) for i in range(ndev))
    tensors = []
    for name, shape in shapes.items():
        shards = []
        for region in draw(tilings(shape)):
            devs = draw(st.lists(st.integers(0, ndev - 1), min_size=1, max_size=3, unique=True))
            shards.append(Shard(region, tuple(devs)))
        tensors.append(Tensor(name, shape, dtype[name], TensorKind.PARAM, tuple(shards)))
    return PTC({}, devices, tuple(tensors))


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[PTC, PTC, set[str] | None, dict[str, Version] | None]:
    n = draw(st.integers(1, 3))
    shapes = {}
    new_shapes = {}
    dtype = {}
    for i in range(n):
        rank = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=rank, max_size=rank)))
        shapes[f"t{i}"] = shape
        dtype[f"t{i}"] = draw(st.sampled_from(["float32", "bfloat16"]))
        if rank >= 1 and draw(st.booleans()):  # vocab-padding-like change of dim 0
            new_shapes[f"t{i}"] = (max(1, shape[0] + draw(st.integers(-3, 4))), *shape[1:])
        else:
            new_shapes[f"t{i}"] = shape
    old = draw(ptcs(shapes, dtype))
    new = draw(ptcs(new_shapes, dtype))
    alive = set(draw(st.lists(st.sampled_from(HOSTS), unique=True))) if draw(st.booleans()) else None
    holders = None
    if draw(st.booleans()):
        holders = {h: draw(st.sampled_from([OLD_V, Version(9, 0), Version(11, 0)])) for h in old.hosts}
    return old, new, alive, holders


def _sources(old: PTC, alive: set[str] | None, holders: dict[str, Version] | None) -> set[str]:
    return {
        h
        for h in old.hosts
        if (alive is None or h in alive) and (holders is None or holders.get(h) == OLD_V)
    }


def _held_mask(old: PTC, name: str, host: str, shape: tuple[int, ...]) -> np.ndarray:
    """Elements of tensor ``name`` (in the new shape) that ``host`` holds in the old layout."""
    mask = np.zeros(shape, dtype=bool)
    t = old.tensor(name)
    hosts_of = {d.id: d.host for d in old.devices}
    for s in t.shards:
        if any(hosts_of[d] == host for d in s.devices):
            inter = Region(tuple((min(a, n), min(b, n)) for (a, b), n in zip(s.region.bounds, shape, strict=True)))
            if not inter.empty:
                mask[inter.slices()] = True
    return mask


def _source_mask(old: PTC, name: str, sources: set[str], shape: tuple[int, ...]) -> np.ndarray:
    mask = np.zeros(shape, dtype=bool)
    for h in sources:
        mask |= _held_mask(old, name, h, shape)
    return mask


def _in_old(old: PTC, name: str, shape: tuple[int, ...]) -> np.ndarray:
    mask = np.zeros(shape, dtype=bool)
    o = old.tensor(name).shape
    mask[tuple(slice(0, min(a, b)) for a, b in zip(o, shape, strict=True))] = True
    return mask


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.booleans())
def test_plan_covers_exactly_once_and_meets_lower_bound(scenario, with_checkpoint) -> None:
    old, new, alive, holders = scenario
    if alive is not None and any(h not in alive for h in new.hosts if h in old.hosts):
        alive = alive | set(new.hosts)  # targets must be alive
    sources = _sources(old, alive, holders)
    try:
        plan = make_plan(
            old,
            new,
            job="j",
            old_version=OLD_V,
            new_version=NEW_V,
            holders=holders,
            alive=alive,
            checkpoint="http://127.0.0.9:1" if with_checkpoint else None,
        )
    except StateLost as exc:
        assert not with_checkpoint
        # Some needed element must really be held by no source.
        missing = False
        for t in new.tensors:
            need = _in_old(old, t.name, t.shape) & ~_source_mask(old, t.name, sources, t.shape)
            missing |= bool(need.any())
        assert missing, exc.detail
        assert "held by no surviving host" in exc.detail
        return

    # Each host's part as its daemon receives it (the compact binary form, built from the planner's arrays)
    # decodes to the same shards and transfers, and names the same sources, as the part's objects.
    for host in new.hosts:
        sent = part.decode(part.encode(plan, host))
        objects = plan.for_host(host)
        assert sent.host(host) == objects.host(host)
        assert plan.sources_of(host) == objects.sources_of(host)

    brute_network = 0
    for host in new.hosts:
        hp = plan.hosts[host]
        # Every distinct destination shard of the host appears once.
        expected = {(t.name, s.region) for t in new.tensors for s in t.shards
                    if any(new.device(d).host == host for d in s.devices)}
        got = [(d.tensor, d.region) for d in hp.shards]
        assert len(got) == len(set(got)) and set(got) == expected
        counts = [np.zeros(d.region.shape, dtype=np.int32) for d in hp.shards]
        for tr in hp.transfers:
            dest = hp.shards[tr.shard]
            assert dest.tensor == tr.tensor and dest.region.contains(tr.region)
            rel = tr.region.relative_to(dest.region)
            counts[tr.shard][rel.slices()] += 1
            itemsize = 4 if dest.dtype == "float32" else 2
            assert tr.nbytes == tr.region.volume * itemsize
            in_old = _in_old(old, tr.tensor, dest.global_shape)[tr.region.slices()]
            if tr.source is None:
                assert not in_old.any(), "zero-filled elements must not exist in the old layout"
            else:
                assert in_old.all()
                if tr.source == CHECKPOINT:
                    assert with_checkpoint
                    assert not _source_mask(old, tr.tensor, sources, dest.global_shape)[tr.region.slices()].any()
                else:
                    assert tr.source in sources
                    assert _held_mask(old, tr.tensor, tr.source, dest.global_shape)[tr.region.slices()].all()
                    if tr.source == host:
                        continue
                    # Remote only when the host itself does not hold the piece.
                    if host in sources:
                        assert not _held_mask(old, tr.tensor, host, dest.global_shape)[tr.region.slices()].any()
                    for alt in tr.alternatives:
                        assert alt in sources and alt != tr.source
                        assert _held_mask(old, tr.tensor, alt, dest.global_shape)[tr.region.slices()].all()
        for c in counts:
            assert (c == 1).all(), "every destination element is written exactly once"
        # Brute-force lower bound: needed elements (present in the old shape) the host does not hold.
        for d in hp.shards:
            itemsize = 4 if d.dtype == "float32" else 2
            need = _in_old(old, d.tensor, d.global_shape)[d.region.slices()]
            if host in sources:
                need = need & ~_held_mask(old, d.tensor, host, d.global_shape)[d.region.slices()]
            brute_network += int(need.sum()) * itemsize
    assert plan.network_bytes == plan.lower_bound_bytes == brute_network


def test_merges_pieces_from_one_source_into_one_box() -> None:
    # Old: a 8x4 tensor split in 4 row blocks, all on h1; new: one shard on h0 -> one request.
    old = PTC(
        {},
        (Device(0, "h1"),),
        (Tensor("w", (8, 4), "float32", TensorKind.PARAM,
                tuple(Shard(r, (0,)) for r in Region.full((8, 4)).split(0, 4))),),
    )
    new = PTC({}, (Device(0, "h0"),), (Tensor("w", (8, 4), "float32", TensorKind.PARAM, (Shard(Region.full((8, 4)), (0,)),)),))
    plan = make_plan(old, new, job="j", old_version=OLD_V, new_version=NEW_V)
    (tr,) = plan.hosts["h0"].transfers
    assert tr.source == "h1" and tr.region == Region.full((8, 4)) and tr.nbytes == 8 * 4 * 4
    assert plan.network_bytes == plan.lower_bound_bytes == 128


def test_balances_sends_across_replicas() -> None:
    # 4 row blocks replicated on h1 and h2; h0 needs all of it: each replica sends half.
    blocks = Region.full((8, 4)).split(0, 4)
    old = PTC({}, (Device(0, "h1"), Device(1, "h2")),
              (Tensor("w", (8, 4), "float32", TensorKind.PARAM, tuple(Shard(r, (0, 1)) for r in blocks)),))
    new = PTC({}, (Device(0, "h0"),), (Tensor("w", (8, 4), "float32", TensorKind.PARAM, (Shard(Region.full((8, 4)), (0,)),)),))
    plan = make_plan(old, new, job="j", old_version=OLD_V, new_version=NEW_V)
    assert plan.send_bytes() == {"h1": 64, "h2": 64}
    for tr in plan.hosts["h0"].transfers:
        assert tr.alternatives == (({"h1", "h2"} - {tr.source}).pop(),)


def test_state_lost_names_tensor_and_region() -> None:
    old = PTC({}, (Device(0, "h1"), Device(1, "h2")),
              (Tensor("w", (4,), "float32", TensorKind.PARAM,
                      (Shard(Region.of([[0, 2]]), (0,)), Shard(Region.of([[2, 4]]), (1,)))),))
    new = PTC({}, (Device(0, "h0"),), (Tensor("w", (4,), "float32", TensorKind.PARAM, (Shard(Region.full((4,)), (0,)),)),))
    with pytest.raises(StateLost) as info:
        make_plan(old, new, job="j", old_version=OLD_V, new_version=NEW_V, alive={"h1", "h0"})
    assert "w [2:4]" in info.value.detail and "h2" in info.value.detail
    plan = make_plan(old, new, job="j", old_version=OLD_V, new_version=NEW_V, alive={"h1", "h0"}, checkpoint="http://x")
    sources = sorted((t.source, t.region.format()) for t in plan.hosts["h0"].transfers)
    assert sources == [(CHECKPOINT, "2:4"), ("h1", "0:2")]
    assert plan.network_bytes == plan.lower_bound_bytes == 16


def test_plan_json_round_trip_and_dataset_carry_over(tmp_path) -> None:
    from tenplex.ptc import DatasetState, ParallelConfig
    from tenplex.ptc.megatron import GPTSpec, megatron_gpt_ptc
    from tenplex.transformer.plan import Plan

    spec = GPTSpec(num_layers=2, hidden=16, heads=4, vocab=100, make_vocab_size_divisible_by=8, seq_len=8)
    old = megatron_gpt_ptc(spec, ParallelConfig(dp=4, zero=1), gpus_per_node=2, hosts=["a", "b"],
                           dataset=DatasetState(1000, 3, 8, consumed_samples=40))
    new = megatron_gpt_ptc(spec, ParallelConfig(dp=2, tp=2, zero=1), gpus_per_node=2, hosts=["b", "c"],
                           dataset=DatasetState(1000, 3, 8))
    plan = make_plan(old, new, job="j", old_version="s5-g0", new_version="s5-g1", holders={"a": "s5-g0", "b": "s5-g0"})
    assert plan.dataset == DatasetState(1000, 3, 8, consumed_samples=40)
    assert plan.zero_fill_bytes > 0  # tp1 pads the vocabulary to 104 rows, tp2 to 112: 8 new rows are zeros
    plan.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    assert back == plan
    with pytest.raises(InvalidInput, match="dataset"):
        make_plan(old, megatron_gpt_ptc(spec, ParallelConfig(dp=4), gpus_per_node=2, hosts=["b", "c"],
                                        dataset=DatasetState(999, 3, 8)),
                  job="j", old_version="s5-g0", new_version="s5-g1")
