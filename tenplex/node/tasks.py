"""A node daemon's background tasks, recorded on its disk: what transforms and uploads share.

A store daemon runs two kinds of long task in the background: a host's part
of a reconfiguration (:mod:`tenplex.node.transforms`) and uploads of a
committed version to the persistent tier (:mod:`tenplex.node.uploads`).
Each is identified by (job, version), and both are run, recorded, followed
and cancelled in the same way, by :class:`RecordedTasks`; the services say
what differs (what a task does, what makes two requests the same, which
finished records a new submission keeps).

A task's record is a JSON file on the node's disk,
``<root>/<records dir>/<job>/<version>.json`` (``.transforms``, ``.uploads``:
dot names, which no job may have), always replaced whole. Next to it is a
lock file, ``<version>.lock``, that the process running the task holds with
``flock``: so several daemon processes sharing one root (``--workers``) agree
on who runs it, and a record that says queued or running while nobody holds
the lock belongs to a daemon that died; it reads ``interrupted``. A
cancellation asked of a process that does not run the task leaves a
``<version>.cancel`` file, which the process running it looks for. Records of
tasks finished more than :data:`RECORD_TTL_S` ago are removed at the job's
next submission.

A submission is idempotent: one with the same request (the same digest)
attaches to the running or finished task instead of starting another; one
with a different request for a task that is running, or whose finished record
the service keeps, is a 409. Any other record (interrupted, and what else the
service says) is started anew. At most ``max_running`` tasks run at once in
one process; more wait, ``queued``. States::

    queued -> running -> <done> | failed | cancelled | interrupted

Routes (:func:`add_task_routes`; ``<tasks>`` is ``transforms`` or ``uploads``)::

    POST   /v1/jobs/{job}/<tasks>                     the request -> the record (201 new, 200 attached)
    GET    /v1/jobs/{job}/<tasks>                     the job's records on this node
    GET    /v1/jobs/{job}/<tasks>/{version}[?wait=S]  one record (a long poll: once it has finished, or after S s)
    DELETE /v1/jobs/{job}/<tasks>/{version}           cancel a queued or running task, or forget a finished one
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from anyio import to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tenplex.core.files import atomic_write
from tenplex.errors import Conflict, InvalidInput, NotFound, StoreUnavailable
from tenplex.store.local import LocalStore
from tenplex.store.names import check_job, check_version

log = logging.getLogger(__name__)

RECORD_EVERY_S = 0.5
"""A running task's record on disk is refreshed at most this often."""
CANCEL_WAIT_S = 10.0
"""How long a cancellation waits for its task to stop before it answers."""
LOCK_TRIES = 50
"""A status read holds a record's lock for microseconds: a submission tries again before it attaches."""
MAX_WAIT_S = 30.0
"""The longest a status read may wait for its task to finish."""
RECORD_TTL_S = 7 * 86400.0
"""Records of tasks finished longer ago than this are removed at the next submission of the job."""


