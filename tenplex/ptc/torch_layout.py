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

Mesh dimensions and their roles. A job's device mesh may name its dimensions
as it likes; each name is mapped to a Tenplex role (:class:`MeshRole`): ``dp``
(data parallel, replicated or sharded as the placements say), ``dp_replicate``
(the replicate dimension of DDP/HSDP: parameters must be ``Replicate`` on it),
``dp_shard`` (the FSDP/ZeRO-3 dimension; HSDP is ``dp_replicate`` plus
``dp_shard``), ``tp`` and ``pp``. The product of the data-parallel dimensions is
Tenplex's ``dp``. Context (``cp``) and expert (``ep``) parallelism are refused
with a clear error until Tenplex supports them (a size-1 dimension of any name
is harmless and ignored). The default mapping, :data:`DEFAULT_MESH_ROLES`,
recognises the names of the reference GPT (``pp, dp, tp``), torchtitan 0.3.0
(``ParallelDims.build_mesh``: ``pp, dp_replicate, fsdp, tp`` for its
``partial_dtensor`` backend, ``dp_replicate, dp_shard, cp, tp`` for
``full_dtensor``; ``cp``, ``ep``, ``efsdp`` refused) and transformers 5.x
(``initialize_distributed_mesh``: ``pp, dp_replicate, fsdp, tp`` and the expert
mesh ``pp, dp_replicate, efsdp, ep``); a job states its own names with
``mesh_roles={"replica": "dp_replicate", "shard": "dp_shard", ...}``.

Which rank holds which region is read off each DTensor's own mesh (the global
rank at every mesh coordinate), so it is exact whatever order the job's mesh
lays its ranks in; the derivation also checks that this order is Tenplex's
(``tp`` fastest, then ``dp``, then ``pp``: :class:`~tenplex.ptc.ParallelConfig`),
because the placement of tensor-parallel groups on nodes and the data-parallel
rank of each device depend on it.

Names are those of ``named_parameters()`` after parallelization (a tied weight
once, under its first name), which are views of the live parameters; a
library's *checkpoint* keys may differ from them (see the table in the
README section "Layouts of other libraries": e.g. torchtitan's fused ``wqkv``
is saved as ``wq``/``wk``/``wv``).

Two ways to hand the job's code to the provider: :func:`derive_ptc` takes a
stage builder and a ``parallelize(module, mesh, parallel)`` function and
builds the ``(pp, dp, tp)`` mesh itself (the reference GPT);
:func:`derive_ptc_from_stages` takes one function that does everything for a
pipeline stage, mesh included (torchtitan's ``ParallelDims`` and
``pipeline_llm``, transformers' ``DistributedConfig``), and returns the
stage's module or modules.

Derive before, not inside, a process that then trains: after a derivation,
torchtitan's FSDP2 parameters built in the same process on a real process
group were seen at the fake group's rank-0 mesh coordinates (a mesh object
cached inside torch.distributed, equal to the new one except for its rank).
The example jobs derive in a subprocess when they need a PTC themselves.

The fake process group is the default group only while a stage is derived and
is destroyed afterwards, so the provider can be called repeatedly. When a
real process group is already initialized in the calling process (inside a
training worker), the derivation runs in a fresh subprocess instead; the
callables must then be picklable (module-level functions or
``functools.partial`` of them).
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import pickle
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
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
"""The mesh :func:`derive_ptc` builds for a job's ``parallelize`` function."""
OPTIMIZERS = ("adamw", "adam", "none")


class MeshRole(StrEnum):
    """What a mesh dimension is to Tenplex."""

    DP = "dp"
    """Data parallel; replicated or sharded (ZeRO-3/FSDP) as the placements say."""
    DP_REPLICATE = "dp_replicate"
    """The replicate dimension of DDP or HSDP: parameters are ``Replicate`` on it."""
    DP_SHARD = "dp_shard"
    """The shard dimension of FSDP/ZeRO-3 (HSDP: beside a ``dp_replicate`` dimension)."""
    TP = "tp"
    PP = "pp"
    CP = "cp"
    """Context parallelism: not supported yet."""
    EP = "ep"
    """Expert parallelism (and expert-FSDP): not supported yet."""


