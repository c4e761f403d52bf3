"""The scheduler's REST contract over real HTTP: auth, bad input, errors as JSON, never a 5xx."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tenplex.scheduler.server import LocalScheduler

TOKEN = "s3cret-token"

JOB = {
    "name": "gpt",
    "layout": {"provider": "megatron-gpt", "precision": "fp32",
               "model": {"num_layers": 4, "hidden": 32, "heads": 4, "vocab": 100, "seq_len": 16,
                         "make_vocab_size_divisible_by": 8}},
    "dataset": {"num_samples": 256, "seed": 0, "global_batch_size": 8},
    "command": ["python", "-c", "pass"],
    # More GPUs than the one emulated host has: the job stays Pending and starts no process.
    "gpus": 4, "min_gpus": 1, "max_gpus": 8,
}


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    sched = LocalScheduler(tmp_path_factory.mktemp("sched"), hosts=1, gpus_per_host=2, token=TOKEN).start()
    yield sched
    sched.stop()


def call(url, method, path, body=None, token=TOKEN, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_health_needs_no_token_everything_else_does(scheduler):
    assert call(scheduler.url, "GET", "/healthz", token=None) == (200, {"status": "ok"})
    for token in (None, "wrong"):
        status, body = call(scheduler.url, "GET", "/v1/jobs", token=token)
        assert status == 401 and body["error"] == "unauthorized"
        status, body = call(scheduler.url, "POST", "/v1/jobs", JOB, token=token)
        assert status == 401
    # Nothing was created by the unauthenticated POSTs.
    assert call(scheduler.url, "GET", "/v1/jobs") == (200, {"jobs": []})


@pytest.mark.parametrize(
    ("patch", "fragment"),
    [
        ({"name": "Bad_Name"}, "name"),
        ({"gpus": 0}, "gpus"),
        ({"min_gpus": 4, "max_gpus": 2}, "min_gpus <= max_gpus"),
        ({"gpus": 9}, "gpus must be an integer in [1, 8]"),
        ({"layout": {"provider": "nope", "model": {}}}, "unknown layout provider 'nope'; registered"),
        ({"layout": {"provider": "Not A Provider!", "model": {}}}, "layout.provider"),
        ({"layout": {"provider": "no_such_module:layout", "model": {}}}, "cannot import 'no_such_module'"),
        ({"layout": {"provider": "tenplex.errors:NotFound", "model": {}}}, "not a layout provider"),
        ({"layout": {"provider": "tenplex.testing.layouts:mlp_layout", "model": {"layers": 2}}}, "dim"),
        ({"layout": {"provider": "megatron-gpt", "model": {"hidden": 32}}}, "megatron-gpt model"),
        ({"dataset": {"num_samples": 0, "global_batch_size": 8}}, "dataset.num_samples"),
        ({"command": [], "image": None}, "worker command"),
        ({"policy": {"table": {"four": {"dp": 4}}}}, "policy table keys must be GPU counts"),
        ({"policy": {"table": {"4": {"dp": 3}}}}, "policy table entry for 4 GPUs is dp3"),
        ({"extra_field": 1}, "extra_field"),
        ({"checkpoint": {"uri": "http://x/y", "interval_steps": 5}}, "checkpoint uri must look like"),
        ({"checkpoint": {"uri": "s3://b/p", "interval_steps": 0}}, "checkpoint.interval_steps"),
    ],
)
def test_bad_job_specs_are_400_with_a_reason(scheduler, patch, fragment):
    status, body = call(scheduler.url, "POST", "/v1/jobs", {**JOB, **patch})
    assert status == 400, body
    assert body["error"] in ("invalid_input", "invalid_config")
    assert fragment in body["detail"]


def test_a_users_own_provider_is_named_by_module_and_function(scheduler):
    """No registration needed: the provider's module and function name it (the README's worked example)."""
    job = {**JOB, "name": "mlp", "layout": {"provider": "tenplex.testing.layouts:mlp_layout", "precision": "bf16",
                                            "model": {"layers": 3, "dim": 8}}}
    status, view = call(scheduler.url, "POST", "/v1/jobs", job)
    assert status == 201, view
    assert view["spec"]["layout"] == job["layout"]
    assert call(scheduler.url, "DELETE", "/v1/jobs/mlp") == (200, {"deleted": "mlp"})


def test_a_read_does_not_wait_for_a_busy_controller(scheduler):
    """While the controller holds the job (planning a large job, say), GET answers with the last view: the read
    returns while the holder still has the lock (it lets go only once released, or after a minute)."""
    import threading

    status, created = call(scheduler.url, "POST", "/v1/jobs", {**JOB, "name": "busy"})
    assert status == 201
    ctl = scheduler.scheduler.get("busy")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with ctl.lock:
            ctl.status.message = "changed while busy"
            held.set()
            release.wait(60)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(30)
        status, view = call(scheduler.url, "GET", "/v1/jobs/busy")
        assert status == 200
        assert t.is_alive() and not release.is_set(), "the read returned only once the lock was let go"
        assert view["status"]["message"] != "changed while busy"  # the last consistent view
        assert view["spec"] == created["spec"]
    finally:
        release.set()
        t.join()
    assert call(scheduler.url, "DELETE", "/v1/jobs/busy")[0] == 200


def test_a_read_answers_while_every_worker_thread_waits_for_the_job(scheduler):
    """A node loss on Kubernetes held the job's lock across its pods' deletions (up to 10 s) while worker reports
    and registrations queued for it, each in one of the server's worker threads, until all were taken; a status
    read then waited as long for a thread to authenticate it in (benchmarks/control_plane_k8s.py: one GET of
    10.4-10.9 s). Here sync routes that need the lock (GET /plan) take every worker thread while the lock is
    held; the read must still answer. Judged without a clock: it returns while the holder still holds the lock
    and every thread is known to be waiting for it."""
    import sys
    import threading

    import anyio
    import anyio.to_thread

    async def pool_size() -> int:
        return int(anyio.to_thread.current_default_thread_limiter().total_tokens)

    threads = anyio.run(pool_size)  # the server's loop gets the same default
    assert call(scheduler.url, "POST", "/v1/jobs", {**JOB, "name": "starved"})[0] == 201
    ctl = scheduler.scheduler.get("starved")

    def waiting_for_the_plan() -> int:
        """Threads inside the /plan route (blocked on the job's lock: it is held)."""
        count = 0
        for frame in sys._current_frames().values():
            while frame is not None and not (frame.f_code.co_name == "get_plan"
                                             and frame.f_code.co_filename.endswith("api.py")):
                frame = frame.f_back
            count += frame is not None
        return count

    answers: list[int] = []
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with ctl.lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    plans = [threading.Thread(target=lambda: answers.append(call(scheduler.url, "GET", "/v1/jobs/starved/plan")[0]))
             for _ in range(threads + 4)]
    try:
        assert held.wait(30)
        for t in plans:
            t.start()
        for _ in range(3000):  # every worker thread taken (at most 30 s: a bound on a hang, not a timing)
            if waiting_for_the_plan() >= threads:
                break
            release.wait(0.01)
        assert waiting_for_the_plan() == threads, "the plan reads did not take every worker thread"
        status, view = call(scheduler.url, "GET", "/v1/jobs/starved")
        assert status == 200 and view["spec"]["name"] == "starved"
        assert holder.is_alive() and not release.is_set() and not answers, \
            "the read returned only once the lock was let go"
    finally:
        release.set()
        holder.join()
        for t in plans:
            t.join()
    assert len(answers) == threads + 4  # every queued read was answered once the lock was free
    assert call(scheduler.url, "DELETE", "/v1/jobs/starved")[0] == 200


def test_reports_waiting_for_a_busy_job_leave_the_other_routes_threads(scheduler):
    """Heartbeat batches that wait for a held job lock take at most REPORT_THREADS worker threads; the rest
    queue without one, and the synchronous routes (here /v1/hosts) keep the default pool and answer while
    the lock is held (judged without a clock: they return while the holder still has it)."""
    import sys
    import threading

    from tenplex.scheduler.api import REPORT_THREADS

    assert call(scheduler.url, "POST", "/v1/jobs", {**JOB, "name": "beats"})[0] == 201
    ctl = scheduler.scheduler.get("beats")
    batch = {"workers": ["beats-g0-r0"], "generations": [0], "steps": [1], "ages": [0.0]}

    def waiting() -> int:
        """Threads inside the controller's node_heartbeats (blocked on the job's lock: it is held)."""
        count = 0
        for frame in sys._current_frames().values():
            while frame is not None and frame.f_code.co_name != "node_heartbeats":
                frame = frame.f_back
            count += frame is not None and frame.f_code.co_filename.endswith("controller.py")
        return count

    answers: list[int] = []
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with ctl.lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    reports = [threading.Thread(target=lambda i=i: answers.append(
        call(scheduler.url, "POST", f"/v1/jobs/beats/nodes/host-{i}/heartbeats", batch)[0])) for i in range(48)]
    try:
        assert held.wait(30)
        for t in reports:
            t.start()
        for _ in range(3000):  # at most 30 s: a bound on a hang, not a timing
            if waiting() >= REPORT_THREADS:
                break
            release.wait(0.01)
        status, body = call(scheduler.url, "GET", "/v1/hosts")
        assert status == 200 and body["hosts"]
        assert call(scheduler.url, "GET", "/healthz", token=None) == (200, {"status": "ok"})
        assert holder.is_alive() and not release.is_set() and not answers, "answered only once the lock was free"
        assert waiting() == REPORT_THREADS
    finally:
        release.set()
        holder.join()
        for t in reports:
            t.join()
    assert answers == [200] * 48  # every queued report answered (each worker's error in its body: unknown)
    assert call(scheduler.url, "DELETE", "/v1/jobs/beats")[0] == 200


def test_malformed_json_is_400(scheduler):
    status, body = call(scheduler.url, "POST", "/v1/jobs", raw=b"{not json")
    assert status == 400 and body["error"] == "invalid_input"


def test_job_lifecycle_errors(scheduler):
    url = scheduler.url
    status, view = call(url, "POST", "/v1/jobs", {**JOB, "name": "life"})
    assert status == 201
    assert view["spec"]["name"] == "life" and view["status"]["phase"] == "Pending"
    assert call(url, "POST", "/v1/jobs", {**JOB, "name": "life"})[0] == 409
    # Too many GPUs for the cluster: it waits, saying why.
    status, view = call(url, "GET", "/v1/jobs/life")
    assert status == 200 and view["status"]["phase"] == "Pending"
    assert call(url, "GET", "/v1/jobs/nope")[1]["error"] == "not_found"
    assert call(url, "POST", "/v1/jobs/life/scale", {"gpus": 100})[0] == 400
    assert call(url, "POST", "/v1/jobs/nope/scale", {"gpus": 2})[0] == 404
    assert call(url, "POST", "/v1/jobs/life/scale", {"gpus": "two"})[0] == 400
    status, body = call(url, "POST", "/v1/jobs/life/scale", {"gpus": 4, "parallel": {"dp": 1, "tp": 2}})
    assert status == 400 and "dp1 x tp2 x pp1 is 2 GPUs, the request asks for 4" in body["detail"], body
    status, body = call(url, "POST", "/v1/jobs/life/scale", {"gpus": 0, "parallel": {"dp": 1}})
    assert status == 400 and "takes no parallel configuration" in body["detail"], body
    status, view = call(url, "POST", "/v1/jobs/life/scale", {"gpus": 4, "parallel": {"dp": 2, "tp": 2}})
    assert status == 202 and view["status"]["requested_parallel"] == {"dp": 2, "tp": 2, "pp": 1, "zero": 0}
    assert call(url, "GET", "/v1/jobs/life/plan")[1]["error"] == "not_found"
    assert call(url, "POST", "/v1/jobs/life/events", {"kind": "cordon"})[1]["detail"] == "a cordon event needs a host"
    assert call(url, "POST", "/v1/jobs/life/events", {"kind": "cordon", "host": "host-9"})[0] == 404
    assert call(url, "POST", "/v1/jobs/life/events", {"kind": "peer_failure"})[0] == 409
    # Worker protocol: unknown workers are 404, bodies are validated.
    assert call(url, "POST", "/v1/jobs/life/workers/register", {"worker_id": "w-0"})[0] == 404
    assert call(url, "POST", "/v1/jobs/life/workers/w-0/heartbeat", {"generation": 0, "step": -1})[0] == 400
    # Heartbeats take their own path through the API (before routing), with the route's contract.
    assert call(url, "POST", "/v1/jobs/life/workers/w-0/heartbeat", {"generation": 0, "step": 1}) == (
        404, {"error": "not_found", "detail": "job 'life' has no worker 'w-0' in generation 0"})
    assert call(url, "POST", "/v1/jobs/life/workers/w-0/heartbeat", {"generation": 0, "step": 1},
                token="wrong")[1]["error"] == "unauthorized"
    assert call(url, "POST", "/v1/jobs/nope/workers/w-0/heartbeat", {"generation": 0, "step": 1})[0] == 404
    status, body = call(url, "POST", "/v1/jobs/life/workers/w-0/heartbeat", raw=b"{not json")
    assert status == 400 and body["error"] == "invalid_input" and body["detail"].startswith("body")
    assert call(url, "POST", "/v1/jobs/life/workers/-bad-/heartbeat", {"generation": 0, "step": 1})[0] == 400
    # So do snapshot and exit reports (every worker sends both at once when a planned change stops it).
    snapshot = {"generation": 0, "step": 3, "version": "s3-g0", "host": "host-0", "committed": True}
    leaving = {"generation": 0, "step": 3, "status": "stopped", "exit_code": 0}
    for kind, report in (("snapshot", snapshot), ("exit", leaving)):
        assert call(url, "POST", f"/v1/jobs/life/workers/w-0/{kind}", report) == (
            404, {"error": "not_found", "detail": "job 'life' has no worker 'w-0' in generation 0"}), kind
        assert call(url, "POST", f"/v1/jobs/life/workers/w-0/{kind}", report, token="wrong")[1]["error"] == \
            "unauthorized"
        assert call(url, "POST", f"/v1/jobs/nope/workers/w-0/{kind}", report)[0] == 404
        status, body = call(url, "POST", f"/v1/jobs/life/workers/w-0/{kind}", {**report, "step": -1})
        assert status == 400 and body["error"] == "invalid_input" and body["detail"].startswith("body.step"), body
        assert call(url, "POST", f"/v1/jobs/life/workers/-bad-/{kind}", report)[0] == 400
    assert call(url, "DELETE", "/v1/jobs/life") == (200, {"deleted": "life"})
    assert call(url, "GET", "/v1/jobs/life")[0] == 404


def test_a_live_jobs_spec_is_replaced_by_put(scheduler):
    """``PUT /v1/jobs/{job}``: what the workers start with and what only the scheduler reads may change (the record
    says which fields, and that the workers are to be redeployed); a change of what the state is, a body of another
    job, or an unknown job are refused and change nothing; the new spec is in the job's record on disk."""
    url = scheduler.url
    assert call(url, "POST", "/v1/jobs", {**JOB, "name": "respec"})[0] == 201
    changed = {**JOB, "name": "respec", "command": ["python", "-c", "pass", "--lr", "0.1"], "env": {"LR": "0.1"},
               "snapshot_every": 5, "max_restarts": 7}
    status, view = call(url, "PUT", "/v1/jobs/respec", changed)
    assert status == 202, view
    assert view["spec"]["env"] == {"LR": "0.1"} and view["spec"]["max_restarts"] == 7
    update = view["status"]["spec_update"]
    assert update["fields"] == ["command", "env", "snapshot_every", "max_restarts"] and update["pending"], update
    for bad, field in ((
            {"dataset": {**JOB["dataset"], "seed": 1}}, "spec.training.dataset"),
            ({"layout": {**JOB["layout"], "precision": "bf16"}}, "spec.layout"),
            ({"policy": {"zero": 1}}, "spec.policy"),
            ({"checkpoint": {"uri": "file:///ckpt", "interval_steps": 5}}, "spec.checkpoint.uri")):
        status, body = call(url, "PUT", "/v1/jobs/respec", {**changed, **bad})
        assert status == 400 and body["detail"].startswith(f"{field} is immutable"), body
    assert call(url, "PUT", "/v1/jobs/respec", {**changed, "name": "other"})[0] == 400
    ctl = scheduler.scheduler.get("respec")
    with ctl.lock:  # as if it had trained to step 3 (this job never starts: no host has its GPUs)
        ctl.status.step = 3
    status, body = call(url, "PUT", "/v1/jobs/respec", {**changed, "steps": 3})
    assert status == 400 and "steps 3 is not after the step job 'respec' has reached (3)" in body["detail"], body
    with ctl.lock:
        ctl.status.step = 0
    assert call(url, "PUT", "/v1/jobs/nope", {**changed, "name": "nope"})[0] == 404
    (spec, record), = [(s, r) for s, r in scheduler.scheduler.state.load_all() if s.name == "respec"]
    assert spec.env == {"LR": "0.1"} and spec.command[-2:] == ("--lr", "0.1") and spec.dataset.seed == 0
    assert record.redeploy_pending and record.spec_update["fields"] == update["fields"]
    assert call(url, "DELETE", "/v1/jobs/respec")[0] == 200


def test_openapi_fuzz_never_500(scheduler):
    """Every operation of the published OpenAPI, fuzzed by schemathesis: 4xx for bad input, never 5xx."""
    schema = schemathesis.openapi.from_url(scheduler.url + "/openapi.json")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12
    for op in operations:

        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            case.call_and_validate(base_url=scheduler.url, headers=auth, checks=[not_a_server_error])

        check()
