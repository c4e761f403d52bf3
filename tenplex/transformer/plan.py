"""The planner: the minimum data movement that turns an old PTC into a new one.

Input: the old PTC (which hosts hold which shards), the version each host holds,
the hosts still alive, and the new PTC. Output: a :class:`Plan` with, for every
target host, the destination shards it must end with and the transfers that
fill them:

- a piece the target host itself holds (in the right version) is copied
  locally, never sent over the network;
- a remote piece comes from one alive holder; holders are chosen by a greedy
  longest-piece-first balancing that gives each piece to the candidate with the
  fewest bytes sent so far (ties: fewer requests so far), which approximates
  "minimise the largest number of bytes any host sends";
- a host stores each distinct (tensor, region) once, so a shard that several of
  its devices need is fetched once;
- pieces from one source for one destination shard whose union is a box are
  merged into one request;
- rows that exist only in the new layout (vocabulary padding grows with tp) are
  zero-filled, rows that exist only in the old layout are dropped;
- the dataset position is carried over; the new data-parallel size
  re-partitions it (see :class:`~tenplex.ptc.dataset.DatasetState`).

The plan is checked before it is returned: every destination shard is covered
exactly once, and the network bytes equal :func:`lower_bound_bytes`, which is
computed independently (per target host: the bytes of the distinct shards it
needs minus the bytes it already holds, by region intersection).

Planning must take well under a second for a 1024-GPU GPT-3 175B layout, so the
hot loops work on plain bound tuples, old shards are indexed per tensor by
their start along the most finely split dimension (interval search, never all
pairs), the pieces of a destination shard are computed once however many hosts
need it, and transfers are named tuples.
"""

from __future__ import annotations

import gc
import json
import logging
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from io import StringIO
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

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


def _intersect(x: Bounds, y: Bounds) -> Bounds | None:
    out = []
    for (a0, a1), (b0, b1) in zip(x, y, strict=True):
        lo = a0 if a0 > b0 else b0
        hi = a1 if a1 < b1 else b1
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


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


@dataclass(frozen=True, slots=True)
class HostPlan:
    host: str
    shards: tuple[DestShard, ...]
    transfers: tuple[Transfer, ...]

    def _sum(self, kind: str) -> int:
        total = 0
        for t in self.transfers:
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
        return sum(s.nbytes for s in self.shards)

    @property
    def requests(self) -> int:
        """Reads this host issues (local and remote; zero-fills issue none)."""
        return sum(1 for t in self.transfers if t.source is not None)

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

    def host(self, name: str) -> HostPlan:
        try:
            return self.hosts[name]
        except KeyError:
            raise InvalidInput(f"host {name!r} has no part in this plan; hosts: {', '.join(self.hosts)}") from None

    def for_host(self, name: str) -> Plan:
        """The plan as one target host's daemon receives it: only ``name``'s part (the totals stay the plan's)."""
        return replace(self, hosts={name: self.host(name)})

    def sources_of(self, name: str) -> set[str]:
        """Every host ``name``'s part may read from (planned sources and their alternatives), itself excluded."""
        out: set[str] = set()
        for t in self.host(name).transfers:
            if t.source is not None:
                out.add(t.source)
            out.update(t.alternatives)
        out.discard(name)
        return out

    def send_bytes(self) -> dict[str, int]:
        """Bytes each source sends to other hosts (the checkpoint included under its name)."""
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

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "job": self.job,
            "old_version": str(self.old_version),
            "new_version": str(self.new_version),
            "network_bytes": self.network_bytes,
            "local_bytes": self.local_bytes,
            "zero_fill_bytes": self.zero_fill_bytes,
            "lower_bound_bytes": self.lower_bound_bytes,
            "checkpoint": self.checkpoint,
            "dataset": self.dataset.to_json() if self.dataset is not None else None,
            "old_config": dict(self.old_config) if self.old_config is not None else None,
            "new_config": dict(self.new_config) if self.new_config is not None else None,
            "hosts": {h: hp.to_json() for h, hp in self.hosts.items()},
        }

    @classmethod
    def from_json(cls, obj: Any) -> Plan:
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            got = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
            raise InvalidInput(f"not a transformation plan: expected format {FORMAT!r}, got {got!r}")
        try:
            hosts = {h: HostPlan.from_json(hp) for h, hp in obj["hosts"].items()}
            dataset = obj.get("dataset")
            return cls(
                job=obj["job"],
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
            )
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
                str(len(hp.shards)) if hp else "-",
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


