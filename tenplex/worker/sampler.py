"""The elastic data sampler: a rank's sample ids, driven by the PTC's dataset state.

The whole job consumes one global sample order (see
:class:`tenplex.ptc.DatasetState`) in global batches; data-parallel rank ``r``
of ``D`` takes the ``r``-th contiguous slice of every global batch. The
sampler starts at the state's ``consumed_samples``, so a job restored with a
different ``D`` at any step continues the same order: no sample repeats,
none is skipped. Pipeline and tensor-parallel ranks of one dp rank get the
same ids, as they must.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler

from tenplex.errors import InvalidConfig
from tenplex.ptc import DatasetState


class ElasticSampler(Sampler[int]):
    """Yields this rank's sample ids, batch after batch, from ``state.consumed_samples`` on.

    Use it with ``DataLoader(dataset, batch_size=sampler.batch_size,
    sampler=sampler)`` (no shuffling, no ``drop_last`` needed: every batch is
    full), or iterate :meth:`batches` directly. ``steps`` bounds the number of
    batches (``None``: endless, as a training loop with its own step limit wants).
    """

    def __init__(self, state: DatasetState, dp_rank: int, dp_size: int, steps: int | None = None) -> None:
        super().__init__()
        part = state.micro_batch_slice(dp_rank, dp_size)  # validates rank, size and divisibility
        if steps is not None and steps < 0:
            raise InvalidConfig(f"steps must be >= 0 or None, got {steps}")
        self.state = state
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.steps = steps
        self._part = part

    @property
    def batch_size(self) -> int:
        """Samples this rank takes per step (the global batch divided by the dp size)."""
        return self._part.stop - self._part.start

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("an endless ElasticSampler (steps=None) has no length")
        return self.steps * self.batch_size

    def __iter__(self) -> Iterator[int]:
        for batch in self.batches():
            yield from batch.tolist()

    def batches(self) -> Iterator[np.ndarray]:
        """This rank's batches as int64 arrays, one per training step."""
        st = self.state
        n, gbs = st.num_samples, st.global_batch_size
        begin = st.consumed_samples
        epoch = -1
        order = np.empty(0, dtype=np.int64)
        step = 0
        while self.steps is None or step < self.steps:
            start = begin + step * gbs + self._part.start
            stop = start + self.batch_size
            out = np.empty(stop - start, dtype=np.int64)
            pos = start
            while pos < stop:
                e, offset = divmod(pos, n)
                if e != epoch:  # one permutation per epoch, not per batch
                    epoch, order = e, st.epoch_order(e)
                take = min(stop - pos, n - offset)
                out[pos - start : pos - start + take] = order[offset : offset + take]
                pos += take
            yield out
            step += 1

    def state_after(self, steps: int) -> DatasetState:
        """The dataset state once ``steps`` global batches past the start are consumed."""
        return self.state.advance(steps)
