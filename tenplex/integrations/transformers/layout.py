"""Layout provider ``transformers``: the PTC of a Hugging Face causal LM as :class:`TenplexTrainer` trains it.

Job layout, one of::

    {"provider": "transformers", "model": {"architecture": "LlamaForCausalLM", "config": {<config fields>}}}
    {"provider": "transformers", "model": {"pretrained": "<local directory with config.json>"}}

and the job's ``precision`` (``fp32`` default, ``bf16``, ``fp16``): the dtype of the model the Trainer is given.
The model is built by transformers itself on the meta device (the architecture's class,
``_from_config``), so nothing is assumed about the family: parameter names are the model's
``named_parameters()`` (a tied output embedding is stored once, under its first name), and AdamW's
state follows them. Any causal LM transformers knows (its ``MODEL_FOR_CAUSAL_LM_MAPPING``) is accepted.

:class:`~tenplex.integrations.transformers.TenplexTrainer` trains with the data parallelism transformers'
``Trainer`` runs on its own (DDP: ``zero=0``, every rank a full replica), so the provider lays out only
that and refuses the rest (tensor or pipeline parallelism, sharded data parallelism) with the reason, when
the job is created or scaled. A config that transformers refuses, an unknown architecture or an unknown
config field is an :class:`~tenplex.errors.InvalidConfig` naming it, at job creation.

This module imports transformers only inside the functions: the scheduler loads it by entry point.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenplex.errors import InvalidConfig
from tenplex.ptc import PTC, DatasetState, ParallelConfig, Placement
from tenplex.ptc.provider import layout_provider

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""The job's ``precision`` -> the dtype of the model's parameters (and AdamW's state)."""


def check_parallel(parallel: ParallelConfig) -> None:
    """What :class:`TenplexTrainer` can run: dp replicas (DDP through the Trainer); :class:`InvalidConfig` if not."""
    if parallel.tp != 1:
        raise InvalidConfig(
            f"{parallel.describe()}: tp={parallel.tp}; TenplexTrainer runs data parallelism only: transformers' "
            "Trainer trains a tp_plan model through accelerate's ParallelismConfig, which accelerate 1.15 refuses "
            "without accelerators (MULTI_CPU), and Tenplex has not run it on GPUs yet: use a policy with tp=1"
        )
    if parallel.pp != 1:
        raise InvalidConfig(f"{parallel.describe()}: pp={parallel.pp}; transformers' Trainer has no pipeline "
                            "parallelism: use a policy with pp=1")
    if parallel.zero != 0:
        raise InvalidConfig(
            f"{parallel.describe()}: zero={parallel.zero}; TenplexTrainer runs the Trainer's DDP (every dp rank a full "
            "replica; accelerate 1.15 runs the Trainer's FSDP only on accelerators, and Tenplex has not run it on "
            "GPUs yet): use a policy with \"zero\": 0, e.g. {\"table\": {\"2\": {\"dp\": 2, \"zero\": 0}}}"
        )


