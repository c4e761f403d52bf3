"""The node store's files: where everything lives under a root, and the small file operations on them.

The floor below both :class:`~tenplex.store.local.LocalStore` (shard I/O,
versions, commits) and :class:`~tenplex.store.memory.MemoryTier` (budget,
placement, eviction, spill): a disk root and a memory root have the same
layout, so one :class:`Root` names the paths of either. Every bookkeeping
entry starts with a dot, which no job name may::

    <root>/<job>/<version>/zarr.json                 zarr group of one version
    <root>/<job>/<version>/<tensor>/zarr.json        zarr group per tensor ('/' encoded as %2F)
    <root>/<job>/<version>/<tensor>/r0-96_0-64/      zarr array per shard, attributes["tenplex"]
    <root>/<job>/<version>/<tensor>/r0-96_0-64/c.0.0 its chunk files (key separator '.')
    <root>/<job>/.commits/<version>.json             commit marker = the manifest at commit time
    <root>/<job>/.lock                               flock for structural changes (disk root only, for both)
    <root>/.staging/<job>/                           shards being written, versions being deleted
    memory root only:
    <root>/<job>/.claims/<version>.json              bytes reserved and claimed by a version's writers (the daemon's)
    <root>/<job>/.evicting/<version>.json            an evicted version's marker, until its files go
    <root>/.budget.lock                              flock for placements, claims and evictions
    <root>/.buffers/<job>/<writer>/                  snapshot buffers of a writer (its .lock held while it lives)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenplex.core.files import atomic_write, fsync_path, syncfs
from tenplex.core.version import Version
from tenplex.errors import InvalidInput, NotFound
from tenplex.store.names import check_job

log = logging.getLogger(__name__)

ATTR = "tenplex"  # key of our record in each zarr node's attributes
CHUNK_CRCS = "tenplex_chunk_crc32c"  # attribute: each chunk file's crc32c, chunk-grid order (cheap whole-file checks)
COMMITS = ".commits"
STAGING = ".staging"
LOCK = ".lock"
CLAIMS = ".claims"
EVICTING = ".evicting"
BUDGET_LOCK = ".budget.lock"
BUFFERS = ".buffers"


@dataclass(frozen=True, slots=True)
class Root:
    """The paths of one store root (the disk root or the memory root: the same layout)."""

    path: Path

    def job(self, job: str) -> Path:
        return self.path / check_job(job)

    def version(self, job: str, version: Version) -> Path:
        return self.job(job) / str(version)

    def commits(self, job: str) -> Path:
        return self.job(job) / COMMITS

    def marker(self, job: str, version: Version) -> Path:
        """The commit marker: on disk, committed and durable; in memory, committed (durable once spilled)."""
        return self.commits(job) / f"{version}.json"

    def claim(self, job: str, version: Version) -> Path:
        return self.job(job) / CLAIMS / f"{version}.json"

    def evictions(self, job: str) -> Path:
        return self.job(job) / EVICTING

    def evicting(self, job: str, version: Version) -> Path:
        return self.evictions(job) / f"{version}.json"

    def staging(self, job: str) -> Path:
        """Where shards are written before they are renamed into place (same file system, not inside the job)."""
        return self.path / STAGING / check_job(job)

    def set_aside(self, job: str, path: Path, prefix: str) -> Path:
        """Rename ``path`` (a version's or a shard's directory) into the job's staging as ``<prefix>-<random>``,
        where nothing reads it, and return that: the caller removes it once it has let the job's lock go
        (:func:`clean_staging` removes what a crash left of it)."""
        moved = self.staging(job) / f"{prefix}-{uuid.uuid4().hex}"
        moved.parent.mkdir(parents=True, exist_ok=True)
        os.rename(path, moved)
        return moved

    def jobs(self) -> list[str]:
        """The job directories under the root, sorted (names that are not valid job names are skipped)."""
        try:
            entries = sorted(os.listdir(self.path))
        except FileNotFoundError:
            return []
        out = []
        for entry in entries:
            if entry.startswith(".") or not (self.path / entry).is_dir():
                continue
            try:
                out.append(check_job(entry))
            except InvalidInput:
                log.warning("ignoring %s: not a job directory of this store", self.path / entry)
        return out

    def versions(self, job: str) -> set[Version]:
        """The version directories of a job under the root, committed or not (other entries are skipped)."""
        jdir = self.job(job)
        try:
            entries = os.listdir(jdir)
        except FileNotFoundError:
            return set()
        found = set()
        for entry in entries:
            if entry.startswith(".") or not (jdir / entry).is_dir():
                continue
            try:
                found.add(Version.parse(entry))
            except InvalidInput:
                log.warning("ignoring %s: not a version directory", jdir / entry)
        return found

    @contextlib.contextmanager
    def locked(self, job: str, *, create: bool | Callable[[], bool]) -> Iterator[None]:
        """The job's lock file in this root, held (exclusive ``flock``) for the block; :class:`NotFound` when
        the job's directory is not there and ``create`` is false (a callable: asked only then)."""
        job_dir = self.job(job)
        try:  # the common case first: the job's directory is there (one system call, not three)
            fd = os.open(job_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            if not (create() if callable(create) else create):
                raise NotFound(f"job {job!r} is not in this store") from None
            job_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(job_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock


@contextlib.contextmanager
def flocked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created), held for the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any, *, durable: bool) -> None:
    # json.dumps, not json.dump into the file: that would run the pure-Python encoder
    atomic_write(path, json.dumps(obj, separators=(",", ":")), durable=durable)


