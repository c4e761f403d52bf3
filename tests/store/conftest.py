"""Fixtures: a real LocalStore on a tmp dir, and a real uvicorn store server on an ephemeral port."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenplex.node.store_routes import StoreServer
from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore

TOKEN = "s3cret-token"


def square_chunks(shape: tuple[int, ...], item: int, chunk_bytes: int = 4 << 20) -> tuple[int, ...]:
    """Near-square chunks in the last two dimensions: the layout of stores written before whole-row chunks."""
    budget = max(1, chunk_bytes // item)
    dims = [max(int(n), 1) for n in shape]
    if len(dims) < 2:
        return tuple(min(n, budget) for n in dims)
    side = max(1, math.isqrt(budget))
    last = min(dims[-1], side)
    rows = min(dims[-2], max(1, budget // last))
    return (*([1] * (len(dims) - 2)), rows, last)


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "root", chunk_bytes=4096)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreServer]:
    root = tmp_path_factory.mktemp("served")
    # small chunks, a small single-pass limit and every region inside one shard sent as chunk-file runs
    # (whatever their length), so that small test tensors exercise every read path
    srv = StoreServer(
        root, token=TOKEN, store=LocalStore(root, chunk_bytes=4096), single_pass_bytes=64 << 10, piece_bytes=16 << 10, min_run_bytes=1
    )
    with srv:
        yield srv


@pytest.fixture
def client(server: StoreServer) -> Iterator[StoreClient]:
    with StoreClient(server.url, TOKEN, retries=1, backoff=0.01) as c:
        yield c
