"""The parallelizable tensor collection (PTC).

PTC = (tensors, slicing, placement) plus the dataset position: every tensor of
a job's state with its global, configuration-independent name, how it is cut
into shards, and which devices hold each shard. Several devices on one shard
are identical (data-parallel) replicas.

Construction validates: a :class:`PTC` that exists is consistent (each
tensor's shards tile it exactly, every device id exists, dtypes are known).
Queries are served from indexes built on first use.
"""

from __future__ import annotations

import gzip
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import Any

from tenplex.core.files import atomic_write
from tenplex.errors import InvalidPTC, InvalidRegion, NotFound
from tenplex.ptc import dtypes
from tenplex.ptc.dataset import DatasetState
from tenplex.ptc.region import Region, subtract

FORMAT = "tenplex.ptc/v1"


class TensorKind(StrEnum):
    PARAM = "param"
    OPTIMIZER = "optimizer"
    BUFFER = "buffer"
    EXTRA = "extra"


@dataclass(frozen=True, slots=True)
class Device:
    """One accelerator (one training process). ``coords`` are for people: dp/tp/pp ranks."""

    id: int
    host: str
    coords: Mapping[str, int] = field(default_factory=dict, hash=False)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "host": self.host, "coords": dict(self.coords)}


@dataclass(frozen=True, slots=True)
class Shard:
    """One region of one tensor and the devices that hold identical copies of it."""

    region: Region
    devices: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"region": self.region.to_json(), "devices": list(self.devices)}


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: TensorKind
    shards: tuple[Shard, ...]

    @property
    def itemsize(self) -> int:
        return dtypes.itemsize(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def region(self) -> Region:
        return Region.full(self.shape)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "kind": self.kind.value,
            "shards": [s.to_json() for s in self.shards],
        }


@dataclass(frozen=True, slots=True)
class Owner:
    """A shard that intersects a queried region: which part, held by which devices."""

    tensor: Tensor
    shard: Shard
    piece: Region


