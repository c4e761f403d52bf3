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

    POST   /v1/jobs/{job}/transforms              a TransformRequest -> the record (the scheduler sends the
                                                  binary form: the host's part as tenplex.transformer.part;
                                                  JSON {"host", "plan", "sources", "token"} is read too)
    GET    /v1/jobs/{job}/transforms              the job's transform records on this node
    GET    /v1/jobs/{job}/transforms/{version}    one record: state, bytes, rate, error, report
    DELETE /v1/jobs/{job}/transforms/{version}    cancel (nothing is committed) or forget a finished one

A transform is identified by (job, target version) and recorded on the
node's disk (``<root>/.transforms/<job>/<version>.json``) as every task of
the daemon is (:mod:`tenplex.node.tasks`): the same sub-plan submitted again
(a scheduler restart, a retried request) attaches to it, another one for the
same version is a 409, and one its dead daemon left ``interrupted`` starts
again from nothing (the executor drops the uncommitted leftover first). A
cancelled transform commits nothing. States::

    queued -> running -> committed | failed | cancelled | interrupted

Bounds come from the daemon's settings (:class:`TransformSettings`, from
``tenplex store serve`` flags and the chart's values), not from the caller:
at most ``max_running`` transforms run at once (more wait, ``queued``), each
with ``concurrency`` piece reads in flight and ``memory_bytes / max_running``
of destination buffers. Re-planning onto another replica when a source dies
happens inside the executor, on the node, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

from fastapi import APIRouter
from prometheus_client import CollectorRegistry

