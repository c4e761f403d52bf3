"""Hyper-rectangles of tensor index space.

A :class:`Region` is one half-open ``[start, stop)`` interval per dimension.
Shards, transfer pieces and HTTP requests are all regions, so the algebra here
(intersection, containment, offsets, flat-range decomposition) is what the
planner and the store rely on for exactness.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import EllipsisType

from tenplex.errors import InvalidRegion, RegionOutOfBounds

Bounds = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Region:
    """An n-D half-open box: ``bounds[d] == (start, stop)`` with ``start <= stop``."""

    bounds: Bounds

    def __post_init__(self) -> None:
        for dim, pair in enumerate(self.bounds):
            if len(pair) != 2:
                raise InvalidRegion(f"region {self.bounds!r}: dimension {dim} is not a (start, stop) pair")
            start, stop = pair
            if type(start) is not int or type(stop) is not int:
                raise InvalidRegion(f"region {self.bounds!r}: dimension {dim} bounds must be integers, got {pair!r}")
            if start < 0 or stop < start:
                raise InvalidRegion(
                    f"region {self.bounds!r}: dimension {dim} needs 0 <= start <= stop, got [{start}, {stop})"
                )

    # -- construction -------------------------------------------------------

    @classmethod
    def of(cls, bounds: Iterable[Sequence[int]]) -> Region:
        """Build from any nested sequence of integers, e.g. JSON ``[[0, 96], [0, 64]]``."""
        try:
            pairs = tuple(tuple(operator.index(v) for v in pair) for pair in bounds)
        except TypeError:
            raise InvalidRegion(f"region {bounds!r} is not a list of [start, stop] integer pairs") from None
        return cls(pairs)  # type: ignore[arg-type]

    @classmethod
    def full(cls, shape: Sequence[int]) -> Region:
        return cls(tuple((0, int(n)) for n in shape))

    @classmethod
    def from_offsets(cls, offsets: Sequence[int], sizes: Sequence[int]) -> Region:
        return cls(tuple((int(o), int(o) + int(s)) for o, s in zip(offsets, sizes, strict=True)))

    @classmethod
    def parse(cls, text: str, shape: Sequence[int]) -> Region:
        """Parse the HTTP form ``a:b,c:d`` against a tensor shape.

        ``:`` (or an empty side) means the whole dimension; a 0-d tensor is
        addressed by the empty string. The result is checked against ``shape``.
        """
        text = text.strip()
        if text == "" and len(shape) == 0:
            return cls(())
        parts = text.split(",") if text else []
        if len(parts) != len(shape):
            raise InvalidRegion(f"region {text!r} has {len(parts)} dimensions, the tensor has {len(shape)} (shape {list(shape)})")
        bounds = []
        for dim, (part, extent) in enumerate(zip(parts, shape, strict=True)):
            if part.count(":") != 1:
                raise InvalidRegion(f"region {text!r}: dimension {dim} must be 'start:stop' or ':', got {part!r}")
            lo, hi = part.split(":")
            try:
                start = int(lo) if lo.strip() else 0
                stop = int(hi) if hi.strip() else int(extent)
            except ValueError:
                raise InvalidRegion(f"region {text!r}: dimension {dim} bounds must be integers, got {part!r}") from None
            if start < 0 or stop < start:
                raise InvalidRegion(f"region {text!r}: dimension {dim} needs 0 <= start <= stop, got {part!r}")
            bounds.append((start, stop))
        region = cls(tuple(bounds))
        region.check_within(shape)
        return region

    def format(self) -> str:
        """The inverse of :meth:`parse`: ``a:b,c:d``."""
        return ",".join(f"{a}:{b}" for a, b in self.bounds)

    # -- properties ---------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.bounds)

    @property
    def start(self) -> tuple[int, ...]:
        return tuple(a for a, _ in self.bounds)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.bounds)

    @property
    def volume(self) -> int:
        n = 1
        for a, b in self.bounds:
            n *= b - a
        return n

    @property
    def empty(self) -> bool:
        return any(a == b for a, b in self.bounds)

    def slices(self) -> tuple[slice, ...] | tuple[EllipsisType]:
        """Index a numpy array or torch tensor with this region, always as a view.

        A 0-d region gives ``(...,)``: ``array[()]`` would return a numpy scalar (a copy),
        so writes through it would be lost.
        """
        if not self.bounds:
            return (...,)
        return tuple(slice(a, b) for a, b in self.bounds)

    def to_json(self) -> list[list[int]]:
        return [[a, b] for a, b in self.bounds]

    # -- algebra ------------------------------------------------------------

    def _same_rank(self, other: Region) -> None:
        if len(self.bounds) != len(other.bounds):
            raise InvalidRegion(f"regions {self.format()!r} and {other.format()!r} differ in rank")

    def intersect(self, other: Region) -> Region | None:
        """The common box, or ``None`` when the two do not overlap (or one is empty)."""
        self._same_rank(other)
        out = []
        for (a0, a1), (b0, b1) in zip(self.bounds, other.bounds, strict=True):
            lo = a0 if a0 > b0 else b0
            hi = a1 if a1 < b1 else b1
            if lo >= hi:
                return None
            out.append((lo, hi))
        return Region(tuple(out))

    def overlaps(self, other: Region) -> bool:
        return self.intersect(other) is not None

    def contains(self, other: Region) -> bool:
        """True when ``other`` lies inside this box (an empty ``other`` counts when its corner does)."""
        self._same_rank(other)
        return all(a0 <= b0 and b1 <= a1 for (a0, a1), (b0, b1) in zip(self.bounds, other.bounds, strict=True))

    def relative_to(self, outer: Region) -> Region:
        """This box in the coordinates of ``outer`` (which must contain it)."""
        if not outer.contains(self):
            raise InvalidRegion(f"region {self.format()!r} is not inside {outer.format()!r}")
        return Region(tuple((a - o, b - o) for (a, b), (o, _) in zip(self.bounds, outer.bounds, strict=True)))

    def shift(self, offsets: Sequence[int]) -> Region:
        """Translate by ``offsets`` (the inverse of :meth:`relative_to`)."""
        return Region(tuple((a + o, b + o) for (a, b), o in zip(self.bounds, offsets, strict=True)))

    def check_within(self, shape: Sequence[int]) -> None:
        """Raise :class:`RegionOutOfBounds` unless the box fits ``shape``."""
        if len(shape) != len(self.bounds):
            raise InvalidRegion(f"region {self.format()!r} has rank {self.ndim}, the tensor has shape {list(shape)}")
        for dim, ((_a, b), n) in enumerate(zip(self.bounds, shape, strict=True)):
            if b > n:
                raise RegionOutOfBounds(
                    f"region {self.format()!r} exceeds dimension {dim} of shape {list(shape)} (stop {b} > {n})"
                )

    def split(self, dim: int, parts: int) -> list[Region]:
        """Cut along ``dim`` into ``parts`` contiguous pieces, the first ones larger by one when uneven."""
        if not 0 <= dim < len(self.bounds):
            raise InvalidRegion(f"region {self.format()!r} has no dimension {dim} (rank {self.ndim})")
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise InvalidRegion(f"a region is split into a positive number of parts, got {parts!r}")
        a, b = self.bounds[dim]
        base, extra = divmod(b - a, parts)
        out = []
        pos = a
        for i in range(parts):
            size = base + (1 if i < extra else 0)
            bounds = list(self.bounds)
            bounds[dim] = (pos, pos + size)
            out.append(Region(tuple(bounds)))
            pos += size
        return out

    def __str__(self) -> str:
        return "[" + ", ".join(f"{a}:{b}" for a, b in self.bounds) + "]"


def flat_range_boxes(
    shape: Sequence[int], start: int, stop: int, origin: Sequence[int] | None = None
) -> list[Region]:
    """The flat row-major index range ``[start, stop)`` as the fewest contiguous boxes.

    ZeRO-1/2 distributed optimizers partition a flattened buffer across data
    parallel ranks without regard for parameter boundaries; each rank's piece
    of one parameter is such a flat range, and this turns it into rectangles
    (a head of partial rows, one block of whole rows, a tail), recursively per
    dimension, in flat order. At most ``2 * ndim - 1`` boxes result.

    Every box is itself one contiguous run of the flat range, i.e. one byte
    range of the tensor's C-order buffer, which is what a flat-buffer reader or
    writer wants; no cutting of the range into such runs has fewer boxes.
    (Boxes that are not contiguous runs can occasionally cover the range with
    one box fewer, e.g. ``[1, 5)`` of a 3x2 tensor as ``[0:2, 1:2]`` plus
    ``[1:3, 0:1]``; they are deliberately not used.)

    ``origin`` translates the boxes: a flat range of a local shard of shape
    ``shape`` that starts at ``origin`` in the global tensor comes out in global
    coordinates directly, without building the local boxes first.
    """
    shape = tuple(int(n) for n in shape)
    total = 1
    for n in shape:
        total *= n
    if not 0 <= start <= stop <= total:
        raise InvalidRegion(f"flat range [{start}, {stop}) is outside a tensor of {total} elements (shape {list(shape)})")
    if start == stop:
        return []
    boxes = _flat_boxes(shape, start, stop)
    if origin is None:
        return [Region(tuple(b)) for b in boxes]
    if len(origin) != len(shape):
        raise InvalidRegion(f"origin {list(origin)} has rank {len(origin)}, the shape {list(shape)} has {len(shape)}")
    if any(int(o) < 0 for o in origin):
        raise InvalidRegion(f"origin {list(origin)} has a negative offset")
    return [
        Region(tuple((a + o, b + o) for (a, b), o in zip(box, origin, strict=True))) for box in boxes
    ]


def _flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[list[tuple[int, int]]]:
    if len(shape) == 0:
        return [[]]
    if len(shape) == 1:
        return [[(start, stop)]]
    inner = 1
    for n in shape[1:]:
        inner *= n
    first, first_off = divmod(start, inner)
    last, last_off = divmod(stop, inner)
    if first == last:  # within one row of dimension 0
        return [[(first, first + 1), *box] for box in _flat_boxes(shape[1:], first_off, last_off)]
    out: list[list[tuple[int, int]]] = []
    whole_from = first
    if first_off:
        out += [[(first, first + 1), *box] for box in _flat_boxes(shape[1:], first_off, inner)]
        whole_from = first + 1
    if last > whole_from:
        out.append([(whole_from, last), *((0, n) for n in shape[1:])])
    if last_off:
        out += [[(last, last + 1), *box] for box in _flat_boxes(shape[1:], 0, last_off)]
    return out


def subtract(box: Region, cut: Region) -> list[Region]:
    """``box`` minus ``cut`` as disjoint boxes (at most two per dimension)."""
    common = box.intersect(cut)
    if common is None:
        return [] if box.empty else [box]
    out = []
    rest = list(box.bounds)
    for dim, ((a, b), (c0, c1)) in enumerate(zip(box.bounds, common.bounds, strict=True)):
        if a < c0:
            lo = list(rest)
            lo[dim] = (a, c0)
            out.append(Region(tuple(lo)))
        if c1 < b:
            hi = list(rest)
            hi[dim] = (c1, b)
            out.append(Region(tuple(hi)))
        rest[dim] = (c0, c1)
    return out
