"""Planning time at the scale of today's largest jobs (target: <= 1 s per plan; network / lower bound = 1.000).

GPT-3 175B (ZeRO-0), from tp8 x pp16 x dp8 (1024 GPUs, 128 hosts of 8):
  scale-down: to tp8 x pp12 x dp8 (768 GPUs, the first 96 hosts);
  host loss:  node-3 and node-77 fail; to tp8 x pp16 x dp7 (896 GPUs) on the first 112 survivors.

A 405B GPT (Llama-3.1-405B's shape: 126 layers, hidden 16384, 128 heads with 8
KV heads, SwiGLU width 53248, vocab 128256, RMSNorm, no biases, rotary), bf16
parameters with fp32 Adam state and ZeRO-1 (megatron-core's distributed
optimizer: fp32 master weights and moments cut over the dp ranks), from
tp8 x pp16 x dp128 (16,384 GPUs, 2,048 hosts of 8):
  host loss:  node-777 (stage 6, dp rank 9) fails; to dp127 (16,256 GPUs) on the survivors, each host
              keeping its pipeline stage and tensor-parallel slice (dp rank 9's hosts of the other stages
              leave the job). Its optimizer shards had no replica (ZeRO-1), so they are read from the
              persistent checkpoint; those reads count as network bytes, in the plan and in the lower bound;
  scale-down: to dp120 (15,360 GPUs), dp ranks 120-127 of every stage leaving.

The PTCs are built by the Megatron layout provider before timing (the scheduler
builds them anyway; their build time is printed separately); the timed part is
make_plan, lower bound and checks included. The first plan of a scenario is
timed on its own (cold) besides the median; CPU time (time.process_time) is
printed too, as the machine is shared. Building and encoding every host's transform request (its part of
the plan in the binary form of tenplex.transformer.part, with its sources: what the scheduler sends the
daemons) is timed apart (--serialize): it is orchestration, not planning.

Run: .venv/bin/python benchmarks/plan_scale.py [--repeat 5] [--cases 175b,405b] [--serialize]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from tenplex.ptc import PTC, ParallelConfig, Placement
from tenplex.ptc.megatron import megatron_gpt_ptc
from tenplex.scheduler.policy import Decision, Policy, keep_state_placement
from tenplex.store.client import StoreClient
from tenplex.testing.scale import GPT3_175B, GPT_405B
from tenplex.transformer.plan import make_plan, plan_summary
from tenplex.transformer.remote import PlanRun


def timed_build(what: str, *args: object, **kwargs: object) -> PTC:
    start = time.perf_counter()
    ptc = megatron_gpt_ptc(*args, **kwargs)  # type: ignore[arg-type]
    print(f"  PTC {what}: built in {time.perf_counter() - start:.2f} s, {len(ptc.devices)} devices, "
          f"{sum(len(t.shards) for t in ptc.tensors)} shards")
    return ptc


def scenarios_175b() -> tuple[str, PTC, dict[str, tuple[PTC, set[str] | None, str | None]]]:
    hosts = [f"node-{i}" for i in range(128)]
    old = timed_build("175B tp8 x pp16 x dp8", GPT3_175B, ParallelConfig(dp=8, tp=8, pp=16), hosts=hosts)
    dead = {"node-3", "node-77"}
    survivors = [h for h in hosts if h not in dead]
    return "GPT-3 175B", old, {
        "175B scale-down pp16->pp12 (1024->768 GPUs)": (
            timed_build("175B tp8 x pp12 x dp8", GPT3_175B, ParallelConfig(dp=8, tp=8, pp=12), hosts=hosts[:96]),
            None, None),
        "175B loss of 2 hosts, dp8->dp7 (1024->896 GPUs)": (
            timed_build("175B tp8 x pp16 x dp7", GPT3_175B, ParallelConfig(dp=7, tp=8, pp=16),
                        hosts=survivors[:112]),
            set(survivors), None),
    }


def scenarios_405b() -> tuple[str, PTC, dict[str, tuple[PTC, set[str] | None, str | None]]]:
    dp, pp = 128, 16
    hosts = [f"node-{i}" for i in range(dp * pp)]  # host s*dp + d runs stage s, dp rank d (tp inside the host)
    old = timed_build("405B tp8 x pp16 x dp128", GPT_405B, ParallelConfig(dp=dp, tp=8, pp=pp, zero=1), hosts=hosts,
                      precision="bf16")
    lost_rank, lost_stage = 9, 6
    lost = hosts[lost_stage * dp + lost_rank]
    kept = [hosts[s * dp + d] for s in range(pp) for d in range(dp) if d != lost_rank]
    down = [hosts[s * dp + d] for s in range(pp) for d in range(120)]
    return "405B GPT", old, {
        f"405B loss of {lost}, dp128->dp127 (16384->16256 GPUs)": (
            timed_build("405B tp8 x pp16 x dp127", GPT_405B, ParallelConfig(dp=127, tp=8, pp=pp, zero=1),
                        hosts=kept, precision="bf16"),
            set(hosts) - {lost}, "http://checkpoint.invalid:7070"),
        "405B scale-down dp128->dp120 (16384->15360 GPUs)": (
            timed_build("405B tp8 x pp16 x dp120", GPT_405B, ParallelConfig(dp=120, tp=8, pp=pp, zero=1),
                        hosts=down, precision="bf16"),
            None, None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per scenario (median reported)")
    parser.add_argument("--cases", default="175b,405b", help="comma-separated: 175b, 405b")
    parser.add_argument("--placement", action="store_true",
                        help="also time the policy's placement step (which host runs which block of ranks, "
                             "tenplex.scheduler.policy.keep_state_placement) on the same layouts")
    parser.add_argument("--serialize", action="store_true",
                        help="also time building and encoding every host's part (binary), as sent to the daemons")
    parser.add_argument("--json", action="store_true",
                        help="with --serialize, also every host's part as JSON (the form before the binary one)")
    args = parser.parse_args()
    print(f"machine: nproc={os.cpu_count()}, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    builders = {"175b": scenarios_175b, "405b": scenarios_405b}
    for case in args.cases.split(","):
        model, old, scenarios = builders[case.strip()]()
        print(f"{model}: {len(old.tensors)} tensors, {sum(len(t.shards) for t in old.tensors)} old shards, "
              f"{old.total_bytes / 2**40:.2f} TiB of state")
        for name, (new, alive, checkpoint) in scenarios.items():
            walls, cpus = [], []
            plan = None
            for _ in range(args.repeat):
                wall, cpu = time.perf_counter(), time.process_time()
                plan = make_plan(old, new, job="big", old_version="s100-g0", new_version="s100-g1", alive=alive,
                                 checkpoint=checkpoint)
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
            assert plan is not None
            s = plan_summary(plan)
            ratio = s["network_bytes"] / s["lower_bound_bytes"]
            print(
                f"{name}: plan median {statistics.median(walls):.3f} s (cold {walls[0]:.3f}, min {min(walls):.3f}, "
                f"max {max(walls):.3f}, n={len(walls)}; CPU median {statistics.median(cpus):.3f} s); "
                f"load {os.getloadavg()[0]:.1f}; {s['transfers']} transfers to {s['hosts']} hosts; network "
                f"{s['network_bytes'] / 2**30:.1f} GiB, lower bound {s['lower_bound_bytes'] / 2**30:.1f} GiB, "
                f"ratio {ratio:.3f}; local {s['local_bytes'] / 2**30:.1f} GiB; max send "
                f"{s['max_send_bytes'] / 2**30:.2f} GiB, max receive {s['max_receive_bytes'] / 2**30:.2f} GiB"
            )
            if args.placement:
                place_walls, place_cpus = [], []
                cfg = ParallelConfig(**{k: new.config[k] for k in ("dp", "tp", "pp", "zero") if k in new.config})
                decision = Decision(cfg, Placement(int(new.config.get("gpus_per_node", 8)), tuple(new.hosts)), new, "given")
                holders = alive if alive is not None else set(old.hosts)
                moved = decision
                for _ in range(args.repeat):
                    wall, cpu = time.perf_counter(), time.process_time()
                    # the provider's build of a moved placement is the layout's cost, timed apart (timed_build)
                    moved = keep_state_placement(decision, old, holders, list(new.hosts), Policy(),
                                                 lambda _c, _p, new=new: new)
                    place_walls.append(time.perf_counter() - wall)
                    place_cpus.append(time.process_time() - cpu)
                print(f"  placement: median {statistics.median(place_walls):.3f} s (CPU median "
                      f"{statistics.median(place_cpus):.3f} s, n={len(place_walls)}); "
                      f"{'moved blocks: ' + moved.reason if moved is not decision else 'the given placement kept'}")
            if args.serialize:
                plan = make_plan(old, new, job="big", old_version="s100-g0", new_version="s100-g1", alive=alive,
                                 checkpoint=checkpoint)  # a fresh plan: no host's objects built yet
                start, cpu = time.perf_counter(), time.process_time()
                run = PlanRun(plan, {h: f"http://{h}:7070" for h in {*old.hosts, *new.hosts}}, token=None,
                              client_for=StoreClient)
                sizes = [len(run.body(h)) for h in plan.hosts]
                print(f"  every host's transform request (binary part + sources) built and encoded: {time.perf_counter() - start:.2f} s "
                      f"(CPU {time.process_time() - cpu:.2f} s), {sum(sizes) / 2**20:.1f} MiB in all, largest "
                      f"{max(sizes) / 2**10:.0f} KiB; load {os.getloadavg()[0]:.1f}")
                if args.json:
                    start = time.perf_counter()
                    size = sum(len(json.dumps(plan.host(h).to_json(), separators=(",", ":"))) for h in plan.hosts)
                    print(f"  every host's part built and serialized as JSON: {time.perf_counter() - start:.2f} s, "
                          f"{size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
