"""The scheduler's REST API (FastAPI; OpenAPI at ``/openapi.json``, docs at ``/docs``).

Users create, inspect, scale and delete jobs and report events; workers speak
the protocol of :mod:`tenplex.core.protocol`. Everything but
``/healthz`` needs ``Authorization: Bearer <token>`` when the scheduler has a
token. Every error is ``{"error": code, "detail": message}``; bad requests
are 4xx, never 5xx.
"""

from __future__ import annotations

import hmac
import time
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from tenplex import __version__
from tenplex.core import protocol as P
from tenplex.errors import InvalidInput, NotFound, TenplexError, Unauthorized
from tenplex.ptc import DatasetState, ParallelConfig
from tenplex.scheduler.controller import JobController, job_view
from tenplex.scheduler.layouts import LayoutSpec
from tenplex.scheduler.service import Scheduler
from tenplex.scheduler.state import CheckpointSpec, JobSpec, policy_from_json
from tenplex.transformer.plan import Plan

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"description": text, "content": {"application/json": {"example": {"error": "code", "detail": "message"}}}}
    for code, text in ((400, "Bad request"), (401, "Missing or wrong bearer token"), (404, "Unknown job or worker"),
                       (409, "Conflicts with the job's state"))
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LayoutBody(_Body):
    provider: Literal["megatron-gpt", "example-gpt", "example-torchtitan", "example-hf"]
    model: dict[str, Any] = Field(description="The provider's model fields (GPTSpec, GPTConfig, TitanConfig or HFConfig).")
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"


class CheckpointBody(_Body):
    uri: str = Field(min_length=1, max_length=2048, description=(
        "Persistent location: s3://bucket/prefix (any S3-compatible store; endpoint and credentials are the store "
        "daemons') or file:///path (a filesystem mounted on every node)."))
    interval_steps: int = Field(ge=1, le=1 << 40, description="Copy a committed version there every this many steps.")
    keep_last: int = Field(2, ge=1, le=1000, description="Persistent versions kept (older ones are deleted).")


class DatasetBody(_Body):
    num_samples: int = Field(gt=0, le=1 << 48)
    seed: int = Field(0, ge=0, le=1 << 62)
    global_batch_size: int = Field(gt=0, le=1 << 30)
    consumed_samples: int = Field(0, ge=0, le=1 << 62)


class PolicyBody(_Body):
    table: dict[str, dict[str, Any]] = Field(default_factory=dict, description="GPU count -> {dp, tp, pp, zero}.")
    gpu_memory_bytes: int | None = Field(None, gt=0)
    state_memory_fraction: float = Field(0.5, gt=0, le=1)
    zero: int = Field(0, ge=0, le=3)


