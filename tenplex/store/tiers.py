"""The node store's memory tier: the newest versions in host memory, spilled to local disk in the background.

A :class:`~tenplex.store.local.LocalStore` may have a *memory root* beside its
disk root: a directory on a memory file system (tmpfs: ``/dev/shm/...`` or a
node tmpfs mount shared by the daemon's and the workers' containers) with the
same layout as the disk root, and a *budget* in bytes. The tier itself (budget,
placement, eviction, spill) is :class:`~tenplex.store.memory.MemoryTier`; this
module holds the parts it is made of: its settings (:class:`TierSettings`) and
how a disk root records them, the verified copy of a shard's files to disk,
and the snapshot buffers that let a worker's copy-out land in memory files that
become a version's shards without another copy (:class:`MemorySlots`).

Where a version lives and when::

    written    -> memory when it fits the budget (else disk, as without a tier)
    committed  -> its marker in the memory root: readable by peers at once, not durable
    spilled    -> copied to disk by the daemon's spiller, every chunk file checked against its
                  recorded crc32c on the way, synced, then the disk marker: durable (both copies)
    evicted    -> the memory marker moved aside when the budget needs room (oldest spilled first);
                  reads go to disk from then on; the memory files are removed after a grace period
                  (reads in flight finish on them)

The memory root itself is the only state of the tier: a daemon restarting on
the same node finds its versions there (and spills what was not spilled); a
reboot empties tmpfs, and versions that were never spilled are gone, not
listed. The disk root records the tier (``.memory-tier.json``, written by the
daemon, the tier's owner) with an id that the memory root carries too, so a
worker opening the disk root directly uses the same memory root and budget,
and a memory root that is not the daemon's (a reboot emptied it, a wrong
mount) is never used.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import crc32c
import numpy as np

from tenplex.core.buffers import PAGE_BYTES
from tenplex.core.files import atomic_write
from tenplex.errors import ChecksumMismatch, InvalidInput
from tenplex.store.base import SnapshotBuffers

log = logging.getLogger(__name__)

RECORD = ".memory-tier.json"
"""In the disk root: the memory tier its daemon keeps (root, budget, id)."""
TIER_ID = ".tier-id"
"""In the memory root: the id the disk root's record names."""
DEFAULT_EVICT_GRACE_S = 2.0
DEFAULT_SPILL_POLL_S = 0.2
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_MEMORY_FS = {"tmpfs", "ramfs", "shm"}
_COPY_PIECE = 8 << 20  # bytes of one chunk file checksummed and written at a time


