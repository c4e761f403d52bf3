"""Fixtures shared by every test package: a memory-tier directory on tmpfs."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenplex.store.tiers import fs_type


@contextlib.contextmanager
def memory_dir(fallback: Path) -> Iterator[Path]:
    """A fresh directory for a store's memory tier: on ``/dev/shm`` (tmpfs, as deployed) where that is usable,
    else ``fallback`` (the tier works on any file system; it is only slower). Removed afterwards."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and fs_type(shm) == "tmpfs":
        path = shm / f"tenplex-test-{uuid.uuid4().hex[:12]}"
    else:
        path = fallback
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def memory_root(tmp_path: Path) -> Iterator[Path]:
    with memory_dir(tmp_path / "memory") as path:
        yield path


@pytest.fixture(scope="module")
def module_memory_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with memory_dir(tmp_path_factory.mktemp("memory") / "tier") as path:
        yield path
