"""The PyTorch-derived layout provider on the meta device (no real process group)."""

from __future__ import annotations

import dataclasses
import socket
from datetime import timedelta
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from examples.gpt.layout import gpt_ptc, meta_stage
from examples.gpt.model import GPT, GPTConfig
from examples.gpt.parallelize import parallelize
from tenplex.errors import InvalidConfig
from tenplex.ptc import PTC, DatasetState, ParallelConfig, Placement, Region, TensorKind
from tenplex.ptc.torch_layout import derive_ptc, local_regions, read_stage_layouts

CFG = GPTConfig(vocab=66, dim=32, n_layers=4, n_heads=4, ffn_dim=48, seq_len=16, gated=True)

CONFIGS = [
    ParallelConfig(),
    ParallelConfig(dp=4),
    ParallelConfig(dp=4, zero=3),
    ParallelConfig(dp=3, zero=3),
    ParallelConfig(dp=2, tp=2),
    ParallelConfig(dp=2, tp=2, zero=3),
    ParallelConfig(tp=2, pp=2),
    ParallelConfig(tp=4),
    ParallelConfig(pp=4),
    ParallelConfig(dp=2, tp=2, pp=2, zero=3),
    ParallelConfig(tp=2, pp=3, layers_per_stage=(2, 1, 1)),
]


def _ptc(parallel: ParallelConfig, cfg: GPTConfig = CFG, **kw) -> PTC:
    return gpt_ptc(cfg, parallel, Placement.uniform(parallel.world_size, 4), **kw)


def _full_params(cfg: GPTConfig = CFG) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in GPT(cfg).named_parameters()}


@pytest.mark.parametrize("parallel", CONFIGS, ids=lambda p: p.describe())
def test_names_are_global_and_cover_the_full_model(parallel: ParallelConfig) -> None:
    ptc = _ptc(parallel)  # constructing the PTC validates the tiling of every tensor
    full = _full_params()
    params = {t.name: t.shape for t in ptc.tensors if t.kind is TensorKind.PARAM}
    assert params == full
    expected = set(full)
    for name in full:
        expected |= {f"optim/{name}/exp_avg", f"optim/{name}/exp_avg_sq", f"optim/{name}/step"}
    assert {t.name for t in ptc.tensors} == expected
    assert {t.name for t in ptc.tensors} == {t.name for t in _ptc(ParallelConfig()).tensors}
    assert ptc.config["provider"] == "torch" and ptc.config["dp"] == parallel.dp
    assert [d.coords for d in ptc.devices] == [parallel.coords(r) for r in range(parallel.world_size)]


@pytest.mark.parametrize("parallel", CONFIGS, ids=lambda p: p.describe())
def test_regions_equal_dtensor_local_shape_and_offset(parallel: ParallelConfig) -> None:
    """Every rank's region is what DTensor itself computes for that mesh coordinate."""
    layouts = read_stage_layouts(partial(meta_stage, CFG, parallel), parallelize, parallel)
    sizes = {"pp": parallel.pp, "dp": parallel.dp, "tp": parallel.tp}
    for stage, stage_layouts in enumerate(layouts):
        for lay in stage_layouts:
            mesh_shape = [sizes[d] for d in lay.mesh_dims]
            assert list(lay.mesh_shape) == mesh_shape
            for dp in range(parallel.dp):
                for tp in range(parallel.tp):
                    rank = parallel.rank(dp, tp, stage)
                    coords = parallel.coords(rank)
                    if lay.mesh_dims:  # the coordinates read off the DTensor's mesh are Tenplex's
                        assert lay.rank_coords[rank] == tuple(coords[d] for d in lay.mesh_dims)
                    regions = local_regions(lay.shape, lay.mesh_shape, lay.placements, lay.rank_coords.get(rank, ()))
                    if not lay.mesh_dims:
                        assert regions == [Region.full(lay.shape)]
                        continue
                    shape, offset = _compute_local_shape_and_global_offset(
                        lay.shape, mesh_shape, [coords[d] for d in lay.mesh_dims], lay.placements
                    )
                    if 0 in shape:
                        assert regions == []
                    else:
                        assert regions == [Region.from_offsets(offset, shape)], (lay.name, coords, lay.placements)


