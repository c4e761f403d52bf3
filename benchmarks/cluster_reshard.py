"""Reconfigurations of a ~1 GB GPT state on an emulated cluster: peer to peer vs through one central store.

Issue 13, item 5. Every host is a network namespace with a 1 Gbit/s link (each
direction) into a switch (:mod:`tenplex.testing.netcluster`), running a node
daemon (``tenplex store serve``) on its own store directory. The state is a
Megatron GPT in fp32 with Adam moments (param, exp_avg, exp_avg_sq), written
into the old hosts' stores as the workers' snapshot would have (before the
clock). For N worker hosts (2 GPUs each) plus one spare and one central store
host, four reconfigurations:

- ``dp``:       tp2 x pp2 x dp(N/4) on the first N/2 hosts -> dp(N/2) on all N (a scale up);
- ``tp-pp``:    tp2 x ppN on all N (one stage a host) -> tp2 x pp(N/2) x dp2 (stages merged, replicated);
- ``loss``:     tp2 x pp2 x dp(N/2) on all N, the last host dies -> same layout, the spare replaces it;
- ``redeploy``: tp2 x pp2 x dp(N/2) on all N -> host 0 drained, the spare takes its place.

Tenplex: the plan is computed, each target host's daemon is sent its sub-plan
(from the scheduler's namespace, as the control plane does) and pulls its
pieces from the daemons that hold them; timed from the submission until every
target has committed. Bound: the largest number of bytes one host sends or
receives, over the link rate (a host cannot do better on its own link).

Central store (the comparison of the Tenplex paper, section 6): the same
change through one store host with the same link: every old region goes to it
once (its daemon pulls them, as an upload), then every new host reads all its
new shards from it; timed end to end. Both phases run through the same daemons
and executor, so the difference is the data path alone.

Reported per scenario: Tenplex time, bound, their ratio (target <= 1.25), the
central time and the speed-up (target >= 3x at 4 hosts, growing with hosts),
the bytes each side moved, and the hosts' link counters against the plan. A
sample of the new shards is checked bit for bit after every transform.

What the emulation cannot give every host: its own disk and cores. All hosts
write their new versions to this machine's one disk, and their daemons share
its cores. So each scenario also reports the bytes all targets wrote (new
shards, not the linked ones), the time this disk alone takes to write them
(``O_DIRECT``, measured at the start of the run: the shared-disk floor), and
how busy the machine's cores were during the transform.

Placement (issue 26, item 3): each scenario's new layout is the preference order's (the ranks on the new
hosts in the order given above); with ``--placement policy`` (the default) the scheduler's policy then puts
each block of ranks on the host holding most of its state
(:func:`tenplex.scheduler.policy.keep_state_placement`, on the scenario's schedulable hosts) and that is
the layout moved; both layouts' network bytes and bounds are reported (``given_*`` and the moved one).

Run (root: it builds network namespaces):
  .venv/bin/python benchmarks/cluster_reshard.py [--hosts 4 8] [--scenarios dp tp-pp loss redeploy]
      [--placement policy|given]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tenplex.core.units import human_bytes
from tenplex.ptc import PTC, Device, ParallelConfig, Region, Shard, Tensor
from tenplex.ptc.megatron import GPTSpec, megatron_gpt_ptc
from tenplex.ptc.parallel import Placement
from tenplex.scheduler.policy import Decision, Policy, keep_state_placement
from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore
from tenplex.testing.emulated import STORE_PORT, EmulatedTenplex
from tenplex.testing.netcluster import NetCluster, netns_unavailable_reason, parse_rate
from tenplex.transformer.plan import Plan, make_plan
from tenplex.transformer.remote import PlanRun

log = logging.getLogger("cluster_reshard")

OLD_V = "s100-g0"


# -- data: each old shard's values follow from (tensor, region), cheap to make and to check ---------------


def _seed(name: str, region: Region) -> float:
    return float(zlib.crc32(f"{name}@{region.format()}".encode()) % 997)


def shard_data(name: str, region: Region) -> np.ndarray:
    """A shard's values: its seed plus the element index, so any misplaced piece shows."""
    return (np.arange(region.volume, dtype=np.float32) + _seed(name, region)).reshape(region.shape)


def expected(old: PTC, name: str, region: Region) -> np.ndarray:
    out = np.empty(region.shape, np.float32)
    for owner in old.owners(name, region):
        src = shard_data(name, owner.shard.region)
        out[owner.piece.relative_to(region).slices()] = src[owner.piece.relative_to(owner.shard.region).slices()]
    return out


