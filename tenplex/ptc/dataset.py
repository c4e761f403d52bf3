"""The dataset part of a PTC: where in the sample order training stands.

The sample order is a deterministic function of ``(num_samples, seed)``: epoch
``e`` visits the permutation drawn from ``seed + e``. Training consumes it in
global batches of ``global_batch_size`` samples starting at
``consumed_samples``; data-parallel rank ``r`` of ``D`` takes the ``r``-th
contiguous slice of each global batch. Because the partition of every future
global batch is recomputed from the consumed count alone, changing ``D``
between any two steps neither repeats nor skips a sample.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np

from tenplex.errors import InvalidConfig, InvalidPTC


@functools.lru_cache(maxsize=2)
def _epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """One epoch's permutation, memoized: a training step asks for its batch every step, and
    permuting millions of samples each time would cost more than the step's data loading.
    Two entries cover the step that crosses an epoch boundary."""
    order = np.random.Generator(np.random.PCG64(seed + epoch)).permutation(num_samples)
    order.flags.writeable = False
    return order


@dataclass(frozen=True, slots=True)
class DatasetState:
    num_samples: int
    seed: int
    global_batch_size: int
    consumed_samples: int = 0

    def __post_init__(self) -> None:
        for name in ("num_samples", "seed", "global_batch_size", "consumed_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise InvalidPTC(f"dataset {name} must be an integer, got {value!r}")
            if not isinstance(value, int):  # numpy integers would not serialize to JSON
                object.__setattr__(self, name, int(value))
        if self.seed < 0:
            raise InvalidPTC(f"dataset seed must be >= 0, got {self.seed}")
        if self.num_samples <= 0:
            raise InvalidPTC(f"dataset num_samples must be positive, got {self.num_samples}")
        if self.global_batch_size <= 0:
            raise InvalidPTC(f"dataset global_batch_size must be positive, got {self.global_batch_size}")
        if self.consumed_samples < 0:
            raise InvalidPTC(f"dataset consumed_samples must be >= 0, got {self.consumed_samples}")

    # -- the order ----------------------------------------------------------

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of sample ids visited in ``epoch`` (read-only: it is shared)."""
        if epoch < 0:
            raise InvalidConfig(f"epoch must be >= 0, got {epoch}")
        return _epoch_order(int(self.num_samples), int(self.seed), int(epoch))

    def samples(self, start: int, stop: int) -> np.ndarray:
        """Sample ids at positions ``[start, stop)`` of the endless epoch-by-epoch order."""
        if not 0 <= start <= stop:
            raise InvalidConfig(f"sample positions need 0 <= start <= stop, got [{start}, {stop})")
        out = np.empty(stop - start, dtype=np.int64)
        pos = start
        while pos < stop:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(stop - pos, self.num_samples - offset)
            out[pos - start : pos - start + take] = self.epoch_order(epoch)[offset : offset + take]
            pos += take
        return out

    def check_dp(self, dp_size: int) -> None:
        if dp_size <= 0 or self.global_batch_size % dp_size:
            raise InvalidConfig(
                f"global batch size {self.global_batch_size} is not divisible by data-parallel size {dp_size}"
            )

    def micro_batch_slice(self, dp_rank: int, dp_size: int) -> slice:
        """Which part of each global batch data-parallel rank ``dp_rank`` of ``dp_size`` takes."""
        self.check_dp(dp_size)
        if not 0 <= dp_rank < dp_size:
            raise InvalidConfig(f"dp rank {dp_rank} is outside data-parallel size {dp_size}")
        per_rank = self.global_batch_size // dp_size
        return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)

    def rank_batch(self, step_offset: int, dp_rank: int, dp_size: int) -> np.ndarray:
        """The sample ids rank ``dp_rank`` trains on in the ``step_offset``-th step from now."""
        part = self.micro_batch_slice(dp_rank, dp_size)
        begin = self.consumed_samples + step_offset * self.global_batch_size
        return self.samples(begin + part.start, begin + part.stop)

    def remaining_for_rank(self, dp_rank: int, dp_size: int, steps: int) -> np.ndarray:
        """The next ``steps`` batches of one rank, concatenated."""
        if steps < 0:
            raise InvalidConfig(f"steps must be >= 0, got {steps}")
        if steps == 0:
            return np.empty(0, dtype=np.int64)
        return np.concatenate([self.rank_batch(k, dp_rank, dp_size) for k in range(steps)])

    def advance(self, steps: int) -> DatasetState:
        """The state after ``steps`` more global batches."""
        return replace(self, consumed_samples=self.consumed_samples + steps * self.global_batch_size)

    # -- JSON ---------------------------------------------------------------

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> DatasetState:
        """The state a JSON object describes (its values are checked as any DatasetState's are)."""
        if not isinstance(obj, dict):
            raise InvalidPTC(f"dataset must be an object, got {type(obj).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names[:3] if n not in obj]
        if missing:
            raise InvalidPTC(f"dataset is missing {', '.join(missing)}")
        return cls(**{n: obj[n] for n in names if n in obj})
