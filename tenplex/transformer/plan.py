"""The planner: the minimum data movement that turns an old PTC into a new one.

Input: the old PTC (which hosts hold which shards), the version each host holds,
the hosts still alive, and the new PTC. Output: a :class:`Plan` with, for every
target host, the destination shards it must end with and the transfers that
fill them:

- a piece the target host itself holds (in the right version) is copied
  locally, never sent over the network;
- a remote piece comes from one alive holder. A piece only one alive host
  holds comes from it; the others are balanced greedily, largest first, each
  to the candidate that has sent the fewest bytes so far (ties: fewer requests
  so far, then the earlier host), which approximates "minimise the largest
  number of bytes any host sends";
- a host stores each distinct (tensor, region) once, so a shard that several of
  its devices need is fetched once;
- pieces from one source for one destination shard whose union is a box are
  merged into one request;
- rows that exist only in the new layout (vocabulary padding grows with tp) are
  zero-filled, rows that exist only in the old layout are dropped;
- the dataset position is carried over; the new data-parallel size
  re-partitions it (see :class:`~tenplex.ptc.dataset.DatasetState`).

The plan is checked before it is returned: every destination shard is covered
exactly once, and the network bytes equal :func:`_lower_bound`, which is
computed independently (per target host: the bytes of the distinct shards it
needs minus the bytes it already holds, by region intersection, counted over
host sets rather than over the plan's rows).

Planning must take well under a second at the scale of today's largest jobs (a
405B-parameter GPT with ZeRO-1 on 16,384 GPUs: 300,000 shards, a million
transfers), so it works on arrays, not on objects: the shards of both PTCs
become bound arrays; the pieces (new shard x overlapping old shard) come from
one vectorized sweep (old shards sorted per tensor by their start along the
dimension in which they are split most finely; a new shard looks only at those
starting less than one maximal shard length before its end); the rows
(destination shard x host x piece) are array expansions; and only the choices
that depend on each other (balancing pieces several hosts hold, merging
pieces into boxes) run as Python loops, over the rows that need them. A host's
part becomes objects (:class:`DestShard`, :class:`Transfer`) when it is first
read, e.g. to be sent to its daemon.
"""

from __future__ import annotations

import gc
import json
import logging
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from io import StringIO
from itertools import chain
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tenplex.core.units import human_bytes
from tenplex.core.version import Version
from tenplex.errors import InvalidInput, StateLost
from tenplex.ptc import dtypes
from tenplex.ptc.dataset import DatasetState
from tenplex.ptc.model import PTC, Tensor
from tenplex.ptc.region import Bounds, Region, subtract

log = logging.getLogger(__name__)

FORMAT = "tenplex.plan/v1"
CHECKPOINT = "checkpoint"
"""Source name of pieces read from the persistent checkpoint (no survivor holds them)."""

_LOST_LISTED = 20  # lost regions named one by one in a StateLost message

_ZERO = -1
"""Row source: zero-fill (no old shard covers the piece)."""
_FROM_CHECKPOINT = -2
"""Row source: the persistent checkpoint (no alive host holds the piece)."""
_MAX_EXTENT = 1 << 40
"""Tensor dimensions must stay below this: sweep keys are ``tensor * 2**42 + coordinate``."""
_KEY = 1 << 42


def _region(bounds: Bounds) -> Region:
    """A Region from bounds that are already known valid (intersections of validated regions).

    Skips ``Region.__post_init__``: the planner makes hundreds of thousands of
    them and their validity follows from how they are computed.
    """
    r = object.__new__(Region)
    object.__setattr__(r, "bounds", bounds)
    return r


def _volume(bounds: Bounds) -> int:
    n = 1
    for a, b in bounds:
        n *= b - a
    return n


# -- the plan ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DestShard:
    """A shard a target host must hold in the new version: one (tensor, region), stored once per host."""

    tensor: str
    region: Region
    dtype: str
    global_shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.region.volume * dtypes.itemsize(self.dtype)

    def to_json(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "region": self.region.to_json(),
            "dtype": self.dtype,
            "global_shape": list(self.global_shape),
        }


class Transfer(NamedTuple):
    """One piece of one destination shard.

    ``source`` is the host to read from (the target host itself for a local
    copy, :data:`CHECKPOINT` for the persistent checkpoint, ``None`` for
    zero-fill). ``region`` is in global tensor coordinates; ``shard`` indexes
    the host plan's ``shards``. ``alternatives`` are the other alive holders of
    the same piece, in preference order, for re-planning when ``source`` fails.
    A named tuple rather than a dataclass: plans hold hundreds of thousands.
    """

    source: str | None
    tensor: str
    region: Region
    shard: int
    nbytes: int
    alternatives: tuple[str, ...] = ()

    def offset(self, dest: DestShard) -> tuple[int, ...]:
        """Where the piece starts inside its destination shard."""
        return tuple(a - o for (a, _), (o, _) in zip(self.region.bounds, dest.region.bounds, strict=True))


