"""Key maps: which PTC tensor regions make up which entry of another library's checkpoint.

Tenplex names a job's state after ``named_parameters()`` (global layer
numbers) and ``optim/<param>/<state>``. Other libraries' checkpoints use their
own keys, and a key is not always a view of one parameter: torchtitan's
llama3 keeps one fused ``wqkv`` parameter but its ``state_dict`` hooks save
``wq``/``wk``/``wv`` copies, interleaved per key/value head group. A
:class:`KeyMap` states this explicitly, in both directions at once:

- an :class:`Entry` is one checkpoint tensor: its key (a path in the nested
  state dict; DCP's flat key is the path joined with ``.``), global shape and
  dtype, and the :class:`Piece` s that tile it;
- a :class:`Piece` says that the box ``target`` of the entry is the box
  ``source`` of the PTC tensor ``tensor`` (same shape).

Export reads each piece's source from the stores and saves it as chunks of
the entry; import reads each entry region that a PTC shard needs and writes
it into the shard. Several entries may cover the same tensor region (tied
weights saved under two keys): import takes the first.

Built-in maps (:data:`KEY_MAPS`), chosen by name; any other
``module:function`` spec names a user map with the same signature,
``fn(ptc, options) -> KeyMap``:

``identity``
    one entry per tensor under its Tenplex name (``layers.0.attn.qkv.weight``,
    ``optim/layers.0.attn.qkv.weight/exp_avg``).
``torchtitan``
    torchtitan 0.3.0's ``CheckpointManager`` layout: model keys at the top
    level (its ``ModelWrapper`` merges ``model.state_dict()`` into the saved
    dict, no ``model.`` prefix), a fused ``...wqkv.weight``/``.bias`` split
    into ``...wq``/``wk``/``wv`` as ``FusedQKVLinear``'s save hook does;
    optimizer state under ``optimizer`` with its ``OptimizersContainer``'s flat
    keys ``state.<param fqn>.<state>`` (param names as in
    ``named_parameters()``, so the fused ``wqkv`` stays fused there), i.e. DCP
    keys ``optimizer.state.<fqn>.exp_avg``; and ``lr_scheduler.last_epoch``
    (the step), ``train_state.step``/``ntokens_seen`` when the option
    ``seq_len`` is given, and the optimizer's hyper-parameters as
    ``optimizer.param_groups.<fqn>.<key>`` (which torchtitan's loader
    requires) from the snapshot's trainer-state records: per parameter where
    the recorded groups name their parameters (torchtitan builds its
    optimizers with ``param_names``), for every parameter when there is one
    unnamed group. Options: ``n_heads`` or ``head_dim`` (needed to split a
    fused QKV; also read from the PTC config keys of the same names, top
    level or under ``model``), ``seq_len``. Not written: torchtitan's
    ``dataloader`` state (resume torchtitan with
    ``checkpoint.exclude_from_loading=["dataloader"]``); Tenplex's own
    dataset position travels in the ``tenplex`` entry.

This module is pure (no torch import).
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tenplex.errors import InvalidConfig, InvalidInput
from tenplex.ptc.dataset import DatasetState
from tenplex.ptc.model import PTC, TensorKind
from tenplex.ptc.region import Region, subtract

OPTIM_PREFIX = "optim/"



@dataclass(frozen=True, slots=True)
class ExportContext:
    """What an export knows besides the tensors, for a map's non-tensor entries."""

    step: int
    dataset: DatasetState | None
    param_groups: tuple[Mapping[str, Any], ...] = ()
    """The optimizer parameter groups of the snapshot's trainer-state records (every rank's, without ``params``;
    with ``param_names`` where the optimizer was built from named parameters)."""


Extras = Callable[[ExportContext], dict[tuple[str, ...], Any]]
"""Non-tensor entries a map adds on export: ``context -> {path: value}``."""