UNSUPPORTED_ROLES = {
    MeshRole.CP: "context parallelism",
    MeshRole.EP: "expert parallelism",
}
_ROLE_ALIASES = {
    "fsdp": MeshRole.DP_SHARD,
    "hsdp_shard": MeshRole.DP_SHARD,
    "replicate": MeshRole.DP_REPLICATE,
    "hsdp_replicate": MeshRole.DP_REPLICATE,
    "context": MeshRole.CP,
    "expert": MeshRole.EP,
}

TENPLEX_MESH_ROLES: Mapping[str, MeshRole] = {"pp": MeshRole.PP, "dp": MeshRole.DP, "tp": MeshRole.TP}
"""The reference GPT's mesh (:data:`MESH_DIMS`)."""
TORCHTITAN_MESH_ROLES: Mapping[str, MeshRole] = {
    "pp": MeshRole.PP,
    "dp": MeshRole.DP,
    "dp_replicate": MeshRole.DP_REPLICATE,
    "dp_shard": MeshRole.DP_SHARD,
    "fsdp": MeshRole.DP_SHARD,  # dp_shard x cp flattened; cp > 1 is refused on the cp dimension itself
    "tp": MeshRole.TP,
    "cp": MeshRole.CP,
    "ep": MeshRole.EP,
    "efsdp": MeshRole.EP,
}
"""torchtitan 0.3.0 ``ParallelDims.build_mesh`` (``partial_dtensor``, ``full_dtensor`` and ``spmd_types`` meshes)."""
TRANSFORMERS_MESH_ROLES: Mapping[str, MeshRole] = {
    "pp": MeshRole.PP,
    "dp_replicate": MeshRole.DP_REPLICATE,
    "fsdp": MeshRole.DP_SHARD,
    "tp": MeshRole.TP,
    "efsdp": MeshRole.EP,
    "ep": MeshRole.EP,
}
"""transformers 5.x ``initialize_distributed_mesh`` (dense mesh ``pp, dp_replicate, fsdp, tp``; expert mesh)."""
DEFAULT_MESH_ROLES: Mapping[str, MeshRole] = {
    **TENPLEX_MESH_ROLES, **TORCHTITAN_MESH_ROLES, **TRANSFORMERS_MESH_ROLES, "context": MeshRole.CP, "expert": MeshRole.EP,
}
"""Every convention above: their names do not conflict."""


def resolve_mesh_roles(mapping: Mapping[str, str] | None = None, *, defaults: bool = True) -> dict[str, MeshRole]:
    """Mesh dimension name -> role: the job's own ``mapping`` over :data:`DEFAULT_MESH_ROLES`.

    Role names are the :class:`MeshRole` values or the aliases ``fsdp``,
    ``replicate``, ``context`` and ``expert``. ``defaults=False`` uses only
    ``mapping``.
    """
    out: dict[str, MeshRole] = dict(DEFAULT_MESH_ROLES) if defaults else {}
    for name, role in (mapping or {}).items():
        if not isinstance(name, str) or not name:
            raise InvalidConfig(f"mesh dimension names must be non-empty strings, got {name!r}")
        text = role.value if isinstance(role, MeshRole) else role
        if not isinstance(text, str):
            raise InvalidConfig(f"the role of mesh dimension {name!r} must be a string, got {role!r}")
        resolved = _ROLE_ALIASES.get(text)
        if resolved is None:
            try:
                resolved = MeshRole(text)
            except ValueError:
                known = sorted({r.value for r in MeshRole} | set(_ROLE_ALIASES))
                raise InvalidConfig(
                    f"mesh dimension {name!r} has an unknown role {text!r}; known roles: {', '.join(known)}"
                ) from None
        out[name] = resolved
    return out