class HostPlan:
    """One target host's part of a plan: the shards it must end with and the transfers that fill them.

    A host plan made by :func:`make_plan` builds its objects when they are
    first read (a 16,384-GPU plan holds a million transfers; most hosts' parts
    are only ever serialized once, to be sent to their daemon); its byte counts
    are known without building them. Immutable once built.
    """

    __slots__ = ("_lazy", "_shards", "_transfers", "host")

    def __init__(self, host: str, shards: Sequence[DestShard], transfers: Sequence[Transfer]) -> None:
        self.host = host
        self._shards = tuple(shards)
        self._transfers = tuple(transfers)
        self._lazy: tuple[_Table, int] | None = None

    @classmethod
    def _of(cls, host: str, table: _Table, host_id: int) -> HostPlan:
        hp = cls.__new__(cls)
        hp.host = host
        hp._shards = hp._transfers = ()
        hp._lazy = (table, host_id)
        return hp

    def _build(self) -> None:
        lazy = self._lazy
        if lazy is not None:
            self._shards, self._transfers = lazy[0].host_part(lazy[1])
            self._lazy = None

    @property
    def shards(self) -> tuple[DestShard, ...]:
        self._build()
        return self._shards

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        self._build()
        return self._transfers

    @property
    def shard_count(self) -> int:
        lazy = self._lazy
        return lazy[0].shard_count(lazy[1]) if lazy is not None else len(self._shards)

    @property
    def transfer_count(self) -> int:
        lazy = self._lazy
        return lazy[0].transfer_count(lazy[1]) if lazy is not None else len(self._transfers)

    def _sum(self, kind: str) -> int:
        lazy = self._lazy
        if lazy is not None:
            return lazy[0].host_bytes(lazy[1], kind)
        total = 0
        for t in self._transfers:
            src = t.source
            k = "zero" if src is None else ("local" if src == self.host else "remote")
            if k == kind:
                total += t.nbytes
        return total

    @property
    def bytes_local(self) -> int:
        return self._sum("local")

    @property
    def bytes_remote(self) -> int:
        """Bytes received over the network (other hosts and the checkpoint)."""
        return self._sum("remote")

    @property
    def bytes_zero(self) -> int:
        return self._sum("zero")

    @property
    def bytes_total(self) -> int:
        lazy = self._lazy
        if lazy is not None:
            return lazy[0].host_bytes(lazy[1], "total")
        return sum(s.nbytes for s in self._shards)

    @property
    def requests(self) -> int:
        """Reads this host issues (local and remote; zero-fills issue none)."""
        lazy = self._lazy
        if lazy is not None:
            return lazy[0].requests(lazy[1])
        return sum(1 for t in self._transfers if t.source is not None)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HostPlan):
            return NotImplemented
        return (self.host, self.shards, self.transfers) == (other.host, other.shards, other.transfers)

    __hash__ = None  # type: ignore[assignment]  # mutable-looking (built lazily): not hashable, as before

    def __repr__(self) -> str:
        return f"HostPlan(host={self.host!r}, shards={self.shard_count}, transfers={self.transfer_count})"

    def to_json(self) -> dict[str, Any]:
        shards = self.shards
        return {
            "host": self.host,
            "shards": [s.to_json() for s in shards],
            "transfers": [
                {
                    "source": t.source,
                    "tensor": t.tensor,
                    "region": t.region.to_json(),
                    "shard": t.shard,
                    "offset": list(t.offset(shards[t.shard])),
                    "nbytes": t.nbytes,
                    "alternatives": list(t.alternatives),
                }
                for t in self.transfers
            ],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> HostPlan:
        host = obj["host"]
        shards = tuple(
            DestShard(s["tensor"], Region.of(s["region"]), dtypes.check_dtype(s["dtype"]), tuple(s["global_shape"]))
            for s in obj["shards"]
        )
        transfers = []
        for i, t in enumerate(obj["transfers"]):
            idx = t["shard"]
            if not isinstance(idx, int) or not 0 <= idx < len(shards):
                raise InvalidInput(f"plan for host {host!r}: transfer {i} names shard {idx!r}, the host has {len(shards)}")
            region = Region.of(t["region"])
            dest = shards[idx]
            if not dest.region.contains(region) or t["tensor"] != dest.tensor:
                raise InvalidInput(
                    f"plan for host {host!r}: transfer {i} ({t['tensor']} {region}) does not lie in its "
                    f"destination shard ({dest.tensor} {dest.region})"
                )
            transfers.append(
                Transfer(t["source"], t["tensor"], region, idx, int(t["nbytes"]), tuple(t.get("alternatives", ())))
            )
        return cls(host, shards, tuple(transfers))


@dataclass(frozen=True, slots=True)
class Plan:
    """A validated transformation plan, per target host."""

    job: str
    old_version: Version
    new_version: Version
    hosts: Mapping[str, HostPlan]
    network_bytes: int
    local_bytes: int
    zero_fill_bytes: int
    lower_bound_bytes: int
    dataset: DatasetState | None = None
    checkpoint: str | None = None
    old_config: Mapping[str, Any] | None = None
    new_config: Mapping[str, Any] | None = None
    old_job: str | None = None
    """The job ``old_version`` belongs to, when not ``job``: a job resumed from another job's persistent
    version (every piece then comes from the checkpoint)."""
    _table: _Table | None = field(default=None, repr=False, compare=False)
    """The arrays :func:`make_plan` built it from (whole-plan statistics without building every host's part)."""

    @property
    def source_job(self) -> str:
        """The job whose ``old_version`` the sources are read from."""
        return self.old_job if self.old_job is not None else self.job

    def host(self, name: str) -> HostPlan:
        try:
            return self.hosts[name]
        except KeyError:
            raise InvalidInput(f"host {name!r} has no part in this plan; hosts: {', '.join(self.hosts)}") from None

    def for_host(self, name: str) -> Plan:
        """The plan as one target host's daemon receives it: only ``name``'s part (the totals stay the plan's)."""
        return replace(self, hosts={name: self.host(name)}, _table=None)

    def part_arrays(self, name: str) -> dict[str, Any] | None:
        """``name``'s part as arrays (for :mod:`tenplex.transformer.part`), straight from the planner's tables;
        None for a plan without them (loaded from JSON or decoded): encode its objects then."""
        self.host(name)
        if self._table is None:
            return None
        return self._table.part_arrays(self._table.host_ids()[name])

    def sources_of(self, name: str) -> set[str]:
        """Every host ``name``'s part may read from (planned sources and their alternatives), itself excluded."""
        self.host(name)
        if self._table is not None:
            return self._table.sources(self._table.host_ids()[name])
        out: set[str] = set()
        for t in self.host(name).transfers:
            if t.source is not None:
                out.add(t.source)
            out.update(t.alternatives)
        out.discard(name)
        return out

    def send_bytes(self) -> dict[str, int]:
        """Bytes each source sends to other hosts (the checkpoint included under its name)."""
        if self._table is not None:
            return self._table.send_bytes()
        out: dict[str, int] = defaultdict(int)
        for hp in self.hosts.values():
            for t in hp.transfers:
                if t.source is not None and t.source != hp.host:
                    out[t.source] += t.nbytes
        return dict(out)

    def receive_bytes(self) -> dict[str, int]:
        return {h: hp.bytes_remote for h, hp in self.hosts.items()}

    def tensor_breakdown(self) -> dict[str, tuple[int, int, int]]:
        """tensor -> (local, network, zero-fill) bytes over all hosts."""
        if self._table is not None:
            return self._table.tensor_breakdown()
        out: dict[str, list[int]] = {}
        for hp in self.hosts.values():
            for t in hp.transfers:
                row = out.get(t.tensor)
                if row is None:
                    row = out[t.tensor] = [0, 0, 0]
                k = 2 if t.source is None else (0 if t.source == hp.host else 1)
                row[k] += t.nbytes
        return {name: (r[0], r[1], r[2]) for name, r in out.items()}

    # -- JSON ---------------------------------------------------------------

    def scalars_json(self) -> dict[str, Any]:
        """Everything but the host parts: also the header of a host's binary part (:mod:`tenplex.transformer.part`)."""
        return {
            "job": self.job,
            "old_version": str(self.old_version),
            "new_version": str(self.new_version),
            "network_bytes": self.network_bytes,
            "local_bytes": self.local_bytes,
            "zero_fill_bytes": self.zero_fill_bytes,
            "lower_bound_bytes": self.lower_bound_bytes,
            "checkpoint": self.checkpoint,
            "old_job": self.old_job,
            "dataset": self.dataset.to_json() if self.dataset is not None else None,
            "old_config": dict(self.old_config) if self.old_config is not None else None,
            "new_config": dict(self.new_config) if self.new_config is not None else None,
        }

    @classmethod
    def from_scalars(cls, obj: Mapping[str, Any], hosts: Mapping[str, HostPlan]) -> Plan:
        """The plan of :meth:`scalars_json`'s fields with these host parts (KeyError, TypeError or ValueError:
        the caller says what was malformed)."""
        dataset = obj.get("dataset")
        return cls(
            job=str(obj["job"]),
            old_version=Version.parse(obj["old_version"]),
            new_version=Version.parse(obj["new_version"]),
            hosts=hosts,
            network_bytes=int(obj["network_bytes"]),
            local_bytes=int(obj["local_bytes"]),
            zero_fill_bytes=int(obj["zero_fill_bytes"]),
            lower_bound_bytes=int(obj["lower_bound_bytes"]),
            dataset=DatasetState.from_json(dataset) if dataset is not None else None,
            checkpoint=obj.get("checkpoint"),
            old_config=obj.get("old_config"),
            new_config=obj.get("new_config"),
            old_job=obj.get("old_job"),
        )

    def to_json(self) -> dict[str, Any]:
        out = {"format": FORMAT, **self.scalars_json(), "hosts": {h: hp.to_json() for h, hp in self.hosts.items()}}
        if self.old_job is None:
            del out["old_job"]
        return out

    @classmethod
    def from_json(cls, obj: Any) -> Plan:
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            got = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
            raise InvalidInput(f"not a transformation plan: expected format {FORMAT!r}, got {got!r}")
        try:
            return cls.from_scalars(obj, {h: HostPlan.from_json(hp) for h, hp in obj["hosts"].items()})
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"malformed plan: {type(exc).__name__}: {exc}") from None

    def dumps(self, indent: int | None = None) -> str:
        return json.dumps(self.to_json(), indent=indent, separators=(",", ":") if indent is None else None)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.dumps())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise InvalidInput(f"cannot read plan file {str(path)!r}: {exc.strerror}") from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"plan file {str(path)!r} is not JSON: {exc}") from None
        return cls.from_json(obj)

    # -- explanation --------------------------------------------------------

    def explain(self, *, tensors: int = 15, hosts: int = 40, width: int = 130) -> str:
        """A human summary: totals, per-host bytes local/remote/sent, per-tensor breakdown (``width`` columns)."""
        from rich.console import Console
        from rich.table import Table

        buf = StringIO()
        console = Console(file=buf, width=width, color_system=None, force_terminal=False)
        sends = self.send_bytes()
        recv = self.receive_bytes()
        top_send = max(sends.items(), key=itemgetter(1), default=("-", 0))
        top_recv = max(recv.items(), key=itemgetter(1), default=("-", 0))
        ratio = self.network_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0
        console.print(f"plan for job {self.job!r}: {self.old_version} -> {self.new_version}")
        if self.old_config is not None and self.new_config is not None:
            console.print(f"layout: {_describe(self.old_config)} -> {_describe(self.new_config)}")
        console.print(
            f"network {human_bytes(self.network_bytes)} (lower bound {human_bytes(self.lower_bound_bytes)}, "
            f"ratio {ratio:.3f}); local copies {human_bytes(self.local_bytes)}; "
            f"zero-filled {human_bytes(self.zero_fill_bytes)}"
        )
        console.print(
            f"largest send: {top_send[0]} {human_bytes(top_send[1])}; "
            f"largest receive: {top_recv[0]} {human_bytes(top_recv[1])}"
        )
        if self.checkpoint is not None:
            console.print(f"checkpoint fallback: {self.checkpoint} ({human_bytes(sends.get(CHECKPOINT, 0))} read from it)")
        if self.dataset is not None:
            console.print(f"dataset: consumed samples {self.dataset.consumed_samples} carried over")

        table = Table(title="per host")
        for col in ("host", "shards", "local", "received", "zero-filled", "sent", "requests"):
            table.add_column(col, justify="left" if col == "host" else "right")
        names = sorted(set(self.hosts) | set(sends))
        for h in names[:hosts]:
            hp = self.hosts.get(h)
            table.add_row(
                h,
                str(hp.shard_count) if hp else "-",
                human_bytes(hp.bytes_local) if hp else "-",
                human_bytes(hp.bytes_remote) if hp else "-",
                human_bytes(hp.bytes_zero) if hp else "-",
                human_bytes(sends.get(h, 0)),
                str(hp.requests) if hp else "-",
            )
        console.print(table)
        if len(names) > hosts:
            console.print(f"... {len(names) - hosts} more hosts")

        breakdown = self.tensor_breakdown()
        ttable = Table(title="per tensor (largest network bytes first)")
        for col in ("tensor", "local", "network", "zero-filled"):
            ttable.add_column(col, justify="left" if col == "tensor" else "right")
        ranked = sorted(breakdown.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))
        for name, (loc, net, zero) in ranked[:tensors]:
            ttable.add_row(name, human_bytes(loc), human_bytes(net), human_bytes(zero))
        console.print(ttable)
        if len(ranked) > tensors:
            console.print(f"... {len(ranked) - tensors} more tensors")
        return buf.getvalue()


