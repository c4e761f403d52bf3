"""Liveness per node: the node daemon's heartbeat relay and the scheduler's batched heartbeat route.

A real scheduler (REST on 127.0.0.1, its local backend's two emulated hosts, whose daemons relay for it) with
one running job recovered from its state directory: four workers, two per host, whose process is a sleeper
(the backend adopts it, as it adopts running workers after a scheduler restart); the test speaks for them. The
relay's batches are sent by hand (``flush``) with a clock the test moves, so every age is exact.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenplex.core import protocol as P
from tenplex.errors import (
    Conflict,
    InvalidConfig,
    InvalidInput,
    NotFound,
    SchedulerUnavailable,
    Unauthorized,
)
from tenplex.node.relay import HeartbeatRelay, PtcCache
from tenplex.ptc import DatasetState, ParallelConfig, Placement
from tenplex.scheduler.decide import Observations, detect_failure
from tenplex.scheduler.launcher import ptc_digest
from tenplex.scheduler.layouts import LayoutSpec
from tenplex.scheduler.server import LocalScheduler
from tenplex.scheduler.state import JobSpec, JobStatus, Phase, Stage, StateDir, WorkerRecord
from tenplex.testing.layouts import MLP, mlp_layout
from tenplex.worker.control import ControlClient, Heartbeat
from tests.scheduler.test_api import call

TOKEN = "node-heartbeats"
JOB = "live"
HOSTS = ("host-0", "host-1")
TIMEOUT = 3600.0


def wid(rank: int) -> str:
    return f"{JOB}-g0-r{rank}"


@pytest.fixture(scope="module")
def sched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalScheduler]:
    root = tmp_path_factory.mktemp("sched")
    parallel = ParallelConfig(dp=4)
    spec = JobSpec(name=JOB, layout=LayoutSpec.from_json({"provider": "tenplex.testing.layouts:mlp_layout",
                                                          "model": {"layers": 1, "dim": 4}}),
                   dataset=DatasetState(num_samples=64, seed=0, global_batch_size=4), command=("python", "-c", "pass"),
                   gpus=4, steps=10_000, heartbeat_timeout=TIMEOUT)
    now = time.time()
    sleeper = subprocess.Popen(["sleep", "3600"], start_new_session=True)
    workers = [WorkerRecord(worker_id=wid(r), rank=r, host=HOSTS[r // 2], local_rank=r % 2, generation=0,
                            pid=sleeper.pid, registered=True, last_heartbeat=now, step=1) for r in range(4)]
    status = JobStatus(phase=Phase.RUNNING, generation=0, gpus=4, parallel=parallel.to_json(), hosts=list(HOSTS),
                       gpus_per_node=2, step=1, workers=workers)
    state = StateDir(root)
    state.save_ptc(JOB, 0, mlp_layout(MLP(1, 4), parallel, Placement(2, HOSTS), None, "fp32"))
    state.save(spec, status)
    try:
        with LocalScheduler(root, hosts=2, gpus_per_host=2, token=TOKEN) as s:
            assert s.scheduler is not None and s.scheduler.get(JOB).status.phase == Phase.RUNNING
            yield s
    finally:
        sleeper.kill()
        sleeper.wait()


def post(url: str, body: object, token: str | None = TOKEN) -> tuple[int, dict]:
    """POST JSON to the whole ``url`` with this module's credential (test_api's request helper)."""
    return call(url, "POST", "", body, token=token)


def record(sched: LocalScheduler, worker: str) -> WorkerRecord:
    assert sched.scheduler is not None
    ctl = sched.scheduler.get(JOB)
    with ctl.lock:
        return next(w for w in ctl.status.workers if w.worker_id == worker)


def set_beat(sched: LocalScheduler, worker: str, when: float) -> None:
    assert sched.scheduler is not None
    ctl = sched.scheduler.get(JOB)
    with ctl.lock:
        next(w for w in ctl.status.workers if w.worker_id == worker).last_heartbeat = when


def daemon_url(sched: LocalScheduler, host: str) -> str:
    return next(h.store_url for h in sched.cluster.hosts() if h.name == host)


def test_a_nodes_batch_is_answered_per_worker(sched: LocalScheduler) -> None:
    """One request for a node's workers: each gets its own heartbeat's answer, in the batch's order."""
    url = f"{sched.url}/v1/jobs/{JOB}/nodes/host-0/heartbeats"
    set_beat(sched, wid(0), time.time() - 100)
    before = time.time()
    status, body = post(url, {
        "workers": [wid(0), wid(1), wid(2), wid(3), "nobody"],  # wid(2) runs on host-1; wid(3) is of generation 0
        "generations": [0, 0, 0, 5, 0], "steps": [7] * 5, "ages": [4.0, 0, 0, 0, 0],
        "losses": [2.5, None, None, None, None], "marks": {wid(1): {"first_step": 1e9}},
    })
    after = time.time()
    assert status == 200, body
    answers = P.NodeHeartbeatsReply.model_validate(body)
    assert answers.reply == P.HeartbeatReply(generation=0) and wid(0) not in answers.errors
    assert wid(1) not in answers.errors
    assert {w: e.error for w, e in answers.errors.items()} == {
        wid(2): Conflict.code, wid(3): Conflict.code, "nobody": NotFound.code}
    assert "runs on host-1, not on host-0" in answers.errors[wid(2)].detail
    # Dated back by the daemon's hold: the beat counts from when the worker sent it.
    beat = record(sched, wid(0)).last_heartbeat
    assert beat is not None and before - 4.0 <= beat <= after - 4.0
    assert record(sched, wid(0)).step == 7 and record(sched, wid(2)).step != 7
    # A beat older than the last one recorded (a delayed batch) does not move it back.
    post(url, {"workers": [wid(0)], "generations": [0], "steps": [8], "ages": [60.0]})
    assert record(sched, wid(0)).last_heartbeat == beat and record(sched, wid(0)).step == 8


