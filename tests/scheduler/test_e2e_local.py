"""The job state machine with real processes on the local backend.

Store daemons on 127.0.0.x, the reference GPT job as real worker processes
(gloo), the scheduler's REST API over HTTP. The model is tiny so that each
reconfiguration (stop, snapshot, plan, transfer, restart) takes seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest

from tenplex.core.auth import Authenticator, Principal
from tenplex.core.protocol import HEARTBEAT_PATH, NODE_HEARTBEATS_PATH, NODE_REPORTS_PATH
from tenplex.errors import TenplexError
from tenplex.scheduler.cli import SchedulerClient
from tenplex.scheduler.server import LocalScheduler
from tenplex.scheduler.state import JobStatus
from tenplex.sockets import free_port
from tenplex.testing.faults import kill_host, kill_worker

pytestmark = pytest.mark.slow

ADMIN_TOKEN = "e2e-admin"
MODEL = {"vocab": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "seq_len": 16}
SNAPSHOT_EVERY = 3
WORKER = [sys.executable, "-m", "examples.gpt.train", "--layers", "2", "--dim", "32", "--heads", "4", "--vocab", "64",
          "--seq-len", "16", "--samples", "4096", "--global-batch", "8"]


def job(name: str, gpus: int, steps: int) -> dict:
    return {
        "name": name,
        "layout": {"provider": "example-gpt", "model": MODEL},
        "dataset": {"num_samples": 4096, "seed": 0, "global_batch_size": 8},
        "command": WORKER,
        "gpus": gpus,
        "max_gpus": 4,
        "steps": steps,
        "snapshot_every": SNAPSHOT_EVERY,  # reaches the workers as TENPLEX_SNAPSHOT_EVERY
        "heartbeat_timeout": 120,
        "env": {"OMP_NUM_THREADS": "1"},
    }


def wait_for(client: SchedulerClient, name: str, pred, what: str, timeout: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout
    status: dict = {}
    while time.monotonic() < deadline:
        try:
            status = client.job(name)["status"]
        except TenplexError:  # the scheduler is restarting
            time.sleep(0.3)
            continue
        assert status["phase"] != "Failed", f"job failed while {what}: {status['message']}"
        if pred(status):
            return status
        time.sleep(0.2)
    raise AssertionError(f"timed out while {what}; last status: {json.dumps(status)[:2000]}")


def running(gen: int, step: int):
    return lambda s: s["phase"] in ("Running", "Succeeded") and s["generation"] >= gen and s["step"] >= step


def check_planned(rec: dict, *, from_gpus: int, to_gpus: int) -> None:
    assert rec["from_gpus"] == from_gpus and rec["to_gpus"] == to_gpus, rec
    assert rec["steps_lost"] == 0, rec
    assert rec["error"] is None, rec
    assert rec["downtime_seconds"] is not None and rec["downtime_seconds"] > 0, rec
    # Every byte a host lacks crosses the network exactly once: the plan meets the lower bound.
    assert rec["bytes_remote"] == rec["lower_bound_bytes"], rec


def test_scale_up_scale_down_and_worker_sigkill(tmp_path: Path) -> None:
    # With a token the local backend keeps jobs apart out of the box: its workers hold their job's own signed
    # credential (never the admin token) and the transforms read their sources with the scheduler's grant.
    with LocalScheduler(tmp_path, hosts=2, gpus_per_host=2, heartbeat_interval=0.3, token=ADMIN_TOKEN) as sched:
        client = SchedulerClient(sched.url, ADMIN_TOKEN)
        client.create(job("elastic", gpus=1, steps=36))
        st = wait_for(client, "elastic", running(0, 3), "training on 1 GPU")
        held = _environ(st["workers"][0]["pid"]).get("TENPLEX_TOKEN", "")
        assert held and held != ADMIN_TOKEN
        assert Authenticator.from_env(None, tmp_path / "auth-keys.json").authenticate(f"Bearer {held}") == Principal(
            "worker", "elastic", "elastic/workers")

        client.scale("elastic", 4)
        st = wait_for(client, "elastic", running(1, 10), "training on 4 GPUs")
        assert st["gpus"] == 4 and sorted(st["hosts"]) == ["host-0", "host-1"]

        client.scale("elastic", 2)
        st = wait_for(client, "elastic", running(2, 17), "training on 2 GPUs")
        assert st["gpus"] == 2

        victim = st["workers"][-1]
        kill_worker(victim)
        st = wait_for(client, "elastic", lambda s: s["phase"] == "Succeeded", "recovering and finishing")
        # Liveness went through the node daemons: one batch per node and interval, no worker's own heartbeat.
        beats = heartbeat_requests(sched)
        assert beats.get(NODE_HEARTBEATS_PATH, 0) > 0 and beats.get(HEARTBEAT_PATH, 0) == 0, beats
        # and so did the snapshot and exit reports (a node's reports in one batch)
        assert beats.get(NODE_REPORTS_PATH, 0) > 0, beats

    assert st["step"] == 36
    up, down, failure = st["history"]
    check_planned(up, from_gpus=1, to_gpus=4)
    check_planned(down, from_gpus=4, to_gpus=2)
    # Whichever is seen first: the killed worker's exit, or a survivor's collective failing on it.
    assert failure["reason"] == "failure", failure
    assert victim["worker_id"] in failure["error"] or "reported a peer failure" in failure["error"], failure
    assert failure["to_gpus"] == 2 and failure["downtime_seconds"] is not None
    # Recovery restarts from the newest snapshot the survivors hold completely. The kill may land while the
    # newest periodic snapshot is still being written, so up to two snapshot intervals can be lost.
    assert 0 <= failure["steps_lost"] <= 2 * SNAPSHOT_EVERY, failure
    assert failure["version_from"] is not None and failure["bytes_remote"] == failure["lower_bound_bytes"]


def heartbeat_requests(sched: LocalScheduler) -> dict[str, float]:
    """Requests the scheduler answered per heartbeat route (a worker's own, a node's batch) and of the nodes'
    batches of reports."""
    assert sched.scheduler is not None
    counts: dict[str, float] = {}
    for metric in sched.scheduler.metrics.requests.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count") and sample.labels["route"] in (HEARTBEAT_PATH, NODE_HEARTBEATS_PATH,
                                                                             NODE_REPORTS_PATH):
                counts[sample.labels["route"]] = counts.get(sample.labels["route"], 0) + sample.value
    return counts


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _start_scheduler(state: Path, port: int, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tenplex", "scheduler", "serve", "--state-dir", str(state), "--port", str(port),
             "--hosts", "2", "--gpus-per-host", "2"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    client = SchedulerClient(f"http://127.0.0.1:{port}", timeout=5)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"scheduler exited: {log.read_text()[-3000:]}"
        with suppress(TenplexError):
            client.request("GET", "/healthz")
            return proc
        time.sleep(0.2)
    raise AssertionError(f"scheduler did not start: {log.read_text()[-3000:]}")


def _kill_everything(state: Path) -> None:
    """The scheduler's children run in their own sessions (so they survive it): end them here."""
    pids = []
    cluster = state / "cluster.json"
    if cluster.exists():
        pids += [h["pid"] for h in json.loads(cluster.read_text()) if h.get("pid")]
    for f in (state / "jobs").glob("*.json"):
        pids += [w.pid for w in JobStatus.from_json(json.loads(f.read_text())["status"]).workers if w.pid]
    for pid in pids:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def test_scheduler_killed_during_reconfiguration_resumes(tmp_path: Path) -> None:
    state, port, log = tmp_path / "state", free_port(), tmp_path / "scheduler.log"
    proc = _start_scheduler(state, port, log)
    try:
        client = SchedulerClient(f"http://127.0.0.1:{port}", timeout=10)
        client.create(job("survivor", gpus=2, steps=24))
        wait_for(client, "survivor", running(0, 3), "training on 2 GPUs")
        client.scale("survivor", 4)
        st = wait_for(client, "survivor", lambda s: s["phase"] == "Reconfiguring", "starting the reconfiguration")
        killed_in = st["stage"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

        proc = _start_scheduler(state, port, log)
        st = wait_for(client, "survivor", lambda s: s["phase"] == "Succeeded", "finishing after the restart")
        assert st["step"] == 24 and st["gpus"] == 4
        [rec] = st["history"]
        assert rec["reason"] == "scale" and rec["to_gpus"] == 4 and rec["steps_lost"] == 0, (killed_in, rec)
        assert rec["bytes_remote"] == rec["lower_bound_bytes"]
        assert "resumed jobs: survivor" in log.read_text()
    finally:
        proc.kill()
        proc.wait(timeout=10)
        _kill_everything(state)


def test_a_lost_host_is_survived_from_the_remaining_replica(tmp_path: Path) -> None:
    """A host dies for real (its daemon and its workers SIGKILLed from outside, as a crash would): the
    health watch sees the daemon gone, and the job continues from the surviving replica."""
    with LocalScheduler(tmp_path, hosts=3, gpus_per_host=2, heartbeat_interval=0.3) as sched:
        client = SchedulerClient(sched.url)
        # 4 GPUs on 2 hosts: tp2 inside each host, dp2 across them, so each host holds a full replica.
        client.create(job("hostloss", gpus=4, steps=24))
        st = wait_for(client, "hostloss", lambda s: running(0, SNAPSHOT_EVERY + 1)(s) and s["version"] is not None,
                      "training on 4 GPUs with a committed snapshot")
        assert sorted(st["hosts"]) == ["host-0", "host-1"]
        kill_host(sched.cluster, "host-1", st["workers"])
        st = wait_for(client, "hostloss", lambda s: s["phase"] == "Succeeded", "recovering without host-1 and finishing")

    assert st["step"] == 24 and "host-1" not in st["hosts"]
    [failure] = st["history"]
    assert failure["reason"] == "failure" and "internal error" not in failure["error"], failure
    assert failure["from_gpus"] == 4 and failure["to_gpus"] == 4 and "host-1" not in failure["to_hosts"], failure
    assert 0 <= failure["steps_lost"] <= 2 * SNAPSHOT_EVERY, failure
    # host-0 held a whole replica: host-2's new ranks pulled what they need from it, once.
    assert failure["bytes_remote"] == failure["lower_bound_bytes"] > 0 and failure["bytes_local"] > 0, failure


def test_a_failure_before_the_first_snapshot_restarts_at_step_0_and_a_crash_loop_ends(tmp_path: Path) -> None:
    with LocalScheduler(tmp_path, hosts=1, gpus_per_host=1, heartbeat_interval=0.3) as sched:
        client = SchedulerClient(sched.url)
        early = {**job("early", gpus=1, steps=8), "snapshot_every": 100}  # no snapshot before the kill
        client.create(early)
        st = wait_for(client, "early", running(0, 2), "training, no snapshot yet")
        assert st["version"] is None
        victim = st["workers"][0]["worker_id"]
        kill_worker(st["workers"][0])
        st = wait_for(client, "early", lambda s: s["phase"] == "Succeeded", "restarting at step 0 and finishing")
        assert st["step"] == 8 and st["generation"] == 1
        [failure] = st["history"]
        assert failure["reason"] == "failure" and victim in failure["error"], failure
        assert failure["version_from"] is None and failure["steps_lost"] >= 2 and failure["to_gpus"] == 1, failure

        # A worker that can never start: each restart fails at once, and max_restarts ends the loop.
        crash = {**job("crash", gpus=1, steps=8), "command": [sys.executable, "-c", "import sys; sys.exit(3)"],
                 "max_restarts": 2}
        client.create(crash)
        deadline = time.monotonic() + 120
        while (st := client.job("crash")["status"])["phase"] != "Failed":
            assert time.monotonic() < deadline, f"the crash loop did not end: {st}"
            time.sleep(0.2)
    assert st["message"].startswith("giving up after 3 failures in a row without a newer snapshot (max_restarts 2)")
    assert "crash-g2-r0 exited with code 3" in st["message"] and st["generation"] == 2


def test_scale_to_zero_suspends_and_a_scale_up_resumes_from_the_kept_state(tmp_path: Path) -> None:
    with LocalScheduler(tmp_path, hosts=2, gpus_per_host=2, heartbeat_interval=0.3) as sched:
        client = SchedulerClient(sched.url)
        client.create(job("nap", gpus=2, steps=18))
        ids = [w["worker_id"] for w in wait_for(client, "nap", running(0, 3), "training on 2 GPUs")["workers"]]
        client.scale("nap", 0)
        st = wait_for(client, "nap", lambda s: s["phase"] == "Suspended", "suspending")
        assert st["gpus"] == 0 and st["workers"] == [] and st["hosts"] == [] and st["version"] is not None
        assert f"state {st['version']} kept on" in st["message"]
        kept, step = st["version"], st["step"]
        assert sorted(sched.scheduler.backend.exited("nap", ids)) == sorted(ids)  # no worker left
        time.sleep(1.0)  # suspended stays suspended
        assert client.job("nap")["status"]["phase"] == "Suspended"
        client.scale("nap", 0)  # again: nothing to do

        client.scale("nap", 4)
        st = wait_for(client, "nap", lambda s: s["phase"] == "Succeeded", "resuming on 4 GPUs and finishing")
    assert st["step"] == 18 and st["gpus"] == 4
    suspend, resume = st["history"]
    assert (suspend["reason"], suspend["from_gpus"], suspend["to_gpus"], suspend["steps_lost"]) == ("suspend", 2, 0, 0)
    assert suspend["version_from"] == kept and suspend["error"] is None
    assert (resume["reason"], resume["from_gpus"], resume["to_gpus"]) == ("resume", 0, 4)
    assert resume["version_from"] == kept and resume["steps_lost"] == 0 and resume["error"] is None
    assert resume["bytes_remote"] == resume["lower_bound_bytes"] > 0  # host-1's new ranks pulled their shards once
    assert int(kept.split("-")[0][1:]) == step  # the suspend snapshot is the step it stopped at


def test_a_job_on_hosts_with_a_memory_tier_snapshots_into_memory_and_scales_from_it(tmp_path: Path) -> None:
    """Every host's store has a memory tier (a directory on /dev/shm, a budget that holds every version the
    job keeps): the workers snapshot into it, the scale-up's transfers read the versions from there (none
    is ever evicted, so every read is a memory read), and the daemons spill them to disk meanwhile."""
    from tenplex.store.client import StoreClient

    with LocalScheduler(tmp_path, hosts=2, gpus_per_host=2, heartbeat_interval=0.3, memory_bytes=256 << 20) as sched:
        cluster = sched.cluster
        assert cluster.memory_root is not None and str(cluster.memory_root).startswith("/dev/shm/")
        client = SchedulerClient(sched.url)
        client.create(job("memtier", gpus=2, steps=18))
        wait_for(client, "memtier", lambda s: running(0, SNAPSHOT_EVERY + 1)(s) and s["version"] is not None,
                 "training on 2 GPUs with a committed snapshot")
        client.scale("memtier", 4)
        st = wait_for(client, "memtier", lambda s: s["phase"] == "Succeeded", "scaling to 4 GPUs and finishing")
        assert st["step"] == 18 and st["gpus"] == 4
        [up] = st["history"]
        check_planned(up, from_gpus=2, to_gpus=4)
        assert up["bytes_remote"] > 0  # the new host's ranks pulled their state from the old host's daemon
        memory_root = cluster.memory_root
        reservations = 0.0
        for host in cluster.hosts():
            with StoreClient(host.store_url) as store:
                versions = store.versions("memtier")
                assert versions and all(v.committed and v.in_memory for v in versions), (host.name, versions)
                deadline = time.monotonic() + 60
                while not all(v.durable for v in store.versions("memtier")):
                    assert time.monotonic() < deadline, f"{host.name}'s daemon did not spill its versions"
                    time.sleep(0.1)
                metrics = store.metrics()
                assert "tenplex_store_spilled_versions_total" in metrics
                reservations += sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                                    if line.startswith('tenplex_store_reservations_total{tier="memory"}'))
            assert (memory_root / host.name / "memtier").is_dir()
        logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs" / "memtier").rglob("*.log"))
        assert "snapshots into the node store's memory tier" in logs
        assert reservations > 0  # the workers (the store root mounted) had their snapshots placed by the daemons
    assert not memory_root.exists()  # the cluster removes the tmpfs directories it made
