"""Where a job's ranks run: a :class:`Placement` of ranks on hosts, for a :class:`ParallelConfig`.

The parallel configuration itself is :mod:`tenplex.core.parallel` (the worker <-> scheduler protocol checks
assignments against it, below the data model); it is named here too, as part of the data model's API.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tenplex.core.parallel import ParallelConfig
from tenplex.errors import InvalidConfig

__all__ = ["ParallelConfig", "Placement", "hosts_from"]


@dataclass(frozen=True, slots=True)
class Placement:
    """Which host each rank runs on: ``gpus_per_node`` consecutive ranks per host."""

    gpus_per_node: int
    hosts: tuple[str, ...]

    def __post_init__(self) -> None:
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise InvalidConfig(f"gpus_per_node must be a positive integer, got {self.gpus_per_node!r}")
        if len(set(self.hosts)) != len(self.hosts) or not all(self.hosts):
            raise InvalidConfig(f"host names must be distinct and non-empty, got {list(self.hosts)}")

    @classmethod
    def uniform(cls, world_size: int, gpus_per_node: int, host_prefix: str = "node-") -> Placement:
        nodes = -(-world_size // gpus_per_node)
        return cls(gpus_per_node, tuple(f"{host_prefix}{i}" for i in range(nodes)))

    def host_of(self, rank: int) -> str:
        index = rank // self.gpus_per_node
        if index >= len(self.hosts):
            raise InvalidConfig(
                f"rank {rank} needs host #{index} but only {len(self.hosts)} hosts of {self.gpus_per_node} GPUs are placed"
            )
        return self.hosts[index]

    def check(self, parallel: ParallelConfig) -> None:
        """Reject placements that do not fit or that split a tensor-parallel group across hosts."""
        capacity = self.gpus_per_node * len(self.hosts)
        if parallel.world_size > capacity:
            raise InvalidConfig(
                f"{parallel.describe()} needs {parallel.world_size} GPUs; {len(self.hosts)} hosts x {self.gpus_per_node} have {capacity}"
            )
        if parallel.tp > self.gpus_per_node or self.gpus_per_node % parallel.tp:
            raise InvalidConfig(
                f"tp={parallel.tp} must divide the {self.gpus_per_node} GPUs per node so tensor-parallel groups stay inside a node"
            )


def hosts_from(names: Sequence[str] | None, world_size: int, gpus_per_node: int) -> Placement:
    """A placement on the given hosts (in order), or on ``node-0..`` when none are given."""
    if names is None:
        return Placement.uniform(world_size, gpus_per_node)
    return Placement(gpus_per_node, tuple(names))