class JobCreate(_Body):
    name: P.JobName
    layout: LayoutBody
    dataset: DatasetBody
    command: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(
        default_factory=list, max_length=256, description="Worker command (local backend).")
    image: str | None = Field(None, min_length=1, max_length=1024, description="Worker image (kubernetes backend).")
    gpus: int = Field(ge=1, le=1 << 20)
    min_gpus: int = Field(1, ge=1, le=1 << 20)
    max_gpus: int = Field(1 << 20, ge=1, le=1 << 20)
    policy: PolicyBody = Field(default_factory=PolicyBody)
    steps: int = Field(100, ge=1, le=1 << 40)
    snapshot_every: int = Field(10, ge=1, le=1 << 40)
    heartbeat_timeout: float = Field(60.0, gt=0, le=86400)
    max_restarts: int = Field(3, ge=0, le=1_000_000, description=(
        "Failure recoveries allowed in a row without a newer snapshot; the next failure fails the job."))
    checkpoint: CheckpointBody | None = Field(None, description=(
        "Persistent checkpoints, the fall-back when no replica of some region survives."))
    standby: bool = Field(False, description=(
        "Keep a warm standby on every usable host: a process with the job's code imported that forks the new "
        "workers of a reconfiguration (local backend)."))
    env: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")], Annotated[str, Field(max_length=65536)]] = Field(
        default_factory=dict)


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
    app = FastAPI(
        title="Tenplex scheduler",
        version=__version__,
        description="Elastic multi-dimensional-parallel training jobs: create, scale, observe; the worker protocol.",
        responses=ERROR_RESPONSES,
    )
    metrics = scheduler.metrics

    def auth(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
            raise Unauthorized("missing or wrong bearer token")

    Auth = Depends(auth)

    @app.exception_handler(TenplexError)
    async def _tenplex_error(_: Request, exc: TenplexError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else None
        return JSONResponse(exc.to_json(), status_code=exc.http_status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for e in exc.errors()[:5]:
            where = ".".join(str(x) for x in e.get("loc", ()))
            parts.append(f"{where}: {e.get('msg')}")
        return JSONResponse({"error": "invalid_input", "detail": "; ".join(parts)}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse({"error": code, "detail": str(exc.detail)}, status_code=exc.status_code)

    @app.middleware("http")
    async def _timing(request: Request, call_next: Any) -> Any:
        start = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        metrics.requests.labels(path, request.method, str(response.status_code)).observe(time.perf_counter() - start)
        return response

    # -- health and metrics ----------------------------------------------------

    @app.get("/healthz", tags=["ops"], summary="Liveness and readiness (no auth)")
    def healthz() -> dict[str, str]:
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
        spec = JobSpec(
            name=body.name,
            layout=LayoutSpec.from_json(body.layout.model_dump()),
            dataset=DatasetState(**body.dataset.model_dump()),
            command=tuple(body.command),
            image=body.image,
            gpus=body.gpus,
            min_gpus=body.min_gpus,
            max_gpus=body.max_gpus,
            policy=policy_from_json(body.policy.model_dump()),
            steps=body.steps,
            snapshot_every=body.snapshot_every,
            heartbeat_timeout=body.heartbeat_timeout,
            max_restarts=body.max_restarts,
            standby=body.standby,
            checkpoint=CheckpointSpec(**body.checkpoint.model_dump()) if body.checkpoint is not None else None,
            env=body.env,
        )
        ctl = scheduler.create(spec)
        return _view(ctl)

    @app.get("/v1/jobs", tags=["jobs"], summary="List jobs with their status", dependencies=[Auth])
    def list_jobs() -> dict[str, Any]:
        return {"jobs": [_view(c) for c in scheduler.list()]}

    @app.get("/v1/jobs/{job}", tags=["jobs"], summary="A job: configuration, step, workers, history",
             dependencies=[Auth])
    def get_job(job: P.JobName) -> dict[str, Any]:
        return _view(scheduler.get(job))

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
    def report_event(job: P.JobName, body: EventBody) -> dict[str, Any]:
        ctl = scheduler.get(job)
        if body.kind == "peer_failure":
            ctl.report_failure(f"peer failure reported through the API: {body.detail or 'no detail'}")
        else:
            if body.host is None:
                raise InvalidInput(f"a {body.kind} event needs a host")
            cluster = getattr(scheduler.backend, "cluster", None)
            if cluster is None:
                raise InvalidInput(f"the {scheduler.backend.name} backend takes {body.kind} from the cluster itself")
            cluster.set_schedulable(body.host, body.kind == "uncordon")
            if body.kind == "cordon":
                ctl.request_redeploy("redeploy")
        return _view(ctl)

    @app.get("/v1/jobs/{job}/plan", tags=["jobs"], summary="The current or last reconfiguration plan, explained",
             dependencies=[Auth])
    def get_plan(job: P.JobName) -> dict[str, Any]:
        ctl = scheduler.get(job)
        with ctl.lock:
            plan = ctl.status.last_plan
        if plan is None:
            raise NotFound(f"job {job!r} has not been reconfigured yet")
        # Rendered when asked for, not kept in the record: the record is saved at every transition.
        return {"explain": Plan.from_json(plan["plan"]).explain(), "plan": plan["plan"]}

    @app.get("/v1/jobs/{job}/ptc", tags=["jobs"], summary="The PTC of a generation (default: current)",
             dependencies=[Auth])
    def get_ptc(job: P.JobName, generation: Annotated[int | None, Query(ge=0, le=1 << 30)] = None) -> Response:
        ctl = scheduler.get(job)
        gen = ctl.status.generation if generation is None else generation
        return Response(ctl.ptc(gen).dumps(), media_type="application/json")

    @app.get("/v1/hosts", tags=["cluster"], summary="Hosts known to the backend", dependencies=[Auth])
    def hosts() -> dict[str, Any]:
        return {"backend": scheduler.backend.name, "hosts": [h.__dict__ for h in scheduler.backend.hosts()]}

    # -- the worker protocol -------------------------------------------------------

    @app.post(P.REGISTER_PATH, tags=["workers"], summary="A worker registers; returns its assignment",
              dependencies=[Auth])
    def register(job: P.JobName, body: P.RegisterRequest) -> P.Assignment:
        return scheduler.get(job).register(body)

    @app.get(P.ASSIGNMENT_PATH, tags=["workers"], summary="A worker's current assignment", dependencies=[Auth])
    def assignment(job: P.JobName, worker_id: P.WorkerId) -> P.Assignment:
        ctl = scheduler.get(job)
        with ctl.lock:
            return ctl.assignment_of(worker_id)

    @app.post(P.HEARTBEAT_PATH, tags=["workers"], summary="Heartbeat with the last completed step",
              dependencies=[Auth])
    def heartbeat(job: P.JobName, worker_id: P.WorkerId, body: P.HeartbeatRequest) -> P.HeartbeatReply:
        return scheduler.get(job).heartbeat(worker_id, body)

    @app.post(P.SNAPSHOT_PATH, tags=["workers"], summary="A worker wrote its part of a version", dependencies=[Auth])
    def snapshot(job: P.JobName, worker_id: P.WorkerId, body: P.SnapshotReport) -> P.Ack:
        scheduler.get(job).snapshot_report(worker_id, body)
        return P.Ack()

    @app.post(P.PEER_FAILURE_PATH, tags=["workers"], summary="A worker saw a peer fail", dependencies=[Auth])
    def peer_failure(job: P.JobName, worker_id: P.WorkerId, body: P.PeerFailureReport) -> P.Ack:
        scheduler.get(job).peer_failure(worker_id, body)
        return P.Ack()

    @app.post(P.EXIT_PATH, tags=["workers"], summary="A worker is exiting", dependencies=[Auth])
    def exit_report(job: P.JobName, worker_id: P.WorkerId, body: P.ExitReport) -> P.Ack:
        scheduler.get(job).exit_report(worker_id, body)
        return P.Ack()

    return app


def _view(ctl: JobController) -> dict[str, Any]:
    with ctl.lock:
        view = dict(job_view(ctl.spec, ctl.status))
        status = dict(view["status"])
        status.pop("last_plan", None)  # large; served by /plan
        view["status"] = status
        return view
