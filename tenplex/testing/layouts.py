"""A user's own layout provider, as the README shows it: the tests name it ``tenplex.testing.layouts:mlp_layout``.

An MLP of ``layers`` square weights, each split by rows over the tensor-parallel
ranks and replicated over the data-parallel ones; no optimizer state, one stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenplex.errors import InvalidConfig
from tenplex.ptc import PTC, DatasetState, Device, ParallelConfig, Placement, Region, build_tensor
from tenplex.ptc.provider import layout_provider

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class MLP:
    layers: int
    dim: int

    def __post_init__(self) -> None:
        if self.layers < 1 or self.dim < 1:
            raise InvalidConfig(f"an MLP needs layers >= 1 and dim >= 1, got {self.layers} and {self.dim}")


@layout_provider(MLP)
def mlp_layout(model: MLP, parallel: ParallelConfig, placement: Placement, dataset: DatasetState | None,
               precision: str) -> PTC:
    if parallel.pp != 1 or model.dim % parallel.tp:
        raise InvalidConfig(f"the MLP runs on one stage with tp dividing dim {model.dim}, got {parallel.describe()}")
    rows = model.dim // parallel.tp
    tensors = [
        build_tensor(f"layers.{i}.weight", (model.dim, model.dim), DTYPES[precision], "param", [
            (Region(((t * rows, (t + 1) * rows), (0, model.dim))), [parallel.rank(d, t, 0) for d in range(parallel.dp)])
            for t in range(parallel.tp)
        ])
        for i in range(model.layers)
    ]
    devices = tuple(Device(r, placement.host_of(r), parallel.coords(r)) for r in range(parallel.world_size))
    return PTC(config={"provider": "mlp", **parallel.to_json()}, devices=devices, tensors=tuple(tensors),
               dataset=dataset)
