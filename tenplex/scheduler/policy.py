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

Where: ``gpus_per_node`` consecutive ranks per host (a tensor-parallel group
never spans hosts), on usable hosts only. Given the state's current layout
(``old``), which host runs which block of ranks is chosen to move the fewest
bytes (:func:`keep_state_placement`): a placement that keeps pipeline stages
and tp groups where their state already is moves less than any plan can save
afterwards (a dp scale-up that maps the new replica's first stage onto the
host of the old second stage moves both stages: twice the bytes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from tenplex.core.units import human_bytes
from tenplex.errors import InvalidConfig, TenplexError
from tenplex.ptc import PTC, ParallelConfig, Placement
from tenplex.transformer.plan import HostOverlap, host_overlap

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
    *,
    old: PTC | None = None,
    holders: Collection[str] | None = None,
) -> Decision:
    """Pick the configuration and placement for ``gpus`` GPUs on ``hosts`` (in order of preference).

    With ``old`` (the layout of the state the new configuration starts from; ``holders``: the hosts whose
    stores have it), the blocks of ranks go where they move the fewest bytes (:func:`keep_state_placement`),
    never a placement that moves more than the preference order alone would.
    """
    decision = _choose(gpus, policy, build, hosts, gpus_per_node)
    if old is None:
        return decision
    return keep_state_placement(decision, old, holders, hosts, policy, build)


def _choose(gpus: int, policy: Policy, build: LayoutBuilder, hosts: list[str], gpus_per_node: int) -> Decision:
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


def _receive_bound(ov: HostOverlap, columns: np.ndarray) -> tuple[float, float]:
    """(largest, total) bytes the hosts receive when new host ``b`` runs on old-host column ``columns[b]``
    (-1: a host that holds nothing of the state)."""
    rows = np.arange(len(ov.new_hosts))
    kept = np.where(columns >= 0, ov.keep[rows, np.maximum(columns, 0)], 0.0) if len(ov.old_hosts) else np.zeros(len(rows))
    receive = ov.need - kept
    return float(receive.max(initial=0.0)), float(receive.sum())


def keep_state_placement(decision: Decision, old: PTC, holders: Collection[str] | None, hosts: list[str],
                         policy: Policy, build: LayoutBuilder) -> Decision:
    """``decision`` with its blocks of ranks moved to the hosts that hold most of their state, when that
    lowers the reconfiguration's receive bound (the busiest host's bytes in; then the total).

    The blocks (``gpus_per_node`` consecutive ranks, so tp groups stay inside a host) and the candidate
    hosts (``hosts``: usable, with the GPUs free) are today's; only which host takes which block changes.
    Greedy on the bytes kept: the (block, host) pairs sharing the most bytes first (each block's best few
    hosts), then the remaining blocks on the remaining hosts in preference order. The result is kept only
    when its bound beats the preference order's (so it is never worse); the receive side is exact (a host
    receives what it needs and does not hold), the send side follows from where the state is.
    """
    placement = decision.placement
    nodes = len(placement.hosts)
    ov = host_overlap(old, decision.ptc, holders)
    if not len(ov.old_hosts) or nodes == 0 or len(ov.new_hosts) != nodes:
        return decision
    column = {h: i for i, h in enumerate(ov.old_hosts)}
    block = {h: b for b, h in enumerate(ov.new_hosts)}
    order = [block[h] for h in placement.hosts]  # rank-block index -> row of the overlap
    today = np.array([column.get(h, -1) for h in ov.new_hosts], dtype=np.int64)
    best_keep = min(len(ov.old_hosts), 8)
    tops = np.argpartition(-ov.keep, best_keep - 1, axis=1)[:, :best_keep] if best_keep < len(ov.old_hosts) else \
        np.tile(np.arange(len(ov.old_hosts)), (nodes, 1))
    pairs = [(float(ov.keep[b, h]), b, int(h)) for b in range(nodes) for h in tops[b] if ov.keep[b, h] > 0]
    pairs.sort(key=lambda p: (-p[0], p[1], p[2]))
    assigned: dict[int, str] = {}
    taken: set[str] = set()
    for _kept, b, h in pairs:
        name = ov.old_hosts[h]
        if b in assigned or name in taken or name not in hosts:
            continue
        assigned[b] = name
        taken.add(name)
    # A block whose best few hosts were all taken (replicated state: under ZeRO-0 every dp rank of a stage holds
    # the same bytes, so a block has dozens of equally good hosts and its top few are every other block's too)
    # takes the free host that keeps most of its state, if any keeps some.
    free = np.array([h in hosts and h not in taken for h in ov.old_hosts], dtype=bool)
    for b in order:
        if b in assigned or not free.any():
            continue
        kept = np.where(free, ov.keep[b], -1.0)
        h = int(kept.argmax())
        if kept[h] > 0:
            assigned[b] = ov.old_hosts[h]
            taken.add(ov.old_hosts[h])
            free[h] = False
    rest = iter(h for h in hosts if h not in taken)
    for b in order:
        if b not in assigned:
            assigned[b] = next(rest)
    chosen = np.array([column.get(assigned[b], -1) for b in range(nodes)], dtype=np.int64)
    before, after = _receive_bound(ov, today), _receive_bound(ov, chosen)
    if after >= before:
        return decision
    moved = Placement(placement.gpus_per_node, tuple(assigned[b] for b in order))
    ptc = _try(decision.parallel, moved, policy, build)
    if isinstance(ptc, str):
        log.warning("placement keeping the state in place is not usable (%s); keeping %s", ptc, list(placement.hosts))
        return decision
    log.info("placement: ranks moved to the hosts holding their state: busiest host receives %s instead of %s, "
             "%s in total instead of %s", human_bytes(int(after[0])), human_bytes(int(before[0])),
             human_bytes(int(after[1])), human_bytes(int(before[1])))
    return Decision(decision.parallel, moved, ptc,
                    f"{decision.reason}; placed where the state is (receives {human_bytes(int(after[1]))}, "
                    f"not {human_bytes(int(before[1]))})")