def _describe(config: Mapping[str, Any]) -> str:
    parts = [f"{k}{config[k]}" for k in ("dp", "tp", "pp") if k in config]
    if config.get("zero"):
        parts.append(f"zero{config['zero']}")
    return " x ".join(parts) if parts else "?"


# -- shards as arrays -------------------------------------------------------------


@dataclass(slots=True)
class _Columns:
    """The shards of a PTC's tensors (those the plan knows) as arrays: one row per shard.

    Bounds are padded to the plan's largest rank with ``(0, 1)`` so every
    tensor's boxes share one array; device tuples are interned (``devsets``).
    """

    tensor: np.ndarray
    """Index of the shard's tensor in the plan's tensor list."""
    lo: np.ndarray
    """``(shards, ndim)`` starts."""
    hi: np.ndarray
    """``(shards, ndim)`` stops."""
    devset: np.ndarray
    """Index of the shard's device tuple in ``devsets``."""
    devsets: list[tuple[int, ...]]
    regions: list[Region]


def _columns(ptc: PTC, ndim: int, index: Mapping[str, int]) -> _Columns:
    tensor_ids: list[int] = []
    bounds: list[Bounds] = []
    regions: list[Region] = []
    devs: list[int] = []
    dev_ids: dict[tuple[int, ...], int] = {}
    find = dev_ids.get
    for t in ptc.tensors:
        ti = index.get(t.name)
        if ti is None:
            continue
        shards = t.shards
        rs = [s.region for s in shards]
        regions.extend(rs)
        pad = ((0, 1),) * (ndim - len(t.shape))
        bounds.extend([r.bounds + pad for r in rs] if pad else [r.bounds for r in rs])
        ids = [find(s.devices, -1) for s in shards]
        if -1 in ids:  # device tuples not seen before (rarer than not: replicas repeat per tensor)
            for k, s in enumerate(shards):
                if ids[k] == -1:
                    ids[k] = dev_ids.setdefault(s.devices, len(dev_ids))
        devs.extend(ids)
        tensor_ids.extend([ti] * len(shards))
    n = len(bounds)
    flat = np.fromiter(chain.from_iterable(chain.from_iterable(bounds)), dtype=np.int64, count=n * ndim * 2)
    flat = flat.reshape(n, ndim, 2)
    return _Columns(np.array(tensor_ids, dtype=np.int64), np.ascontiguousarray(flat[:, :, 0]),
                    np.ascontiguousarray(flat[:, :, 1]), np.array(devs, dtype=np.int64), list(dev_ids), regions)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``, without the loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    shift = starts - (np.cumsum(counts) - counts)
    return np.arange(total, dtype=np.int64) + np.repeat(shift, counts)


