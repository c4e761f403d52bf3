"""Uploads to the persistent tier, run by the node daemons in the background.

Every N steps the control plane has the nodes copy a committed version to
the job's persistent location (:class:`~tenplex.store.persistent.PersistentStore`,
``s3://`` or ``file://``): it sends each node the regions that node uploads
(each region once, not once per data-parallel replica, spread over the nodes
that hold it), follows their records, and once every node's part is
uploaded asks one daemon to commit the version there, which checks every
expected shard first. Training never waits for any of it, and no byte of it
passes through the control plane.

Routes (mounted by the node daemon, behind its bearer token)::

    POST   /v1/jobs/{job}/uploads                     UploadRequest -> the record (201 new, 200 attached)
    GET    /v1/jobs/{job}/uploads                     the job's upload records on this node
    GET    /v1/jobs/{job}/uploads/{version}[?wait=S]  one record: state, bytes, attempts, last error, rate
    DELETE /v1/jobs/{job}/uploads/{version}           cancel (what is uploaded stays uncommitted) or forget
    POST   /v1/jobs/{job}/uploads/{version}/commit    CommitRequest -> the committed manifest, or 409 naming
                                                      every expected shard missing or damaged there
    GET    /v1/jobs/{job}/persistent?uri=...          the job's versions at the persistent location
    GET    /v1/jobs/{job}/persistent/{version}?uri=...   a persistent version's manifest
    GET    /v1/jobs/{job}/persistent/{version}/ptc?uri=...   the PTC it was saved in (sent with the commit)
    DELETE /v1/jobs/{job}/persistent/{version}?uri=...   retention: delete a version there

An upload is identified by (job, version) and recorded under
``<root>/.uploads/<job>/`` as every task of the daemon is
(:mod:`tenplex.node.tasks`): the same shards to the same URI attach to the
running or uploaded upload; a different request for one that failed, was
cancelled or interrupted starts anew, for a running or uploaded one it is a
409. A cancelled upload leaves what it wrote uncommitted. States::

    queued -> running -> uploaded | failed | cancelled | interrupted

An attempt reads each shard from the node's store straight into buffers
(pieces of whole chunk bands for large shards, within the daemon's memory
budget) and writes it through zarr; a shard already in the persistent store
with the checksum the node recorded is skipped (a retry or a resubmission
after a restart redoes only what is missing). Errors of the persistent
store (unreachable, throttled, refused credentials) end the attempt; the
next starts after an exponential backoff, for up to ``retry_for_s`` after
the first error (``attempts`` and ``last_error`` say so meanwhile), then the
upload is ``failed``. Errors of the node's own copy (the version deleted, a
shard damaged on this disk: its checksum is checked against the node's
record before it is uploaded) fail the upload at once: retrying cannot help.
Connection options may carry credentials; they are never written into a
record nor logged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import tenacity
from anyio import to_thread
from fastapi import APIRouter, Request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tenplex.core.version import Version
from tenplex.errors import (
    ChecksumMismatch,
    Conflict,
    InvalidInput,
    NotFound,
    StoreUnavailable,
    TenplexError,
)
from tenplex.node.tasks import RecordedTasks, TaskRun, add_task_routes, json_body
from tenplex.ptc.dtypes import storage_dtype
from tenplex.ptc.region import Region
from tenplex.store.local import LocalStore
from tenplex.store.locations import check_options, check_uri, public_options
from tenplex.store.model import ShardInfo, parse_checksum
from tenplex.store.names import check_job, check_tensor, check_version
from tenplex.store.persistent import DEFAULT_CHUNK_BYTES, PersistentStore, SmallShard
from tenplex.transformer.remote import CANCELLED, FAILED, INTERRUPTED, QUEUED, RUNNING, TaskProgress

log = logging.getLogger(__name__)

# -- the upload routes' bodies and records ---------------------------------------------------------------------

UPLOADED = "uploaded"
UPLOAD_FINAL_STATES = frozenset({UPLOADED, FAILED, CANCELLED, INTERRUPTED})


def parse_region_text(text: str) -> Region:
    """A region as ``a:b,c:d`` with every bound given (``''`` for a 0-d tensor): what upload requests carry."""
    if not isinstance(text, str):
        raise InvalidInput(f"a region is a string like '0:64,0:128', got {text!r}")
    if text.strip() == "":
        return Region(())
    bounds = []
    for part in text.split(","):
        a, sep, b = part.partition(":")
        try:
            if not sep:
                raise ValueError
            bounds.append((int(a), int(b)))
        except ValueError:
            raise InvalidInput(f"region {text!r}: each dimension must be start:stop with both bounds given") from None
    return Region(tuple(bounds))


@dataclass(frozen=True)
class UploadRequest:
    """``POST /v1/jobs/{job}/uploads``: upload these shards of a committed version on the node to ``uri``.

    The control plane sends each node the regions it uploads (each region once, spread over the nodes that
    hold it); the daemon reads them from its own store and writes them to the persistent tier in the
    background. ``options`` are the persistent location's connection options (never recorded in full:
    credentials are dropped from records and answers).
    """

    version: Version
    uri: str
    shards: tuple[tuple[str, Region], ...]
    options: Mapping[str, Any] | None = None

    @property
    def digest(self) -> str:
        """Identifies the upload: a resubmission with the same digest attaches to it."""
        text = json.dumps([str(self.version), self.uri, sorted([t, r.format()] for t, r in self.shards)],
                          separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    @classmethod
    def from_json(cls, obj: Any) -> UploadRequest:
        if not isinstance(obj, dict):
            raise InvalidInput(f"an upload request is a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - {"version", "uri", "shards", "options"})
        if unknown:
            raise InvalidInput(f"unknown fields in the upload request: {', '.join(unknown)}")
        for key in ("version", "uri", "shards"):
            if key not in obj:
                raise InvalidInput(f"the upload request needs {key!r}")
        shards = obj["shards"]
        if not isinstance(shards, list) or not shards:
            raise InvalidInput("'shards' must be a non-empty list of [tensor, region] pairs, e.g. [\"w\", \"0:64,0:128\"]")
        pairs = []
        for item in shards:
            if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str):
                raise InvalidInput(f"shard {item!r} is not a [tensor, region] pair")
            pairs.append((check_tensor(item[0]), parse_region_text(item[1])))
        if len(set(pairs)) != len(pairs):
            raise InvalidInput("'shards' names a shard twice")
        options = obj.get("options")
        return cls(version=check_version(str(obj["version"])), uri=check_uri(obj["uri"]), shards=tuple(pairs),
                   options=check_options(options) if options is not None else None)


@dataclass(frozen=True)
class UploadStatus(TaskProgress):
    """The record of one upload on one node, as stored and as answered (never with credentials)."""

    job: str
    version: str
    uri: str
    digest: str
    state: str
    shards_total: int
    bytes_total: int
    shards_done: int = 0
    bytes_done: int = 0
    attempts: int = 0
    """Attempts started; more than 1 means errors were retried."""
    submitted_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    last_error: str | None = None
    """The latest error (of the last attempt that failed), also while a retry is pending."""
    error_code: str | None = None
    next_attempt_at: float | None = None
    """When the next attempt starts, while one is pending after an error."""
    options: Mapping[str, Any] | None = None
    """The public connection options (no credentials)."""
    stages: Mapping[str, float] | None = None
    """Seconds spent per stage, summed over the upload's threads and attempts: ``check`` (what the destination
    already holds), ``read`` (the node's copy), ``write`` (chunk objects and metadata to the destination)."""

    final_states: ClassVar[frozenset[str]] = UPLOAD_FINAL_STATES

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job, "version": self.version, "uri": self.uri, "digest": self.digest, "state": self.state,
            "shards_total": self.shards_total, "shards_done": self.shards_done, "bytes_total": self.bytes_total,
            "bytes_done": self.bytes_done, "attempts": self.attempts, "submitted_at": self.submitted_at,
            "started_at": self.started_at, "finished_at": self.finished_at, "seconds": round(self.seconds, 6),
            "rate_bytes_per_s": round(self.rate, 1), "last_error": self.last_error, "error_code": self.error_code,
            "error": self.last_error if self.state in (FAILED, CANCELLED, INTERRUPTED) else None,
            "next_attempt_at": self.next_attempt_at,
            "options": dict(self.options) if self.options is not None else None,
            "stages": {k: round(v, 6) for k, v in self.stages.items()} if self.stages is not None else None,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> UploadStatus:
        try:
            return cls(
                job=str(obj["job"]), version=str(obj["version"]), uri=str(obj["uri"]), digest=str(obj["digest"]),
                state=str(obj["state"]), shards_total=int(obj["shards_total"]), bytes_total=int(obj["bytes_total"]),
                shards_done=int(obj.get("shards_done", 0)), bytes_done=int(obj.get("bytes_done", 0)),
                attempts=int(obj.get("attempts", 0)), submitted_at=float(obj.get("submitted_at", 0.0)),
                started_at=obj.get("started_at"), finished_at=obj.get("finished_at"), last_error=obj.get("last_error"),
                error_code=obj.get("error_code"), next_attempt_at=obj.get("next_attempt_at"), options=obj.get("options"),
                stages={str(k): float(v) for k, v in obj["stages"].items()} if obj.get("stages") else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"malformed upload record: {type(exc).__name__}: {exc}") from None


@dataclass(frozen=True)
class CommitRequest:
    """``POST /v1/jobs/{job}/uploads/{version}/commit``: ``{"uri": ..., "shards": [[tensor, region], ...]}``.

    Check that the persistent version holds every expected shard intact (each one present, every chunk there,
    its data matching the crc32c recorded with it when it was uploaded; a third element per shard, when given,
    is the checksum the node stores recorded, which must match too) and write its commit marker, last.
    """

    uri: str
    shards: tuple[tuple[str, Region, str | None], ...]
    options: Mapping[str, Any] | None = None
    ptc: Mapping[str, Any] | None = None
    """The PTC JSON of the version (its dataset position at the version's step): kept with the version so that
    a job resumed from it plans its layout from it."""

    @classmethod
    def from_json(cls, obj: Any) -> CommitRequest:
        if not isinstance(obj, dict):
            raise InvalidInput(f"a commit request is a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - {"uri", "shards", "options", "ptc"})
        if unknown:
            raise InvalidInput(f"unknown fields in the commit request: {', '.join(unknown)}")
        ptc = obj.get("ptc")
        if ptc is not None and not isinstance(ptc, dict):
            raise InvalidInput(f"'ptc' must be the PTC's JSON object, got {type(ptc).__name__}")
        if "uri" not in obj:
            raise InvalidInput("the commit request needs 'uri'")
        shards = obj.get("shards")
        if not isinstance(shards, list) or not shards:
            raise InvalidInput("'shards' must be a non-empty list of [tensor, region] or [tensor, region, checksum]")
        items = []
        for item in shards:
            if (not isinstance(item, list) or len(item) not in (2, 3) or not isinstance(item[0], str)
                    or (len(item) == 3 and not isinstance(item[2], str))):
                raise InvalidInput(f"expected shard {item!r} is not [tensor, region] or [tensor, region, checksum]")
            if len(item) == 3:
                parse_checksum(item[2])
            items.append((check_tensor(item[0]), parse_region_text(item[1]), item[2] if len(item) == 3 else None))
        if len({(t, r) for t, r, _ in items}) != len(items):
            raise InvalidInput("'shards' names a shard twice")
        options = obj.get("options")
        return cls(uri=check_uri(obj["uri"]), shards=tuple(items),
                   options=check_options(options) if options is not None else None, ptc=ptc)


RECORDS_DIR = ".uploads"
"""Under the store root; a dot name, which no job may have."""


@dataclass(frozen=True)
class UploadSettings:
    """What bounds a daemon's uploads (``tenplex store serve --upload-*``; chart ``store.uploads``)."""

    concurrency: int = 4
    """Shards of one upload in flight at once."""
    memory_bytes: int = 512 << 20
    """Read buffers of all running uploads together (a piece larger than that still runs, alone)."""
    max_running: int = 2
    """Uploads running at once on this node; more wait in state ``queued``."""
    retry_for_s: float = 900.0
    """How long after its first error an upload keeps retrying before it is ``failed``."""
    backoff_s: float = 1.0
    """The wait before the first retry; doubled after each failed attempt, up to :attr:`backoff_max_s`."""
    backoff_max_s: float = 60.0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Size of the chunk objects written to the persistent store."""
    request_timeout_s: float = 60.0
    """How long one request to the persistent store may take."""
    small_shard_bytes: int = 1 << 20
    """Shards up to this size (in one chunk object) are uploaded in batches: what each of them costs is the
    latency of its few requests, which a batch overlaps (:meth:`PersistentStore.write_shards`)."""
    batch_shards: int = 32
    """Small shards per batch (one batch: one read pass on the node, then its writes). Batches run
    :attr:`concurrency` at a time, so a version of a few hundred small shards still spreads over all of them,
    and one batch's reads overlap another's writes."""
    batch_bytes: int = 16 << 20
    """Bytes per batch of small shards (read into memory at once, within :attr:`memory_bytes`)."""

    def __post_init__(self) -> None:
        if self.small_shard_bytes < 0 or self.batch_shards < 1 or self.batch_bytes < 1:
            raise InvalidInput(f"upload settings: small_shard_bytes {self.small_shard_bytes} (>= 0), batch_shards "
                               f"{self.batch_shards} (>= 1), batch_bytes {self.batch_bytes} (>= 1)")
        if self.concurrency < 1 or self.max_running < 1 or self.memory_bytes < 1 or self.chunk_bytes < 64:
            raise InvalidInput(
                f"upload settings: concurrency {self.concurrency} (>= 1), max_running {self.max_running} (>= 1), "
                f"memory_bytes {self.memory_bytes} (>= 1), chunk_bytes {self.chunk_bytes} (>= 64)"
            )
        if self.retry_for_s < 0 or self.backoff_s <= 0 or self.backoff_max_s < self.backoff_s or self.request_timeout_s <= 0:
            raise InvalidInput(
                f"upload settings: retry_for_s {self.retry_for_s} (>= 0), backoff_s {self.backoff_s} (> 0), "
                f"backoff_max_s {self.backoff_max_s} (>= backoff_s), request_timeout_s {self.request_timeout_s} (> 0)"
            )

    @property
    def piece_bytes(self) -> int:
        """The buffer one shard in flight reads at a time (at least a band of chunks: see the writer)."""
        return max(1 << 20, self.memory_bytes // (self.max_running * self.concurrency))


class UploadMetrics:
    """Prometheus metrics of uploads, in the daemon's registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.bytes = Counter("tenplex_upload_bytes", "Bytes written to the persistent tier", registry=self.registry)
        self.skipped = Counter("tenplex_upload_skipped_bytes",
                               "Bytes found already uploaded (same checksum) and not uploaded again", registry=self.registry)
        self.uploads = Counter("tenplex_uploads", "Uploads finished, by outcome", ["outcome"], registry=self.registry)
        self.failures = Counter("tenplex_upload_failures", "Upload attempts that ended in an error", registry=self.registry)
        self.retries = Counter("tenplex_upload_retries", "Upload attempts started after an error", registry=self.registry)
        self.active = Gauge("tenplex_uploads_active", "Uploads on this node not finished, by state (queued, running)",
                            ["state"], registry=self.registry, multiprocess_mode="livesum")
        for state in (QUEUED, RUNNING):
            self.active.labels(state)
        self.seconds = Histogram("tenplex_upload_seconds", "Duration of finished uploads",
                                 buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200), registry=self.registry)


class _Budget:
    """Bytes of read buffers in use by all uploads of this daemon; a take larger than the budget runs alone."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def take(self, nbytes: int, cancel: threading.Event) -> Iterator[bool]:
        with self._cond:
            while self.used and self.used + nbytes > self.limit and not cancel.is_set():
                self._cond.wait(0.2)
            if cancel.is_set():
                yield False
                return
            self.used += nbytes
        try:
            yield True
        finally:
            with self._cond:
                self.used -= nbytes
                self._cond.notify_all()


class _Permanent(Exception):
    """An error retrying cannot fix (the node's own copy is gone or damaged, the request is wrong)."""

    def __init__(self, error: TenplexError) -> None:
        super().__init__(error.detail)
        self.error = error


class _Cancelled(Exception):
    pass


@contextlib.contextmanager
def _permanent(only: type[TenplexError] = TenplexError) -> Iterator[None]:
    """Errors of the node's own copy fail the upload at once, retrying cannot help: the block's ``only`` errors
    (:class:`ChecksumMismatch` of bytes read here: the copy is damaged, another attempt reads them again)."""
    try:
        yield
    except only as exc:
        raise _Permanent(exc) from exc


@dataclass
class _Run(TaskRun[UploadRequest, UploadStatus]):
    shards: list[ShardInfo] = field(default_factory=list)
    done: set[int] = field(default_factory=set)
    """Indices of the shards uploaded (by any attempt)."""
    failed: threading.Event = field(default_factory=threading.Event)
    """Set when a shard of the current attempt fails: its other shards stop at their next piece."""


class UploadService(RecordedTasks[UploadRequest, UploadStatus, _Run]):
    """The uploads of one node's store: started, followed, cancelled and recorded here; and the persistent
    tier's commit and retention requests. Thread-safe; one per daemon process."""

    KIND = "upload"
    ARTICLE = "an"
    RECORDS_DIR = RECORDS_DIR
    STATUS = UploadStatus

    def __init__(self, store: LocalStore, *, settings: UploadSettings | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.settings = settings or UploadSettings()
        self.metrics = UploadMetrics(registry)
        self._budget = _Budget(self.settings.memory_bytes)
        super().__init__(store, max_running=self.settings.max_running)

    def _what(self, job: str, version: str) -> str:
        return f"upload of {version} of job {job!r}"

    def _other_request(self, status: UploadStatus, digest: str) -> str:
        return (f"an upload of {status.version} of job {status.job!r} to {status.uri} exists with other shards or "
                f"another location (digest {status.digest}, this one {digest}, state {status.state})")

    def _keeps(self, record: UploadStatus) -> bool:
        return record.state == UPLOADED

    def _new_run(self, job: str, version: str, request: UploadRequest, record: UploadStatus | None,
                 lock_fd: int) -> _Run:
        shards = self._local_shards(job, request)  # checked before anything is recorded
        status = UploadStatus(
            job=job, version=version, uri=request.uri, digest=request.digest, state=QUEUED, shards_total=len(shards),
            bytes_total=sum(s.nbytes for s in shards), submitted_at=time.time(),
            options=public_options(request.options) or None,
        )
        return _Run(request, status, lock_fd, shards=shards)

    def _submitted(self, run: _Run) -> None:
        self.metrics.active.labels(QUEUED).inc()
        status = run.status
        log.info("upload of %s of job %s to %s submitted: %d shards, %d bytes", status.version, status.job, status.uri,
                 status.shards_total, status.bytes_total)

    def _interrupted(self, record: UploadStatus) -> UploadStatus:
        return replace(record, state=INTERRUPTED, finished_at=record.finished_at or time.time(),
                       last_error=record.last_error or "the daemon running this upload stopped before it finished",
                       error_code="interrupted", next_attempt_at=None)

    def _local_shards(self, job: str, request: UploadRequest) -> list[ShardInfo]:
        """The node's records of the requested shards: the version must be committed here and hold each exactly."""
        manifest = self.store.manifest(job, request.version)
        if not manifest.committed:
            raise Conflict(f"version {request.version} of job {job!r} is not committed on this node; only committed "
                           "versions are uploaded")
        held = {(s.tensor, s.region): s for s in manifest.shards}
        missing = [f"{t} {r.format()}" for t, r in request.shards if (t, r) not in held]
        if missing:
            raise NotFound(f"version {request.version} of job {job!r} on this node holds no shard exactly "
                           + ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
        return [held[(t, r)] for t, r in request.shards]

    # -- the persistent tier's other requests --------------------------------------------------

    def persistent(self, uri: str, options: dict[str, Any] | None = None) -> PersistentStore:
        """The persistent store at ``uri`` with this daemon's settings (and its AWS environment)."""
        return PersistentStore(check_uri(uri), options=check_options(options), chunk_bytes=self.settings.chunk_bytes,
                               timeout_s=self.settings.request_timeout_s)

    def commit(self, job: str, version: str, request: CommitRequest) -> dict[str, Any]:
        v = check_version(version)
        check_job(job)
        with self.persistent(request.uri, dict(request.options or {})) as store:
            manifest = store.commit(job, v, expect=request.shards, ptc=request.ptc)
        log.info("version %s of job %s committed at %s (%d shards checked)", v, job, request.uri, len(request.shards))
        return manifest.to_json()

    # -- running ------------------------------------------------------------------------------

    def _progress(self, run: _Run, nbytes: int, shards: int = 0) -> None:
        with self._lock:
            run.status = replace(run.status, bytes_done=run.status.bytes_done + nbytes,
                                 shards_done=run.status.shards_done + shards)
        self._write_soon(run)

    def _check_cancel(self, run: _Run) -> None:
        if self._cancel_requested(run):
            raise _Cancelled

    def _execute(self, run: _Run) -> None:
        job, version = run.status.job, run.status.version
        try:
            with self._slots:
                self._check_cancel(run)
                self._update(run, state=RUNNING, started_at=time.time())
                self.metrics.active.labels(QUEUED).dec()
                self.metrics.active.labels(RUNNING).inc()
                self._attempts(run)
            self._update(run, write=False, state=UPLOADED, finished_at=time.time(), next_attempt_at=None)
        except _Cancelled:
            if run.interrupt:
                self._update(run, write=False, state=INTERRUPTED, finished_at=time.time(), error_code="interrupted",
                             next_attempt_at=None, last_error="the store daemon stopped during the upload; nothing was committed")
            else:
                self._update(run, write=False, state=CANCELLED, finished_at=time.time(), next_attempt_at=None)
        except _Permanent as exc:
            self._update(run, write=False, state=FAILED, finished_at=time.time(), last_error=exc.error.detail,
                         error_code=exc.error.code, next_attempt_at=None)
        except Exception as exc:  # the record must say what happened, whatever it was
            log.exception("upload of %s of job %s failed unexpectedly", version, job)
            self._update(run, write=False, state=FAILED, finished_at=time.time(), next_attempt_at=None,
                         last_error=f"{type(exc).__name__}: {exc}", error_code="internal_error")

    def _ended(self, run: _Run, final: UploadStatus) -> None:
        self.metrics.uploads.labels(final.state).inc()
        self.metrics.active.labels(RUNNING if final.started_at is not None else QUEUED).dec()
        job, version, uri = final.job, final.version, run.request.uri
        if final.state == UPLOADED:
            self.metrics.seconds.observe(final.seconds)
            log.info("upload of %s of job %s to %s done: %d bytes in %.2f s (%d attempts)", version, job, uri,
                     final.bytes_done, final.seconds, final.attempts)
        else:
            log.warning("upload of %s of job %s to %s %s after %d attempts: %s", version, job, uri, final.state,
                        final.attempts, final.last_error)

    def _attempts(self, run: _Run) -> None:
        """Attempt after attempt, with tenacity's exponential backoff, until every shard is uploaded or the next
        attempt would start ``retry_for_s`` after the first error; a cancel ends the wait between them."""
        settings = self.settings
        first_error: list[float] = []

        def attempt() -> None:
            self._check_cancel(run)
            if run.status.attempts:
                self.metrics.retries.inc()
            self._update(run, attempts=run.status.attempts + 1, next_attempt_at=None)
            try:
                self._attempt(run)
            except (_Permanent, _Cancelled):
                raise
            except Exception as exc:
                self.metrics.failures.inc()
                first_error[:] = first_error or [time.time()]
                if not isinstance(exc, TenplexError):  # a backend error the store did not classify: retried too
                    raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
                raise

        def out_of_time(state: tenacity.RetryCallState) -> bool:
            return time.time() - first_error[0] + (state.upcoming_sleep or 0.0) > settings.retry_for_s

        def give_up(state: tenacity.RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome is not None else None
            assert isinstance(error, TenplexError)
            raise _Permanent(type(error)(f"{error.detail} (gave up after {run.status.attempts} attempts in "
                                         f"{time.time() - first_error[0]:.0f} s)"))

        def waiting(state: tenacity.RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome is not None else None
            assert isinstance(error, TenplexError)
            backoff = state.upcoming_sleep
            self._update(run, last_error=error.detail, error_code=error.code, next_attempt_at=time.time() + backoff)
            log.warning("upload of %s of job %s, attempt %d: %s; retrying in %.1f s", run.status.version,
                        run.status.job, run.status.attempts, error.detail, backoff)

        def pause(seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                self._check_cancel(run)
                run.cancel.wait(min(0.2, max(0.0, deadline - time.monotonic())))

        tenacity.Retrying(retry=tenacity.retry_if_exception_type(TenplexError), stop=out_of_time,
                          wait=tenacity.wait_exponential(multiplier=settings.backoff_s, max=settings.backoff_max_s),
                          before_sleep=waiting, sleep=pause, retry_error_callback=give_up)(attempt)

    def _attempt(self, run: _Run) -> None:
        req = run.request
        job = run.status.job
        run.failed.clear()
        with self.persistent(req.uri, dict(req.options or {})) as dest:
            committed = self._committed_there(dest, job, run)
            if committed:
                return
            todo = [i for i in range(len(run.shards)) if i not in run.done]
            if not todo:
                return
            with self._stage(run, "check"):
                there = dest.uploaded(job, req.version)  # one listing: a first attempt finds nothing
            stale: set[int] = set()
            for i in list(todo):
                info = run.shards[i]
                old = there.get((info.tensor, info.region))
                if old is None:
                    continue
                if old.checksum == info.checksum and old.nbytes == info.nbytes:
                    run.done.add(i)  # uploaded by an earlier attempt or submission
                    todo.remove(i)
                    self.metrics.skipped.inc(info.nbytes)
                    self._progress(run, info.nbytes, 1)
                else:
                    stale.add(i)  # another copy of it is there: replaced
            if not todo:
                return
            tasks = [(self._upload_batch, batch) for batch in self._batches(dest, run, todo)]
            tasks += [(self._upload_shard, [i]) for i in todo if not dest.small(
                run.shards[i].region, run.shards[i].dtype, self.settings.small_shard_bytes)]
            errors: list[BaseException] = []
            with ThreadPoolExecutor(max_workers=min(self.settings.concurrency, len(tasks)),
                                    thread_name_prefix=f"tenplex-upload-{job}") as pool:
                futures = [pool.submit(fn, run, dest, indices, stale) for fn, indices in tasks]
                for f in futures:  # a task that fails stops the others at their next piece or batch
                    f.add_done_callback(lambda f: run.failed.set() if f.exception() is not None else None)
                for f in futures:
                    exc = f.exception()
                    if exc is not None:
                        errors.append(exc)
                        run.failed.set()
            if errors:
                first = next((e for e in errors if isinstance(e, _Permanent | _Cancelled)), errors[0])
                raise first

    def _batches(self, dest: PersistentStore, run: _Run, todo: list[int]) -> list[list[int]]:
        """The small shards of ``todo`` (one chunk object, at most ``small_shard_bytes``) in batches of at most
        ``batch_shards`` shards and ``batch_bytes`` bytes, in the request's order."""
        settings = self.settings
        out: list[list[int]] = []
        size = 0
        for i in todo:
            info = run.shards[i]
            if not dest.small(info.region, info.dtype, settings.small_shard_bytes):
                continue
            if not out or len(out[-1]) >= settings.batch_shards or size + info.nbytes > settings.batch_bytes:
                out.append([])
                size = 0
            out[-1].append(i)
            size += info.nbytes
        return out

    @contextlib.contextmanager
    def _stage(self, run: _Run, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - t0
            with self._lock:
                stages = dict(run.status.stages or {})
                stages[stage] = stages.get(stage, 0.0) + spent
                run.status = replace(run.status, stages=stages)

    def _upload_batch(self, run: _Run, dest: PersistentStore, indices: list[int], stale: set[int]) -> None:
        """Read a batch of small shards from the node's store (each checked against the node's checksum) and
        write them to the destination at once (:meth:`PersistentStore.write_shards`)."""
        job, v = run.status.job, run.request.version
        if run.failed.is_set():
            return
        self._check_cancel(run)
        infos = [run.shards[i] for i in indices]
        nbytes = sum(info.nbytes for info in infos)
        with self._budget.take(nbytes, run.cancel) as ok:
            if not ok:
                raise _Cancelled
            batch = []
            with self._stage(run, "read"):
                for i, info in zip(indices, infos, strict=True):
                    data = np.empty(info.region.shape, storage_dtype(info.dtype))
                    with _permanent():
                        self.store.read_into(job, v, info.tensor, info.region, data, verify=False)
                    batch.append(SmallShard(info.tensor, info.region, info.dtype, info.global_shape, data,
                                            expected=info.checksum, replace=i in stale))
            self._check_cancel(run)
            if run.failed.is_set():
                return
            with self._stage(run, "write"), _permanent(ChecksumMismatch):
                dest.write_shards(job, v, batch)
        run.done.update(indices)
        self.metrics.bytes.inc(nbytes)
        self._progress(run, nbytes, len(indices))

    def _committed_there(self, dest: PersistentStore, job: str, run: _Run) -> bool:
        """A version already committed at the destination holds our shards (a repeated upload: done) or not
        (a conflict nothing can resolve by retrying)."""
        try:
            manifest = dest.manifest(job, run.request.version)
        except NotFound:
            return False
        if not manifest.committed:
            return False
        there = {(s.tensor, s.region): s.checksum for s in manifest.shards}
        wrong = [f"{s.tensor} {s.region.format()}" for s in run.shards if there.get((s.tensor, s.region)) != s.checksum]
        if wrong:
            raise _Permanent(Conflict(f"version {run.request.version} of job {job!r} is already committed at "
                                      f"{run.request.uri} without these shards as this node holds them: "
                                      + ", ".join(wrong[:8])))
        self._update(run, shards_done=len(run.shards), bytes_done=run.status.bytes_total)
        return True

    def _upload_shard(self, run: _Run, dest: PersistentStore, indices: list[int], stale: set[int]) -> None:
        """Upload one shard too large for a batch, piece by piece within the memory budget."""
        [index] = indices
        info = run.shards[index]
        job, v = run.status.job, run.request.version
        if run.failed.is_set():
            return
        self._check_cancel(run)
        writer = dest.open_writer(job, v, info.tensor, info.region, dtype=info.dtype, global_shape=info.global_shape,
                                  piece_bytes=self.settings.piece_bytes, check=False)
        st = storage_dtype(info.dtype)
        largest = max(p.volume for p in writer.pieces) * st.itemsize
        sent = 0
        try:
            with self._budget.take(largest, run.cancel) as ok:
                if not ok:
                    raise _Cancelled
                buf = np.empty(max(1, largest // st.itemsize), st)
                for i, piece in enumerate(writer.pieces):
                    self._check_cancel(run)
                    if run.failed.is_set():
                        return
                    view = buf[: piece.volume].reshape(piece.shape)
                    with _permanent(), self._stage(run, "read"):
                        self.store.read_into(job, v, info.tensor, piece.shift(info.region.start), view, verify=False)
                    with self._stage(run, "write"):
                        writer.write_piece(i, view)
                    nbytes = piece.volume * st.itemsize
                    sent += nbytes
                    self.metrics.bytes.inc(nbytes)
                    self._progress(run, nbytes)
            with _permanent(ChecksumMismatch), self._stage(run, "write"):
                writer.finish(expected=info.checksum)
        except BaseException:
            writer.abort()
            self._progress(run, -sent)  # a piece uploaded for a shard not finished counts again next time
            raise
        run.done.add(index)
        self._progress(run, 0, 1)


def _query_options(request: Request) -> dict[str, Any]:
    return {k: request.query_params[k] for k in ("endpoint", "region") if request.query_params.get(k)}


def upload_router(service: UploadService) -> APIRouter:
    """The daemon's upload and persistent-tier routes (mounted by the node daemon behind its bearer-token check)."""
    router = APIRouter()
    add_task_routes(router, service, parse=lambda body: UploadRequest.from_json(json_body(body, "the upload request")))

    @router.post("/v1/jobs/{job}/uploads/{version}/commit")
    async def commit(job: str, version: str, request: Request) -> dict[str, Any]:
        check_job(job)
        check_version(version)
        body = await request.body()

        def parse_and_commit() -> dict[str, Any]:
            return service.commit(job, version, CommitRequest.from_json(json_body(body, "the commit request")))

        return await to_thread.run_sync(parse_and_commit)

    async def with_store(request: Request, uri: str, use: Callable[[PersistentStore], dict[str, Any]]) -> dict[str, Any]:
        """``use`` of the persistent store at ``uri`` (the request's options), off the event loop."""

        def run() -> dict[str, Any]:
            with service.persistent(uri, _query_options(request)) as store:
                return use(store)

        return await to_thread.run_sync(run)

    @router.get("/v1/jobs/{job}/persistent")
    async def persistent_versions(job: str, request: Request, uri: str) -> dict[str, Any]:
        check_job(job)
        return await with_store(request, uri, lambda store: {"job": job, "uri": store.url,
                                                             "versions": [vi.to_json() for vi in store.versions(job)]})

    @router.get("/v1/jobs/{job}/persistent/{version}")
    async def persistent_manifest(job: str, version: str, request: Request, uri: str) -> dict[str, Any]:
        check_job(job)
        check_version(version)
        return await with_store(request, uri, lambda store: store.manifest(job, version).to_json())

    @router.get("/v1/jobs/{job}/persistent/{version}/ptc")
    async def persistent_ptc(job: str, version: str, request: Request, uri: str) -> dict[str, Any]:
        """The PTC a committed persistent version was saved in (its layout and dataset position)."""
        check_job(job)
        check_version(version)
        return await with_store(request, uri, lambda store: store.ptc_document(job, version))

    @router.delete("/v1/jobs/{job}/persistent/{version}")
    async def persistent_delete(job: str, version: str, request: Request, uri: str) -> dict[str, Any]:
        check_job(job)
        v = check_version(version)

        def delete(store: PersistentStore) -> dict[str, Any]:
            store.delete(job, v)
            log.info("deleted version %s of job %s at %s (retention)", v, job, uri)
            return {"job": job, "version": str(v), "uri": check_uri(uri), "deleted": True}

        return await with_store(request, uri, delete)

    return router


__all__ = ["RECORDS_DIR", "UploadMetrics", "UploadService", "UploadSettings", "upload_router"]
