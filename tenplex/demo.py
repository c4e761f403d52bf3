"""``tenplex demo``: a whole elastic cluster on this machine, driven through the real REST API.

It starts the scheduler with emulated hosts (one store daemon each on its own
127.0.0.x address), submits the reference GPT job, and then by itself scales
it up, scales it down, kills a worker process, and redeploys it off a
cordoned host. At the end it prints one row per event (old -> new
configuration, downtime, bytes moved locally and over the network against the
lower bound, steps lost) and plots the loss per step, with the events marked,
beside an uninterrupted run of the same job.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from tenplex.errors import TenplexError, TransformFailed
from tenplex.scheduler.cli import SchedulerClient, history_table, phases_table
from tenplex.scheduler.server import LocalScheduler
from tenplex.sockets import free_port

log = logging.getLogger(__name__)

LOSS_LOG_ENV = "TENPLEX_LOSS_LOG"
"""The reference job appends ``{"step", "loss", "generation"}`` lines here when set (examples.gpt.train)."""

MODEL = {"vocab": 64, "dim": 32, "n_layers": 4, "n_heads": 4, "seq_len": 16}
MODEL_ARGS = ["--layers", "4", "--dim", "32", "--heads", "4", "--vocab", "64", "--seq-len", "16"]
SAMPLES = 4096


@dataclass(frozen=True)
class DemoSettings:
    out: Path
    steps: int = 120
    hosts: int = 3
    gpus_per_host: int = 2
    global_batch: int = 8
    seed: int = 0
    standby: bool = True
    """Keep a warm standby per host (the job's ``standby``): new workers are forked with torch imported."""


def train_command(s: DemoSettings) -> list[str]:
    return [sys.executable, "-m", "examples.gpt.train", *MODEL_ARGS, "--samples", str(SAMPLES),
            "--global-batch", str(s.global_batch), "--seed", str(s.seed)]


def job_spec(s: DemoSettings) -> dict[str, Any]:
    return {
        "name": "gpt-demo",
        "layout": {"provider": "example-gpt", "model": MODEL, "precision": "fp32"},
        "dataset": {"num_samples": SAMPLES, "seed": s.seed, "global_batch_size": s.global_batch},
        "command": train_command(s),
        "gpus": 2,
        "min_gpus": 1,
        "max_gpus": s.hosts * s.gpus_per_host,
        "steps": s.steps,
        "snapshot_every": 4,
        "heartbeat_timeout": 60,
        "env": {LOSS_LOG_ENV: str(s.out / "loss-elastic.jsonl"), "OMP_NUM_THREADS": "1"},
        "standby": s.standby,
    }


class Demo:
    def __init__(self, settings: DemoSettings, console: Console | None = None) -> None:
        self.s = settings
        self.console = console or Console(width=None if sys.stdout.isatty() else 132)
        self.events: list[tuple[int, str]] = []
        self._last_line = ""

    def say(self, text: str) -> None:
        self.console.print(f"[bold cyan]demo[/bold cyan] {text}")

    def run(self) -> int:
        s = self.s
        s.out.mkdir(parents=True, exist_ok=True)
        for f in ("loss-elastic.jsonl", "loss-baseline.jsonl"):
            (s.out / f).unlink(missing_ok=True)
        # The demo's scheduler state (job records, stores, logs) is its own scratch: a new run starts clean
        # rather than finding the previous run's job (and refusing to create it again).
        shutil.rmtree(s.out / "scheduler", ignore_errors=True)
        started = time.monotonic()
        self.say(f"starting the scheduler and {s.hosts} emulated hosts x {s.gpus_per_host} GPUs (state in {s.out})")
        with LocalScheduler(s.out / "scheduler", hosts=s.hosts, gpus_per_host=s.gpus_per_host,
                            heartbeat_interval=0.3) as sched:
            client = SchedulerClient(sched.url)
            for h in sched.cluster.hosts():
                self.say(f"  {h.name}: store daemon at {h.store_url}")
            client.create(job_spec(s))
            self.say("submitted job gpt-demo on 2 GPUs")
            job = "gpt-demo"
            third = s.steps // 5
            self.wait(client, job, lambda v: _running_past(v, third), "training on 2 GPUs")

            self.event(client, job, "scale up to 4 GPUs", lambda: client.scale(job, 4))
            self.wait(client, job, lambda v: _running_past(v, 2 * third, 1), "training on 4 GPUs")

            self.event(client, job, "scale down to 2 GPUs", lambda: client.scale(job, 2))
            self.wait(client, job, lambda v: _running_past(v, 3 * third, 2), "training on 2 GPUs")

            victim = client.job(job)["status"]["workers"][-1]
            # From outside, as a real failure comes: the worker's pid from the job status, SIGKILL.
            self.event(client, job, f"kill worker {victim['worker_id']} (pid {victim['pid']}, SIGKILL)",
                       lambda: os.kill(victim["pid"], signal.SIGKILL))
            self.wait(client, job, lambda v: _running_past(v, 4 * third, 3), "recovering from the survivors")

            hosts_now = client.job(job)["status"]["hosts"]
            self.event(client, job, f"cordon {hosts_now[0]}: redeploy to other hosts",
                       lambda: client.event(job, "cordon", host=hosts_now[0]))
            final = self.wait(client, job, lambda v: v["status"]["phase"] == "Succeeded", "finishing the job")

            self.console.print(history_table(final["status"]["history"]))
            self.console.print(phases_table(final["status"]["history"]))
        self.say("uninterrupted baseline run of the same job (1 process)")
        run_baseline(s)
        plot = plot_losses(s.out, self.events)
        elastic, baseline = read_losses(s.out / "loss-elastic.jsonl"), read_losses(s.out / "loss-baseline.jsonl")
        common = sorted(set(elastic) & set(baseline))
        if common:
            worst = max(abs(elastic[k] - baseline[k]) / abs(baseline[k]) for k in common)
            self.say(f"loss vs the uninterrupted run over {len(common)} steps: max relative difference {worst:.2e}")
        elapsed = time.monotonic() - started
        self.say(f"loss plot: {plot}")
        self.say(f"finished in {elapsed:.0f} s")
        return 0

    def event(self, client: SchedulerClient, job: str, what: str, action: Callable[[], Any]) -> None:
        step = client.job(job)["status"]["step"]
        self.events.append((step, what))
        self.say(f"[yellow]event at step {step}: {what}[/yellow]")
        action()

    def wait(self, client: SchedulerClient, job: str, done: Callable[[dict[str, Any]], bool], what: str,
             timeout: float = 240.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            view = client.job(job)
            st = view["status"]
            line = (f"  {st['phase']}{'/' + st['stage'] if st.get('stage') else ''} gen {st['generation']} "
                    f"step {st['step']}/{self.s.steps} gpus {st['gpus']} {st.get('message', '')}")
            if line != self._last_line:
                self.console.print(line[:160])
                self._last_line = line
            if st["phase"] == "Failed":
                raise TransformFailed(f"the job failed: {st.get('message')}")
            if done(view):
                return view
            if time.monotonic() > deadline:
                raise TenplexError(f"timed out after {timeout:.0f}s while {what}; last status: {st.get('message')}")
            time.sleep(0.25)


def _running_past(view: dict[str, Any], step: int, generation: int = 0) -> bool:
    """The job finished, or runs ``generation`` (or a later one) past ``step`` with its standby workers ready (a
    change now starts none of its workers from scratch)."""
    st = view["status"]
    return st["phase"] == "Succeeded" or (st["phase"] == "Running" and st["generation"] >= generation
                                          and st["step"] >= step and st.get("standby_ready", 0) >= st.get("standby_wanted", 0))


def run_baseline(s: DemoSettings) -> None:
    """The same job, uninterrupted, in one process, logging its losses like the elastic one."""
    port = free_port()  # for its rendezvous (see tenplex.sockets: a port the process binds later)
    env = {**os.environ, LOSS_LOG_ENV: str(s.out / "loss-baseline.jsonl"), "OMP_NUM_THREADS": "1", "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    with open(s.out / "baseline.log", "wb") as log_file:
        subprocess.run([*train_command(s), "--steps", str(s.steps)], env=env, check=True, stdout=log_file,
                       stderr=subprocess.STDOUT)


def read_losses(path: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            out[int(rec["step"])] = float(rec["loss"])  # a replayed step overwrites: the survivors' value
    return out


def plot_losses(out: Path, events: list[tuple[int, str]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    elastic = read_losses(out / "loss-elastic.jsonl")
    baseline = read_losses(out / "loss-baseline.jsonl")
    fig, ax = plt.subplots(figsize=(9, 4.5))
    if baseline:
        ax.plot(sorted(baseline), [baseline[k] for k in sorted(baseline)], label="uninterrupted", color="0.6", lw=3)
    if elastic:
        ax.plot(sorted(elastic), [elastic[k] for k in sorted(elastic)], label="elastic (Tenplex)", color="C0", lw=1.2,
                marker=".", ms=3)
    for i, (step, what) in enumerate(events):
        ax.axvline(step, color=f"C{i + 1}", ls="--", lw=1)
        ax.annotate(what, (step, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                    fontsize=7, color=f"C{i + 1}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Reference GPT: loss across reconfigurations")
    ax.legend(loc="lower left")
    fig.tight_layout()
    path = out / "loss.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def register(sub: Any) -> None:
    demo = sub.add_parser("demo", help="run the elastic-training demo on emulated local hosts")
    demo.add_argument("--out", type=Path, default=Path("demo-out"), help="where state, logs and the plot go")
    demo.add_argument("--steps", type=int, default=120, help="training steps of the job (default 120)")
    demo.set_defaults(func=lambda args: Demo(DemoSettings(out=args.out.resolve(), steps=args.steps)).run())