def test_the_route_checks_its_input_and_credential(sched: LocalScheduler) -> None:
    url = f"{sched.url}/v1/jobs/{JOB}/nodes/host-0/heartbeats"
    beat = {"workers": [wid(0)], "generations": [0], "steps": [1], "ages": [0.0]}
    assert post(url, beat, token="wrong")[1]["error"] == "unauthorized"
    assert post(f"{sched.url}/v1/jobs/nope/nodes/host-0/heartbeats", beat)[0] == 404
    for bad, says in (({**beat, "workers": []}, "body.workers"),
                      ({**beat, "workers": [wid(0), wid(0)], "generations": [0, 0], "steps": [1, 1], "ages": [0, 0]},
                       "more than once"),
                      ({**beat, "steps": [1, 2]}, "one entry per worker (1): {'steps': 2}"),
                      ({**beat, "ages": [-1]}, "body.ages.0"),
                      ({**beat, "marks": {wid(0): {"typo": 1.0}}}, "unknown marks ['typo']"),
                      ({**beat, "marks": {wid(1): {"first_step": 1.0}}}, "marks of workers not in the batch")):
        status, body = post(url, bad)
        assert status == 400 and body["error"] == "invalid_input" and says in body["detail"], (bad, body)
    assert post(f"{sched.url}/v1/jobs/{JOB}/nodes/-bad-/heartbeats", beat)[0] == 400