@dataclass(frozen=True, slots=True)
class TierSettings:
    """The settings of a store's memory tier.

    ``root``: the memory root as this process sees it. ``budget``: bytes of
    versions kept there (shard payload bytes of committed versions and those
    being written; what the daemon serves peers from). ``evict_grace_s``: how
    long an evicted version's memory files stay for reads already in flight.
    ``tier_id``: names this tier in the disk root's record and the memory root.
    """

    root: Path
    budget: int
    evict_grace_s: float = DEFAULT_EVICT_GRACE_S
    tier_id: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
            raise InvalidInput(f"the memory tier's budget must be a positive number of bytes, got {self.budget!r}")
        if not self.evict_grace_s >= 0:
            raise InvalidInput(f"evict_grace_s must be >= 0, got {self.evict_grace_s!r}")

    def to_json(self) -> dict[str, Any]:
        return {"root": str(self.root), "budget": self.budget, "evict_grace_s": self.evict_grace_s, "id": self.tier_id}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TierSettings:
        try:
            return cls(Path(str(obj["root"])), int(obj["budget"]), float(obj.get("evict_grace_s", DEFAULT_EVICT_GRACE_S)),
                       str(obj.get("id", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"memory tier record {obj!r} is malformed: {exc}") from None


def recorded_tier(disk_root: Path) -> TierSettings | None:
    """The memory tier a disk root's daemon recorded, or None (no tier, or an unreadable record: logged)."""
    try:
        with open(disk_root / RECORD, encoding="utf-8") as f:
            return TierSettings.from_json(json.load(f))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, InvalidInput) as exc:
        log.warning("ignoring %s: %s", disk_root / RECORD, exc)
        return None


def take_ownership(disk_root: Path, tier: TierSettings | None) -> TierSettings | None:
    """Record ``tier`` as the disk root's memory tier (None: the root has none), as its daemon does at start.

    The memory root gets an id file (kept when it has one, so a restart keeps the
    tier's identity; new after a reboot emptied it) and the record names that id.
    Returns the tier with its id.
    """
    record = disk_root / RECORD
    if tier is None:
        record.unlink(missing_ok=True)
        return None
    tier.root.mkdir(parents=True, exist_ok=True)
    id_file = tier.root / TIER_ID
    try:
        tier_id = id_file.read_text().strip()
    except FileNotFoundError:
        tier_id = ""
    if not tier_id:
        tier_id = uuid.uuid4().hex
        atomic_write(id_file, tier_id)
    owned = TierSettings(tier.root, tier.budget, tier.evict_grace_s, tier_id)
    atomic_write(record, json.dumps(owned.to_json()))
    return owned


def matches(tier: TierSettings) -> bool:
    """Whether the memory root this process sees is the one the record describes (same id)."""
    try:
        return (tier.root / TIER_ID).read_text().strip() == tier.tier_id != ""
    except OSError:
        return False


def fs_type(path: Path) -> str | None:
    """The file system type of the mount holding ``path`` (Linux ``/proc/self/mountinfo``), or None."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    target = str(path.resolve())
    best, best_type = "", None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount = fields[4].replace("\\040", " ")
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, best_type = mount, right.split()[0]
    return best_type


def check_memory_fs(path: Path) -> None:
    """Warn when a memory root is not on a memory file system (it works, but is as slow as a disk)."""
    kind = fs_type(path)
    if kind is not None and kind not in _MEMORY_FS:
        log.warning("memory root %s is on %s, not on tmpfs: versions there cost disk writes and are still "
                    "not durable until spilled", path, kind)


# -- verified copies to disk ---------------------------------------------------------------


def copy_verified(src: Path, dst: Path, expect_crc: int | None, *, direct: bool) -> int:
    """Copy one file to ``dst`` (new), checking its crc32c against ``expect_crc`` on the way; its crc32c.

    The bytes are read from a map of the source (a memory-tier file: its pages
    are memory already, nothing is copied in user space), checksummed and
    written from the same map, so the crc32c checked is that of the very bytes
    written. With ``direct`` the whole pages go with ``O_DIRECT`` (no page
    cache pages for the disk copy: that memory is what the tier is for) and a
    tail shorter than a page is written through the page cache. A mismatch
    raises :class:`~tenplex.errors.ChecksumMismatch` (the memory copy is
    damaged: the version is not made durable from it).
    """
    fd_in = os.open(src, os.O_RDONLY)
    try:
        size = os.fstat(fd_in).st_size
        view: memoryview | None = None
        m = None
        if size:
            m = mmap.mmap(fd_in, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            view = memoryview(m)
        try:
            crc = _write_out(view, dst, size, direct=direct)
        finally:
            if view is not None:
                view.release()
            if m is not None:
                m.close()
    finally:
        os.close(fd_in)
    if expect_crc is not None and crc != expect_crc:
        raise ChecksumMismatch(f"{src} has crc32c {crc:08x}, recorded {expect_crc:08x}: the memory copy is damaged")
    return crc


def _write_out(view: memoryview | None, dst: Path, size: int, *, direct: bool) -> int:
    aligned = size - size % PAGE_BYTES if direct and _O_DIRECT else 0
    crc = 0
    if aligned:
        try:
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            aligned = 0
        else:
            try:
                assert view is not None
                for lo in range(0, aligned, _COPY_PIECE):
                    piece = view[lo : min(aligned, lo + _COPY_PIECE)]
                    crc = crc32c.crc32c(piece, crc)
                    _write_all(fd, piece)
            finally:
                os.close(fd)
    flags = os.O_WRONLY | (os.O_CREAT | os.O_TRUNC if not aligned else 0)
    fd = os.open(dst, flags, 0o644)
    try:
        if aligned:
            os.lseek(fd, aligned, os.SEEK_SET)
        for lo in range(aligned, size, _COPY_PIECE):
            assert view is not None
            piece = view[lo : min(size, lo + _COPY_PIECE)]
            crc = crc32c.crc32c(piece, crc)
            _write_all(fd, piece)
    finally:
        os.close(fd)
    return crc


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


# -- the spiller's priority ---------------------------------------------------------------------


def lower_priority(nice: int) -> None:
    """Make the calling thread yield the CPU to others (Linux: niceness is per thread)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:
        log.debug("could not lower the thread's priority: %s", exc)


# -- snapshot buffers in memory ---------------------------------------------------------------


class _Slot:
    """One memory file of a writer's snapshot buffers, mapped for the writer's whole life."""

    __slots__ = ("array", "fd", "idle", "map", "nbytes", "path")

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        self.nbytes = nbytes
        self.idle = 0  # snapshots it stayed free while another buffer of its shard was handed out
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(self.fd, nbytes)
            self.map = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            path.unlink(missing_ok=True)
            raise
        self.array = np.frombuffer(self.map, dtype=np.uint8)

    def free(self) -> bool:
        """Whether no version links the file any more (the writer may overwrite it)."""
        return os.fstat(self.fd).st_nlink == 1

    def prefault(self) -> None:
        """Allocate and map every page now (off the critical path), so that the copy-out takes no page faults."""
        populate_write = 23  # MADV_POPULATE_WRITE, Linux 5.14; not in Python 3.11's mmap module
        try:
            self.map.madvise(populate_write)
        except (OSError, ValueError):
            self.array[::PAGE_BYTES] = 0  # touch a byte of every page

    def close(self, *, unlink: bool) -> None:
        del self.array
        with contextlib.suppress(BufferError):  # a caller still holds a view: the map goes with the process
            self.map.close()
        os.close(self.fd)
        if unlink:
            self.path.unlink(missing_ok=True)


class AdoptSlot(Protocol):
    """What stores a filled snapshot buffer as a shard (:meth:`LocalStore.adopt_slot
    <tenplex.store.local.LocalStore.adopt_slot>`): the memory file ``path``, mapped as ``data``."""

    def __call__(self, job: str, version: Any, tensor: str, region: Any, dtype: str, global_shape: Any, path: Path,
                 data: np.ndarray, *, crc: int | None = None) -> Any: ...


class MemorySlots(SnapshotBuffers):
    """A writer's snapshot buffers as memory-tier files: the copy-out lands where the version's shards will be.

    What :meth:`LocalStore.snapshot_buffers` hands a snapshotting worker when the
    store has a memory tier (made by :meth:`MemoryTier.slots`; ``adopt`` is the
    store's ``adopt_slot``). :meth:`acquire` gives, per shard, a page-aligned
    buffer that is a file in the memory root mapped into this process for good
    (no page faults once it has been used, like the reused host buffers it
    replaces); :meth:`store` then puts that file into the version as the
    shard's one chunk file by a hard link: no copy, no new pages. A buffer is
    handed out again only when no version links its file any more (the version
    was deleted or evicted and its grace period passed); otherwise another
    one is made (and made ready in the background, :meth:`prepare`), so a
    stored version is never overwritten. Where the version does not go to
    memory (over the budget), :meth:`store` writes the buffer's bytes like any
    shard. A free buffer passed over by ``max_idle`` snapshots in a row is let
    go: the buffers that cycle through the versions the job keeps (however its
    retention deletes them) stay, and a surplus from a one-off burst goes; no
    new pages are allocated (and zeroed) in the steady state.

    Memory: the free buffers are this writer's staging memory (as its private
    host buffers were), outside the tier's budget; the ones linked into
    versions are counted there as the versions' bytes. ``close`` (or the
    writer's death: its directory's lock is released and the spiller removes
    it) removes the writer's names; versions keep their links.
    """

    def __init__(self, adopt: AdoptSlot, job: str, directory: Path, *, max_idle: int = 8) -> None:
        self._adopt = adopt
        self.job = job
        self.directory = directory
        self._max_idle = max_idle
        self._slots: dict[tuple[str, str, str], list[_Slot]] = {}
        self._lent: dict[tuple[str, str, str], _Slot] = {}
        self._lock = threading.Lock()
        directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # held while this writer lives (see MemoryTier.reap_dead_slots)
        self._closed = False

    @staticmethod
    def _key(tensor: str, region: Any, dtype: str) -> tuple[str, str, str]:
        return (tensor, region.format(), dtype)

    def acquire(self, tensor: str, region: Any, dtype: str, nbytes: int) -> np.ndarray:
        """A writable, page-aligned ``uint8`` buffer of ``nbytes`` for the shard ``region`` of ``tensor``.

        Valid until :meth:`store` of the same shard; acquiring it again before
        that hands out the same buffer.
        """
        key = self._key(tensor, region, dtype)
        with self._lock:
            if self._closed:
                raise InvalidInput("the snapshot buffers are closed")
            slot = self._lent.get(key)
            if slot is None or slot.nbytes != nbytes:
                slot = self._take(key, nbytes)
                self._lent[key] = slot
            return slot.array

    def _take(self, key: tuple[str, str, str], nbytes: int) -> _Slot:
        slots = self._slots.setdefault(key, [])
        free = [s for s in slots if s.nbytes == nbytes and s.free()]
        for passed in free[1:]:
            passed.idle += 1
            if passed.idle > self._max_idle:  # not needed for that long: a surplus
                slots.remove(passed)
                passed.close(unlink=True)
        if free:
            free[0].idle = 0
            return free[0]
        for stale in [s for s in slots if s.nbytes != nbytes]:  # the shard changed size: drop the old files
            slots.remove(stale)
            stale.close(unlink=True)
        slot = _Slot(self.directory / f"{uuid.uuid4().hex}", nbytes)
        slots.append(slot)
        return slot

    def store(self, version: Any, tensor: str, region: Any, dtype: str, global_shape: Any, *, crc: int | None = None) -> Any:
        """Put the shard's acquired buffer into ``version`` (uncommitted) of this writer's job; its ShardInfo."""
        key = self._key(tensor, region, dtype)
        with self._lock:
            slot = self._lent.pop(key, None)
        if slot is None:
            raise InvalidInput(f"no buffer was acquired for {tensor!r} {region.format()}")
        return self._adopt(self.job, version, tensor, region, dtype, global_shape, slot.path, slot.array, crc=crc)

    def prepare(self) -> int:
        """Make sure every shard has a free buffer for the next snapshot, making and faulting in new ones
        now (in the caller's background thread) where none is free; how many were made."""
        made = 0
        with self._lock:
            wanted = [(key, slots[0].nbytes) for key, slots in self._slots.items() if slots]
        for key, nbytes in wanted:
            with self._lock:
                if self._closed:
                    return made
                slots = self._slots.get(key, [])
                if any(s.nbytes == nbytes and s.free() for s in slots):
                    continue
                slot = _Slot(self.directory / f"{uuid.uuid4().hex}", nbytes)
                slots.append(slot)
            slot.prefault()
            made += 1
        return made

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            slots = [s for group in self._slots.values() for s in group]
            self._slots.clear()
            self._lent.clear()
        for s in slots:
            s.close(unlink=True)
        with contextlib.suppress(OSError):
            (self.directory / ".lock").unlink()
            self.directory.rmdir()
        os.close(self._lock_fd)


def slot_owner_dead(directory: Path) -> bool:
    """Whether the writer that owns a snapshot-buffer directory is gone (its lock can be taken)."""
    try:
        fd = os.open(directory / ".lock", os.O_RDWR)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)