def version_markers(directory: Path) -> Iterator[tuple[Version, Path]]:
    """(version, path) of the ``<version>.json`` markers in ``directory`` (none when it does not exist); other
    names (temporary files, anything hidden) are skipped."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(".") or not name.endswith(".json"):
            continue
        try:
            yield Version.parse(name[:-5]), directory / name
        except InvalidInput:
            continue


def read_meta(node_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A zarr node's metadata document and our record in it (zarr v3 spec: ``attributes`` of zarr.json)."""
    meta = json.loads(read_small(node_dir / "zarr.json"))
    rec = meta.get("attributes", {}).get(ATTR)
    if not isinstance(rec, dict):
        raise InvalidInput(f"{node_dir} is not a shard written by the tenplex store (no '{ATTR}' attribute)")
    return meta, rec


def write_group(node_dir: Path, attributes: dict[str, Any]) -> None:
    """A zarr v3 group node (``zarr.json``), written directly: zarr's own path costs milliseconds per group.

    Written in place, not through a temporary file and a rename: the caller holds the job's lock (no other
    writer), the group is in an uncommitted version (not served; a torn one after a crash is redone with
    the version) and the commit's ``syncfs`` makes it durable. A transform creates one per tensor.
    """
    node_dir.mkdir(parents=True, exist_ok=True)
    doc = {"zarr_format": 3, "node_type": "group", "attributes": {ATTR: attributes}}
    write_small(node_dir / "zarr.json", json.dumps(doc, separators=(",", ":")).encode())


def read_small(path: Path) -> bytes:
    """A small file's bytes, without a Python file object (a metadata document per shard on every scan)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        parts = [os.read(fd, 1 << 16)]
        while parts[-1]:
            parts.append(os.read(fd, 1 << 16))
    finally:
        os.close(fd)
    return b"".join(parts)


def write_small(path: Path, data: bytes) -> None:
    """A new small file with ``data``, without a Python file object (whose set-up costs four system calls)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def group_written(node_dir: Path) -> bool:
    """Whether a group's ``zarr.json`` is there and not empty (a writer killed between creating and writing
    it, see :func:`write_group`, leaves it empty; one ``write`` of a small document is never half done
    by a process that dies)."""
    try:
        return os.stat(node_dir / "zarr.json").st_size > 0
    except FileNotFoundError:
        return False


def newest_mtime(path: Path) -> float:
    """Latest modification time of anything under ``path`` (a partial shard being written keeps changing)."""
    newest = 0.0
    for dirpath, _dirs, files in os.walk(path):
        for name in (dirpath, *(os.path.join(dirpath, f) for f in files)):
            with contextlib.suppress(FileNotFoundError):
                newest = max(newest, os.stat(name).st_mtime)
    return newest


def clean_staging(staging: Path, stale_s: float) -> None:
    """Remove deleted versions, replaced shards and abandoned partial shards, spills and moves left by crashes."""
    if not staging.is_dir():
        return
    now = time.time()
    for entry in os.listdir(staging):
        path = staging / entry
        if entry.startswith(("deleted-", "replaced-")):
            shutil.rmtree(path, ignore_errors=True)
        elif entry.startswith(("shard-", "spill-", "demote-")) and now - newest_mtime(path) > stale_s:
            log.info("removing %s: a partial write nothing has written to for %.0f s", path, now - newest_mtime(path))
            shutil.rmtree(path, ignore_errors=True)


def copy_tree(src: Path, dst: Path) -> None:
    """Recreate the directory tree ``src`` at ``dst`` with copies of its files (a shard moving between tiers)."""
    if not src.is_dir():
        raise FileNotFoundError(src)
    for dirpath, _dirs, files in os.walk(src):
        out = dst / os.path.relpath(dirpath, src)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            shutil.copyfile(os.path.join(dirpath, name), out / name)


def link_tree(src: Path, dst: Path) -> None:
    """Recreate the directory tree ``src`` at ``dst`` with hard links to its files (copies where links fail)."""
    for dirpath, _dirs, files in os.walk(src):
        out = dst / os.path.relpath(dirpath, src)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            try:
                os.link(os.path.join(dirpath, name), out / name)
            except FileNotFoundError:
                raise
            except OSError:  # a file system without hard links, or the link limit: copy this one
                shutil.copyfile(os.path.join(dirpath, name), out / name)
    if not dst.is_dir():  # os.walk yields nothing for a source that is gone
        raise FileNotFoundError(src)


def sync_tree(path: Path) -> None:
    """Make every file and directory entry under ``path`` durable before the commit marker is written: one
    :func:`~tenplex.core.files.syncfs` of the store's file system; where that is not possible, fsync each one."""
    with contextlib.suppress(OSError):
        if syncfs(path):
            return
    _fsync_tree(path)


def _fsync_tree(path: Path) -> None:
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath), directory=True)
