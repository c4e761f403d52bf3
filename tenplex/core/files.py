"""Atomic file replacement: the one way Tenplex writes a file that another process may read at any moment.

Records, layouts, key sets, port files and the persistent tier's ``file://`` objects are all read by other
processes (daemons, workers, a restarted scheduler) while they may be rewritten. Each is written to a hidden
temporary name in its own directory and renamed over the target, so a reader sees the old content or the new,
never a part; a failed write leaves the target as it was and removes its temporary. ``durable`` adds the two
fsyncs (the file, then its directory) that make the new content survive a power loss, for the records a store
promises to keep; the rest skip them (their loss is recovered from elsewhere, and an fsync costs milliseconds).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import uuid
from pathlib import Path
from typing import Any


def fsync_path(path: str | Path, *, directory: bool = False) -> None:
    """fsync a file, or a directory (to make a rename or a new entry in it durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def syncfs(path: str | Path) -> bool:
    """Make everything written on the file system holding ``path`` durable with one ``syncfs(2)`` (Linux): it
    flushes that file system only, not every disk of the machine as ``sync(2)`` does, and a version of a few
    hundred shards would otherwise cost thousands of fsyncs. False where there is no ``syncfs`` (the caller
    syncs another way); :class:`OSError` when it fails."""
    call = getattr(_libc(), "syncfs", None) if sys.platform.startswith("linux") else None
    if call is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        if call(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs({path}): {os.strerror(err)}")
    finally:
        os.close(fd)
    return True


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def atomic_write(path: str | Path, data: str | bytes | Any, *, mode: int = 0o644, durable: bool = False,
                 make_parents: bool = False) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8; anything else through the buffer protocol).

    The file is created with ``mode`` (0600 for secrets), independent of the umask's default for temporaries.
    """
    path = Path(path)
    if make_parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    payload = data.encode() if isinstance(data, str) else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(path.parent, directory=True)
