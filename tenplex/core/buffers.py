"""Host memory for bulk bytes: page-aligned buffers and flat byte views of arrays.

Why here, below every other layer: the worker (snapshot copies), the
executor (destination buffers of a transform) and the store (chunk files
written with ``O_DIRECT``) all hand buffers to each other, and a buffer
whose data starts on a page boundary is what lets the store write a chunk
file straight from it. None of them should reach into the store's chunk-file
module for that.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Sequence
from typing import Any

import numpy as np

from tenplex.errors import InvalidInput

PAGE_BYTES = 4096
"""The alignment ``O_DIRECT`` needs of buffer addresses, file offsets and lengths (the logical block size)."""
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """An uninitialised C-order array whose data starts on a page boundary (anonymous memory of its own).

    Chunk files of whole pages are written with ``O_DIRECT`` straight from such
    a buffer (see :class:`~tenplex.store.rawchunks.RawChunkWriter`);
    ``numpy.empty`` memory is not page-aligned (malloc's header precedes it).
    """
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes == 0:
        return np.empty(shape, dt)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # private: shared anonymous memory gets no huge pages
    if _MADV_HUGEPAGE is not None and nbytes >= 2 << 20:  # as numpy does for its own large arrays: 512x fewer faults
        with contextlib.suppress(OSError):
            m.madvise(_MADV_HUGEPAGE)
    return np.frombuffer(m, dtype=dt).reshape(shape)


def byte_view(arr: np.ndarray) -> memoryview:
    """The C-order bytes of a contiguous array as a flat ``B`` memoryview (no copy)."""
    if not arr.flags.c_contiguous:
        raise InvalidInput(f"buffer of shape {arr.shape} is not C-contiguous")
    return memoryview(arr.reshape(-1).view(np.uint8))