class TaskStatus(Protocol):
    """What the service needs of a record (:class:`~tenplex.transformer.remote.TransformStatus`,
    :class:`~tenplex.node.uploads.UploadStatus`)."""

    @property
    def job(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def digest(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def finished_at(self) -> float | None: ...
    @property
    def finished(self) -> bool: ...
    def to_json(self) -> dict[str, Any]: ...


class TaskRequest(Protocol):
    @property
    def version(self) -> Any: ...
    @property
    def digest(self) -> str: ...


RequestT = TypeVar("RequestT", bound=TaskRequest)
StatusT = TypeVar("StatusT", bound=TaskStatus)


@dataclass
class TaskRun(Generic[RequestT, StatusT]):
    """A task running in this process."""

    request: RequestT
    status: StatusT
    lock_fd: int
    """The record's lock, held until the final record is written."""
    cancel: threading.Event = field(default_factory=threading.Event)
    interrupt: bool = False
    """Set with ``cancel`` when the daemon stops: the record then reads ``interrupted``, and a new
    submission runs it again."""
    written_at: float = 0.0
    """When (monotonic) the record was last written."""
    thread: threading.Thread | None = None


RunT = TypeVar("RunT", bound=TaskRun[Any, Any])


class RecordedTasks(ABC, Generic[RequestT, StatusT, RunT]):
    """The tasks of one kind of one node's store: started, followed, cancelled and recorded here.

    Thread-safe; one per daemon process (processes sharing a root coordinate
    through the record and lock files, see the module doc). A subclass says
    what differs: the class attributes, how a request becomes a run
    (:meth:`_new_run`), what a run does (:meth:`_execute`) and the messages.
    """

    KIND: ClassVar[str]
    """``transform``, ``upload``: in messages, thread names and routes."""
    ARTICLE: ClassVar[str] = "a"
    RECORDS_DIR: ClassVar[str]
    """Under the store root; a dot name, which no job may have."""
    STATUS: ClassVar[type[Any]]
    """The records' class (its ``from_json`` reads one)."""

    def __init__(self, store: LocalStore, *, max_running: int) -> None:
        self.store = store
        self._runs: dict[tuple[str, str], RunT] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_running)
        self._finished = threading.Condition(self._lock)
        """Notified whenever a task of this process ends (long polls wake on it)."""
        self._closed = False

    # -- what a service says ------------------------------------------------------------

    @abstractmethod
    def _what(self, job: str, version: str) -> str:
        """The task in messages, without its article: ``transform of job 'j' to 3``."""

    @abstractmethod
    def _other_request(self, status: StatusT, digest: str) -> str:
        """The 409's message when a request with ``digest`` meets ``status`` with another digest."""

    @abstractmethod
    def _keeps(self, record: StatusT) -> bool:
        """Whether a submission attaches to this record (or is a 409) rather than starting the task anew
        (asked of a record nobody runs)."""

    @abstractmethod
    def _new_run(self, job: str, version: str, request: RequestT, record: StatusT | None, lock_fd: int) -> RunT:
        """A new run of ``request`` (state queued), once its request is checked; ``record`` is the one it
        replaces. Raising refuses the submission (nothing is recorded)."""

    @abstractmethod
    def _interrupted(self, record: StatusT) -> StatusT:
        """``record`` (queued or running, but nobody runs it) as ``interrupted``."""

    def _submitted(self, run: RunT) -> None:
        """Called as a run is queued (holding the service's lock)."""

    @abstractmethod
    def _execute(self, run: RunT) -> None:
        """Runs the task in its thread, within a slot (:attr:`_slots`) it takes, and leaves how it ended in
        ``run.status``; the final record is written after it returns."""

    def _ended(self, run: RunT, final: StatusT) -> None:
        """Called once the final record is written and the lock let go (metrics, the log)."""

    # -- files ------------------------------------------------------------------------------

    def _dir(self, job: str) -> Path:
        return self.store.root / self.RECORDS_DIR / check_job(job)

    def _file(self, job: str, version: str, kind: str) -> Path:
        """A task's record (``json``), its lock (``lock``) or its cancel request (``cancel``)."""
        return self._dir(job) / f"{version}.{kind}"

    def _read_record(self, job: str, version: str) -> StatusT | None:
        try:
            record: StatusT = self.STATUS.from_json(json.loads(self._file(job, version, "json").read_text()))
            return record
        except FileNotFoundError:
            return None
        except (OSError, ValueError, InvalidInput) as exc:
            log.warning("%s record %s/%s is unreadable (%s); treating it as absent", self.KIND, job, version, exc)
            return None

    def _write_record(self, status: StatusT) -> None:
        atomic_write(self._file(status.job, status.version, "json"), json.dumps(status.to_json()), make_parents=True)

    def _try_lock(self, job: str, version: str) -> int | None:
        """The record's lock, taken without waiting (its fd), or None when another run holds it."""
        path = self._file(job, version, "lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def _lock_soon(self, job: str, version: str) -> int | None:
        """:meth:`_try_lock`, tried for a moment: a status read may hold the lock for an instant."""
        for _ in range(LOCK_TRIES):
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
                self._file(job, record.version, "lock").unlink(missing_ok=True)

    # -- the API --------------------------------------------------------------------------

    def submit(self, job: str, request: RequestT) -> tuple[StatusT, bool]:
        """Start ``request`` (True) or attach to the task it already is (False)."""
        check_job(job)
        version = str(request.version)
        digest = request.digest
        with self._lock:
            if self._closed:
                raise StoreUnavailable(f"the store daemon is stopping; submit the {self.KIND} again once it is back")
            run = self._runs.get((job, version))
            if run is not None:
                return self._attach(run.status, digest), False
            fd = self._lock_soon(job, version)
            if fd is None:  # another process of this daemon runs it
                record = self._read_record(job, version)
                if record is None:
                    raise Conflict(f"{self.ARTICLE} {self._what(job, version)} is being started; ask again")
                return self._attach(record, digest), False
            try:
                record = self._read_record(job, version)
                if record is not None and self._keeps(record):
                    os.close(fd)
                    fd = -1
                    return self._attach(record, digest), False
                run = self._new_run(job, version, request, record, fd)
                self._file(job, version, "cancel").unlink(missing_ok=True)
                self._prune(job)
                self._write_record(run.status)
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                raise
            self._runs[(job, version)] = run
            self._submitted(run)
            run.thread = threading.Thread(target=self._main, args=(run,), daemon=True,
                                          name=f"tenplex-{self.KIND}-{job}-{version}")
            run.thread.start()
        return run.status, True

    def _attach(self, status: StatusT, digest: str) -> StatusT:
        if status.digest != digest:
            raise Conflict(self._other_request(status, digest))
        return status

    def status(self, job: str, version: str) -> StatusT:
        version = str(check_version(version))
        with self._lock:
            run = self._runs.get((check_job(job), version))
            if run is not None:
                return run.status
        record = self._read_record(job, version)
        if record is None:
            raise NotFound(f"no {self._what(job, version)} on this node")
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
                record = self._interrupted(record)
            return record
        finally:
            os.close(fd)

    def wait(self, job: str, version: str, timeout: float) -> StatusT:
        """:meth:`status`, once the task has finished or ``timeout`` seconds have passed (a long poll:
        the control plane learns of the end at once instead of at its next poll)."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            current = self.status(job, version)
            remaining = deadline - time.monotonic()
            if current.finished or remaining <= 0:
                return current
            with self._finished:  # a task of this process notifies; one of another process is polled
                self._finished.wait(min(remaining, 0.05))

    def list(self, job: str) -> list[StatusT]:
        d = self._dir(job)
        names = sorted(p.name[: -len(".json")] for p in d.glob("*.json")) if d.is_dir() else []
        out = []
        for name in names:
            with contextlib.suppress(NotFound, InvalidInput):  # InvalidInput: a file no version is named as
                out.append(self.status(job, name))
        return out

    def cancel(self, job: str, version: str, *, wait_s: float = CANCEL_WAIT_S) -> StatusT:
        """Cancel a queued or running task and answer its record once it has stopped (or after ``wait_s``);
        a finished task's record is forgotten (what it made is untouched)."""
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
            self._file(job, version, "json").unlink(missing_ok=True)
            self._file(job, version, "cancel").unlink(missing_ok=True)
            return current
        self._file(job, version, "cancel").touch()  # the process running it looks for this file
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            current = self.status(job, version)
            if current.finished:
                break
            time.sleep(0.05)
        return current

    def close(self, timeout: float = 30.0) -> None:
        """Stop every running task (recorded ``interrupted``: a new submission runs it again)."""
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

    # -- running ----------------------------------------------------------------------------

    def _update(self, run: RunT, *, write: bool = True, **changes: Any) -> None:
        """Change the run's status and write its record (unless ``write`` is False), both holding the lock:
        a state a reader is answered is on disk (a daemon killed just after still leaves it)."""
        with self._lock:
            run.status = replace(run.status, **changes)
            if write:
                run.written_at = time.monotonic()
                self._write_record(run.status)

    def _write_soon(self, run: RunT) -> None:
        """Write the run's record if it was last written :data:`RECORD_EVERY_S` ago or earlier (progress)."""
        now = time.monotonic()
        if now - run.written_at >= RECORD_EVERY_S:
            run.written_at = now
            self._write_record(run.status)

    def _cancel_requested(self, run: RunT) -> bool:
        """Whether the run is cancelled, here or by a cancel file (another process's cancellation)."""
        if not run.cancel.is_set() and self._file(run.status.job, run.status.version, "cancel").exists():
            run.cancel.set()
        return run.cancel.is_set()

    def _main(self, run: RunT) -> None:
        """The run's thread: :meth:`_execute`, then the final record, written before the lock is let go."""
        job, version = run.status.job, run.status.version
        try:
            self._execute(run)
        finally:
            with self._lock:
                final = run.status
                try:
                    self._write_record(final)
                except OSError as exc:
                    log.error("cannot write the record of %s %s/%s: %s", self.KIND, job, version, exc)
                self._file(job, version, "cancel").unlink(missing_ok=True)
                self._runs.pop((job, version), None)
                os.close(run.lock_fd)
                self._finished.notify_all()
            self._ended(run, final)


def json_body(body: bytes, what: str) -> Any:
    """A request body's JSON (``what`` names it in the error: ``the upload request``)."""
    try:
        return json.loads(body)
    except ValueError as exc:
        raise InvalidInput(f"{what} is not JSON: {exc}") from None


def add_task_routes(router: APIRouter, service: RecordedTasks[Any, Any, Any], *,
                    parse: Callable[[bytes], Any]) -> None:
    """Add a service's submit, list, status and cancel routes (see the module doc) to ``router``;
    ``parse`` makes the request of a submission's body (JSON, or a service's binary form)."""
    kind = service.KIND
    plural = f"{kind}s"
    path = f"/v1/jobs/{{job}}/{plural}"

    async def submit(job: str, request: Request) -> JSONResponse:
        check_job(job)
        body = await request.body()

        def parse_and_submit() -> tuple[Any, bool]:
            return service.submit(job, parse(body))

        status, created = await to_thread.run_sync(parse_and_submit)
        return JSONResponse(status.to_json(), status_code=201 if created else 200)

    async def list_tasks(job: str) -> dict[str, Any]:
        check_job(job)
        records = await to_thread.run_sync(service.list, job)
        return {"job": job, plural: [r.to_json() for r in records]}

    async def get_task(job: str, version: str, wait: float = 0.0) -> dict[str, Any]:
        check_job(job)
        if not 0.0 <= wait <= MAX_WAIT_S:
            raise InvalidInput(f"wait must be between 0 and {MAX_WAIT_S:g} seconds, got {wait}")
        status = await to_thread.run_sync(service.wait, job, version, wait)
        return status.to_json()

    async def cancel_task(job: str, version: str) -> dict[str, Any]:
        check_job(job)
        status = await to_thread.run_sync(service.cancel, job, version)
        return status.to_json()

    router.add_api_route(path, submit, methods=["POST"], name="submit")
    router.add_api_route(path, list_tasks, methods=["GET"], name=f"list_{plural}")
    router.add_api_route(
        f"{path}/{{version}}", get_task, methods=["GET"], name=f"get_{kind}",
        description=f"``?wait=S`` (at most {MAX_WAIT_S:g}): answer once the {kind} has finished, or after S seconds.",
    )
    router.add_api_route(f"{path}/{{version}}", cancel_task, methods=["DELETE"], name=f"cancel_{kind}")


__all__ = ["MAX_WAIT_S", "RECORD_TTL_S", "RecordedTasks", "TaskRun", "add_task_routes", "json_body"]