def _sweep(q_tensor: np.ndarray, q_lo: np.ndarray, q_hi: np.ndarray, i_tensor: np.ndarray, i_lo: np.ndarray,
           i_hi: np.ndarray, tensors: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (query box, indexed box) pair of one tensor that overlaps: (query, indexed, overlap lo, overlap hi).

    The indexed boxes of each tensor are sorted by their start along the
    dimension in which they are split most finely (the one with the most
    distinct starts); a query box looks only at those whose start lies less
    than the tensor's longest indexed box before the query's end: boxes of a
    tiling, so the candidates are few. Pairs come grouped by query, in query
    order, and within a query in that sorted order.
    """
    n, ndim = i_lo.shape
    empty = np.zeros(0, dtype=np.int64)
    if n == 0 or len(q_tensor) == 0:
        return empty, empty, np.zeros((0, ndim), np.int64), np.zeros((0, ndim), np.int64)
    # The sweep dimension of each tensor: the most distinct starts among its indexed boxes (the first on ties).
    distinct = np.zeros((ndim, tensors), dtype=np.int64)
    for d in range(ndim):
        order = np.lexsort((i_lo[:, d], i_tensor))
        t, start = i_tensor[order], i_lo[order, d]
        first = np.ones(n, dtype=bool)
        first[1:] = (t[1:] != t[:-1]) | (start[1:] != start[:-1])
        distinct[d] = np.bincount(t[first], minlength=tensors)
    dim = np.argmax(distinct, axis=0)
    rows = np.arange(n)
    i_start = i_lo[rows, dim[i_tensor]]
    keys = i_tensor * _KEY + i_start
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    # The longest indexed box of each tensor along its sweep dimension.
    length = (i_hi[rows, dim[i_tensor]] - i_start)[order]
    sorted_tensor = i_tensor[order]
    first = np.flatnonzero(np.r_[True, sorted_tensor[1:] != sorted_tensor[:-1]])
    maxlen = np.zeros(tensors, dtype=np.int64)
    maxlen[sorted_tensor[first]] = np.maximum.reduceat(length, first)
    qrows = np.arange(len(q_tensor))
    qdim = dim[q_tensor]
    base = q_tensor * _KEY
    first_i = np.searchsorted(keys, base + q_lo[qrows, qdim] - maxlen[q_tensor], side="right")
    end_i = np.searchsorted(keys, base + q_hi[qrows, qdim], side="left")
    counts = np.maximum(end_i - first_i, 0)
    query = np.repeat(qrows, counts)
    cand = order[_ranges(first_i, counts)]
    # Overlaps, one dimension at a time on contiguous columns, dropping the pairs that miss as soon as they do.
    los: list[np.ndarray] = []
    his: list[np.ndarray] = []
    for d in range(ndim):
        lo = np.maximum(np.ascontiguousarray(q_lo[:, d])[query], np.ascontiguousarray(i_lo[:, d])[cand])
        hi = np.minimum(np.ascontiguousarray(q_hi[:, d])[query], np.ascontiguousarray(i_hi[:, d])[cand])
        hit = hi > lo
        if not hit.all():
            query, cand, lo, hi = query[hit], cand[hit], lo[hit], hi[hit]
            los = [x[hit] for x in los]
            his = [x[hit] for x in his]
        los.append(lo)
        his.append(hi)
    return query, cand, np.stack(los, axis=1), np.stack(his, axis=1)


def _bincount(index: np.ndarray, weights: np.ndarray | None, size: int) -> np.ndarray:
    """Exact integer sums per index (byte counts of a large plan stay far below 2**53)."""
    if weights is None:
        return np.bincount(index, minlength=size).astype(np.int64)
    return np.rint(np.bincount(index, weights=weights, minlength=size)).astype(np.int64)


# -- the arrays behind a plan -----------------------------------------------------------


class _Names:
    """Host ids back to names: a row's source, and the alternatives of a source among a piece's candidates."""

    def __init__(self, names: list[str], candidates: list[tuple[int, ...]]) -> None:
        self.names = names
        self.candidates = candidates
        self._alternatives: dict[tuple[int, int], tuple[str, ...]] = {}

    def source(self, source: int) -> str | None:
        if source >= 0:
            return self.names[source]
        return None if source == _ZERO else CHECKPOINT

    def alternatives(self, cands: int, source: int) -> tuple[str, ...]:
        key = (cands, source)
        alts = self._alternatives.get(key)
        if alts is None:
            names = self.names
            alts = self._alternatives[key] = tuple(names[c] for c in self.candidates[cands] if c != source)
        return alts



class _Table:
    """Everything :func:`make_plan` computed, as arrays; builds one host's part on demand.

    Pieces are (new shard, old shard) overlaps (old shard -1: zero-fill);
    pairs are (new shard, target host); rows are (pair, piece): one transfer
    each, except rows a merge replaced (``dropped``) by one of ``merged``.
    """

    def __init__(self, *, names: list[str], tensors: Sequence[Tensor], new: _Columns, ndim: Sequence[int],
                 piece_shard: np.ndarray, piece_lo: np.ndarray, piece_hi: np.ndarray, piece_exact: np.ndarray,
                 pair_shard: np.ndarray, pair_host: np.ndarray, pair_k: np.ndarray, row_pair: np.ndarray,
                 row_piece: np.ndarray, row_source: np.ndarray, row_cands: np.ndarray, row_bytes: np.ndarray,
                 candidates: list[tuple[int, ...]], dropped: np.ndarray,
                 merged: Mapping[int, list[Transfer]]) -> None:
        self.names = names
        self.tensors = tensors
        self.new = new
        self.ndim = ndim
        self.piece_shard, self.piece_lo, self.piece_hi, self.piece_exact = piece_shard, piece_lo, piece_hi, piece_exact
        self.pair_shard, self.pair_k = pair_shard, pair_k
        self.row_pair, self.row_piece, self.row_source, self.row_cands = row_pair, row_piece, row_source, row_cands
        self.row_bytes = row_bytes
        self.candidates = candidates
        self.dropped = dropped
        self.merged = merged
        hosts = len(names)
        row_host = pair_host[row_pair]
        self.row_host = row_host
        # Each host's pairs (in destination-shard order) and rows (in pair, then piece order).
        self.pair_order = np.argsort(pair_host, kind="stable")
        self.pair_bounds = np.searchsorted(pair_host[self.pair_order], np.arange(hosts + 1))
        self.row_order = np.argsort(row_host, kind="stable")
        self.row_bounds = np.searchsorted(row_host[self.row_order], np.arange(hosts + 1))
        local = row_source == row_host
        zero = row_source == _ZERO
        remote = ~local & ~zero
        self.local, self.remote = local, remote
        self.sums = {
            "local": _bincount(row_host[local], row_bytes[local], hosts),
            "remote": _bincount(row_host[remote], row_bytes[remote], hosts),
            "zero": _bincount(row_host[zero], row_bytes[zero], hosts),
            "total": _bincount(row_host, row_bytes, hosts),
        }
        kept = ~dropped
        self._requests = _bincount(row_host[kept & ~zero], None, hosts)
        self._transfers = _bincount(row_host[kept], None, hosts)
        for h, extra in merged.items():
            self._requests[h] += sum(1 for t in extra if t.source is not None)
            self._transfers[h] += len(extra)
        self._dests: dict[int, DestShard] = {}
        self._regions: dict[int, Region] = {}
        self._names = _Names(names, candidates)
        self._host_id: dict[str, int] | None = None

    # -- per host ---------------------------------------------------------------

    def shard_count(self, host: int) -> int:
        return int(self.pair_bounds[host + 1] - self.pair_bounds[host])

    def transfer_count(self, host: int) -> int:
        return int(self._transfers[host])

    def requests(self, host: int) -> int:
        return int(self._requests[host])

    def host_bytes(self, host: int, kind: str) -> int:
        return int(self.sums[kind][host])

    def dest(self, shard: int) -> DestShard:
        d = self._dests.get(shard)
        if d is None:
            t = self.tensors[int(self.new.tensor[shard])]
            d = self._dests[shard] = DestShard(t.name, self.new.regions[shard], t.dtype, t.shape)
        return d

    def region(self, piece: int) -> Region:
        r = self._regions.get(piece)
        if r is None:
            shard = int(self.piece_shard[piece])
            if self.piece_exact[piece]:
                r = self.new.regions[shard]
            else:
                n = self.ndim[int(self.new.tensor[shard])]
                r = _region(tuple(zip(self.piece_lo[piece, :n].tolist(), self.piece_hi[piece, :n].tolist(),
                                      strict=True)))
            self._regions[piece] = r
        return r

    def host_part(self, host: int) -> tuple[tuple[DestShard, ...], tuple[Transfer, ...]]:
        pairs = self.pair_order[self.pair_bounds[host]:self.pair_bounds[host + 1]]
        shards = tuple(self.dest(j) for j in self.pair_shard[pairs].tolist())
        rows = self.row_order[self.row_bounds[host]:self.row_bounds[host + 1]]
        rows = rows[~self.dropped[rows]]
        new_transfer = tuple.__new__
        tensors, shard_tensor = self.tensors, self.new.tensor
        transfers: list[Transfer] = []
        for piece, source, cands, k, nbytes in zip(
            self.row_piece[rows].tolist(), self.row_source[rows].tolist(), self.row_cands[rows].tolist(),
            self.pair_k[self.row_pair[rows]].tolist(), self.row_bytes[rows].tolist(), strict=True,
        ):
            name = tensors[int(shard_tensor[self.piece_shard[piece]])].name
            alts = self._names.alternatives(cands, source) if source >= 0 else ()
            transfers.append(new_transfer(Transfer, (self._names.source(source), name, self.region(piece), k, nbytes,
                                                     alts)))
        extra = self.merged.get(host)
        if extra:
            transfers.extend(extra)
            transfers.sort(key=itemgetter(3))  # by destination shard (stable: pieces keep their order)
        return shards, tuple(transfers)

    def part_arrays(self, host: int) -> dict[str, Any]:
        """One host's part as arrays local to the part, without building its objects (see
        :mod:`tenplex.transformer.part`): the same shards and transfers as :meth:`host_part`, in its order."""
        pairs = self.pair_order[self.pair_bounds[host]:self.pair_bounds[host + 1]]
        shard_global = self.pair_shard[pairs]
        rows = self.row_order[self.row_bounds[host]:self.row_bounds[host + 1]]
        rows = rows[~self.dropped[rows]]
        piece = self.row_piece[rows]
        source = self.row_source[rows]
        k = self.pair_k[self.row_pair[rows]]
        lo, hi = self.piece_lo[piece], self.piece_hi[piece]
        cands = np.where(source >= 0, self.row_cands[rows], -1)
        sets, set_index = np.unique(cands[cands >= 0], return_inverse=True)
        altset = np.full(len(rows), -1, dtype=np.int64)
        altset[cands >= 0] = set_index
        set_members: list[tuple[int, ...]] = [self.candidates[c] for c in sets.tolist()]
        extra = self.merged.get(host)
        if extra:
            ndim = lo.shape[1]
            host_id = self.host_ids()
            e_source, e_alt, e_lo, e_hi = [], [], [], []
            for t in extra:
                e_source.append(_ZERO if t.source is None else _FROM_CHECKPOINT if t.source == CHECKPOINT
                                else host_id[t.source])
                if t.alternatives:
                    e_alt.append(len(set_members))
                    set_members.append(tuple(host_id[a] for a in t.alternatives))
                else:
                    e_alt.append(-1)
                bounds = t.region.bounds + ((0, 1),) * (ndim - len(t.region.bounds))
                e_lo.append([a for a, _ in bounds])
                e_hi.append([b for _, b in bounds])
            k = np.concatenate([k, np.array([t.shard for t in extra], dtype=np.int64)])
            source = np.concatenate([source, np.array(e_source, dtype=np.int64)])
            altset = np.concatenate([altset, np.array(e_alt, dtype=np.int64)])
            lo = np.concatenate([lo, np.array(e_lo, dtype=np.int64).reshape(-1, ndim)])
            hi = np.concatenate([hi, np.array(e_hi, dtype=np.int64).reshape(-1, ndim)])
            order = np.argsort(k, kind="stable")  # by destination shard, as host_part orders them
            k, source, altset, lo, hi = k[order], source[order], altset[order], lo[order], hi[order]
        # Local tables: the part's tensors in order of first use, its hosts in the plan's host order.
        shard_tensor_global = self.new.tensor[shard_global]
        used, first, tensor_local = np.unique(shard_tensor_global, return_index=True, return_inverse=True)
        by_first = np.argsort(first, kind="stable")
        rank = np.empty(len(used), dtype=np.int64)
        rank[by_first] = np.arange(len(used), dtype=np.int64)
        tensors = [self.tensors[t] for t in used[by_first].tolist()]
        ndim = max([1, *(len(t.shape) for t in tensors)])
        flat = np.fromiter((m for s in set_members for m in s), dtype=np.int64,
                           count=sum(len(s) for s in set_members))
        host_ids = np.unique(np.concatenate([source[source >= 0], flat]))
        local_sets = [tuple(np.searchsorted(host_ids, np.array(s, dtype=np.int64)).tolist()) for s in set_members]
        local_source = np.where(source >= 0, np.searchsorted(host_ids, np.maximum(source, 0)), source)
        names = self.names
        return {
            "host": names[host],
            "tensors": [(t.name, t.dtype, tuple(t.shape)) for t in tensors],
            "hosts": [names[h] for h in host_ids.tolist()],
            "shard_tensor": rank[tensor_local],
            "shard_lo": self.new.lo[shard_global, :ndim], "shard_hi": self.new.hi[shard_global, :ndim],
            "source": local_source, "shard": k, "lo": lo[:, :ndim], "hi": hi[:, :ndim], "altset": altset,
            "sets": local_sets,
        }

    def host_ids(self) -> dict[str, int]:
        if self._host_id is None:
            self._host_id = {h: i for i, h in enumerate(self.names)}
        return self._host_id

    def sources(self, host: int) -> set[str]:
        """Every host ``host``'s part may read from (sources and alternatives), itself excluded."""
        rows = self.row_order[self.row_bounds[host]:self.row_bounds[host + 1]]
        rows = rows[~self.dropped[rows]]
        source = self.row_source[rows]
        hosts = set(source[source >= 0].tolist())
        for c in np.unique(self.row_cands[rows][source >= 0]).tolist():
            hosts.update(self.candidates[c])
        out = {self.names[h] for h in hosts}
        if (source == _FROM_CHECKPOINT).any():
            out.add(CHECKPOINT)
        for t in self.merged.get(host, ()):
            if t.source is not None:
                out.add(t.source)
            out.update(t.alternatives)
        out.discard(self.names[host])
        return out

    # -- whole plan ---------------------------------------------------------------

    def send_bytes(self) -> dict[str, int]:
        remote = self.remote
        src = self.row_source[remote]
        data = self.row_bytes[remote]
        out: dict[str, int] = {}
        hosts = src >= 0
        sums = _bincount(src[hosts], data[hosts], len(self.names))
        for h in np.nonzero(np.bincount(src[hosts], minlength=len(self.names)))[0].tolist():
            out[self.names[h]] = int(sums[h])
        ckpt = src == _FROM_CHECKPOINT
        if ckpt.any():
            out[CHECKPOINT] = int(data[ckpt].sum())
        return out

    def tensor_breakdown(self) -> dict[str, tuple[int, int, int]]:
        tensor = self.new.tensor[self.piece_shard[self.row_piece]]
        kind = np.where(self.local, 0, np.where(self.remote, 1, 2))
        key = tensor * 3 + kind
        size = len(self.tensors) * 3
        sums = _bincount(key, self.row_bytes, size).reshape(-1, 3)
        seen = np.bincount(tensor, minlength=len(self.tensors))
        return {self.tensors[t].name: (int(sums[t, 0]), int(sums[t, 1]), int(sums[t, 2]))
                for t in np.nonzero(seen)[0].tolist()}