def test_tensor_parallel_vocab_shards_are_uneven() -> None:
    ptc = _ptc(ParallelConfig(tp=4))
    emb = ptc.tensor("tok_embeddings.weight")
    assert sorted((s.region.bounds[0], s.devices) for s in emb.shards) == [
        ((0, 17), (0,)), ((17, 34), (1,)), ((34, 51), (2,)), ((51, 66), (3,))
    ]
    wo = ptc.tensor("layers.2.attention.wo.weight")  # row-parallel: input dimension split
    assert sorted(s.region.bounds for s in wo.shards) == [((0, 32), (8 * i, 8 * i + 8)) for i in range(4)]
    norm = ptc.tensor("layers.2.ffn_norm.weight")
    assert [(s.region, s.devices) for s in norm.shards] == [(Region.full((32,)), (0, 1, 2, 3))]


def test_fsdp_on_top_of_tp_shards_each_tp_half_over_dp() -> None:
    """(dp2, tp2, zero3): column-parallel weights are _StridedShard(0) over dp inside each tp half."""
    ptc = _ptc(ParallelConfig(dp=2, tp=2, zero=3))
    w1 = ptc.tensor("layers.0.feed_forward.w1.weight")  # (48, 32): tp halves of 24, each cut 12/12
    got = {s.devices[0]: s.region.bounds[0] for s in w1.shards}
    # rank = dp * tp_size + tp
    assert got == {0: (0, 12), 2: (12, 24), 1: (24, 36), 3: (36, 48)}
    emb = ptc.tensor("tok_embeddings.weight")  # (66, 32): tp halves of 33, cut 17/16 over dp
    assert {s.devices[0]: s.region.bounds[0] for s in emb.shards} == {0: (0, 17), 2: (17, 33), 1: (33, 50), 3: (50, 66)}


def test_fsdp_empty_shards_are_not_listed() -> None:
    """seq_len 2 over dp3: torch.chunk gives 1, 1, 0 rows; the third rank holds nothing of it."""
    cfg = dataclasses.replace(CFG, seq_len=2)
    ptc = _ptc(ParallelConfig(dp=3, zero=3), cfg)
    pos = ptc.tensor("pos_embeddings.weight")
    assert sorted((s.region.bounds[0], s.devices) for s in pos.shards) == [((0, 1), (0,)), ((1, 2), (1,))]
    step = ptc.tensor("optim/pos_embeddings.weight/step")
    assert [(s.region, s.devices) for s in step.shards] == [(Region.full(()), (0, 1))]
    assert all(t.name != "pos_embeddings.weight" for t, _ in ptc.shards_of_device(2))


def test_replicated_dp_and_pipeline_stages() -> None:
    parallel = ParallelConfig(dp=2, pp=2)
    ptc = _ptc(parallel)
    first = {parallel.rank(d, 0, 0) for d in range(2)}
    last = {parallel.rank(d, 0, 1) for d in range(2)}
    for name, holders in [("tok_embeddings.weight", first), ("layers.1.attention.wq.weight", first),
                          ("layers.2.attention.wq.weight", last), ("output.weight", last), ("norm.bias", last)]:
        t = ptc.tensor(name)
        assert [set(s.devices) for s in t.shards] == [holders], name
        assert [s.region for s in t.shards] == [Region.full(t.shape)]


def test_optimizer_state_follows_the_parameter() -> None:
    ptc = _ptc(ParallelConfig(dp=2, tp=2, zero=3))
    for t in ptc.tensors:
        if t.kind is not TensorKind.PARAM:
            continue
        param = {(s.region, s.devices) for s in t.shards}
        for state in ("exp_avg", "exp_avg_sq"):
            o = ptc.tensor(f"optim/{t.name}/{state}")
            assert o.kind is TensorKind.OPTIMIZER and o.dtype == t.dtype and o.shape == t.shape
            assert {(s.region, s.devices) for s in o.shards} == param
        step = ptc.tensor(f"optim/{t.name}/step")
        assert step.shape == () and step.dtype == "float32"
        assert set(step.shards[0].devices) == {d for s in t.shards for d in s.devices}
    no_opt = _ptc(ParallelConfig(dp=2), optimizer="none")
    assert all(t.kind is TensorKind.PARAM for t in no_opt.tensors)


