"""The control plane at 1,024 workers: heartbeat cost, API latency and orchestration time of a reconfiguration.

Targets on the 2-core VM: heartbeat handling at 1,024 workers below 25% of one
core; p99 of GET /v1/jobs/{job} below 100 ms during a reconfiguration; the
orchestration of a 1,024 -> 768 GPU change (stop agreement, snapshot, plan,
sub-plans to the node daemons, launch) below 5 s beyond planning.

Three processes besides this driver, as on a cluster:

- ``--role daemons``: 128 real node daemons (``tenplex.node.daemon.NodeDaemon``, store and transforms) in one process,
  each with its own store directory, described in a hosts file;
- ``--role agent``: the simulated workers (``tenplex.testing.simworkers``): every rank an asyncio task that speaks
  the worker protocol over HTTP (register, PTC fetch, the stop step, its snapshot written into its host's store,
  snapshot and exit reports; heartbeats as the node daemons relay them, one batch per host and second), ranks
  of a generation in lockstep, no torch;
- ``--role scheduler``: ``tenplex scheduler serve``'s scheduler (REST API, job controller, planner) on the
  simulated backend (``tenplex.testing.simworkers:simulated_scheduler``: the local backend's hosts, workers
  launched in the agent), with a per-thread CPU sampler that attributes its CPU time to threads and functions.

The job is a real Megatron GPT layout (4 layers, hidden 64, 8 heads, vocab 512, RMSNorm, fp32, ZeRO-1: 81
tensors) on tp8 x pp4 x dp32 = 1,024 GPUs of 128 hosts, scaled to dp24 = 768 GPUs on 96 hosts: its PTC has
the devices and shards of a job of that size (about 10,600 shards written per snapshot, 11,000 transfers in
the plan), its tensors are tiny (bytes do not matter here). The daemons really run the transforms.

Run: .venv/bin/python benchmarks/control_plane.py [--hosts 128] [--scale-to 768] [--window 20] [--out DIR]
     [--model gpt3-175b-shape]  (GPT-3 175B's layout, 4,628 tensors and 20,812 shards, tiny tensors; pp16 -> pp12)
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tenplex.testing.processes import stop_processes

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-token"
JOB = "cp"
BACKEND = "tenplex.testing.simworkers:simulated_scheduler"
MODEL = {"num_layers": 4, "hidden": 64, "heads": 8, "vocab": 512, "seq_len": 0, "normalization": "RMSNorm",
         "bias": False, "make_vocab_size_divisible_by": 8}
MODEL_175B_SHAPE = {"num_layers": 96, "hidden": 64, "heads": 8, "vocab": 512, "seq_len": 2048,
                    "make_vocab_size_divisible_by": 8}
"""GPT-3 175B's layout (96 layers, LayerNorm, biases, learned positions: 4,628 tensors, 20,812 shards on
tp8 x pp16 x dp8) with tiny tensors: ``--model gpt3-175b-shape``."""


# -- roles ----------------------------------------------------------------------------------------


def role_daemons(args: argparse.Namespace) -> None:
    from tenplex.node.daemon import NodeDaemon

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    daemons = []
    hosts = []
    try:
        for i in range(args.hosts):
            root = Path(args.root) / f"host-{i}" / "store"
            root.mkdir(parents=True, exist_ok=True)
            d = NodeDaemon(root, token=TOKEN).start()
            daemons.append(d)
            hosts.append({"name": f"host-{i}", "address": "127.0.0.1", "store_url": d.url, "gpus": args.gpus_per_host,
                          "store_root": str(root)})
        tmp = Path(args.hosts_file).with_suffix(".tmp")
        tmp.write_text(json.dumps(hosts))
        os.replace(tmp, args.hosts_file)
        stop.wait()
    finally:
        for d in daemons:
            with contextlib.suppress(Exception):
                d.stop(timeout=5)


def role_agent(args: argparse.Namespace) -> None:
    from tenplex.serving import write_port_file
    from tenplex.testing.simworkers import run_agent

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = run_agent(step_seconds=args.step_seconds)
    write_port_file(args.port_file, server.port)
    stop.wait()
    server.stop(timeout=5)


def _thread_cpu_clock(tid: int) -> int:
    """The CPU clock of kernel thread ``tid`` (Linux's MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)).

    Not ``time.pthread_getcpuclockid``: given the handle of a thread that has
    just exited, it reads the freed thread descriptor and can crash the process
    (it did: a segfault in libc while the transfer's thread pool wound down);
    a dead TID here only makes ``clock_gettime`` fail with EINVAL.
    """
    return (~tid << 3) | 6


class CpuSampler:
    """Per-thread CPU time, attributed to (thread group, function) by sampling the stacks of threads that ran.

    Every ``interval`` seconds it reads each thread's CPU clock; the CPU a
    thread used since the last sample goes to the function it is in now (the
    innermost frame of Tenplex's own code, else the innermost frame). Totals
    are written to ``path`` every second, so a reader can difference windows.
    """

    def __init__(self, path: Path, interval: float = 0.005) -> None:
        self.path = path
        self.interval = interval
        self.totals: Counter[str] = Counter()
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def start(self) -> CpuSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._dump()

    @staticmethod
    def _group(name: str) -> str:
        name = re.sub(r"[_-]?\d+$", "", name)
        return re.sub(r"\s*\(.*\)$", "", name)

    @staticmethod
    def _where(frame: Any) -> str:
        innermost = None
        f = frame
        while f is not None:
            code = f.f_code
            if innermost is None:
                innermost = f"{Path(code.co_filename).name}:{code.co_name}"
            if "/tenplex/" in code.co_filename and "/testing/" not in code.co_filename:
                return f"{code.co_filename.split('/tenplex/', 1)[1]}:{code.co_name}"
            f = f.f_back
        return innermost or "?"

    def _run(self) -> None:
        me = threading.get_ident()
        last_dump = time.monotonic()
        while not self._stop.wait(self.interval):
            frames = sys._current_frames()
            for t in threading.enumerate():
                if t.ident is None or t.ident == me or t.native_id is None:
                    continue
                try:
                    cpu = time.clock_gettime(_thread_cpu_clock(t.native_id))
                except OSError:  # the thread ended since enumerate()
                    continue
                used = cpu - self._last.get(t.ident, cpu)
                self._last[t.ident] = cpu
                if used > 0 and t.ident in frames:
                    self.totals[f"{self._group(t.name)} | {self._where(frames[t.ident])}"] += used
            if time.monotonic() - last_dump > 1.0:
                self._dump()
                last_dump = time.monotonic()

    def _dump(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(self.totals)))
        os.replace(tmp, self.path)


def role_scheduler(args: argparse.Namespace) -> None:
    from tenplex.scheduler.api import create_app
    from tenplex.scheduler.server import build_scheduler
    from tenplex.serving import bind_socket, serve_forever, url_for, write_port_file

    logging.basicConfig(filename=args.log, level=logging.INFO, format="%(created).3f %(name)s [%(threadName)s] %(message)s")
    sampler = CpuSampler(Path(args.profile)).start()
    sock = bind_socket("127.0.0.1", 0)
    url = url_for("127.0.0.1", sock.getsockname()[1])
    # The 128 daemons share one process and two cores with everything else: while 96 of them run their transforms
    # one may not answer its health probe for seconds (a real node's daemon has its own machine), so the health
    # watch waits longer than its 10 s default before it calls a host lost.
    scheduler = build_scheduler(BACKEND, Path(args.state_dir), url, TOKEN, hosts_file=Path(args.hosts_file),
                                heartbeat_interval=args.heartbeat_interval, host_timeout=120.0)
    scheduler.recover()
    write_port_file(args.port_file, sock.getsockname()[1])
    try:
        serve_forever(create_app(scheduler, token=TOKEN), sock, log_level="warning")
    finally:
        sampler.stop()
        scheduler.close()


# -- the driver -----------------------------------------------------------------------------------------


def request(url: str, method: str = "GET", body: Any = None, timeout: float = 60.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Authorization": f"Bearer {TOKEN}"})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_status(url: str, job: str, pred: Callable[[dict[str, Any]], bool], what: str,
                timeout: float) -> dict[str, Any]:
    """The job's status once ``pred`` holds (polled every 0.5 s); exits the benchmark if the job fails or
    ``timeout`` passes (a scheduler that does not answer for a moment is asked again)."""
    deadline = time.monotonic() + timeout
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            st = request(f"{url}/v1/jobs/{job}", timeout=60)["status"]
        except OSError:
            time.sleep(1.0)
            continue
        if st["phase"] == "Failed":
            raise SystemExit(f"the job failed: {st['message']}")
        if pred(st):
            return st
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}: {st.get('phase')} {st.get('stage')} {st.get('message')}")


def training(gen_at_least: int) -> Callable[[dict[str, Any]], bool]:
    """A status predicate: generation >= ``gen_at_least`` running, every worker registered, past its restored step."""
    return lambda s: bool(s["phase"] == "Running" and s["generation"] >= gen_at_least and s["workers"]
                          and s["downtime_started_at"] is None and s["step"] > (s["restored_step"] or 0)
                          and all(w["registered"] for w in s["workers"]))


def wait_file(path: Path, proc: subprocess.Popen, what: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start within {timeout:.0f} s")
        time.sleep(0.1)
    return path.read_text().strip()


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_json(path: Path) -> dict[str, float]:
    for _ in range(20):
        with contextlib.suppress(ValueError, OSError):
            return json.loads(path.read_text())
        time.sleep(0.05)
    return {}


def top(diff: dict[str, float], n: int, seconds: float) -> list[str]:
    groups: dict[str, float] = defaultdict(float)
    for k, v in diff.items():
        groups[k.split(" | ")[0]] += v
    lines = ["    by thread: " + ", ".join(f"{g} {v / seconds * 100:.1f}%" for g, v in
                                         sorted(groups.items(), key=lambda kv: -kv[1]) if v / seconds > 0.002)]
    for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:n]:
        lines.append(f"    {v / seconds * 100:5.1f}%  {k}")
    return lines


def diff(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a.get(k, 0.0) for k in b if b[k] - a.get(k, 0.0) > 0}


class Probe(threading.Thread):
    """GET /v1/jobs/{job} back to back (with ``pause`` between), recording latency and what it saw."""

    def __init__(self, url: str, pause: float = 0.02) -> None:
        super().__init__(name="probe", daemon=True)
        self.url, self.pause = url, pause
        self.samples: list[tuple[float, float, dict[str, Any]]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            start = time.time()
            t0 = time.perf_counter()
            try:
                view = request(f"{self.url}/v1/jobs/{JOB}", timeout=30)
            except OSError as exc:
                view = {"error": str(exc)}
            self.samples.append((start, time.perf_counter() - t0, view))
            self.halt.wait(self.pause)

    def latest(self) -> dict[str, Any]:
        return self.samples[-1][2] if self.samples else {}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def print_latencies(probe: Probe, t_req: float, t_done: float, target: str = "") -> list[float]:
    """``GET /v1/jobs/{job}``'s latencies between ``t_req`` and ``t_done``: overall and per phase/stage; the
    window's latencies."""
    window = [lat for ts, lat, _ in probe.samples if t_req <= ts <= t_done]
    print(f"  GET /v1/jobs/{JOB} during it: n={len(window)}, p50 {1e3 * pct(window, 0.5):.1f} ms, "
          f"p99 {1e3 * pct(window, 0.99):.1f} ms, max {1e3 * max(window):.1f} ms{target}")
    by_stage: dict[str, list[float]] = defaultdict(list)
    for ts, lat, view in probe.samples:
        if t_req <= ts <= t_done and "status" in view:
            s = view["status"]
            by_stage[f"{s['phase']}/{s['stage']}" if s["stage"] else s["phase"]].append(lat)
    for k, v in by_stage.items():
        print(f"    {k:<28} n={len(v):4d}  p99 {1e3 * pct(v, 0.99):6.1f} ms  max {1e3 * max(v):6.1f} ms")
    return window


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["driver", "daemons", "agent", "scheduler"], default="driver")
    parser.add_argument("--hosts", type=int, default=128)
    parser.add_argument("--gpus-per-host", type=int, default=8)
    parser.add_argument("--scale-to", type=int, default=768)
    parser.add_argument("--window", type=float, default=20.0, help="seconds of steady training to measure heartbeats")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0,
                        help="the scheduler's heartbeat interval (tenplex scheduler serve's default: 1 s)")
    parser.add_argument("--step-seconds", type=float, default=0.2, help="simulated training step time")
    parser.add_argument("--model", choices=["toy", "gpt3-175b-shape"], default="toy",
                        help="toy: 4 layers on tp8 x pp4, ZeRO-1, dp scaled down; gpt3-175b-shape: GPT-3 175B's "
                             "layout with tiny tensors on tp8 x pp16 x dp8, ZeRO-0, scaled down in pp (dp8 kept)")
    parser.add_argument("--out", type=Path, help="keep logs and profiles here (default: a temporary directory)")
    parser.add_argument("--root"), parser.add_argument("--hosts-file"), parser.add_argument("--port-file")
    parser.add_argument("--state-dir"), parser.add_argument("--log"), parser.add_argument("--profile")
    args = parser.parse_args()
    if args.role == "daemons":
        return role_daemons(args)
    if args.role == "agent":
        return role_agent(args)
    if args.role == "scheduler":
        return role_scheduler(args)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the children are stopped (finally) on a timeout
    gpus = args.hosts * args.gpus_per_host
    tp = args.gpus_per_host
    if args.model == "toy":
        model, zero, pp = MODEL, 1, 4
        dp, dp_to, pp_to = gpus // (tp * pp), args.scale_to // (tp * pp), pp
    else:
        model, zero, dp = MODEL_175B_SHAPE, 0, 8
        pp, pp_to, dp_to = gpus // (tp * dp), args.scale_to // (tp * dp), dp
    out = args.out or Path(tempfile.mkdtemp(prefix="tenplex-control-plane-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: nproc={os.cpu_count()}, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"files in {out}")
    me = [sys.executable, str(Path(__file__).resolve())]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    children: list[subprocess.Popen] = []

    def spawn(*extra: str, log: str, env_extra: dict[str, str] | None = None) -> subprocess.Popen:
        f = open(out / log, "ab")  # noqa: SIM115 - handed to the child
        p = subprocess.Popen([*me, *extra], stdout=f, stderr=subprocess.STDOUT, env={**env, **(env_extra or {})},
                             cwd=REPO)
        f.close()
        children.append(p)
        return p

    try:
        t = time.perf_counter()
        daemons = spawn("--role", "daemons", "--hosts", str(args.hosts), "--gpus-per-host", str(args.gpus_per_host),
                        "--root", str(out / "hosts"), "--hosts-file", str(out / "hosts.json"), log="daemons.log")
        wait_file(out / "hosts.json", daemons, "the daemons", 300)
        print(f"{args.hosts} node daemons up in {time.perf_counter() - t:.1f} s")
        agent = spawn("--role", "agent", "--port-file", str(out / "agent.port"), "--step-seconds",
                      str(args.step_seconds), log="agent.log")
        agent_url = f"http://127.0.0.1:{wait_file(out / 'agent.port', agent, 'the agent', 120)}"
        sched = spawn("--role", "scheduler", "--state-dir", str(out / "state"), "--hosts-file", str(out / "hosts.json"),
                      "--port-file", str(out / "scheduler.port"), "--log", str(out / "scheduler.log"),
                      "--profile", str(out / "scheduler-cpu.json"), "--heartbeat-interval",
                      str(args.heartbeat_interval), log="scheduler.out", env_extra={"TENPLEX_SIM_AGENT": agent_url})
        url = f"http://127.0.0.1:{wait_file(out / 'scheduler.port', sched, 'the scheduler', 120)}"

        spec = {
            "name": JOB, "layout": {"provider": "megatron-gpt", "model": model, "precision": "fp32"},
            "dataset": {"num_samples": 1 << 30, "global_batch_size": 96 * 16},
            "command": ["simulated"], "gpus": gpus, "min_gpus": tp * pp, "max_gpus": gpus,
            "policy": {"table": {str(gpus): {"dp": dp, "tp": tp, "pp": pp, "zero": zero},
                                 str(args.scale_to): {"dp": dp_to, "tp": tp, "pp": pp_to, "zero": zero}}},
            # Registration is slow at this scale (each one rewrites the job record, see RESULTS.md): a rank that
            # registered first waits for the others' records before its heartbeat is handled.
            "steps": 1 << 30, "snapshot_every": 1 << 30, "heartbeat_timeout": 600,
        }
        t = time.perf_counter()
        request(f"{url}/v1/jobs", "POST", spec)

        def wait(pred: Any, what: str, timeout: float = 600.0) -> dict[str, Any]:
            return wait_status(url, JOB, pred, what, timeout)

        wait(lambda s: s["phase"] == "Running" and s["workers"] and all(w["registered"] for w in s["workers"])
             and s["step"] >= 3, f"{gpus} workers registered and training")
        print(f"job on {gpus} GPUs ({dp}x{tp}x{pp}) registered and training after {time.perf_counter() - t:.1f} s")

        # -- heartbeats in steady training ---------------------------------------------------
        counts0 = request(f"{agent_url}/counts")
        prof0, cpu0, t0 = read_json(out / "scheduler-cpu.json"), proc_cpu(sched.pid), time.monotonic()
        time.sleep(args.window)
        counts1 = request(f"{agent_url}/counts")
        prof1, cpu1, t1 = read_json(out / "scheduler-cpu.json"), proc_cpu(sched.pid), time.monotonic()
        seconds = t1 - t0
        beats = counts1["heartbeat"] - counts0["heartbeat"]
        reports = counts1["node_report"] - counts0["node_report"]
        print(f"steady training, {seconds:.1f} s (load {os.getloadavg()[0]:.1f}): {beats / seconds:.0f} heartbeats/s "
              f"in {reports / seconds:.0f} node reports/s; "
              f"scheduler process CPU {100 * (cpu1 - cpu0) / seconds:.1f}% of one core "
              f"({1e6 * (cpu1 - cpu0) / max(beats, 1):.0f} us per heartbeat, everything included)")
        for line in top(diff(prof0, prof1), 14, seconds):
            print(line)

        # -- the reconfiguration ---------------------------------------------------------------------
        probe = Probe(url)
        probe.start()
        time.sleep(1.0)
        prof2, cpu2 = read_json(out / "scheduler-cpu.json"), proc_cpu(sched.pid)
        counts2 = request(f"{agent_url}/counts")
        t_req = time.time()
        request(f"{url}/v1/jobs/{JOB}/scale", "POST", {"gpus": args.scale_to})
        st = wait(lambda s: s["generation"] >= 1 and s["phase"] == "Running" and s["history"]
                  and s["history"][-1]["finished_at"] is not None, f"training on {args.scale_to} GPUs", 900)
        t_done = time.time()
        time.sleep(0.5)
        probe.halt.set()
        probe.join()
        prof3, cpu3 = read_json(out / "scheduler-cpu.json"), proc_cpu(sched.pid)
        counts3 = request(f"{agent_url}/counts")
        rec = st["history"][-1]
        print(f"reconfiguration {rec['from_config']} -> {rec['to_config']} ({rec['from_gpus']} -> {rec['to_gpus']} GPUs), "
              f"load {os.getloadavg()[0]:.1f}:")
        timeline = request(f"{agent_url}/timeline")
        hosts_json = json.loads((out / "hosts.json").read_text())
        records = []
        for h in hosts_json:
            with contextlib.suppress(OSError):
                records.append(request(f"{h['store_url']}/v1/jobs/{JOB}/transforms/{rec['version_to']}"))
        # One time line: the scheduler's milestones (the job record's marks), the simulated workers' (the
        # agent's: the last rank of each generation) and the daemons' transforms (their records).
        events = [(t_req, "scale requested (driver)")]
        events += [(t, f"{name} (scheduler)") for name, t in rec["marks"].items()]
        for gen, marks_of in sorted(timeline.items()):
            events += [(t, f"{name} ({gen.split('/')[-1]} workers)") for name, t in marks_of.items() if t >= t_req - 1]
        busy = (0.0, 0.0)
        if records:
            started = [r["started_at"] for r in records if r.get("started_at")]
            finished = [r["finished_at"] for r in records if r.get("finished_at")]
            busy = (min(started), max(finished))
            events += [(min(r["submitted_at"] for r in records), f"first sub-plan submitted (of {len(records)})"),
                       (max(r["submitted_at"] for r in records), "last sub-plan submitted"),
                       (busy[0], "first transform started"), (busy[1], "last transform committed")]
            print(f"  transforms on {len(records)} daemons: each {statistics.median(r['finished_at'] - r['started_at'] for r in records):.2f} s median")
        events.append((t_done, "training again (first step of the new generation seen by the driver)"))
        events.sort()
        for (ta, what), (tb, _) in zip(events, events[1:] + [(t_done, "")], strict=True):
            print(f"    {ta - t_req:+8.2f} s  {what:<58} {tb - ta:6.2f} s to the next")
        print("  phases (job record): " + ", ".join(f"{k} {v:.2f} s" for k, v in rec["phases"].items()))
        marks = rec["marks"]
        planning = marks.get("planned", t_req) - marks.get("committed", t_req)
        g0 = timeline.get(f"{JOB}/g0", {})
        writes = g0.get("snapshot_written", t_req) - g0.get("stop_step", t_req)
        moving = busy[1] - busy[0]
        total = t_done - t_req
        beyond = total - planning - writes - moving
        print(f"  from the request to training again {total:.2f} s = planning {planning:.2f} s + the workers writing "
              f"their snapshot {writes:.2f} s + the daemons moving the state {moving:.2f} s + orchestration "
              f"{beyond:.2f} s (target < 5 s beyond planning and moving data)")
        print(f"  state: {rec['bytes_remote']} B over the network (lower bound {rec['lower_bound_bytes']} B), "
              f"{rec['bytes_local']} B local; workers: "
              + ", ".join(f"{k} {counts3[k] - counts2[k]}" for k in ("register", "ptc", "snapshot", "exit", "heartbeat"))
              + f", {counts3['shards_written'] - counts2['shards_written']} shards written")
        print_latencies(probe, t_req, t_done)
        span = t_done - t_req
        print(f"  scheduler process CPU during it: {cpu3 - cpu2:.1f} s in {span:.1f} s")
        record = (out / "state" / "jobs" / f"{JOB}.json").read_bytes()
        print(f"  job record after it: {len(record) / 1024:.1f} KiB of JSON ({len(gzip.compress(record, 6)) / 1024:.1f} "
              f"KiB gzipped, as the Kubernetes job store keeps it); the plan is not in it")
        for line in top(diff(prof2, prof3), 16, span):
            print(line)
    finally:
        stop_processes(reversed(children), signal.SIGTERM, grace=30)


if __name__ == "__main__":
    main()
