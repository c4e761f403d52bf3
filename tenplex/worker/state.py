"""What one rank holds of the job state, in PTC terms: the live layout.

Snapshot and restore both need, for every tensor of the state this rank holds,
its global name, global shape, dtype, the region of the global tensor this rank
holds, and the local torch tensor whose storage holds it. This module reads
that off the live model and optimizer:

- parameters by their fully qualified name (wrapper prefixes such as
  ``_orig_mod.`` or ``module.`` removed, so the names are those of the model);
- a DTensor's region from its mesh and placements (TP shards, FSDP2 shards,
  replicas); a plain tensor is the whole tensor (e.g. a norm weight on a
  pipeline stage);
- optimizer state as ``optim/<param>/<key>`` (``exp_avg``, ``exp_avg_sq``,
  ``step`` for AdamW): same-shape state has the parameter's region, scalars
  (``step``) are whole.

:func:`check_layout` compares it with the device's part of a PTC and names the
first tensor that differs, with both layouts. :func:`materialize` allocates a
model built on the ``meta`` device without values, for a worker that restores
(its initial values would all be overwritten).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tenplex.errors import InvalidConfig
from tenplex.ptc import PTC, Region, TensorKind
from tenplex.ptc import dtypes as ptc_dtypes
from tenplex.ptc.torch_layout import clean_name

log = logging.getLogger(__name__)

OPTIM_PREFIX = "optim/"
EXTRA_PREFIX = "extra/"


@dataclass(frozen=True, slots=True)
class LocalPiece:
    """One tensor of the state as this rank holds it."""

    name: str
    kind: TensorKind
    global_shape: tuple[int, ...]
    dtype: str
    region: Region
    local: torch.Tensor
    """The local torch tensor (a DTensor's ``to_local()``), sharing the live storage."""

    def layout(self) -> str:
        return f"{self.region} of {list(self.global_shape)} {self.dtype}"


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_view(t: torch.Tensor) -> tuple[torch.Tensor, Region]:
    """The local tensor of ``t`` and the region of the global tensor it holds."""
    if _is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = t.to_local()
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if tuple(local.shape) != tuple(shape):
            raise InvalidConfig(
                f"DTensor local shape {list(local.shape)} differs from the shape {list(shape)} its placements "
                f"{t.placements} imply on global shape {list(t.shape)}"
            )
        return local, Region.from_offsets(offset, shape)
    return t, Region.full(tuple(t.shape))


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Distinct parameters by cleaned FQN (a tied weight appears once, under its first name)."""
    out: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        out.append((clean_name(name), p))
    return out


def _piece(name: str, kind: TensorKind, t: torch.Tensor) -> LocalPiece:
    local, region = local_view(t)
    return LocalPiece(
        name=name,
        kind=kind,
        global_shape=tuple(t.shape),
        dtype=ptc_dtypes.name_of_torch(t.dtype),
        region=region,
        local=local,
    )


def live_pieces(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[LocalPiece]:
    """Every tensor of the state this rank holds: parameters, then optimizer state."""
    params = named_parameters(model)
    pieces = [_piece(name, TensorKind.PARAM, p) for name, p in params]
    if optimizer is not None:
        name_of = {id(p): name for name, p in params}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in name_of:
                    raise InvalidConfig(
                        f"the optimizer holds a parameter of shape {list(p.shape)} that is not in the model"
                    )
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        pieces.append(_piece(f"{OPTIM_PREFIX}{name_of[id(p)]}/{key}", TensorKind.OPTIMIZER, value))
    return pieces


def ensure_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, ptc: PTC, *, zeros: bool = True) -> int:
    """Create the optimizer state the PTC names but the optimizer lacks (it has not stepped yet).

    A state tensor of the parameter's global shape is created like the
    parameter (same DTensor placements, same device), any other (``step``) as a
    plain tensor of the PTC's shape and dtype on CPU, which is where AdamW keeps
    its step counter. With ``zeros`` they are zeros, which is AdamW's own
    initial state (a fresh job's first step is unchanged); without, they are
    left uninitialised, for a restore that overwrites them all (no pass over
    memory that is about to be written). Returns the number of tensors created.
    """
    created = 0
    for name, p in named_parameters(model):
        prefix = f"{OPTIM_PREFIX}{name}/"
        wanted = [t for t in ptc.tensors if t.name.startswith(prefix) and "/" not in t.name[len(prefix) :]]
        if not wanted:
            continue
        state = optimizer.state[p]
        for t in wanted:
            key = t.name[len(prefix) :]
            if key in state:
                continue
            dtype = ptc_dtypes.torch_dtype(t.dtype)
            if tuple(t.shape) == tuple(p.shape) and t.shape:
                like = torch.zeros_like if zeros else torch.empty_like
                state[key] = like(p, dtype=dtype, memory_format=torch.preserve_format)
            else:
                state[key] = (torch.zeros if zeros else torch.empty)(t.shape, dtype=dtype)
            created += 1
    return created


def materialize(
    module: nn.Module,
    device: torch.device | str,
    *,
    init_buffers: Callable[[nn.Module], None] | None = None,
) -> int:
    """Storage without values for a module built (and parallelized) on the ``meta`` device, for a restore to fill.

    A worker that restores a version overwrites every parameter and optimizer
    state tensor it holds (:func:`check_layout` guarantees the PTC covers them
    all), so initial values are wasted work, and for a large model it is the
    bulk of its start-up: the random draws, and the collectives with which
    DTensor's ``distribute_tensor`` makes them agree (a scatter or broadcast
    from rank 0 of every tensor parallelized with real values). A job that
    restores builds and parallelizes on ``meta`` instead (DTensor TP, FSDP2
    ``fully_shard`` and ``replicate`` accept meta parameters and skip that
    communication; this is how torchtitan builds every model), then calls this,
    before it creates its optimizer: ``module.to_empty(device=device)`` allocates
    each parameter and buffer without writing it (DTensors keep their
    placements; FSDP2 re-registers its sharded parameters; tied parameters are
    tied again).

    Buffers are not restored (a job's state is its parameters and optimizer
    state), so none may be left without a value: buffers that had values
    already (made off ``meta``) keep them, and those made on ``meta`` (e.g. a
    RoPE cache) are set by ``init_buffers(module)``, the job's own buffer
    initialisation; without one they are an :class:`InvalidConfig` naming
    them, raised before anything is allocated. A module with nothing on
    ``meta`` is left as it is. Returns the number of tensors allocated.
    """
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    if not any(t.is_meta for _, t in tensors):
        return 0
    buffers = dict(module.named_buffers())
    unset = sorted(name for name, b in buffers.items() if b.is_meta)
    if unset and init_buffers is None:
        raise InvalidConfig(
            f"buffers {unset[:5]}{' and more' if len(unset) > 5 else ''} were built on the meta device and a restore "
            "does not set buffers: pass init_buffers (the model's own buffer initialisation) to materialize"
        )
    kept = {name: b for name, b in buffers.items() if not b.is_meta}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}  # a tied parameter: every module that holds it
    for mod in module.modules():
        for pname, param in mod._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((mod, pname))
    module.to_empty(device=device)
    for places in owners.values():  # to_empty gives each holder of a tied parameter its own copy: tie again
        first = getattr(places[0][0], places[0][1])
        for mod, pname in places[1:]:
            setattr(mod, pname, first)
    with torch.no_grad():
        now = dict(module.named_buffers())
        for name, value in kept.items():
            now[name].copy_(value)
        if unset and init_buffers is not None:
            init_buffers(module)
    left = sorted(name for name, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta)
    if left:
        raise InvalidConfig(f"tensors {left[:5]} are still on the meta device after materializing the module")
    count = len({id(t) for _, t in tensors})
    log.info("materialized %d tensors on %s without values (%d buffers initialised, %d kept)", count, device,
             len(unset), len(kept))
    return count


def expected_pieces(ptc: PTC, device: int) -> dict[str, tuple[tuple[int, ...], str, Region]]:
    """name -> (global shape, dtype, region) for the non-extra tensors ``device`` holds in ``ptc``."""
    out: dict[str, tuple[tuple[int, ...], str, Region]] = {}
    for t, s in ptc.shards_of_device(device):
        if t.kind == TensorKind.EXTRA:
            continue
        if t.name in out:
            raise InvalidConfig(
                f"device {device} holds two shards of {t.name!r} ({out[t.name][2]} and {s.region}); "
                "a rank's live tensor is one region, so this PTC does not describe a PyTorch job"
            )
        out[t.name] = (tuple(t.shape), t.dtype, s.region)
    return out


def check_layout(pieces: Iterable[LocalPiece], ptc: PTC, device: int) -> None:
    """Raise :class:`InvalidConfig` naming the first tensor whose live layout differs from the PTC's."""
    expected = expected_pieces(ptc, device)
    live = {p.name: p for p in pieces}
    for name, (shape, dtype, region) in expected.items():
        want = f"{region} of {list(shape)} {dtype}"
        piece = live.get(name)
        if piece is None:
            raise InvalidConfig(
                f"layout mismatch on device {device}: the PTC gives it {name!r} ({want}), "
                "the live model/optimizer has no such tensor"
            )
        if piece.global_shape != shape or piece.dtype != dtype or piece.region != region:
            raise InvalidConfig(
                f"layout mismatch on device {device} for {name!r}: live {piece.layout()}, PTC {want}"
            )
    for name, piece in live.items():
        if name not in expected and piece.region.volume == 0:
            continue  # an empty local shard (uneven FSDP2 split): the PTC lists no shard for it
        if name not in expected:
            where = "is not in the PTC" if not ptc.has_tensor(name) else "is not held by this device in the PTC"
            raise InvalidConfig(
                f"layout mismatch on device {device}: live tensor {name!r} ({piece.layout()}) {where}"
            )