def test_tied_embeddings_are_one_tensor() -> None:
    cfg = dataclasses.replace(CFG, tied=True)
    ptc = _ptc(ParallelConfig(dp=2, zero=3), cfg)
    names = {t.name for t in ptc.tensors if t.kind is TensorKind.PARAM}
    assert "tok_embeddings.weight" in names and "output.weight" not in names


def test_persistent_buffers_are_listed_and_non_persistent_ones_are_not() -> None:
    class WithBuffers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 6)
            self.register_buffer("count", torch.zeros(3, dtype=torch.int64))
            self.register_buffer("scratch", torch.zeros(5), persistent=False)

    parallel = ParallelConfig(dp=2)
    ptc = derive_ptc(lambda s, n: WithBuffers(), lambda m, mesh, p: m, parallel, Placement.uniform(2, 2),
                     optimizer="none")
    kinds = {t.name: (t.kind, t.dtype, t.shape) for t in ptc.tensors}
    assert kinds == {
        "lin.weight": (TensorKind.PARAM, "float32", (6, 4)),
        "lin.bias": (TensorKind.PARAM, "float32", (6,)),
        "count": (TensorKind.BUFFER, "int64", (3,)),
    }
    assert ptc.tensor("count").shards[0].devices == (0, 1)


def test_frozen_parameters_have_no_optimizer_state() -> None:
    def frozen_bias(stage: int, num_stages: int) -> nn.Module:
        module = nn.Linear(4, 6)
        module.bias.requires_grad_(False)
        return module

    ptc = derive_ptc(frozen_bias, lambda m, mesh, p: m, ParallelConfig(), Placement.uniform(1, 1))
    assert {t.name for t in ptc.tensors} == {
        "weight", "bias", "optim/weight/exp_avg", "optim/weight/exp_avg_sq", "optim/weight/step"
    }


def test_dataset_batch_must_divide_by_dp() -> None:
    with pytest.raises(InvalidConfig, match="global batch size 8 is not divisible by data-parallel size 3"):
        _ptc(ParallelConfig(dp=3, zero=3), dataset=DatasetState(100, 0, 8))


def test_dataset_state_json_round_trip_and_repeated_calls_leave_no_process_group() -> None:
    dataset = DatasetState(num_samples=100, seed=3, global_batch_size=8, consumed_samples=16)
    first = _ptc(ParallelConfig(dp=2, tp=2, pp=2, zero=3), dataset=dataset)
    assert not dist.is_initialized()
    second = _ptc(ParallelConfig(dp=2, tp=2, pp=2, zero=3), dataset=dataset)
    assert not dist.is_initialized()
    assert first.dumps() == second.dumps()
    back = PTC.loads(first.dumps())
    assert back.dataset == dataset
    assert back.to_json() == first.to_json()
    assert back.config["model"]["vocab"] == CFG.vocab


@pytest.mark.parametrize(
    ("parallel", "cfg", "message"),
    [
        (ParallelConfig(dp=2, zero=1), CFG, "zero=1"),
        (ParallelConfig(tp=3), CFG, "tp=3 must divide n_heads=4"),
        (ParallelConfig(tp=2), dataclasses.replace(CFG, tied=True), "tied embeddings"),
        (ParallelConfig(pp=5), CFG, "4 layers cannot fill 5 pipeline stages"),
        (ParallelConfig(pp=2, layers_per_stage=(1, 2)), CFG, "sums to 3"),
    ],
)
def test_unsupported_configurations_are_clear_errors(parallel: ParallelConfig, cfg: GPTConfig, message: str) -> None:
    with pytest.raises(InvalidConfig, match=message.replace("(", r"\(").replace(")", r"\)")):
        _ptc(parallel, cfg)
    assert not dist.is_initialized()


