"""The control client against a small real FastAPI/uvicorn server serving the protocol models.

The real scheduler (issue 6) serves the same models from tenplex.core.protocol; this
fixture server is the minimum that answers them honestly: it keeps registered workers,
hands out one assignment, records heartbeats and reports, and can be told to ask for a stop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse

from tenplex.core import protocol as p
from tenplex.errors import InvalidInput, NotFound, SchedulerUnavailable, Unauthorized
from tenplex.ptc import PTC, Device, Region, TensorKind, build_tensor
from tenplex.sockets import free_port
from tenplex.worker.control import ControlClient, Heartbeat, agree_stop

TOKEN = "s3cret"


def tiny_ptc() -> PTC:
    return PTC(
        config={"dp": 2},
        devices=(Device(0, "h0"), Device(1, "h0")),
        tensors=(build_tensor("w", (4,), "float32", TensorKind.PARAM, [(Region.full((4,)), (0, 1))]),),
    )


@dataclass
class FakeJob:
    """State of the fixture scheduler (one job)."""

    stop_at_step: int | None = None
    action: str = "continue"
    unavailable_for: int = 0
    registered: dict[str, p.RegisterRequest] = field(default_factory=dict)
    heartbeats: list[p.HeartbeatRequest] = field(default_factory=list)
    reports: list[Any] = field(default_factory=list)


def make_app(state: FakeJob) -> FastAPI:
    app = FastAPI()

    def auth(authorization: str | None) -> None:
        if authorization != f"Bearer {TOKEN}":
            raise HTTPException(401, detail="bad token")

    @app.exception_handler(HTTPException)
    async def _err(_: Request, exc: HTTPException) -> JSONResponse:
        code = {401: "unauthorized", 404: "not_found"}.get(exc.status_code, "invalid_input")
        return JSONResponse({"error": code, "detail": exc.detail}, status_code=exc.status_code)

    def assignment(worker_id: str) -> p.Assignment:
        return p.Assignment(
            job="demo", generation=3, worker_id=worker_id, rank=1, world_size=2, local_rank=1, host="h0",
            parallel={"dp": 2}, master_addr="127.0.0.1", master_port=29500, restore_version="s10-g2",
            store_url="http://127.0.0.1:1", ptc_url="/ptc/demo", stop_at_step=state.stop_at_step,
        )

    @app.post(p.REGISTER_PATH, response_model=p.Assignment)
    def register(job: str, body: p.RegisterRequest, authorization: str | None = Header(None)) -> p.Assignment:
        auth(authorization)
        if job != "demo":
            raise HTTPException(404, detail=f"job {job!r} does not exist")
        if state.unavailable_for > 0:
            state.unavailable_for -= 1
            raise HTTPException(503, detail="scheduler restarting")
        state.registered[body.worker_id] = body
        return assignment(body.worker_id)

    @app.get(p.ASSIGNMENT_PATH, response_model=p.Assignment)
    def get_assignment(job: str, worker_id: str, authorization: str | None = Header(None)) -> p.Assignment:
        auth(authorization)
        if worker_id not in state.registered:
            raise HTTPException(404, detail=f"worker {worker_id!r} is not registered")
        return assignment(worker_id)

    @app.get("/ptc/demo")
    def ptc(authorization: str | None = Header(None)) -> JSONResponse:
        auth(authorization)
        return JSONResponse(tiny_ptc().to_json())

    @app.post(p.HEARTBEAT_PATH, response_model=p.HeartbeatReply)
    def heartbeat(job: str, worker_id: str, body: p.HeartbeatRequest, authorization: str | None = Header(None)) -> p.HeartbeatReply:
        auth(authorization)
        state.heartbeats.append(body)
        return p.HeartbeatReply(action=state.action, generation=3, stop_at_step=state.stop_at_step)  # type: ignore[arg-type]

    @app.post(p.SNAPSHOT_PATH, response_model=p.Ack)
    def snapshot(job: str, worker_id: str, body: p.SnapshotReport, authorization: str | None = Header(None)) -> p.Ack:
        auth(authorization)
        state.reports.append(body)
        return p.Ack()

    @app.post(p.PEER_FAILURE_PATH, response_model=p.Ack)
    def peer_failure(job: str, worker_id: str, body: p.PeerFailureReport, authorization: str | None = Header(None)) -> p.Ack:
        auth(authorization)
        state.reports.append(body)
        return p.Ack()

    @app.post(p.EXIT_PATH, response_model=p.Ack)
    def exit_(job: str, worker_id: str, body: p.ExitReport, authorization: str | None = Header(None)) -> p.Ack:
        auth(authorization)
        state.reports.append(body)
        return p.Ack()

    return app


@pytest.fixture
def scheduler() -> Iterator[tuple[str, FakeJob]]:
    job = FakeJob()
    config = uvicorn.Config(make_app(job), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fixture scheduler did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", job
    server.should_exit = True
    thread.join(5)


def client(url: str, **kw: Any) -> ControlClient:
    return ControlClient(url, "demo", "w-1", token=TOKEN, backoff_s=0.01, **kw)


def test_register_assignment_and_ptc(scheduler: tuple[str, FakeJob]) -> None:
    url, job = scheduler
    c = client(url)
    a = c.register(host="h0", rank=1)
    assert (a.rank, a.world_size, a.generation, a.restore_version) == (1, 2, 3, "s10-g2")
    assert job.registered["w-1"].host == "h0" and job.registered["w-1"].pid is not None
    assert c.assignment() == a
    ptc = c.fetch_ptc(a)
    assert ptc.tensor("w").shape == (4,)


def test_errors_come_back_as_tenplex_errors(scheduler: tuple[str, FakeJob]) -> None:
    url, _ = scheduler
    with pytest.raises(Unauthorized, match="bad token"):
        ControlClient(url, "demo", "w-1", token="wrong").register()
    with pytest.raises(NotFound, match="'nojob' does not exist"):
        ControlClient(url, "nojob", "w-1", token=TOKEN).register()
    with pytest.raises(NotFound, match="'w-1' is not registered"):
        client(url).assignment()


def test_503_is_retried_then_succeeds(scheduler: tuple[str, FakeJob]) -> None:
    url, job = scheduler
    job.unavailable_for = 2
    assert client(url).register().worker_id == "w-1"
    job.unavailable_for = 5
    with pytest.raises(SchedulerUnavailable, match="HTTP 503"):
        client(url, retries=1).register()


def test_unreachable_scheduler_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SchedulerUnavailable, match="after 2 attempts"):
        client(url, retries=1, timeout_s=1).register()


def test_heartbeat_learns_stop_and_reports_arrive(scheduler: tuple[str, FakeJob]) -> None:
    url, job = scheduler
    c = client(url)
    hb = Heartbeat(c, generation=3, interval_s=0.05).start()
    try:
        hb.update(7, 1.25)
        job.stop_at_step = 9
        deadline = time.monotonic() + 5
        while hb.stop_at_step is None:
            assert time.monotonic() < deadline, "stop request not learned"
            time.sleep(0.02)
        assert hb.stop_at_step == 9 and not hb.abort
        assert any(h.step == 7 and h.loss == 1.25 for h in job.heartbeats)
        job.action = "stop"
        hb.beat_now()
        assert hb.abort
    finally:
        hb.close()
    c.heartbeat(3, 8, float("nan"))  # NaN travels as null
    assert job.heartbeats[-1].loss is None
    c.report_snapshot(p.SnapshotReport(generation=3, step=9, version="s9-g3", host="h0", committed=True))
    c.report_peer_failure(3, "allreduce timed out after 30s", step=9)
    c.report_exit(3, 9, "stopped", 0)
    kinds = [type(r).__name__ for r in job.reports]
    assert kinds == ["SnapshotReport", "PeerFailureReport", "ExitReport"]
    assert job.reports[1].detail == "allreduce timed out after 30s"


def test_agree_stop_without_process_group_uses_local_values() -> None:
    assert agree_stop(5, None) == (False, False)
    assert agree_stop(5, 5) == (True, False)
    assert agree_stop(4, 5) == (False, False)
    assert agree_stop(4, None, local_abort=True) == (False, True)


def test_from_env_and_bad_arguments() -> None:
    env = {p.ENV_SCHEDULER_URL: "http://10.0.0.1:8470/", p.ENV_JOB: "demo", p.ENV_WORKER_ID: "w-0", p.ENV_TOKEN: "t"}
    c = ControlClient.from_env(env)
    assert (c.base_url, c.job, c.worker_id, c.token) == ("http://10.0.0.1:8470", "demo", "w-0", "t")
    with pytest.raises(InvalidInput, match="TENPLEX_JOB, TENPLEX_WORKER_ID not set"):
        ControlClient.from_env({p.ENV_SCHEDULER_URL: "http://x"})
    with pytest.raises(InvalidInput, match="'ftp://x'"):
        ControlClient("ftp://x", "demo", "w")
    with pytest.raises(InvalidInput, match="'Demo_1'"):
        ControlClient("http://x", "Demo_1", "w")
    with pytest.raises(InvalidInput, match="'-bad'"):
        ControlClient("http://x", "demo", "-bad")


def test_protocol_models_validate() -> None:
    base: dict[str, Any] = dict(
        job="demo", generation=0, worker_id="w", rank=0, world_size=4, local_rank=0, host="h",
        parallel={"dp": 2, "tp": 2}, master_addr="a", master_port=1, store_url="http://s", ptc={},
    )
    assert p.Assignment(**base).world_size == 4
    for change, match in [
        ({"rank": 4}, "rank 4 is outside world size 4"),
        ({"world_size": 2}, "dp2 x tp2 x pp1 has world size 4"),
        ({"ptc": None}, "set ptc or ptc_url"),
        ({"restore_version": "v1"}, "'v1' is not of the form"),
        ({"parallel": {"dp": 0}}, "dp must be a positive integer"),
        ({"master_port": 70000}, "less than or equal to 65535"),
        ({"surprise": 1}, "Extra inputs"),
    ]:
        with pytest.raises(ValueError, match=match):
            p.Assignment(**{**base, **change})
    with pytest.raises(ValueError, match="not of step 4"):
        p.SnapshotReport(generation=0, step=4, version="s5-g0", host="h", committed=False)
    with pytest.raises(ValueError, match="finite"):
        p.HeartbeatRequest(generation=0, step=1, loss=float("inf"))