# -- planning -------------------------------------------------------------------


def _as_version(v: Version | str, what: str) -> Version:
    if isinstance(v, Version):
        return v
    if isinstance(v, str):
        return Version.parse(v)
    raise InvalidInput(f"{what} must be a Version or a string like s10-g0, got {v!r}")


def _sources(
    old: PTC, old_version: Version, holders: Mapping[str, Version | str] | None, alive: Collection[str] | None
) -> set[str]:
    """Old hosts that may serve pieces: alive and holding exactly ``old_version``."""
    alive_set = set(old.hosts) if alive is None else set(alive)
    out = set()
    for h in old.hosts:
        if h not in alive_set:
            continue
        if holders is not None:
            held = holders.get(h)
            if held is None or _as_version(held, f"version held by {h!r}") != old_version:
                log.debug("host %s holds %s, not %s: not a source", h, held, old_version)
                continue
        out.add(h)
    return out


def _check_compatible(old: PTC, new: PTC) -> None:
    problems = []
    for t in new.tensors:
        if not old.has_tensor(t.name):
            problems.append(f"{t.name!r} is not in the old state")
            continue
        o = old.tensor(t.name)
        if o.dtype != t.dtype:
            problems.append(f"{t.name!r} changes dtype {o.dtype} -> {t.dtype}")
        elif len(o.shape) != len(t.shape):
            problems.append(f"{t.name!r} changes rank {list(o.shape)} -> {list(t.shape)}")
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise InvalidInput(f"the new layout does not match the old state: {shown}")
    too_large = [t.name for t in (*old.tensors, *new.tensors) if any(n >= _MAX_EXTENT for n in t.shape)]
    if too_large:
        raise InvalidInput(f"tensor dimensions must stay below 2**40 elements: {too_large[:5]}")
    dropped = [t.name for t in old.tensors if not new.has_tensor(t.name)]
    if dropped:
        log.info("%d tensors of the old state are not in the new layout and are dropped: %s", len(dropped), dropped[:5])


def carry_dataset(old: PTC, new: PTC) -> DatasetState | None:
    """The new layout's dataset state with the old consumed-sample count.

    The sample order must be the same dataset (size and seed); the global batch
    size may change. The new data-parallel size must divide the global batch.
    """
    if old.dataset is None:
        return new.dataset
    if new.dataset is None:
        ds = old.dataset
    else:
        if (new.dataset.num_samples, new.dataset.seed) != (old.dataset.num_samples, old.dataset.seed):
            raise InvalidInput(
                f"the new layout's dataset (num_samples {new.dataset.num_samples}, seed {new.dataset.seed}) is not "
                f"the old one (num_samples {old.dataset.num_samples}, seed {old.dataset.seed})"
            )
        ds = replace(new.dataset, consumed_samples=old.dataset.consumed_samples)
    dp = new.config.get("dp")
    if isinstance(dp, int) and not isinstance(dp, bool):
        ds.check_dp(dp)
    return ds


def make_plan(
    old: PTC,
    new: PTC,
    *,
    job: str,
    old_version: Version | str,
    new_version: Version | str,
    holders: Mapping[str, Version | str] | None = None,
    alive: Collection[str] | None = None,
    checkpoint: str | None = None,
    old_job: str | None = None,
) -> Plan:
    """Plan the transformation of ``old`` (held in ``old_version``) into ``new`` (``new_version``).

    ``holders`` maps each host to the newest committed version it holds
    (``None``: every old host holds ``old_version``); only alive hosts holding
    exactly ``old_version`` serve pieces. ``alive`` defaults to all old hosts.
    Regions that no source holds raise :class:`StateLost` naming them, unless
    ``checkpoint`` (a store URL holding ``old_version``) is given, in which
    case they are read from there. ``old_job`` (another job's name) reads ``old_version`` of that job: only
    from the checkpoint, so no host may hold it (``holders`` must name none).
    """
    if old_job is not None and old_job != job:
        if checkpoint is None:
            raise InvalidInput(f"a plan from job {old_job!r}'s state into job {job!r} needs the checkpoint it is in")
        if holders:
            raise InvalidInput(f"a plan from job {old_job!r}'s state into job {job!r} reads only the checkpoint; "
                               f"no host holds it, got holders {sorted(holders)}")
        holders = {}
    else:
        old_job = None
    # The cyclic garbage collector is paused while the plan is built: reading two large PTCs allocates a few
    # hundred thousand small acyclic objects, and the collector would rescan the growing heap several times
    # over and could free nothing.
    enabled = gc.isenabled()
    gc.disable()
    try:
        plan = _make_plan(old, new, job, old_version, new_version, holders, alive, checkpoint)
    finally:
        if enabled:
            gc.enable()
    return replace(plan, old_job=old_job) if old_job is not None else plan


