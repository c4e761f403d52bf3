"""The PyTorch-derived layout provider: a PTC read off the job's own parallelize code.

Instead of re-stating a model's sharding rules, this provider runs the job's
code: for every pipeline stage it builds the stage module on the ``meta``
device (no memory, no values), applies the job's ``parallelize`` function on
a ``(pp, dp, tp)`` device mesh backed by a *fake* process group of the
job's world size (no processes, no communication), and reads every
parameter's DTensor placements. From the placements and the mesh it
computes, for every rank of the stage, which region of the global tensor the
rank holds, with DTensor's own per-placement arithmetic (``torch.chunk``
semantics: uneven and empty shards; ``_StridedShard`` for FSDP2 on top of
tensor parallelism). Empty shards are not listed. A parameter that is not a
DTensor is replicated on every rank of its stage.

Optimizer state (``optimizer="adamw"`` or ``"adam"``): torch's Adam/AdamW
keep ``exp_avg`` and ``exp_avg_sq`` shaped and sharded exactly like the
parameter (``torch.zeros_like(param)``), and a ``step`` count per parameter
(a 0-d float32 tensor, the same value on every rank). All three are listed
for every parameter that requires grad (frozen ones have no state),
as ``optim/<param>/exp_avg``, ``optim/<param>/exp_avg_sq`` and
``optim/<param>/step``; the ``step`` tensor is held by every device that
holds a piece of the parameter, so restoring a rank needs nothing but its
own shards.

Persistent buffers are listed as kind ``buffer`` the same way; non-persistent
buffers are recomputed by the model and are not state.

The fake process group is the default group only while a stage is derived and
is destroyed afterwards, so the provider can be called repeatedly. When a
real process group is already initialized in the calling process (inside a
training worker), the derivation runs in a fresh subprocess instead; the
callables must then be picklable (module-level functions or
``functools.partial`` of them).
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING, Any

from tenplex.errors import InvalidConfig
from tenplex.ptc import dtypes
from tenplex.ptc.dataset import DatasetState
from tenplex.ptc.model import PTC, Device, Tensor, TensorKind, build_tensor
from tenplex.ptc.parallel import ParallelConfig, Placement
from tenplex.ptc.region import Region

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

MESH_DIMS = ("pp", "dp", "tp")
OPTIMIZERS = ("adamw", "adam", "none")

# torch.distributed has one default process group per process: derivations take turns.
_FAKE_PG_LOCK = threading.RLock()

BuildStage = Callable[[int, int], "nn.Module"]
Parallelize = Callable[["nn.Module", "DeviceMesh", ParallelConfig], "nn.Module"]


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """What the provider reads from one parameter or buffer of one stage."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: TensorKind
    mesh_dims: tuple[str, ...]
    """Names of the DTensor's mesh dimensions; empty for a plain (replicated) tensor."""
    placements: tuple[Any, ...]
    """The DTensor placements, one per mesh dimension."""
    trainable: bool = True
    """A parameter that requires grad (only those have optimizer state)."""


