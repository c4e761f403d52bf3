"""Fixtures: a real LocalStore on a tmp dir, and a real uvicorn store server on an ephemeral port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore
from tenplex.store.server import StoreServer

TOKEN = "s3cret-token"


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "root", chunk_bytes=4096)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreServer]:
    root = tmp_path_factory.mktemp("served")
    # small chunks and a small single-pass limit, so that small test tensors exercise every read path
    srv = StoreServer(root, token=TOKEN, store=LocalStore(root, chunk_bytes=4096), single_pass_bytes=64 << 10, piece_bytes=16 << 10)
    with srv:
        yield srv


@pytest.fixture
def client(server: StoreServer) -> Iterator[StoreClient]:
    with StoreClient(server.url, TOKEN, retries=1, backoff=0.01) as c:
        yield c
