"""Transforms executed by the nodes: a target host's part of a plan runs in that host's store daemon.

The scheduler is a control plane. For a reconfiguration it sends every target
host's daemon that host's sub-plan (:meth:`Plan.for_host`) with the URLs of
the source daemons, polls their progress and cancels what is left when one
fails; it never opens a tensor body or a chunk file. The daemon pulls the
remote pieces straight from the source daemons into its own store, reads its
local pieces from its own disk, hard-links the shards it keeps (no network,
no copy), verifies every checksum and commits. So the bytes of a
reconfiguration cross the network once, from the holder to the host that
needs them, all target hosts in parallel, and no single process carries
them: the Tenplex data path.

Routes (added to the store daemon's app; bearer token as for the store)::

    POST   /v1/jobs/{job}/transforms              {"host", "plan", "sources", "token"} -> the record
    GET    /v1/jobs/{job}/transforms              the job's transform records on this node
    GET    /v1/jobs/{job}/transforms/{version}    one record: state, bytes, rate, error, report
    DELETE /v1/jobs/{job}/transforms/{version}    cancel (nothing is committed) or forget a finished one

A transform is identified by (job, target version), and a submission is
idempotent: a second one with the same sub-plan (after a scheduler restart,
or a retried request) attaches to the running or finished transform instead
of starting another; one with a different sub-plan for the same version is a
409. Its record is a JSON file on the node's disk,
``<root>/.transforms/<job>/<version>.json``, next to a lock file that the
process running it holds with ``flock``: so several daemon processes sharing
one root (``--workers``) agree on who runs it, and a record that says
"running" while nobody holds the lock belongs to a daemon that died; it reads
``interrupted``, and a new submission starts it again from nothing (the
executor drops the uncommitted leftover first). States::

    queued -> running -> committed | failed | cancelled | interrupted

Bounds come from the daemon's settings (:class:`TransformSettings`, from
``tenplex store serve`` flags and the chart's values), not from the caller:
at most ``max_running`` transforms run at once (more wait, ``queued``), each
with ``concurrency`` piece reads in flight and ``memory_bytes / max_running``
of destination buffers. Re-planning onto another replica when a source dies
happens inside the executor, on the node, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from anyio import to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry

from tenplex.core.version import Version
from tenplex.errors import (
    Conflict,
    InvalidInput,
    NotFound,
    StoreUnavailable,
    TenplexError,
    TransformCancelled,
)
from tenplex.store import open_store
from tenplex.store.base import TensorStore
from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore
from tenplex.store.locations import is_persistent_uri
from tenplex.store.names import check_job, check_version
from tenplex.transformer.execute import DEFAULT_BATCH_BYTES, TransformMetrics, execute_host_plan
from tenplex.transformer.plan import CHECKPOINT
from tenplex.transformer.remote import (
    CANCELLED,
    COMMITTED,
    FAILED,
    INTERRUPTED,
    QUEUED,
    RUNNING,
    TransformRequest,
    TransformStatus,
)

log = logging.getLogger(__name__)

RECORDS_DIR = ".transforms"
"""Under the store root; a dot name, which no job may have."""

_RECORD_EVERY_S = 0.5  # a running transform's record on disk is refreshed at most this often
_CANCEL_WAIT_S = 10.0
_LOCK_TRIES = 50  # a status read holds a record's lock for microseconds: a submission tries again before it attaches
MAX_WAIT_S = 30.0
"""The longest a status read may wait for its transform to finish."""
RECORD_TTL_S = 7 * 86400.0
"""Records of transforms finished longer ago than this are removed at the next submission of the job."""


@dataclass(frozen=True)
class TransformSettings:
    """What bounds a daemon's transforms (``tenplex store serve --transform-*``; chart ``store.transforms``)."""

    concurrency: int = 8
    """Piece reads in flight per transform."""
    memory_bytes: int = 1 << 30
    """Destination buffers of all running transforms together (a shard larger than a transform's share
    still runs, alone)."""
    max_running: int = 2
    """Transforms running at once on this node; more wait in state ``queued``."""
    batch_bytes: int = DEFAULT_BATCH_BYTES
    """Remote pieces of one source are pulled in batch reads of up to this many bytes."""
    source_timeout_s: float = 60.0
    """How long a source daemon may leave a read unanswered before it counts as failed (after retries)."""

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.max_running < 1 or self.memory_bytes < 1 or self.batch_bytes < 0:
            raise InvalidInput(
                f"transform settings: concurrency {self.concurrency} (>= 1), max_running {self.max_running} (>= 1), "
                f"memory_bytes {self.memory_bytes} (>= 1), batch_bytes {self.batch_bytes} (>= 0)"
            )
        if self.source_timeout_s <= 0:
            raise InvalidInput(f"transform settings: source_timeout_s must be > 0, got {self.source_timeout_s}")

    @property
    def buffer_bytes(self) -> int:
        """One transform's share of :attr:`memory_bytes`."""
        return max(1, self.memory_bytes // self.max_running)


@dataclass
class _Run:
    """A transform running in this process."""

    request: TransformRequest
    status: TransformStatus
    lock_fd: int
    cancel: threading.Event = field(default_factory=threading.Event)
    interrupt: bool = False
    """Set with ``cancel`` when the daemon stops: the record then reads ``interrupted``, and a new
    submission runs it again."""
    written_at: float = 0.0
    thread: threading.Thread | None = None


class TransformService:
    """The transforms of one node's store: started, followed, cancelled and recorded here.

    Thread-safe; one per daemon process (processes sharing a root coordinate
    through the record and lock files, see the module doc).
    """

    def __init__(
        self,
        store: LocalStore,
        *,
        token: str | None = None,
        settings: TransformSettings | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.store = store
        self.token = token
        self.settings = settings or TransformSettings()
        self.metrics = TransformMetrics(registry)
        self._runs: dict[tuple[str, str], _Run] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.settings.max_running)
        self._finished = threading.Condition(self._lock)
        """Notified whenever a transform of this process ends (long polls wake on it)."""
        self._closed = False

    # -- files ------------------------------------------------------------------

    def _dir(self, job: str) -> Path:
        return self.store.root / RECORDS_DIR / check_job(job)

    def _record_path(self, job: str, version: str) -> Path:
        return self._dir(job) / f"{version}.json"

    def _lock_path(self, job: str, version: str) -> Path:
        return self._dir(job) / f"{version}.lock"

    def _cancel_path(self, job: str, version: str) -> Path:
        return self._dir(job) / f"{version}.cancel"

    def _read_record(self, job: str, version: str) -> TransformStatus | None:
        try:
            return TransformStatus.from_json(json.loads(self._record_path(job, version).read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, InvalidInput) as exc:
            log.warning("transform record %s/%s is unreadable (%s); treating it as absent", job, version, exc)
            return None

    def _write_record(self, status: TransformStatus) -> None:
        path = self._record_path(status.job, status.version)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(status.to_json()))
        os.replace(tmp, path)

    def _lock_soon(self, job: str, version: str) -> int | None:
        """:meth:`_try_lock`, tried for a moment: a status read may hold the lock for an instant."""
        for _ in range(_LOCK_TRIES):
            fd = self._try_lock(job, version)
            if fd is not None:
                return fd
            time.sleep(0.01)
        return None

    def _prune(self, job: str) -> None:
        d = self._dir(job)
        if not d.is_dir():
            return
        now = time.time()
        for path in d.glob("*.json"):
            record = self._read_record(job, path.name[: -len(".json")])
            if record is not None and record.finished and now - (record.finished_at or now) > RECORD_TTL_S:
                path.unlink(missing_ok=True)
                self._lock_path(job, record.version).unlink(missing_ok=True)

    def _try_lock(self, job: str, version: str) -> int | None:
        """The record's lock, taken without waiting (its fd), or None when another run holds it."""
        path = self._lock_path(job, version)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    # -- the API ------------------------------------------------------------------

    def submit(self, job: str, request: TransformRequest) -> tuple[TransformStatus, bool]:
        """Start ``request`` (True) or attach to the transform it already is (False)."""
        if request.plan.job != job:
            raise InvalidInput(f"the plan is for job {request.plan.job!r}, the request names {job!r}")
        version = str(request.version)
        digest = request.digest
        with self._lock:
            if self._closed:
                raise StoreUnavailable("the store daemon is stopping; submit the transform again once it is back")
            run = self._runs.get((job, version))
            if run is not None:
                return self._same_plan(run.status, digest), False
            fd = self._lock_soon(job, version)
            if fd is None:  # another process of this daemon runs it
                record = self._read_record(job, version)
                if record is None:
                    raise Conflict(f"a transform of job {job!r} to {version} is being started; ask again")
                return self._same_plan(record, digest), False
            try:
                record = self._read_record(job, version)
                if record is not None and record.state not in (QUEUED, RUNNING, INTERRUPTED):
                    os.close(fd)
                    return self._same_plan(record, digest), False
                if record is not None and record.state != INTERRUPTED:
                    log.warning("transform of %s to %s was %s in a daemon that is gone: starting it again",
                                job, version, record.state)
                if record is None and self._committed(job, request.version):
                    raise Conflict(
                        f"version {version} of job {job!r} is already committed on this node, and no transform "
                        "record says which plan wrote it; delete the version to transform into it again"
                    )
                self._cancel_path(job, version).unlink(missing_ok=True)
                self._prune(job)
                hp = request.plan.host(request.host)
                status = TransformStatus(
                    job=job, version=version, host=request.host, old_version=str(request.plan.old_version),
                    digest=digest, state=QUEUED, bytes_total=hp.bytes_total, submitted_at=time.time(),
                )
                self._write_record(status)
            except BaseException:
                os.close(fd)
                raise
            run = _Run(request, status, fd)
            self._runs[(job, version)] = run
            run.thread = threading.Thread(target=self._execute, args=(run,), name=f"tenplex-transform-{job}-{version}",
                                          daemon=True)
            run.thread.start()
        log.info("transform of %s to %s on %s submitted: %d bytes from %s", job, version, request.host,
                 status.bytes_total, ", ".join(sorted(request.plan.sources_of(request.host))) or "this node only")
        return status, True

    @staticmethod
    def _same_plan(status: TransformStatus, digest: str) -> TransformStatus:
        if status.digest != digest:
            raise Conflict(
                f"a transform of job {status.job!r} to {status.version} exists with another plan "
                f"(digest {status.digest}, this one {digest}, state {status.state}); a plan must write a new version"
            )
        return status

    def _committed(self, job: str, version: Version) -> bool:
        try:
            return any(v.version == version and v.committed for v in self.store.versions(job))
        except NotFound:
            return False

    def status(self, job: str, version: str) -> TransformStatus:
        version = str(check_version(version))
        with self._lock:
            run = self._runs.get((check_job(job), version))
            if run is not None:
                return run.status
        record = self._read_record(job, version)
        if record is None:
            raise NotFound(f"no transform of job {job!r} to {version} on this node")
        if record.finished:
            return record
        fd = self._try_lock(job, version)
        if fd is None:  # its owner (another process of this daemon) is running it
            return self._read_record(job, version) or record
        try:
            # A run writes its final record before it lets the lock go: read again, holding the lock.
            record = self._read_record(job, version) or record
            with self._lock:
                run = self._runs.get((job, version))
            if run is not None:
                return run.status
            if not record.finished:  # nobody runs it: the daemon that did has died
                record = replace(record, state=INTERRUPTED, finished_at=record.finished_at or time.time(),
                                 error=record.error or "the daemon running this transform stopped before it finished",
                                 error_code="interrupted")
            return record
        finally:
            os.close(fd)

    def wait(self, job: str, version: str, timeout: float) -> TransformStatus:
        """:meth:`status`, once the transform has finished or ``timeout`` seconds have passed (a long poll:
        the control plane learns of a commit at once instead of at its next poll)."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            current = self.status(job, version)
            remaining = deadline - time.monotonic()
            if current.finished or remaining <= 0:
                return current
            with self._finished:  # a transform of this process notifies; one of another process is polled
                self._finished.wait(min(remaining, 0.05))

    def list(self, job: str) -> list[TransformStatus]:
        d = self._dir(job)
        names = sorted(p.name[: -len(".json")] for p in d.glob("*.json")) if d.is_dir() else []
        out = []
        for name in names:
            with contextlib.suppress(NotFound):
                out.append(self.status(job, name))
        return out

    def cancel(self, job: str, version: str, *, wait_s: float = _CANCEL_WAIT_S) -> TransformStatus:
        """Cancel a queued or running transform (nothing is committed) and answer its record once it has
        stopped (or after ``wait_s``); a finished transform's record is forgotten (its data is untouched)."""
        version = str(check_version(version))
        with self._lock:
            run = self._runs.get((check_job(job), version))
        if run is not None:
            run.cancel.set()
            if run.thread is not None:
                run.thread.join(wait_s)
            return run.status
        current = self.status(job, version)
        if current.finished:
            self._record_path(job, version).unlink(missing_ok=True)
            self._cancel_path(job, version).unlink(missing_ok=True)
            return current
        self._cancel_path(job, version).touch()  # the process running it looks for this file
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            current = self.status(job, version)
            if current.finished:
                break
            time.sleep(0.05)
        return current

    def close(self, timeout: float = 30.0) -> None:
        """Stop every running transform (recorded ``interrupted``: a new submission runs it again)."""
        with self._lock:
            self._closed = True
            runs = list(self._runs.values())
        for run in runs:
            run.interrupt = True
            run.cancel.set()
        deadline = time.monotonic() + timeout
        for run in runs:
            if run.thread is not None:
                run.thread.join(max(0.0, deadline - time.monotonic()))

    # -- running ------------------------------------------------------------------

    def _update(self, run: _Run, **changes: Any) -> None:
        with self._lock:
            run.status = replace(run.status, **changes)

    def _progress(self, run: _Run, done: int, _total: int) -> None:
        now = time.monotonic()
        if now - run.written_at < _RECORD_EVERY_S:
            run.status = replace(run.status, bytes_done=done)  # a plain attribute swap: readers see old or new
            return
        run.written_at = now
        self._update(run, bytes_done=done)
        self._write_record(run.status)

    def _watch(self, run: _Run, clients: Mapping[str, StoreClient], done: threading.Event) -> None:
        """Until ``done``: a cancel (here, or by another daemon process's cancel file) cuts the source
        connections, so that reads waiting on a source that does not answer end now, not at their timeout."""
        cancel_file = self._cancel_path(run.status.job, run.status.version)
        while not done.wait(0.1):
            if not run.cancel.is_set() and cancel_file.exists():
                run.cancel.set()
            if run.cancel.is_set():
                for c in clients.values():
                    c.abort()
                return

    def _execute(self, run: _Run) -> None:
        req = run.request
        plan = req.plan
        job, version = plan.job, str(plan.new_version)
        clients: dict[str, StoreClient] = {}
        checkpoint: TensorStore | None = None
        done = threading.Event()
        try:
            with self._slots:
                if self._cancel_path(job, version).exists():
                    run.cancel.set()
                if run.cancel.is_set():
                    raise TransformCancelled(f"transform of {req.host} to {version} was cancelled while queued")
                self._update(run, state=RUNNING, started_at=time.time())
                self._write_record(run.status)
                urls = {h: u for h, u in req.sources.items() if h != req.host}
                if plan.checkpoint is not None:
                    urls.setdefault(CHECKPOINT, plan.checkpoint)
                token = req.token if req.token is not None else self.token
                for name, url in urls.items():
                    if name == CHECKPOINT and is_persistent_uri(url):
                        continue
                    clients[name] = StoreClient(url, token, timeout=self.settings.source_timeout_s,
                                                max_connections=max(8, self.settings.concurrency))
                threading.Thread(target=self._watch, args=(run, clients, done), daemon=True,
                                 name=f"tenplex-transform-watch-{job}-{version}").start()
                sources: dict[str, TensorStore] = dict(clients)
                if CHECKPOINT in urls and CHECKPOINT not in clients:
                    # the persistent tier: the regions no survivor holds, read from the object store or shared
                    # file system with the daemon's credentials (its AWS environment) and the request's options
                    checkpoint = open_store(urls[CHECKPOINT], options=req.checkpoint_options)
                    sources[CHECKPOINT] = checkpoint
                report = execute_host_plan(
                    plan, req.host, target=self.store, sources=sources, concurrency=self.settings.concurrency,
                    progress=lambda done, total: self._progress(run, done, total), metrics=self.metrics,
                    max_buffer_bytes=self.settings.buffer_bytes, batch_bytes=self.settings.batch_bytes,
                    cancel=run.cancel,
                )
            self._update(run, state=COMMITTED, bytes_done=report.bytes_total, finished_at=time.time(),
                         report=report.to_json())
        except TransformCancelled as exc:
            if run.interrupt:
                self._update(run, state=INTERRUPTED, finished_at=time.time(), error_code="interrupted",
                             error="the store daemon stopped during the transform; nothing was committed")
            else:
                self._update(run, state=CANCELLED, finished_at=time.time(), error=exc.detail, error_code=exc.code)
        except TenplexError as exc:
            self._update(run, state=FAILED, finished_at=time.time(), error=exc.detail, error_code=exc.code)
        except Exception as exc:  # the record must say what happened, whatever it was
            log.exception("transform of %s to %s failed unexpectedly", job, version)
            self._update(run, state=FAILED, finished_at=time.time(), error=f"{type(exc).__name__}: {exc}",
                         error_code="internal_error")
        finally:
            done.set()
            for c in clients.values():
                c.close()
            if checkpoint is not None:
                checkpoint.close()
            with self._lock:
                final = run.status
                try:
                    self._write_record(final)
                except OSError as exc:
                    log.error("cannot write the record of transform %s/%s: %s", job, version, exc)
                self._cancel_path(job, version).unlink(missing_ok=True)
                self._runs.pop((job, version), None)
                os.close(run.lock_fd)
                self._finished.notify_all()
            if final.state == COMMITTED:
                log.info("transform of %s to %s on %s committed in %.2f s", job, version, req.host, final.seconds)
            else:
                log.warning("transform of %s to %s on %s %s: %s", job, version, req.host, final.state, final.error)


def transform_router(service: TransformService) -> APIRouter:
    """The daemon's transform routes (mounted by the node daemon behind its bearer-token check)."""
    router = APIRouter()

    @router.post("/v1/jobs/{job}/transforms")
    async def submit(job: str, request: Request) -> JSONResponse:
        check_job(job)
        body = await request.body()

        def parse_and_submit() -> tuple[TransformStatus, bool]:
            try:
                obj = json.loads(body)
            except ValueError as exc:
                raise InvalidInput(f"the transform request is not JSON: {exc}") from None
            return service.submit(job, TransformRequest.from_json(obj))

        status, created = await to_thread.run_sync(parse_and_submit)
        return JSONResponse(status.to_json(), status_code=201 if created else 200)

    @router.get("/v1/jobs/{job}/transforms")
    async def list_transforms(job: str) -> dict[str, Any]:
        check_job(job)
        records = await to_thread.run_sync(service.list, job)
        return {"job": job, "transforms": [r.to_json() for r in records]}

    @router.get("/v1/jobs/{job}/transforms/{version}")
    async def get_transform(job: str, version: str, wait: float = 0.0) -> dict[str, Any]:
        """``?wait=S`` (at most 30): answer once the transform has finished, or after S seconds."""
        check_job(job)
        if not 0.0 <= wait <= MAX_WAIT_S:
            raise InvalidInput(f"wait must be between 0 and {MAX_WAIT_S:g} seconds, got {wait}")
        status = await to_thread.run_sync(service.wait, job, version, wait)
        return status.to_json()

    @router.delete("/v1/jobs/{job}/transforms/{version}")
    async def cancel_transform(job: str, version: str) -> dict[str, Any]:
        check_job(job)
        status = await to_thread.run_sync(service.cancel, job, version)
        return status.to_json()

    return router


