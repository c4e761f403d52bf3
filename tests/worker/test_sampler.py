"""The elastic sampler: the sample order is consumed exactly, whatever dp size changes when."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from tenplex.errors import InvalidConfig
from tenplex.ptc import DatasetState
from tenplex.worker.sampler import ElasticSampler


def consume(state: DatasetState, dp: int, steps: int) -> list[np.ndarray]:
    """What all dp ranks train on in ``steps`` steps: one global batch (rank-ordered) per step."""
    per_rank = [list(ElasticSampler(state, r, dp, steps).batches()) for r in range(dp)]
    return [np.concatenate([per_rank[r][k] for r in range(dp)]) for k in range(steps)]


@settings(max_examples=60, deadline=None)
@given(
    num_samples=st.integers(1, 50),
    plan=st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 6, 12]), st.integers(0, 7)), min_size=1, max_size=5),
    seed=st.integers(0, 1000),
)
def test_dp_changes_at_any_step_consume_the_order_exactly(num_samples: int, plan: list[tuple[int, int]], seed: int) -> None:
    state = DatasetState(num_samples=num_samples, seed=seed, global_batch_size=12)
    seen: list[np.ndarray] = []
    for dp, steps in plan:
        seen.extend(consume(state, dp, steps))
        state = state.advance(steps)
    total = sum(steps for _, steps in plan) * 12
    got = np.concatenate(seen) if seen else np.empty(0, dtype=np.int64)
    expected = DatasetState(num_samples=num_samples, seed=seed, global_batch_size=12).samples(0, total)
    np.testing.assert_array_equal(got, expected)
    assert state.consumed_samples == total
    # each epoch is a permutation: no sample repeats within an epoch, none is skipped
    for e in range(total // num_samples):
        assert sorted(got[e * num_samples : (e + 1) * num_samples].tolist()) == list(range(num_samples))


def test_dataloader_gives_rank_batches_from_the_consumed_position() -> None:
    state = DatasetState(num_samples=40, seed=3, global_batch_size=8, consumed_samples=16)
    data = TensorDataset(torch.arange(40))
    sampler = ElasticSampler(state, dp_rank=1, dp_size=2, steps=3)
    assert len(sampler) == 12
    loader = DataLoader(data, batch_size=sampler.batch_size, sampler=sampler)
    got = [b[0].numpy() for b in loader]
    assert len(got) == 3
    for k, batch in enumerate(got):
        np.testing.assert_array_equal(batch, state.rank_batch(k, 1, 2))
    assert sampler.state_after(3).consumed_samples == 40


def test_endless_sampler_crosses_epochs_and_has_no_length() -> None:
    state = DatasetState(num_samples=5, seed=1, global_batch_size=4)
    it = ElasticSampler(state, 0, 1).batches()
    first = np.concatenate([next(it) for _ in range(5)])  # 20 samples = 4 epochs
    np.testing.assert_array_equal(first, state.samples(0, 20))
    with pytest.raises(TypeError, match="endless"):
        len(ElasticSampler(state, 0, 1))


@pytest.mark.parametrize(
    ("rank", "size", "match"),
    [(0, 3, "not divisible by data-parallel size 3"), (2, 2, "dp rank 2 is outside data-parallel size 2"), (0, 0, "size 0")],
)
def test_bad_rank_or_size_is_a_clear_error(rank: int, size: int, match: str) -> None:
    state = DatasetState(num_samples=10, seed=0, global_batch_size=8)
    with pytest.raises(InvalidConfig, match=match):
        ElasticSampler(state, rank, size)


def test_negative_steps_rejected() -> None:
    with pytest.raises(InvalidConfig, match="-1"):
        ElasticSampler(DatasetState(num_samples=10, seed=0, global_batch_size=2), 0, 1, steps=-1)