def test_bad_optimizer_and_placement() -> None:
    with pytest.raises(InvalidConfig, match="unknown optimizer 'sgd'"):
        _ptc(ParallelConfig(dp=2), optimizer="sgd")
    with pytest.raises(InvalidConfig, match="needs 8 GPUs"):
        gpt_ptc(CFG, ParallelConfig(dp=8), Placement(4, ("a",)))


def test_error_in_parallelize_releases_the_fake_process_group() -> None:
    def broken(module: nn.Module, mesh, parallel):
        raise InvalidConfig("broken plan")

    with pytest.raises(InvalidConfig, match="broken plan"):
        derive_ptc(partial(meta_stage, CFG, ParallelConfig(dp=2)), broken, ParallelConfig(dp=2), Placement.uniform(2, 2))
    assert not dist.is_initialized()
    assert _ptc(ParallelConfig(dp=2)).config["dp"] == 2


@pytest.mark.slow
def test_with_a_real_process_group_it_derives_in_a_subprocess() -> None:
    """Inside a training worker (default process group set) the result is the same."""
    parallel = ParallelConfig(dp=2, tp=2, zero=3)
    expected = _ptc(parallel).dumps()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert _ptc(parallel).dumps() == expected
        with pytest.raises(InvalidConfig, match="picklable"):
            derive_ptc(lambda s, n: GPT(CFG), parallelize, parallel, Placement.uniform(4, 4))
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


def test_concurrent_derivations_take_turns() -> None:
    """The fake process group is process-global; threads deriving at once must not collide."""
    from concurrent.futures import ThreadPoolExecutor

    configs = [ParallelConfig(dp=2, tp=2, zero=3), ParallelConfig(tp=2, pp=2), ParallelConfig(dp=4)] * 2
    expected = [_ptc(p).dumps() for p in configs]
    with ThreadPoolExecutor(max_workers=3) as pool:
        got = list(pool.map(lambda p: _ptc(p).dumps(), configs))
    assert got == expected
    assert not dist.is_initialized()


def test_torch_thread_count_is_restored() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _ptc(ParallelConfig(dp=2, tp=2, zero=3))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_partial_placements_are_refused() -> None:
    from torch.distributed.tensor import DTensor, Partial

    def partial_weight(module: nn.Module, mesh, parallel: ParallelConfig) -> nn.Module:
        weight = DTensor.from_local(torch.empty(3, 4, device="meta"), mesh["dp"], [Partial()], run_check=False)
        module.weight = nn.Parameter(weight)
        return module

    with pytest.raises(InvalidConfig, match=r"'weight' has placements \[Partial\(sum\)\]"):
        derive_ptc(lambda s, n: nn.Linear(4, 3, bias=False), partial_weight, ParallelConfig(dp=2), Placement.uniform(2, 2))
    assert not dist.is_initialized()


def test_dtensors_on_foreign_mesh_dimensions_are_refused() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def other_mesh(module: nn.Module, mesh, parallel: ParallelConfig) -> nn.Module:
        foreign = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
        module.weight = nn.Parameter(distribute_tensor(module.weight, foreign, [Shard(0)]))
        return module

    with pytest.raises(InvalidConfig, match=r"'weight' is a DTensor on mesh dimensions \['shard'\]"):
        derive_ptc(lambda s, n: nn.Linear(4, 6, bias=False), other_mesh, ParallelConfig(dp=2), Placement.uniform(2, 2))
    assert not dist.is_initialized()


# -- mesh dimensions of any name ---------------------------------------------------------


