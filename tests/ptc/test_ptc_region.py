"""Property tests of the region algebra, checked against numpy index sets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex.errors import InvalidRegion, RegionOutOfBounds
from tenplex.ptc import Region, flat_range_boxes, subtract


@st.composite
def shapes(draw: st.DrawFn, max_dims: int = 4, max_side: int = 6) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(1, max_side), min_size=1, max_size=max_dims)))


@st.composite
def regions_in(draw: st.DrawFn, shape: tuple[int, ...], allow_empty: bool = True) -> Region:
    bounds = []
    for n in shape:
        a = draw(st.integers(0, n if allow_empty else n - 1))
        b = draw(st.integers(a if allow_empty else a + 1, n))
        bounds.append((a, b))
    return Region(tuple(bounds))


@st.composite
def shape_and_regions(draw: st.DrawFn, count: int = 2) -> tuple[tuple[int, ...], list[Region]]:
    shape = draw(shapes())
    return shape, [draw(regions_in(shape)) for _ in range(count)]


def mask(shape: tuple[int, ...], *regions: Region) -> np.ndarray:
    """How many of ``regions`` cover each element of a tensor of ``shape``."""
    out = np.zeros(shape, dtype=np.int64)
    for r in regions:
        out[r.slices()] += 1
    return out


@given(shape_and_regions())
def test_intersection_is_commutative_and_exact(case: tuple[tuple[int, ...], list[Region]]) -> None:
    shape, (a, b) = case
    ab, ba = a.intersect(b), b.intersect(a)
    assert ab == ba
    both = (mask(shape, a) > 0) & (mask(shape, b) > 0)
    if ab is None:
        assert not both.any()
    else:
        assert a.contains(ab) and b.contains(ab)
        assert np.array_equal(mask(shape, ab) > 0, both)
        assert ab.volume == int(both.sum())
    assert a.overlaps(b) == (ab is not None)


@given(shape_and_regions())
def test_contains_matches_index_sets(case: tuple[tuple[int, ...], list[Region]]) -> None:
    shape, (a, b) = case
    if b.empty:
        return  # an empty box has no elements to compare; its corner rule is tested below
    inside = not ((mask(shape, b) > 0) & (mask(shape, a) == 0)).any()
    assert a.contains(b) == inside
    assert a.contains(b) == (a.intersect(b) == b)


def test_contains_empty_box_by_corner() -> None:
    outer = Region(((2, 5), (0, 4)))
    assert outer.contains(Region(((3, 3), (1, 2))))
    assert not outer.contains(Region(((6, 6), (1, 2))))


@given(shape_and_regions(), st.lists(st.integers(0, 50), min_size=4, max_size=4))
def test_relative_to_and_shift_are_inverse(case: tuple[tuple[int, ...], list[Region]], offsets: list[int]) -> None:
    shape, (outer, other) = case
    if not outer.contains(other):
        with pytest.raises(InvalidRegion, match="is not inside"):
            other.relative_to(outer)
    inner = outer.intersect(other)
    if inner is None:
        return
    rel = inner.relative_to(outer)
    assert rel.shift(outer.start) == inner
    assert Region.full(outer.shape).contains(rel)
    # numpy: the relative box indexes the same elements inside the outer block
    data = np.arange(int(np.prod(shape))).reshape(shape)
    assert np.array_equal(data[outer.slices()][rel.slices()], data[inner.slices()])
    off = offsets[: len(shape)]
    moved = Region(tuple((o, o + n) for o, n in zip(off, shape, strict=True)))
    assert inner.shift(off).relative_to(moved) == inner


@given(shape_and_regions())
def test_subtract_partitions_the_rest(case: tuple[tuple[int, ...], list[Region]]) -> None:
    shape, (box, cut) = case
    pieces = subtract(box, cut)
    common = box.intersect(cut)
    covered = mask(shape, *pieces)
    assert covered.max(initial=0) <= 1, "pieces overlap"
    for p in pieces:
        assert not p.empty
        assert box.contains(p)
        assert not p.overlaps(cut)
    assert sum(p.volume for p in pieces) + (common.volume if common else 0) == box.volume
    expected = (mask(shape, box) > 0) & (mask(shape, cut) == 0)
    assert np.array_equal(covered > 0, expected)
    assert len(pieces) <= 2 * len(shape)


@given(shape_and_regions(count=1))
def test_parse_format_round_trip(case: tuple[tuple[int, ...], list[Region]]) -> None:
    shape, (r,) = case
    assert Region.parse(r.format(), shape) == r
    assert Region.of(r.to_json()) == r
    assert Region.parse(",".join(":" for _ in shape), shape) == Region.full(shape)


@given(shapes(), st.integers(1, 5), st.data())
def test_split_tiles_the_dimension(shape: tuple[int, ...], parts: int, data: st.DataObject) -> None:
    dim = data.draw(st.integers(0, len(shape) - 1))
    pieces = Region.full(shape).split(dim, parts)
    assert len(pieces) == parts
    assert np.array_equal(mask(shape, *pieces), np.ones(shape, dtype=np.int64))
    sizes = [p.shape[dim] for p in pieces]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize(
    ("text", "shape", "error"),
    [
        ("0:4", (4, 4), InvalidRegion),
        ("0:4,x:2", (4, 4), InvalidRegion),
        ("0:4,3", (4, 4), InvalidRegion),
        ("0:5,0:4", (4, 4), RegionOutOfBounds),
        ("3:1,0:4", (4, 4), InvalidRegion),
        ("-1:2,0:4", (4, 4), InvalidRegion),
    ],
)
def test_parse_rejects_bad_text_with_the_values(text: str, shape: tuple[int, ...], error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        Region.parse(text, shape)
    assert repr(text) in str(info.value) or text in str(info.value)


def test_bad_bounds_are_rejected() -> None:
    with pytest.raises(InvalidRegion, match=r"\[3, 1\)"):
        Region(((3, 1),))
    with pytest.raises(InvalidRegion, match="integer"):
        Region.of([[0, 1.5]])
    with pytest.raises(InvalidRegion, match="pair"):
        Region.of([[0, 1, 2]])
    with pytest.raises(InvalidRegion, match="differ in rank"):
        Region(((0, 1),)).intersect(Region(((0, 1), (0, 1))))
    assert Region.parse("", ()) == Region(())
    with pytest.raises(InvalidRegion, match="positive number of parts, got 0"):
        Region(((0, 4),)).split(0, 0)
    with pytest.raises(InvalidRegion, match="has no dimension 1"):
        Region(((0, 4),)).split(1, 2)


# -- flat ranges -----------------------------------------------------------------


@st.composite
def flat_ranges(draw: st.DrawFn, max_dims: int = 4, max_side: int = 5) -> tuple[tuple[int, ...], int, int]:
    shape = draw(shapes(max_dims, max_side))
    total = int(np.prod(shape))
    start = draw(st.integers(0, total))
    stop = draw(st.integers(start, total))
    return shape, start, stop


@given(flat_ranges(), st.lists(st.integers(0, 9), min_size=4, max_size=4))
def test_flat_range_boxes_cover_exactly_the_range(case: tuple[tuple[int, ...], int, int], origin: list[int]) -> None:
    shape, start, stop = case
    boxes = flat_range_boxes(shape, start, stop)
    covered = mask(shape, *boxes).reshape(-1)
    expected = np.zeros(covered.size, dtype=np.int64)
    expected[start:stop] = 1
    assert np.array_equal(covered, expected), "boxes are not exactly the flat range, or overlap"
    assert all(not b.empty for b in boxes)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    # boxes come in flat order, so consecutive boxes continue each other
    flat = np.arange(covered.size).reshape(shape)
    assert np.array_equal(np.concatenate([flat[b.slices()].reshape(-1) for b in boxes] or [np.empty(0, int)]), np.arange(start, stop))
    # the origin form equals shifting each box
    off = origin[: len(shape)]
    assert flat_range_boxes(shape, start, stop, origin=off) == [b.shift(off) for b in boxes]


def _is_box(flat: np.ndarray, i: int, j: int) -> bool:
    """Whether the flat index range ``[i, j)`` of a tensor is exactly one box."""
    idx = np.argwhere((flat >= i) & (flat < j))
    lo, hi = idx.min(axis=0), idx.max(axis=0) + 1
    return int(np.prod(hi - lo)) == j - i


def _fewest_contiguous_boxes(shape: tuple[int, ...], start: int, stop: int) -> int:
    """Brute force (dynamic programming over cut points): the fewest consecutive pieces of
    ``[start, stop)`` that are each a box."""
    flat = np.arange(int(np.prod(shape))).reshape(shape)
    best = {start: 0}
    for j in range(start + 1, stop + 1):
        best[j] = min(best[i] + 1 for i in range(start, j) if _is_box(flat, i, j))
    return best[stop]


@settings(max_examples=80, deadline=None)
@given(flat_ranges(max_dims=3, max_side=4))
def test_flat_range_boxes_are_the_fewest_contiguous_boxes(case: tuple[tuple[int, ...], int, int]) -> None:
    """Each box is one contiguous run of the flat range (one byte range of the buffer), and
    no cutting of the range into such runs needs fewer boxes."""
    shape, start, stop = case
    boxes = flat_range_boxes(shape, start, stop)
    assert len(boxes) == _fewest_contiguous_boxes(shape, start, stop)


def test_flat_range_boxes_examples() -> None:
    # a head of a partial row, whole rows, a tail
    assert flat_range_boxes((4, 5), 3, 17) == [
        Region(((0, 1), (3, 5))),
        Region(((1, 3), (0, 5))),
        Region(((3, 4), (0, 2))),
    ]
    assert flat_range_boxes((4, 5), 0, 20) == [Region.full((4, 5))]
    assert flat_range_boxes((4, 5), 7, 7) == []
    assert flat_range_boxes((), 0, 1) == [Region(())]
    with pytest.raises(InvalidRegion, match=r"\[3, 21\) is outside a tensor of 20 elements"):
        flat_range_boxes((4, 5), 3, 21)
    with pytest.raises(InvalidRegion, match="origin"):
        flat_range_boxes((4, 5), 0, 3, origin=[1])


def test_slices_of_a_0d_region_index_a_view():
    import numpy as np
    import torch

    a = np.zeros((), dtype=np.float32)
    view = a[Region(()).slices()]
    view[...] = 3.0
    assert isinstance(view, np.ndarray) and a == 3.0
    t = torch.zeros(())
    t[Region(()).slices()].fill_(2.0)
    assert t.item() == 2.0
    b = np.arange(12).reshape(3, 4)
    assert np.shares_memory(b[Region(((1, 3), (0, 2))).slices()], b)
