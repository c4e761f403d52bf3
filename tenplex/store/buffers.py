"""Chunk shapes, payload pieces and zero-copy views of caller buffers.

Shared by the local store, the server and the client: all three move a
region's bytes in C order and, for large regions, in consecutive pieces
("slabs") whose bytes are contiguous in the payload, so that a bounded buffer
can carry any region and a piece maps to a contiguous slice of the caller's
buffer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import crc32c
import numpy as np

from tenplex.core.buffers import byte_view
from tenplex.errors import InvalidInput
from tenplex.ptc.dtypes import check_dtype, itemsize, storage_dtype
from tenplex.ptc.region import Region

if TYPE_CHECKING:
    import torch

DEFAULT_CHUNK_BYTES = 4 << 20


def chunk_shape(shape: Sequence[int], item: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[int, ...]:
    """A chunk of about ``chunk_bytes`` that suits both row and column slices.

    Trailing dimensions are taken whole while they fit (the common case: a
    band of whole rows, e.g. 64 x 16384 float32 for a 4 MiB chunk): a chunk
    file is then one contiguous run of the array's C-order bytes, so a row
    slice (tensor parallelism of row-parallel layers, pipeline splits of
    stacked layers) is whole chunk files or bands of them, served straight
    from the page cache without a copy. Column slices (column-parallel
    layers) lose nothing by it: in a C-order chunk file a column slice is read
    as row segments of ``min(slice width, chunk width)`` elements, so wider
    chunks never shorten those segments, and only the rows the slice touches
    are read. When a single row is larger than ``chunk_bytes`` the chunk is
    near-square in the last two dimensions instead, and leading dimensions get
    whatever budget the last two leave.

    Where the array is cut along a dimension, the chunks share it evenly
    (:func:`_cut`): zarr stores an edge chunk at full size, so 1344 rows in
    chunks of the 1170 that fit would take 2340 rows of disk, and every
    transform and snapshot would write and read the padding. Even chunks are
    also whole 4 KiB pages where that wastes almost nothing (e.g. 1024 rows
    of 896 float32 for 8192 rows): chunk files are then written with
    ``O_DIRECT`` straight from the caller's (page-aligned) buffer, with no
    padding and no truncation afterwards.
    """
    n = len(shape)
    if n == 0:
        return ()
    if chunk_bytes < item:
        raise InvalidInput(f"chunk size {chunk_bytes} bytes is smaller than one element ({item} bytes)")
    budget = chunk_bytes // item
    dims = [max(int(s), 1) for s in shape]
    if n == 1:
        return (dims[0] if dims[0] <= budget else _cut(dims[0], budget, item),)
    chunks = [1] * n
    if dims[-1] <= budget:  # whole rows fit: take trailing dimensions whole while they do
        used = 1
        d = n - 1
        while d >= 0 and used * dims[d] <= budget:
            chunks[d] = dims[d]
            used *= dims[d]
            d -= 1
        if d >= 0:
            chunks[d] = _cut(dims[d], max(1, budget // used), used * item)
        return tuple(chunks)
    side = max(1, math.isqrt(budget))
    c_last = _cut(dims[-1], side, _PAGE)
    c_rows = _cut(dims[-2], max(1, budget // c_last), c_last * item)
    if c_rows == dims[-2]:  # few rows: let the rows be wider
        c_last = _cut(dims[-1], max(1, budget // c_rows), c_rows * item)
    chunks[-1], chunks[-2] = c_last, c_rows
    used = c_last * c_rows
    for d in range(n - 3, -1, -1):
        c = _cut(dims[d], max(1, budget // used), _PAGE)
        chunks[d] = c
        used *= c
    return tuple(chunks)


_PAGE = 4096


def _cut(extent: int, fit: int, unit_bytes: int) -> int:
    """How many of ``extent`` indices a chunk takes, at most ``fit``, so that the chunks share the extent evenly.

    ``unit_bytes`` is the size of one index's slice of a chunk. The count is
    rounded up to whole pages when that keeps it within ``fit`` and pads the
    stored extent by at most 1/32 (trying up to 64 more chunks for such a
    count); otherwise the even count stands and the chunk files are not whole
    pages (they are written through the page cache).
    """
    if extent <= fit:
        return extent
    count = _ceil_div(extent, fit)
    step = _PAGE // math.gcd(unit_bytes, _PAGE)
    if step > fit:  # no whole-page count fits
        return _ceil_div(extent, count)
    for k in range(count, min(2 * count, count + 64) + 1):
        paged = _ceil_div(_ceil_div(extent, k), step) * step
        if paged <= fit and (_ceil_div(extent, paged) * paged - extent) * 32 <= extent:
            return paged
    return _ceil_div(extent, count)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def slabs(shape: Sequence[int], item: int, max_bytes: int, align: Sequence[int] | None = None) -> Iterator[Region]:
    """Cut a box (in its own coordinates) into consecutive C-order pieces of at most ``max_bytes``.

    Each piece's bytes are one contiguous run of the box's C-order bytes and
    the pieces come in payload order. Along the dimension being cut, piece
    boundaries are rounded to multiples of ``align`` (the zarr chunk shape)
    when that is possible, so that writes cover whole chunks.
    A piece is never larger than ``max_bytes`` unless a single element is.
    """
    shape = tuple(int(s) for s in shape)
    n = len(shape)
    if n == 0 or math.prod(shape) == 0:
        yield Region.full(shape)
        return
    max_bytes = max(max_bytes, item)

    def rec(prefix: list[tuple[int, int]], d: int) -> Iterator[Region]:
        rest = [(0, s) for s in shape[d + 1 :]]
        inner = item * math.prod(shape[d + 1 :])
        extent = shape[d]
        if inner * extent <= max_bytes:
            yield Region(tuple([*prefix, (0, extent), *rest]))
            return
        if inner <= max_bytes:
            step = max(1, max_bytes // inner)
            if align is not None and 0 < align[d] <= step:
                step -= step % align[d]
            for s in range(0, extent, step):
                yield Region(tuple([*prefix, (s, min(s + step, extent)), *rest]))
            return
        for i in range(extent):
            yield from rec([*prefix, (i, i + 1)], d + 1)

    yield from rec([], 0)


def payload_offset(shape: Sequence[int], item: int, piece: Region) -> int:
    """Byte offset of a slab (from :func:`slabs`) in the C-order payload of ``shape``."""
    offset = 0
    stride = item
    for (a, _b), s in zip(reversed(piece.bounds), reversed(tuple(shape)), strict=True):
        offset += a * stride
        stride *= s
    return offset


def crc_of(arr: np.ndarray, crc: int = 0) -> int:
    """crc32c of a contiguous array's bytes, continuing from ``crc``."""
    return crc32c.crc32c(byte_view(arr), crc) if arr.size else crc


