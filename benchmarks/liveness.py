"""Liveness at 16,384 workers on 2,048 nodes: the scheduler's CPU for one batched report per node per second.

Target on the 2-core VM: at most 25% of one core for the liveness of 16,384
workers on 2,048 nodes (issue 27, item 4). Each node daemon relays its
workers' heartbeats as one ``POST /v1/jobs/{job}/nodes/{node}/heartbeats``
per interval (:mod:`tenplex.node.relay`), so the scheduler answers 2,048
requests a second carrying 16,384 heartbeats, instead of 16,384 requests.

Two processes besides this driver:

- ``--role scheduler``: the real scheduler (REST API on uvicorn, the job's controller and its loop, the record
  in a state directory) on a backend of 2,048 simulated nodes of 8 GPUs (:class:`SimulatedNodes`: it places
  and records workers, runs none, and says they all run). A job of 16,384 GPUs (a Megatron GPT layout, tp8 x
  pp4 x dp512) is created through the scheduler's own path, and its 16,384 workers register in-process
  (``JobController.register``, what the register route calls), so the job is Running before the window.
- ``--role nodes``: 2,048 simulated node daemons in one asyncio process, each on its own kept-alive HTTP
  connection, sending its 8 workers' heartbeats (step, loss, the age the relay measures) as one
  :class:`~tenplex.core.protocol.NodeHeartbeats` every second, spread evenly over the second, and checking
  that every worker is answered with a reply. With ``--direct`` each of a node's workers instead sends its
  own ``HeartbeatRequest`` to the per-worker route: the baseline, one request per heartbeat.

The driver measures the scheduler process's CPU time (``/proc/PID/stat``) over windows of the same length:
idle (the controller's loop alone), the node batches, and the per-worker baseline at the same request rate
(2,048 heartbeats/s; 16,384 of them a second do not fit this machine), and reports CPU per heartbeat and
the share of one core at 16,384 workers. After the batch window every worker's last heartbeat must be
recent and the job still Running (no false failure).

Run: .venv/bin/python benchmarks/liveness.py [--nodes 2048] [--gpus-per-node 8] [--window 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tenplex.testing.processes import stop_processes

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-token"
JOB = "live"
MODEL = {"num_layers": 4, "hidden": 64, "heads": 8, "vocab": 512, "seq_len": 0, "normalization": "RMSNorm",
         "bias": False, "make_vocab_size_divisible_by": 8}


# -- the scheduler ----------------------------------------------------------------------------------


def running_job(nodes: int, gpus_per_node: int, url: str, state_dir: Path) -> tuple[Any, dict[str, list[str]]]:
    """A scheduler on ``nodes`` simulated nodes with a Running job on all their GPUs, every worker registered;
    and the job's worker ids by node."""
    from tenplex.core.protocol import RegisterRequest
    from tenplex.scheduler.backend import Backend, HostInfo, WorkerLaunch
    from tenplex.scheduler.context import SchedulerSettings
    from tenplex.scheduler.jobspec import JobCreate
    from tenplex.scheduler.service import Scheduler
    from tenplex.scheduler.state import Phase, StateDir

    class SimulatedNodes(Backend):
        """``nodes`` hosts of ``gpus`` GPUs, all ready; workers are recorded, none runs, none exits."""

        name = "simulated-nodes"

        def __init__(self, nodes: int, gpus: int) -> None:
            # No daemon listens anywhere (port 9, discard): nothing in a running job's liveness talks to one.
            self._hosts = [HostInfo(name=f"node-{i}", gpus=gpus, store_url="http://127.0.0.1:9", address="127.0.0.1")
                           for i in range(nodes)]
            self._by_name = {h.name: h for h in self._hosts}

        def hosts(self) -> list[HostInfo]:
            return self._hosts

        def host(self, name: str) -> HostInfo:
            return self._by_name[name]

        def launch(self, job: str, command: Sequence[str], workers: Sequence[WorkerLaunch],
                   log_dir: Path) -> dict[str, int | None]:
            return {w.worker_id: None for w in workers}

        def stop(self, job: str, worker_ids: Sequence[str], *, grace: float = 10.0) -> None:
            pass

        def exited(self, job: str, worker_ids: Sequence[str]) -> dict[str, int | None]:
            return {}

        def adopt(self, job: str, pids: Mapping[str, int]) -> None:
            pass

        def master_port(self, host: HostInfo) -> int:
            return 29500

    gpus = nodes * gpus_per_node
    tp, pp = gpus_per_node, 4
    scheduler = Scheduler(SimulatedNodes(nodes, gpus_per_node), StateDir(state_dir),
                          SchedulerSettings(url=url, token=TOKEN, heartbeat_interval=1.0, start_timeout=3600.0))
    spec = JobCreate.model_validate({
        "name": JOB, "layout": {"provider": "megatron-gpt", "model": MODEL, "precision": "fp32"},
        "dataset": {"num_samples": 1 << 30, "global_batch_size": gpus}, "command": ["simulated"],
        "gpus": gpus, "policy": {"table": {str(gpus): {"dp": gpus // (tp * pp), "tp": tp, "pp": pp, "zero": 0}}},
        "steps": 1 << 30, "snapshot_every": 1 << 30, "heartbeat_timeout": 600,
    }).to_job_spec()
    ctl = scheduler.create(spec)
    while True:
        with ctl.lock:
            workers = list(ctl.status.workers)
            if ctl.status.phase == Phase.FAILED:
                raise SystemExit(f"the job failed: {ctl.status.message}")
        if len(workers) == gpus:
            break
        time.sleep(0.2)
    for w in workers:
        ctl.register(RegisterRequest(worker_id=w.worker_id, host=w.host, pid=1 + w.rank, rank=w.rank))
    while ctl.status.phase != Phase.RUNNING:
        time.sleep(0.2)
    by_host: dict[str, list[str]] = {}
    for w in workers:
        by_host.setdefault(w.host, []).append(w.worker_id)
    return scheduler, by_host


def role_scheduler(args: argparse.Namespace) -> None:
    from tenplex.scheduler.api import create_app
    from tenplex.serving import bind_socket, serve_forever, url_for, write_port_file

    logging.basicConfig(filename=args.log, level=logging.INFO, format="%(created).3f %(name)s [%(threadName)s] %(message)s")
    sock = bind_socket("127.0.0.1", 0)
    url = url_for("127.0.0.1", sock.getsockname()[1])
    t = time.perf_counter()
    scheduler, by_host = running_job(args.nodes, args.gpus_per_node, url, Path(args.state_dir))
    Path(args.workers_file).write_text(json.dumps(by_host))
    logging.getLogger(__name__).info("job of %d workers on %d nodes registered and Running after %.1f s",
                                     sum(map(len, by_host.values())), len(by_host), time.perf_counter() - t)
    write_port_file(args.port_file, sock.getsockname()[1])
    try:
        serve_forever(create_app(scheduler, token=TOKEN), sock, log_level="warning")
    finally:
        scheduler.close()


# -- the simulated node daemons -----------------------------------------------------------------------


async def _node(host: str, port: int, node: str, workers: list[str], offset: float, until: float, direct: bool,
                counts: dict[str, int]) -> None:
    """One node daemon's relay: a batch of its workers' heartbeats every second (or, ``direct``, one worker's
    own heartbeat per second, the workers taking turns: the same request rate as the batches)."""
    from tenplex.core import protocol as P

    reader, writer = await asyncio.open_connection(host, port)
    await asyncio.sleep(offset)
    step, turn = 0, 0
    start = time.monotonic()
    while time.monotonic() < until:
        step += 1
        if direct:
            worker = workers[turn % len(workers)]
            turn += 1
            path = P.HEARTBEAT_PATH.format(job=JOB, worker_id=worker)
            body = P.HeartbeatRequest(generation=0, step=step, loss=2.0).model_dump_json().encode()
            expect = 1
        else:
            path = P.NODE_HEARTBEATS_PATH.format(job=JOB, node=node)
            n = len(workers)
            body = P.NodeHeartbeats(workers=workers, generations=[0] * n, steps=[step] * n, ages=[0.25] * n,
                                    losses=[2.0] * n).model_dump_json(exclude_none=True).encode()
            expect = len(workers)
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        raw = await reader.readexactly(length)
        if not head.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"{node}: {head[:40]!r} {raw[:300]!r}")
        if not direct:
            answers = P.NodeHeartbeatsReply.model_validate_json(raw)
            if answers.errors or answers.reply is None:
                raise SystemExit(f"{node}: not every worker's heartbeat was answered with a reply: {raw[:300]!r}")
        counts["requests"] += 1
        counts["beats"] += expect
        await asyncio.sleep(max(0.0, start + step - time.monotonic()))
    writer.close()


def role_nodes(args: argparse.Namespace) -> None:
    with open(args.workers_file) as f:
        by_host: dict[str, list[str]] = json.load(f)
    counts = {"requests": 0, "beats": 0}
    nodes = sorted(by_host)

    async def main() -> None:
        until = time.monotonic() + args.seconds
        await asyncio.gather(*(_node("127.0.0.1", args.port, n, by_host[n], i / len(nodes), until, args.direct, counts)
                               for i, n in enumerate(nodes)))

    asyncio.run(main())
    Path(args.counts_file).write_text(json.dumps(counts))


# -- the driver -----------------------------------------------------------------------------------------


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_file(path: Path, proc: subprocess.Popen, what: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        time.sleep(0.2)
    raise SystemExit(f"{what} did not start within {timeout:.0f} s")


def get(url: str) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["driver", "scheduler", "nodes"], default="driver")
    parser.add_argument("--nodes", type=int, default=2048)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--window", type=float, default=20.0, help="seconds of each measured window")
    parser.add_argument("--out", type=Path, help="keep logs here (default: a temporary directory)")
    parser.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int), parser.add_argument("--seconds", type=float)
    parser.add_argument("--state-dir"), parser.add_argument("--log"), parser.add_argument("--port-file")
    parser.add_argument("--workers-file"), parser.add_argument("--counts-file")
    args = parser.parse_args()
    if args.role == "scheduler":
        return role_scheduler(args)
    if args.role == "nodes":
        return role_nodes(args)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    out = args.out or Path(tempfile.mkdtemp(prefix="tenplex-liveness-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: nproc={os.cpu_count()}, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"files in {out}")
    me = [sys.executable, str(Path(__file__).resolve())]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    children: list[subprocess.Popen] = []

    def spawn(*extra: str, log: str) -> subprocess.Popen:
        f = open(out / log, "ab")  # noqa: SIM115 - handed to the child
        p = subprocess.Popen([*me, *extra], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        f.close()
        children.append(p)
        return p

    workers = args.nodes * args.gpus_per_node
    try:
        t = time.perf_counter()
        sched = spawn("--role", "scheduler", "--nodes", str(args.nodes), "--gpus-per-node", str(args.gpus_per_node),
                      "--state-dir", str(out / "state"), "--log", str(out / "scheduler.log"),
                      "--port-file", str(out / "scheduler.port"), "--workers-file", str(out / "workers.json"),
                      log="scheduler.out")
        port = int(wait_file(out / "scheduler.port", sched, "the scheduler", 900))
        url = f"http://127.0.0.1:{port}"
        print(f"scheduler up with a Running job of {workers} workers on {args.nodes} nodes after "
              f"{time.perf_counter() - t:.1f} s")

        def window(direct: bool | None) -> tuple[float, float, dict[str, int]]:
            """(seconds, scheduler CPU seconds, counts) of one window: idle (None), batches, or direct beats."""
            counts = {"requests": 0, "beats": 0}
            nodes = None
            if direct is not None:
                counts_file = out / f"counts-{'direct' if direct else 'batches'}.json"
                nodes = spawn("--role", "nodes", "--port", str(port), "--seconds", str(args.window + 3),
                              "--workers-file", str(out / "workers.json"), "--counts-file", str(counts_file),
                              *(["--direct"] if direct else []), log="nodes.log")
                time.sleep(2.0)  # connected and spread over the second
            cpu0, t0 = proc_cpu(sched.pid), time.monotonic()
            time.sleep(args.window)
            cpu1, t1 = proc_cpu(sched.pid), time.monotonic()
            if nodes is not None:
                if nodes.wait(timeout=120) != 0:
                    raise SystemExit(f"the simulated nodes failed; see {out / 'nodes.log'}")
                counts = json.loads(counts_file.read_text())
            return t1 - t0, cpu1 - cpu0, counts

        idle_s, idle_cpu, _ = window(None)
        print(f"idle (the controller's loop over {workers} workers), {idle_s:.1f} s: scheduler CPU "
              f"{100 * idle_cpu / idle_s:.1f}% of one core")
        batch_s, batch_cpu, batch = window(False)
        status = get(f"{url}/v1/jobs/{JOB}")["status"]
        now = time.time()
        stale = [w["worker_id"] for w in status["workers"] if w["last_heartbeat"] is None or now - w["last_heartbeat"] > 10]
        if status["phase"] != "Running" or stale:
            raise SystemExit(f"after the batches: phase {status['phase']}, {len(stale)} workers without a recent "
                             f"heartbeat (e.g. {stale[:3]})")
        idle = idle_cpu / idle_s  # the share of a core the scheduler takes without any request

        def per_beat(cpu: float, seconds: float, counts: dict[str, int]) -> tuple[float, float]:
            """(heartbeats/s, CPU seconds per heartbeat beyond the idle loop) of a window."""
            rate = counts["beats"] / (args.window + 3)
            return rate, max(0.0, cpu / seconds - idle) / rate

        sent = batch["requests"] / (args.window + 3)
        beats, batch_beat = per_beat(batch_cpu, batch_s, batch)
        print(f"node batches (load {os.getloadavg()[0]:.1f}), {batch_s:.1f} s: {sent:.0f} requests/s carrying "
              f"{beats:.0f} heartbeats/s; scheduler CPU {100 * batch_cpu / batch_s:.1f}% of one core, idle loop "
              f"included ({1e6 * batch_beat:.1f} us per heartbeat beyond it, "
              f"{1e6 * batch_beat * beats / max(sent, 1):.0f} us per node report); every worker's heartbeat recent, "
              f"job Running")
        direct_s, direct_cpu, direct = window(True)
        direct_rate, direct_beat = per_beat(direct_cpu, direct_s, direct)
        print(f"baseline, each worker's own heartbeat (load {os.getloadavg()[0]:.1f}), {direct_s:.1f} s: "
              f"{direct_rate:.0f} heartbeats/s; scheduler CPU {100 * direct_cpu / direct_s:.1f}% of one core "
              f"({1e6 * direct_beat:.1f} us per heartbeat beyond the idle loop)")
        print(f"at {workers} workers on {args.nodes} nodes, one heartbeat each per second: node batches "
              f"{100 * (idle + batch_beat * workers):.1f}% of one core, idle loop included (target <= 25%); each "
              f"worker's own {100 * (idle + direct_beat * workers):.0f}% ({direct_beat / max(batch_beat, 1e-9):.1f}x "
              f"the CPU per heartbeat); idle loop {100 * idle:.1f}%")
    finally:
        stop_processes(reversed(children), signal.SIGTERM, grace=30)


if __name__ == "__main__":
    main()