from tenplex.errors import (
    Conflict,
    InvalidInput,
    TenplexError,
    TransformCancelled,
)
from tenplex.node.tasks import RECORD_EVERY_S, RecordedTasks, TaskRun, add_task_routes
from tenplex.store import open_store
from tenplex.store.base import TensorStore
from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore
from tenplex.store.locations import is_persistent_uri
from tenplex.transformer.execute import (
    DEFAULT_BATCH_BYTES,
    BufferPool,
    TransformMetrics,
    execute_host_plan,
)
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
    buffer_keep_s: float = 60.0
    """Destination buffers are kept this long after the last transform for the next ones (the transforms of
    a burst of reconfigurations then fault in and zero no fresh memory); 0: freed when each transform ends."""
    resident_bytes: int = 0
    """Destination-buffer memory faulted in at start-up, in the background, and held for the daemon's life
    (at most :attr:`memory_bytes`): a daemon's first transform then zeroes no fresh pages (the kernel's page
    zeroing was 36% of the daemons' CPU in the 8-host tp-pp case of benchmarks/cluster_reshard.py). 0 (the
    library's default, for memory-tight nodes): nothing held, buffers are faulted in by the first transform
    and let go :attr:`buffer_keep_s` after the last. ``tenplex store serve`` holds one transform's share
    (:attr:`buffer_bytes`) by default, the chart 1 GiB."""

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.max_running < 1 or self.memory_bytes < 1 or self.batch_bytes < 0:
            raise InvalidInput(
                f"transform settings: concurrency {self.concurrency} (>= 1), max_running {self.max_running} (>= 1), "
                f"memory_bytes {self.memory_bytes} (>= 1), batch_bytes {self.batch_bytes} (>= 0)"
            )
        if self.source_timeout_s <= 0:
            raise InvalidInput(f"transform settings: source_timeout_s must be > 0, got {self.source_timeout_s}")
        if self.buffer_keep_s < 0:
            raise InvalidInput(f"transform settings: buffer_keep_s must be >= 0, got {self.buffer_keep_s}")
        if not 0 <= self.resident_bytes <= self.memory_bytes:
            raise InvalidInput(f"transform settings: resident_bytes must be between 0 and memory_bytes "
                               f"({self.memory_bytes}), got {self.resident_bytes}")

    @property
    def buffer_bytes(self) -> int:
        """One transform's share of :attr:`memory_bytes`."""
        return max(1, self.memory_bytes // self.max_running)


_Run = TaskRun[TransformRequest, TransformStatus]


class TransformService(RecordedTasks[TransformRequest, TransformStatus, _Run]):
    """The transforms of one node's store: started, followed, cancelled and recorded here.

    Thread-safe; one per daemon process (processes sharing a root coordinate
    through the record and lock files, see :mod:`tenplex.node.tasks`).
    """

    KIND = "transform"
    RECORDS_DIR = RECORDS_DIR
    STATUS = TransformStatus

    def __init__(
        self,
        store: LocalStore,
        *,
        token: str | None = None,
        settings: TransformSettings | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.token = token
        self.settings = settings or TransformSettings()
        self.metrics = TransformMetrics(registry)
        # one pool of destination buffers for all transforms of this daemon (see BufferPool); its resident
        # bytes are faulted in in the background: the daemon is ready meanwhile, a transform that starts
        # before it is done faults the rest in itself
        self.buffers = BufferPool(self.settings.memory_bytes, keep_s=self.settings.buffer_keep_s,
                                  resident=self.settings.resident_bytes)
        if self.buffers.resident_bytes:
            threading.Thread(target=self.buffers.prefault, daemon=True, name="tenplex-transform-prefault").start()
        super().__init__(store, max_running=self.settings.max_running)

    def submit(self, job: str, request: TransformRequest) -> tuple[TransformStatus, bool]:
        """Start ``request`` (True) or attach to the transform it already is (False): one with the same
        sub-plan attaches to any record but an interrupted one, which starts anew."""
        if request.plan.job != job:
            raise InvalidInput(f"the plan is for job {request.plan.job!r}, the request names {job!r}")
        return super().submit(job, request)

    def _what(self, job: str, version: str) -> str:
        return f"transform of job {job!r} to {version}"

    def _other_request(self, status: TransformStatus, digest: str) -> str:
        return (f"a transform of job {status.job!r} to {status.version} exists with another plan "
                f"(digest {status.digest}, this one {digest}, state {status.state}); a plan must write a new version")

    def _keeps(self, record: TransformStatus) -> bool:
        return record.state not in (QUEUED, RUNNING, INTERRUPTED)

    def _new_run(self, job: str, version: str, request: TransformRequest, record: TransformStatus | None,
                 lock_fd: int) -> _Run:
        if record is not None and record.state != INTERRUPTED:
            log.warning("transform of %s to %s was %s in a daemon that is gone: starting it again",
                        job, version, record.state)
        if record is None and self.store.is_committed(job, request.version):
            raise Conflict(
                f"version {version} of job {job!r} is already committed on this node, and no transform "
                "record says which plan wrote it; delete the version to transform into it again"
            )
        hp = request.plan.host(request.host)
        status = TransformStatus(
            job=job, version=version, host=request.host, old_version=str(request.plan.old_version),
            digest=request.digest, state=QUEUED, bytes_total=hp.bytes_total, submitted_at=time.time(),
        )
        return _Run(request, status, lock_fd)

    def _submitted(self, run: _Run) -> None:
        request, status = run.request, run.status
        log.info("transform of %s to %s on %s submitted: %d bytes from %s", status.job, status.version, request.host,
                 status.bytes_total, ", ".join(sorted(request.plan.sources_of(request.host))) or "this node only")

    def _interrupted(self, record: TransformStatus) -> TransformStatus:
        return replace(record, state=INTERRUPTED, finished_at=record.finished_at or time.time(),
                       error=record.error or "the daemon running this transform stopped before it finished",
                       error_code="interrupted")

    # -- running ------------------------------------------------------------------

    def _progress(self, run: _Run, done: int, _total: int) -> None:
        if time.monotonic() - run.written_at < RECORD_EVERY_S:
            run.status = replace(run.status, bytes_done=done)  # a plain attribute swap: readers see old or new
            return
        self._update(run, bytes_done=done)

    def _watch(self, run: _Run, clients: Mapping[str, StoreClient], done: threading.Event) -> None:
        """Until ``done``: a cancel (here, or by another daemon process's cancel file) cuts the source
        connections, so that reads waiting on a source that does not answer end now, not at their timeout."""
        while not done.wait(0.1):
            if self._cancel_requested(run):
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
                if self._cancel_requested(run):
                    raise TransformCancelled(f"transform of {req.host} to {version} was cancelled while queued")
                self._update(run, state=RUNNING, started_at=time.time())
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
                    cancel=run.cancel, buffers=self.buffers,
                )
            self._update(run, write=False, state=COMMITTED, bytes_done=report.bytes_total, finished_at=time.time(),
                         report=report.to_json())
        except TransformCancelled as exc:
            if run.interrupt:
                self._update(run, write=False, state=INTERRUPTED, finished_at=time.time(), error_code="interrupted",
                             error="the store daemon stopped during the transform; nothing was committed")
            else:
                self._update(run, write=False, state=CANCELLED, finished_at=time.time(), error=exc.detail,
                             error_code=exc.code)
        except TenplexError as exc:
            self._update(run, write=False, state=FAILED, finished_at=time.time(), error=exc.detail, error_code=exc.code)
        except Exception as exc:  # the record must say what happened, whatever it was
            log.exception("transform of %s to %s failed unexpectedly", job, version)
            self._update(run, write=False, state=FAILED, finished_at=time.time(), error=f"{type(exc).__name__}: {exc}",
                         error_code="internal_error")
        finally:
            done.set()
            for c in clients.values():
                c.close()
            if checkpoint is not None:
                checkpoint.close()

    def _ended(self, run: _Run, final: TransformStatus) -> None:
        if final.state == COMMITTED:
            log.info("transform of %s to %s on %s committed in %.2f s", final.job, final.version, run.request.host,
                     final.seconds)
        else:
            log.warning("transform of %s to %s on %s %s: %s", final.job, final.version, run.request.host, final.state,
                        final.error)


def transform_router(service: TransformService) -> APIRouter:
    """The daemon's transform routes (mounted by the node daemon behind its bearer-token check)."""
    router = APIRouter()
    add_task_routes(router, service, parse=TransformRequest.from_body)
    return router
