"""tenplex.core.files.atomic_write: what every record, layout, key set and file:// object relies on."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from tenplex.core.files import atomic_write


def test_replaces_the_content_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "record.json"
    atomic_write(target, "old")
    atomic_write(target, '{"new": true}', durable=True)
    assert target.read_text() == '{"new": true}'
    assert os.listdir(tmp_path) == ["record.json"]


def test_writes_bytes_and_buffers(tmp_path: Path) -> None:
    arr = np.arange(6, dtype="<f4")
    atomic_write(tmp_path / "chunk", memoryview(arr).cast("B"))
    atomic_write(tmp_path / "raw", b"\x00\x01")
    assert np.array_equal(np.fromfile(tmp_path / "chunk", dtype="<f4"), arr)
    assert (tmp_path / "raw").read_bytes() == b"\x00\x01"


def test_a_failed_write_keeps_the_old_content_and_removes_its_temporary(tmp_path: Path) -> None:
    target = tmp_path / "record.json"
    atomic_write(target, "old")
    with pytest.raises(TypeError):
        atomic_write(target, object())  # not text, not a buffer: fails while writing
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["record.json"]


def test_mode_and_parents(tmp_path: Path) -> None:
    secret = tmp_path / "a" / "b" / "keys.json"
    atomic_write(secret, "{}", mode=0o600, make_parents=True)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "missing" / "x", "{}")
    assert not (tmp_path / "missing").exists()