def test_a_dead_worker_is_noticed_within_the_timeout_of_its_last_beat(sched: LocalScheduler) -> None:
    """The bound: failed at the first tick after its last beat (as the daemon received it) + the heartbeat
    timeout, whether its beats went straight to the scheduler or through its node's daemon (which dates each
    beat back by how long it held it; a worker that stops beating is not in its node's next batch)."""
    relay = HeartbeatRelay(sched.url, interval_s=3600.0, clock=lambda: clock[0])
    clock = [100.0]
    auth = f"Bearer {TOKEN}"

    for r in (0, 1):
        set_beat(sched, wid(r), time.time() - 100)

    async def beats() -> tuple[float, float, int]:
        waits = [asyncio.create_task(relay.beat(JOB, wid(r), auth, P.RelayedHeartbeat(
            generation=0, step=20, scheduler_url=sched.url, host="host-0"))) for r in (0, 1)]
        await asyncio.sleep(0)
        clock[0] += 2.5  # the daemon held them 2.5 s
        before = time.time()
        assert await relay.flush() == 1  # one batch for the node's two workers
        after = time.time()
        answers = [await w for w in waits]
        assert [s for s, _ in answers] == [200, 200]
        assert P.HeartbeatReply.model_validate_json(answers[0][1]).generation == 0
        # Worker 1 died: only worker 0 beats again.
        late = asyncio.create_task(relay.beat(JOB, wid(0), auth, P.RelayedHeartbeat(
            generation=0, step=21, scheduler_url=sched.url, host="host-0")))
        await asyncio.sleep(0)
        assert await relay.flush() == 1
        assert (await late)[0] == 200
        return before, after, relay.batches

    before, after, batches = asyncio.run(beats())
    assert batches == 2
    dead, alive = record(sched, wid(1)), record(sched, wid(0))
    assert dead.step == 20 and alive.step == 21
    last = dead.last_heartbeat
    assert last is not None and before - 2.5 <= last <= after - 2.5  # dated back by the hold
    assert sched.scheduler is not None
    ctl = sched.scheduler.get(JOB)
    with ctl.lock:
        spec, status = ctl.spec, ctl.status
        others = {w.worker_id for w in status.workers} - {wid(1)}
        for w in status.workers:
            if w.worker_id in others:
                w.last_heartbeat = last + TIMEOUT  # the others beat on
        at_bound = Observations(now=last + TIMEOUT, stage_age=0.0, hosts=[], exits={})
        past = Observations(now=last + TIMEOUT + 0.001, stage_age=0.0, hosts=[], exits={})
        assert detect_failure(spec, status, at_bound, start_timeout=60) is None
        assert detect_failure(spec, status, past, start_timeout=60) == f"worker {wid(1)} missed heartbeats for 3600s"


def test_beats_at_the_restored_step_do_not_wake_the_loop_during_a_downtime(sched: LocalScheduler) -> None:
    """After a change the new workers beat at the restored step until their first step: a node's batch wakes the
    job's loop (a tick over every worker) only once a step past it may end the downtime; the poll sees the rest."""
    assert sched.scheduler is not None
    ctl = sched.scheduler.get(JOB)
    with ctl.lock:  # the loop's ticks wait: the record is as set here
        st = ctl.status
        assert st.phase == Phase.RUNNING and st.stop_at_step is None
        kept = (st.downtime_started_at, st.restored_step, st.step, st.stage)
        st.downtime_started_at, st.restored_step = time.time(), 10_000 - 2
        try:
            assert not ctl._progress(10_000 - 2, None, False)  # the restored step: nothing to end yet
            assert ctl._progress(10_000 - 2, None, True)  # a milestone (the first step's mark) wakes it
            assert ctl._progress(10_000 - 1, None, False)  # past it: training is back
            st.downtime_started_at = None
            assert not ctl._progress(10_000 - 1, None, False)  # steady training: the poll is enough
            st.phase, st.stage, st.stop_at_step = Phase.RECONFIGURING, Stage.STOPPING, 10_000 - 1
            assert not ctl._progress(10_000 - 2, None, False)  # stopping: their exit reports move it on
            assert ctl._progress(10_000 - 1, None, False)  # the stop step reached
        finally:
            st.downtime_started_at, st.restored_step, st.step, st.stage = kept
            st.phase, st.stop_at_step = Phase.RUNNING, None