@dataclass(frozen=True, eq=False)
class PTC:
    """A validated parallelizable tensor collection.

    ``config`` records how the layout was made (``dp``/``tp``/``pp`` and the
    provider's parameters); it is descriptive and JSON-serializable.
    """

    config: Mapping[str, Any]
    devices: tuple[Device, ...]
    tensors: tuple[Tensor, ...]
    dataset: DatasetState | None = None

    def __post_init__(self) -> None:
        validate(self)

    # -- lookups ------------------------------------------------------------

    @cached_property
    def _tensor_index(self) -> dict[str, Tensor]:
        return {t.name: t for t in self.tensors}

    @cached_property
    def _device_index(self) -> dict[int, Device]:
        return {d.id: d for d in self.devices}

    @cached_property
    def _by_device(self) -> dict[int, list[tuple[Tensor, Shard]]]:
        index: dict[int, list[tuple[Tensor, Shard]]] = defaultdict(list)
        for t in self.tensors:
            for s in t.shards:
                for d in s.devices:
                    index[d].append((t, s))
        return index

    def tensor(self, name: str) -> Tensor:
        try:
            return self._tensor_index[name]
        except KeyError:
            raise NotFound(f"tensor {name!r} is not in the PTC") from None

    def has_tensor(self, name: str) -> bool:
        return name in self._tensor_index

    def device(self, device_id: int) -> Device:
        try:
            return self._device_index[device_id]
        except KeyError:
            raise NotFound(f"device {device_id} is not in the PTC") from None

    @cached_property
    def hosts(self) -> tuple[str, ...]:
        """Hosts in order of first appearance among the devices."""
        return tuple(dict.fromkeys(d.host for d in self.devices))

    @cached_property
    def _host_devices(self) -> dict[str, list[Device]]:
        index: dict[str, list[Device]] = defaultdict(list)
        for d in self.devices:
            index[d.host].append(d)
        return index

    @cached_property
    def _by_host(self) -> dict[str, list[tuple[Tensor, Shard]]]:
        """host -> distinct shards its devices hold, in tensor order (one pass for all hosts)."""
        host_of = {d.id: d.host for d in self.devices}
        index: dict[str, list[tuple[Tensor, Shard]]] = defaultdict(list)
        for t in self.tensors:
            for s in t.shards:
                for h in dict.fromkeys(host_of[d] for d in s.devices):
                    index[h].append((t, s))
        return index

    def devices_on_host(self, host: str) -> list[Device]:
        return list(self._host_devices.get(host, ()))

    def shards_of_device(self, device_id: int) -> list[tuple[Tensor, Shard]]:
        self.device(device_id)
        return list(self._by_device.get(device_id, ()))

    def shards_on_host(self, host: str) -> list[tuple[Tensor, Shard]]:
        """Distinct shards held by at least one device on ``host`` (a host stores each once)."""
        if host not in self._host_devices:
            raise NotFound(f"host {host!r} has no devices in the PTC")
        return list(self._by_host.get(host, ()))

    def owners(self, name: str, region: Region) -> list[Owner]:
        """The shards of ``name`` that intersect ``region``, each with the common piece."""
        t = self.tensor(name)
        region.check_within(t.shape)
        out = []
        for s in t.shards:
            piece = s.region.intersect(region)
            if piece is not None:
                out.append(Owner(t, s, piece))
        return out

    def bytes_per_device(self) -> dict[int, int]:
        out = dict.fromkeys((d.id for d in self.devices), 0)
        for t in self.tensors:
            size = t.itemsize
            for s in t.shards:
                nbytes = s.region.volume * size
                for d in s.devices:
                    out[d] += nbytes
        return out

    def bytes_per_host(self) -> dict[str, int]:
        """Bytes each host's store keeps: a shard held by several devices of a host counts once."""
        host_of = {d.id: d.host for d in self.devices}
        out = dict.fromkeys(self.hosts, 0)
        for t in self.tensors:
            size = t.itemsize
            for s in t.shards:
                nbytes = s.region.volume * size
                for h in {host_of[d] for d in s.devices}:
                    out[h] += nbytes
        return out

    @property
    def total_bytes(self) -> int:
        """Bytes of the logical state (one copy of every tensor)."""
        return sum(t.nbytes for t in self.tensors)

    # -- JSON ---------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "config": dict(self.config),
            "devices": [d.to_json() for d in self.devices],
            "tensors": [t.to_json() for t in self.tensors],
            "dataset": self.dataset.to_json() if self.dataset is not None else None,
        }

    def dumps(self, indent: int | None = None) -> str:
        if indent is None:
            return self._compact_json
        return json.dumps(self.to_json(), indent=indent)

    @cached_property
    def _compact_json(self) -> str:
        """The compact JSON, made once: a PTC never changes, and the scheduler hands the same one to every worker
        of a generation (a thousand workers: a thousand times)."""
        return json.dumps(self.to_json(), separators=(",", ":"))

    @cached_property
    def gzipped_json(self) -> bytes:
        """The compact JSON gzipped, made once: what the scheduler sends every worker of a generation that accepts
        it (the 405B layout on 16,384 GPUs: 14.5 MB of JSON, 0.8 MB gzipped, fetched by each of 16,384 workers)."""
        return gzip.compress(self._compact_json.encode(), compresslevel=6, mtime=0)

    def save(self, path: str | Path) -> None:
        """Write the JSON atomically: a reader never sees a half-written layout, and a failed
        write leaves an existing file as it was."""
        atomic_write(path, self.dumps())

    @classmethod
    def from_json(cls, obj: Any) -> PTC:
        return _from_json(obj)

    @classmethod
    def loads(cls, text: str | bytes) -> PTC:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidPTC(f"not JSON: {exc}") from None
        return _from_json(obj)

    @classmethod
    def load(cls, path: str | Path) -> PTC:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise InvalidPTC(f"cannot read PTC file {str(path)!r}: {exc.strerror}") from None
        return cls.loads(text)


# -- validation ---------------------------------------------------------------


