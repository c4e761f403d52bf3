"""The dataset position: a dp change at any consumed count neither repeats nor skips a sample."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex.errors import InvalidConfig, InvalidPTC
from tenplex.ptc import DatasetState


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _train(state: DatasetState, dp: int, steps: int) -> np.ndarray:
    """The samples all dp ranks consume in ``steps`` steps, batch by batch, rank by rank."""
    out = []
    for k in range(steps):
        out.extend(state.rank_batch(k, r, dp) for r in range(dp))
    return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


@st.composite
def runs(draw: st.DrawFn) -> tuple[DatasetState, list[tuple[int, int]]]:
    gbs = draw(st.sampled_from([1, 2, 4, 6, 8, 12]))
    state = DatasetState(
        num_samples=draw(st.integers(1, 40)),
        seed=draw(st.integers(0, 2**32)),
        global_batch_size=gbs,
        consumed_samples=draw(st.integers(0, 200)),  # any count, not only whole batches
    )
    phases = draw(
        st.lists(st.tuples(st.sampled_from(_divisors(gbs)), st.integers(0, 5)), min_size=1, max_size=4)
    )
    return state, phases


@settings(max_examples=120, deadline=None)
@given(runs())
def test_dp_changes_neither_repeat_nor_skip(case: tuple[DatasetState, list[tuple[int, int]]]) -> None:
    state, phases = case
    start = state.consumed_samples
    consumed = []
    for dp, steps in phases:
        consumed.append(_train(state, dp, steps))
        state = state.advance(steps)
    seen = np.concatenate(consumed)
    # exactly the global order from where training stood, whatever the dp sizes were
    assert np.array_equal(seen, state.samples(start, state.consumed_samples))
    assert state.consumed_samples == start + len(seen)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30), st.integers(0, 1000), st.integers(0, 3))
def test_each_epoch_visits_every_sample_once(n: int, seed: int, epoch: int) -> None:
    state = DatasetState(num_samples=n, seed=seed, global_batch_size=1)
    order = state.samples(epoch * n, (epoch + 1) * n)
    assert sorted(order.tolist()) == list(range(n))
    # deterministic in (seed, epoch)
    assert np.array_equal(order, DatasetState(n, seed, 1, 17).epoch_order(epoch))


def test_ranks_take_contiguous_parts_of_the_global_batch() -> None:
    state = DatasetState(num_samples=100, seed=3, global_batch_size=8, consumed_samples=16)
    batch = state.samples(16, 24)
    assert np.array_equal(state.rank_batch(0, 1, 4), batch[2:4])
    assert np.array_equal(state.remaining_for_rank(0, 2, 2), np.concatenate([batch[:4], state.samples(24, 28)]))
    assert state.remaining_for_rank(0, 2, 0).size == 0


def test_invalid_values_name_themselves() -> None:
    with pytest.raises(InvalidPTC, match="num_samples must be positive, got 0"):
        DatasetState(0, 1, 4)
    with pytest.raises(InvalidPTC, match="global_batch_size must be positive, got -2"):
        DatasetState(10, 1, -2)
    with pytest.raises(InvalidPTC, match="consumed_samples must be >= 0, got -1"):
        DatasetState(10, 1, 2, -1)
    with pytest.raises(InvalidPTC, match="seed must be >= 0, got -3"):
        DatasetState(10, -3, 2)
    with pytest.raises(InvalidPTC, match="num_samples must be an integer, got 10.5"):
        DatasetState(10.5, 1, 2)  # type: ignore[arg-type]
    with pytest.raises(InvalidPTC, match="global_batch_size must be an integer, got True"):
        DatasetState(10, 1, True)
    assert DatasetState(np.int64(10), 1, 2).to_json()["num_samples"] == 10
    assert type(DatasetState(np.int64(10), 1, 2).num_samples) is int
    with pytest.raises(InvalidConfig, match="epoch must be >= 0, got -1"):
        DatasetState(10, 1, 2).epoch_order(-1)
    state = DatasetState(10, 1, 6)
    with pytest.raises(InvalidConfig, match="global batch size 6 is not divisible by data-parallel size 4"):
        state.rank_batch(0, 0, 4)
    with pytest.raises(InvalidConfig, match="dp rank 3 is outside data-parallel size 3"):
        state.rank_batch(0, 3, 3)
    with pytest.raises(InvalidConfig, match=r"\[5, 2\)"):
        state.samples(5, 2)


def test_json_round_trip_and_errors() -> None:
    state = DatasetState(num_samples=1000, seed=7, global_batch_size=32, consumed_samples=96)
    assert DatasetState.from_json(state.to_json()) == state
    assert DatasetState.from_json({"num_samples": 5, "seed": 1, "global_batch_size": 1}).consumed_samples == 0
    with pytest.raises(InvalidPTC, match="missing global_batch_size"):
        DatasetState.from_json({"num_samples": 5, "seed": 1})
    with pytest.raises(InvalidPTC, match="seed must be an integer, got '1'"):
        DatasetState.from_json({"num_samples": 5, "seed": "1", "global_batch_size": 1})
    with pytest.raises(InvalidPTC, match="dataset must be an object, got list"):
        DatasetState.from_json([1, 2])


def test_epoch_order_is_shared_and_read_only() -> None:
    """Steps ask for their batch every step; the epoch's permutation is computed once."""
    state = DatasetState(num_samples=50_000, seed=9, global_batch_size=16)
    first = state.epoch_order(0)
    assert state.advance(3).epoch_order(0) is first
    assert not first.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        first[0] = 1
    assert not np.array_equal(first, state.epoch_order(1))
