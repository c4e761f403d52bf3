"""The executor's destination buffers: page-aligned, recycled across shard shapes of one size class."""

from __future__ import annotations

import numpy as np

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