@dataclass(frozen=True)
class TransformersModel:
    """The job's model: an architecture and its config fields, or a local pretrained directory.

    Checked when the job is created: the architecture must be a causal LM class of transformers, every
    config field one its config class has, and the config one transformers accepts.
    """

    architecture: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    pretrained: str | None = None

    def __post_init__(self) -> None:
        if self.pretrained is not None:
            if self.architecture is not None or self.config:
                raise InvalidConfig("transformers model: give either \"pretrained\" or \"architecture\" with "
                                    "\"config\", not both")
            if not isinstance(self.pretrained, str) or not self.pretrained.strip():
                raise InvalidConfig(f"transformers model pretrained must be a local directory, got {self.pretrained!r}")
        elif not isinstance(self.architecture, str) or not self.architecture.strip():
            raise InvalidConfig("transformers model needs \"architecture\" (e.g. \"LlamaForCausalLM\") with "
                                f"\"config\", or \"pretrained\" (a local directory); got architecture {self.architecture!r}")
        if not isinstance(self.config, dict):
            raise InvalidConfig(f"transformers model config must be an object, got {type(self.config).__name__}")
        self.load()

    def load(self) -> tuple[type, Any]:
        """The model class and its config object (:class:`InvalidConfig` naming what is wrong)."""
        if self.pretrained is not None:
            return self._pretrained()
        assert self.architecture is not None
        cls = model_class(self.architecture, "transformers model architecture")
        config_class = cls.config_class
        known = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set(
            config_class().to_dict())
        known |= set(getattr(config_class, "attribute_map", {}))
        unknown = sorted(set(self.config) - known)
        if unknown:
            raise InvalidConfig(f"transformers model config: {config_class.__name__} has no field "
                                f"{', '.join(repr(u) for u in unknown)}")
        try:
            config = config_class(**self.config)
        except Exception as exc:  # transformers' strict dataclass validation raises its own types
            raise InvalidConfig(f"transformers model config for {self.architecture}: {exc}") from None
        return cls, config

    def _pretrained(self) -> tuple[type, Any]:
        from transformers import AutoConfig

        path = Path(str(self.pretrained)).expanduser()
        if not (path / "config.json").is_file():
            raise InvalidConfig(f"transformers model pretrained {self.pretrained!r} is not a local directory with a "
                                "config.json (nothing is downloaded)")
        try:
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:
            raise InvalidConfig(f"transformers model pretrained {self.pretrained!r}: {exc}") from None
        archs = list(getattr(config, "architectures", None) or [])
        if len(archs) != 1:
            raise InvalidConfig(f"transformers model pretrained {self.pretrained!r}: config.json \"architectures\" "
                                f"must name one class, it names {archs}")
        return model_class(archs[0], f"{path / 'config.json'} architectures"), config

    def describe(self) -> dict[str, Any]:
        if self.pretrained is not None:
            return {"library": "transformers", "pretrained": self.pretrained}
        return {"library": "transformers", "architecture": self.architecture, **self.config}


def model_class(name: str, what: str) -> type:
    """transformers' causal LM class ``name`` (:class:`InvalidConfig` naming ``what`` when it is not one)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if name not in causal:
        near = sorted(c for c in causal if c.lower().startswith(name[:4].lower()))[:6]
        raise InvalidConfig(f"{what} {name!r} is not a causal LM class of transformers {transformers.__version__}"
                            + (f" (did you mean one of {', '.join(near)}?)" if near else ""))
    cls = getattr(transformers, name, None)
    if cls is None:
        raise InvalidConfig(f"{what} {name!r}: transformers {transformers.__version__} cannot import it")
    return cls


@dataclass(frozen=True)
class _BuildModel:
    """The model as the Trainer gets it, on meta (picklable: may run in a subprocess)."""

    model: TransformersModel
    dtype: str

    def __call__(self, stage: int, parallel: ParallelConfig) -> Any:
        import torch

        cls, config = self.model.load()
        try:
            return cls._from_config(config, dtype=getattr(torch, self.dtype))
        except Exception as exc:  # the config passed validation, but the model cannot be built from it
            raise InvalidConfig(f"transformers cannot build {cls.__name__} from the job's config: "
                                f"{type(exc).__name__}: {exc}") from None


@layout_provider(TransformersModel, check=lambda model, parallel: check_parallel(parallel))
def transformers_layout(model: TransformersModel, parallel: ParallelConfig, placement: Placement,
                        dataset: DatasetState | None, precision: str) -> PTC:
    """The ``transformers`` layout provider: the PTC of ``model`` trained by :class:`TenplexTrainer` in
    ``parallel`` (parameters and AdamW state; ``precision``: the dtype of the model the Trainer trains)."""
    from tenplex.ptc.torch_layout import derive_ptc_from_stages

    check_parallel(parallel)
    if dataset is None:
        raise InvalidConfig("a TenplexTrainer job needs the job's \"dataset\" (num_samples, seed, global_batch_size): "
                            "the elastic sample order the Trainer's sampler follows")
    if precision not in DTYPES:
        raise InvalidConfig(f"precision must be one of {', '.join(DTYPES)}, got {precision!r}")
    return derive_ptc_from_stages(
        _BuildModel(model, DTYPES[precision]),
        parallel,
        placement,
        optimizer="adamw",
        dataset=dataset,
        model=model.describe(),
    )
