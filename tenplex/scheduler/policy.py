"""Parallelization policy: which (dp, tp, pp) to run on N GPUs, and where.

Two ways to decide, as platform teams asked for:

- a user table (GPU count -> configuration), taken as given but still checked
  against the model and the nodes;
- the built-in cost model: tensor parallelism inside a node (its all-reduces
  need the node's fast links) up to the GPUs of a node, pipeline parallelism
  across nodes, the smallest pipeline depth whose largest per-device state fits
  the GPU memory budget, then as much data parallelism as remains.

A GPU count that no configuration serves is rejected with the reasons of
every candidate tried, so the user sees *why* (heads not divisible, too little
memory, batch not divisible, ...).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tenplex.core.units import human_bytes
from tenplex.errors import InvalidConfig, TenplexError
from tenplex.ptc import PTC, ParallelConfig, Placement

log = logging.getLogger(__name__)

# Builds the PTC of a configuration on a placement (see tenplex.scheduler.layouts).
LayoutBuilder = Callable[[ParallelConfig, Placement], PTC]


@dataclass(frozen=True)
class Policy:
    """How a job's GPU count becomes a parallel configuration.

    ``state_memory_fraction`` is the part of a GPU's memory that model and
    optimizer state may use; the rest is left to activations and workspace.
    """

    table: Mapping[int, ParallelConfig] = field(default_factory=dict)
    gpu_memory_bytes: int | None = None
    state_memory_fraction: float = 0.5
    zero: int = 0

    def __post_init__(self) -> None:
        if self.gpu_memory_bytes is not None and self.gpu_memory_bytes <= 0:
            raise InvalidConfig(f"gpu_memory_bytes must be positive, got {self.gpu_memory_bytes}")
        if not 0 < self.state_memory_fraction <= 1:
            raise InvalidConfig(f"state_memory_fraction must be in (0, 1], got {self.state_memory_fraction}")
        for gpus, cfg in self.table.items():
            if cfg.world_size != gpus:
                raise InvalidConfig(f"policy table entry for {gpus} GPUs is {cfg.describe()} = {cfg.world_size} GPUs")

    @property
    def memory_budget(self) -> int | None:
        if self.gpu_memory_bytes is None:
            return None
        return int(self.gpu_memory_bytes * self.state_memory_fraction)


@dataclass(frozen=True)
class Decision:
    parallel: ParallelConfig
    placement: Placement
    ptc: PTC
    reason: str


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose(
    gpus: int,
    policy: Policy,
    build: LayoutBuilder,
    hosts: list[str],
    gpus_per_node: int,
) -> Decision:
    """Pick the configuration and placement for ``gpus`` GPUs on ``hosts`` (in order of preference)."""
    if gpus < 1:
        raise InvalidConfig(f"a job needs at least 1 GPU, got {gpus}")
    capacity = len(hosts) * gpus_per_node
    if gpus > capacity:
        raise InvalidConfig(f"{gpus} GPUs requested but the {len(hosts)} available hosts x {gpus_per_node} GPUs hold {capacity}")
    nodes = -(-gpus // gpus_per_node)
    placement = Placement(gpus_per_node, tuple(hosts[:nodes]))

    if gpus in policy.table:
        cfg = policy.table[gpus]
        ptc = _try(cfg, placement, policy, build)
        if isinstance(ptc, str):
            raise InvalidConfig(f"the policy table's configuration for {gpus} GPUs ({cfg.describe()}) is not usable: {ptc}")
        return Decision(cfg, placement, ptc, f"policy table entry for {gpus} GPUs")
    if policy.table:
        raise InvalidConfig(f"the policy table has no entry for {gpus} GPUs (it has {sorted(policy.table)})")

    reasons: list[str] = []
    # TP inside a node: the largest tp that divides both the node and the GPU count.
    tp_candidates = [t for t in reversed(divisors(min(gpus_per_node, gpus))) if gpus % t == 0 and gpus_per_node % t == 0]
    for tp in tp_candidates:
        for pp in divisors(gpus // tp):
            dp = gpus // (tp * pp)
            cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, zero=policy.zero)
            ptc = _try(cfg, placement, policy, build)
            if isinstance(ptc, str):
                reasons.append(f"{cfg.describe()}: {ptc}")
                continue
            return Decision(cfg, placement, ptc, f"built-in: tp{tp} inside a node, smallest pp that fits ({pp}), dp{dp}")
    shown = "; ".join(reasons[:8]) + (f"; ... {len(reasons) - 8} more" if len(reasons) > 8 else "")
    raise InvalidConfig(f"no parallel configuration runs this job on {gpus} GPUs: {shown}")


def _try(cfg: ParallelConfig, placement: Placement, policy: Policy, build: LayoutBuilder) -> PTC | str:
    """The PTC for ``cfg``, or the reason it is not usable."""
    try:
        placement.check(cfg)
        ptc = build(cfg, placement)
    except TenplexError as exc:
        return exc.detail
    budget = policy.memory_budget
    if budget is not None:
        worst = max(ptc.bytes_per_device().values(), default=0)
        if worst > budget:
            return f"largest device state {human_bytes(worst)} exceeds the budget {human_bytes(budget)}"
    return ptc
