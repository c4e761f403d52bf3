"""The job's persisted state at the scale the planner claims: record and API-server object sizes, plan recompute.

For GPT-3 175B (tp8 x pp16 x dp8, 1,024 GPUs on 128 hosts) and a 405B GPT with
ZeRO-1 (tp8 x pp16 x dp128, 16,384 GPUs on 2,048 hosts), each through a
scale-down and a host loss (the layouts of benchmarks/plan_scale.py), this
builds the job record as the scheduler holds it in the transferring stage of
the change (the new generation's workers, named and placed as the launcher
does, registered and heartbeating; the history; the plan's inputs, not the
plan) and measures, offline:

- the record as the local backend's state directory writes it (JSON) and as
  the Kubernetes job store writes it (the ``<job>-tenplex-state`` ConfigMap,
  serialized as sent to the API server: gzip + base64 inside JSON);
- every ConfigMap that holds a generation's PTC (chunks of 512 KiB of gzip)
  serialized the same way, against the 1 MiB object limit;
- the time to compute the plan again from the record's inputs and the PTCs
  (what a restarted scheduler does), and that it is the same plan (every host's
  encoded part compared byte for byte);
- with --json, the plan as JSON and gzipped (what the record held before).

The worker pids are those of processes launched one after another (increasing,
small gaps), as on the local backend; on Kubernetes every pod has its own pid
namespace and the pids repeat, which compresses better.

Run: .venv/bin/python benchmarks/record_scale.py [--cases 175b,405b] [--json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_scale import GPT3_175B, GPT_405B, timed_build  # noqa: E402

from tenplex.k8s.jobstore import (  # noqa: E402
    CONFIGMAP_LIMIT,
    owned_configmap,
    ptc_chunks,
    state_configmap,
    state_data,
)
from tenplex.ptc import PTC, DatasetState, ParallelConfig  # noqa: E402
from tenplex.scheduler.layouts import LayoutSpec  # noqa: E402
from tenplex.scheduler.plans import PlanInputs  # noqa: E402
from tenplex.scheduler.state import JobSpec, JobStatus, Phase, Reconfiguration, Stage, WorkerRecord  # noqa: E402
from tenplex.transformer import part  # noqa: E402

JOB = "big"
JOB_OBJ = {"apiVersion": "tenplex.io/v1alpha1", "kind": "ElasticJob",
           "metadata": {"name": JOB, "namespace": "training", "uid": "6f0c1e2a-0000-4000-8000-000000000001"}}


def record(old: PTC, new: PTC, inputs: PlanInputs, parallel: ParallelConfig, reason: str,
           model: dict) -> tuple[JobSpec, JobStatus]:
    now = time.time()
    rng = random.Random(0)
    hosts = list(new.hosts)
    pid = 40_000
    workers = []
    for d in sorted(new.devices, key=lambda d: d.id):
        pid += rng.randint(1, 20)
        workers.append(WorkerRecord(f"{JOB}-g1-r{d.id}", d.id, d.host, d.id % 8, 1, pid=pid, registered=True,
                                    last_heartbeat=now - rng.random(), step=1000))
    old_hosts = list(old.hosts)
    spec = JobSpec(name=JOB, layout=LayoutSpec("megatron-gpt", model),
                   dataset=DatasetState(10_000_000, 1, 1536), command=("python", "-m", "train"),
                   gpus=len(old.devices), max_gpus=len(old.devices))
    rec = Reconfiguration(reason=reason, started_at=now - 30, from_config=str(old.config), to_config=str(new.config),
                          from_gpus=len(old.devices), to_gpus=len(new.devices), from_hosts=old_hosts, to_hosts=hosts,
                          version_from=inputs.old_version, version_to=inputs.new_version)
    status = JobStatus(
        phase=Phase.RECONFIGURING, stage=Stage.TRANSFERRING, generation=1, gpus=len(new.devices),
        parallel=parallel.to_json(), hosts=hosts, gpus_per_node=8, step=1000, version=inputs.old_version,
        committed={inputs.old_version: sorted(inputs.holders())}, version_generation={inputs.old_version: 0},
        restore_version=inputs.new_version, workers=workers, history=[rec],
        last_plan={"inputs": inputs.to_json(), "parallel": parallel.to_json(), "hosts": hosts, "gpus_per_node": 8})
    return spec, status


def serialized(body: dict) -> int:
    return len(json.dumps(body, separators=(",", ":")))


def scenarios(case: str) -> list[tuple[str, PTC, PTC, ParallelConfig, list[str], str | None]]:
    if case == "175b":
        hosts = [f"node-{i}" for i in range(128)]
        old = timed_build("175B tp8 x pp16 x dp8", GPT3_175B, ParallelConfig(dp=8, tp=8, pp=16), hosts=hosts)
        survivors = [h for h in hosts if h not in {"node-3", "node-77"}]
        down = ParallelConfig(dp=8, tp=8, pp=12)
        loss = ParallelConfig(dp=7, tp=8, pp=16)
        return [
            ("175B scale-down 1024->768", old, timed_build("175B pp12", GPT3_175B, down, hosts=hosts[:96]), down,
             hosts, None),
            ("175B loss of 2 hosts 1024->896", old, timed_build("175B dp7", GPT3_175B, loss, hosts=survivors[:112]),
             loss, survivors, None),
        ]
    dp, pp = 128, 16
    hosts = [f"node-{i}" for i in range(dp * pp)]
    old = timed_build("405B dp128", GPT_405B, ParallelConfig(dp=dp, tp=8, pp=pp, zero=1), hosts=hosts,
                      precision="bf16")
    lost = hosts[6 * dp + 9]
    kept = [hosts[s * dp + d] for s in range(pp) for d in range(dp) if d != 9]
    down_hosts = [hosts[s * dp + d] for s in range(pp) for d in range(120)]
    loss = ParallelConfig(dp=127, tp=8, pp=pp, zero=1)
    down = ParallelConfig(dp=120, tp=8, pp=pp, zero=1)
    return [
        ("405B scale-down 16384->15360", old, timed_build("405B dp120", GPT_405B, down, hosts=down_hosts,
                                                          precision="bf16"), down, hosts, None),
        (f"405B loss of {lost} 16384->16256", old, timed_build("405B dp127", GPT_405B, loss, hosts=kept,
                                                               precision="bf16"), loss,
         [h for h in hosts if h != lost], "http://checkpoint.invalid:7070"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="175b,405b")
    parser.add_argument("--json", action="store_true", help="also the plan as JSON (what the record held before)")
    args = parser.parse_args()
    print(f"machine: nproc={os.cpu_count()}, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for case in args.cases.split(","):
        for name, old, new, parallel, alive, checkpoint in scenarios(case.strip()):
            inputs = PlanInputs.of(job=JOB, old_version="s1000-g0", new_version="s1000-g1", old_generation=0,
                                   alive=alive, holders=alive, checkpoint=checkpoint)
            plan = inputs.plan(old, new)
            model = {k: v for k, v in vars(GPT3_175B if case.strip() == "175b" else GPT_405B).items()}
            spec, status = record(old, new, inputs, parallel, "failure" if "loss" in name else "scale", model)
            local = len(json.dumps({"spec": spec.to_json(), "status": status.to_record()}, separators=(",", ":")))
            cm = serialized(owned_configmap(JOB_OBJ, state_configmap(JOB), state_data(spec, status)))
            print(f"{name}: {len(status.workers)} workers on {len(status.hosts)} hosts")
            print(f"  job record: state directory {local / 1024:.1f} KiB of JSON; Kubernetes state ConfigMap "
                  f"{cm / 1024:.1f} KiB serialized (limit 1024 KiB; target <= 64 KiB)")
            for gen, ptc in ((0, old), (1, new)):
                sizes = [serialized(owned_configmap(JOB_OBJ, n, d, t)) for n, d, t in ptc_chunks(JOB, gen, ptc)]
                assert max(sizes) < CONFIGMAP_LIMIT
                print(f"  PTC generation {gen} ({sum(len(t.shards) for t in ptc.tensors)} shards): {len(sizes)} "
                      f"ConfigMap{'s' if len(sizes) > 1 else ''}, largest {max(sizes) / 1024:.0f} KiB serialized, "
                      f"{sum(sizes) / 1024:.0f} KiB in all")
            back = JobStatus.from_json(json.loads(json.dumps(status.to_record())))
            again_inputs = PlanInputs.from_json(back.last_plan["inputs"] if back.last_plan else None)
            start, cpu = time.perf_counter(), time.process_time()
            again = again_inputs.plan(old, new)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            same = all(part.encode(again, h) == part.encode(plan, h) for h in plan.hosts)
            print(f"  plan computed again from the record: {wall:.2f} s (CPU {cpu:.2f} s), load "
                  f"{os.getloadavg()[0]:.1f}; the same plan (every host's part byte for byte): {same}")
            assert same
            if args.json:
                text = plan.dumps().encode()
                print(f"  the plan as JSON (stored before): {len(text) / 2**20:.1f} MiB, gzipped "
                      f"{len(gzip.compress(text, 6)) / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
