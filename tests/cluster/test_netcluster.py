"""The multi-host emulation itself: topology, isolation, shaping, counters, partitions and teardown.

Real namespaces, real veths, real tc; a real HTTP transfer between two hosts
(``tenplex.testing.bulkhttp`` in each host's namespace). Tests that need root
skip with the probe's reason elsewhere; the argument checks and the import
boundary run everywhere.
"""

from __future__ import annotations

import ast
import http.client
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tenplex.errors import InvalidInput
from tenplex.testing import netcluster
from tenplex.testing.netcluster import (
    MARKER_DIR,
    EmuNode,
    NetCluster,
    NetClusterError,
    netem_unavailable_reason,
    parse_rate,
)

REPO = Path(__file__).resolve().parents[2]
PORT = 8900
MB = 10**6


def netns_names() -> set[str]:
    out = subprocess.run([netcluster._require_tool("ip"), "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def ip_json(*args: str) -> Any:
    out = subprocess.run([netcluster._require_tool("ip"), "-j", *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out) if out.strip() else []


def htb_ceilings(netns: str, dev: str) -> dict[str, str]:
    """Each HTB class on ``dev`` in ``netns`` and its ceiling (``tc class show``), e.g. ``{"1:1": "100Mbit"}``."""
    out = subprocess.run([netcluster._require_tool("tc"), "-n", netns, "class", "show", "dev", dev],
                         capture_output=True, text=True, check=True).stdout
    return {m[1]: m[2] for m in re.finditer(r"^class htb (\S+) .*? ceil (\S+)", out, re.MULTILINE)}


def serve(cluster: NetCluster, node: EmuNode) -> subprocess.Popen[str]:
    """The bulk HTTP server on ``node``'s address, ready."""
    proc = cluster.python(node, ["-m", "tenplex.testing.bulkhttp", "serve", "--host", node.address, "--port", str(PORT)],
                          stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def fetch(cluster: NetCluster, node: EmuNode, url: str) -> dict[str, float]:
    """Fetch ``url`` from a process in ``node``'s namespace: its JSON report."""
    done = cluster.run(node, [sys.executable, "-m", "tenplex.testing.bulkhttp", "fetch", url],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def get_length(host: str, path: str, timeout: float = 5.0) -> int:
    """GET http://host:PORT/path from the calling thread (run it through ``cluster.call``)."""
    conn = http.client.HTTPConnection(host, PORT, timeout=timeout)
    try:
        conn.request("GET", path)
        return len(conn.getresponse().read())
    finally:
        conn.close()


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


# ----------------------------------------------------------------------------- everywhere


def test_arguments_are_checked() -> None:
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("100Mbit") == 10**8
    assert parse_rate("2.5gbit") == 2_500_000_000
    assert parse_rate(5e8) == 500_000_000
    for bad in ("fast", "1gbps", "-1gbit", "1kbit", True):
        with pytest.raises(InvalidInput):
            parse_rate(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="outside 198.18.0.0/15"):
        NetCluster(2, subnet="10.0.0.0/24")
    with pytest.raises(InvalidInput, match="no room"):
        NetCluster(300, subnet="198.18.0.0/24")
    NetCluster(300, subnet="198.18.0.0/16")  # fits: nothing is built before start()
    with pytest.raises(InvalidInput):
        NetCluster(0)
    with pytest.raises(InvalidInput):
        NetCluster(2, mtu=100)
    with pytest.raises(InvalidInput):
        NetCluster(2, count_ports=(7070, 7070))
    with pytest.raises(InvalidInput):
        NetCluster(2, delay_ms=-1)
    with pytest.raises(InvalidInput, match="name"):
        NetCluster(2, name="mycluster")  # not our prefix: the sweep would never recognise it
    c = NetCluster(3, subnet="198.19.4.0/24")
    assert [n.name for n in c.nodes] == ["scheduler", "host-0", "host-1", "host-2"]
    assert [n.address for n in c.nodes] == ["198.19.4.1", "198.19.4.10", "198.19.4.11", "198.19.4.12"]
    assert c.node("host-2").url(7070) == "http://198.19.4.12:7070"
    assert len(set(c.namespaces)) == 5 and all(ns.startswith(c.name) for ns in c.namespaces)
    assert NetCluster(1).name != NetCluster(1).name
    with pytest.raises(InvalidInput, match="no node"):
        c.node("host-3")
    with pytest.raises(NetClusterError, match="not started"):
        c.counters()


def test_product_code_never_imports_the_test_machinery() -> None:
    offenders = []
    for path in (REPO / "tenplex").rglob("*.py"):
        if (REPO / "tenplex" / "testing") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n == "tenplex.testing" or n.startswith("tenplex.testing.")]
    assert offenders == []


# ----------------------------------------------------------------------------- in namespaces (root)


def test_topology_addresses_and_isolation(make_cluster: Callable[..., NetCluster]) -> None:
    root_links = {link["ifname"] for link in ip_json("link", "show")}
    root_routes = ip_json("route", "show")
    cluster = make_cluster(2, rate=None, delay_ms=0)
    assert set(cluster.namespaces) <= netns_names()

    for node in cluster.nodes:
        assert node.root.is_dir() and node.root.parent == cluster.hosts[0].root.parent
        addrs = {a["ifname"]: a for a in json.loads(cluster.run(node, [netcluster._require_tool("ip"), "-j", "addr", "show"], capture_output=True,
                                                                      text=True, check=True).stdout)}
        assert set(addrs) == {"lo", node.iface}
        assert "UP" in addrs["lo"]["flags"]
        inet = [(a["local"], a["prefixlen"]) for a in addrs[node.iface]["addr_info"] if a["family"] == "inet"]
        assert inet == [(node.address, 24)]
        assert not [a for a in addrs[node.iface]["addr_info"] if a["family"] == "inet6"]  # no IPv6 chatter
        routes = json.loads(cluster.run(node, [netcluster._require_tool("ip"), "-j", "route", "show"], capture_output=True, text=True, check=True).stdout)
        assert [r["dst"] for r in routes] == ["198.18.0.0/24"]  # no default route: nothing leaves the bridge

    # the root namespace is untouched: same interfaces and routes, no benchmarking-range address
    assert {link["ifname"] for link in ip_json("link", "show")} == root_links
    assert ip_json("route", "show") == root_routes
    root_addrs = [a["local"] for link in ip_json("addr", "show") for a in link.get("addr_info", [])]
    assert not [a for a in root_addrs if a.startswith(("198.18.", "198.19."))]

    # a host serves on its own address; the other host (a process) and the scheduler (a thread) reach it
    serve(cluster, cluster.hosts[1])
    assert fetch(cluster, cluster.hosts[0], f"{cluster.hosts[1].url(PORT)}/bytes/123456")["bytes"] == 123456
    assert cluster.call("scheduler", get_length, cluster.hosts[1].address, "/bytes/1000") == 1000

    def loopback_and_own_address() -> tuple[bytes, str]:
        with socket.create_server(("127.0.0.1", 0)) as srv, socket.create_connection(srv.getsockname()) as c:
            conn, _ = srv.accept()
            c.sendall(b"lo works")
            got = conn.recv(16)
            conn.close()
        with socket.create_server((cluster.hosts[0].address, 0)) as own:
            return got, own.getsockname()[0]

    assert cluster.call(cluster.hosts[0], loopback_and_own_address) == (b"lo works", cluster.hosts[0].address)

    def in_a_thread_started_there() -> str:  # threads inherit the namespace: in-process servers work
        out: list[str] = []
        t = threading.Thread(target=lambda: out.append(loopback_and_own_address()[1]))
        t.start()
        t.join()
        return out[0]

    assert cluster.call(cluster.hosts[0], in_a_thread_started_there) == cluster.hosts[0].address
    with pytest.raises(OSError):  # the test process's own namespace does not have the address
        socket.create_server((cluster.hosts[0].address, 0)).close()


@pytest.mark.slow
def test_http_transfer_is_shaped_and_counted(make_cluster: Callable[..., NetCluster]) -> None:
    rate, payload = 100 * 10**6, 20 * MB
    cluster = make_cluster(2, rate="100mbit", mtu=9000, count_ports=(PORT,))
    client, server = cluster.hosts
    serve(cluster, server)
    fetch(cluster, client, f"{server.url(PORT)}/bytes/1000")  # ARP and connection set-up out of the way
    before = cluster.snapshot()
    result = fetch(cluster, client, f"{server.url(PORT)}/bytes/{payload}")
    delta = cluster.snapshot() - before
    assert result["bytes"] == payload

    got, sent, sched = delta[client.name], delta[server.name], delta["scheduler"]
    # wire bytes: payload plus one Ethernet/IP/TCP header set per ~8.9 kB segment (0.74%), within 3%
    for counted in (got.rx_bytes, sent.tx_bytes, got.ports[PORT].rx_from_port, sent.ports[PORT].tx_from_port):
        assert payload <= counted <= payload * 1.03
    assert got.rx_bytes >= payload * 1.005, "per-segment headers are counted"
    assert payload <= got.iface_rx_bytes <= got.rx_bytes  # GRO super-packets: fewer headers
    # the request and the ACKs go to the server's port and are small
    assert 0 < got.ports[PORT].tx_to_port == sent.ports[PORT].rx_to_port < payload * 0.01
    assert got.tx_bytes < payload * 0.01 and sent.rx_bytes < payload * 0.01
    assert sched.rx_bytes + sched.tx_bytes < 10_000  # a few ARP frames at most
    assert delta.seconds > 0

    # the shaped rate holds: no faster than the link (plus one burst; load can only make it slower) ...
    wire_seconds = got.rx_bytes * 8 / rate
    assert result["seconds"] >= wire_seconds * 0.9
    # ... and nothing else slows it: every class on both shaping points (the server's egress, the client's
    # switch port) may use the whole link (ceil = the rate); a leaf capped at its share would not.
    for netns, dev in ((server.netns, server.iface), (cluster.switch_netns, client.switch_port)):
        ceilings = htb_ceilings(netns, dev)
        assert len(ceilings) == 4 and set(ceilings.values()) == {"100Mbit"}, (dev, ceilings)  # link, default, 2 port


def test_delay_is_applied_only_where_netem_exists(make_cluster: Callable[..., NetCluster], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tenplex.testing.netcluster"):
        cluster = make_cluster(2, rate=None, delay_ms=5)
    reason = netem_unavailable_reason()
    assert cluster.delay_applied is (reason is None)
    assert cluster.delay_unavailable_reason == reason
    if reason is not None:
        assert "netem" in reason
        assert any("NOT delayed" in r.getMessage() for r in caplog.records)
        assert not cluster.delay_applied
        return
    # netem exists: a TCP handshake crosses four delayed link directions
    serve(cluster, cluster.hosts[1])

    def connect_seconds() -> float:
        t = time.perf_counter()
        socket.create_connection((cluster.hosts[1].address, PORT), timeout=5).close()
        return time.perf_counter() - t

    assert min(cluster.call("host-0", connect_seconds) for _ in range(5)) >= 4 * 0.005 * 0.9


def test_a_link_taken_down_partitions_its_host(make_cluster: Callable[..., NetCluster]) -> None:
    cluster = make_cluster(2, rate=None, delay_ms=0)
    h0, h1 = cluster.hosts
    serve(cluster, h1)
    serve(cluster, h0)
    assert cluster.call(h0, get_length, h1.address, "/bytes/10") == 10
    cluster.set_link(h1, up=False)
    assert not cluster.link_is_up(h1)
    with pytest.raises(OSError):  # timeout or EHOSTUNREACH: a pulled cable, not a refusal
        cluster.call(h0, get_length, h1.address, "/bytes/10", 1.0)
    with pytest.raises(OSError):
        cluster.call(h1, get_length, h0.address, "/bytes/10", 1.0)
    assert cluster.call("scheduler", get_length, h0.address, "/bytes/10") == 10  # the rest of the cluster is fine
    cluster.set_link(h1, up=True)
    assert cluster.link_is_up(h1)

    def reachable() -> bool:
        try:
            return cluster.call(h0, get_length, h1.address, "/bytes/10", 1.0) == 10
        except OSError:
            return False

    assert wait_for(reachable, 10)


def test_close_kills_processes_and_removes_everything(netns_available: None) -> None:
    cluster = NetCluster(2, rate="1gbit", delay_ms=0).start()
    root = cluster.hosts[0].root.parent
    tracked = cluster.popen(cluster.hosts[0], ["sleep", "600"])
    # a process started by other code with the prefix: not tracked, still in a namespace of the cluster
    untracked = subprocess.Popen([*cluster.exec_prefix("host-1"), "sleep", "600"])
    assert wait_for(lambda: untracked.pid in netcluster._pids_in_netns(cluster.namespaces), 5)
    assert (MARKER_DIR / f"{cluster.name}.json").exists() and root.is_dir()

    cluster.close()
    assert tracked.poll() == -signal.SIGTERM  # ended by the SIGTERM, not by a SIGKILL after a grace period
    assert untracked.wait(5) == -signal.SIGTERM
    assert not set(cluster.namespaces) & netns_names()
    assert not (MARKER_DIR / f"{cluster.name}.json").exists()
    assert not root.exists()
    cluster.close()  # idempotent
    with pytest.raises(NetClusterError, match="closed"):
        cluster.start()
    with pytest.raises(NetClusterError, match="closed"):
        cluster.popen("host-0", ["true"])


def test_an_exception_in_the_with_block_tears_down(netns_available: None) -> None:
    with pytest.raises(RuntimeError, match="boom"), NetCluster(1, rate=None, delay_ms=0) as cluster:
        names = cluster.namespaces
        assert set(names) <= netns_names()
        raise RuntimeError("boom")
    assert not set(names) & netns_names()


CHILD = """
import json, sys, time
from tenplex.testing.netcluster import NetCluster
c = NetCluster(1, rate=None, delay_ms=0).start()
p = c.popen(c.hosts[0], ["sleep", "600"])
print(json.dumps({"name": c.name, "namespaces": c.namespaces, "sleeper": p.pid, "root": str(c.hosts[0].root.parent)}), flush=True)
time.sleep(600)
"""


def start_child() -> tuple[subprocess.Popen[str], dict[str, Any]]:
    # SIGINT back to its default (a worker of pytest-xdist may ignore it, and the child would inherit that)
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the child did not build its cluster (exit {proc.wait()})"
    return proc, json.loads(line)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_owner_tears_down(netns_available: None, sig: signal.Signals) -> None:
    proc, info = start_child()
    assert set(info["namespaces"]) <= netns_names()
    proc.send_signal(sig)
    assert proc.wait(30) == -sig  # handled, then the signal's own action
    assert not set(info["namespaces"]) & netns_names()
    assert not (MARKER_DIR / f"{info['name']}.json").exists()
    assert not Path(info["root"]).exists()
    assert wait_for(lambda: gone(info["sleeper"]), 5)


SLOW_CLOSE = """
import json, sys
from tenplex.testing.netcluster import NetCluster
c = NetCluster(1, rate=None, delay_ms=0, kill_grace_s=2).start()
stubborn = c.python(c.hosts[0], ["-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                       "print('ready', flush=True); time.sleep(600)"], stdout=-1, text=True)
stubborn.stdout.readline()
print(json.dumps({"name": c.name, "namespaces": c.namespaces}), flush=True)
c.close()
print("closed", flush=True)
"""


@pytest.mark.slow
def test_a_signal_during_close_waits_for_the_teardown(netns_available: None) -> None:
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CLOSE], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    time.sleep(0.5)  # inside close(), waiting out the process that ignores SIGTERM
    proc.send_signal(signal.SIGINT)
    rest = proc.stdout.read()
    assert proc.wait(30) == -signal.SIGINT and "closed" not in rest  # interrupted right after the teardown
    assert not set(info["namespaces"]) & netns_names()
    assert not (MARKER_DIR / f"{info['name']}.json").exists()


@pytest.mark.slow
def test_a_killed_owners_namespaces_are_swept_by_the_next_start(make_cluster: Callable[..., NetCluster]) -> None:
    bystander = make_cluster(1, rate=None, delay_ms=0)  # a live cluster of a live process: never swept
    proc, info = start_child()
    proc.kill()
    proc.wait(10)
    assert set(info["namespaces"]) <= netns_names(), "SIGKILL leaves the namespaces behind"
    assert not gone(info["sleeper"])

    cluster = make_cluster(1, rate=None, delay_ms=0)
    assert not set(info["namespaces"]) & netns_names()
    assert not (MARKER_DIR / f"{info['name']}.json").exists()
    assert not Path(info["root"]).exists()
    assert wait_for(lambda: gone(info["sleeper"]), 60)
    assert set(bystander.namespaces) | set(cluster.namespaces) <= netns_names()
    assert netcluster.sweep_stale() == []  # nothing left to sweep
