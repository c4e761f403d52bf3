"""The parallel configuration of a job: its degrees and how its ranks map to coordinates.

It is on the ground floor because every layer speaks it: the data model's layouts
(:mod:`tenplex.ptc`, which also places the ranks on hosts: :mod:`tenplex.ptc.parallel`), the worker <->
scheduler protocol (:mod:`tenplex.core.protocol` checks an assignment against it), the scheduler, the workers.
One dataclass owns the degrees (dp, tp, pp), the ZeRO stage and the pipeline
split, and validates them with messages that show the values. Every component
uses the same rank order, Megatron's: tensor-parallel fastest, then data
parallel, then pipeline stages, i.e. ``rank = (pp * dp_size + dp) * tp_size + tp``.
With ``tp`` dividing the GPUs of a node, tensor-parallel groups never cross a
node, which is where their all-reduces belong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tenplex.errors import InvalidConfig


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    """0: replicated optimizer; 1/2: optimizer state flat-partitioned across dp; 3: parameters too."""
    layers_per_stage: tuple[int, ...] | None = None
    """Explicit transformer layers per pipeline stage; ``None`` splits evenly (earlier stages take the remainder)."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidConfig(f"{name} must be a positive integer, got {value!r}")
        if self.zero not in (0, 1, 2, 3):
            raise InvalidConfig(f"zero stage must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.layers_per_stage is not None:
            if len(self.layers_per_stage) != self.pp:
                raise InvalidConfig(
                    f"layers_per_stage {list(self.layers_per_stage)} has {len(self.layers_per_stage)} entries, pp is {self.pp}"
                )
            if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.layers_per_stage):
                raise InvalidConfig(f"layers_per_stage {list(self.layers_per_stage)} must be positive integers")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def describe(self) -> str:
        extra = f", zero{self.zero}" if self.zero else ""
        split = f", layers {list(self.layers_per_stage)}" if self.layers_per_stage else ""
        return f"dp{self.dp} x tp{self.tp} x pp{self.pp}{extra}{split}"

    # -- ranks ----------------------------------------------------------------

    def coords(self, rank: int) -> dict[str, int]:
        """``{"dp", "tp", "pp"}`` coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise InvalidConfig(f"rank {rank} is outside world size {self.world_size} ({self.describe()})")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return {"dp": dp, "tp": tp, "pp": pp}

    def rank(self, dp: int, tp: int, pp: int) -> int:
        if not (0 <= dp < self.dp and 0 <= tp < self.tp and 0 <= pp < self.pp):
            raise InvalidConfig(f"coordinates dp={dp} tp={tp} pp={pp} are outside {self.describe()}")
        return (pp * self.dp + dp) * self.tp + tp

    # -- pipeline split -------------------------------------------------------

    def stage_layers(self, num_layers: int) -> list[range]:
        """The global transformer-layer indices of each pipeline stage."""
        if self.layers_per_stage is not None:
            if sum(self.layers_per_stage) != num_layers:
                raise InvalidConfig(
                    f"layers_per_stage {list(self.layers_per_stage)} sums to {sum(self.layers_per_stage)}, "
                    f"the model has {num_layers} layers"
                )
            sizes = list(self.layers_per_stage)
        else:
            if num_layers < self.pp:
                raise InvalidConfig(f"{num_layers} layers cannot fill {self.pp} pipeline stages")
            base, extra = divmod(num_layers, self.pp)
            sizes = [base + (1 if s < extra else 0) for s in range(self.pp)]
        out, start = [], 0
        for size in sizes:
            out.append(range(start, start + size))
            start += size
        return out

    # -- JSON -----------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "zero": self.zero}
        if self.layers_per_stage is not None:
            out["layers_per_stage"] = list(self.layers_per_stage)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ParallelConfig:
        if not isinstance(obj, Mapping):
            raise InvalidConfig(f"parallel config must be an object, got {type(obj).__name__}")
        unknown = set(obj) - {"dp", "tp", "pp", "zero", "layers_per_stage"}
        if unknown:
            raise InvalidConfig(f"unknown parallel config keys: {', '.join(sorted(unknown))}")
        lps = obj.get("layers_per_stage")
        if lps is not None and not isinstance(lps, list | tuple):
            raise InvalidConfig(f"layers_per_stage must be a list of integers, got {lps!r}")
        return cls(
            dp=obj.get("dp", 1),
            tp=obj.get("tp", 1),
            pp=obj.get("pp", 1),
            zero=obj.get("zero", 0),
            layers_per_stage=tuple(lps) if lps is not None else None,
        )