def _linear_on(mesh_shape: tuple[int, ...], names: tuple[str, ...], placements_of) -> object:
    """A stage builder: an 8x4 linear distributed on a mesh of the job's own names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    def build(stage: int, parallel: ParallelConfig) -> nn.Module:
        module = nn.Linear(4, 8, bias=False)
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        module.weight = nn.Parameter(distribute_tensor(module.weight, mesh, placements_of()))
        return module

    return build


def test_hsdp_on_the_jobs_own_dimension_names() -> None:
    from torch.distributed.tensor import Replicate, Shard

    from tenplex.ptc.torch_layout import derive_ptc_from_stages

    parallel = ParallelConfig(dp=4, zero=3)
    build = _linear_on((2, 2), ("replica", "shard"), lambda: [Replicate(), Shard(0)])
    ptc = derive_ptc_from_stages(build, parallel, Placement.uniform(4, 4),
                                 mesh_roles={"replica": "dp_replicate", "shard": "fsdp"})
    w = ptc.tensor("weight")
    assert [(str(s.region), s.devices) for s in w.shards] == [("[0:4, 0:4]", (0, 2)), ("[4:8, 0:4]", (1, 3))]
    assert ptc.config["mesh_roles"] == {"replica": "dp_replicate", "shard": "dp_shard"}
    with pytest.raises(InvalidConfig, match=r"dimension 'replica' \(size 2\) has no Tenplex role"):
        derive_ptc_from_stages(build, parallel, Placement.uniform(4, 4))
    assert not dist.is_initialized()


def test_torchtitan_and_transformers_names_are_known() -> None:
    from torch.distributed.tensor import Replicate, Shard

    from tenplex.ptc.torch_layout import derive_ptc_from_stages

    for names in (("dp_replicate", "fsdp"), ("dp_replicate", "dp_shard")):
        build = _linear_on((2, 2), names, lambda: [Replicate(), Shard(0)])
        ptc = derive_ptc_from_stages(build, ParallelConfig(dp=4, zero=3), Placement.uniform(4, 4))
        assert [s.devices for s in ptc.tensor("weight").shards] == [(0, 2), (1, 3)]


def test_mesh_roles_are_checked() -> None:
    from torch.distributed.tensor import Replicate, Shard

    from tenplex.ptc.torch_layout import MeshRole, derive_ptc_from_stages, resolve_mesh_roles

    assert resolve_mesh_roles({"x": "fsdp", "y": "context"}, defaults=False) == {"x": MeshRole.DP_SHARD, "y": MeshRole.CP}
    with pytest.raises(InvalidConfig, match="unknown role 'shards'"):
        resolve_mesh_roles({"x": "shards"})
    placement = Placement.uniform(4, 4)
    cases = [
        # context parallelism is refused while it is more than one rank
        (_linear_on((2, 2), ("fsdp", "cp"), lambda: [Shard(0), Replicate()]), ParallelConfig(dp=4, zero=3),
         r"mesh dimension 'cp' of size 2 \(context parallelism\); Tenplex does not support context parallelism yet"),
        (_linear_on((2, 2), ("fsdp", "ep"), lambda: [Shard(0), Replicate()]), ParallelConfig(dp=4, zero=3),
         "expert parallelism"),
        # a replicate dimension that shards is a wrong mapping
        (_linear_on((2, 2), ("dp_replicate", "fsdp"), lambda: [Shard(0), Shard(1)]), ParallelConfig(dp=4, zero=3),
         "whose role is dp_replicate"),
        # sizes must be the configuration's
        (_linear_on((2, 2), ("fsdp", "tp"), lambda: [Shard(0), Shard(1)]), ParallelConfig(dp=1, tp=4),
         r"mesh dimensions \['tp'\] \(tp\) have size 2, dp1 x tp4 x pp1 says tp=4"),
        # ranks in another order than Tenplex's (tp fastest): the dp/tp placement on nodes would be wrong
        (_linear_on((2, 2), ("tp", "dp"), lambda: [Shard(0), Shard(1)]), ParallelConfig(dp=2, tp=2, zero=3),
         "build the mesh in that order"),
    ]
    for build, parallel, message in cases:
        with pytest.raises(InvalidConfig, match=message):
            derive_ptc_from_stages(build, parallel, placement)
        assert not dist.is_initialized()
    # a size-1 dimension of any name changes nothing
    ptc = derive_ptc_from_stages(_linear_on((2, 1), ("dp", "cp"), lambda: [Shard(0), Replicate()]),
                                 ParallelConfig(dp=2, zero=3), Placement.uniform(2, 2))
    assert [s.devices for s in ptc.tensor("weight").shards] == [(0,), (1,)]