_CRC32C_POLY = 0x82F63B78  # Castagnoli, bit-reflected


def _mult_mod_p(a: int, b: int) -> int:
    """a(x) * b(x) modulo the crc32c polynomial, both in the reflected bit order of the register."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1


def _x2n_table() -> tuple[int, ...]:
    """x^(2^k) modulo the polynomial, k = 0..31 (zlib's x2n_table)."""
    p = 1 << 30  # x^1
    table = [p]
    for _ in range(31):
        p = _mult_mod_p(p, p)
        table.append(p)
    return tuple(table)


_X2N = _x2n_table()


@functools.lru_cache(maxsize=4096)
def _shift_of(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: what advancing a crc register over ``nbytes`` bytes multiplies by.

    zlib 1.2.12's method: one product per set bit of the bit count (a few ~us products), so a store that
    combines the checksums of chunk files of many sizes pays microseconds per new size, not a 32x32 matrix
    squaring chain; the (one-int) results are cached per length.
    """
    p = 1 << 31  # x^0
    n, k = nbytes, 3  # 2^3 bits a byte
    while n:
        if n & 1:
            p = _mult_mod_p(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c of ``A + B`` from crc32c(A), crc32c(B) and len(B), without the bytes."""
    if len2 <= 0:
        return crc1
    return _mult_mod_p(_shift_of(len2), crc1) ^ crc2


RECEIVED_CRC_BLOCK = 256 << 10
"""Granularity of :class:`ReceivedCrcs` (a receive pass records its running crc32c every this many bytes)."""


class ReceivedCrcs:
    """The running crc32c of a buffer's bytes recorded every ``block`` bytes, as they were received.

    Why: a transform checksums every byte it receives (to verify the source's
    checksum) and the store then checksums the same bytes again to record each
    chunk file's crc32c. With the prefixes of the receive pass the store gets
    the crc32c of any part of the buffer from two prefixes (one product modulo
    the polynomial) plus the few bytes between a part's ends and the nearest
    block boundaries: one pass over the bytes instead of two. ``prefix[i]`` is
    the crc32c of ``buffer[: min((i + 1) * block, nbytes)]``; a part outside
    the buffer, or a buffer not fully recorded, gets None (the caller
    checksums the bytes itself).
    """

    __slots__ = ("base", "nbytes", "block", "prefix")

    def __init__(self, buffer: np.ndarray, block: int = RECEIVED_CRC_BLOCK) -> None:
        if not buffer.flags.c_contiguous:
            raise InvalidInput(f"buffer of shape {buffer.shape} is not C-contiguous")
        self.base = int(buffer.ctypes.data)
        self.nbytes = int(buffer.nbytes)
        self.block = block
        self.prefix: list[int] = []

    @property
    def complete(self) -> bool:
        return len(self.prefix) == _ceil_div(self.nbytes, self.block)

    def _at(self, offset: int) -> int:
        """crc32c of the first ``offset`` bytes; ``offset`` a block boundary or the end."""
        return 0 if offset == 0 else self.prefix[_ceil_div(offset, self.block) - 1]

    def crc_of(self, view: memoryview) -> int | None:
        """crc32c of ``view`` (flat bytes lying inside the recorded buffer), or None when it does not."""
        if not self.complete or not view.contiguous:
            return None
        addr = np.frombuffer(view, np.uint8).ctypes.data if view.nbytes else self.base
        start = addr - self.base
        stop = start + view.nbytes
        if start < 0 or stop > self.nbytes:
            return None
        lo = _ceil_div(start, self.block) * self.block
        hi = stop if stop == self.nbytes else stop // self.block * self.block
        if lo >= hi:
            return crc32c.crc32c(view) if view.nbytes else 0
        mid = self._at(hi)
        if lo:  # crc(buf[lo:hi]) = prefix(hi) - prefix(lo) advanced over hi - lo bytes
            mid ^= _mult_mod_p(_shift_of(hi - lo), self._at(lo))
        crc = crc32c_combine(crc32c.crc32c(view[: lo - start]), mid, hi - lo) if lo > start else mid
        return crc32c.crc32c(view[hi - start :], crc) if stop > hi else crc


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "untyped_storage")


def numpy_view(x: np.ndarray | torch.Tensor, dtype: str, *, what: str) -> np.ndarray:
    """A numpy view (storage dtype) of a CPU, C-contiguous numpy array or torch tensor, without copying.

    ``dtype`` is the PTC dtype name; the buffer's element size must match.
    bfloat16 tensors are viewed as uint16, their stored form.
    """
    st = storage_dtype(dtype)
    if _is_torch(x):
        import torch

        t: torch.Tensor = x  # type: ignore[assignment]
        if t.device.type != "cpu":
            raise InvalidInput(f"{what}: torch tensor on {t.device} must be on the CPU here")
        if not t.is_contiguous():
            raise InvalidInput(f"{what}: torch tensor of shape {tuple(t.shape)} is not contiguous")
        if t.element_size() != itemsize(dtype):
            raise InvalidInput(f"{what}: torch {t.dtype} has {t.element_size()}-byte elements, {dtype} needs {itemsize(dtype)}")
        t = t.detach()
        return t.numpy() if t.dtype == torch.bool else _torch_as_numpy(t, st)
    if not isinstance(x, np.ndarray):
        raise InvalidInput(f"{what} must be a numpy array or a torch tensor, got {type(x).__name__}")
    if not x.flags.c_contiguous:
        raise InvalidInput(f"{what}: numpy array of shape {x.shape} is not C-contiguous")
    if x.dtype.itemsize != st.itemsize:
        raise InvalidInput(f"{what}: numpy {x.dtype} has {x.dtype.itemsize}-byte elements, {dtype} needs {st.itemsize}")
    return x if x.dtype == st else x.view(st)


def _torch_as_numpy(t: torch.Tensor, st: np.dtype) -> np.ndarray:
    import torch

    unsigned = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}[t.element_size()]
    return t.view(unsigned).numpy().view(st)