def _plan_shapes(old: PTC, new: PTC) -> tuple[list[str], dict[str, int], list[int], int, np.ndarray]:
    """The plan's tensors (the new PTC's), their index, ranks, the common padded rank, and the old shapes."""
    names = [t.name for t in new.tensors]
    index = {name: i for i, name in enumerate(names)}
    ranks = [len(t.shape) for t in new.tensors]
    ndim = max([1, *ranks])
    old_shape = np.ones((len(names), ndim), dtype=np.int64)
    for i, name in enumerate(names):
        shape = old.tensor(name).shape
        old_shape[i, : len(shape)] = shape
    return names, index, ranks, ndim, old_shape


def _make_plan(
    old: PTC,
    new: PTC,
    job: str,
    old_version: Version | str,
    new_version: Version | str,
    holders: Mapping[str, Version | str] | None,
    alive: Collection[str] | None,
    checkpoint: str | None,
) -> Plan:
    ov = _as_version(old_version, "old_version")
    nv = _as_version(new_version, "new_version")
    if ov == nv:
        raise InvalidInput(f"the new version must differ from the old one, both are {ov}")
    if not job:
        raise InvalidInput("a plan needs a job name")
    _check_compatible(old, new)
    sources = _sources(old, ov, holders, alive)
    if alive is not None:
        alive_set, old_set = set(alive), set(old.hosts)
        dead_targets = [h for h in new.hosts if h in old_set and h not in alive_set]
        if dead_targets:
            raise InvalidInput(f"the new layout places devices on hosts that are not alive: {dead_targets}")
    dataset = carry_dataset(old, new)

    tensor_names, index, ranks, ndim, old_shape = _plan_shapes(old, new)
    tensors = new.tensors
    oc = _columns(old, ndim, index)
    nc = _columns(new, ndim, index)
    old_hosts = list(old.hosts)
    known = set(old_hosts)
    names = old_hosts + [h for h in new.hosts if h not in known]  # old hosts first: their order ranks sources
    host_id = {h: i for i, h in enumerate(names)}
    nhosts = len(names)

    # Old shards: the alive holders of the old version (candidate sources, in old host order), interned.
    old_host_of = {d.id: host_id[d.host] for d in old.devices}
    source_ids = {host_id[h] for h in sources}
    cand_id: dict[tuple[int, ...], int] = {}
    candidates: list[tuple[int, ...]] = []
    devset_cands = np.empty(len(oc.devsets), dtype=np.int64)
    for k, devs in enumerate(oc.devsets):
        cands = tuple(sorted({old_host_of[d] for d in devs} & source_ids))
        c = cand_id.get(cands)
        if c is None:
            c = cand_id[cands] = len(candidates)
            candidates.append(cands)
        devset_cands[k] = c
    old_cands = devset_cands[oc.devset]
    cand_count = np.array([len(c) for c in candidates], dtype=np.int64)
    cand_first = np.array([c[0] if c else _ZERO for c in candidates], dtype=np.int64)

    # New shards: their distinct target hosts (device order), and the part inside the old shape.
    new_host_of = {d.id: host_id[d.host] for d in new.devices}
    targets = [tuple(dict.fromkeys(new_host_of[d] for d in devs)) for devs in nc.devsets]
    shards = len(nc.regions)
    clip_hi = np.minimum(nc.hi, old_shape[nc.tensor])
    clipped = np.nonzero((clip_hi != nc.hi).any(axis=1))[0]

    # Pieces: every (new shard, old shard) overlap, then the zero-filled boxes outside the old shape.
    p_shard, p_old, p_lo, p_hi = _sweep(nc.tensor, nc.lo, clip_hi, oc.tensor, oc.lo, oc.hi, len(tensors))
    if len(clipped):
        zs, zlo, zhi = [], [], []
        for j in clipped.tolist():
            region = nc.regions[j]
            n = ranks[int(nc.tensor[j])]
            inside = tuple(zip(nc.lo[j, :n].tolist(), clip_hi[j, :n].tolist(), strict=True))
            if any(a >= b for a, b in inside):
                boxes = [region.bounds]
            else:
                boxes = [r.bounds for r in subtract(region, _region(inside))]
            pad = ((0, 1),) * (ndim - n)
            for box in boxes:
                full = box + pad
                zs.append(j)
                zlo.append([a for a, _ in full])
                zhi.append([b for _, b in full])
        order = np.argsort(np.concatenate([p_shard, np.array(zs, dtype=np.int64)]), kind="stable")
        p_shard = np.concatenate([p_shard, np.array(zs, dtype=np.int64)])[order]
        p_old = np.concatenate([p_old, np.full(len(zs), -1, dtype=np.int64)])[order]
        p_lo = np.concatenate([p_lo, np.array(zlo, dtype=np.int64).reshape(-1, ndim)])[order]
        p_hi = np.concatenate([p_hi, np.array(zhi, dtype=np.int64).reshape(-1, ndim)])[order]
    p_volume = np.prod(p_hi - p_lo, axis=1)
    shard_volume = np.prod(nc.hi - nc.lo, axis=1)
    covered = np.rint(np.bincount(p_shard, weights=p_volume, minlength=shards)).astype(np.int64)
    wrong = np.nonzero(covered != shard_volume)[0]
    if len(wrong):
        j = int(wrong[0])
        raise AssertionError(f"planner bug: pieces of {tensor_names[int(nc.tensor[j])]} {nc.regions[j]} cover "
                             f"{int(covered[j])} of {int(shard_volume[j])} elements")
    itemsize = np.array([t.itemsize for t in tensors], dtype=np.int64)
    p_bytes = p_volume * itemsize[nc.tensor[p_shard]]
    p_count = np.bincount(p_shard, minlength=shards)
    p_start = np.cumsum(p_count) - p_count
    p_exact = (p_count[p_shard] == 1) & (p_lo == nc.lo[p_shard]).all(axis=1) & (p_hi == nc.hi[p_shard]).all(axis=1)
    real = p_old >= 0
    p_cands = np.where(real, old_cands[np.where(real, p_old, 0)], -1)
    p_ncands = np.where(real, cand_count[np.where(p_cands >= 0, p_cands, 0)], 0)

    lost = real & (p_ncands == 0)
    if lost.any() and checkpoint is None:
        raise StateLost(_lost_message(lost, p_shard, p_lo, p_hi, nc, tensor_names, ranks, old, sources))

    # Pairs (new shard, target host), in shard order; each host's k-th pair is its k-th destination shard.
    target_count = np.array([len(t) for t in targets], dtype=np.int64)
    target_flat = np.fromiter(chain.from_iterable(targets), dtype=np.int64, count=int(target_count.sum()))
    target_start = np.cumsum(target_count) - target_count
    per_shard = target_count[nc.devset]
    pair_shard = np.repeat(np.arange(shards, dtype=np.int64), per_shard)
    pair_host = target_flat[_ranges(target_start[nc.devset], per_shard)]
    pairs = len(pair_shard)
    by_host = np.argsort(pair_host, kind="stable")
    first_pair = np.searchsorted(pair_host[by_host], np.arange(nhosts))
    pair_k = np.empty(pairs, dtype=np.int64)
    pair_k[by_host] = np.arange(pairs, dtype=np.int64) - first_pair[pair_host[by_host]]

    # Rows (pair, piece): one transfer each.
    row_pair = np.repeat(np.arange(pairs, dtype=np.int64), p_count[pair_shard])
    row_piece = _ranges(p_start[pair_shard], p_count[pair_shard])
    row_host = pair_host[row_pair]
    row_cands = p_cands[row_piece]
    row_bytes = p_bytes[row_piece]
    rows = len(row_pair)

    # Sources: the target itself where it holds the piece; else its only holder; else balanced (below).
    member_keys = np.sort(np.fromiter(
        chain.from_iterable((c * nhosts + h for h in hs) for c, hs in enumerate(candidates)), dtype=np.int64))
    keys = np.where(row_cands >= 0, row_cands, 0) * nhosts + row_host
    at = np.minimum(np.searchsorted(member_keys, keys), max(len(member_keys) - 1, 0))
    local = (row_cands >= 0) & (member_keys[at] == keys) if len(member_keys) else np.zeros(rows, dtype=bool)
    row_ncands = p_ncands[row_piece]
    remote = (row_cands >= 0) & ~local
    source = np.full(rows, _ZERO, dtype=np.int64)
    source[local] = row_host[local]
    source[remote & (row_ncands == 0)] = _FROM_CHECKPOINT
    single = remote & (row_ncands == 1)
    source[single] = cand_first[row_cands[single]]
    several = np.nonzero(remote & (row_ncands > 1))[0]
    if len(several):
        # Pieces with one holder are fixed; the others, largest first, go to the candidate that has sent the
        # fewest bytes so far (then the fewest requests): score = bytes << 32 | requests orders both.
        sent = _bincount(source[single], row_bytes[single], nhosts).tolist()
        asked = _bincount(source[single], None, nhosts).tolist()
        score = [(b << 32) + r for b, r in zip(sent, asked, strict=True)]
        get_score = score.__getitem__
        several = several[np.argsort(-row_bytes[several], kind="stable")]
        chosen = []
        for c, nbytes in zip(row_cands[several].tolist(), row_bytes[several].tolist(), strict=True):
            best = min(candidates[c], key=get_score)
            score[best] += (nbytes << 32) + 1
            chosen.append(best)
        source[several] = chosen

    zero = source == _ZERO
    network = int(row_bytes[~local & ~zero].sum())
    local_bytes = int(row_bytes[local].sum())
    zero_bytes = int(row_bytes[zero].sum())

    table_args = dict(names=names, tensors=tensors, new=nc, ndim=ranks, piece_shard=p_shard, piece_lo=p_lo,
                      piece_hi=p_hi, piece_exact=p_exact, pair_shard=pair_shard, pair_host=pair_host, pair_k=pair_k,
                      row_pair=row_pair, row_piece=row_piece, row_source=source, row_cands=row_cands,
                      row_bytes=row_bytes, candidates=candidates)
    dropped, merged = _merge_rows(table_args, p_count)
    table = _Table(**table_args, dropped=dropped, merged=merged)

    bound = _lower_bound(old, new, sources, oc, nc, ndim, old_shape)
    if network != bound:
        raise AssertionError(f"planner bug: plan moves {network} bytes over the network, the lower bound is {bound}")
    new_hosts = new.hosts
    return Plan(
        job=job,
        old_version=ov,
        new_version=nv,
        hosts={h: HostPlan._of(h, table, host_id[h]) for h in new_hosts},
        network_bytes=network,
        local_bytes=local_bytes,
        zero_fill_bytes=zero_bytes,
        lower_bound_bytes=bound,
        dataset=dataset,
        checkpoint=checkpoint,
        old_config=dict(old.config),
        new_config=dict(new.config),
        _table=table,
    )


