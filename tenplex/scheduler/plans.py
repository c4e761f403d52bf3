"""A reconfiguration's plan is derived, not stored: what the job record keeps of it.

The planner is deterministic: the same two PTCs, versions, source hosts and
checkpoint give the same plan (:func:`~tenplex.transformer.plan.make_plan`).
The PTCs of the job's generations are persisted already (one object per
generation), so the record keeps only the rest, :class:`PlanInputs`, and a
restarted scheduler computes the plan again. The plan itself is large (GPT-3
175B going 1,024 -> 768 GPUs: 60 MiB of JSON, 1.8 MiB gzipped), over the API
server's 1 MiB object limit; its inputs are a few hundred bytes plus the alive
hosts' names.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tenplex.core.version import Version
from tenplex.errors import InvalidInput
from tenplex.ptc import PTC
from tenplex.transformer.plan import Plan, make_plan

FORMAT = "tenplex.plan-inputs/v1"


@dataclass(frozen=True)
class PlanInputs:
    """Everything :func:`make_plan` needs besides the two PTCs.

    ``old_generation`` names the job generation whose persisted PTC is the old
    layout; None when the old layout is a persistent version's (a resumed job:
    its PTC is read from the checkpoint again). ``alive`` are the hosts whose
    stores answered when the plan was made; ``not_holding`` those of them that
    did not hold ``old_version`` (usually none: the record keeps the
    difference, not a second list of every host).
    """

    job: str
    old_version: str
    new_version: str
    old_generation: int | None
    alive: tuple[str, ...]
    not_holding: tuple[str, ...] = ()
    checkpoint: str | None = None
    old_job: str | None = None

    @property
    def new_generation(self) -> int:
        return Version.parse(self.new_version).generation

    @classmethod
    def of(cls, *, job: str, old_version: Version | str, new_version: Version | str, old_generation: int | None,
           alive: Collection[str], holders: Collection[str], checkpoint: str | None = None,
           old_job: str | None = None) -> PlanInputs:
        held = set(holders)
        unknown = sorted(held - set(alive))
        if unknown:
            raise InvalidInput(f"holders {unknown} are not among the alive hosts")
        return cls(job=job, old_version=str(old_version), new_version=str(new_version), old_generation=old_generation,
                   alive=tuple(sorted(alive)), not_holding=tuple(sorted(set(alive) - held)), checkpoint=checkpoint,
                   old_job=old_job)

    def holders(self) -> dict[str, str]:
        skip = set(self.not_holding)
        return {h: self.old_version for h in self.alive if h not in skip}

    def plan(self, old: PTC, new: PTC) -> Plan:
        """The plan these inputs give for ``old`` -> ``new`` (the same one every time)."""
        return make_plan(old, new, job=self.job, old_version=self.old_version, new_version=self.new_version,
                         holders=self.holders(), alive=list(self.alive), checkpoint=self.checkpoint,
                         old_job=self.old_job)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "job": self.job, "old_version": self.old_version, "new_version": self.new_version,
                "old_generation": self.old_generation, "alive": list(self.alive),
                "not_holding": list(self.not_holding), "checkpoint": self.checkpoint, "old_job": self.old_job}

    @classmethod
    def from_json(cls, obj: Any) -> PlanInputs:
        if not isinstance(obj, Mapping) or obj.get("format") != FORMAT:
            got = obj.get("format") if isinstance(obj, Mapping) else type(obj).__name__
            raise InvalidInput(f"not a plan's inputs: expected format {FORMAT!r}, got {got!r} (a record written "
                               "before plans were derived holds the whole plan: finish or cancel that change with "
                               "the scheduler version that wrote it)")
        try:
            gen = obj["old_generation"]
            return cls(job=str(obj["job"]), old_version=str(Version.parse(obj["old_version"])),
                       new_version=str(Version.parse(obj["new_version"])),
                       old_generation=None if gen is None else int(gen), alive=_names(obj["alive"]),
                       not_holding=_names(obj.get("not_holding", [])), checkpoint=obj.get("checkpoint"),
                       old_job=obj.get("old_job"))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"malformed plan inputs: {type(exc).__name__}: {exc}") from None


def _names(value: Sequence[Any]) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError("host lists must be lists of names")
    return tuple(value)


__all__ = ["FORMAT", "PlanInputs"]