# -- indexes -------------------------------------------------------------------


class _OldTensor:
    """The old shards of one tensor, searchable by region.

    Shards are sorted by their start along the dimension in which they are
    split most finely; a query visits only shards whose start lies within one
    maximal shard length before the query's end (they cannot overlap
    otherwise), which keeps the search logarithmic plus output size.
    """

    __slots__ = ("bounds", "dim", "ids", "maxlen", "shape", "starts")

    def __init__(self, shape: tuple[int, ...], shards: list[tuple[Bounds, int]]) -> None:
        self.shape = shape
        ndim = len(shape)
        dim = 0
        if ndim > 1 and len(shards) > 1:
            best = -1
            for d in range(ndim):
                n = len({b[d][0] for b, _ in shards})
                if n > best:
                    best, dim = n, d
        self.dim = dim
        if ndim:
            shards = sorted(shards, key=lambda e: e[0][dim][0])
            self.starts = [b[dim][0] for b, _ in shards]
            self.maxlen = max(b[dim][1] - b[dim][0] for b, _ in shards)
        else:
            self.starts = [0] * len(shards)
            self.maxlen = 0
        self.bounds = [b for b, _ in shards]
        self.ids = [i for _, i in shards]

    def query(self, bounds: Bounds) -> list[tuple[Bounds, int]]:
        """(piece, old shard id) for every old shard overlapping ``bounds``."""
        if len(self.bounds) == 1:
            piece = _intersect(self.bounds[0], bounds) if bounds else ()
            return [] if piece is None else [(piece, self.ids[0])]
        if not bounds:
            return [((), self.ids[0])]
        a, b = bounds[self.dim]
        lo = bisect_right(self.starts, a - self.maxlen)
        hi = bisect_left(self.starts, b)
        out = []
        for k in range(lo, hi):
            piece = _intersect(self.bounds[k], bounds)
            if piece is not None:
                out.append((piece, self.ids[k]))
        return out


def _hosts_of(
    devices: tuple[int, ...], host_of: Mapping[int, str], cache: dict[tuple[int, ...], tuple[str, ...]]
) -> tuple[str, ...]:
    hosts = cache.get(devices)
    if hosts is None:
        hosts = cache[devices] = tuple(dict.fromkeys(host_of[d] for d in devices))
    return hosts


def _distinct_shards_by_host(ptc: PTC) -> dict[str, list[tuple[Tensor, Region]]]:
    """host -> the distinct (tensor, region) its devices hold, in PTC order."""
    host_of = {d.id: d.host for d in ptc.devices}
    cache: dict[tuple[int, ...], tuple[str, ...]] = {}
    out: dict[str, list[tuple[Tensor, Region]]] = {h: [] for h in ptc.hosts}
    for t in ptc.tensors:
        for s in t.shards:
            entry = (t, s.region)
            for h in _hosts_of(s.devices, host_of, cache):
                out[h].append(entry)
    return out


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