@dataclass(frozen=True, slots=True)
class Piece:
    """The box ``target`` of a checkpoint entry is the box ``source`` of PTC tensor ``tensor``."""

    target: Region
    tensor: str
    source: Region


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a checkpoint: its key path, global shape, dtype (PTC name) and the pieces tiling it."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]

    @property
    def fqn(self) -> str:
        """The key DCP stores (a nested state dict's path joined with ``.``)."""
        return ".".join(self.path)


@dataclass(frozen=True)
class KeyMap:
    """A validated mapping from a PTC's tensors to checkpoint entries (see the module docstring)."""

    name: str
    entries: tuple[Entry, ...]
    extras: Extras | None = field(default=None, compare=False)

    def by_fqn(self) -> dict[str, Entry]:
        return {e.fqn: e for e in self.entries}

    def pieces_of(self, tensor: str) -> list[tuple[Entry, Piece]]:
        """Every (entry, piece) whose source is part of ``tensor``, in entry order."""
        return [(e, p) for e in self.entries for p in e.pieces if p.tensor == tensor]

    def uncovered(self, ptc: PTC) -> list[tuple[str, Region]]:
        """PTC tensor boxes (other than ``extra`` ones) that no entry exports: state the checkpoint would lose."""
        by_tensor: dict[str, list[Region]] = {}
        for e in self.entries:
            for p in e.pieces:
                by_tensor.setdefault(p.tensor, []).append(p.source)
        out = []
        for t in ptc.tensors:
            if t.kind == TensorKind.EXTRA or t.numel == 0:
                continue
            missing = [t.region]
            for src in by_tensor.get(t.name, ()):
                missing = [m for box in missing for m in subtract(box, src)]
            out += [(t.name, m) for m in missing]
        return out


def validate(keymap: KeyMap, ptc: PTC) -> KeyMap:
    """Raise :class:`InvalidConfig` unless every entry is tiled exactly by pieces of PTC tensors of its dtype."""
    seen: set[str] = set()
    for e in keymap.entries:
        where = f"key map {keymap.name!r}: entry {e.fqn!r} (shape {list(e.shape)})"
        if not e.path or any(not isinstance(p, str) or not p for p in e.path):
            raise InvalidConfig(f"key map {keymap.name!r}: an entry has an empty key path {e.path!r}")
        if e.fqn in seen:
            raise InvalidConfig(f"{where} appears twice")
        seen.add(e.fqn)
        volume = 0
        for p in e.pieces:
            if not ptc.has_tensor(p.tensor):
                raise InvalidConfig(f"{where}: piece names tensor {p.tensor!r}, which is not in the PTC")
            t = ptc.tensor(p.tensor)
            if t.dtype != e.dtype:
                raise InvalidConfig(f"{where} is {e.dtype}, its piece of {p.tensor!r} is {t.dtype}")
            if p.target.shape != p.source.shape:
                raise InvalidConfig(f"{where}: piece {p.target} and its source {p.source} of {p.tensor!r} differ in shape")
            try:
                p.target.check_within(e.shape)
                p.source.check_within(t.shape)
            except InvalidInput as exc:
                raise InvalidConfig(f"{where}: {exc.detail}") from None
            volume += p.target.volume
        if volume != math.prod(e.shape):
            raise InvalidConfig(f"{where}: its pieces cover {volume} of {math.prod(e.shape)} elements")
        targets = sorted((p.target for p in e.pieces), key=lambda r: r.bounds)
        for i, a in enumerate(targets):
            for b in targets[i + 1 :]:
                if a.overlaps(b):
                    raise InvalidConfig(f"{where}: pieces {a} and {b} overlap")
    return keymap


def _whole(path: tuple[str, ...], ptc: PTC, name: str) -> Entry:
    t = ptc.tensor(name)
    return Entry(path, tuple(t.shape), t.dtype, (Piece(t.region, name, t.region),))


# -- the built-in maps ------------------------------------------------------------