@contextmanager
def host_buffer(out: np.ndarray | torch.Tensor, dtype: str, *, what: str) -> Iterator[np.ndarray]:
    """A host numpy view to fill for ``out``; for a GPU tensor a temporary host buffer copied in at the end."""
    if _is_torch(out) and out.device.type != "cpu":  # type: ignore[union-attr]
        import torch

        staging = torch.empty(tuple(out.shape), dtype=out.dtype, device="cpu", pin_memory=torch.cuda.is_available())
        yield numpy_view(staging, dtype, what=what)
        out.copy_(staging, non_blocking=False)  # type: ignore[union-attr]
        return
    yield numpy_view(out, dtype, what=what)


def host_data(data: np.ndarray | torch.Tensor, dtype: str, tensor: str, region: Region) -> np.ndarray:
    """A host numpy view of the data of shard ``region`` of ``tensor`` (its dtype and shape checked) to store; GPU
    tensors are copied to the host, non-contiguous ones made contiguous."""
    check_dtype(dtype)
    if not isinstance(region, Region):
        raise InvalidInput(f"region must be a Region, got {type(region).__name__}")
    what = f"data for tensor {tensor!r}"
    if _is_torch(data):
        t = data.detach()  # type: ignore[union-attr]
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        import torch

        if t.dtype != getattr(torch, dtype):
            raise InvalidInput(f"{what}: torch tensor is {t.dtype}, but dtype {dtype!r} was given")
        arr = numpy_view(t, dtype, what=what)
    elif not isinstance(data, np.ndarray):
        raise InvalidInput(f"{what} must be a numpy array or a torch tensor, got {type(data).__name__}")
    elif data.dtype != storage_dtype(dtype):
        st = storage_dtype(dtype)
        raise InvalidInput(f"{what}: numpy array is {data.dtype}, dtype {dtype!r} is stored as {st} (give a {st} array)")
    else:
        arr = data if data.flags.c_contiguous else np.ascontiguousarray(data)  # (a 0-d array stays 0-d)
    if arr.shape != region.shape:
        raise InvalidInput(f"data has shape {list(arr.shape)}, region {region.format()!r} has shape {list(region.shape)}")
    return arr
