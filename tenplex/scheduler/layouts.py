"""From a job's layout spec to the PTC of any configuration.

The scheduler must know the PTC of a configuration *before* its workers
start, so it can plan the state transformation while they launch. A layout
spec names a provider and its model parameters:

``{"provider": "megatron-gpt", "model": {"num_layers": 24, ...}, "precision": "bf16"}``
``{"provider": "example-gpt", "model": {"vocab": 64, "dim": 32, ...}}``
``{"provider": "example-torchtitan", "model": {"flavor": "debugmodel", "n_layers": 2, "seq_len": 32}}``
``{"provider": "example-hf", "model": {"vocab_size": 128, "hidden_size": 64, ...}}``

The providers are imported lazily: the example provider builds the model on
the meta device and so imports torch, which the rest of the scheduler does
not need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tenplex.errors import InvalidConfig
from tenplex.ptc import PTC, DatasetState, ParallelConfig, Placement

PROVIDERS = ("megatron-gpt", "example-gpt", "example-torchtitan", "example-hf")


@dataclasses.dataclass(frozen=True)
class LayoutSpec:
    provider: str
    model: Mapping[str, Any]
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS:
            raise InvalidConfig(f"unknown layout provider {self.provider!r}; known: {', '.join(PROVIDERS)}")
        if not isinstance(self.model, Mapping):
            raise InvalidConfig(f"layout model must be an object, got {type(self.model).__name__}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise InvalidConfig(f"precision must be fp32, bf16 or fp16, got {self.precision!r}")
        # Fail at job creation, not at the first scale event.
        self.model_config()

    def model_config(self) -> Any:
        """The provider's typed model description (raises InvalidConfig on bad fields)."""
        if self.provider == "megatron-gpt":
            from tenplex.ptc.megatron import GPTSpec

            return _construct(GPTSpec, self.model, "megatron-gpt model")
        if self.provider == "example-torchtitan":
            from examples.torchtitan.job import TitanConfig

            return _construct(TitanConfig, self.model, "example-torchtitan model")
        if self.provider == "example-hf":
            from examples.hf.job import HFConfig

            return _construct(HFConfig, self.model, "example-hf model")
        from examples.gpt.model import GPTConfig

        return _construct(GPTConfig, self.model, "example-gpt model")

    def build(self, parallel: ParallelConfig, placement: Placement, dataset: DatasetState | None) -> PTC:
        """The PTC of this model in ``parallel`` on ``placement``."""
        if dataset is not None:
            dataset.check_dp(parallel.dp)
        model = self.model_config()
        if self.provider == "megatron-gpt":
            from tenplex.ptc.megatron import megatron_gpt_ptc

            return megatron_gpt_ptc(
                model,
                parallel,
                gpus_per_node=placement.gpus_per_node,
                hosts=placement.hosts,
                precision=self.precision,
                dataset=dataset,
            )
        if self.provider == "example-torchtitan":
            from examples.torchtitan.job import titan_ptc

            return titan_ptc(model, parallel, placement, dataset=dataset)
        if self.provider == "example-hf":
            from examples.hf.job import hf_ptc

            return hf_ptc(model, parallel, placement, dataset=dataset)
        from examples.gpt.layout import gpt_ptc

        return gpt_ptc(model, parallel, placement, dataset=dataset)  # derive_ptc serializes its own fake group

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


def _construct(cls: type, fields: Mapping[str, Any], what: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(fields) - names
    if unknown:
        raise InvalidConfig(f"{what}: unknown fields {', '.join(sorted(unknown))}; known: {', '.join(sorted(names))}")
    try:
        return cls(**fields)
    except InvalidConfig:
        raise
    except (TypeError, ValueError) as exc:
        raise InvalidConfig(f"{what}: {exc}") from None