# -- planning -------------------------------------------------------------------


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
) -> Plan:
    """Plan the transformation of ``old`` (held in ``old_version``) into ``new`` (``new_version``).

    ``holders`` maps each host to the newest committed version it holds
    (``None``: every old host holds ``old_version``); only alive hosts holding
    exactly ``old_version`` serve pieces. ``alive`` defaults to all old hosts.
    Regions that no source holds raise :class:`StateLost` naming them, unless
    ``checkpoint`` (a store URL holding ``old_version``) is given, in which
    case they are read from there.
    """
    with _gc_paused():
        return _make_plan(old, new, job, old_version, new_version, holders, alive, checkpoint)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a plan is built.

    A large plan allocates about a million small acyclic objects; the collector
    would rescan the growing heap many times over (a third of the planning
    time at 1024 GPUs) and can free nothing. It is re-enabled afterwards.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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
        dead_targets = [h for h in new.hosts if h in set(old.hosts) and h not in set(alive)]
        if dead_targets:
            raise InvalidInput(f"the new layout places devices on hosts that are not alive: {dead_targets}")
    dataset = carry_dataset(old, new)

    # Old shards: id -> alive valid holders (old host order), and a per-tensor region index.
    host_rank = {h: i for i, h in enumerate(old.hosts)}
    old_host_of = {d.id: d.host for d in old.devices}
    old_cache: dict[tuple[int, ...], tuple[str, ...]] = {}
    old_index: dict[str, _OldTensor] = {}
    shard_holders: list[tuple[str, ...]] = []
    holder_cache: dict[tuple[str, ...], tuple[str, ...]] = {}
    for t in old.tensors:
        entries = []
        for s in t.shards:
            hosts = _hosts_of(s.devices, old_host_of, old_cache)
            valid = holder_cache.get(hosts)
            if valid is None:
                valid = holder_cache[hosts] = tuple(sorted((h for h in hosts if h in sources), key=host_rank.__getitem__))
            entries.append((s.region.bounds, len(shard_holders)))
            shard_holders.append(valid)
        old_index[t.name] = _OldTensor(t.shape, entries)

    # "cands minus one host", shared: the alternatives of a transfer.
    alt_cache: dict[tuple[tuple[str, ...], str], tuple[str, ...]] = {}

    # Transfers are built with tuple.__new__ directly: the named tuple's own __new__ is a Python
    # function, and a large plan makes a few hundred thousand of them.
    new_transfer = tuple.__new__

    def others(cands: tuple[str, ...], host: str) -> tuple[str, ...]:
        key = (cands, host)
        alts = alt_cache.get(key)
        if alts is None:
            alts = alt_cache[key] = tuple(c for c in cands if c != host)
        return alts

    # Walk the distinct new shards once: their pieces are the same for every host that needs
    # them; each such host gets the shard once and a row per piece (rows are
    # [source, tensor, region, shard index, nbytes, alternatives]; remote rows wait for balancing).
    new_host_of = {d.id: d.host for d in new.devices}
    new_cache: dict[tuple[int, ...], tuple[str, ...]] = {}
    host_shards: dict[str, list[DestShard]] = {h: [] for h in new.hosts}
    raw: dict[str, list[Any]] = {h: [] for h in new.hosts}
    multi: dict[str, set[int]] = {h: set() for h in new.hosts}  # shards with several pieces (merge candidates)
    expected: dict[str, int] = dict.fromkeys(new.hosts, 0)  # bytes of each host's shards, for the coverage check
    pending: list[tuple[int, list[Any], int, str, Region, int, tuple[str, ...]]] = []
    lost: dict[str, list[Bounds]] = defaultdict(list)
    for t in new.tensors:
        name = t.name
        index = old_index[name]
        size = t.itemsize
        same_shape = index.shape == t.shape
        for s in t.shards:
            region = s.region
            bounds = region.bounds
            dest = DestShard(name, region, t.dtype, t.shape)
            found, zeros = _pieces(index, region, same_shape)
            zero_recs = [(_region(z), _volume(z) * size) for z in zeros]
            recs = [
                (region if p == bounds else _region(p), _volume(p) * size, shard_holders[sid]) for p, sid in found
            ]
            several = len(zero_recs) + len(recs) > 1
            dest_bytes = _volume(bounds) * size
            hosts = _hosts_of(s.devices, new_host_of, new_cache)
            if not several and recs and recs[0][2]:
                # The common case (one piece, some holder): no zero-fill, merging or loss to handle.
                pr, nbytes, cands = recs[0]
                for host in hosts:
                    dests = host_shards[host]
                    k = len(dests)
                    dests.append(dest)
                    expected[host] += dest_bytes
                    rows = raw[host]
                    if host in cands:
                        alts = alt_cache.get((cands, host))
                        if alts is None:
                            alts = others(cands, host)
                        rows.append(new_transfer(Transfer, (host, name, pr, k, nbytes, alts)))
                    else:
                        pending.append((nbytes, rows, len(rows), name, pr, k, cands))
                        rows.append(None)
                continue
            for host in hosts:
                dests = host_shards[host]
                k = len(dests)
                dests.append(dest)
                expected[host] += dest_bytes
                rows = raw[host]
                for zr, nbytes in zero_recs:
                    rows.append(new_transfer(Transfer, (None, name, zr, k, nbytes, ())))
                for pr, nbytes, cands in recs:
                    if host in cands:  # cands are sources only: a local copy
                        alts = alt_cache.get((cands, host))
                        if alts is None:
                            alts = others(cands, host)
                        rows.append(new_transfer(Transfer, (host, name, pr, k, nbytes, alts)))
                    elif cands:  # remote: the source is chosen below, the slot filled then
                        pending.append((nbytes, rows, len(rows), name, pr, k, cands))
                        rows.append(None)
                    elif checkpoint is not None:
                        rows.append(new_transfer(Transfer, (CHECKPOINT, name, pr, k, nbytes, ())))
                    else:
                        lost[name].append(pr.bounds)
                if several:
                    multi[host].add(k)
    if lost:
        raise StateLost(_lost_message(lost, old, sources))

    # Greedy balancing: largest pieces first, each to the candidate that has sent the fewest bytes
    # (then the fewest requests). score = bytes << 32 | requests orders both in one integer.
    score: dict[str, int] = dict.fromkeys(sources, 0)
    pending.sort(key=itemgetter(0), reverse=True)
    get_score = score.__getitem__
    for nbytes, rows, pos, name, pr, k, cands in pending:
        best = cands[0] if len(cands) == 1 else min(cands, key=get_score)
        score[best] += (nbytes << 32) + 1
        alts = alt_cache.get((cands, best))
        if alts is None:
            alts = others(cands, best)
        rows[pos] = new_transfer(Transfer, (best, name, pr, k, nbytes, alts))

    hosts_out: dict[str, HostPlan] = {}
    network = local = zero = 0
    for host, rows in raw.items():
        transfers = _merge(rows, multi[host]) if multi[host] else rows
        hp = HostPlan(host, tuple(host_shards[host]), tuple(transfers))
        got = 0
        for tr in transfers:
            nbytes = tr.nbytes
            got += nbytes
            src = tr.source
            if src is None:
                zero += nbytes
            elif src == host:
                local += nbytes
            else:
                network += nbytes
        if got != expected[host]:
            raise AssertionError(f"planner bug: host {host} gets {got} bytes for shards of {expected[host]} bytes")
        hosts_out[host] = hp

    bound = lower_bound_bytes(old, new, old_version=ov, holders=holders, alive=alive)
    if network != bound:
        raise AssertionError(f"planner bug: plan moves {network} bytes over the network, the lower bound is {bound}")
    return Plan(
        job=job,
        old_version=ov,
        new_version=nv,
        hosts=hosts_out,
        network_bytes=network,
        local_bytes=local,
        zero_fill_bytes=zero,
        lower_bound_bytes=bound,
        dataset=dataset,
        checkpoint=checkpoint,
        old_config=dict(old.config),
        new_config=dict(new.config),
    )