def derive_ptc(
    build_stage: BuildStage,
    parallelize: Parallelize,
    parallel: ParallelConfig,
    placement: Placement,
    *,
    optimizer: str = "adamw",
    dataset: DatasetState | None = None,
    model: Mapping[str, Any] | None = None,
) -> PTC:
    """The PTC of a job in configuration ``parallel`` placed by ``placement``.

    ``build_stage(stage, num_stages)`` returns pipeline stage ``stage``'s
    module with global parameter names; it is called under a ``meta`` device
    context. ``parallelize(module, mesh, parallel)`` applies the job's TP/DP
    to it on the ``(pp, dp, tp)`` mesh (``mesh["tp"]``, ``mesh["dp"]`` ...)
    and returns it. ``model`` is an optional JSON-able description recorded
    in the PTC's ``config``.
    """
    if optimizer not in OPTIMIZERS:
        raise InvalidConfig(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    placement.check(parallel)
    if dataset is not None:
        dataset.check_dp(parallel.dp)
    with _FAKE_PG_LOCK, _one_torch_thread():
        stages = read_stage_layouts(build_stage, parallelize, parallel)
        tensors = _layout_tensors(stages, parallel, optimizer)
    devices = tuple(
        Device(rank, placement.host_of(rank), parallel.coords(rank)) for rank in range(parallel.world_size)
    )
    config: dict[str, Any] = {
        **parallel.to_json(),
        "provider": "torch",
        "optimizer": optimizer,
        "gpus_per_node": placement.gpus_per_node,
    }
    if model is not None:
        config["model"] = dict(model)
    return PTC(config=config, devices=devices, tensors=tuple(tensors), dataset=dataset)


# -- reading the stages -----------------------------------------------------------


def read_stage_layouts(
    build_stage: BuildStage, parallelize: Parallelize, parallel: ParallelConfig
) -> list[list[TensorLayout]]:
    """Per pipeline stage, the parameters and persistent buffers with their DTensor placements."""
    import torch.distributed as dist

    with _FAKE_PG_LOCK, _one_torch_thread():
        if dist.is_available() and dist.is_initialized():
            log.info("a process group is initialized here; deriving the layout in a subprocess")
            return _read_stages_in_subprocess(build_stage, parallelize, parallel)
        return _read_all_stages(build_stage, parallelize, parallel)


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Run torch single-threaded, then restore (callers hold ``_FAKE_PG_LOCK``).

    Deriving is many tiny index computations (DTensor's own, on CPU): intra-op
    threads only contend, and on a loaded 2-core machine they made each
    50k-element ``arange`` take 16 ms instead of 0.2 ms.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _read_all_stages(
    build_stage: BuildStage, parallelize: Parallelize, parallel: ParallelConfig
) -> list[list[TensorLayout]]:
    return [_read_stage(build_stage, parallelize, parallel, stage) for stage in range(parallel.pp)]


def _read_stage(
    build_stage: BuildStage, parallelize: Parallelize, parallel: ParallelConfig, stage: int
) -> list[TensorLayout]:
    """Build and parallelize one stage on meta under a fake process group; read its tensors."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import (
        FakeStore,  # registers the "fake" backend
    )

    # A rank of this stage, so code that looks at its own pipeline coordinate sees the right one.
    rank = parallel.rank(0, 0, stage)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=parallel.world_size)
    try:
        with torch.device("meta"):
            module = build_stage(stage, parallel.pp)
        mesh = init_device_mesh("cpu", (parallel.pp, parallel.dp, parallel.tp), mesh_dim_names=MESH_DIMS)
        module = parallelize(module, mesh, parallel)
        out: list[TensorLayout] = []
        items = [(n, p, TensorKind.PARAM) for n, p in module.named_parameters()]
        items += [(n, b, TensorKind.BUFFER) for n, b in _persistent_buffers(module)]
        for name, value, kind in items:
            if isinstance(value, DTensor):
                spec_mesh = value.device_mesh
                mesh_dims = tuple(spec_mesh.mesh_dim_names or ())
                _check_mesh(name, mesh_dims, tuple(spec_mesh.shape), parallel)
                placements = tuple(value.placements)
                if any(p.is_partial() for p in placements):
                    raise InvalidConfig(
                        f"{name!r} has placements {list(placements)}: a pending (Partial) reduction is not a stored layout"
                    )
            else:
                mesh_dims, placements = (), ()
            shape = tuple(int(n) for n in value.shape)
            dtype = dtypes.name_of_torch(value.dtype)
            trainable = kind is TensorKind.PARAM and bool(value.requires_grad)
            out.append(TensorLayout(name, shape, dtype, kind, mesh_dims, placements, trainable))
        log.debug("stage %d of %s: %d tensors", stage, parallel.describe(), len(out))
        return out
    finally:
        dist.destroy_process_group()


def _persistent_buffers(module: nn.Module) -> list[tuple[str, Any]]:
    out = []
    for mod_name, mod in module.named_modules():
        for buf_name, buf in mod.named_buffers(recurse=False):
            if buf is None or buf_name in getattr(mod, "_non_persistent_buffers_set", ()):
                continue
            out.append((f"{mod_name}.{buf_name}" if mod_name else buf_name, buf))
    return out


def _check_mesh(name: str, mesh_dims: tuple[str, ...], mesh_shape: tuple[int, ...], parallel: ParallelConfig) -> None:
    sizes = {"pp": parallel.pp, "dp": parallel.dp, "tp": parallel.tp}
    for dim, size in zip(mesh_dims, mesh_shape, strict=True):
        if dim not in sizes:
            raise InvalidConfig(
                f"{name!r} is a DTensor on mesh dimensions {list(mesh_dims)}; the layout provider "
                f"knows only sub-meshes of ('pp', 'dp', 'tp')"
            )
        if sizes[dim] != size:
            raise InvalidConfig(f"{name!r}: mesh dimension {dim!r} has size {size}, {parallel.describe()} says {sizes[dim]}")


def _read_stages_in_subprocess(
    build_stage: BuildStage, parallelize: Parallelize, parallel: ParallelConfig
) -> list[list[TensorLayout]]:
    try:
        pickle.dumps((build_stage, parallelize))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise InvalidConfig(
            "a process group is initialized in this process, so the layout is derived in a subprocess, "
            f"which needs picklable build_stage and parallelize callables: {exc}"
        ) from None
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_read_all_stages, build_stage, parallelize, parallel).result()


# -- from placements to shards ----------------------------------------------------


def local_regions(
    shape: Sequence[int], mesh_dims: Sequence[str], placements: Sequence[Any], coords: Mapping[str, int],
    parallel: ParallelConfig,
) -> list[Region]:
    """The regions of a global tensor that the rank at ``coords`` holds.

    Placements are applied left to right as DTensor does: a ``Shard(d)`` on
    mesh dimension ``m`` keeps the ``coords[m]``-th ``torch.chunk`` of the
    indices still held along tensor dimension ``d``; ``_StridedShard``
    keeps its strided selection. The held indices of each dimension are then
    cut into maximal contiguous runs; their product is the list of regions
    (one region in every layout torch produces today, several for exotic
    strided ones). An empty list means the rank holds nothing.
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

    sizes = {"pp": parallel.pp, "dp": parallel.dp, "tp": parallel.tp}
    held: list[list[int] | range] = [range(n) for n in shape]
    for mesh_dim, p in zip(mesh_dims, placements, strict=True):
        if not isinstance(p, Shard | _StridedShard):
            continue  # Replicate / Partial: every rank of this mesh dimension holds the same indices
        current = held[p.dim]
        num_chunks, rank = sizes[mesh_dim], coords[mesh_dim]
        if isinstance(p, _StridedShard):
            size, offsets = p._local_shard_size_and_offset(
                len(current), num_chunks, rank, offset_mode=_StridedShardOffsetMode.ALL
            )
            picked = [current[i] for i in offsets] if size else []
        else:
            size, start = Shard.local_shard_size_and_offset(len(current), num_chunks, rank)
            picked = current[start : start + size] if size else []
        held[p.dim] = picked if isinstance(picked, range) else list(picked)
    if any(len(h) == 0 for h in held):
        return []
    runs_per_dim = [_runs(h) for h in held]
    return [Region.of(box) for box in product(*runs_per_dim)]


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal ``[start, stop)`` runs of consecutive increasing indices."""
    if isinstance(indices, range) and indices.step == 1:
        return [(indices.start, indices.stop)]
    out: list[tuple[int, int]] = []
    start = prev = indices[0]
    for i in indices[1:]:
        if i != prev + 1:
            out.append((start, prev + 1))
            start = i
        prev = i
    out.append((start, prev + 1))
    return out


def _layout_tensors(stages: list[list[TensorLayout]], parallel: ParallelConfig, optimizer: str) -> list[Tensor]:
    seen: dict[str, int] = {}
    tensors: list[Tensor] = []
    # Layers repeat: the regions depend only on (shape, placements, coordinates on the tensor's mesh).
    memo: dict[tuple[Any, ...], list[Region]] = {}
    for stage, layouts in enumerate(stages):
        stage_ranks = [parallel.rank(dp, tp, stage) for dp in range(parallel.dp) for tp in range(parallel.tp)]
        for lay in layouts:
            if lay.name in seen:
                raise InvalidConfig(
                    f"{lay.name!r} is on pipeline stages {seen[lay.name]} and {stage}; "
                    "names must be global and each tensor must live on one stage"
                )
            seen[lay.name] = stage
            shards: list[tuple[Region, list[int]]] = []
            for rank in stage_ranks:
                coords = parallel.coords(rank)
                key = (lay.shape, lay.mesh_dims, lay.placements, tuple(coords[d] for d in lay.mesh_dims))
                regions = memo.get(key)
                if regions is None:
                    regions = memo[key] = local_regions(lay.shape, lay.mesh_dims, lay.placements, coords, parallel)
                shards.extend((region, [rank]) for region in regions)
            if not shards:  # a 0-element tensor: one empty full region on every rank of the stage
                shards = [(Region.full(lay.shape), stage_ranks)]
            tensors.append(build_tensor(lay.name, lay.shape, lay.dtype, lay.kind, shards))
            if optimizer != "none" and lay.trainable:
                for state in ("exp_avg", "exp_avg_sq"):
                    tensors.append(build_tensor(f"optim/{lay.name}/{state}", lay.shape, lay.dtype, TensorKind.OPTIMIZER, shards))
                holders = sorted({d for _, devs in shards for d in devs})
                tensors.append(build_tensor(f"optim/{lay.name}/step", (), "float32", TensorKind.OPTIMIZER, [(Region.full(()), holders)]))
    return tensors
