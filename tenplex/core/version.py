"""Names of stored state versions.

A version is one consistent state of a job: the training step it was taken
after, and the layout generation (bumped by every reconfiguration, since the
same step can exist in several layouts). Its name, ``s<step>-g<generation>``,
is what the store's paths, the HTTP API and the scheduler use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tenplex.errors import InvalidInput

_PATTERN = re.compile(r"^s(0|[1-9][0-9]{0,17})-g(0|[1-9][0-9]{0,8})$")


@dataclass(frozen=True, slots=True, order=True)
class Version:
    step: int
    generation: int = 0

    def __post_init__(self) -> None:
        if self.step < 0 or self.generation < 0:
            raise InvalidInput(f"version step and generation must be >= 0, got step {self.step}, generation {self.generation}")

    def __str__(self) -> str:
        return f"s{self.step}-g{self.generation}"

    @classmethod
    def parse(cls, text: str) -> Version:
        m = _PATTERN.match(text)
        if m is None:
            raise InvalidInput(f"version {text!r} is not of the form s<step>-g<generation> (e.g. s120-g0)")
        return cls(int(m.group(1)), int(m.group(2)))

    def next_generation(self) -> Version:
        """The same step in the next layout (what a reconfiguration writes)."""
        return Version(self.step, self.generation + 1)
