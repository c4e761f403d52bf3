"""The control plane at 16,384 GPUs: a 405B job on 2,048 simulated nodes through a scale-down and a host loss.

Targets (issue 27, item 5b): orchestration overhead beyond planning and data <= 10 s for each change; p99 of
GET /v1/jobs/{job} < 100 ms during it; the scheduler's RSS recorded.

Two processes besides this driver:

- ``--role cluster``: 2,048 simulated node agents (:mod:`tenplex.testing.simnodes`: each on its own loopback port,
  described in a hosts file, answering every daemon request the scheduler makes; each sub-plan is decoded for
  real and reported committed without moving a byte) and the simulated workers (:mod:`tenplex.testing.simworkers`:
  every rank an asyncio task speaking the worker protocol over HTTP, heartbeats relayed one batch per node and
  second, snapshots committed into their node agent), in one asyncio process;
- ``--role scheduler`` of ``benchmarks/control_plane.py``: the real scheduler (REST API, controller, planner) on the
  simulated backend, with its per-thread CPU sampler.

The job: Llama-3.1-405B's shape as a Megatron GPT with its real dimensions (``tenplex.testing.scale.GPT_405B``:
3,036 tensors, bf16, on tp8 x pp16 x dp128 = 16,384 GPUs on 2,048 hosts of 8; ZeRO-0 by default, so that every
shard has dp replicas for the recovery to take from; ``--zero 1`` is the 149,708-shard layout of plan_scale). Nothing
moves bytes, so the sizes cost nothing but are those the planner and the records see. Then:

1. scale-down dp128 -> dp120 (15,360 GPUs): the workers stop at the agreed step and commit their snapshot, the
   scheduler plans, sends 1,920 sub-plans, launches 15,360 new workers, which register, fetch the PTC and train;
2. a host of the dp120 generation is lost (its agent stops answering, its 8 ranks end as SIGKILLed): the
   scheduler stops the rest, recovers from the newest version the survivors hold (their dp replicas), plans
   dp120 on the 2,047 hosts left and restarts.

How the overhead is computed, per change, from the job record's milestones and the driver's clock:
``total`` = from the request (the scale POST; the kill) to the scheduler seeing the first step of the new
generation (the change's ``finished_at``); ``planning`` = the scheduler's planning stage (``committed`` -> ``planned`` for the scale-down,
``requested`` -> ``planned`` for the failure: the stores' versions, policy and placement, the new PTC, the plan;
the planner's own CPU inside it is reported from the profile); ``data`` = the workers writing their stop
snapshot (the agent's ``stop_step`` -> ``snapshot_written``) + the daemons moving state, which is 0 here (the
agents move nothing: the sending of sub-plans counts as orchestration); ``orchestration`` = total - planning - data.

Run: .venv/bin/python benchmarks/control_plane_16k.py [--hosts 2048] [--dp 128] [--dp-to 120] [--out DIR]
     (small: --hosts 32 --dp 16 --dp-to 12 --pp 2 runs the same scenario on 256 GPUs)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from control_plane import (
    JOB,
    TOKEN,
    Probe,
    diff,
    pct,
    print_latencies,
    proc_cpu,
    read_json,
    request,
    top,
    training,
    wait_file,
    wait_status,
)

from tenplex.testing.processes import stop_processes

REPO = Path(__file__).resolve().parents[1]


def role_cluster(args: argparse.Namespace) -> None:
    from tenplex.serving import write_port_file
    from tenplex.testing.simnodes import SimNodes
    from tenplex.testing.simworkers import run_agent

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = run_agent(step_seconds=args.step_seconds, nodes=SimNodes(args.hosts, args.gpus_per_host, token=TOKEN, decoders=3))
    hosts = request(f"http://127.0.0.1:{server.port}/nodes/start", "POST", {})
    tmp = Path(args.hosts_file).with_suffix(".tmp")
    tmp.write_text(json.dumps(hosts))
    os.replace(tmp, args.hosts_file)
    write_port_file(args.port_file, server.port)
    stop.wait()
    server.stop(timeout=5)


class StageProbe(Probe):
    """:class:`control_plane.Probe` keeping only each answer's phase and stage (a 16,384-worker view is 3 MB)."""

    def run(self) -> None:
        while not self.halt.is_set():
            start = time.time()
            t0 = time.perf_counter()
            try:
                st = request(f"{self.url}/v1/jobs/{JOB}", timeout=30)["status"]
                view: dict[str, Any] = {"status": {"phase": st["phase"], "stage": st["stage"]}}
            except OSError as exc:
                view = {"error": str(exc)}
            self.samples.append((start, time.perf_counter() - t0, view))
            self.halt.wait(self.pause)


