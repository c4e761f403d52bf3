"""What one emulated link carries: throughput vs the shaped rate, counter overhead, CPU cost.

Builds a :class:`tenplex.testing.netcluster.NetCluster` with two hosts, serves
``--mb`` MB over HTTP from host-1 (``tenplex.testing.bulkhttp``) and fetches it
on host-0, for each case (link rate, MTU). Reports per case (medians over
``--repeats`` transfers):

- goodput (HTTP body bytes / seconds, connection set-up included) and its ratio
  to the shaped rate; the ideal is below 1 by the header share of each frame;
- the receiver's wire bytes (``rx_bytes``, one header set per TCP segment) and
  interface bytes (``iface_rx_bytes``, GRO super-packets) over the payload: the
  protocol overhead the counters show; and the bytes counted for the server's
  source port over the payload;
- CPU: the server's process (user + system seconds per GB, from /proc) and the
  client's transfer (its own process_time, start-up excluded); the kernel's
  forwarding through veth, bridge and HTB mostly runs inline in the sending
  and receiving processes' system time; and the whole machine's busy time (all cores, /proc/stat, so other load on a
  shared machine inflates it) as cores busy during the transfer.

Needs root (network namespaces). Usage:
    .venv/bin/python benchmarks/netcluster_links.py [--mb 200] [--repeats 3] [--pairs 4 8] [--incast 4 7] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tenplex.testing.netcluster import EmuNode, NetCluster, netns_unavailable_reason, parse_rate  # noqa: E402

PORT = 8900
CASES = [("1gbit", 9000), ("1gbit", 1500), (None, 9000), (None, 1500)]


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def machine_busy() -> tuple[int, int, int]:
    """(busy, softirq, total) jiffies over all cores."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, values[6], sum(values)