def _pieces(
    index: _OldTensor, region: Region, same_shape: bool
) -> tuple[list[tuple[Bounds, int]], list[Bounds]]:
    """(piece, old shard id) covering ``region`` inside the old shape, and the boxes outside it (zero-filled)."""
    bounds = region.bounds
    clipped = bounds if same_shape else tuple((a, b if b < n else n) for (a, b), n in zip(bounds, index.shape, strict=True))
    zeros: list[Bounds] = []
    if clipped == bounds:
        found = index.query(bounds)
        if len(found) == 1 and found[0][0] == bounds:
            return found, zeros
    elif any(a >= b for a, b in clipped):
        found, zeros = [], [bounds]
    else:
        found = index.query(clipped)
        zeros = [r.bounds for r in subtract(region, _region(clipped))]
    covered = sum(_volume(p) for p, _ in found) + sum(_volume(z) for z in zeros)
    if covered != _volume(bounds):
        raise AssertionError(f"planner bug: pieces of {region} cover {covered} of {_volume(bounds)} elements")
    return found, zeros


def _merge(rows: list[Transfer], multi: set[int]) -> list[Transfer]:
    """One host's transfers; pieces from one source for one shard merged where their union is a box.

    Only shards in ``multi`` (those with several pieces) can merge; the rest pass through.
    """
    out: list[Transfer] = []
    groups: dict[tuple[str | None, int], list[Transfer]] = {}
    for tr in rows:
        if tr.shard not in multi:
            out.append(tr)
            continue
        key = (tr.source, tr.shard)
        g = groups.get(key)
        if g is None:
            groups[key] = [tr]
        else:
            g.append(tr)
    for (src, idx), g in groups.items():
        if len(g) == 1:
            out.append(g[0])
            continue
        first = g[0]
        itemsize = first.nbytes // first.region.volume
        alts: dict[Bounds, tuple[str, ...]] = {tr.region.bounds: tr.alternatives for tr in g}
        for box, members in merge_boxes([tr.region.bounds for tr in g]):
            if len(members) == 1:
                out.append(next(tr for tr in g if tr.region.bounds == box))
                continue
            # A merged request can fall back only to hosts that hold all of it.
            common = set(alts[members[0]])
            for m in members[1:]:
                common &= set(alts[m])
            alt = tuple(a for a in alts[members[0]] if a in common)
            out.append(Transfer(src, first.tensor, _region(box), idx, _volume(box) * itemsize, alt))
    return out


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


