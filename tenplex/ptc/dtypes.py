"""Element types a PTC may name, and how each is stored.

Names follow torch (``bfloat16``, ``float32``, ...). zarr and numpy have no
bfloat16, so it is stored bit-exactly as ``uint16`` and the real type travels
as metadata; :func:`storage_dtype` gives the numpy type used on disk and on the
wire. torch is imported only when a torch dtype is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tenplex.errors import InvalidInput

if TYPE_CHECKING:
    import torch

# name -> numpy dtype of the stored bytes (same itemsize as the real type)
_STORAGE: dict[str, str] = {
    "bfloat16": "uint16",
    "float16": "float16",
    "float32": "float32",
    "float64": "float64",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "uint8": "uint8",
    "bool": "bool",
}

DTYPES: frozenset[str] = frozenset(_STORAGE)

_ITEMSIZE: dict[str, int] = {name: np.dtype(st).itemsize for name, st in _STORAGE.items()}


def check_dtype(name: str) -> str:
    if name not in _STORAGE:
        raise InvalidInput(f"unknown dtype {name!r}; known: {', '.join(sorted(_STORAGE))}")
    return name


def itemsize(name: str) -> int:
    try:
        return _ITEMSIZE[name]
    except KeyError:
        check_dtype(name)
        raise


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype whose bytes equal the tensor's bytes (uint16 for bfloat16)."""
    return np.dtype(_STORAGE[check_dtype(name)])


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, check_dtype(name))


def name_of_torch(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return check_dtype(name)

