"""Host memory for the copies between a GPU and the node store: one page-locked arena, made once, reused.

A device-to-host copy into ordinary (pageable) memory is staged by the driver
through a bounce buffer and blocks the calling thread; into page-locked memory
it is one DMA at the bus's speed that a stream runs while the host goes on. So
the snapshot's copy-out and the restore's copy-in go through page-locked
memory. It is not taken from torch's pinned allocator (``pin_memory=True``):
that allocator rounds every block up to a power of two (a 20 GB state would
pin 32 GB) and keeps freed blocks cached. Instead :class:`HostArena` maps the
exact bytes once (page-aligned, as the store's ``O_DIRECT`` writes need) and
registers them with the CUDA driver (``cudaHostRegister``); slices of it serve
every tensor, snapshot after snapshot. Registering costs about as much as
pinning (page faults and page locking, once); the arena is unregistered when
closed or collected.

Without CUDA (or with ``pin=False``) the arena is the same page-aligned memory,
unregistered: the CPU path is the same code.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from tenplex.core.buffers import PAGE_BYTES, aligned_empty
from tenplex.errors import InvalidConfig, InvalidInput

log = logging.getLogger(__name__)


def _round_up(n: int) -> int:
    return -(-n // PAGE_BYTES) * PAGE_BYTES


def _register(ptr: int, nbytes: int) -> None:
    rc = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))  # 0: cudaHostRegisterDefault
    if rc != 0:
        raise InvalidConfig(f"cudaHostRegister of {nbytes} bytes of host memory failed with CUDA error {rc} "
                           "(the locked-memory limit, ulimit -l, or the host's free memory may be too small)")


def _unregister(ptr: int) -> None:
    rc = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if rc != 0:  # at interpreter exit the runtime may be gone already: nothing to release then
        log.debug("cudaHostUnregister failed with CUDA error %d", rc)


class HostArena:
    """Page-aligned host memory for tensors of the given byte sizes, one slice each, page-locked when ``pin``.

    ``slice(i, shape, dtype)`` is the i-th slice as a tensor (its bytes must fit the size given). The memory
    lives as long as the arena or any slice of it; the page lock ends at :meth:`close` (or collection).
    """

    def __init__(self, sizes: Sequence[int], *, pin: bool) -> None:
        self.sizes = tuple(int(n) for n in sizes)
        self.offsets: list[int] = []
        total = 0
        for n in self.sizes:
            self.offsets.append(total)
            total += _round_up(n)
        self.nbytes = total
        self._mem = torch.from_numpy(aligned_empty((max(total, 1),), np.uint8))
        self._finalizer: weakref.finalize | None = None
        self.pinned = False
        if pin and total:
            ptr = self._mem.data_ptr()
            _register(ptr, total)
            self.pinned = True
            self._finalizer = weakref.finalize(self, _unregister, ptr)

    def slice(self, index: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        if n > self.sizes[index]:
            raise InvalidInput(f"arena slice {index} holds {self.sizes[index]} bytes, not {n}")
        start = self.offsets[index]
        return self._mem[start:start + n].view(dtype).view(tuple(shape))

    def close(self) -> None:
        """End the page lock (the memory stays valid while slices of it are referenced). Idempotent."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.pinned = False
