"""The scheduler's REST API (FastAPI; OpenAPI at ``/openapi.json``, docs at ``/docs``).

Users create, inspect, scale and delete jobs and report events; workers speak
the protocol of :mod:`tenplex.core.protocol`. Everything but
``/healthz`` needs ``Authorization: Bearer <credential>`` when the scheduler has a
token or a key set (:mod:`tenplex.core.auth`): the admin credential reaches
every route; a job's worker credential only that job's routes (its status,
plan, PTC, ``peer_failure`` events, the worker protocol), a job's reader
credential only its GET routes; never another job's, the job list, the hosts,
metrics, a scale, a cordon or a delete. Every error is
``{"error": code, "detail": message}``; bad requests are 4xx, never 5xx.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import anyio
import anyio.to_thread
from anyio.lowlevel import RunVar
from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tenplex import __version__
from tenplex.core import protocol as P
from tenplex.core.auth import Authenticator, Principal, require_admin
from tenplex.errors import Conflict, Forbidden, InvalidInput, TenplexError, Unauthorized
from tenplex.ptc import ParallelConfig
from tenplex.scheduler.controller import JobController
from tenplex.scheduler.jobspec import JobCreate
from tenplex.scheduler.launcher import ptc_digest
from tenplex.scheduler.service import Scheduler

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"description": text, "content": {"application/json": {"example": {"error": "code", "detail": "message"}}}}
    for code, text in ((400, "Bad request"), (401, "Missing, forged or expired credential"),
                       (403, "The credential does not reach this job or route"), (404, "Unknown job or worker"),
                       (409, "Conflicts with the job's state"))
}


_ADMIN_JOB_ROUTES = frozenset({("DELETE", "/v1/jobs/{job}"), ("POST", "/v1/jobs/{job}/scale"),
                               ("PUT", "/v1/jobs/{job}")})
"""Routes of one job that its own credential does not reach: deleting it, changing its GPUs (the cluster's) or
its spec."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ParallelBody(_Body):
    dp: int = Field(1, ge=1, le=1 << 20)
    tp: int = Field(1, ge=1, le=1 << 12)
    pp: int = Field(1, ge=1, le=1 << 12)
    zero: int = Field(0, ge=0, le=3)


class ScaleBody(_Body):
    gpus: int = Field(ge=0, le=1 << 20, description=(
        "The new GPU count; 0 suspends the job (state kept on the node stores), a later count resumes it."))
    parallel: ParallelBody | None = Field(None, description=(
        "The configuration to run in (dp x tp x pp = gpus), instead of the policy's choice: also a change of "
        "layout at the same GPU count."))


class EventBody(_Body):
    kind: Literal["peer_failure", "cordon", "uncordon"]
    host: str | None = Field(None, min_length=1, max_length=253)
    detail: str = Field("", max_length=4000)


def create_app(scheduler: Scheduler, *, token: str | None) -> FastAPI:
    app = _SchedulerApp(
        title="Tenplex scheduler",
        version=__version__,
        description="Elastic multi-dimensional-parallel training jobs: create, scale, observe; the worker protocol.",
        responses=ERROR_RESPONSES,
    )
    metrics = scheduler.metrics
    _view = _Views()

    issuer = scheduler.settings.credentials
    authn = Authenticator(token, issuer.keys if issuer is not None else None)

    def auth(request: Request) -> Principal:
        """Authenticate; a job's credential reaches only routes of its own ``{job}`` (not a scale or delete)."""
        principal = authn.authenticate(request.headers.get("authorization"))
        request.state.principal = principal
        if principal.is_admin:
            return principal
        job = request.path_params.get("job")
        what = f"{request.method} {getattr(request.scope.get('route'), 'path', request.url.path)}"
        if not isinstance(job, str) or (request.method, what.split(" ", 1)[1]) in _ADMIN_JOB_ROUTES:
            require_admin(principal, what)
        elif not (principal.can_write(job) or (request.method == "GET" and principal.can_read(job))):
            raise Forbidden(f"a {principal.describe()} may not call {what} of job {job!r}")
        return principal

    async def authorized(request: Request) -> Principal:
        """``auth`` as the routes' dependency, run on the event loop (a token compare or a cached signature check:
        microseconds). A plain ``def`` dependency is run in a worker thread, and those threads can all be
        taken: worker reports and registrations wait in them for a job's lock while its controller holds it
        across a Kubernetes call (a node loss's pod deletions: up to their 10 s grace), and a
        ``GET /v1/jobs/{job}``, which never waits on the lock itself, waited that long for a thread."""
        return auth(request)

    Auth = Depends(authorized)

    @app.exception_handler(TenplexError)
    async def _tenplex_error(_: Request, exc: TenplexError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else None
        return JSONResponse(exc.to_json(), status_code=exc.http_status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": "invalid_input", "detail": _validation_detail(exc.errors())}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse({"error": code, "detail": str(exc.detail)}, status_code=exc.status_code)

    app.add_middleware(_Timing, metrics=metrics)
    app.worker_reports = _WorkerReports(scheduler, authn, metrics)

    # -- health and metrics ----------------------------------------------------

    @app.get("/healthz", tags=["ops"], summary="Liveness and readiness (no auth)")
    async def healthz() -> dict[str, str]:  # on the event loop: never waits for a worker thread
        return {"status": "ok"}

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics", dependencies=[Auth],
             response_class=Response)
    def prometheus() -> Response:
        for ctl in scheduler.list():
            metrics.gpus.labels(ctl.spec.name).set(ctl.status.gpus)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- jobs ------------------------------------------------------------------

    @app.post("/v1/jobs", status_code=201, tags=["jobs"], summary="Create a job", dependencies=[Auth])
    def create_job(body: JobCreate) -> dict[str, Any]:
        spec = body.to_job_spec()
        ctl = scheduler.create(spec)
        return _view(ctl)

    @app.get("/v1/jobs", tags=["jobs"], summary="List jobs with their status", dependencies=[Auth])
    def list_jobs() -> dict[str, Any]:
        return {"jobs": [_view(c, wait=VIEW_WAIT_S) for c in scheduler.list()]}

    @app.get("/v1/jobs/{job}", tags=["jobs"], summary="A job: configuration, step, workers, history",
             dependencies=[Auth], response_model=dict[str, Any], description=(
                 "Never waits on a busy job controller for more than 50 ms: while it holds the job (planning a "
                 "large job, recording a registration), the answer is the job's last consistent view. A job whose "
                 "view takes longer than 20 ms to make (thousands of workers) is answered with its last view, "
                 "made again in the background at most every max(1 s, 5 x the time it takes)."))
    async def get_job(job: P.JobName) -> Response:
        # The read every dashboard and `tenplex job get` polls, answered on the event loop (a copy of the
        # record and the C JSON encoder: a millisecond or two for a thousand workers). A busy lock is looked
        # at again every few milliseconds for at most VIEW_WAIT_S, then the last view answers; no worker
        # thread is taken (they may all be waiting for this job's lock, registering a thousand workers).
        # At 16,384 workers a view is 3 MB of JSON and 0.2-0.4 s of CPU: made on the event loop at every poll
        # it would hold up every heartbeat batch behind it, so a large job's view is made again in a thread,
        # not more often than VIEW_REFRESH_S or VIEW_REFRESH_FACTOR times what it costs.
        ctl = scheduler.get(job)
        large = _view.large(ctl)
        if large is not None:
            _view.refresh_soon(ctl)
            return Response(large, media_type="application/json")
        deadline = time.monotonic() + VIEW_WAIT_S
        start = time.perf_counter()
        while (view := _view.now(ctl)) is None and time.monotonic() < deadline:
            await asyncio.sleep(VIEW_POLL_S)
        if view is None:
            view = _view.last(ctl) or await run_in_threadpool(_view, ctl)
            return Response(json.dumps(view, separators=(",", ":"), allow_nan=False), media_type="application/json")
        body = json.dumps(view, separators=(",", ":"), allow_nan=False).encode()
        _view.encoded(ctl, body, time.perf_counter() - start)
        return Response(body, media_type="application/json")

    @app.put("/v1/jobs/{job}", status_code=202, tags=["jobs"], summary="Change a live job's spec",
             dependencies=[Auth], description=(
                 "The job's whole spec, as created: what the workers start with (command, env, image, steps, "
                 "snapshot_every, standby) is applied by a redeploy at the next step boundary (same layout, state "
                 "kept); what only the scheduler reads (min/max GPUs, heartbeat timeout, max_restarts, the "
                 "checkpoint's cadence) at once; a different gpus is a scale. A change of what the state is "
                 "(layout, dataset, policy, gpus_per_pod, resume_from, checkpoint uri) is refused (400)."))
    def replace_job(job: P.JobName, body: JobCreate) -> dict[str, Any]:
        if body.name != job:
            raise InvalidInput(f"the body names job {body.name!r}, the path {job!r}")
        return _view(scheduler.update(job, body.to_job_spec()))

    @app.delete("/v1/jobs/{job}", tags=["jobs"], summary="Stop a job's workers and forget it", dependencies=[Auth])
    def delete_job(job: P.JobName) -> dict[str, Any]:
        scheduler.delete(job)
        return {"deleted": job}

    @app.post("/v1/jobs/{job}/scale", status_code=202, tags=["jobs"], summary="Change the job's GPU count",
              dependencies=[Auth])
    def scale_job(job: P.JobName, body: ScaleBody) -> dict[str, Any]:
        ctl = scheduler.get(job)
        parallel = ParallelConfig.from_json(body.parallel.model_dump()) if body.parallel is not None else None
        ctl.request_scale(body.gpus, parallel)
        return _view(ctl)

    @app.post("/v1/jobs/{job}/events", status_code=202, tags=["jobs"], summary="Report an event", dependencies=[Auth])
    def report_event(job: P.JobName, body: EventBody, request: Request) -> dict[str, Any]:
        if body.kind != "peer_failure":  # a host's cordon concerns every job on it
            require_admin(request.state.principal, f"a {body.kind} event")
        ctl = scheduler.get(job)
        if body.kind == "peer_failure":
            ctl.report_failure(f"peer failure reported through the API: {body.detail or 'no detail'}")
        else:
            if body.host is None:
                raise InvalidInput(f"a {body.kind} event needs a host")
            scheduler.backend.set_schedulable(body.host, body.kind == "uncordon")
            if body.kind == "cordon":
                ctl.request_redeploy("redeploy")
        return _view(ctl)

    @app.get("/v1/jobs/{job}/plan", tags=["jobs"], summary="The current or last reconfiguration plan, explained",
             dependencies=[Auth])
    def get_plan(job: P.JobName) -> dict[str, Any]:
        ctl = scheduler.get(job)
        with ctl.lock:
            plan = ctl.plan()
            inputs = dict(ctl.status.last_plan or {})
        # Rendered when asked for, not kept in the record: the record keeps only what the plan is computed from.
        return {"explain": plan.explain(), "plan": plan.to_json(), "inputs": inputs.get("inputs")}

    @app.get("/v1/jobs/{job}/ptc", tags=["jobs"], summary="The PTC of a generation (default: current)",
             dependencies=[Auth])
    def get_ptc(request: Request, job: P.JobName,
                generation: Annotated[int | None, Query(ge=0, le=1 << 30)] = None,
                digest: Annotated[str | None, Query(max_length=64)] = None) -> Response:
        ctl = scheduler.get(job)
        gen = ctl.status.generation if generation is None else generation
        ptc = ctl.ptc(gen)
        if digest is not None and digest != ptc_digest(ptc):  # the ptc_url of a job since deleted and created again
            raise Conflict(f"generation {gen} of job {job} has another PTC than the one with digest {digest}")
        if "gzip" in request.headers.get("accept-encoding", ""):
            # Every worker of a generation fetches it: gzipped once, 15-20x fewer bytes to send each of them.
            return Response(ptc.gzipped_json, media_type="application/json", headers={"Content-Encoding": "gzip"})
        return Response(ptc.dumps(), media_type="application/json")  # the PTC keeps its JSON

    @app.get("/v1/hosts", tags=["cluster"], summary="Hosts known to the backend", dependencies=[Auth])
    def hosts() -> dict[str, Any]:
        return {"backend": scheduler.backend.name, "hosts": [h.__dict__ for h in scheduler.backend.hosts()]}

    # -- the worker protocol -------------------------------------------------------

    @app.post(P.REGISTER_PATH, tags=["workers"], summary="A worker registers; returns its assignment",
              dependencies=[Auth], description="Answered by the API's worker-report path (see `_WorkerReports`) "
                                               "before routing; same contract.")
    def register(job: P.JobName, body: P.RegisterRequest) -> P.Assignment:
        return scheduler.get(job).register(body)

    @app.get(P.ASSIGNMENT_PATH, tags=["workers"], summary="A worker's current assignment", dependencies=[Auth])
    def assignment(job: P.JobName, worker_id: P.WorkerId) -> P.Assignment:
        return scheduler.get(job).worker_assignment(worker_id)

    def report_route(kind: str, name: str, summary: str, reply: type[BaseModel]) -> None:
        """A worker report's route: answered by `_WorkerReports` before routing; here for the OpenAPI document
        and for an app without that layer."""
        model, path, _call = _REPORTS[kind]

        async def answer(job: P.JobName, worker_id: P.WorkerId, request: Request) -> Response:
            auth(request)
            return Response(await _worker_report(scheduler, kind, job, worker_id, await request.body()),
                            media_type="application/json")

        app.post(path, tags=["workers"], summary=summary, name=name, response_model=reply,
                 openapi_extra=_json_body(model),
                 description="Answered by the API's worker-report path (see `_WorkerReports`) before routing; "
                             "same contract.")(answer)

    report_route("heartbeat", "heartbeat", "Heartbeat with the last completed step", P.HeartbeatReply)
    report_route("snapshot", "snapshot", "A worker wrote its part of a version", P.Ack)

    @app.post(P.PEER_FAILURE_PATH, tags=["workers"], summary="A worker saw a peer fail", dependencies=[Auth])
    def peer_failure(job: P.JobName, worker_id: P.WorkerId, body: P.PeerFailureReport) -> P.Ack:
        scheduler.get(job).peer_failure(worker_id, body)
        return P.Ack()

    report_route("exit", "exit_report", "A worker is exiting", P.Ack)

    def node_route(kind: str, path: str, model: type[BaseModel], reply: type[BaseModel], summary: str,
                   description: str) -> None:
        """A node daemon's batch route: answered by `_WorkerReports` before routing; here for the OpenAPI document
        and for an app without that layer."""

        async def answer(job: P.JobName, node: Annotated[str, Path(pattern=_NODE_NAME.pattern)],
                         request: Request) -> Response:
            auth(request)
            return Response(await _worker_report(scheduler, kind, job, node, await request.body()),
                            media_type="application/json")

        app.post(path, tags=["workers"], summary=summary, name=f"node_{kind}", response_model=reply,
                 openapi_extra=_json_body(model),
                 description=f"{description} Answered by `_WorkerReports` before routing.")(answer)

    node_route("heartbeats", P.NODE_HEARTBEATS_PATH, P.NodeHeartbeats, P.NodeHeartbeatsReply,
               "A node daemon's batch of its workers' heartbeats",
               "One report per node and job per interval instead of one per worker; answers each worker as its own "
               "heartbeat would be.")
    node_route("reports", P.NODE_REPORTS_PATH, P.NodeReports, P.NodeReportsReply,
               "A node daemon's batch of its workers' reports",
               "The snapshot and exit reports of a node's workers, each handled as if sent directly; each one's "
               "error under its index.")

    return app


def _validation_detail(errors: Sequence[Any], prefix: tuple[str, ...] = ()) -> str:
    parts = []
    for e in errors[:5]:
        where = ".".join(str(x) for x in (*prefix, *e.get("loc", ())))
        parts.append(f"{where}: {e.get('msg')}")
    return "; ".join(parts)


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses ``model`` from the raw body itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


VIEW_WAIT_S = 0.05
"""How long a read of a job waits for its controller's lock before it answers with the job's last view."""
VIEW_POLL_S = 0.004
"""How often a read or a worker report on the event loop looks at a busy lock again."""
VIEW_INLINE_S = 0.02
"""A job whose view (copy and JSON) takes longer than this to make is served its last view, made again in the
background (see ``GET /v1/jobs/{job}``)."""
VIEW_REFRESH_S = 1.0
VIEW_REFRESH_FACTOR = 5.0
"""Such a view is made again at most every max(VIEW_REFRESH_S, VIEW_REFRESH_FACTOR x what it cost)."""
REPORT_WAIT_S = 0.05
"""How long a worker report waits on the event loop for its job's busy lock before a worker thread waits."""
REPORT_THREADS = 24
"""At most this many worker threads wait for busy job locks on behalf of worker reports (a limiter of their own);
further reports queue for one of them without a thread. The other synchronous routes keep all of anyio's
default limiter (40): a controller holding its job across a slow call (a node loss's pod deletions, 10 s on
Kubernetes) once had a second's heartbeat batches take all 40, and /v1/hosts, /metrics, registrations and the
authentication of every route waited as long."""
_REPORT_LIMITER: RunVar[anyio.CapacityLimiter] = RunVar("tenplex_report_threads")


def _report_threads() -> anyio.CapacityLimiter:
    """The event loop's limiter of :data:`REPORT_THREADS` (made on first use: a limiter belongs to its loop)."""
    try:
        return _REPORT_LIMITER.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(REPORT_THREADS)
        _REPORT_LIMITER.set(limiter)
        return limiter


class _Views:
    """Jobs as the API shows them: spec and status without the last plan (large; served by /plan).

    A view is a copy taken under the job's lock. With ``wait``, a controller
    that holds its lock longer (planning a large job, recording a worker's
    registration) is not waited for: the answer is the job's last view, a
    consistent copy at most as old as that hold (every view built, a write's
    included, renews it). One per app: no state is shared between schedulers.
    """

    def __init__(self) -> None:
        self._last: weakref.WeakKeyDictionary[JobController, dict[str, Any]] = weakref.WeakKeyDictionary()
        self._large: weakref.WeakKeyDictionary[JobController, tuple[bytes, float, float]] = weakref.WeakKeyDictionary()
        """A large job's last view as JSON, when it was made (monotonic) and what it cost (seconds)."""
        self._refreshing: weakref.WeakSet[JobController] = weakref.WeakSet()
        self._lock = threading.Lock()

    def encoded(self, ctl: JobController, body: bytes, cost: float) -> None:
        """A view of ``ctl`` was made and encoded as ``body`` in ``cost`` seconds: a large job's is kept."""
        with self._lock:
            if cost > VIEW_INLINE_S:
                self._large[ctl] = (body, time.monotonic(), cost)
            else:
                self._large.pop(ctl, None)

    def large(self, ctl: JobController) -> bytes | None:
        """The last view of ``ctl`` as JSON if it is a large job's (too costly to make at every read), else None."""
        with self._lock:
            kept = self._large.get(ctl)
        return kept[0] if kept is not None else None

    def refresh_soon(self, ctl: JobController) -> None:
        """Make a large job's view again in a thread, when the last one is old enough (see ``get_job``)."""
        with self._lock:
            kept = self._large.get(ctl)
            if kept is None or ctl in self._refreshing:
                return
            _body, made, cost = kept
            if time.monotonic() - made < max(VIEW_REFRESH_S, VIEW_REFRESH_FACTOR * cost):
                return
            self._refreshing.add(ctl)

        def refresh() -> None:
            try:
                # The cost is the view's making, not the wait for the lock: a controller that held it for 20 s
                # (a large launch) would otherwise stretch the next refresh to 5 x 20 s, and every GET until then
                # would read a view that old (it did: 100 s behind a scale-down that had finished).
                ctl.lock.acquire()
                start = time.perf_counter()
                view = self._build(ctl)
                self.encoded(ctl, json.dumps(view, separators=(",", ":"), allow_nan=False).encode(),
                             time.perf_counter() - start)
            finally:
                with self._lock:
                    self._refreshing.discard(ctl)

        threading.Thread(target=refresh, name="job-view", daemon=True).start()

    def __call__(self, ctl: JobController, *, wait: float | None = None) -> dict[str, Any]:
        if not ctl.lock.acquire(timeout=-1 if wait is None else wait):
            last = self.last(ctl)
            if last is not None:
                return last
            ctl.lock.acquire()
        return self._build(ctl)

    def now(self, ctl: JobController) -> dict[str, Any] | None:
        """The view if the job's lock is free at once (never blocks: for the event loop), else None."""
        if not ctl.lock.acquire(blocking=False):
            return None
        return self._build(ctl)

    def last(self, ctl: JobController) -> dict[str, Any] | None:
        """The job's last view (None before the first)."""
        with self._lock:
            return self._last.get(ctl)

    def _build(self, ctl: JobController) -> dict[str, Any]:
        """The view, from a caller that holds the job's lock (released here)."""
        try:
            view = {"spec": ctl.spec.to_json(), "status": ctl.status.to_json(plan=False)}
        finally:
            ctl.lock.release()
        with self._lock:
            self._last[ctl] = view
        return view


_ACK = P.Ack().model_dump_json().encode()

_REPORTS: dict[str, tuple[type[BaseModel], str, Callable[[JobController, str, Any], BaseModel | None]]] = {
    "heartbeat": (P.HeartbeatRequest, P.HEARTBEAT_PATH, lambda ctl, w, body: ctl.heartbeat(w, body)),
    "snapshot": (P.SnapshotReport, P.SNAPSHOT_PATH, lambda ctl, w, body: ctl.snapshot_report(w, body)),
    "exit": (P.ExitReport, P.EXIT_PATH, lambda ctl, w, body: ctl.exit_report(w, body)),
    "heartbeats": (P.NodeHeartbeats, P.NODE_HEARTBEATS_PATH, lambda ctl, node, body: ctl.node_heartbeats(node, body)),
    "register": (P.RegisterRequest, P.REGISTER_PATH, lambda ctl, _, body: ctl.register(body)),
    "reports": (P.NodeReports, P.NODE_REPORTS_PATH, lambda ctl, _node, body: _node_reports(ctl, body)),
}
"""The worker reports every worker sends (``kind`` -> body model, route, controller call): a heartbeat every
second or so (one batch per node and interval from the node daemons that relay them: ``heartbeats``, called
with the node's name), and at every planned change a snapshot and an exit report from each worker at once, and
each new worker's registration (the worker id is in its body) within seconds of its generation's launch."""


def _node_reports(ctl: JobController, batch: P.NodeReports) -> P.NodeReportsReply:
    """A node daemon's batch of snapshot and exit reports, each handled in order as if sent directly (the caller
    holds the job's lock, so the batch is one hold of it); each report's error is answered under its index."""
    errors: dict[int, P.ErrorBody] = {}
    for i, report in enumerate(batch.reports):
        try:
            if report.snapshot is not None:
                ctl.snapshot_report(report.worker_id, report.snapshot)
            else:
                assert report.exit is not None  # the model guarantees one of them
                ctl.exit_report(report.worker_id, report.exit)
        except TenplexError as exc:
            errors[i] = P.ErrorBody(error=exc.code, detail=exc.detail[:4000])
    return P.NodeReportsReply(errors=errors)


async def _worker_report(scheduler: Scheduler, kind: str, job: str, worker_id: str, raw: bytes) -> bytes:
    """A worker report's reply: the body parsed by pydantic from the raw bytes, the reply serialized by it, and
    the controller called on the event loop once its lock is free (held only briefly then: a report is a few
    dictionary updates). A lock held longer than ``REPORT_WAIT_S`` (planning a large job) is waited for in a
    worker thread, one of at most ``REPORT_THREADS`` (the other routes keep theirs); a shorter hold (the
    controller's tick over its workers) is looked at again every ``VIEW_POLL_S`` from the event loop: a hand-off
    to a thread costs more than the report."""
    model, _path, call = _REPORTS[kind]
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        raise InvalidInput(_validation_detail(exc.errors(), ("body",))) from None
    ctl = scheduler.get(job)
    deadline = None
    while not ctl.lock.acquire(blocking=False):
        deadline = deadline or time.monotonic() + REPORT_WAIT_S
        if time.monotonic() > deadline:
            reply = await anyio.to_thread.run_sync(call, ctl, worker_id, body, limiter=_report_threads())
            break
        await asyncio.sleep(VIEW_POLL_S)
    else:
        try:
            reply = call(ctl, worker_id, body)
        finally:
            ctl.lock.release()
    return reply.model_dump_json().encode() if reply is not None else _ACK


_WORKER_REPORT = re.compile(
    r"^/v1/jobs/([^/]+)/(?:workers/([^/]+)/(heartbeat|snapshot|exit)|nodes/([^/]+)/(heartbeats|reports)|workers/(register))$")
_JOB_NAME = re.compile(P.JOB_NAME_PATTERN)
_WORKER_ID = re.compile(P.WORKER_ID_PATTERN)
_NODE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")
"""A node's name in the path of its batch (a Kubernetes node name, an emulated host's)."""


class _WorkerReports:
    """Worker reports answered before the app: heartbeats (a worker's own and a node's batch), snapshot and exit
    reports, registrations (:data:`_REPORTS`).

    A thousand workers send a thousand heartbeats a second, and two thousand
    reports within a second or two when a planned change stops them; through
    the framework's routing, dependencies, request objects and worker threads
    each cost several times the work of the report itself
    (``benchmarks/control_plane.py``). This layer, ahead of the app
    (:class:`_SchedulerApp`), answers
    ``POST /v1/jobs/{job}/workers/{worker_id}/{heartbeat,snapshot,exit}``,
    ``POST /v1/jobs/{job}/nodes/{node}/{heartbeats,reports}`` (a node daemon's batch of heartbeats, or of
    snapshot and exit reports) and
    ``POST /v1/jobs/{job}/workers/register`` (15,360 of them within seconds
    when a 16,384-GPU job restarts) itself, with the routes'
    contract (bearer token, body and reply models, errors as
    ``{"error", "detail"}``, latency in the request histogram); anything
    else, and a path whose names are malformed, goes on to the app.
    """

    def __init__(self, scheduler: Scheduler, authn: Authenticator, metrics: Any) -> None:
        self.scheduler = scheduler
        self.authn = authn
        self.metrics = metrics
        self._latency: dict[tuple[str, int], Any] = {}
        """(kind, status) -> its series of the request histogram (a label lookup costs as much as the rest)."""

    async def answered(self, scope: dict[str, Any], receive: Any, send: Any) -> bool:
        """Answer ``scope`` if it is a worker report (True), else leave it to the app (False)."""
        m = _WORKER_REPORT.match(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if m is None:
            return False
        job, who, kind = (m.group(1), m.group(2), m.group(3)) if m.group(2) else (
            (m.group(1), m.group(4), m.group(5)) if m.group(4) else (m.group(1), "", "register"))
        name = {"heartbeats": _NODE_NAME, "reports": _NODE_NAME, "register": None}.get(kind, _WORKER_ID)
        if not _JOB_NAME.match(job) or (name is not None and not name.match(who)):
            return False
        start = time.perf_counter()
        headers: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]
        try:
            principal = self.authn.authenticate(dict(scope["headers"]).get(b"authorization"))
            if not principal.can_write(job):
                raise Forbidden(f"a {principal.describe()} may not report for job {job!r}")
            chunks, size = [], 0
            while True:
                message = await receive()
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > MAX_REPORT_BYTES:
                    raise InvalidInput(f"a worker or node report is at most {MAX_REPORT_BYTES} bytes")
                if not message.get("more_body"):
                    break
            status, body = 200, await _worker_report(self.scheduler, kind, job, who, b"".join(chunks))
        except TenplexError as exc:
            status, body = exc.http_status, json.dumps(exc.to_json()).encode()
            if isinstance(exc, Unauthorized):
                headers.append((b"www-authenticate", b"Bearer"))
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        series = self._latency.get((kind, status))
        if series is None:
            series = self._latency[(kind, status)] = self.metrics.requests.labels(_REPORTS[kind][1], "POST", str(status))
        series.observe(time.perf_counter() - start)
        return True


MAX_REPORT_BYTES = 1 << 20
"""The largest worker report or node batch body the scheduler reads (a node's batch of 4,096 heartbeats is
about 150 KiB)."""


class _SchedulerApp(FastAPI):
    """The scheduler's app: FastAPI, with the worker reports (:class:`_WorkerReports`) answered before any of its
    layers (its telemetry, body limit, error handling, middleware and routing), which cost more than a
    node's batch of heartbeats itself (``benchmarks/liveness.py``)."""

    worker_reports: _WorkerReports | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        reports = self.worker_reports
        if reports is not None and await reports.answered(scope, receive, send):
            return
        await super().__call__(scope, receive, send)


class _Timing:
    """Request latency per route into the scheduler's Prometheus histogram.

    A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` (what
    ``@app.middleware("http")`` makes) runs every request through extra tasks
    and streams, which costs more than a worker's heartbeat itself.
    """

    def __init__(self, app: Any, metrics: Any) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            self.metrics.requests.labels(path, scope["method"], str(status[0])).observe(time.perf_counter() - start)