def transfer(cluster: NetCluster, server_pid: int, nbytes: int) -> dict[str, float]:
    server, client = cluster.hosts[1], cluster.hosts[0]
    before = cluster.snapshot()
    busy0, soft0, total0 = machine_busy()
    server_cpu0 = cpu_ticks(server_pid)
    proc = cluster.python(client, ["-m", "tenplex.testing.bulkhttp", "fetch", f"{server.url(PORT)}/bytes/{nbytes}"],
                          stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.wait()
    busy1, soft1, total1 = machine_busy()
    delta = cluster.snapshot() - before
    if proc.returncode != 0:
        raise RuntimeError(f"fetch failed ({proc.returncode}): {out}")
    result = json.loads(out)
    tick = os.sysconf("SC_CLK_TCK")
    got = delta[client.name]
    ncpu = os.cpu_count() or 1
    return {
        "seconds": result["seconds"],
        "goodput_mbit_s": result["mbit_s"],
        "wire_overhead_pct": (got.rx_bytes - nbytes) / nbytes * 100,
        "iface_overhead_pct": (got.iface_rx_bytes - nbytes) / nbytes * 100,
        "port_counted_pct": (got.ports[PORT].rx_from_port - nbytes) / nbytes * 100,
        "rx_dropped": got.rx_dropped + delta[server.name].tx_dropped,
        "scheduler_bytes": delta["scheduler"].rx_bytes + delta["scheduler"].tx_bytes,
        "server_cpu_s_per_gb": (cpu_ticks(server_pid) - server_cpu0) / tick / (nbytes / 1e9),
        "client_cpu_s_per_gb": result["cpu_s"] / (nbytes / 1e9),
        "machine_cores_busy": (busy1 - busy0) / (total1 - total0) * ncpu,
        "softirq_cores": (soft1 - soft0) / (total1 - total0) * ncpu,
    }


def run_case(rate: str | None, mtu: int, nbytes: int, repeats: int) -> dict[str, object]:
    with NetCluster(2, rate=rate, mtu=mtu, count_ports=(PORT,), delay_ms=0) as cluster:
        server = cluster.python(cluster.hosts[1], ["-m", "tenplex.testing.bulkhttp", "serve", "--host",
                                                   cluster.hosts[1].address, "--port", str(PORT)],
                                stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("bulkhttp server did not start")
        transfer(cluster, server.pid, 1 << 20)  # warm up: ARP, imports
        runs = [transfer(cluster, server.pid, nbytes) for _ in range(repeats)]
    summary: dict[str, object] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    summary["goodput_runs_mbit_s"] = [round(r["goodput_mbit_s"], 1) for r in runs]
    if rate is not None:
        summary["goodput_over_rate"] = float(summary["goodput_mbit_s"]) * 1e6 / parse_rate(rate)  # type: ignore[arg-type]
    return summary


def start_servers(cluster: NetCluster, nodes: list[EmuNode]) -> None:
    for node in nodes:
        server = cluster.python(node, ["-m", "tenplex.testing.bulkhttp", "serve", "--host", node.address, "--port", str(PORT)],
                                stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("bulkhttp server did not start")


def fetch_all(cluster: NetCluster, flows: list[tuple[str, str]], nbytes: int) -> tuple[float, list[float]]:
    """Start every (client, server) fetch at once; wall seconds until the last ends, and each flow's Mbit/s."""
    t = time.perf_counter()
    procs = [cluster.python(client, ["-m", "tenplex.testing.bulkhttp", "fetch",
                                     f"{cluster.node(server).url(PORT)}/bytes/{nbytes}"],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT) for client, server in flows]
    outs = [p.communicate()[0] for p in procs]
    wall = time.perf_counter() - t
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a fetch failed: {outs}")
    return wall, [json.loads(o)["mbit_s"] for o in outs]


def concurrent_case(kind: str, n: int, nbytes: int) -> dict[str, object]:
    """``pairs``: n disjoint client/server pairs at once; ``incast``: n servers into one client."""
    hosts = 2 * n if kind == "pairs" else n + 1
    with NetCluster(hosts, rate="1gbit", count_ports=(PORT,), delay_ms=0) as cluster:
        if kind == "pairs":
            flows = [(f"host-{i}", f"host-{n + i}") for i in range(n)]
        else:
            flows = [("host-0", f"host-{i + 1}") for i in range(n)]
        start_servers(cluster, [cluster.node(s) for _, s in flows])
        fetch_all(cluster, flows, 1 << 20)  # warm up: ARP, imports
        before = cluster.snapshot()
        wall, rates = fetch_all(cluster, flows, nbytes)
        delta = cluster.snapshot() - before
    clients = sorted({c for c, _ in flows})
    servers = sorted({s for _, s in flows})
    payload = n * nbytes
    return {
        "kind": kind, "flows": n, "wall_s": wall, "aggregate_gbit_s": payload * 8 / wall / 1e9,
        "flow_mbit_s": [round(r) for r in rates],
        "rx_overhead_pct": (delta.total("rx_bytes", clients) - payload) / payload * 100,
        "tx_overhead_pct": (delta.total("tx_bytes", servers) - payload) / payload * 100,
        "drops": delta.total("rx_dropped") + delta.total("tx_dropped"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=200, help="payload per transfer, MB (10^6 bytes)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pairs", type=int, nargs="*", default=[4, 8],
                        help="also: this many disjoint 1 Gbit/s client/server pairs at once")
    parser.add_argument("--incast", type=int, nargs="*", default=[4, 7],
                        help="also: this many 1 Gbit/s servers into one client at once")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    reason = netns_unavailable_reason()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    nbytes = args.mb * 10**6
    results = []
    print(f"{args.mb} MB per transfer, {args.repeats} repeats, load average {os.getloadavg()[0]:.1f}, "
          f"{os.cpu_count()} cores, kernel {os.uname().release}")
    header = ("rate", "mtu", "Mbit/s", "/rate", "wire ovh %", "iface ovh %", "port %", "drops",
              "srv cpu s/GB", "cli cpu s/GB", "cores busy", "softirq cores")
    print(" | ".join(header))
    for rate, mtu in CASES:
        s = run_case(rate, mtu, nbytes, args.repeats)
        results.append({"rate": rate or "unshaped", "mtu": mtu, **s})
        print(" | ".join([
            rate or "unshaped", str(mtu), f"{s['goodput_mbit_s']:.0f} {s['goodput_runs_mbit_s']}",
            f"{s['goodput_over_rate']:.3f}" if "goodput_over_rate" in s else "-",
            f"{s['wire_overhead_pct']:.2f}", f"{s['iface_overhead_pct']:.2f}", f"{s['port_counted_pct']:.2f}",
            f"{s['rx_dropped']:.0f}", f"{s['server_cpu_s_per_gb']:.2f}", f"{s['client_cpu_s_per_gb']:.2f}",
            f"{s['machine_cores_busy']:.2f}", f"{s['softirq_cores']:.3f}",
        ]), flush=True)
    print("concurrent flows at 1gbit, MTU 9000 (wall includes starting the fetch processes)")
    print("kind | flows | wall s | aggregate Gbit/s | per flow Mbit/s | rx ovh % | tx ovh % | drops")
    for kind, counts in (("pairs", args.pairs), ("incast", args.incast)):
        for n in counts:
            c = concurrent_case(kind, n, nbytes if kind == "pairs" else nbytes // n)
            results.append(c)
            print(f"{kind} | {n} | {c['wall_s']:.2f} | {c['aggregate_gbit_s']:.2f} | {c['flow_mbit_s']} | "
                  f"{c['rx_overhead_pct']:.2f} | {c['tx_overhead_pct']:.2f} | {c['drops']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