def test_a_worker_heartbeats_through_its_daemon_and_hears_the_stop_step(sched: LocalScheduler) -> None:
    """The worker's heartbeat thread asks its daemon, relays through it, and gets what the scheduler answers."""
    host = "host-1"
    node = daemon_url(sched, host)
    client = ControlClient(sched.url, JOB, wid(2), TOKEN)
    assert client.relays_for_me(node)
    assert not ControlClient("http://127.0.0.1:9", JOB, wid(2), TOKEN).relays_for_me(node)  # another scheduler
    assert sched.scheduler is not None
    ctl = sched.scheduler.get(JOB)
    with ctl.lock:
        ctl.status.stop_at_step = 50
    try:
        hb = Heartbeat(client, 0, 3600.0, node=(node, host))
        hb.update(30)
        hb.beat_now()
        assert hb.relayed and hb.stop_at_step == 50 and not hb.abort
        assert record(sched, wid(2)).step == 30
        # A worker of this host that the scheduler does not know gets its own error back through the daemon.
        stranger = ControlClient(sched.url, JOB, "stranger", TOKEN)
        with pytest.raises(NotFound, match="has no worker 'stranger'"):
            stranger.heartbeat(0, 1, relay=(node, host))
        with pytest.raises(Conflict, match="relays heartbeats to"):
            ControlClient("http://127.0.0.1:9", JOB, wid(2), TOKEN).heartbeat(0, 1, relay=(node, host))
    finally:
        with ctl.lock:
            ctl.status.stop_at_step = None
    # The daemon counts what it relayed.
    with urllib.request.urlopen(urllib.request.Request(node + "/metrics",
                                                       headers={"Authorization": f"Bearer {TOKEN}"})) as resp:
        relayed = {line.split(" ")[0]: float(line.split(" ")[1]) for line in resp.read().decode().splitlines()
                   if line.startswith("tenplex_relay_")}
    assert relayed["tenplex_relay_batches_total"] >= 2 and relayed["tenplex_relay_heartbeats_total"] >= 2, relayed
    # Without a node (or with a daemon that relays for another scheduler) it heartbeats the scheduler itself.
    direct = Heartbeat(ControlClient(sched.url, JOB, wid(3), TOKEN), 0, 3600.0)
    direct.update(31)
    direct.beat_now()
    assert not direct.relayed and record(sched, wid(3)).step == 31
    # A relayed beat that fails (here: reported for the wrong node) goes to the scheduler itself.
    wrong = Heartbeat(ControlClient(sched.url, JOB, wid(3), TOKEN), 0, 3600.0, node=(node, "host-0"))
    wrong.update(32)
    wrong.beat_now()
    assert not wrong.relayed and record(sched, wid(3)).step == 32


def test_a_relay_needs_a_scheduler_url() -> None:
    with pytest.raises(InvalidConfig, match="scheduler URL"):
        HeartbeatRelay("ftp://x")
    with pytest.raises(InvalidConfig, match="interval"):
        HeartbeatRelay("http://127.0.0.1:1", interval_s=0)


def test_the_daemon_says_whom_it_relays_for(sched: LocalScheduler, tmp_path: Path) -> None:
    with urllib.request.urlopen(urllib.request.Request(daemon_url(sched, "host-0") + P.RELAY_PATH,
                                                       headers={"Authorization": f"Bearer {TOKEN}"})) as resp:
        info = P.RelayInfo.model_validate_json(resp.read())
    assert info.scheduler_url == sched.url and info.interval_s == 0.5


def relay_counters(node: str) -> dict[str, float]:
    with urllib.request.urlopen(urllib.request.Request(node + "/metrics",
                                                       headers={"Authorization": f"Bearer {TOKEN}"})) as resp:
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in resp.read().decode().splitlines()
                if line.startswith("tenplex_relay_")}