def _lost_message(lost: Mapping[str, list[Bounds]], old: PTC, sources: set[str]) -> str:
    total = sum(len(v) for v in lost.values())
    shown = []
    for name, pieces in lost.items():
        for p in pieces:
            if len(shown) >= _LOST_LISTED:
                break
            holders = sorted({old.device(d).host for s in old.tensor(name).shards if s.region.intersect(_region(p)) for d in s.devices})
            shown.append(f"{name} {_region(p)} (held only by {', '.join(holders)})")
    more = f"; and {total - len(shown)} more regions" if total > len(shown) else ""
    return (
        f"{total} regions in {len(lost)} tensors are held by no surviving host "
        f"(sources: {', '.join(sorted(sources)) or 'none'}) and no checkpoint is configured: "
        + "; ".join(shown)
        + more
    )


# -- lower bound -------------------------------------------------------------------


def lower_bound_bytes(
    old: PTC,
    new: PTC,
    *,
    old_version: Version | str | None = None,
    holders: Mapping[str, Version | str] | None = None,
    alive: Collection[str] | None = None,
) -> int:
    """Bytes that must cross the network: per target host, what it needs minus what it holds.

    Independent of the planner's piece bookkeeping: for each target host it
    sums its distinct new shards (clipped to the old shape: padding rows are
    zero-filled, not fetched) and subtracts their intersections with the old
    shards the same host holds in the usable version.
    """
    if holders is not None and old_version is None:
        raise InvalidInput("lower_bound_bytes needs old_version when holders are given")
    ov = _as_version(old_version, "old_version") if old_version is not None else Version(0)
    sources = _sources(old, ov, holders, alive)
    # (host, tensor) -> the old regions that host holds: as a set (exact matches) and a list.
    # tensor -> host -> the old regions that host holds: as a set (exact matches) and a list.
    held: dict[str, dict[str, tuple[set[Bounds], list[Bounds]]]] = {}
    host_of = {d.id: d.host for d in old.devices}
    old_sets: dict[tuple[int, ...], frozenset[str]] = {}
    for t in old.tensors:
        per = held[t.name] = {}
        for s in t.shards:
            hosts = old_sets.get(s.devices)
            if hosts is None:
                hosts = old_sets[s.devices] = frozenset(h for h in (host_of[d] for d in s.devices) if h in sources)
            for h in hosts:
                entry = per.get(h)
                if entry is None:
                    entry = per[h] = (set(), [])
                entry[0].add(s.region.bounds)
                entry[1].append(s.region.bounds)
    old_shape = {t.name: t.shape for t in old.tensors}
    new_host_of = {d.id: d.host for d in new.devices}
    host_sets: dict[tuple[int, ...], frozenset[str]] = {}
    total = 0
    for t in new.tensors:
        shape = old_shape[t.name]
        same_shape = shape == t.shape
        per = held[t.name]
        size = t.itemsize
        for s in t.shards:
            bounds = s.region.bounds
            clipped = bounds if same_shape else tuple((a, min(b, n)) for (a, b), n in zip(bounds, shape, strict=True))
            if any(a >= b for a, b in clipped):
                continue
            need = _volume(clipped)
            hosts = host_sets.get(s.devices)
            if hosts is None:
                hosts = host_sets[s.devices] = frozenset(new_host_of[d] for d in s.devices)
            for h in hosts:  # a host stores a shard once
                entry = per.get(h)
                if entry is None:
                    total += need * size
                elif clipped not in entry[0]:
                    have = 0
                    for box in entry[1]:
                        common = _intersect(box, clipped)
                        if common is not None:
                            have += _volume(common)
                    total += (need - have) * size
    return total


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
        "transfers": sum(len(hp.transfers) for hp in plan.hosts.values()),
    }


__all__: Iterable[str] = (
    "CHECKPOINT",
    "DestShard",
    "HostPlan",
    "Plan",
    "Transfer",
    "carry_dataset",
    "lower_bound_bytes",
    "make_plan",
    "merge_boxes",
    "plan_summary",
)
