"""Real jobs' layouts and records, for the tests and benchmarks that check sizes at the scale the planner claims.

GPT-3 175B as tp8 x pp16 x dp8 (1,024 GPUs on 128 hosts) and a 405B GPT with ZeRO-1 as tp8 x pp16 x dp128
(16,384 GPUs on 2,048 hosts), each with a scale-down and a host loss, and the job record the scheduler holds in
the transferring stage of such a change (the new generation's workers registered and heartbeating, the history,
the plan's inputs). ``benchmarks/record_scale.py`` measures these records and writes them to a real API server;
``tests/k8s/test_jobstore_k8s.py`` checks the real server accepts them through the product's job store.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from tenplex.ptc import PTC, DatasetState, ParallelConfig
from tenplex.ptc.megatron import GPTSpec, megatron_gpt_ptc
from tenplex.scheduler.layouts import LayoutSpec
from tenplex.scheduler.plans import PlanInputs
from tenplex.scheduler.state import JobSpec, JobStatus, Phase, Reconfiguration, Stage, WorkerRecord

GPT3_175B = GPTSpec(num_layers=96, hidden=12288, heads=96, vocab=50257, seq_len=2048)
GPT_405B = GPTSpec(num_layers=126, hidden=16384, heads=128, kv_heads=8, vocab=128256, ffn_hidden=53248,
                   gated_mlp=True, normalization="RMSNorm", bias=False, seq_len=0)

Build = Callable[..., PTC]


@dataclass(frozen=True)
class Change:
    """One reconfiguration of a real-sized job: its layouts before and after, the hosts alive, the fall-back."""

    name: str
    model: GPTSpec
    old: PTC
    new: PTC
    parallel: ParallelConfig
    alive: list[str]
    checkpoint: str | None = None

    @property
    def reason(self) -> str:
        return "failure" if "loss" in self.name else "scale"

    def inputs(self, job: str) -> PlanInputs:
        return PlanInputs.of(job=job, old_version="s1000-g0", new_version="s1000-g1", old_generation=0,
                             alive=self.alive, holders=self.alive, checkpoint=self.checkpoint)


KINDS = ("scale-down", "host-loss")


def changes(case: str, build: Build = megatron_gpt_ptc, kinds: tuple[str, ...] = KINDS) -> list[Change]:
    """The changes of ``case`` ("175b" or "405b") of the given kinds; ``build`` makes each PTC (a timed wrapper
    of :func:`megatron_gpt_ptc` in the benchmarks). A layout takes seconds to build at 16,384 GPUs: only those
    of the kinds asked for are."""
    if unknown := set(kinds) - set(KINDS):
        raise ValueError(f"unknown kinds {sorted(unknown)}: {', '.join(KINDS)}")
    if case == "175b":
        hosts = [f"node-{i}" for i in range(128)]
        old = build(GPT3_175B, ParallelConfig(dp=8, tp=8, pp=16), hosts=hosts)
        survivors = [h for h in hosts if h not in {"node-3", "node-77"}]
        down = ParallelConfig(dp=8, tp=8, pp=12)
        loss = ParallelConfig(dp=7, tp=8, pp=16)
        out = []
        if "scale-down" in kinds:
            out.append(Change("175B scale-down 1024->768", GPT3_175B, old, build(GPT3_175B, down, hosts=hosts[:96]),
                              down, hosts))
        if "host-loss" in kinds:
            out.append(Change("175B loss of 2 hosts 1024->896", GPT3_175B, old,
                              build(GPT3_175B, loss, hosts=survivors[:112]), loss, survivors))
        return out
    if case != "405b":
        raise ValueError(f"unknown case {case!r}: 175b or 405b")
    dp, pp = 128, 16
    hosts = [f"node-{i}" for i in range(dp * pp)]  # host s*dp + d runs stage s, dp rank d (tp inside the host)
    old = build(GPT_405B, ParallelConfig(dp=dp, tp=8, pp=pp, zero=1), hosts=hosts, precision="bf16")
    lost = hosts[6 * dp + 9]
    kept = [hosts[s * dp + d] for s in range(pp) for d in range(dp) if d != 9]
    down_hosts = [hosts[s * dp + d] for s in range(pp) for d in range(120)]
    down = ParallelConfig(dp=120, tp=8, pp=pp, zero=1)
    loss = ParallelConfig(dp=127, tp=8, pp=pp, zero=1)
    out = []
    if "scale-down" in kinds:
        out.append(Change("405B scale-down 16384->15360", GPT_405B, old,
                          build(GPT_405B, down, hosts=down_hosts, precision="bf16"), down, hosts))
    if "host-loss" in kinds:
        out.append(Change(f"405B loss of {lost} 16384->16256", GPT_405B, old,
                          build(GPT_405B, loss, hosts=kept, precision="bf16"), loss, [h for h in hosts if h != lost],
                          "http://checkpoint.invalid:7070"))
    return out


def transferring_record(job: str, change: Change) -> tuple[JobSpec, JobStatus]:
    """The job's spec and status as the scheduler holds them while ``change`` moves its state.

    The worker pids are those of processes launched one after another (increasing, small gaps), as on the
    local backend; on Kubernetes every pod has its own pid namespace and the pids repeat, which compresses
    better: this is the larger record of the two."""
    old, new, inputs = change.old, change.new, change.inputs(job)
    now = time.time()
    rng = random.Random(0)
    hosts = list(new.hosts)
    pid = 40_000
    workers = []
    for d in sorted(new.devices, key=lambda d: d.id):
        pid += rng.randint(1, 20)
        workers.append(WorkerRecord(f"{job}-g1-r{d.id}", d.id, d.host, d.id % 8, 1, pid=pid, registered=True,
                                    last_heartbeat=now - rng.random(), step=1000))
    spec = JobSpec(name=job, layout=LayoutSpec("megatron-gpt", dict(vars(change.model))),
                   dataset=DatasetState(10_000_000, 1, 1536), command=("python", "-m", "train"),
                   gpus=len(old.devices), max_gpus=len(old.devices))
    rec = Reconfiguration(reason=change.reason, started_at=now - 30, from_config=str(old.config),
                          to_config=str(new.config), from_gpus=len(old.devices), to_gpus=len(new.devices),
                          from_hosts=list(old.hosts), to_hosts=hosts, version_from=inputs.old_version,
                          version_to=inputs.new_version)
    status = JobStatus(
        phase=Phase.RECONFIGURING, stage=Stage.TRANSFERRING, generation=1, gpus=len(new.devices),
        parallel=change.parallel.to_json(), hosts=hosts, gpus_per_node=8, step=1000, version=inputs.old_version,
        committed={inputs.old_version: sorted(inputs.holders())}, version_generation={inputs.old_version: 0},
        restore_version=inputs.new_version, workers=workers, history=[rec],
        last_plan={"inputs": inputs.to_json(), "parallel": change.parallel.to_json(), "hosts": hosts,
                   "gpus_per_node": 8})
    return spec, status