def rss(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MiB: now and the peak."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def planner_cpu(profile: dict[str, float]) -> float:
    """CPU seconds of the planner itself (``tenplex/transformer/plan.py``) in a profile difference."""
    return sum(v for k, v in profile.items() if "transformer/plan.py:" in k)


def steady_training(agent_url: str, profile: Path, pid: int, window: float, n_top: int, note: str = "") -> None:
    """Print the heartbeats and node reports per second the simulated workers sent in ``window`` seconds of steady
    training, the scheduler's CPU share in them, and its ``n_top`` busiest threads/functions (``profile``: the
    scheduler's CPU sampler's file)."""
    counts0 = request(f"{agent_url}/counts")
    prof0, cpu0, t0 = read_json(profile), proc_cpu(pid), time.monotonic()
    time.sleep(window)
    counts1 = request(f"{agent_url}/counts")
    prof1, cpu1, t1 = read_json(profile), proc_cpu(pid), time.monotonic()
    seconds = t1 - t0
    print(f"steady training, {seconds:.1f} s (load {os.getloadavg()[0]:.1f}): "
          f"{(counts1['heartbeat'] - counts0['heartbeat']) / seconds:.0f} heartbeats/s in "
          f"{(counts1['node_report'] - counts0['node_report']) / seconds:.0f} node reports/s; scheduler CPU "
          f"{100 * (cpu1 - cpu0) / seconds:.1f}% of one core{note}", flush=True)
    for line in top(diff(prof0, prof1), n_top, seconds):
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["driver", "cluster"], default="driver")
    parser.add_argument("--hosts", type=int, default=2048)
    parser.add_argument("--gpus-per-host", type=int, default=8)
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--dp", type=int, default=128)
    parser.add_argument("--dp-to", type=int, default=120)
    parser.add_argument("--model", choices=["405b", "toy"], default="405b",
                        help="405b: Llama-3.1-405B's shape, real dimensions; toy: 4 layers (a quick run of the machinery)")
    parser.add_argument("--zero", type=int, choices=[0, 1], default=0,
                        help="ZeRO stage: 0 (default) keeps every shard on all dp replicas, so the survivors of a host "
                             "loss hold the whole state; under ZeRO-1 the lost host's optimizer slices have no replica "
                             "and the recovery needs a persistent checkpoint, which the agents do not simulate")
    parser.add_argument("--window", type=float, default=10.0, help="seconds of steady training measured")
    parser.add_argument("--step-seconds", type=float, default=0.5, help="simulated training step time")
    parser.add_argument("--out", type=Path, help="keep logs and profiles here (default: a temporary directory)")
    parser.add_argument("--hosts-file"), parser.add_argument("--port-file")
    args = parser.parse_args()
    if args.role == "cluster":
        return role_cluster(args)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    tp, pp = args.gpus_per_host, args.pp
    gpus, gpus_to = args.dp * tp * pp, args.dp_to * tp * pp
    if gpus > args.hosts * tp:
        raise SystemExit(f"dp{args.dp} x tp{tp} x pp{pp} needs {gpus // tp} hosts, there are {args.hosts}")
    if args.model == "405b":
        from tenplex.testing.scale import GPT_405B
        model: dict[str, Any] = dict(vars(GPT_405B))
        precision = "bf16"
    else:
        model = {"num_layers": 4, "hidden": 64, "heads": 8, "vocab": 512, "seq_len": 0, "normalization": "RMSNorm",
                 "bias": False, "make_vocab_size_divisible_by": 8}
        precision = "fp32"
    out = args.out or Path(tempfile.mkdtemp(prefix="tenplex-control-plane-16k-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: nproc={os.cpu_count()}, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"files in {out}", flush=True)
    here = Path(__file__).resolve()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    children: list[subprocess.Popen] = []

    def spawn(argv: list[str], log: str, env_extra: dict[str, str] | None = None) -> subprocess.Popen:
        f = open(out / log, "ab")  # noqa: SIM115 - handed to the child
        p = subprocess.Popen([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT,
                             env={**env, **(env_extra or {})}, cwd=REPO)
        f.close()
        children.append(p)
        return p

    try:
        t = time.perf_counter()
        cluster = spawn([str(here), "--role", "cluster", "--hosts", str(args.hosts), "--gpus-per-host", str(tp),
                         "--hosts-file", str(out / "hosts.json"), "--port-file", str(out / "agent.port"),
                         "--step-seconds", str(args.step_seconds)], "cluster.log")
        agent_url = f"http://127.0.0.1:{wait_file(out / 'agent.port', cluster, 'the cluster', 300)}"
        print(f"{args.hosts} simulated node agents up in {time.perf_counter() - t:.1f} s", flush=True)
        sched = spawn([str(here.parent / "control_plane.py"), "--role", "scheduler", "--state-dir", str(out / "state"),
                       "--hosts-file", str(out / "hosts.json"), "--port-file", str(out / "scheduler.port"),
                       "--log", str(out / "scheduler.log"), "--profile", str(out / "scheduler-cpu.json"),
                       "--heartbeat-interval", "1.0"], "scheduler.out", {"TENPLEX_SIM_AGENT": agent_url})
        url = f"http://127.0.0.1:{wait_file(out / 'scheduler.port', sched, 'the scheduler', 300)}"
        print(f"scheduler up: RSS {rss(sched.pid)[0]:.0f} MiB", flush=True)

        batch = 3840
        spec = {
            "name": JOB, "layout": {"provider": "megatron-gpt", "model": model, "precision": precision},
            "dataset": {"num_samples": 1 << 30, "global_batch_size": batch}, "command": ["simulated"],
            "gpus": gpus, "min_gpus": tp * pp, "max_gpus": gpus,
            "policy": {"table": {str(gpus): {"dp": args.dp, "tp": tp, "pp": pp, "zero": args.zero},
                                 str(gpus_to): {"dp": args.dp_to, "tp": tp, "pp": pp, "zero": args.zero}}},
            "steps": 1 << 30, "snapshot_every": 1 << 30, "heartbeat_timeout": 600,
        }
        t = time.perf_counter()
        request(f"{url}/v1/jobs", "POST", spec, timeout=300)

        def wait(pred: Any, what: str, timeout: float = 1200.0) -> dict[str, Any]:
            return wait_status(url, JOB, pred, what, timeout)

        st = wait(lambda s: training(0)(s) and s["step"] >= 2, f"{gpus} workers registered and training")
        print(f"job on {gpus} GPUs (dp{args.dp} x tp{tp} x pp{pp}, ZeRO-{args.zero}) registered and training after "
              f"{time.perf_counter() - t:.1f} s; scheduler RSS {rss(sched.pid)[0]:.0f} MiB "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)

        steady_training(agent_url, out / "scheduler-cpu.json", sched.pid, args.window, 10,
                        f" (the health watch of {args.hosts} daemons included)")

        results = []

        def change(name: str, act: Any, done: Any, data_of: Any) -> dict[str, Any]:
            probe = StageProbe(url)
            probe.start()
            time.sleep(1.0)
            prof_a, cpu_a = read_json(out / "scheduler-cpu.json"), proc_cpu(sched.pid)
            counts_a = request(f"{agent_url}/counts")
            nodes_a = request(f"{agent_url}/nodes/counts")["counts"]
            t_req = time.time()
            act()
            st = wait(done, name)
            # the end: when the scheduler saw the new generation's first step (the record's, not the driver's
            # clock: a 16,384-worker job's view is made again at most every second or two, see GET /v1/jobs/{job})
            t_done = st["history"][-1]["finished_at"]
            time.sleep(0.5)
            probe.halt.set()
            probe.join()
            prof_b, cpu_b = read_json(out / "scheduler-cpu.json"), proc_cpu(sched.pid)
            counts_b = request(f"{agent_url}/counts")
            nodes = request(f"{agent_url}/nodes/counts")
            rec = st["history"][-1]
            marks = rec["marks"]
            total = t_done - t_req
            planning = marks["planned"] - marks.get("committed", marks["requested"])
            data = data_of()
            span = t_done - t_req
            prof = diff(prof_a, prof_b)
            now_rss, peak_rss = rss(sched.pid)
            print(f"\n{name}: {rec['from_config']} -> {rec['to_config']} ({rec['from_gpus']} -> {rec['to_gpus']} GPUs), "
                  f"reason {rec['reason']}, load {os.getloadavg()[0]:.1f}", flush=True)
            for k, v in sorted(marks.items(), key=lambda kv: kv[1]):
                print(f"    {v - t_req:+8.2f} s  {k}")
            print(f"    {t_done - t_req:+8.2f} s  training again (the scheduler sees the new generation's first step)")
            timelines = request(f"{agent_url}/timeline")
            old_tl = timelines.get(f"{JOB}/g{st['generation'] - 1}", {})
            print("  the old generation on the agent (its stop): " + ", ".join(
                f"{k} {v - t_req:+.2f} s" for k, v in sorted(old_tl.items(), key=lambda kv: kv[1]) if v >= t_req))
            agent_tl = timelines.get(f"{JOB}/g{st['generation']}", {})
            print("  the new generation on the agent: " + ", ".join(
                f"{k} {v - t_req:+.2f} s" for k, v in sorted(agent_tl.items(), key=lambda kv: kv[1])))
            parts = {k: nodes["counts"].get(k, 0) - nodes_a.get(k, 0) for k in
                     ("parts received", "parts decoded", "parts refused")}
            print(f"  sub-plans: {parts} (refused: {nodes['refused'][:3]}); workers: "
                  + ", ".join(f"{k} {counts_b[k] - counts_a[k]}" for k in ("register", "ptc", "snapshot", "exit")))
            print("  phases (job record): " + ", ".join(f"{k} {v:.2f} s" for k, v in rec["phases"].items()))
            beyond = total - planning - data
            dec = nodes.get("decoding", {}).get(rec.get("version_to") or "", {})
            decoding = dec.get("last_decoded", 0.0) - dec.get("first_received", 0.0) if dec else 0.0
            print(f"  total {total:.2f} s = planning {planning:.2f} s (planner CPU {planner_cpu(prof):.2f} s) + data "
                  f"{data:.2f} s + orchestration {beyond:.2f} s (target <= 10 s)")
            if dec:
                print(f"  the agents decoding the {dec['parts']:.0f} sub-plans: {decoding:.2f} s from the first received to "
                      f"the last decoded ({dec['cpu_s']:.1f} CPU s in all on this machine, at most {dec['max_cpu_s']:.3f} s "
                      f"for one: on a cluster each node decodes its own); orchestration without that span "
                      f"{beyond - decoding:.2f} s")
            window = print_latencies(probe, t_req, t_done, " (target p99 < 100 ms)")
            print(f"  scheduler: CPU {cpu_b - cpu_a:.1f} s in {span:.1f} s; RSS {now_rss:.0f} MiB, peak {peak_rss:.0f} MiB")
            for line in top(prof, 14, span):
                print(line)
            sys.stdout.flush()
            result = {"name": name, "total": total, "planning": planning, "data": data, "orchestration": beyond,
                      "decoding": decoding, "decoding_stats": dec,
                      "p99_ms": 1e3 * pct(window, 0.99), "rss_mib": now_rss, "peak_rss_mib": peak_rss,
                      "cpu_s": cpu_b - cpu_a, "parts": parts, "record": rec, "status": st}
            results.append(result)
            return result

        def snapshot_time() -> float:
            tl = request(f"{agent_url}/timeline").get(f"{JOB}/g0", {})
            return tl.get("snapshot_written", 0.0) - tl.get("stop_step", 0.0)

        scaled = change(f"scale-down dp{args.dp} -> dp{args.dp_to}",
                        lambda: request(f"{url}/v1/jobs/{JOB}/scale", "POST", {"gpus": gpus_to}),
                        lambda s: training(1)(s) and s["history"] and s["history"][-1]["finished_at"] is not None,
                        snapshot_time)
        st = scaled["status"]
        # every target host's sub-plan decoded (a POST that timed out under load is sent again: decoded again, and
        # attached to the first by its digest), none refused
        assert scaled["parts"]["parts decoded"] >= len(st["hosts"]) and not scaled["parts"]["parts refused"], \
            scaled["parts"]
        lost = sorted(st["hosts"])[len(st["hosts"]) // 3]
        gen = st["generation"]
        loss = change(f"loss of {lost}", lambda: request(f"{agent_url}/nodes/kill", "POST", {"host": lost}),
                      lambda s: (training(gen + 1)(s) and s["history"][-1]["reason"] == "failure"
                                 and s["history"][-1]["finished_at"] is not None), lambda: 0.0)
        rec = loss["record"]
        print(f"  recovered from {rec['version_from']} (the scale-down's {scaled['record']['version_to']}), "
              f"{rec['steps_lost']} steps lost; {lost} in the new hosts: {lost in loss['status']['hosts']}")
        (out / "results.json").write_text(json.dumps(
            [{k: v for k, v in r.items() if k != "status"} for r in results], indent=1, default=str))
        print(f"\nload average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        stop_processes(reversed(children), signal.SIGTERM, grace=30)


if __name__ == "__main__":
    main()