# -- layouts ----------------------------------------------------------------------------------------------


@dataclass
class Scenario:
    name: str
    old: PTC
    new: PTC
    alive: list[str]
    dead: list[str] = field(default_factory=list)


def layout(spec: GPTSpec, cfg: ParallelConfig, hosts: list[str]) -> PTC:
    return megatron_gpt_ptc(spec, cfg, gpus_per_node=2, hosts=hosts, precision="fp32")


def scenarios(spec: GPTSpec, n: int) -> dict[str, Scenario]:
    hosts = [f"host-{i}" for i in range(n)]
    spare = f"host-{n}"
    full = ParallelConfig(dp=n // 2, tp=2, pp=2)
    return {
        "dp": Scenario("dp", layout(spec, ParallelConfig(dp=n // 4, tp=2, pp=2), hosts[: n // 2]),
                       layout(spec, full, hosts), hosts),
        "tp-pp": Scenario("tp-pp", layout(spec, ParallelConfig(tp=2, pp=n), hosts),
                          layout(spec, ParallelConfig(dp=2, tp=2, pp=n // 2), hosts), hosts),
        "loss": Scenario("loss", layout(spec, full, hosts), layout(spec, full, [*hosts[:-1], spare]),
                         [*hosts[:-1], spare], dead=[hosts[-1]]),
        "redeploy": Scenario("redeploy", layout(spec, full, hosts), layout(spec, full, [*hosts[1:], spare]),
                             [*hosts, spare]),
    }


def placed(spec: GPTSpec, sc: Scenario) -> Scenario:
    """``sc`` with its new layout placed by the policy: the same configuration on the same (schedulable)
    hosts, each block of ranks on the host that holds most of its state."""
    cfg = ParallelConfig(dp=sc.new.config["dp"], tp=sc.new.config["tp"], pp=sc.new.config["pp"])
    given = Decision(cfg, Placement(2, tuple(sc.new.hosts)), sc.new, "given")
    holders = set(sc.old.hosts) - set(sc.dead)
    d = keep_state_placement(given, sc.old, holders, list(sc.new.hosts), Policy(),
                             lambda c, p: layout(spec, c, list(p.hosts)))
    return Scenario(sc.name, sc.old, d.ptc, sc.alive, sc.dead)


def central_ptc(old: PTC, central: str) -> PTC:
    """Every distinct old region, held once by one device on the central store host."""
    tensors = []
    for t in old.tensors:
        regions = sorted({s.region for s in t.shards}, key=lambda r: r.bounds)
        tensors.append(Tensor(t.name, t.shape, t.dtype, t.kind, tuple(Shard(r, (0,)) for r in regions)))
    return PTC(dict(old.config), (Device(0, central),), tuple(tensors), old.dataset)


# -- running ------------------------------------------------------------------------------------------------


def populate(t: EmulatedTenplex, old: PTC, job: str) -> None:
    """The old hosts' stores as their workers' snapshot leaves them (written here, on the shared disk)."""

    def one(host: str) -> None:
        store = LocalStore(t.store_root(host))
        for tensor, shard in old.shards_on_host(host):
            store.write_shard(job, OLD_V, tensor.name, shard.region, shard_data(tensor.name, shard.region),
                              dtype=tensor.dtype, global_shape=tensor.shape)
        store.commit(job, OLD_V)
        store.close()

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, old.hosts))


def run_plan(t: EmulatedTenplex, plan: Plan, alive: list[str]) -> tuple[float, int]:
    """Submit every target's sub-plan from the scheduler's node and wait for all commits; seconds, and the
    bytes the targets wrote (their new shards but the linked ones)."""
    stores = {h: t.store_url(h) for h in alive}
    clients: dict[str, StoreClient] = {}

    def client_for(url: str) -> StoreClient:
        if url not in clients:
            clients[url] = StoreClient(url, t.token, timeout=60)
        return clients[url]

    def go() -> tuple[float, int]:
        start = time.perf_counter()
        reports = PlanRun(plan, stores, token=t.token, client_for=client_for).wait(poll_interval=0.05, timeout=3600)
        return time.perf_counter() - start, sum(r.bytes_total - r.bytes_linked for r in reports.values())

    try:
        return t.call(go)
    finally:
        for c in clients.values():
            c.close()


def check_sample(t: EmulatedTenplex, truth: PTC, new: PTC, job: str, version: str, count: int = 12) -> int:
    """Read back ``count`` random new shards over HTTP (from the scheduler's node) and compare bit for bit."""
    rng = random.Random(version)
    picks = rng.sample([(h, tensor, s) for h in new.hosts for tensor, s in new.shards_on_host(h)], count)
    for host, tensor, shard in picks:
        got = t.store(host, "read", job, version, tensor.name, shard.region, tensor.dtype)
        want = expected(truth, tensor.name, shard.region)
        assert got.tobytes() == want.tobytes(), f"{host}: {tensor.name} {shard.region} differs after {version}"
    return len(picks)


def disk_write_rate(work: Path, total: int = 1 << 30, file_bytes: int = 4 << 20) -> float:
    """Bytes per second this machine's disk writes with O_DIRECT from 4 threads (as the stores write chunks)."""
    import mmap
    import os

    root = work / "disk-rate"
    root.mkdir(exist_ok=True)
    block = mmap.mmap(-1, file_bytes)  # page-aligned, as O_DIRECT needs
    block.write(np.random.default_rng(0).bytes(file_bytes))
    direct = getattr(os, "O_DIRECT", 0)

    def write_one(i: int) -> None:
        fd = os.open(root / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
        os.pwrite(fd, block, 0)
        os.close(fd)

    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write_one, range(total // file_bytes)))
    os.sync()
    seconds = time.perf_counter() - start
    for f in root.iterdir():
        f.unlink()
    return total / seconds


def cpu_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all cores, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


PERF_DIR: Path | None = None
"""``--perf DIR``: where the machine-wide profile of each Tenplex transform's stages goes."""


def machine_stages(script: str, pids: set[int]) -> dict[str, float]:
    """Share of the daemons' (``pids``) CPU samples per stage (datapath_cpu's stages, with the emulated links'
    forwarding split out), from ``perf script -F pid,period,ip,sym`` with call chains of the whole machine."""
    from datapath_cpu import PERF_STAGES  # same directory

    stages = [("idle", ("cpuidle", "default_idle", "do_idle", "pv_native_safe_halt")),
              ("network emulation (bridge, veth, qdisc)", ("br_", "veth_", "htb_", "__dev_queue_xmit",
                                                          "netif_receive_skb", "__netif_receive_skb")),
              *PERF_STAGES]
    counts: dict[str, int] = {}
    frames: list[str] = []
    keep = [False]

    def flush() -> None:
        if frames and keep[0]:
            stage = next((name for f in frames for name, keys in stages if any(k in f for k in keys)), "other")
            counts[stage] = counts.get(stage, 0) + 1
        frames.clear()

    for line in script.splitlines():
        if not line.strip():
            flush()
        elif line.startswith("\t"):
            frames.append(line.strip())
        else:
            flush()
            head = line.split()
            keep[0] = bool(head) and head[0].isdigit() and int(head[0]) in pids
    flush()
    total = sum(counts.values()) or 1
    return {k: round(v / total, 4) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}


def daemons_cpu(t: EmulatedTenplex) -> float:
    """CPU seconds (utime + stime, all threads) the running node daemons have used so far, from /proc: what the
    data path costs, which other work on a shared machine does not inflate the way it does wall-clock time."""
    total = 0.0
    for proc in t.daemons.values():  # `ip netns exec` execs the daemon: the same pid
        if proc.poll() is not None:
            continue
        try:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def bound_seconds(plan: Plan, rate_bps: int) -> tuple[float, int]:
    sends, receives = plan.send_bytes(), plan.receive_bytes()
    worst = max([*sends.values(), *receives.values(), 0])
    return worst * 8 / rate_bps, worst


def clean(t: EmulatedTenplex, hosts: list[str], job: str) -> None:
    for h in hosts:
        store = LocalStore(t.store_root(h))
        for v in store.versions(job) if job in store.jobs() else []:
            store.delete(job, v.version)
        store.close()


def describe(ptc: PTC) -> str:
    c = ptc.config
    return f"dp{c['dp']} x tp{c['tp']} x pp{c['pp']} on {len(ptc.hosts)} hosts"


def run_scenario(t: EmulatedTenplex, sc: Scenario, rate_bps: int, central_host: str, disk_bps: float,
                 workers: int, given: Scenario | None = None) -> dict[str, Any]:
    job = f"bench-{sc.name}"
    all_hosts = [h.name for h in t.net.hosts]
    clean(t, all_hosts, job)
    populate(t, sc.old, job)
    for h in sc.dead:  # the host dies: its daemon is gone, its store is not reachable
        t.daemons[h].kill()
        t.daemons[h].wait()
    state = sum(tensor.nbytes for tensor in sc.old.tensors)

    # Tenplex: peer to peer.
    plan = make_plan(sc.old, sc.new, job=job, old_version=OLD_V, new_version="s100-g1", alive=set(sc.alive))
    assert plan.network_bytes == plan.lower_bound_bytes
    bound, worst = bound_seconds(plan, rate_bps)
    given_plan = plan if given is None else make_plan(given.old, given.new, job=job, old_version=OLD_V,
                                                      new_version="s100-g1", alive=set(given.alive))
    given_bound, given_worst = bound_seconds(given_plan, rate_bps)
    perf = None
    if PERF_DIR is not None:  # the whole machine (every namespace's daemons and their softirqs), with call chains
        PERF_DIR.mkdir(parents=True, exist_ok=True)
        out = PERF_DIR / f"{workers}-{sc.name}.perf"
        perf = subprocess.Popen(["perf", "record", "-a", "-g", "-F", "499", "-o", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    before, cpu0, daemons0 = t.net.snapshot(), cpu_busy(), daemons_cpu(t)
    seconds, written = run_plan(t, plan, sc.alive)
    delta, cpu1, daemons1 = t.net.snapshot() - before, cpu_busy(), daemons_cpu(t)
    if perf is not None:
        perf.send_signal(signal.SIGINT)
        perf.wait()
        script = subprocess.run(["perf", "script", "-i", str(out), "-F", "pid,period,ip,sym"], capture_output=True,
                                text=True, check=False).stdout
        pids = {p.pid for p in t.daemons.values() if p.poll() is None}
        out.with_suffix(".stages.json").write_text(json.dumps(machine_stages(script, pids), indent=1))
    busy = (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1])
    checked = check_sample(t, sc.old, sc.new, job, "s100-g1")
    links = {h: {"plan_bytes": plan.host(h).bytes_remote, "link_bytes": delta[h].ports[STORE_PORT].rx_from_port}
             for h in plan.hosts}
    sched = delta["scheduler"].rx_bytes + delta["scheduler"].tx_bytes

    # Central store: every old region to it once, then every new shard from it.
    central = central_ptc(sc.old, central_host)
    up = make_plan(sc.old, central, job=job, old_version=OLD_V, new_version="s100-g2",
                   alive={*sc.alive, central_host})
    down = make_plan(central, sc.new, job=job, old_version="s100-g2", new_version="s100-g3", alive={central_host})
    upload, _ = run_plan(t, up, [*sc.alive, central_host])
    download, _ = run_plan(t, down, [central_host, *sc.new.hosts])
    check_sample(t, sc.old, sc.new, job, "s100-g3")
    central_s = upload + download
    for h in sc.dead:  # back for the next scenario
        t.start_daemon(h)
        t.wait_daemon(h)
    clean(t, all_hosts, job)
    return {
        "scenario": sc.name, "hosts": workers, "state_bytes": state,
        "from": describe(sc.old), "to": describe(sc.new),
        "network_bytes": plan.network_bytes, "local_bytes": plan.local_bytes, "worst_host_bytes": worst,
        "placement": list(sc.new.hosts), "given_placement": list((given or sc).new.hosts),
        "given_network_bytes": given_plan.network_bytes, "given_worst_host_bytes": given_worst,
        "given_bound_s": round(given_bound, 3),
        "tenplex_s": round(seconds, 3), "bound_s": round(bound, 3), "ratio": round(seconds / bound, 3) if bound else None,
        "written_bytes": written, "disk_floor_s": round(written / disk_bps, 3), "cpu_busy": round(busy, 3),
        "daemons_core_s": round(daemons1 - daemons0, 3),
        "daemons_core_s_per_gib": round((daemons1 - daemons0) / (plan.network_bytes / (1 << 30)), 3) if plan.network_bytes else None,
        "central_upload_s": round(upload, 3), "central_download_s": round(download, 3), "central_s": round(central_s, 3),
        "central_bytes": up.network_bytes + down.network_bytes,
        "speedup": round(central_s / seconds, 2) if seconds else None,
        "scheduler_link_bytes": sched, "links": links, "shards_checked": checked,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, nargs="+", default=[4, 8], help="worker host counts (multiples of 4)")
    ap.add_argument("--scenarios", nargs="+", default=["dp", "tp-pp", "loss", "redeploy"])
    ap.add_argument("--rate", default="1gbit", help="link rate per direction (tc units)")
    ap.add_argument("--layers", type=int, default=8, help="a multiple of the largest --hosts (one stage a host)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--placement", choices=["policy", "given"], default="policy",
                    help="policy: the scheduler's placement of the new layout (default); given: the preference order's")
    ap.add_argument("--dry-run", action="store_true",
                    help="only the plans: bytes and bounds of each scenario's given and placed layouts (no cluster)")
    ap.add_argument("--daemon-args", default="", metavar="ARGS",
                    help="extra 'tenplex store serve' options for every daemon, e.g. '--transform-memory 256Mi'")
    ap.add_argument("--perf", type=Path, default=None, metavar="DIR",
                    help="perf record -a -g during each Tenplex transform; its stage split into DIR")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args(argv)
    global PERF_DIR
    PERF_DIR = args.perf
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = GPTSpec(num_layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq_len=2048)
    if args.dry_run:
        rate_bps = parse_rate(args.rate)
        for n in args.hosts:
            for name, sc in scenarios(spec, n).items():
                if name not in args.scenarios:
                    continue
                rows = []
                for layout_sc in (sc, placed(spec, sc)):
                    plan = make_plan(layout_sc.old, layout_sc.new, job="j", old_version=OLD_V, new_version="s100-g1",
                                     alive=set(layout_sc.alive))
                    bound, worst = bound_seconds(plan, rate_bps)
                    rows.append(f"{human_bytes(plan.network_bytes)} moved, busiest host {human_bytes(worst)}, "
                                f"bound {bound:.2f} s on {list(layout_sc.new.hosts)}")
                print(f"{n} hosts {name:9s} given: {rows[0]}\n{'':18s}placed: {rows[1]}", flush=True)
        return 0
    reason = netns_unavailable_reason()
    if reason is not None:
        print(f"cannot build the emulated cluster here: {reason}", file=sys.stderr)
        return 2
    if any(n % 4 for n in args.hosts):
        ap.error("--hosts must be multiples of 4")
    rate_bps = parse_rate(args.rate)
    with tempfile.TemporaryDirectory(prefix="cluster-reshard-disk-") as tmp:
        disk_bps = disk_write_rate(Path(tmp))
    print(f"this machine's disk writes {disk_bps / 1e9:.2f} GB/s (O_DIRECT, 4 threads)", flush=True)
    results = []
    for n in args.hosts:
        table = scenarios(spec, n)
        # host-n is the spare, host-(n+1) the central store
        with tempfile.TemporaryDirectory(prefix="cluster-reshard-") as tmp, \
                NetCluster(n + 2, rate=args.rate, count_ports=(STORE_PORT,), root_dir=tmp) as net, \
                EmulatedTenplex(net, scheduler=False, gpus_per_host=2,
                                daemon_args=tuple(shlex.split(args.daemon_args))) as t:
            for name in args.scenarios:
                given = table[name]
                sc = placed(spec, given) if args.placement == "policy" else given
                r = run_scenario(t, sc, rate_bps, f"host-{n + 1}", disk_bps, n, given)
                results.append(r)
                print(f"{n} hosts {name:9s} state {human_bytes(r['state_bytes'])}: tenplex {r['tenplex_s']:.2f} s "
                      f"(bound {r['bound_s']:.2f} s, ratio {r['ratio']}), central {r['central_s']:.2f} s "
                      f"(up {r['central_upload_s']:.2f} + down {r['central_download_s']:.2f}), speed-up "
                      f"{r['speedup']}x; network {human_bytes(r['network_bytes'])} vs central "
                      f"{human_bytes(r['central_bytes'])} (given placement: {human_bytes(r['given_network_bytes'])}, "
                      f"bound {r['given_bound_s']:.2f} s); scheduler link {r['scheduler_link_bytes']} B; written "
                      f"{human_bytes(r['written_bytes'])} (disk floor {r['disk_floor_s']:.2f} s), cpu {r['cpu_busy']:.0%}, "
                      f"daemons {r['daemons_core_s']:.2f} core-s ({r['daemons_core_s_per_gib']} per GiB moved)",
                      flush=True)
    if args.json:
        args.json.write_text(json.dumps({"disk_write_bytes_per_s": disk_bps, "results": results}, indent=1))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
