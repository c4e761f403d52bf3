"""The parallelizable tensor collection: Tenplex's data model (pure, no I/O at import)."""

from tenplex.ptc.dataset import DatasetState
from tenplex.ptc.model import FORMAT, PTC, Device, Owner, Shard, Tensor, TensorKind, build_tensor
from tenplex.ptc.parallel import ParallelConfig, Placement
from tenplex.ptc.region import Region, flat_range_boxes, subtract

__all__ = [
    "FORMAT",
    "PTC",
    "DatasetState",
    "Device",
    "Owner",
    "ParallelConfig",
    "Placement",
    "Region",
    "Shard",
    "Tensor",
    "TensorKind",
    "build_tensor",
    "flat_range_boxes",
    "subtract",
]
