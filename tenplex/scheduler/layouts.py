"""From a job's layout spec to the PTC of any configuration.

A layout spec names a layout provider (:mod:`tenplex.ptc.provider`) and gives
it the model's description::

    {"provider": "megatron-gpt", "model": {"num_layers": 24, ...}, "precision": "bf16"}
    {"provider": "example-gpt", "model": {"vocab": 64, "dim": 32, ...}}
    {"provider": "mypackage.layout:my_layout", "model": {...}}

The provider is a name registered under the ``tenplex.layouts`` entry points
(Tenplex registers ``megatron-gpt``, ``torchtitan`` and ``transformers``; the example job's
distribution, ``tenplex-examples``, registers ``example-gpt``), or a ``module:function`` spec naming a provider directly.
Either is resolved when the spec is made (job creation, or a scheduler
reading its records back), so an unknown provider or bad model fields are
refused at once, with the reason. Resolving imports the provider's module
(a provider that builds its model on the meta device imports torch then, which
the rest of the scheduler does not need).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tenplex import registry
from tenplex.errors import InvalidConfig
from tenplex.ptc import PTC, DatasetState, ParallelConfig, Placement
from tenplex.ptc.provider import PRECISIONS, LayoutProvider


def registered_providers() -> list[str]:
    """The names of the installed layout providers (nothing is imported)."""
    return list(registry.registered(registry.LAYOUTS))


def resolve_provider(reference: str) -> LayoutProvider:
    """The :class:`LayoutProvider` a registered name or a ``module:function`` spec stands for."""
    obj = registry.resolve(registry.LAYOUTS, reference, "layout provider")
    if not isinstance(obj, LayoutProvider):
        raise InvalidConfig(f"layout provider {reference!r} is a {type(obj).__name__}, not a layout provider: "
                            "make it with @tenplex.ptc.provider.layout_provider(ModelType)")
    return obj


@dataclasses.dataclass(frozen=True)
class LayoutSpec:
    provider: str
    model: Mapping[str, Any]
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise InvalidConfig(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        # Fail at job creation, not at the first scale event: the provider must resolve, the model must fit it.
        self.model_config()

    @property
    def layout_provider(self) -> LayoutProvider:
        return resolve_provider(self.provider)

    def model_config(self) -> Any:
        """The provider's typed model description (raises InvalidConfig on bad fields)."""
        return self.layout_provider.model_config(self.model, f"{self.provider} model")

    def check_parallel(self, parallel: ParallelConfig) -> None:
        """Whether the provider's trainer can run ``parallel`` at all (:attr:`LayoutProvider.check`; providers
        without one accept every configuration here and say no when the layout is built)."""
        provider = self.layout_provider
        if provider.check is not None:
            provider.check(self.model_config(), parallel)

    def build(self, parallel: ParallelConfig, placement: Placement, dataset: DatasetState | None) -> PTC:
        """The PTC of this model in ``parallel`` on ``placement``."""
        if dataset is not None:
            dataset.check_dp(parallel.dp)
        provider = self.layout_provider
        ptc = provider(self.model_config(), parallel, placement, dataset, self.precision)
        if not isinstance(ptc, PTC):
            raise InvalidConfig(f"layout provider {self.provider!r} returned a {type(ptc).__name__}, not a PTC")
        return ptc

    def to_json(self) -> dict[str, Any]:
        return {"provider": self.provider, "model": dict(self.model), "precision": self.precision}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> LayoutSpec:
        if not isinstance(obj, Mapping):
            raise InvalidConfig(f"layout must be an object, got {type(obj).__name__}")
        unknown = set(obj) - {"provider", "model", "precision"}
        if unknown:
            raise InvalidConfig(f"unknown layout keys: {', '.join(sorted(unknown))}")
        if "provider" not in obj:
            raise InvalidConfig("layout needs a 'provider'")
        return cls(provider=obj["provider"], model=obj.get("model", {}), precision=obj.get("precision", "fp32"))
