"""Layout providers: how the PTC of a model is made for any parallel configuration.

The scheduler must know the PTC of a configuration *before* its workers
start, so it can plan the state transformation while they launch. A job's
layout spec names a provider and gives it the model's description::

    {"provider": "megatron-gpt", "model": {"num_layers": 24, ...}, "precision": "bf16"}

A provider is a function ``(model, parallel, placement, dataset, precision) -> PTC``
together with the type of its ``model`` argument (a dataclass, typically):
the spec's ``model`` object becomes that type's keyword arguments when the job
is created, so a job with unknown or malformed model fields is refused then,
not at its first reconfiguration. :func:`layout_provider` makes one::

    @dataclass(frozen=True)
    class MyModel:
        layers: int
        dim: int

    @layout_provider(MyModel)
    def my_layout(model: MyModel, parallel: ParallelConfig, placement: Placement,
                  dataset: DatasetState | None, precision: str) -> PTC:
        ...

The scheduler finds providers by name among the ``tenplex.layouts`` entry
points of the installed distributions (Tenplex registers ``megatron-gpt``;
a user's package registers its own), or by a ``module:function`` spec naming
one directly (see :mod:`tenplex.scheduler.layouts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tenplex.errors import InvalidConfig
from tenplex.ptc.dataset import DatasetState
from tenplex.ptc.model import PTC
from tenplex.ptc.parallel import ParallelConfig, Placement

PRECISIONS = ("fp32", "bf16", "fp16")
"""Training precisions a layout spec may name (the provider decides what each means for its tensors)."""

BuildFunction = Callable[[Any, ParallelConfig, Placement, "DatasetState | None", str], PTC]
CheckFunction = Callable[[Any, ParallelConfig], None]


@dataclass(frozen=True)
class LayoutProvider:
    """A registered way to make a model's PTC: its build function and the type of its model description."""

    build: BuildFunction
    """``(model, parallel, placement, dataset, precision) -> PTC``; raises :class:`InvalidConfig` for a
    configuration the model does not divide into."""
    model: Callable[..., Any]
    """Called with the layout spec's ``model`` fields as keyword arguments (a dataclass, typically); raises
    :class:`InvalidConfig`, ``TypeError`` or ``ValueError`` for bad values."""
    check: CheckFunction | None = None
    """``(model, parallel) -> None``: raises :class:`InvalidConfig` for a configuration the model's trainer
    cannot run at all, without building the PTC. Cheap, so the scheduler asks it for every configuration a
    job's policy table names when the job is created: an entry no placement can fix is a refused job, not a
    job left pending at its first scale event."""

    def __post_init__(self) -> None:
        if not callable(self.build) or not callable(self.model):
            raise InvalidConfig("a layout provider needs a callable build function and a callable model type")
        if self.check is not None and not callable(self.check):
            raise InvalidConfig("a layout provider's check must be callable")

    def model_config(self, fields: Mapping[str, Any], what: str = "layout model") -> Any:
        """The typed model description of ``fields``; :class:`InvalidConfig` naming the bad or unknown fields."""
        if not isinstance(fields, Mapping):
            raise InvalidConfig(f"{what} must be an object, got {type(fields).__name__}")
        if dataclasses.is_dataclass(self.model) and isinstance(self.model, type):
            names = {f.name for f in dataclasses.fields(self.model) if f.init}
            unknown = set(fields) - names
            if unknown:
                raise InvalidConfig(f"{what}: unknown fields {', '.join(sorted(unknown))}; "
                                    f"known: {', '.join(sorted(names))}")
        try:
            return self.model(**fields)
        except InvalidConfig:
            raise
        except (TypeError, ValueError) as exc:
            raise InvalidConfig(f"{what}: {exc}") from None

    def __call__(self, model: Any, parallel: ParallelConfig, placement: Placement, dataset: DatasetState | None,
                 precision: str) -> PTC:
        return self.build(model, parallel, placement, dataset, precision)


def layout_provider(model: Callable[..., Any], *,
                    check: CheckFunction | None = None) -> Callable[[BuildFunction], LayoutProvider]:
    """Decorator: the function becomes a :class:`LayoutProvider` whose model description is ``model``
    (and whose configurations ``check`` refuses, see :attr:`LayoutProvider.check`)."""

    def wrap(build: BuildFunction) -> LayoutProvider:
        return LayoutProvider(build=build, model=model, check=check)

    return wrap