# torch.distributed has one default process group per process: derivations take turns.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def clean_name(name: str) -> str:
    """A parameter name without the prefixes that wrappers (compile, DDP, FSDP1, activation checkpointing)
    insert: the PTC's names and the workers' live names are the model's own, whatever wraps its modules."""
    return ".".join(part for part in name.split(".") if f"{part}." not in _WRAPPER_PREFIXES)


_FAKE_PG_LOCK = threading.RLock()

BuildStage = Callable[[int, int], "nn.Module"]
Parallelize = Callable[["nn.Module", "DeviceMesh", ParallelConfig], "nn.Module"]
BuildParallelStage = Callable[[int, ParallelConfig], "nn.Module | Sequence[nn.Module]"]


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
    mesh_shape: tuple[int, ...] = ()
    """Sizes of the DTensor's mesh dimensions."""
    rank_coords: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """Global rank -> its coordinates on the DTensor's mesh, for every rank of every copy of that mesh."""


def derive_ptc(
    build_stage: BuildStage,
    parallelize: Parallelize,
    parallel: ParallelConfig,
    placement: Placement,
    *,
    optimizer: str = "adamw",
    dataset: DatasetState | None = None,
    model: Mapping[str, Any] | None = None,
    mesh_roles: Mapping[str, str] | None = None,
) -> PTC:
    """The PTC of a job in configuration ``parallel`` placed by ``placement``.

    ``build_stage(stage, num_stages)`` returns pipeline stage ``stage``'s
    module with global parameter names; it is called under a ``meta`` device
    context. ``parallelize(module, mesh, parallel)`` applies the job's TP/DP
    to it on the ``(pp, dp, tp)`` mesh (``mesh["tp"]``, ``mesh["dp"]`` ...)
    and returns it. ``model`` is an optional JSON-able description recorded
    in the PTC's ``config``.
    """
    return derive_ptc_from_stages(
        _MeshAndParallelize(build_stage, parallelize),
        parallel,
        placement,
        optimizer=optimizer,
        dataset=dataset,
        model=model,
        mesh_roles=mesh_roles,
    )