def test_the_workers_of_a_node_get_the_ptc_through_their_daemon_fetched_once(sched: LocalScheduler) -> None:
    """A generation's PTC comes through the node daemon, which fetches it from the scheduler once for its workers;
    what the scheduler refuses is refused the same, and a worker of another scheduler fetches it itself."""
    assert sched.scheduler is not None
    expected = sched.scheduler.get(JOB).ptc(0).dumps()
    node = daemon_url(sched, "host-1")
    base = P.Assignment.model_validate(call(f"{sched.url}/v1/jobs/{JOB}/workers/{wid(2)}/assignment", "GET", "",
                                            token=TOKEN)[1])
    digest = ptc_digest(sched.scheduler.get(JOB).ptc(0))
    by_url = base.model_copy(update={"ptc": None, "ptc_url": f"/v1/jobs/{JOB}/ptc?generation=0&digest={digest}"})
    before = relay_counters(node)
    for rank in (2, 3):
        assert ControlClient(sched.url, JOB, wid(rank), TOKEN).fetch_ptc(by_url, node).dumps() == expected
    after = relay_counters(node)
    assert after["tenplex_relay_ptc_fetches_total"] - before.get("tenplex_relay_ptc_fetches_total", 0) == 1
    assert after["tenplex_relay_ptc_served_total"] - before.get("tenplex_relay_ptc_served_total", 0) == 2
    assert after["tenplex_relay_ptc_fetches_total"] >= 1
    # The daemon's route answers what the scheduler answers, gzipped or not.
    route = node + P.RELAY_PTC_PATH.format(job=JOB)
    plain = urllib.request.Request(f"{route}?generation=0&scheduler_url={sched.url}&digest={digest}",
                                   headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(plain) as resp:
        assert resp.headers.get("Content-Encoding") is None and resp.read().decode() == expected
    status, body = call(f"{route}?generation=7&scheduler_url={sched.url}", "GET", "", token=TOKEN)
    assert status == NotFound.http_status and body["error"] == NotFound.code, body
    status, body = call(f"{route}?generation=0&scheduler_url=http://127.0.0.1:9", "GET", "", token=TOKEN)
    assert status == Conflict.http_status and "relays for" in body["detail"], body
    status, body = call(f"{route}?generation=0&scheduler_url={sched.url}", "GET", "", token="forged")
    assert status == Unauthorized.http_status, body
    # Through the daemon or not, a worker gets the scheduler's own error (here: a generation it does not have, and
    # the ptc_url of a job created again under the same name: another PTC).
    with pytest.raises(NotFound):
        ControlClient(sched.url, JOB, wid(2), TOKEN).fetch_ptc(by_url.model_copy(
            update={"ptc_url": f"/v1/jobs/{JOB}/ptc?generation=7", "generation": 7}), node)
    with pytest.raises(Conflict, match="another PTC"):
        ControlClient(sched.url, JOB, wid(2), TOKEN).fetch_ptc(by_url.model_copy(
            update={"ptc_url": f"/v1/jobs/{JOB}/ptc?generation=0&digest=0123456789abcdef"}), node)
    # A worker of another scheduler does not use this daemon (it fetches ptc_url itself: unreachable here).
    served = relay_counters(node)["tenplex_relay_ptc_served_total"]
    with pytest.raises(SchedulerUnavailable):
        ControlClient("http://127.0.0.1:9", JOB, wid(2), TOKEN, retries=0).fetch_ptc(by_url, node)
    assert relay_counters(node)["tenplex_relay_ptc_served_total"] == served


def test_the_daemons_ptc_cache_is_bounded_and_keyed_by_generation_and_credential(sched: LocalScheduler) -> None:
    assert sched.scheduler is not None
    ctl = sched.scheduler.get(JOB)
    ctl.ctx.set_ptc(1, ctl.ptc(0))  # a second generation's PTC to ask for
    cache = PtcCache(sched.url, entries=1)
    auth = f"Bearer {TOKEN}"

    async def fetches() -> list[int]:
        counts = []
        for generation in (0, 0, 1, 0):
            ptc = await cache.get(JOB, generation, auth, ptc_digest(ctl.ptc(generation)))
            assert ptc.json_bytes().decode() == ctl.ptc(generation).dumps()
            counts.append(cache.fetches)
        asked = await asyncio.gather(*(cache.get(JOB, 1, auth, ptc_digest(ctl.ptc(1))) for _ in range(4)))
        assert len({id(p) for p in asked}) == 1  # asked at once: one fetch
        counts.append(cache.fetches)
        await cache.get(JOB, 1, auth, None)  # without a digest (an older scheduler's ptc_url): fetched, not kept
        await cache.get(JOB, 1, auth, None)
        counts.append(cache.fetches)
        with pytest.raises(Unauthorized):  # another credential: asked of the scheduler, refused
            await cache.get(JOB, 1, "Bearer forged", ptc_digest(ctl.ptc(1)))
        with pytest.raises(Conflict, match="another PTC"):
            await cache.get(JOB, 1, auth, "0123456789abcdef")
        return counts

    assert asyncio.run(fetches()) == [1, 1, 2, 3, 4, 6] and len(cache) == 1
    with pytest.raises(InvalidConfig, match="room for one PTC"):
        PtcCache(sched.url, entries=0)


def test_a_registration_is_answered_with_the_route_contract(sched: LocalScheduler) -> None:
    """Registrations are answered ahead of the app's routing (15,360 at once at a 16,384-GPU restart), with the
    route's contract: the worker's Assignment, or its error."""
    url = f"{sched.url}/v1/jobs/{JOB}/workers/register"
    status, body = post(url, {"worker_id": wid(1), "host": "host-0", "pid": 123, "rank": 1})
    assert status == 200, body
    a = P.Assignment.model_validate(body)
    assert (a.worker_id, a.rank, a.world_size, a.host, a.local_rank, a.generation) == (wid(1), 1, 4, "host-0", 1, 0)
    assert record(sched, wid(1)).pid == 123 and record(sched, wid(1)).registered
    assert ControlClient(sched.url, JOB, wid(2), TOKEN).register(host="host-1", rank=2).rank == 2
    for body, code, says in (({"worker_id": "nobody"}, NotFound, "has no worker 'nobody'"),
                             ({"worker_id": "Bad Name!"}, InvalidInput, "worker_id"),
                             ({"worker_id": wid(1), "surprise": 1}, InvalidInput, "surprise")):
        status, answer = post(url, body)
        assert status == code.http_status and answer["error"] == code.code and says in answer["detail"], answer
    assert post(url, {"worker_id": wid(1)}, token="forged")[0] == Unauthorized.http_status
    assert post(f"{sched.url}/v1/jobs/nojob/workers/register", {"worker_id": wid(1)})[0] == NotFound.http_status


def test_a_nodes_snapshot_and_exit_reports_go_to_the_scheduler_in_one_batch(sched: LocalScheduler) -> None:
    """A node daemon sends the snapshot and exit reports of its workers as one batch, each worker answered with
    its own report's answer (an Ack, or the error the report sent directly gets), and a report the daemon cannot
    deliver goes to the scheduler itself: an exit report is never lost."""
    assert sched.scheduler is not None
    ctl = sched.scheduler.get(JOB)
    host = "host-1"
    node = daemon_url(sched, host)

    def exit_body(worker: str, generation: int = 0) -> dict:
        return {"worker_id": worker, "exit": {"generation": generation, "step": 9, "status": "stopped", "exit_code": 0}}

    try:
        # The scheduler's route: one request, each report handled as if sent directly, errors under their index.
        status, body = post(f"{sched.url}/v1/jobs/{JOB}/nodes/{host}/reports", {"reports": [
            exit_body(wid(2)), exit_body("nobody"), exit_body(wid(3), generation=5),
            {"worker_id": wid(3), "snapshot": {"generation": 0, "step": 9, "version": "s9-g0", "host": host,
                                               "committed": False}}]})
        assert status == 200, body
        reply = P.NodeReportsReply.model_validate(body)
        assert {i: e.error for i, e in reply.errors.items()} == {1: NotFound.code, 2: Conflict.code}, reply
        with ctl.lock:
            assert ctl.ctx.exit_reports[wid(2)].step == 9 and wid(3) not in ctl.ctx.exit_reports
        status, body = post(f"{sched.url}/v1/jobs/{JOB}/nodes/{host}/reports", {"reports": []})
        assert status == InvalidInput.http_status and body["error"] == InvalidInput.code, body
        status, body = post(f"{sched.url}/v1/jobs/{JOB}/nodes/{host}/reports", {"reports": [exit_body(wid(2))]},
                            token="forged")
        assert status == Unauthorized.http_status, body

        # Through the daemon: the worker's own answer; a stranger's error comes back as its own direct report's.
        before = relay_counters(node)
        client = ControlClient(sched.url, JOB, wid(3), TOKEN)
        client.report_exit(0, 11, "stopped", P.EXIT_STOPPED, relay=(node, host))
        after = relay_counters(node)
        assert after["tenplex_relay_reports_total"] - before.get("tenplex_relay_reports_total", 0) == 1, after
        assert after["tenplex_relay_report_batches_total"] - before.get("tenplex_relay_report_batches_total", 0) == 1
        with ctl.lock:
            assert ctl.ctx.exit_reports[wid(3)].step == 11
        route = node + P.RELAY_REPORT_PATH.format(job=JOB, worker_id="stranger")
        status, body = post(route, {**exit_body("stranger"), "scheduler_url": sched.url, "host": host})
        assert status == NotFound.http_status and "has no worker 'stranger'" in body["detail"], body
        with pytest.raises(NotFound, match="has no worker 'stranger'"):
            ControlClient(sched.url, JOB, "stranger", TOKEN).report_exit(0, 1, "stopped", 0, relay=(node, host))
        status, body = post(route, {**exit_body(wid(2)), "scheduler_url": sched.url, "host": host})
        assert status == InvalidInput.http_status and "posted for worker stranger" in body["detail"], body
        status, body = post(route, {**exit_body("stranger"), "scheduler_url": "http://127.0.0.1:9", "host": host})
        assert status == Conflict.http_status and "relays reports to" in body["detail"], body

        # A daemon that is gone: the report goes to the scheduler itself.
        with ctl.lock:
            del ctl.ctx.exit_reports[wid(3)]
        ControlClient(sched.url, JOB, wid(3), TOKEN).report_exit(0, 12, "stopped", 0, relay=("http://127.0.0.1:9", host))
        with ctl.lock:
            assert ctl.ctx.exit_reports[wid(3)].step == 12

        # The relay batches what comes in within its window: two workers' reports, one request.
        async def two_in_one() -> tuple[int, list[tuple[int, bytes]]]:
            relay = HeartbeatRelay(sched.url, interval_s=3600.0)
            relay.report_window_s = 3600.0  # sent by hand below
            auth = f"Bearer {TOKEN}"
            waits = [asyncio.ensure_future(relay.report(JOB, auth, P.RelayedReport.model_validate(
                {**exit_body(w), "scheduler_url": sched.url, "host": host}))) for w in (wid(2), "nobody")]
            await asyncio.sleep(0.01)
            sent = await relay.flush_reports()
            return sent, list(await asyncio.gather(*waits))

        sent, answers = asyncio.run(two_in_one())
        assert sent == 1 and answers[0] == (200, P.Ack().model_dump_json().encode())
        assert answers[1][0] == NotFound.http_status and b"nobody" in answers[1][1], answers
    finally:
        with ctl.lock:
            ctl.ctx.exit_reports.clear()