def _merge_rows(t: Mapping[str, Any], p_count: np.ndarray) -> tuple[np.ndarray, dict[int, list[Transfer]]]:
    """Rows of one pair (shard, host) from one source whose union is a box, merged into one transfer.

    Returns which rows were merged away and, per host, the transfers that
    replace them. A merged transfer falls back only to hosts that hold all of
    it. Only groups in which two boxes touch (equal in every dimension but one,
    adjacent in that one) can merge: they are found with arrays, and only they
    are merged one by one.
    """
    row_pair, row_piece, source = t["row_pair"], t["row_piece"], t["row_source"]
    dropped = np.zeros(len(row_pair), dtype=bool)
    merged: dict[int, list[Transfer]] = defaultdict(list)
    multi = np.nonzero(p_count[t["pair_shard"][row_pair]] > 1)[0]
    if not len(multi):
        return dropped, merged
    key = row_pair[multi] * (len(t["names"]) + 3) + (source[multi] + 2)
    order = np.argsort(key, kind="stable")
    multi, key = multi[order], key[order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    sizes = np.diff(np.r_[starts, len(key)])
    p_lo, p_hi = t["piece_lo"], t["piece_hi"]
    ndim = p_lo.shape[1]
    touching = np.zeros(len(starts), dtype=bool)
    for gap in range(1, int(sizes.max())):
        groups = np.nonzero(sizes > gap)[0]
        first = _ranges(starts[groups], sizes[groups] - gap)
        group = np.repeat(groups, sizes[groups] - gap)
        a, b = row_piece[multi[first]], row_piece[multi[first + gap]]
        same = (p_lo[a] == p_lo[b]) & (p_hi[a] == p_hi[b])
        adjacent = (p_hi[a] == p_lo[b]) | (p_hi[b] == p_lo[a])
        touch = (same.sum(axis=1) == ndim - 1) & (adjacent & ~same).any(axis=1)
        touching[group[touch]] = True
    groups = np.nonzero(touching)[0]
    if not len(groups):
        return dropped, merged
    names = _Names(t["names"], t["candidates"])
    tensors, shard_tensor, piece_shard = t["tensors"], t["new"].tensor, t["piece_shard"]
    row_cands, row_bytes, pair_host, pair_k = t["row_cands"], t["row_bytes"], t["pair_host"], t["pair_k"]
    for g in groups.tolist():
        members = multi[starts[g]:starts[g] + sizes[g]].tolist()
        pieces = row_piece[members].tolist()
        tensor = tensors[int(shard_tensor[piece_shard[pieces[0]]])]
        n = len(tensor.shape)
        box_of = {tuple(zip(p_lo[p, :n].tolist(), p_hi[p, :n].tolist(), strict=True)): r
                  for p, r in zip(pieces, members, strict=True)}
        out = merge_boxes(list(box_of))
        first_row = members[0]
        src = int(source[first_row])
        host = int(pair_host[row_pair[first_row]])
        k = int(pair_k[row_pair[first_row]])
        for box, parts in out:
            if len(parts) == 1:
                continue
            rows_in = [box_of[b] for b in parts]
            dropped[rows_in] = True
            if src >= 0:
                alts = [names.alternatives(c, src) for c in row_cands[rows_in].tolist()]
                common = set(alts[0]).intersection(*alts[1:])
                alt = tuple(a for a in alts[0] if a in common)
            else:
                alt = ()
            nbytes = _volume(box) * tensor.itemsize
            if nbytes != int(row_bytes[rows_in].sum()):
                raise AssertionError(f"planner bug: merging {tensor.name} {parts} changed the bytes")
            merged[host].append(Transfer(names.source(src), tensor.name, _region(box), k, nbytes, alt))
    return dropped, dict(merged)


def merge_boxes(boxes: Sequence[Bounds]) -> list[tuple[Bounds, list[Bounds]]]:
    """Merge disjoint boxes pairwise while two of them form a box; returns (box, original members).

    Two disjoint boxes form a box when they agree in all dimensions but one and
    touch in that one. Sorting by (other dimensions, start) puts such pairs
    next to each other, so each pass is a sort plus a scan; passes repeat over
    the dimensions until nothing merges.
    """
    items: list[tuple[Bounds, list[Bounds]]] = [(b, [b]) for b in boxes]
    if len(items) < 2:
        return items
    ndim = len(items[0][0])
    changed = True
    while changed and len(items) > 1:
        changed = False
        for d in range(ndim):
            items.sort(key=lambda it: (it[0][:d] + it[0][d + 1 :], it[0][d][0]))
            merged: list[tuple[Bounds, list[Bounds]]] = [items[0]]
            for box, members in items[1:]:
                last, last_members = merged[-1]
                if (
                    last[:d] == box[:d]
                    and last[d + 1 :] == box[d + 1 :]
                    and last[d][1] == box[d][0]
                ):
                    joined = last[:d] + ((last[d][0], box[d][1]),) + last[d + 1 :]
                    merged[-1] = (joined, last_members + members)
                    changed = True
                else:
                    merged.append((box, members))
            items = merged
    return items


def _lost_message(lost: np.ndarray, p_shard: np.ndarray, p_lo: np.ndarray, p_hi: np.ndarray, nc: _Columns,
                  tensor_names: Sequence[str], ranks: Sequence[int], old: PTC, sources: set[str]) -> str:
    pieces = np.nonzero(lost)[0]
    tensors = {int(t) for t in nc.tensor[p_shard[pieces]].tolist()}
    shown = []
    for p in pieces[:_LOST_LISTED].tolist():
        t = int(nc.tensor[p_shard[p]])
        name, n = tensor_names[t], ranks[t]
        box = _region(tuple(zip(p_lo[p, :n].tolist(), p_hi[p, :n].tolist(), strict=True)))
        holders = sorted({old.device(d).host for s in old.tensor(name).shards if s.region.intersect(box)
                          for d in s.devices})
        shown.append(f"{name} {box} (held only by {', '.join(holders)})")
    more = f"; and {len(pieces) - len(shown)} more regions" if len(pieces) > len(shown) else ""
    return (
        f"{len(pieces)} regions in {len(tensors)} tensors are held by no surviving host "
        f"(sources: {', '.join(sorted(sources)) or 'none'}) and no checkpoint is configured: "
        + "; ".join(shown)
        + more
    )


# -- lower bound -------------------------------------------------------------------


def _lower_bound(old: PTC, new: PTC, sources: set[str], oc: _Columns, nc: _Columns, ndim: int,
                 old_shape: np.ndarray) -> int:
    """Bytes that must cross the network: per target host, what it needs minus what it holds.

    Independent of the planner's piece and row bookkeeping: it sums, over
    every new shard, its bytes inside the old shape (padding rows are
    zero-filled, not fetched) once per distinct host that needs it, and
    subtracts every overlap of an old shard with a new shard once per host
    that both holds the old shard (alive, in the usable version, ``sources``)
    and needs the new one, counted by intersecting the two host sets.
    """
    old_host = {d.id: d.host for d in old.devices}
    new_host = {d.id: d.host for d in new.devices}
    held = [frozenset(old_host[d] for d in devs) & sources for devs in oc.devsets]
    need = [frozenset(new_host[d] for d in devs) for devs in nc.devsets]
    itemsize = np.array([t.itemsize for t in new.tensors], dtype=np.int64)
    new_size = itemsize[nc.tensor]
    inside = np.prod(np.maximum(np.minimum(nc.hi, old_shape[nc.tensor]) - nc.lo, 0), axis=1)
    needed = int((inside * np.array([len(s) for s in need], dtype=np.int64)[nc.devset] * new_size).sum())
    useful = np.nonzero(np.array([len(s) > 0 for s in held], dtype=bool)[oc.devset])[0]
    o, n, lo, hi = _sweep(oc.tensor[useful], oc.lo[useful], oc.hi[useful], nc.tensor, nc.lo, nc.hi,
                          len(new.tensors))
    if not len(o):
        return needed
    volume = np.prod(hi - lo, axis=1)
    width = len(need)
    key = oc.devset[useful[o]] * width + nc.devset[n]
    pairs, which = np.unique(key, return_inverse=True)
    both = np.array([len(held[k // width] & need[k % width]) for k in pairs.tolist()], dtype=np.int64)
    have = int((volume * both[which] * new_size[n]).sum())
    return needed - have


def plan_summary(plan: Plan) -> dict[str, Any]:
    """Small numbers about a plan, for logs and status endpoints."""
    sends = plan.send_bytes()
    recv = plan.receive_bytes()
    return {
        "network_bytes": plan.network_bytes,
        "lower_bound_bytes": plan.lower_bound_bytes,
        "local_bytes": plan.local_bytes,
        "zero_fill_bytes": plan.zero_fill_bytes,
        "max_send_bytes": max(sends.values(), default=0),
        "max_receive_bytes": max(recv.values(), default=0),
        "hosts": len(plan.hosts),
        "transfers": sum(hp.transfer_count for hp in plan.hosts.values()),
    }


# -- what a placement keeps in place ------------------------------------------------------------


@dataclass(frozen=True)
class HostOverlap:
    """Per new host of a layout, the bytes it needs and how many of them each old holder has.

    What a placement choice needs (:mod:`tenplex.scheduler.policy`): putting
    the new host ``new_hosts[b]``'s ranks on old host ``old_hosts[h]`` makes
    that host receive ``need[b] - keep[b, h]`` bytes (exactly what the plan
    has it receive: a host takes every byte it holds from its own store).
    """

    new_hosts: tuple[str, ...]
    old_hosts: tuple[str, ...]
    need: np.ndarray
    """``(len(new_hosts),)``: the distinct bytes each new host's devices hold."""
    keep: np.ndarray
    """``(len(new_hosts), len(old_hosts))``: of those, the bytes the old host holds (in ``old``)."""


def host_overlap(old: PTC, new: PTC, holders: Collection[str] | None = None) -> HostOverlap:
    """Bytes each host of ``new`` needs and finds on each host of ``old`` (``holders``: only these old hosts).

    One vectorized sweep over the two PTCs' shards (as :func:`make_plan`'s), summed over host sets: a
    shard replicated on many hosts is counted per (new host set, old host set) pair, expanded to hosts at
    the end, so a data-parallel layout of thousands of hosts costs a few arrays, not a loop per replica.
    """
    new_tensors = list(new.tensors)
    index = {t.name: i for i, t in enumerate(new_tensors)}
    ndim = max((len(t.shape) for t in new_tensors), default=0) or 1
    items = np.array([dtypes.itemsize(t.dtype) for t in new_tensors], dtype=np.float64)
    nc = _columns(new, ndim, index)
    oc = _columns(old, ndim, index)
    new_hosts = tuple(new.hosts)
    held = None if holders is None else set(holders)
    old_all = tuple(old.hosts) if held is None else tuple(h for h in old.hosts if h in held)
    nh = {h: i for i, h in enumerate(new_hosts)}
    oh = {h: i for i, h in enumerate(old_all)}

    def hostsets(ptc: PTC, devsets: list[tuple[int, ...]], ids: Mapping[str, int]) -> tuple[list[np.ndarray], np.ndarray]:
        """Each device tuple's set of host indices (interned: replicas share theirs), -1 hosts left out."""
        host_of = {d.id: ids.get(d.host, -1) for d in ptc.devices}
        sets: dict[tuple[int, ...], int] = {}
        of_devset = np.empty(len(devsets), dtype=np.int64)
        for k, ds in enumerate(devsets):
            if len(ds) == 1:
                h = host_of[ds[0]]
                hs: tuple[int, ...] = (h,) if h >= 0 else ()
            else:
                hs = tuple(sorted({host_of[d] for d in ds} - {-1}))
            of_devset[k] = sets.setdefault(hs, len(sets))
        return [np.array(hs, dtype=np.int64) for hs in sets], of_devset

    n_sets, n_of = hostsets(new, nc.devsets, nh)
    o_sets, o_of = hostsets(old, oc.devsets, oh)
    need = np.zeros(len(new_hosts), dtype=np.float64)
    keep = np.zeros((len(new_hosts), len(old_all)), dtype=np.float64)

    def spread(set_ids: np.ndarray, weights: np.ndarray, sets: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(host index, weight) per member of each set: a set of k hosts repeats its weight k times."""
        sizes = np.array([len(x) for x in sets], dtype=np.int64)[set_ids]
        flat = np.concatenate(sets) if sets else np.zeros(0, np.int64)
        starts = (np.cumsum([len(x) for x in sets]) - [len(x) for x in sets]).astype(np.int64) if sets else flat
        members = flat[_ranges(starts[set_ids], sizes)] if len(set_ids) else flat[:0]
        return members, np.repeat(weights, sizes)

    if len(nc.tensor):
        vol = np.prod(nc.hi - nc.lo, axis=1).astype(np.float64) * items[nc.tensor]
        per_set = np.bincount(n_of[nc.devset], weights=vol, minlength=len(n_sets))
        ids = np.flatnonzero(per_set)
        hosts_b, w = spread(ids, per_set[ids], n_sets)
        need += np.bincount(hosts_b, weights=w, minlength=len(new_hosts))
    if len(nc.tensor) and len(oc.tensor) and old_all:
        q, i, lo, hi = _sweep(nc.tensor, nc.lo, nc.hi, oc.tensor, oc.lo, oc.hi, len(new_tensors))
        nbytes = np.prod(hi - lo, axis=1).astype(np.float64) * items[nc.tensor[q]]
        width = max(1, len(o_sets))
        pair = n_of[nc.devset[q]] * width + o_of[oc.devset[i]]
        keys, inverse = np.unique(pair, return_inverse=True)
        sums = np.bincount(inverse, weights=nbytes, minlength=len(keys))
        ns_id, os_id = keys // width, keys % width
        n_size = np.array([len(x) for x in n_sets], dtype=np.int64)[ns_id]
        o_size = np.array([len(x) for x in o_sets], dtype=np.int64)[os_id]
        single = (n_size == 1) & (o_size == 1)  # per-device state (ZeRO slices, unreplicated shards): one cell each
        if single.any():
            rows = np.array([x[0] if len(x) == 1 else -1 for x in n_sets], dtype=np.int64)[ns_id[single]]
            cols = np.array([x[0] if len(x) == 1 else -1 for x in o_sets], dtype=np.int64)[os_id[single]]
            np.add.at(keep, (rows, cols), sums[single])
        for k in np.flatnonzero(~single & (n_size > 0) & (o_size > 0)).tolist():  # replicated: a block of cells
            keep[np.ix_(n_sets[ns_id[k]], o_sets[os_id[k]])] += sums[k]
    return HostOverlap(new_hosts, old_all, np.rint(need), np.rint(keep))