def identity(ptc: PTC, options: Mapping[str, str]) -> KeyMap:
    """Every tensor (but ``extra`` records) whole, under its Tenplex name."""
    _check_options("identity", options, ())
    entries = tuple(_whole((t.name,), ptc, t.name) for t in ptc.tensors if t.kind != TensorKind.EXTRA)
    return KeyMap("identity", entries)


_FUSED_QKV = re.compile(r"^(?P<prefix>.*\.)wqkv\.(?P<param>weight|bias)$")


def torchtitan(ptc: PTC, options: Mapping[str, str]) -> KeyMap:
    """torchtitan 0.3.0's checkpoint keys (see the module docstring)."""
    _check_options("torchtitan", options, ("n_heads", "head_dim", "seq_len"))
    seq_len = _int_option(options, "seq_len", ptc)
    entries: list[Entry] = []
    for t in ptc.tensors:
        if t.kind == TensorKind.EXTRA:
            continue
        if t.kind == TensorKind.OPTIMIZER or t.name.startswith(OPTIM_PREFIX):
            param, state = _split_optim(t.name)
            entries.append(_whole(("optimizer", f"state.{param}.{state}"), ptc, t.name))
            continue
        m = _FUSED_QKV.match(t.name)
        if m is None:
            entries.append(_whole((t.name,), ptc, t.name))
            continue
        entries += _split_qkv(ptc, t.name, m.group("prefix"), m.group("param"), options)

    params = sorted({_split_optim(t.name)[0] for t in ptc.tensors if t.kind == TensorKind.OPTIMIZER or t.name.startswith(OPTIM_PREFIX)})

    def extras(ctx: ExportContext) -> dict[tuple[str, ...], Any]:
        out: dict[tuple[str, ...], Any] = {("lr_scheduler", "last_epoch"): ctx.step}
        if seq_len is not None and ctx.dataset is not None:
            out[("train_state", "step")] = ctx.step
            out[("train_state", "ntokens_seen")] = ctx.dataset.consumed_samples * seq_len
        for fqn, group in _groups_by_param(ctx.param_groups, params).items():
            for key, value in group.items():
                out[("optimizer", f"param_groups.{fqn}.{key}")] = value
        return out

    return KeyMap("torchtitan", tuple(entries), extras)


def _groups_by_param(groups: Sequence[Mapping[str, Any]], params: Sequence[str]) -> dict[str, dict[str, Any]]:
    """param fqn -> its group's hyper-parameters, as torchtitan's flat optimizer state dict keys them."""
    out: dict[str, dict[str, Any]] = {}
    unnamed = [g for g in groups if not g.get("param_names")]
    for g in groups:
        values = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        for fqn in g.get("param_names") or ():
            out.setdefault(fqn, values)
    if not out and len(unnamed) == 1:
        values = {k: v for k, v in unnamed[0].items() if k not in ("params", "param_names")}
        out = dict.fromkeys(params, values)
    wanted = set(params)
    return {fqn: v for fqn, v in out.items() if fqn in wanted}


def _split_optim(name: str) -> tuple[str, str]:
    body = name[len(OPTIM_PREFIX) :] if name.startswith(OPTIM_PREFIX) else name
    param, sep, state = body.rpartition("/")
    if not sep or not param or not state:
        raise InvalidConfig(f"optimizer tensor {name!r} is not named optim/<param>/<state>")
    return param, state


