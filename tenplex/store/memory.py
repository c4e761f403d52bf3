"""The memory tier of a node store: one object that owns its budget, placement, eviction, spill and buffers.

A :class:`MemoryTier` is a memory root beside a store's disk root (same
:mod:`~tenplex.store.layout`) and a budget (see :mod:`tenplex.store.tiers` for
how versions move between the tiers and how a disk root records its tier).
The :class:`~tenplex.store.local.LocalStore` asks it where a version goes
(:meth:`MemoryTier.place`), where an uncommitted one is
(:meth:`MemoryTier.working_dir`) and to record a commit in memory
(:meth:`MemoryTier.commit`); the tier never calls the store: it works on the
files of both roots, under the same locks, so the processes sharing a root
(the node daemon, workers writing snapshots directly) share one tier through
its files: claims, the budget lock, eviction records, the tier record and the
snapshot buffers' lock files. The node daemon is the tier's owner: it records
the tier in the disk root and runs its one :class:`Spiller`
(:meth:`MemoryTier.start_spilling`); a worker's store finds the tier through
that record (:meth:`MemoryTier.open`) and has the daemon place its versions
(a :class:`Placement` over the daemon's API, once per snapshot), so that only
the daemon takes the budget lock, writes claims, evicts and demotes; the claims
stay files, so a restarted daemon counts the room it reserved before.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from tenplex.core.files import fsync_path
from tenplex.core.units import human_bytes
from tenplex.core.version import Version
from tenplex.errors import ChecksumMismatch, Conflict, InvalidInput, StateLost
from tenplex.store.layout import (
    BUDGET_LOCK,
    BUFFERS,
    CHUNK_CRCS,
    Root,
    copy_tree,
    flocked,
    read_meta,
    sync_tree,
    version_markers,
    write_group,
    write_json_atomic,
)
from tenplex.store.model import Manifest, ShardInfo
from tenplex.store.names import check_job, check_version
from tenplex.store.rawchunks import ChunkLayout, direct_writes_work
from tenplex.store.reader import StoredShard, TensorReader, damage
from tenplex.store.tiers import (
    DEFAULT_EVICT_GRACE_S,
    DEFAULT_SPILL_POLL_S,
    AdoptSlot,
    MemorySlots,
    TierSettings,
    check_memory_fs,
    copy_verified,
    lower_priority,
    matches,
    recorded_tier,
    slot_owner_dead,
    take_ownership,
)

log = logging.getLogger(__name__)


class Placement(Protocol):
    """Who places a store's versions in the memory tier: the :class:`MemoryTier` itself (its owner, the node
    daemon, and stores of one process), or the daemon over its API
    (:meth:`StoreClient.place <tenplex.store.client.StoreClient.place>`) for a worker sharing its root."""

    def place(self, job: str, version: Version, nbytes: int) -> bool:
        """Room for ``nbytes`` more of an uncommitted version: True in memory (claimed), False on disk."""
        ...


class MemoryTier:
    """A store's memory tier: ``settings`` (root, budget, grace, id) over the memory root beside ``disk_root``.

    ``durable`` syncs spilled copies before their disk markers; ``direct_writes``
    writes them past the page cache (``None``: where the disk root allows it).
    Made by :meth:`open`, which reads or takes the disk root's record.
    """

    def __init__(self, settings: TierSettings, disk_root: Path, *, durable: bool = True,
                 direct_writes: bool | None = None) -> None:
        self.settings = settings
        self.disk = Root(Path(disk_root))
        self.mem = Root(settings.root)
        self.durable = durable
        self.direct_writes = direct_writes_work(self.disk.path) if direct_writes is None else direct_writes
        self._marker_sizes: dict[Path, tuple[int, int, int]] = {}
        self._lock = threading.Lock()
        self._slot_sets: list[MemorySlots] = []
        self._spiller: Spiller | None = None

    @classmethod
    def open(cls, disk_root: str | Path, memory_root: str | Path | None = None, memory_bytes: int | None = None,
             evict_grace_s: float | None = None, *, owner: bool = False, durable: bool = True,
             direct_writes: bool | None = None) -> MemoryTier | None:
        """The memory tier of the store at ``disk_root``, or None where it has none (or none this process may use).

        - ``owner`` (the node daemon): this tier (``memory_root`` and ``memory_bytes``), recorded in the disk
          root for the processes sharing it; without ``memory_root`` the record is removed (no tier).
        - ``memory_root`` with ``memory_bytes``: the root's recorded tier, else one of this process's own.
        - ``memory_root`` alone: the root's recorded tier at this path (a container that mounts it elsewhere);
          without a record the tier is not used (its daemon would neither serve nor spill what is written
          there), with a warning.
        - neither: the root's recorded tier, if any.
        """
        disk = Path(disk_root).resolve()
        if memory_bytes is not None and memory_root is None:
            raise InvalidInput("memory_bytes needs memory_root (the memory tier's directory)")
        grace_s = DEFAULT_EVICT_GRACE_S if evict_grace_s is None else evict_grace_s
        options = {"durable": durable, "direct_writes": direct_writes}
        if owner:
            disk.mkdir(parents=True, exist_ok=True)  # the daemon may open the tier before its store
            if memory_root is None:
                take_ownership(disk, None)
                return None
            if memory_bytes is None:
                raise InvalidInput("the owner of a memory tier needs memory_bytes, its budget")
            mroot = Path(memory_root)
            mroot.mkdir(parents=True, exist_ok=True)
            check_memory_fs(mroot)
            owned = take_ownership(disk, TierSettings(mroot.resolve(), memory_bytes, grace_s))
            assert owned is not None
            return cls(owned, disk, **options)
        recorded = recorded_tier(disk)
        if recorded is None:
            if memory_root is None:
                return None
            if memory_bytes is None:
                log.warning("%s records no memory tier (its daemon runs without one): writing to disk, not to %s",
                            disk, memory_root)
                return None
            mroot = Path(memory_root)
            mroot.mkdir(parents=True, exist_ok=True)
            return cls(TierSettings(mroot.resolve(), memory_bytes, grace_s), disk, **options)
        settings = TierSettings(
            Path(memory_root).resolve() if memory_root is not None else recorded.root,
            memory_bytes if memory_bytes is not None else recorded.budget,
            recorded.evict_grace_s if evict_grace_s is None else evict_grace_s,
            recorded.tier_id,
        )
        if not matches(settings):
            log.warning("%s is not the memory root that %s records (a reboot emptied it, or another mount): "
                        "writing to disk only", settings.root, disk)
            return None
        return cls(settings, disk, **options)

    @property
    def root(self) -> Path:
        return self.settings.root

    @property
    def budget(self) -> int:
        return self.settings.budget

    def __repr__(self) -> str:
        return f"MemoryTier({str(self.root)!r}, budget {human_bytes(self.budget)}, beside {str(self.disk.path)!r})"

    # -- the owner's spiller and the writers' buffers ---------------------------------------

    def start_spilling(self, *, poll_s: float = DEFAULT_SPILL_POLL_S, interval_s: float = 0.0) -> Spiller:
        """Start this process's spiller (the tier's owner runs the one spiller of the tier)."""
        with self._lock:
            if self._spiller is None:
                self._spiller = Spiller(self, poll_s=poll_s, interval_s=interval_s).start()
                log.info("memory tier %s, budget %s: new versions are written and served there and spilled to %s",
                         self.root, human_bytes(self.budget), self.disk.path)
            return self._spiller

    @property
    def spiller(self) -> Spiller | None:
        """This process's spiller, if it runs one (the tier's owner does)."""
        return self._spiller

    def slots(self, job: str, adopt: AdoptSlot) -> MemorySlots:
        """Snapshot buffers of one writer of ``job`` in the memory root (see
        :class:`~tenplex.store.tiers.MemorySlots`); ``adopt`` stores a filled buffer as a shard."""
        owner = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        slots = MemorySlots(adopt, check_job(job), self.root / BUFFERS / check_job(job) / owner)
        with self._lock:
            self._slot_sets.append(slots)
        return slots

    def close(self) -> None:
        """Stop the spiller and this process's snapshot buffers (the tier stays usable)."""
        with self._lock:
            spiller, self._spiller = self._spiller, None
            slot_sets, self._slot_sets = self._slot_sets, []
        if spiller is not None:
            spiller.stop()
        for slots in slot_sets:
            slots.close()

    # -- where a version is ----------------------------------------------------------------

    def holds_job(self, job: str) -> bool:
        return self.mem.job(job).is_dir()

    def jobs(self) -> list[str]:
        return self.mem.jobs()

    def committed(self, job: str, version: Version) -> bool:
        """Whether the version is committed in memory (and not evicted)."""
        return self.mem.marker(job, version).is_file()

    def working_dir(self, job: str, version: Version) -> Path | None:
        """The directory of an uncommitted version placed in memory, or None (on disk, or nowhere yet)."""
        mdir = self.mem.version(job, version)
        if mdir.is_dir() and not self.mem.evicting(job, version).exists():
            return mdir
        return None

    def _committed_anywhere(self, job: str, version: Version) -> bool:
        return self.disk.marker(job, version).is_file() or self.committed(job, version)

    def commit(self, job: str, version: Version, manifest: Manifest) -> None:
        """Record a memory version as committed (the store holds the job's lock): its marker, no fsync (not
        durable until spilled); its claim goes, the manifest counts now. Wakes this process's spiller."""
        marker = self.mem.marker(job, version)
        marker.parent.mkdir(exist_ok=True)
        write_json_atomic(marker, manifest.to_json(), durable=False)
        self.mem.claim(job, version).unlink(missing_ok=True)
        if self._spiller is not None:
            self._spiller.wake()

    # -- the budget ------------------------------------------------------------------------

    def _marker_nbytes(self, marker: Path) -> int | None:
        """A commit marker's byte count (markers are immutable: parsed once per file), None when it is absent."""
        try:
            st = os.stat(marker)
        except FileNotFoundError:
            return None
        cached = self._marker_sizes.get(marker)
        if cached is not None and cached[0] == st.st_ino and cached[1] == st.st_mtime_ns:
            return cached[2]
        try:
            with open(marker, encoding="utf-8") as f:
                nbytes = int(json.load(f)["nbytes"])
        except FileNotFoundError:
            return None
        if len(self._marker_sizes) > 4096:
            self._marker_sizes.clear()
        self._marker_sizes[marker] = (st.st_ino, st.st_mtime_ns, nbytes)
        return nbytes

    def _read_claim(self, job: str, version: Version) -> tuple[int, int] | None:
        """(bytes reserved, bytes claimed by its writers) of an uncommitted memory version, if recorded."""
        try:
            with open(self.mem.claim(job, version), encoding="utf-8") as f:
                obj = json.load(f)
            return int(obj["reserved"]), int(obj["used"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the damaged claim of %s of job %s: %s", version, job, exc)
            return None

    def _write_claim(self, job: str, version: Version, reserved: int, used: int) -> None:
        path = self.mem.claim(job, version)
        path.parent.mkdir(exist_ok=True)
        write_json_atomic(path, {"reserved": reserved, "used": used}, durable=False)

    def used(self) -> int:
        """Bytes of the tier's versions: committed ones (their manifests) and those being written (what their
        writers reserved or claimed, the larger). Evicted versions no longer count."""
        total = 0
        for job in self.jobs():
            try:
                names = os.listdir(self.mem.job(job))
            except FileNotFoundError:
                continue
            for name in names:
                if name.startswith("."):
                    continue
                try:
                    v = Version.parse(name)
                except InvalidInput:
                    continue
                n = self._marker_nbytes(self.mem.marker(job, v))
                if n is None:
                    claim = self._read_claim(job, v)
                    n = max(claim) if claim is not None else 0
                total += n
        return total

    def _predicted_bytes(self, job: str) -> int:
        """The size of the job's newest committed version here: what its next version will most likely need."""
        best: tuple[Version, Path] | None = None
        for root in (self.disk, self.mem):
            for v, marker in version_markers(root.commits(job)):
                if best is None or v > best[0]:
                    best = (v, marker)
        if best is None:
            return 0
        return self._marker_nbytes(best[1]) or 0

    def versions(self, *, spilled: bool | None = None) -> list[tuple[float, str, Version]]:
        """(commit time, job, version) of the versions committed in memory, oldest first; with ``spilled``,
        only those with (True) or without (False) a disk copy."""
        out = []
        for job in self.jobs():
            for v, marker in version_markers(self.mem.commits(job)):
                try:
                    mtime = os.stat(marker).st_mtime
                except FileNotFoundError:
                    continue
                if spilled is None or self.disk.marker(job, v).is_file() == spilled:
                    out.append((mtime, job, v))
        out.sort()
        return out

    def _make_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit the budget, evicting the oldest spilled versions as needed (budget lock held)."""
        budget = self.budget
        if nbytes > budget:
            return False
        used = self.used()
        if used + nbytes <= budget:
            return True
        for _mtime, job, v in self.versions(spilled=True):
            freed = self.evict(job, v)
            if freed is not None:
                used -= freed
                if used + nbytes <= budget:
                    return True
        return False

    def evict(self, job: str, version: Version) -> int | None:
        """Take a spilled version out of memory: reads go to its disk copy from now on (a store's cached reader
        sees its memory marker gone); its memory files are removed after the grace period
        (:meth:`reap_evicted`). Its bytes, or None when it is not evictable."""
        with self.disk.locked(job, create=True):
            marker, disk = self.mem.marker(job, version), self.disk.marker(job, version)
            if not (marker.is_file() and disk.is_file()):
                return None
            nbytes = self._marker_nbytes(marker) or 0
            record = self.mem.evicting(job, version)
            record.parent.mkdir(exist_ok=True)
            os.rename(marker, record)
            os.utime(record)  # the grace period runs from now
        log.info("evicted version %s of job %s from memory (%s); it is read from disk now", version, job, human_bytes(nbytes))
        return nbytes

    def place(self, job: str, version: Version, nbytes: int) -> bool:
        """Where ``nbytes`` more of an uncommitted version go: True for memory (claimed in the budget), False for disk.

        A version lives in one tier. Its first writer places it: in memory when
        the job's last version (or these bytes, if more) fits the budget after
        evicting what is spilled already, else on disk (pinned there by its
        directory). Writers of a memory version claim their bytes; a claim the
        budget cannot hold moves the version to disk (:meth:`_demote`).
        """
        with flocked(self.root / BUDGET_LOCK):
            with self.disk.locked(job, create=True):
                if self._committed_anywhere(job, version):
                    raise Conflict(f"version {version} of job {job!r} is committed; committed versions are immutable")
                in_memory = self.working_dir(job, version) is not None
                exists = in_memory or self.disk.version(job, version).is_dir()
                claim = self._read_claim(job, version) if in_memory else None
            if exists and not in_memory:
                return False
            if not exists:
                want = max(nbytes, self._predicted_bytes(job))
                fits = self._make_room(want)
                with self.disk.locked(job, create=True):
                    if fits:
                        write_group(self.mem.version(job, version), {"job": job, "version": str(version)})
                        self._write_claim(job, version, want, nbytes)
                    else:
                        write_group(self.disk.version(job, version), {"job": job, "version": str(version)})
                if not fits:
                    log.info("version %s of job %s (%s expected) does not fit the memory budget (%s): written to disk",
                             version, job, human_bytes(want), human_bytes(self.budget))
                return fits
            reserved, used = claim if claim is not None else (0, 0)
            extra = max(reserved, used + nbytes) - max(reserved, used)
            if extra and not self._make_room(extra):
                self._demote(job, version)
                return False
            with self.disk.locked(job, create=True):
                self._write_claim(job, version, reserved, used + nbytes)
            return True

    def _demote(self, job: str, version: Version) -> None:
        """Move an uncommitted memory version to disk: it outgrew the budget (budget lock held)."""
        trash = None
        with self.disk.locked(job, create=True):
            mdir = self.mem.version(job, version)
            if mdir.is_dir():
                staging = self.disk.staging(job) / f"demote-{uuid.uuid4().hex}"
                staging.parent.mkdir(parents=True, exist_ok=True)
                copy_tree(mdir, staging)
                vdir = self.disk.version(job, version)
                if vdir.exists():
                    shutil.rmtree(self.disk.set_aside(job, vdir, "replaced"), ignore_errors=True)
                os.rename(staging, vdir)
                trash = self.mem.set_aside(job, mdir, f"deleted-{version}")
            self.mem.claim(job, version).unlink(missing_ok=True)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        log.info("version %s of job %s outgrew the memory budget while being written: moved to disk", version, job)

    def stats(self) -> dict[str, float]:
        """The tier now: budget, bytes used, versions committed there, how many of them are not durable and
        ``spill_lag``: seconds since the oldest of those was committed (0 when all are durable)."""
        versions = self.versions()
        unspilled = [t for t, job, v in versions if not self.disk.marker(job, v).is_file()]
        return {"budget": self.budget, "used": self.used(), "versions": len(versions),
                "unspilled": len(unspilled), "spill_lag": max(0.0, time.time() - min(unspilled)) if unspilled else 0.0}

    # -- spilling and reaping --------------------------------------------------------------

    def unspilled(self) -> list[tuple[str, Version]]:
        """(job, version) of the versions committed in memory without a disk copy, newest first."""
        return [(job, v) for _t, job, v in reversed(self.versions(spilled=False))]

    def spill(self, job: str, version: Version | str) -> int | None:
        """Copy a version committed in memory to disk and make that copy its durable one; its bytes, or None
        when there was nothing to do (not in memory, spilled already, deleted meanwhile).

        Every chunk file is checksummed as it is written and compared with the
        crc32c recorded when it was written (shards without recorded chunk
        checksums are checked whole, read back); a mismatch stops the spill.
        The copy is synced, renamed into place and then the disk marker is
        written, so a crash leaves either no durable copy or a complete one.
        Chunk files shared by hard links with another version already spilled
        (a transform kept the shard) are linked to that version's disk copy.
        """
        v = check_version(version)
        marker, disk_marker = self.mem.marker(job, v), self.disk.marker(job, v)
        try:
            with open(marker, encoding="utf-8") as f:
                manifest = Manifest.from_json(json.load(f))
        except FileNotFoundError:
            return None
        if disk_marker.is_file():
            return None
        staging = self.disk.staging(job) / f"spill-{uuid.uuid4().hex}"
        staging.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            try:
                copied = self._spill_copy(job, v, staging)
            except FileNotFoundError:  # deleted (or its files disappeared) while being copied
                if not marker.is_file():
                    return None
                raise
            if self.durable:
                sync_tree(staging)
            with self.disk.locked(job, create=True):
                if not marker.is_file() or disk_marker.is_file():
                    return None
                vdir = self.disk.version(job, v)
                if vdir.exists():  # what a spill killed before its marker left
                    shutil.rmtree(self.disk.set_aside(job, vdir, "replaced"), ignore_errors=True)
                os.rename(staging, vdir)
                if self.durable:
                    fsync_path(vdir.parent, directory=True)
                disk_marker.parent.mkdir(exist_ok=True)
                write_json_atomic(disk_marker, replace(manifest, durable=True).to_json(), durable=self.durable)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info("spilled version %s of job %s to disk: %s (%s copied) in %.2f s; durable", v, job,
                 human_bytes(manifest.nbytes), human_bytes(copied), time.perf_counter() - t0)
        return manifest.nbytes

    def _spill_copy(self, job: str, version: Version, dst: Path) -> int:
        """Copy the memory version's tree to ``dst`` on disk, verifying every shard; bytes copied (not linked)."""
        src = self.mem.version(job, version)
        # older versions in memory and on disk: their disk files are where hard-linked (kept) shards go
        spilled = [(self.mem.version(job, w), self.disk.version(job, w)) for _t, j, w in self.versions(spilled=True)
                   if j == job and w != version]
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / "zarr.json", dst / "zarr.json")
        copied = 0
        for tname in sorted(os.listdir(src)):
            tsrc = src / tname
            if not tsrc.is_dir():
                continue
            (dst / tname).mkdir()
            shutil.copyfile(tsrc / "zarr.json", dst / tname / "zarr.json")
            for sname in sorted(os.listdir(tsrc)):
                if (tsrc / sname).is_dir():
                    copied += self._spill_shard(job, version, tsrc / sname, dst / tname / sname, f"{tname}/{sname}", spilled)
        return copied

    def _spill_shard(self, job: str, version: Version, src: Path, dst: Path, rel: str,
                     spilled: Sequence[tuple[Path, Path]]) -> int:
        meta, rec = read_meta(src)
        info = ShardInfo.from_json(rec)
        layout = ChunkLayout.from_metadata(meta)
        crcs = meta["attributes"].get(CHUNK_CRCS)
        expected: dict[str, int] = {}
        if layout is not None and isinstance(crcs, list) and len(crcs) == len(layout.chunk_coords()):
            expected = {layout.chunk_key(c): int(crc) for c, crc in zip(layout.chunk_coords(), crcs, strict=True)}
        copied = 0
        for dirpath, _dirs, files in os.walk(src):
            here = Path(dirpath)
            sub = os.path.relpath(dirpath, src)
            out = dst / sub
            out.mkdir(parents=True, exist_ok=True)
            for name in files:
                key = name if sub == "." else f"{sub}/{name}"
                if key == "zarr.json":
                    shutil.copyfile(here / name, out / name)
                elif not _link_kept(here / name, f"{rel}/{key}", spilled, out / name):
                    copy_verified(here / name, out / name, expected.get(key), direct=self.direct_writes)
                    copied += os.stat(out / name).st_size
        if not expected:  # written through zarr (no chunk checksums): check the copy whole
            stored = StoredShard(info, dst, layout, None)
            problem = damage(TensorReader(job, version, info.tensor, False, [stored]), stored, info.region)
            if problem is not None:
                raise ChecksumMismatch(f"spilling {info.tensor!r} {info.region.format()} of {version} of job {job!r}: "
                                       f"{problem}: the memory copy is damaged")
        return copied

    def reap_evicted(self) -> int:
        """Remove the memory files of evicted versions whose grace period has passed; how many versions."""
        now = time.time()
        done = 0
        for job in self.jobs():
            for v, marker in version_markers(self.mem.evictions(job)):
                try:
                    if os.stat(marker).st_mtime + self.settings.evict_grace_s > now:
                        continue
                except FileNotFoundError:
                    continue
                trash = None
                with self.disk.locked(job, create=True):
                    record = self.mem.evicting(job, v)
                    if not record.is_file():
                        continue
                    mdir = self.mem.version(job, v)
                    if mdir.is_dir():
                        trash = self.mem.set_aside(job, mdir, f"deleted-{v}")
                    record.unlink()
                if trash is not None:
                    shutil.rmtree(trash, ignore_errors=True)
                done += 1
        return done

    def reap_dead_slots(self) -> int:
        """Remove the snapshot buffers of writers that are gone (their lock is free); versions keep their links."""
        base = self.root / BUFFERS
        done = 0
        try:
            jobs = os.listdir(base)
        except FileNotFoundError:
            return 0
        for job in jobs:
            try:
                owners = os.listdir(base / job)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for owner in owners:
                d = base / job / owner
                try:
                    young = time.time() - os.stat(d).st_mtime < 60
                except FileNotFoundError:
                    continue
                if not (d / ".lock").exists() and young:
                    continue  # being created
                if slot_owner_dead(d):
                    shutil.rmtree(d, ignore_errors=True)
                    done += 1
        return done


def _link_kept(src: Path, rel: str, spilled: Sequence[tuple[Path, Path]], dst: Path) -> bool:
    """Link ``dst`` to the disk copy of a spilled version whose memory file is ``src``'s very file (a shard a
    transform kept by a hard link): the same bytes, verified when that version was spilled."""
    ino = os.stat(src).st_ino
    for mdir, ddir in spilled:
        try:
            if os.stat(mdir / rel).st_ino == ino:
                os.link(ddir / rel, dst)
                return True
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:  # no hard links there: copy
            return False
    return False


class Spiller:
    """The owner's one background thread that makes memory versions durable and keeps the tier tidy.

    Every ``poll_s`` (and at once when this process commits a memory version)
    it spills the committed memory versions that have no disk copy yet, newest
    first (the newest is what a recovery needs; an older one superseded while
    waiting is usually deleted by retention before its turn), removes evicted
    versions whose grace period has passed and snapshot buffers of writers that
    are gone. It runs ``nice`` steps nicer than the daemon's request threads. A
    version whose spill fails (a full disk) is retried with a growing delay.

    ``interval_s`` (default 0: every version as soon as it is committed) spills
    at most one version of a job per that many seconds, the newest: where a job
    snapshots more often than that, the versions in between are spilled only
    once no newer one waits (usually retention has deleted them by then; until
    then they hold their memory, and a version that finds no room goes to disk
    directly). That bounds
    the disk work (and the CPU it takes from training) whatever the snapshot
    rate; a version is durable at most about ``interval_s`` plus one spill after
    its commit, while peers read it from memory at once.
    """

    def __init__(self, tier: MemoryTier, *, poll_s: float = DEFAULT_SPILL_POLL_S, nice: int = 10,
                 interval_s: float = 0.0) -> None:
        if not interval_s >= 0:
            raise InvalidInput(f"the spill interval must be >= 0 seconds, got {interval_s!r}")
        self._tier = tier
        self._poll_s = poll_s
        self._interval_s = interval_s
        self._last_spill: dict[str, float] = {}  # job -> when its last spill started (monotonic)
        self._nice = nice
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._retry_at: dict[tuple[str, str], tuple[float, float]] = {}  # (job, version) -> (when, delay)
        self.spilled = 0
        self.spilled_bytes = 0
        self.failures = 0
        self.busy = False
        """Whether a spill is running now."""
        self._thread = threading.Thread(target=self._run, name="tenplex-spiller", daemon=True)

    def start(self) -> Spiller:
        self._thread.start()
        return self

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        lower_priority(self._nice)
        while not self._stop.is_set():
            self._wake.wait(self._poll_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.run_once()
            except Exception:  # a bug must not end the thread: log it and keep spilling
                log.exception("the memory tier's spiller failed a round")

    def run_once(self) -> int:
        """One round: reap, then spill every unspilled committed version (newest first); how many were spilled."""
        tier = self._tier
        tier.reap_evicted()
        tier.reap_dead_slots()
        done = 0
        now = time.monotonic()
        for job, version in tier.unspilled():
            if self._stop.is_set():
                break
            if self._interval_s and now - self._last_spill.get(job, -math.inf) < self._interval_s:
                continue  # this job's newest version was spilled recently: the next one waits its turn
            key = (job, str(version))
            when, delay = self._retry_at.get(key, (0.0, 0.0))
            if now < when:
                continue
            try:
                self.busy = True
                nbytes = tier.spill(job, version)
            except (OSError, StateLost, ChecksumMismatch, InvalidInput) as exc:
                delay = min(60.0, max(1.0, delay * 2))
                self._retry_at[key] = (time.monotonic() + delay, delay)
                self.failures += 1
                log.warning("spilling version %s of job %s to disk failed (retrying in %.0f s): %s", version, job, delay, exc)
                continue
            finally:
                self.busy = False
            self._retry_at.pop(key, None)
            if nbytes is not None:
                self._last_spill[job] = now
                done += 1
                self.spilled += 1
                self.spilled_bytes += nbytes
        return done
