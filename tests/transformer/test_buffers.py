"""The executor's destination buffers: page-aligned, recycled across shard shapes of one size class, resident."""

from __future__ import annotations

import ctypes
import resource

import numpy as np
import pytest

from tenplex.errors import InvalidInput
from tenplex.node.transforms import TransformSettings
from tenplex.transformer.execute import BufferPool


def test_a_stored_shard_buffer_serves_the_next_shard_of_its_size_class_in_any_shape() -> None:
    pool = BufferPool(1 << 30)
    a = pool.get((1000, 896), np.dtype(np.float32))  # 3.4 MiB: the 4 MiB class
    assert a.shape == (1000, 896) and a.flags.c_contiguous and a.ctypes.data % 4096 == 0
    a[...] = 1.5
    pool.put(a)
    b = pool.get((2000, 900), np.dtype(np.uint16))  # 3.4 MiB of bfloat16 storage: same class, same memory
    assert b.ctypes.data == a.ctypes.data and b.shape == (2000, 900) and b.dtype == np.uint16
    c = pool.get((1000, 896), np.dtype(np.float32))  # b is in use: a new buffer
    assert c.ctypes.data != b.ctypes.data and c.ctypes.data % 4096 == 0
    d = pool.get((100,), np.dtype(np.float64))  # small: its own (power-of-two) class
    pool.put(d)
    assert pool.get((3000, 896), np.dtype(np.float32)).ctypes.data != d.ctypes.data


def test_the_pool_keeps_at_most_its_limit_and_ignores_empty_shards() -> None:
    pool = BufferPool(4 << 20)
    bufs = [pool.get((1 << 20,), np.dtype(np.float32)) for _ in range(2)]  # two 4 MiB buffers
    for buf in bufs:
        pool.put(buf)
    kept = {pool.get((1 << 20,), np.dtype(np.float32)).ctypes.data for _ in range(2)}
    assert len(kept & {b.ctypes.data for b in bufs}) == 1  # one was kept, the other dropped
    empty = pool.get((0, 7), np.dtype(np.float32))
    assert empty.shape == (0, 7)
    pool.put(empty)  # a 0-size shard's array is not pooled (and does not fail)


def test_a_larger_free_buffer_serves_a_smaller_shard_instead_of_fresh_memory() -> None:
    pool = BufferPool(1 << 30)
    big = pool.get((2 << 20,), np.dtype(np.float32))  # 8 MiB
    pool.put(big)
    small = pool.get((3 << 20,), np.dtype(np.uint8))  # 3 MiB: the 4 MiB class, served by the 8 MiB buffer
    assert small.ctypes.data == big.ctypes.data and pool.fresh == 8 << 20
    pool.put(small)
    tiny = pool.get((1000,), np.dtype(np.uint8))  # far smaller than any free buffer: fresh (4 KiB class)
    assert tiny.ctypes.data != big.ctypes.data and pool.fresh == (8 << 20) + 4096


def test_a_shared_pool_lets_its_free_buffers_go_when_the_last_transform_holding_it_ends() -> None:
    pool = BufferPool(1 << 30, keep_s=0)
    with pool.hold():
        with pool.hold():  # two transforms at once
            pool.put(pool.get((1 << 20,), np.dtype(np.uint8)))
        assert pool.free_bytes == 1 << 20  # the other transform still runs: kept for it
    assert pool.free_bytes == 0


def _resident(address: int, nbytes: int) -> int:
    """Bytes of [address, address + nbytes) in memory now (mincore(2)): the pool's own view cannot tell."""
    pages = -(-nbytes // 4096)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * 4096


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def test_resident_buffers_are_faulted_in_once_and_reused_without_a_fault_across_transforms() -> None:
    pool = BufferPool(64 << 20, keep_s=0, resident=16 << 20)
    assert pool.resident_bytes == 16 << 20 and not pool.prefaulted.is_set()
    with pool.hold():
        arena = pool.get((1,), np.dtype(np.uint8)).ctypes.data  # the first buffer is cut at the mapping's start
    assert _resident(arena, 16 << 20) == 0
    pool.prefault()
    assert pool.prefaulted.is_set() and _resident(arena, 16 << 20) == 16 << 20
    for _ in range(2):  # two transforms: the carving starts over in between, the memory stays
        with pool.hold():
            a = pool.get((1000, 896), np.dtype(np.float32))  # 4 MiB class, from the resident bytes
            b = pool.get((3 << 20,), np.dtype(np.uint8))
            assert a.ctypes.data == arena and a.ctypes.data % 4096 == 0 and b.ctypes.data % 4096 == 0
            before = _minor_faults()
            a[...] = 1.5
            b[...] = 7
            assert _minor_faults() == before  # written without a page fault: no page was given back
            pool.put(a)
            assert pool.get((2000, 900), np.dtype(np.uint16)).ctypes.data == arena  # reused in another shape
        assert pool.fresh == 0 and _resident(arena, 16 << 20) == 16 << 20
    # beyond the resident bytes: fresh memory, kept within limit - resident
    with pool.hold():
        held = [pool.get((8 << 20,), np.dtype(np.uint8)) for _ in range(2)]  # 16 MiB: all resident
        extra = [pool.get((16 << 20,), np.dtype(np.uint8)) for _ in range(4)]
        assert pool.fresh == 64 << 20
        before = _minor_faults()
        extra[0][...] = 1
        assert _minor_faults() > before  # the counter does see the faults of fresh memory
        for buf in held + extra:
            pool.put(buf)
        assert pool.free_bytes == 48 << 20  # 16 MiB resident + 48 MiB fresh: the limit of 64 MiB
    assert pool.free_bytes == 0 and _resident(arena, 16 << 20) == 16 << 20  # the fresh ones go, the resident stay


def test_a_resident_buffer_put_back_after_the_carving_started_over_is_not_lent_twice() -> None:
    pool = BufferPool(64 << 20, resident=8 << 20)
    with pool.hold():
        lost = pool.get((4 << 20,), np.dtype(np.uint8))  # a failed transform's buffer, never put back in time
    with pool.hold():
        first = pool.get((4 << 20,), np.dtype(np.uint8))
        assert first.ctypes.data == lost.ctypes.data  # the same bytes, cut anew
        pool.put(lost)  # late: ignored, else the next shard would get the bytes `first` still uses
        second = pool.get((4 << 20,), np.dtype(np.uint8))
        assert second.ctypes.data != first.ctypes.data and pool.fresh == 0


def test_the_resident_bytes_are_bounded_by_the_transform_memory_setting() -> None:
    with pytest.raises(InvalidInput, match="resident_bytes"):
        TransformSettings(memory_bytes=1 << 20, resident_bytes=2 << 20)
    assert BufferPool(1 << 20, resident=(2 << 20) + 5).resident_bytes == 1 << 20
    with pytest.raises(InvalidInput):
        BufferPool(1 << 20, resident=-1)