def _split_qkv(ptc: PTC, name: str, prefix: str, param: str, options: Mapping[str, str]) -> list[Entry]:
    """``FusedQKVLinear._split_qkv_on_save``: rows are ``[n_kv, heads_per_kv + 2, head_dim]`` (q heads, k, v)."""
    t = ptc.tensor(name)
    wo_name = prefix.removesuffix("qkv_linear.") + "wo.weight"
    if not ptc.has_tensor(wo_name):
        raise InvalidConfig(f"torchtitan key map: {name!r} has no sibling {wo_name!r} to read the query width from")
    q_rows = ptc.tensor(wo_name).shape[1]  # n_heads * head_dim
    head_dim = _int_option(options, "head_dim", ptc)
    n_heads = _int_option(options, "n_heads", ptc)
    if head_dim is None and n_heads is not None:
        if q_rows % n_heads:
            raise InvalidConfig(f"torchtitan key map: {wo_name!r} has {q_rows} inputs, not a multiple of n_heads={n_heads}")
        head_dim = q_rows // n_heads
    if head_dim is None:
        raise InvalidConfig(
            f"torchtitan key map: splitting the fused {name!r} needs the head size: give the option n_heads=N "
            "or head_dim=N (or put it in the PTC config)"
        )
    rows = t.shape[0]
    kv_rows = rows - q_rows
    if head_dim <= 0 or q_rows % head_dim or kv_rows <= 0 or kv_rows % (2 * head_dim):
        raise InvalidConfig(
            f"torchtitan key map: {name!r} has {rows} rows, {wo_name!r} {q_rows} inputs: no [n_kv, heads_per_kv + 2, "
            f"{head_dim}] row layout fits head_dim={head_dim}"
        )
    n_kv = kv_rows // (2 * head_dim)
    if (q_rows // head_dim) % n_kv:
        raise InvalidConfig(f"torchtitan key map: {q_rows // head_dim} query heads are not a multiple of {n_kv} kv heads")
    hpk = q_rows // head_dim // n_kv
    group = (hpk + 2) * head_dim
    tail = tuple((0, n) for n in t.shape[1:])
    parts = {"wq": (0, hpk * head_dim), "wk": (hpk * head_dim, head_dim), "wv": ((hpk + 1) * head_dim, head_dim)}
    out = []
    for key, (offset, size) in parts.items():
        pieces = tuple(
            Piece(
                Region(((g * size, (g + 1) * size), *tail)),
                name,
                Region(((g * group + offset, g * group + offset + size), *tail)),
            )
            for g in range(n_kv)
        )
        out.append(Entry((f"{prefix}{key}.{param}",), (n_kv * size, *t.shape[1:]), t.dtype, pieces))
    return out


def _int_option(options: Mapping[str, str], key: str, ptc: PTC) -> int | None:
    value: Any = options.get(key)
    if value is None:
        value = ptc.config.get(key)
    if value is None and isinstance(ptc.config.get("model"), Mapping):
        value = ptc.config["model"].get(key)
    if value is None:
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise InvalidConfig(f"key map option {key}={value!r} is not an integer") from None
    if n <= 0:
        raise InvalidConfig(f"key map option {key}={n} must be positive")
    return n


def _check_options(name: str, options: Mapping[str, str], known: Sequence[str]) -> None:
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise InvalidConfig(
            f"key map {name!r} has no option {', '.join(unknown)}; it takes {', '.join(known) if known else 'none'}"
        )


# -- the registry ---------------------------------------------------------------

KeyMapFunction = Callable[[PTC, Mapping[str, str]], KeyMap]

KEY_MAPS: dict[str, KeyMapFunction] = {"identity": identity, "torchtitan": torchtitan}


def resolve(spec: str) -> KeyMapFunction:
    """A built-in map by name, or ``package.module:function``."""
    if spec in KEY_MAPS:
        return KEY_MAPS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidConfig(f"unknown key map {spec!r}: use one of {', '.join(KEY_MAPS)} or module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidConfig(f"key map {spec!r}: cannot import {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise InvalidConfig(f"key map {spec!r}: {module_name!r} has no function {attr!r}")
    return fn


def build(spec: str, ptc: PTC, options: Mapping[str, str] | None = None) -> KeyMap:
    """Resolve ``spec``, build its map for ``ptc`` and validate it."""
    keymap = resolve(spec)(ptc, dict(options or {}))
    if not isinstance(keymap, KeyMap):
        raise InvalidConfig(f"key map {spec!r} returned {type(keymap).__name__}, not a KeyMap")
    return validate(keymap, ptc)