def derive_ptc_from_stages(
    build_parallel_stage: BuildParallelStage,
    parallel: ParallelConfig,
    placement: Placement,
    *,
    optimizer: str = "adamw",
    dataset: DatasetState | None = None,
    model: Mapping[str, Any] | None = None,
    mesh_roles: Mapping[str, str] | None = None,
) -> PTC:
    """The PTC of a job whose own code builds each parallelized pipeline stage, mesh included.

    ``build_parallel_stage(stage, parallel)`` runs under a ``meta`` device
    context and a fake default process group of ``parallel.world_size`` ranks
    in which this process is the stage's first rank (dp 0, tp 0); it builds
    the job's device mesh as the job does, applies the job's parallelisms and
    returns the stage's module (or its modules, for schedules with several
    model parts per rank). ``mesh_roles`` names the roles of the mesh's
    dimensions (see :func:`resolve_mesh_roles`; the default recognises the reference
    GPT, torchtitan and transformers).
    """
    if optimizer not in OPTIMIZERS:
        raise InvalidConfig(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    roles = resolve_mesh_roles(mesh_roles)
    placement.check(parallel)
    if dataset is not None:
        dataset.check_dp(parallel.dp)
    with _FAKE_PG_LOCK, _one_torch_thread():
        stages = read_parallel_stage_layouts(build_parallel_stage, parallel)
        tensors = _layout_tensors(stages, parallel, optimizer, roles)
    devices = tuple(
        Device(rank, placement.host_of(rank), parallel.coords(rank)) for rank in range(parallel.world_size)
    )
    config: dict[str, Any] = {
        **parallel.to_json(),
        "provider": "torch",
        "optimizer": optimizer,
        "gpus_per_node": placement.gpus_per_node,
    }
    if mesh_roles:
        config["mesh_roles"] = {name: roles[name].value for name in mesh_roles}
    if model is not None:
        config["model"] = dict(model)
    return PTC(config=config, devices=devices, tensors=tuple(tensors), dataset=dataset)


@dataclass(frozen=True)
class _MeshAndParallelize:
    """:func:`derive_ptc`'s stage builder: the ``(pp, dp, tp)`` mesh plus the job's ``parallelize`` (picklable)."""

    build_stage: BuildStage
    parallelize: Parallelize

    def __call__(self, stage: int, parallel: ParallelConfig) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        module = self.build_stage(stage, parallel.pp)
        mesh = init_device_mesh("cpu", (parallel.pp, parallel.dp, parallel.tp), mesh_dim_names=MESH_DIMS)
        return self.parallelize(module, mesh, parallel)


# -- reading the stages -----------------------------------------------------------


def read_stage_layouts(
    build_stage: BuildStage, parallelize: Parallelize, parallel: ParallelConfig
) -> list[list[TensorLayout]]:
    """Per pipeline stage, the parameters and persistent buffers with their DTensor placements."""
    return read_parallel_stage_layouts(_MeshAndParallelize(build_stage, parallelize), parallel)


def read_parallel_stage_layouts(build: BuildParallelStage, parallel: ParallelConfig) -> list[list[TensorLayout]]:
    """:func:`read_stage_layouts` for a :data:`BuildParallelStage` (see :func:`derive_ptc_from_stages`)."""
    import torch.distributed as dist

    with _FAKE_PG_LOCK, _one_torch_thread():
        if dist.is_available() and dist.is_initialized():
            log.info("a process group is initialized here; deriving the layout in a subprocess")
            return _read_stages_in_subprocess(build, parallel)
        return _read_all_stages(build, parallel)


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


def _read_all_stages(build: BuildParallelStage, parallel: ParallelConfig) -> list[list[TensorLayout]]:
    return [_read_stage(build, parallel, stage) for stage in range(parallel.pp)]


def _read_stage(build: BuildParallelStage, parallel: ParallelConfig, stage: int) -> list[TensorLayout]:
    """Build and parallelize one stage on meta under a fake process group; read its tensors."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import (
        FakeStore,  # registers the "fake" backend
    )

    # A rank of this stage, so code that looks at its own pipeline coordinate sees the right one.
    rank = parallel.rank(0, 0, stage)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=parallel.world_size)
    try:
        with torch.device("meta"):
            built = build(stage, parallel)
        modules = [built] if isinstance(built, nn.Module) else list(built)
        if not modules or not all(isinstance(m, nn.Module) for m in modules):
            raise InvalidConfig(f"the stage builder returned {type(built).__name__}, not a module or a list of modules")
        items: list[tuple[str, Any, TensorKind]] = []
        seen: set[int] = set()
        for module in modules:
            for n, p in module.named_parameters():
                if id(p) not in seen:  # named_parameters dedups within a module; parts may share too
                    seen.add(id(p))
                    items.append((clean_name(n), p, TensorKind.PARAM))
            items += [(clean_name(n), b, TensorKind.BUFFER) for n, b in _persistent_buffers(module)]
        out: list[TensorLayout] = []
        mesh_cache: dict[int, tuple[tuple[str, ...], tuple[int, ...], dict[int, tuple[int, ...]]]] = {}
        for name, value, kind in items:
            if isinstance(value, DTensor):
                spec_mesh = value.device_mesh
                if id(spec_mesh) not in mesh_cache:
                    mesh_cache[id(spec_mesh)] = _mesh_coords(name, spec_mesh)
                mesh_dims, mesh_shape, rank_coords = mesh_cache[id(spec_mesh)]
                placements = tuple(value.placements)
                if any(p.is_partial() for p in placements):
                    raise InvalidConfig(
                        f"{name!r} has placements {list(placements)}: a pending (Partial) reduction is not a stored layout"
                    )
            else:
                mesh_dims, mesh_shape, rank_coords, placements = (), (), {}, ()
            shape = tuple(int(n) for n in value.shape)
            dtype = dtypes.name_of_torch(value.dtype)
            trainable = kind is TensorKind.PARAM and bool(value.requires_grad)
            out.append(TensorLayout(name, shape, dtype, kind, mesh_dims, placements, trainable, mesh_shape, rank_coords))
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


def _mesh_coords(name: str, mesh: DeviceMesh) -> tuple[tuple[str, ...], tuple[int, ...], dict[int, tuple[int, ...]]]:
    """The mesh's dimension names, sizes, and every global rank's coordinates on it.

    A sub-mesh (``mesh["tp"]``) has one copy per coordinate of the dimensions
    sliced away; the ranks of all copies are read, so every rank of the stage
    gets its coordinates although the fake process group is only one of them.
    """
    dims = tuple(mesh.mesh_dim_names or ())
    shape = tuple(int(n) for n in mesh.shape)
    if len(dims) != len(shape):
        raise InvalidConfig(f"{name!r} is a DTensor on a mesh without dimension names; Tenplex needs named meshes")
    try:  # every copy of the sub-mesh: (copies, *shape) global ranks (torch 2.13's layout algebra)
        full = mesh._layout.remap_to_tensor(mesh._rank_map)
    except AttributeError:  # only this rank's copy
        full = mesh.mesh.reshape(1, *shape)
    coords: dict[int, tuple[int, ...]] = {}
    for copy in full.reshape(-1, *shape):
        for index in product(*(range(n) for n in shape)):
            coords[int(copy[index])] = index
    return dims, shape, coords


def _check_mesh(
    lay: TensorLayout, stage_ranks: Sequence[int], parallel: ParallelConfig, roles: Mapping[str, MeshRole]
) -> None:
    """The DTensor's mesh agrees with ``parallel``: known roles, sizes, Tenplex's rank order; no cp/ep."""
    name = lay.name
    by_role: dict[MeshRole, list[int]] = {}
    for axis, (dim, size) in enumerate(zip(lay.mesh_dims, lay.mesh_shape, strict=True)):
        if size == 1:
            continue  # a size-1 dimension changes nothing, whatever it is
        role = roles.get(dim)
        if role is None:
            raise InvalidConfig(
                f"{name!r} is a DTensor on mesh dimensions {list(lay.mesh_dims)}; dimension {dim!r} (size {size}) "
                f"has no Tenplex role: state it with mesh_roles={{{dim!r}: 'dp' | 'dp_replicate' | 'dp_shard' | 'tp' | 'pp'}}"
            )
        if role in UNSUPPORTED_ROLES:
            raise InvalidConfig(
                f"{name!r} is a DTensor on mesh dimension {dim!r} of size {size} ({UNSUPPORTED_ROLES[role]}); "
                f"Tenplex does not support {UNSUPPORTED_ROLES[role]} yet: run the job with {dim}=1"
            )
        if role is MeshRole.DP_REPLICATE and not lay.placements[axis].is_replicate():
            raise InvalidConfig(
                f"{name!r} is {lay.placements[axis]} on mesh dimension {dim!r}, whose role is dp_replicate: "
                "a replicate dimension holds whole copies (map it to 'dp_shard' or 'dp' if it shards)"
            )
        by_role.setdefault(role, []).append(axis)
    expected = {MeshRole.TP: parallel.tp, MeshRole.PP: parallel.pp}
    for role, want in expected.items():
        axes = by_role.get(role, [])
        got = math.prod(lay.mesh_shape[a] for a in axes)
        if axes and got != want:
            raise InvalidConfig(
                f"{name!r}: mesh dimensions {[lay.mesh_dims[a] for a in axes]} ({role.value}) have size {got}, "
                f"{parallel.describe()} says {role.value}={want}"
            )
    dp_axes = [a for role in (MeshRole.DP, MeshRole.DP_REPLICATE, MeshRole.DP_SHARD) for a in by_role.get(role, [])]
    dp_axes.sort()
    dp_size = math.prod(lay.mesh_shape[a] for a in dp_axes)
    if parallel.dp % dp_size:
        raise InvalidConfig(
            f"{name!r}: data-parallel mesh dimensions {[lay.mesh_dims[a] for a in dp_axes]} have size {dp_size}, "
            f"which does not divide {parallel.describe()}'s dp={parallel.dp}"
        )
    # Rank order: where a role's dimensions span all of it, the mesh coordinate must be Tenplex's.
    spans = {"tp": (by_role.get(MeshRole.TP, []), parallel.tp), "pp": (by_role.get(MeshRole.PP, []), parallel.pp),
             "dp": (dp_axes, parallel.dp)}
    for rank in stage_ranks:
        coords = lay.rank_coords.get(rank)
        if coords is None:
            raise InvalidConfig(f"{name!r}: rank {rank} of its pipeline stage is not on the DTensor's mesh {list(lay.mesh_dims)}")
        want_coords = parallel.coords(rank)
        for key, (axes, full) in spans.items():
            if not axes or math.prod(lay.mesh_shape[a] for a in axes) != full:
                continue
            flat = 0
            for a in axes:
                flat = flat * lay.mesh_shape[a] + coords[a]
            if flat != want_coords[key]:
                raise InvalidConfig(
                    f"{name!r}: the job's mesh puts rank {rank} at {key} {flat}, Tenplex's order "
                    f"(tp fastest, then dp, then pp) at {key} {want_coords[key]}; build the mesh in that order"
                )


def _read_stages_in_subprocess(build: BuildParallelStage, parallel: ParallelConfig) -> list[list[TensorLayout]]:
    try:
        pickle.dumps(build)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise InvalidConfig(
            "a process group is initialized in this process, so the layout is derived in a subprocess, "
            f"which needs picklable build_stage and parallelize callables: {exc}"
        ) from None
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_read_all_stages, build, parallel).result()


# -- from placements to shards ----------------------------------------------------


def local_regions(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any], coords: Sequence[int]
) -> list[Region]:
    """The regions of a global tensor that the rank at mesh coordinates ``coords`` holds.

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

    held: list[list[int] | range] = [range(n) for n in shape]
    for num_chunks, rank, p in zip(mesh_shape, coords, placements, strict=True):
        if not isinstance(p, Shard | _StridedShard):
            continue  # Replicate / Partial: every rank of this mesh dimension holds the same indices
        current = held[p.dim]
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


def _layout_tensors(
    stages: list[list[TensorLayout]], parallel: ParallelConfig, optimizer: str, roles: Mapping[str, MeshRole]
) -> list[Tensor]:
    seen: dict[str, int] = {}
    tensors: list[Tensor] = []
    # Layers repeat: the regions depend only on (shape, placements, coordinates on the tensor's mesh).
    memo: dict[tuple[Any, ...], list[Region]] = {}
    checked: set[tuple[Any, ...]] = set()
    for stage, layouts in enumerate(stages):
        stage_ranks = [parallel.rank(dp, tp, stage) for dp in range(parallel.dp) for tp in range(parallel.tp)]
        for lay in layouts:
            if lay.name in seen:
                raise InvalidConfig(
                    f"{lay.name!r} is on pipeline stages {seen[lay.name]} and {stage}; "
                    "names must be global and each tensor must live on one stage"
                )
            seen[lay.name] = stage
            if lay.mesh_dims:
                mesh_key = (stage, lay.mesh_dims, lay.mesh_shape, tuple(p.is_replicate() for p in lay.placements))
                if mesh_key not in checked:
                    _check_mesh(lay, stage_ranks, parallel, roles)
                    checked.add(mesh_key)
            shards: list[tuple[Region, list[int]]] = []
            for rank in stage_ranks:
                coords = lay.rank_coords[rank] if lay.mesh_dims else ()
                key = (lay.shape, lay.mesh_shape, lay.placements, coords)
                regions = memo.get(key)
                if regions is None:
                    regions = memo[key] = local_regions(lay.shape, lay.mesh_shape, lay.placements, coords)
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
