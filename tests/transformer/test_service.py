"""The node daemon's transform routes: a host's part of a plan runs in its daemon, idempotently.

Real daemons (in threads on 127.0.0.2..5, and as `tenplex store serve`
processes for the restart and multi-process cases), real plans of a tiny
Megatron GPT, bit-exact checks of the new version.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenplex.errors import Conflict, InvalidInput, NotFound, TransformCancelled, Unauthorized
from tenplex.node.daemon import NodeDaemon
from tenplex.node.transforms import TransformSettings
from tenplex.ptc import ParallelConfig
from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore
from tenplex.transformer import part
from tenplex.transformer.plan import make_plan
from tenplex.transformer.remote import PlanRun, TransformRequest, TransformStatus, transforms_path

from .conftest import check_new_state, populate, random_state
from .test_transform_e2e import layout

pytestmark = pytest.mark.slow

OLD_V, NEW_V = "s3-g0", "s3-g1"


def _plan(cluster, job: str, *, old_hosts=("h0", "h1"), new_hosts=("h1", "h2"), new_cfg=None):
    old = layout(ParallelConfig(dp=2, tp=2), 2, list(old_hosts), "bf16")
    new = layout(new_cfg or ParallelConfig(tp=2, pp=2), 2, list(new_hosts), "bf16")
    state = random_state(old, seed=len(job))
    populate(cluster, old, state, job, OLD_V)
    return old, new, state, make_plan(old, new, job=job, old_version=OLD_V, new_version=NEW_V)


def _request(cluster, plan, host: str, **sources: str) -> dict:
    srcs = sources or {h: cluster.servers[h].url for h in plan.sources_of(host)}
    return TransformRequest(host=host, plan=plan.for_host(host), sources=srcs).to_json()


def _wait(client: StoreClient, job: str, version: str, timeout: float = 60) -> TransformStatus:
    deadline = time.monotonic() + timeout
    while True:
        status = TransformStatus.from_json(client.request_json("GET", transforms_path(job, version)))
        if status.finished or time.monotonic() > deadline:
            return status
        time.sleep(0.02)


def _cancel(client: StoreClient, job: str) -> TransformStatus:
    """DELETE the transform of ``NEW_V``, then its end state: the DELETE answers once the transform stopped or after
    its own wait (CANCEL_WAIT_S), which a loaded machine can outlast; then the record is read until it ends. The tests
    judge the state the transform ended in, not how soon (their sources' timeout is an hour: only the cancel ends it)."""
    status = TransformStatus.from_json(client.request_json("DELETE", transforms_path(job, NEW_V)))
    return status if status.finished else _wait(client, job, NEW_V, timeout=600)


@pytest.fixture
def hung_source() -> Iterator[str]:
    """A 'store' that accepts connections and never answers: reads from it hang until the client's timeout."""
    srv = socket.create_server(("127.0.0.9", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(conn)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.9:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join(2)
        for c in held:
            c.close()
        srv.close()


def test_a_hosts_part_runs_in_its_daemon_and_a_second_submission_attaches(cluster) -> None:
    old, new, state, plan = _plan(cluster, "attach")
    client = cluster.clients["h1"]
    body = _request(cluster, plan, "h1")
    first = TransformStatus.from_json(client.request_json("POST", transforms_path("attach"), body))
    assert first.state in ("queued", "running", "committed") and first.host == "h1" and first.version == NEW_V
    again = TransformStatus.from_json(client.request_json("POST", transforms_path("attach"), body))
    assert again.digest == first.digest and again.submitted_at == first.submitted_at  # the same transform
    done = _wait(client, "attach", NEW_V)
    assert done.state == "committed", done
    hp = plan.host("h1")
    report = done.transform_report()
    assert done.bytes_done == done.bytes_total == hp.bytes_total
    assert (report.bytes_remote, report.bytes_local, report.bytes_zero) == (hp.bytes_remote, hp.bytes_local, hp.bytes_zero)
    assert done.rate > 0 and done.seconds > 0
    # Submitted again once finished: the finished record, nothing runs twice.
    after = TransformStatus.from_json(client.request_json("POST", transforms_path("attach"), body))
    assert after.state == "committed" and after.finished_at == done.finished_at
    listed = client.request_json("GET", transforms_path("attach"))["transforms"]
    assert [t["version"] for t in listed] == [NEW_V]
    # Only h1's part ran: h2's shards are not there yet.
    assert {(s.tensor, s.region) for s in client.manifest("attach", NEW_V).shards} == {
        (t.name, s.region) for t, s in new.shards_on_host("h1")}
    with pytest.raises(NotFound):
        cluster.clients["h2"].request_json("GET", transforms_path("attach", NEW_V))


def test_kept_shards_are_linked_on_the_node(cluster) -> None:
    """A dp change that keeps h0's tp shards where they are: linked into the new version, never sent."""
    old, new, state, plan = _plan(cluster, "keep", old_hosts=("h0", "h1"), new_hosts=("h0", "h1"),
                                  new_cfg=ParallelConfig(dp=2, tp=2))
    reports = PlanRun(plan, {h: cluster.servers[h].url for h in ("h0", "h1")}, token=None,
                      client_for=lambda url: StoreClient(url)).wait(poll_interval=0.05, timeout=60)
    for host, report in reports.items():
        assert report.bytes_remote == 0 and report.bytes_linked == report.bytes_local == plan.host(host).bytes_total > 0
    check_new_state(cluster, new, state, "keep", NEW_V)


def test_a_different_plan_for_the_same_version_is_refused(cluster) -> None:
    _old, _new, _state, plan = _plan(cluster, "clash")
    client = cluster.clients["h1"]
    client.request_json("POST", transforms_path("clash"), _request(cluster, plan, "h1"))
    other = make_plan(layout(ParallelConfig(dp=2, tp=2), 2, ["h0", "h1"], "bf16"),
                      layout(ParallelConfig(tp=4), 4, ["h1"], "bf16"), job="clash", old_version=OLD_V, new_version=NEW_V)
    with pytest.raises(Conflict, match="another plan"):
        client.request_json("POST", transforms_path("clash"), _request(cluster, other, "h1"))
    assert _wait(client, "clash", NEW_V).state == "committed"


def test_bad_requests_get_clear_errors_and_start_nothing(cluster) -> None:
    _old, _new, _state, plan = _plan(cluster, "bad")
    client = cluster.clients["h2"]
    path = transforms_path("bad")
    good = _request(cluster, plan, "h2")
    cases = [
        ({**good, "host": "h3"}, "no part for host 'h3'"),
        ({k: v for k, v in good.items() if k != "plan"}, "needs 'plan'"),
        ({**good, "sources": {"h0": "ftp://x"}}, "must look like http"),
        ({**good, "extra": 1}, "unknown fields"),
        ({**good, "plan": {"format": "nope"}}, "not a transformation plan"),
        ([1, 2], "JSON object"),
    ]
    for body, message in cases:
        with pytest.raises(InvalidInput, match=message):
            client.request_json("POST", path, body)
    with pytest.raises(InvalidInput, match="for job 'bad'"):
        client.request_json("POST", transforms_path("other"), good)
    # The binary form the scheduler sends: another format version, or a damaged part, is refused by name.
    binary = PlanRun(plan, {h: cluster.servers[h].url for h in ("h0", "h1", "h2")}, token=None,
                     client_for=StoreClient).body("h2")
    head = len(binary) - len(part.encode(plan, "h2"))
    future_request = binary[:8] + struct.pack("<I", 2) + binary[12:]
    future_part = binary[:head + 8] + struct.pack("<I", 9) + binary[head + 12:]
    for body, message in [
        (b"TPLXNOPE" + binary[8:], "JSON or the binary form"),
        (future_request, "request format version 2: this daemon reads version 1 only"),
        (future_part, "plan part format version 9: this daemon reads version 1 only"),
        (binary[:-40], "malformed plan part: .*truncated"),
        (binary[:head] + b"XXXXXXXX" + binary[head + 8:], "not a tenplex plan part"),
    ]:
        with pytest.raises(InvalidInput, match=message):
            client.request_json("POST", path, body)
    with pytest.raises(InvalidInput, match="not JSON"):
        client._call("POST", path, lambda r: r.read(), body=b"{nope", headers={"Content-Type": "application/json"})
    with pytest.raises(NotFound):
        client.request_json("GET", transforms_path("bad", NEW_V))
    assert client.request_json("GET", path) == {"job": "bad", "transforms": []}


def test_the_transform_routes_need_the_token(tmp_path: Path) -> None:
    with NodeDaemon(tmp_path / "n", token="s3cret") as daemon:
        with pytest.raises(Unauthorized), StoreClient(daemon.url, "wrong") as c:
            c.request_json("GET", transforms_path("j"))
        with StoreClient(daemon.url, "s3cret") as c:
            assert c.request_json("GET", transforms_path("j"))["transforms"] == []


def test_cancel_stops_a_running_transform_and_commits_nothing(tmp_path: Path, cluster, hung_source: str) -> None:
    """h2's part reads from a source that never answers; DELETE cancels it: state cancelled, no new version.
    The source timeout is an hour, far past this test's waits: the transform can only end "cancelled" because the
    cancel cut the hung reads, not because they timed out (so the test reads on past the DELETE's own wait,
    CANCEL_WAIT_S, when a loaded machine takes longer: the end state is the assertion, not the time)."""
    _old, _new, _state, plan = _plan(cluster, "cancel", new_hosts=("h2", "h3"))
    with NodeDaemon(tmp_path / "t", host="127.0.0.6", store=LocalStore(tmp_path / "t", durable=False),
                    transforms=TransformSettings(source_timeout_s=3600.0)) as daemon, StoreClient(daemon.url) as client:
        hp = plan.host("h2")
        req = TransformRequest(host="h2", plan=plan.for_host("h2"), sources={h: hung_source for h in plan.sources_of("h2")})
        client.request_json("POST", transforms_path("cancel"), req.to_json())
        deadline = time.monotonic() + 10
        while client.request_json("GET", transforms_path("cancel", NEW_V))["state"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status = _cancel(client, "cancel")
        assert status.state == "cancelled" and status.error_code == TransformCancelled.code, status
        assert status.bytes_done < hp.bytes_total
        with pytest.raises(NotFound):
            client.versions("cancel")
        # Cancelled is final: a resubmission answers it; DELETE again forgets it, and a new one runs.
        again = TransformStatus.from_json(client.request_json("POST", transforms_path("cancel"), req.to_json()))
        assert again.state == "cancelled"
        client.request_json("DELETE", transforms_path("cancel", NEW_V))
        good = TransformRequest(host="h2", plan=plan.for_host("h2"),
                                sources={h: cluster.servers[h].url for h in plan.sources_of("h2")})
        client.request_json("POST", transforms_path("cancel"), good.to_json())
        assert _wait(client, "cancel", NEW_V).state == "committed"


def _start_daemon(root: Path, address: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """A node daemon in its own process (its own session, so that it can be killed like a crashed host); its
    log goes to ``<root>.log``, quoted when it does not come up."""
    port_file = root.parent / f"{root.name}.port"
    port_file.unlink(missing_ok=True)
    log = root.parent / f"{root.name}.log"
    with log.open("ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tenplex", "--log-level", "INFO", "store", "serve", "--root", str(root),
             "--host", address, "--port", "0", "--port-file", str(port_file), *extra],
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=err,
        )
    deadline = time.monotonic() + 120
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            pytest.fail(f"the node daemon did not come up (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    return proc, f"http://{address}:{port_file.read_text().strip()}"


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_a_daemon_killed_mid_transform_reads_interrupted_and_a_resubmission_redoes_it(
    tmp_path: Path, cluster, hung_source: str
) -> None:
    _old, new, state, plan = _plan(cluster, "restart", new_hosts=("h2", "h3"))
    root = tmp_path / "node"
    proc, url = _start_daemon(root, "127.0.0.7")
    try:
        stuck = TransformRequest(host="h2", plan=plan.for_host("h2"), sources={h: hung_source for h in plan.sources_of("h2")})
        with StoreClient(url, retries=0, timeout=5) as c:
            c.request_json("POST", transforms_path("restart"), stuck.to_json())
            while c.request_json("GET", transforms_path("restart", NEW_V))["state"] != "running":
                time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        record = json.loads((root / ".transforms" / "restart" / f"{NEW_V}.json").read_text())
        assert record["state"] == "running"  # what the dead daemon last wrote
        proc, url = _start_daemon(root, "127.0.0.7")
        with StoreClient(url, retries=1, timeout=60) as c:
            status = TransformStatus.from_json(c.request_json("GET", transforms_path("restart", NEW_V)))
            assert status.state == "interrupted" and "stopped" in (status.error or "")
            # A resubmission (the scheduler after its restart) runs it again, from nothing.
            c.request_json("POST", transforms_path("restart"), stuck.to_json())
            assert _cancel(c, "restart").state == "cancelled"
            c.request_json("DELETE", transforms_path("restart", NEW_V))  # forgotten: it may be submitted anew
            good = TransformRequest(host="h2", plan=plan.for_host("h2"),
                                    sources={h: cluster.servers[h].url for h in plan.sources_of("h2")})
            c.request_json("POST", transforms_path("restart"), good.to_json())
            assert _wait(c, "restart", NEW_V).state == "committed"
            got = {(s.tensor, s.region) for s in c.manifest("restart", NEW_V).shards}
            assert got == {(t.name, s.region) for t, s in new.shards_on_host("h2")}
    finally:
        _stop(proc)


def test_several_daemon_processes_agree_on_one_transform(tmp_path: Path, cluster) -> None:
    """With --workers 2 every request may land in either process: one runs it, both answer its record."""
    _old, new, state, plan = _plan(cluster, "multi", new_hosts=("h2", "h3"))
    root = tmp_path / "node"
    proc, url = _start_daemon(root, "127.0.0.8", "--workers", "2")
    try:
        body = TransformRequest(host="h2", plan=plan.for_host("h2"),
                                sources={h: cluster.servers[h].url for h in plan.sources_of("h2")}).to_json()
        seen = set()
        for _ in range(6):  # new connections: the kernel spreads them over the processes
            with StoreClient(url, timeout=10) as c:
                seen.add(TransformStatus.from_json(c.request_json("POST", transforms_path("multi"), body)).submitted_at)
        assert len(seen) == 1  # one transform, whichever process took the submissions
        with StoreClient(url, timeout=10) as c:
            assert _wait(c, "multi", NEW_V).state == "committed"
        for _ in range(6):
            with StoreClient(url, timeout=10) as c:
                assert c.request_json("GET", transforms_path("multi", NEW_V))["state"] == "committed"
        with StoreClient(url) as c:
            for t, s in new.shards_on_host("h2"):
                got = c.read("multi", NEW_V, t.name, s.region, t.dtype)
                assert got.tobytes() == state[t.name][s.region.slices()].tobytes()
    finally:
        _stop(proc)


def test_a_status_read_can_wait_for_the_end_of_its_transform(cluster, hung_source: str, tmp_path: Path) -> None:
    """?wait=S answers as soon as the transform ends (a commit is learnt of at once), else after S seconds.
    The stuck transform's source timeout is an hour: it cannot end on its own while the test runs, so a read
    answering "running" answered at the end of its wait, and one answering "cancelled" before its wait ran out
    answered at the cancel."""
    _old, _new, _state, plan = _plan(cluster, "longpoll", new_hosts=("h2", "h3"))
    with NodeDaemon(tmp_path / "t", host="127.0.0.6", store=LocalStore(tmp_path / "t", durable=False),
                    transforms=TransformSettings(source_timeout_s=3600.0)) as daemon, StoreClient(daemon.url) as client:
        stuck = TransformRequest(host="h2", plan=plan.for_host("h2"), sources={h: hung_source for h in plan.sources_of("h2")})
        client.request_json("POST", transforms_path("longpoll"), stuck.to_json())
        start = time.monotonic()
        status = client.request_json("GET", transforms_path("longpoll", NEW_V, wait=0.5))
        assert status["state"] in ("queued", "running") and time.monotonic() - start >= 0.5  # not before its wait
        # cancelled from another thread while a read waits (as long as a read may): the read answers with the end
        timer = threading.Timer(0.3, lambda: StoreClient(daemon.url).request_json("DELETE", transforms_path("longpoll", NEW_V)))
        timer.start()
        start = time.monotonic()
        status = client.request_json("GET", transforms_path("longpoll", NEW_V, wait=30))
        assert status["state"] == "cancelled" and time.monotonic() - start < 30, "answered at the end of its wait"
        timer.join()
        with pytest.raises(InvalidInput, match="wait must be between 0 and 30"):
            client.request_json("GET", transforms_path("longpoll", NEW_V) + "?wait=31")
