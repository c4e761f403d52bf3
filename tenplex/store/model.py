"""What the store records about shards and versions, and their JSON forms.

These are the values exchanged between the local store, the HTTP server and
the client (the manifest is what the transformer's planner reads to know what
a node holds), so they are frozen dataclasses with an explicit JSON mapping.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tenplex.core.version import Version
from tenplex.errors import InvalidInput
from tenplex.ptc.dtypes import check_dtype, itemsize
from tenplex.ptc.region import Region, subtract

T = TypeVar("T")

CHECKSUM_PREFIX = "crc32c:"


def format_checksum(crc: int) -> str:
    return f"{CHECKSUM_PREFIX}{crc & 0xFFFFFFFF:08x}"


def parse_checksum(text: str) -> int:
    if not text.startswith(CHECKSUM_PREFIX) or len(text) != len(CHECKSUM_PREFIX) + 8:
        raise InvalidInput(f"checksum {text!r} is not of the form crc32c:xxxxxxxx")
    try:
        return int(text[len(CHECKSUM_PREFIX) :], 16)
    except ValueError:
        raise InvalidInput(f"checksum {text!r} is not of the form crc32c:xxxxxxxx") from None


def cover(shards: Sequence[T], region_of: Callable[[T], Region], region: Region) -> tuple[list[tuple[T, Region]], str]:
    """Which of ``shards`` serves which part of ``region`` (the first of overlapping shards wins), and the parts
    none covers as text (empty when they cover it all; the first 8 named)."""
    parts: list[tuple[T, Region]] = []
    missing = [region]
    for s in shards:
        common = region_of(s).intersect(region)
        if common is None or not any(m.overlaps(common) for m in missing):
            continue  # no part of the region, or one an overlapping shard already served
        parts.append((s, common))
        missing = [piece for m in missing for piece in subtract(m, common)]
    text = ", ".join(m.format() for m in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return parts, text


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One stored shard: a region of a tensor, its element type and the crc32c of its C-order bytes."""

    tensor: str
    region: Region
    dtype: str
    global_shape: tuple[int, ...]
    checksum: str
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "region": self.region.to_json(),
            "dtype": self.dtype,
            "global_shape": list(self.global_shape),
            "checksum": self.checksum,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> ShardInfo:
        try:
            info = cls(
                tensor=str(obj["tensor"]),
                region=Region.of(obj["region"]),
                dtype=check_dtype(str(obj["dtype"])),
                global_shape=tuple(int(n) for n in obj["global_shape"]),
                checksum=str(obj["checksum"]),
                nbytes=int(obj["nbytes"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"shard record {obj!r} is malformed: {exc}") from None
        if info.nbytes != info.region.volume * itemsize(info.dtype):
            raise InvalidInput(f"shard record {obj!r}: nbytes does not equal the region volume times the itemsize")
        return info


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything one node's store holds of one version of one job.

    ``durable``: the version is committed on the node's disk (it survives a crash or reboot of the node).
    A version committed only in the node's memory tier (:mod:`tenplex.store.tiers`) is readable by
    peers at once but ``durable`` only once it has been spilled to disk.
    """

    job: str
    version: Version
    committed: bool
    shards: list[ShardInfo] = field(default_factory=list)
    durable: bool = False

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def tensors(self) -> list[str]:
        return sorted({s.tensor for s in self.shards})

    def shards_of(self, tensor: str) -> list[ShardInfo]:
        return [s for s in self.shards if s.tensor == tensor]

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "version": str(self.version),
            "committed": self.committed,
            "durable": self.durable,
            "nbytes": self.nbytes,
            "shards": [s.to_json() for s in self.shards],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Manifest:
        try:
            committed = bool(obj["committed"])
            return cls(
                job=str(obj["job"]),
                version=Version.parse(str(obj["version"])),
                committed=committed,
                shards=[ShardInfo.from_json(s) for s in obj["shards"]],
                # written before the memory tier: every committed version was on disk
                durable=bool(obj.get("durable", committed)),
            )
        except (KeyError, TypeError) as exc:
            raise InvalidInput(f"manifest is malformed: missing or bad field {exc}") from None


@dataclass(frozen=True, slots=True)
class VersionInfo:
    """One version of a job in one node's store: committed (readable), durable (committed on the node's
    disk: it survives a crash of the node) and where it is (``in_memory``: in the node's memory tier,
    read from there; it may be on disk too)."""

    version: Version
    committed: bool
    nbytes: int
    durable: bool = False
    in_memory: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"version": str(self.version), "committed": self.committed, "nbytes": self.nbytes,
                "durable": self.durable, "in_memory": self.in_memory}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> VersionInfo:
        try:
            committed = bool(obj["committed"])
            return cls(Version.parse(str(obj["version"])), committed, int(obj["nbytes"]),
                       durable=bool(obj.get("durable", committed)), in_memory=bool(obj.get("in_memory", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"version record {obj!r} is malformed: {exc}") from None