def validate(ptc: PTC) -> None:
    """Raise :class:`InvalidPTC` with the offending values unless ``ptc`` is consistent."""
    if not isinstance(ptc.config, Mapping):
        raise InvalidPTC(f"config must be a mapping, got {type(ptc.config).__name__}")
    device_ids: set[int] = set()
    for d in ptc.devices:
        if isinstance(d.id, bool) or not isinstance(d.id, int) or d.id < 0:
            raise InvalidPTC(f"device id must be a non-negative integer, got {d.id!r}")
        if d.id in device_ids:
            raise InvalidPTC(f"device id {d.id} appears twice")
        if not isinstance(d.host, str) or not d.host:
            raise InvalidPTC(f"device {d.id} has no host name (got {d.host!r})")
        device_ids.add(d.id)
    names: set[str] = set()
    for t in ptc.tensors:
        if not t.name or not isinstance(t.name, str):
            raise InvalidPTC(f"tensor name must be a non-empty string, got {t.name!r}")
        if t.name in names:
            raise InvalidPTC(f"tensor {t.name!r} appears twice")
        names.add(t.name)
        _validate_tensor(t, device_ids)


def _validate_tensor(t: Tensor, device_ids: set[int]) -> None:
    where = f"tensor {t.name!r} (shape {list(t.shape)})"
    if t.dtype not in dtypes.DTYPES:
        raise InvalidPTC(f"{where}: unknown dtype {t.dtype!r}; known: {', '.join(sorted(dtypes.DTYPES))}")
    if not isinstance(t.kind, TensorKind):
        raise InvalidPTC(f"{where}: kind must be one of {[k.value for k in TensorKind]}, got {t.kind!r}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in t.shape):
        raise InvalidPTC(f"{where}: dimensions must be non-negative integers")
    if not t.shards:
        raise InvalidPTC(f"{where}: has no shards")
    ndim = len(t.shape)
    total = 0
    numel = t.numel
    shape = t.shape
    known = device_ids.issuperset
    for s in t.shards:
        r = s.region
        bounds = r.bounds
        if len(bounds) != ndim:
            raise InvalidPTC(f"{where}: shard {r} has rank {r.ndim}, expected {ndim}")
        vol = 1
        for dim, ((a, b), n) in enumerate(zip(bounds, shape, strict=True)):
            if b > n:
                raise InvalidPTC(f"{where}: shard {r} is out of bounds in dimension {dim} (stop {b} > {n})")
            vol *= b - a
        if vol == 0 and numel != 0:
            raise InvalidPTC(f"{where}: shard {r} is empty")
        devices = s.devices
        if not devices:
            raise InvalidPTC(f"{where}: shard {r} is held by no device")
        if len(devices) > 1 and len(set(devices)) != len(devices):
            raise InvalidPTC(f"{where}: shard {r} lists a device twice: {list(devices)}")
        if not known(devices):
            d = next(d for d in devices if d not in device_ids)
            raise InvalidPTC(f"{where}: shard {r} names device {d}, which does not exist")
        total += vol
    if len(t.shards) > 1:
        _check_disjoint(t, where)
    if total != numel:
        gap = _find_gap(t)
        raise InvalidPTC(
            f"{where}: shards cover {total} of {numel} elements"
            + (f"; {gap} is not covered" if gap is not None else "")
        )


def _check_disjoint(t: Tensor, where: str) -> None:
    """Pairwise overlap test pruned by a sweep along one dimension.

    The sweep runs along the dimension where the shards' starts differ most, so
    that shards cut along any single dimension (row- or column-parallel, flat
    partitions) are checked in near-linear time instead of all pairs.
    """
    if not t.shape:
        raise InvalidPTC(f"{where}: a 0-d tensor has {len(t.shards)} shards, expected 1")
    boxes = [s.region.bounds for s in t.shards]
    dim = max(range(len(t.shape)), key=lambda d: len({b[d][0] for b in boxes}))
    order = sorted(boxes, key=lambda b: b[dim][0])
    for i, box in enumerate(order):
        stop0 = box[dim][1]
        for j in range(i + 1, len(order)):
            other = order[j]
            if other[dim][0] >= stop0:
                break
            if all(a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(box, other, strict=True)):
                common = Region(box).intersect(Region(other))
                raise InvalidPTC(f"{where}: shards {Region(box)} and {Region(other)} overlap in {common}")


def _find_gap(t: Tensor) -> Region | None:
    """One uncovered box, for the error message (bounded effort)."""
    uncovered = [Region.full(t.shape)]
    for s in t.shards:
        nxt = []
        for box in uncovered:
            nxt.extend(subtract(box, s.region))
        uncovered = nxt
        if len(uncovered) > 10_000:
            return None
    return uncovered[0] if uncovered else None


# -- JSON parsing ---------------------------------------------------------------


def _field(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise InvalidPTC(f"{where}: missing {key!r}")
    value = obj[key]
    if isinstance(value, bool) and kind is not bool:
        raise InvalidPTC(f"{where}: {key!r} must be {_kind_name(kind)}, got {value!r}")
    if not isinstance(value, kind):
        raise InvalidPTC(f"{where}: {key!r} must be {_kind_name(kind)}, got {type(value).__name__} {value!r}"[:300])
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", str: "a string", list: "a list", dict: "an object"}.get(k, k.__name__) for k in kinds)


def _int_list(value: Any, where: str, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise InvalidPTC(f"{where}: {what} must be a list of integers, got {value!r}"[:300])
    return tuple(value)


def _from_json(obj: Any) -> PTC:
    if not isinstance(obj, dict):
        raise InvalidPTC(f"a PTC must be a JSON object, got {type(obj).__name__}")
    fmt = obj.get("format")
    if fmt != FORMAT:
        raise InvalidPTC(f"unsupported format {fmt!r}; expected {FORMAT!r}")
    config = _field(obj, "config", dict, "PTC")
    devices = []
    for i, d in enumerate(_field(obj, "devices", list, "PTC")):
        where = f"devices[{i}]"
        if not isinstance(d, dict):
            raise InvalidPTC(f"{where} must be an object")
        coords = d.get("coords", {})
        if not isinstance(coords, dict) or any(isinstance(v, bool) or not isinstance(v, int) for v in coords.values()):
            raise InvalidPTC(f"{where}: coords must map names to integers, got {coords!r}")
        devices.append(Device(_field(d, "id", int, where), _field(d, "host", str, where), coords))
    tensors = []
    for i, t in enumerate(_field(obj, "tensors", list, "PTC")):
        where = f"tensors[{i}]"
        if not isinstance(t, dict):
            raise InvalidPTC(f"{where} must be an object")
        name = _field(t, "name", str, where)
        where = f"tensor {name!r}"
        kind_text = _field(t, "kind", str, where)
        try:
            kind = TensorKind(kind_text)
        except ValueError:
            raise InvalidPTC(f"{where}: kind must be one of {[k.value for k in TensorKind]}, got {kind_text!r}") from None
        shards = []
        for j, s in enumerate(_field(t, "shards", list, where)):
            swhere = f"{where} shards[{j}]"
            if not isinstance(s, dict):
                raise InvalidPTC(f"{swhere} must be an object")
            try:
                region = Region.of(_field(s, "region", list, swhere))
            except InvalidRegion as exc:
                raise InvalidPTC(f"{swhere}: {exc.detail}") from None
            shards.append(Shard(region, _int_list(_field(s, "devices", list, swhere), swhere, "devices")))
        tensors.append(
            Tensor(
                name=name,
                shape=_int_list(_field(t, "shape", list, where), where, "shape"),
                dtype=_field(t, "dtype", str, where),
                kind=kind,
                shards=tuple(shards),
            )
        )
    dataset = obj.get("dataset")
    return PTC(
        config=config,
        devices=tuple(devices),
        tensors=tuple(tensors),
        dataset=DatasetState.from_json(dataset) if dataset is not None else None,
    )


def build_tensor(
    name: str,
    shape: Sequence[int],
    dtype: str,
    kind: TensorKind | str,
    shards: Iterable[tuple[Region, Sequence[int]]],
) -> Tensor:
    """Convenience constructor used by layout providers: merges shards with equal regions."""
    merged: dict[Region, list[int]] = {}
    for region, devs in shards:
        merged.setdefault(region, []).extend(devs)
    return Tensor(
        name=name,
        shape=tuple(shape),
        dtype=dtype,
        kind=TensorKind(kind),
        shards=tuple(Shard(r, tuple(d)) for r, d in merged.items()),
    )
