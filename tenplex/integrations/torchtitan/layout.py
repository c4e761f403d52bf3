"""Layout provider ``torchtitan``: the PTC of a torchtitan job, derived from the job's own config function.

Job layout: ``{"provider": "torchtitan", "model": {"module": "<pkg>", "config": "<fn>"}}``, the same
``--module`` and ``--config`` the job's command gives ``python -m torchtitan.train``. For a configuration
``(dp, tp, pp)`` the provider calls the config function (torchtitan's own lookup: ``<pkg>.config_registry``
or ``<pkg>``; :func:`~tenplex.integrations.torchtitan.integration.elastic` changes nothing while it does),
sets the degrees as :func:`~tenplex.integrations.torchtitan.integration.elastic` does in the workers, and
builds each pipeline stage exactly as ``Trainer.__init__`` does, on the meta device under a fake process
group: ``ParallelDims`` and its mesh, ``update_from_config``, the model spec's ``parallelize_fn`` or
``pipelining_fn``. The DTensors it gives are read into the PTC (parameters and AdamW state by
``named_parameters()``, :func:`tenplex.ptc.torch_layout.derive_ptc_from_stages`).

This module imports torchtitan only inside the functions: the scheduler loads it by entry point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tenplex.errors import InvalidConfig
from tenplex.ptc import PTC, DatasetState, ParallelConfig, Placement
from tenplex.ptc.provider import layout_provider

MESH_ROLES = {"pp": "pp", "dp_replicate": "dp_replicate", "fsdp": "dp_shard", "dp_shard": "dp_shard", "tp": "tp",
              "cp": "cp"}
"""torchtitan 0.3.0's meshes: ``partial_dtensor`` builds ``pp, dp_replicate, fsdp, tp`` (``fsdp`` is
dp_shard x cp), ``full_dtensor`` names the shard dimension ``dp_shard``."""

OPTIMIZERS = {"AdamW": "adamw", "Adam": "adam"}
"""torchtitan optimizer names whose state the PTC describes (exp_avg, exp_avg_sq, step)."""


@dataclass(frozen=True)
class TorchtitanJob:
    """Which config function the job runs: ``python -m torchtitan.train --module <module> --config <config>``.

    Made when the job is created: the config function is called then and a config Tenplex cannot run
    (:func:`~tenplex.integrations.torchtitan.integration.check_config`) refuses the job with the reason.
    """

    module: str
    config: str

    def __post_init__(self) -> None:
        from tenplex.integrations.torchtitan.integration import check_config

        for name in ("module", "config"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise InvalidConfig(f"layout model {name} must be a non-empty string, got {value!r}")
        check_config(self.load())

    def load(self) -> Any:
        """The ``Trainer.Config`` the config function returns (nothing registers: see the module docstring)."""
        from torchtitan.config import ConfigManager

        from tenplex.integrations.torchtitan.integration import deriving

        with deriving():
            try:
                config, _ = ConfigManager()._load_config(["--module", self.module, "--config", self.config])
            except (ImportError, ValueError) as exc:
                raise InvalidConfig(f"torchtitan config {self.module}:{self.config}: {exc}") from None
        if getattr(config, "model_spec", None) is None:
            raise InvalidConfig(f"torchtitan config {self.module}:{self.config} has no model_spec")
        return config

    def to_json(self) -> dict[str, str]:
        return {"module": self.module, "config": self.config}


@dataclass(frozen=True)
class _BuildStage:
    """One pipeline stage, built and parallelized as torchtitan's Trainer does (picklable: runs in a subprocess
    when this process has a process group of its own)."""

    job: TorchtitanJob
    global_batch_size: int

    def __call__(self, stage: int, parallel: ParallelConfig) -> Any:
        import torch
        from torchtitan.config import TORCH_DTYPE_MAP
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.tools import utils

        from tenplex.integrations.torchtitan import cpu
        from tenplex.integrations.torchtitan.integration import apply_parallel

        cpu.apply()
        config = self.job.load()
        apply_parallel(config, parallel, self.global_batch_size)
        spec = config.model_spec
        dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
        parallel_dims = ParallelDims.from_config(config.parallelism, parallel.world_size)
        parallel_dims.build_mesh()
        model_config = spec.model
        model_config.update_from_config(config=config)
        with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
            model = model_config.build()
        common = {
            "parallel_dims": parallel_dims,
            "training": config.training,
            "parallelism": config.parallelism,
            "compile_config": config.compile,
            "ac_config": config.activation_checkpoint,
            "dump_folder": config.dump_folder,
        }
        if parallel.pp > 1:
            if not spec.pipelining_fn:
                raise InvalidConfig(f"torchtitan model {spec.name} has no pipelining function; pp must be 1")
            loss_fn = config.loss.build(compile_config=config.compile)
            _, parts, _, _ = spec.pipelining_fn(model, device=torch.device("meta"), model_config=model_config,
                                                parallelize_fn=spec.parallelize_fn, loss_fn=loss_fn, **common)
            if len(parts) != 1:
                raise InvalidConfig(f"stage {stage} has {len(parts)} model parts; Tenplex stores one per rank")
            return parts[0]
        return spec.parallelize_fn(model, **common)


@layout_provider(TorchtitanJob)
def torchtitan_layout(job: TorchtitanJob, parallel: ParallelConfig, placement: Placement,
                      dataset: DatasetState | None, precision: str) -> PTC:
    """The ``torchtitan`` layout provider: the PTC of ``job`` in configuration ``parallel`` (the tensors' dtypes
    are the config's own; ``precision`` is not used); :class:`InvalidConfig` for one it cannot run."""
    from tenplex.integrations.torchtitan.integration import check_config
    from tenplex.ptc.torch_layout import derive_ptc_from_stages

    config = job.load()  # errors in the config before the fake process group
    check_config(config)  # (the job was checked when it was made; the config function may have changed since)
    if dataset is None:
        raise InvalidConfig("a torchtitan job needs the job's \"dataset\" (num_samples, seed, global_batch_size)")
    names = {pg.optimizer_name for pg in config.optimizer.param_groups}
    if len(names) != 1 or not names <= set(OPTIMIZERS):
        raise InvalidConfig(f"the optimizer's parameter groups use {', '.join(sorted(names)) or 'no optimizer'}; "
                            f"Tenplex describes the state of one of {', '.join(OPTIMIZERS)} over the whole model")
    opt_name = names.pop()
    return derive_ptc_from_stages(
        _BuildStage(job, dataset.global_batch_size),
        parallel,
        placement,
        optimizer=OPTIMIZERS[opt_name],
        dataset=dataset,
        model={"library": "torchtitan", **job.to_json(), "name": config.model_spec.name,
               "flavor": config.model_spec.flavor},
        mesh_roles=MESH_ROLES,
    )
