"""The one interface of a tensor store, whatever side of the wire it is on.

Every consumer of stored state (the worker's snapshots and restores, the
executor of a transform, DCP export and import, the CLI) needs the same few
operations of a node's store, and reaches that store either directly on the
node's disk (:class:`~tenplex.store.local.LocalStore`) or through the node's
daemon over HTTP (:class:`~tenplex.store.client.StoreClient`). Both implement
:class:`TensorStore` themselves, with the same meaning, so that a consumer
takes a ``TensorStore`` and works with either; ``tests/store/test_conformance.py``
runs one suite of behaviours against the local store, the client on a daemon
and the client on a multi-process daemon.

What the interface promises:

- Versions (:class:`~tenplex.core.version.Version` or its ``s<step>-g<gen>``
  text) are written shard by shard, then committed atomically; a committed
  version is immutable and is what reads see unless ``uncommitted`` is asked for.
- A read of a region that is exactly a stored shard is checked against the
  crc32c recorded when the shard was written, whichever side reads it
  (``verify``): damage on a disk is a :class:`~tenplex.errors.ChecksumMismatch`,
  never silently wrong bytes. Any region a version's shards cover can be read;
  a region they do not cover is :class:`~tenplex.errors.StateLost`.
- :meth:`TensorStore.link_shard` puts a shard of an older committed version
  into a newer one without moving its bytes: hard links on the node, done by
  the daemon when the caller is remote.
- Errors are the :mod:`tenplex.errors` hierarchy on both sides (a daemon's
  ``{"error", "detail"}`` answer becomes the same exception class).

This module imports neither zarr nor the HTTP stack: a library that only
passes stores around (the executor, the worker) stands on it alone.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from tenplex.core.version import Version
from tenplex.errors import InvalidInput, NotFound
from tenplex.ptc.dtypes import storage_dtype
from tenplex.ptc.region import Region
from tenplex.store.buffers import ReceivedCrcs
from tenplex.store.model import Manifest, ShardInfo, VersionInfo

if TYPE_CHECKING:
    import torch

COMMIT_RECHECK_S = 0.25
"""How often a wait for a commit looks again when it cannot be told of it (a commit by another process)."""


@dataclass(frozen=True, slots=True)
class RegionRead:
    """One region of a batch read (:meth:`TensorStore.read_regions`) and the buffer it fills."""

    tensor: str
    region: Region
    out: Any  # np.ndarray | torch.Tensor, C-contiguous, shape region.shape
    received: ReceivedCrcs | None = None
    """Of ``out``: a reader that checksums the bytes as they arrive (a daemon's client) records its running
    crc32c there, so that the store writing ``out`` next need not checksum it again; others leave it empty."""
    done: Callable[[], None] | None = None
    """Called (once, in the calling thread) as soon as ``out`` holds the region's verified bytes, where a store
    can tell before the whole batch has arrived (a daemon's client: the region's part of the body is in and
    checked); the store neither writes ``out`` nor records into ``received`` after that, even when it retries
    the rest of the batch. Why: the caller can store a shard while the next ones of a large batch are still
    on the wire. Stores that cannot tell do not call it: their caller counts every read done when the
    call returns."""


class SnapshotBuffers(ABC):
    """Host buffers a snapshot copies a rank's shards into, which the store then keeps without another copy.

    What :meth:`TensorStore.snapshot_buffers` gives a snapshotting worker where
    the store can do it (a node store with a memory tier: the buffers are its
    memory files, see :class:`~tenplex.store.tiers.MemorySlots`). Per shard:
    :meth:`acquire` a buffer, fill it (the blocking copy-out), then
    :meth:`store` it into an uncommitted version (in the background). A buffer
    stored into a version is never handed out again while that version holds it.
    """

    @abstractmethod
    def acquire(self, tensor: str, region: Region, dtype: str, nbytes: int) -> np.ndarray:
        """A writable, page-aligned ``uint8`` array of ``nbytes`` for the shard ``region`` of ``tensor``."""

    @abstractmethod
    def store(self, version: Version | str, tensor: str, region: Region, dtype: str, global_shape: Sequence[int], *,
              crc: int | None = None) -> ShardInfo:
        """Put the shard's acquired buffer into ``version`` (uncommitted) of the job as the shard ``region``;
        ``crc``: the buffer's crc32c when the caller computed it already (else it is computed here)."""

    def prepare(self) -> int:
        """Get buffers ready for the next snapshot (in a background thread, after :meth:`store`); how many were made."""
        return 0

    @abstractmethod
    def close(self) -> None:
        """Let the buffers go (versions that hold some keep them)."""


class TensorStore(ABC):
    """A node's tensor store: shards of tensors, per job and version, with atomic commits.

    Thread-safe in every implementation. ``url`` says where the store is, in
    the form :func:`tenplex.store.open_store` accepts back: the daemon's
    ``http(s)://`` URL, the root directory of a node store on this machine's
    disk (a path), or a persistent location (``s3://bucket/prefix``,
    ``file:///path``; :class:`~tenplex.store.persistent.PersistentStore`).
    """

    url: str

    # -- reads ----------------------------------------------------------------

    @abstractmethod
    def read_into(
        self,
        job: str,
        version: Version | str,
        tensor: str,
        region: Region,
        out: np.ndarray | torch.Tensor,
        *,
        verify: bool = True,
        uncommitted: bool = False,
    ) -> None:
        """Fill ``out`` (C-contiguous, shape ``region.shape``, the tensor's element size; numpy or torch, a
        GPU tensor through a host buffer) with ``region`` of ``tensor``, assembled from the shards covering it.

        With ``verify``, a region that is exactly a stored shard is checked against its recorded crc32c
        (:class:`~tenplex.errors.ChecksumMismatch`). Only committed versions are read unless ``uncommitted``.
        """

    @abstractmethod
    def read_regions(self, job: str, version: Version | str, reads: Sequence[RegionRead], *, verify: bool = True) -> None:
        """Fill every read's ``out`` with its region of one committed version (as :meth:`read_into` each).

        One call for many regions: over HTTP they travel in as few batch
        requests as the limits allow (:data:`~tenplex.store.wire.MAX_BATCH_REGIONS`),
        which is what makes the hundreds of small shards of a transform cheap.
        """

    def read(self, job: str, version: Version | str, tensor: str, region: Region, dtype: str) -> np.ndarray:
        """The region as a new numpy array of the storage dtype (uint16 for bfloat16)."""
        out = np.empty(region.shape, storage_dtype(dtype))
        self.read_into(job, version, tensor, region, out)
        return out

    # -- writes ---------------------------------------------------------------

    @abstractmethod
    def write_shard(
        self,
        job: str,
        version: Version | str,
        tensor: str,
        region: Region,
        data: np.ndarray | torch.Tensor,
        *,
        dtype: str,
        global_shape: Sequence[int],
        received: ReceivedCrcs | None = None,
    ) -> ShardInfo:
        """Store ``data`` (shape ``region.shape``; numpy in the storage dtype or a torch tensor of ``dtype``) as
        the shard ``region`` of ``tensor`` in an uncommitted version; the same region again replaces it.

        :class:`~tenplex.errors.Conflict` for a committed version, or a dtype or global shape that differs
        from the tensor's other shards in the version. ``received``: the crc32c prefixes of ``data`` taken
        when it was received (:class:`~tenplex.store.buffers.ReceivedCrcs`); a store that checksums what it
        writes takes the checksums of ``data``'s parts from them instead of another pass over the bytes
        (one that receives the bytes over the network checksums them itself and ignores it).
        """

    @abstractmethod
    def link_shard(
        self,
        job: str,
        from_version: Version | str,
        tensor: str,
        region: Region,
        to_version: Version | str,
        *,
        verify: bool = True,
    ) -> ShardInfo:
        """Put the shard ``region`` of ``tensor`` of committed ``from_version`` into uncommitted ``to_version``
        without moving its bytes (on the node: hard links to the same files), its checksum carried over.

        :class:`~tenplex.errors.NotFound` when ``from_version`` holds no shard with exactly this region (the
        caller copies the bytes instead). ``verify`` first checks the old shard against its checksum, so a
        shard damaged on disk is refused with :class:`~tenplex.errors.ChecksumMismatch`, not carried over.
        """

    # -- versions -------------------------------------------------------------

    @abstractmethod
    def manifest(self, job: str, version: Version | str) -> Manifest:
        """Everything this store holds of one version, committed or not (:class:`~tenplex.errors.NotFound`
        for an unknown job or version)."""

    @abstractmethod
    def versions(self, job: str) -> list[VersionInfo]:
        """All versions of a job here, committed or not, ordered by (step, generation)."""

    def is_committed(self, job: str, version: Version | str) -> bool:
        """Whether ``version`` of ``job`` is committed here (False for an unknown job or version). The default
        asks :meth:`versions`; a store that can answer without looking at the versions' contents does."""
        want = Version.parse(str(version))
        try:
            return any(v.version == want and v.committed for v in self.versions(job))
        except NotFound:
            return False

    def wait_committed(self, job: str, version: Version | str, timeout_s: float) -> bool:
        """Whether ``version`` is committed here within ``timeout_s`` (at once when it is): what a new worker
        does while its version is being built on its node. The node's own store is told of its commits and
        its daemon answers a long poll, so neither waits by asking again and again; this default, for a store
        that can do neither, asks :meth:`is_committed` every :data:`COMMIT_RECHECK_S`."""
        deadline = time.monotonic() + timeout_s
        while not self.is_committed(job, version):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(COMMIT_RECHECK_S, left))
        return True

    @abstractmethod
    def jobs(self) -> list[str]:
        """The jobs this store holds anything of, sorted."""

    @abstractmethod
    def commit(self, job: str, version: Version | str) -> Manifest:
        """Make a version visible as committed, atomically (all its shards, or nothing); its manifest.
        Committing a committed version changes nothing."""

    @abstractmethod
    def delete(self, job: str, version: Version | str) -> None:
        """Remove a version, committed or not (:class:`~tenplex.errors.NotFound` when it is not here); it
        never looks committed and partial on the way."""

    def gc(self, job: str, keep_last: int) -> list[Version]:
        """Delete all but the newest ``keep_last`` committed versions, and uncommitted ones older than the newest
        committed (newer ones may still be being written); the versions deleted."""
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise InvalidInput(f"keep_last must be an integer >= 1 (the newest committed version is never collected), "
                               f"got {keep_last!r}")
        infos = self.versions(job)
        committed = [vi.version for vi in infos if vi.committed]
        keep = set(committed[-keep_last:])
        newest = committed[-1] if committed else None
        doomed = [vi.version for vi in infos
                  if vi.version not in keep and (vi.committed or (newest is not None and vi.version < newest))]
        for v in doomed:
            with contextlib.suppress(NotFound):
                self.delete(job, v)
        return doomed

    def reserve(self, job: str, version: Version | str, nbytes: int) -> None:  # noqa: B027  (most stores place nothing)
        """Announce that this writer is about to write ``nbytes`` of uncommitted ``version`` (a snapshot, all
        its shards): a store with a memory tier places the version and claims that room once, not shard by
        shard. The default does nothing (a store that places nothing, or places each upload as it comes)."""

    def snapshot_buffers(self, job: str) -> SnapshotBuffers | None:
        """Buffers in this store that a snapshot of ``job`` can copy into and then store without copying again,
        or None where the store has none (the default: the snapshot keeps host buffers of its own and writes
        them with :meth:`write_shard`)."""
        return None

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:  # noqa: B027  (a store with nothing to release keeps this)
        """Release threads and connections; a closed store is not used again."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
