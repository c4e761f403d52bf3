"""A multi-host cluster emulated on one Linux machine: network namespaces, veth links, a bridge, tc.

Why: every Tenplex component can run on one machine, but then every "host"
shares one network stack and nothing can tell which component carried which
bytes. Here each emulated host, and the scheduler, is a network namespace with
one link into a switch, every link is rate-limited like a NIC, and every link
counts its bytes. A test can then assert from the counters what crossed which
link (the scheduler carried no tensor state; each host received its plan's
remote bytes), and a benchmark can measure a reconfiguration against the link
rate.

Topology (names for a cluster called ``tpxab3-0`` with two hosts)::

    netns tpxab3-0-sched        netns tpxab3-0-h0            netns tpxab3-0-h1
    +------------------+        +------------------+         +------------------+
    | lo  127.0.0.1    |        | lo  127.0.0.1    |         | lo  127.0.0.1    |
    | eth0 198.18.0.1  |        | eth0 198.18.0.10 |         | eth0 198.18.0.11 |
    +--[HTB egress]----+        +--[HTB egress]----+         +--[HTB egress]----+
             | veth                      | veth                       | veth
    +--[HTB egress]------------[HTB egress]------------------[HTB egress]--+
    |  port "scheduler"         port "host-0"              port "host-1"   |
    |                        bridge br0 (no address)                       |
    +-------------------------- netns tpxab3-0-sw --------------------------+

- Addressing: ``subnet`` (default 198.18.0.0/24) must lie in 198.18.0.0/15, the
  range reserved for benchmarking networks (RFC 2544). The scheduler gets the
  first address (.1), host i gets .10+i. The addresses exist only on
  interfaces inside namespaces this module creates; no namespace has a default
  route and the bridge has no address and no link to the root namespace, so
  nothing is routed off the machine and the root namespace's interfaces, routes
  and firewall are never touched. IPv6 address generation is off on every link,
  so the counters see only the traffic that the test makes, plus ARP and the
  bridge's own IGMP/MLD reports when it comes up (a few hundred bytes).
- Processes: :meth:`NetCluster.popen` / :meth:`NetCluster.run` start a command
  inside a node's namespace (``ip netns exec``) with this process's environment;
  :meth:`NetCluster.python` does so with this interpreter (``sys.executable``),
  so the venv carries over. :meth:`NetCluster.call` runs a Python callable in a
  thread that has entered the node's namespace (``setns``), so the test process
  itself can talk to servers inside the cluster (a REST call "from the
  scheduler") without a subprocess; threads started there inherit the
  namespace, and :func:`enter_netns` moves a thread of your own (an in-process
  server). The test process's own namespace has no route to the cluster's
  addresses: it reaches the nodes only these ways. Each node also gets its own
  directory (:attr:`EmuNode.root`) for its store.
- Shaping: every link is shaped in both directions, like a full-duplex NIC
  port: HTB on the egress of the node's ``eth0`` (inside its namespace) limits
  what the node sends, HTB on the egress of the switch port toward the node
  limits what it receives. So each node sends at most ``rate`` and receives at
  most ``rate`` at the same time, and several senders into one receiver queue
  at the receiver's switch port, as on a real switch. The burst is 2 ms of the
  rate (at least two 64 KiB TSO segments). Each queue holds ``queue_ms``
  (default 50 ms, 6.25 MB at 1 Gbit/s) of the rate, at least 512 KiB; a full
  queue drops, and TCP's retransmissions then count again on the sender's link
  (7 senders into one 1 Gbit/s receiver: no drops with 50 ms, 5-7% extra sent
  bytes with 20 ms). ``rate=None`` leaves the links unshaped: HTB is still
  installed at 100 Gbit/s, far above what one machine forwards, so the
  counters work the same way.
- Latency: ``delay_ms`` is added with netem on each direction of every link
  (so a packet between two nodes crosses two links: node-to-node one-way
  latency is 2 x delay_ms, the round trip 4 x delay_ms). netem is a kernel
  module (``sch_netem``) that some kernels lack: the Firecracker kernel 6.18 of
  the development VM has HTB, TBF, ingress/clsact, u32, bpf, mirred and IFB
  built in but no netem, fq or prio. Where netem is missing, the links are
  NOT delayed: :attr:`NetCluster.delay_applied` is False,
  :attr:`NetCluster.delay_unavailable_reason` says why, and a warning is
  logged. Bandwidth-bound measurements are unaffected; latency-bound ones are
  optimistic.
- Counters (:meth:`NetCluster.counters`): per node, the bytes and packets of
  its link as they would cross a wire: the node's sends are read from the HTB
  qdisc on its ``eth0``, its receives from the HTB qdisc on its switch port.
  The kernel counts a TSO/GSO super-packet there as the segments it stands
  for, each with its own Ethernet/IP/TCP headers (``qdisc_pkt_len``), so
  ``rx_bytes`` is payload plus real per-segment header overhead (no preamble,
  FCS or inter-frame gap). The interface counters (``iface_*``, from
  ``ip -s link``) are reported too; on veth they count GSO/GRO super-packets,
  i.e. one header per up to 64 KiB, and so under-state the overhead. Per TCP
  port in ``count_ports``, u32 filters put the packets into HTB classes of
  their own whose queues count: bytes the node received from / sent from that
  source port (a server on that port answering, e.g. a store daemon's range
  reads) and bytes received / sent to that destination port (requests and
  uploads to such a server). A packet whose source and destination ports are
  both counted is counted under its source port only.
- Why jumbo frames (``mtu=9000``, the default): the tests assert that a host
  received its payload within 3% (protocol overhead). With MTU 1500 each
  1448-byte TCP segment (timestamps on) carries 66 bytes of Ethernet, IP and
  TCP headers, about 4.6% on top of the payload, before ACKs and
  retransmissions; with MTU 9000 the same headers cost 0.74%. Data-centre
  clusters that move training state run jumbo frames for the same reason.
- Teardown is guaranteed: :meth:`NetCluster.close` (also on leaving the
  ``with`` block, on an exception inside it, at interpreter exit via
  ``atexit``, and on SIGINT/SIGTERM/SIGHUP through handlers that chain to the
  previous ones) kills every process in the cluster's namespaces and deletes
  the namespaces (which deletes their veths and the bridge). A process killed
  with SIGKILL cannot clean up: before creating anything, each cluster writes a
  marker ``/run/tenplex-netcluster/<name>.json`` with its owner's pid and
  process start time, and every start (and :func:`sweep_stale`) deletes the
  namespaces, processes and temporary directories of markers whose owner is
  dead. Namespaces without such a marker are never touched.
- Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for ``ip netns``), iproute2's
  ``ip`` and ``tc``, veth, bridge and HTB in the kernel.
  :func:`netns_unavailable_reason` probes all of it once and says what is
  missing, for ``pytest.skip``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import functools
import ipaddress
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tenplex.errors import InvalidInput, TenplexError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: RFC 2544's range for benchmarking networks; the only addresses the harness uses.
BENCHMARK_NET = ipaddress.IPv4Network("198.18.0.0/15")
#: Every cluster name starts with it (the default names also carry the creator's pid).
NAME_PREFIX = "tpx"
#: One marker file per cluster: which process created which namespaces.
MARKER_DIR = Path("/run/tenplex-netcluster")
#: Where ``ip netns`` keeps its namespaces (iproute2's NETNS_RUN_DIR).
NETNS_DIR = Path("/run/netns")
#: The interface of every node inside its namespace.
NODE_IFACE = "eth0"
#: The bridge inside the switch namespace.
BRIDGE = "br0"
#: Rate of the HTB classes when a cluster is unshaped (``rate=None``): only there to count.
UNSHAPED_RATE_BPS = 100 * 10**9
#: Address offsets inside the subnet: the scheduler, then the hosts.
SCHEDULER_OFFSET = 1
FIRST_HOST_OFFSET = 10

_CLONE_NEWNET = 0x40000000
_SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/local/bin", "/usr/bin", "/bin")
_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,23}$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_MAX_PORTS = 64
# HTB class minors: 1 is the link, 2 the default leaf, then two leaves per counted port.
_LINK_MINOR = 0x1
_DEFAULT_MINOR = 0x2
_PORT_MINOR_BASE = 0x100
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class NetClusterError(TenplexError):
    """The emulated cluster could not be built, used or torn down (a command failed, a name is taken)."""

    code = "netcluster_error"


# ----------------------------------------------------------------------------- values


def parse_rate(rate: str | int | float) -> int:
    """Bits per second from ``"1gbit"``, ``"100mbit"``, ``"2.5gbit"`` (tc's SI units) or a number of bit/s."""
    if isinstance(rate, bool):
        raise InvalidInput(f"rate: expected a rate like '1gbit' or bits per second, got {rate!r}")
    if isinstance(rate, int | float):
        bps = float(rate)
    else:
        m = _RATE_RE.match(str(rate))
        if not m:
            raise InvalidInput(f"rate: expected a number with a unit bit, kbit, mbit, gbit or tbit (like '1gbit'), got {rate!r}")
        bps = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    if not math.isfinite(bps) or bps < 8000:
        raise InvalidInput(f"rate: must be at least 8kbit, got {rate!r}")
    return int(bps)


@dataclass(frozen=True)
class EmuNode:
    """One emulated machine: the scheduler or a host."""

    name: str  #: "scheduler", "host-0", "host-1", ...
    netns: str  #: its network namespace (``ip netns`` name)
    address: str  #: its IPv4 address on :attr:`iface`
    iface: str  #: its link's interface inside :attr:`netns`
    switch_port: str  #: the other end of its link, a bridge port in the switch namespace
    root: Path  #: a directory of its own (for its store root, logs, ...); made by ``start()``

    def url(self, port: int, scheme: str = "http") -> str:
        """``http://<address>:<port>``: how the other nodes reach a server this node runs on ``port``."""
        return f"{scheme}://{self.address}:{port}"


@dataclass(frozen=True)
class PortCounters:
    """Wire bytes of one node's link in TCP packets with one counted port (see the module docstring)."""

    rx_from_port: int = 0  #: received by the node, source port = the port (answers of a server on it)
    tx_from_port: int = 0  #: sent by the node, source port = the port (the node serves on it)
    rx_to_port: int = 0  #: received by the node, destination port = the port (requests/uploads to its server)
    tx_to_port: int = 0  #: sent by the node, destination port = the port (requests/uploads to a server on it)

    def __sub__(self, other: PortCounters) -> PortCounters:
        return PortCounters(*(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)))


@dataclass(frozen=True)
class LinkCounters:
    """Counters of one node's link, as seen from the node (rx = toward the node).

    ``rx_bytes``/``tx_bytes`` are wire bytes (Ethernet header included, one set of
    headers per TCP segment); ``*_dropped`` are packets the shaping queues dropped
    (retransmitted later by TCP, which the byte counters then count again);
    ``iface_*`` are the veth interface counters, which count GSO/GRO super-packets.
    """

    rx_bytes: int
    tx_bytes: int
    rx_packets: int
    tx_packets: int
    rx_dropped: int
    tx_dropped: int
    iface_rx_bytes: int
    iface_tx_bytes: int
    iface_rx_packets: int
    iface_tx_packets: int
    ports: Mapping[int, PortCounters] = field(default_factory=dict)

    def __sub__(self, other: LinkCounters) -> LinkCounters:
        values = {f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self) if f.name != "ports"}
        ports = {p: c - other.ports.get(p, PortCounters()) for p, c in self.ports.items()}
        return LinkCounters(**values, ports=ports)


@dataclass(frozen=True)
class CounterDelta:
    """What every link carried between two snapshots, and how long that took."""

    seconds: float
    links: Mapping[str, LinkCounters]

    def __getitem__(self, node: str) -> LinkCounters:
        return self.links[node]

    def total(self, counter: str, nodes: Sequence[str] | None = None) -> int:
        """The sum of one counter (``"rx_bytes"``, ...) over ``nodes`` (default: every node)."""
        names = self.links.keys() if nodes is None else nodes
        return sum(getattr(self.links[n], counter) for n in names)


@dataclass(frozen=True)
class CounterSnapshot:
    """The counters of every link at one moment (``taken_at`` is ``time.monotonic()``)."""

    taken_at: float
    links: Mapping[str, LinkCounters]

    def __getitem__(self, node: str) -> LinkCounters:
        return self.links[node]

    def __sub__(self, earlier: CounterSnapshot) -> CounterDelta:
        missing = set(self.links) ^ set(earlier.links)
        if missing:
            raise InvalidInput(f"snapshots of different clusters: nodes {sorted(missing)} are in only one of them")
        return CounterDelta(self.taken_at - earlier.taken_at, {n: c - earlier.links[n] for n, c in self.links.items()})


# ----------------------------------------------------------------------------- commands


def _tool(name: str) -> str | None:
    """An iproute2 binary: on PATH, else in the sbin directories a non-login PATH often lacks."""
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(_SBIN))


def _require_tool(name: str) -> str:
    path = _tool(name)
    if path is None:
        raise NetClusterError(f"`{name}` not found (install iproute2)")
    return path


def _cmd(argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one iproute2 command; a failure is a :class:`NetClusterError` with its stderr."""
    try:
        done = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetClusterError(f"{' '.join(argv)}: {exc}") from exc
    if check and done.returncode != 0:
        detail = (done.stderr or done.stdout).strip()
        where = f"\n{stdin.strip()}" if stdin else ""
        raise NetClusterError(f"{' '.join(argv)} failed (exit {done.returncode}): {detail}{where}")
    return done


def _batch(tool: str, netns: str | None, lines: Sequence[str]) -> None:
    """Several ``ip``/``tc`` commands in one process (``-batch -``), inside ``netns`` when given."""
    if not lines:
        return
    argv = [_require_tool(tool)]
    if netns is not None:
        argv += ["-n", netns]
    _cmd([*argv, "-batch", "-"], stdin="\n".join(lines) + "\n")


def _json(argv: Sequence[str]) -> Any:
    out = _cmd(argv).stdout.strip()
    try:
        return json.loads(out) if out else []
    except json.JSONDecodeError as exc:
        raise NetClusterError(f"{' '.join(argv)}: expected JSON, got {out[:200]!r}") from exc


def _existing_netns() -> set[str]:
    try:
        return {p.name for p in NETNS_DIR.iterdir()}
    except FileNotFoundError:
        return set()


def _delete_netns(names: Sequence[str]) -> None:
    present = [n for n in names if n in _existing_netns()]
    if present:
        # -force: go on after a namespace that vanished meanwhile (another sweeper got it first)
        _cmd([_require_tool("ip"), "-force", "-batch", "-"], stdin="".join(f"netns del {n}\n" for n in present), check=False)
    left = [n for n in present if n in _existing_netns()]
    if left:
        raise NetClusterError(f"could not delete network namespaces {left}")


def _pids_in_netns(names: Sequence[str]) -> list[int]:
    """Live processes inside any of the namespaces (what ``ip netns pids`` finds), never this one."""
    wanted: set[tuple[int, int]] = set()
    for n in names:
        with contextlib.suppress(OSError):
            st = os.stat(NETNS_DIR / n)
            wanted.add((st.st_dev, st.st_ino))
    if not wanted:
        return []
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:  # gone, or a zombie
            continue
        if (st.st_dev, st.st_ino) in wanted:
            found.append(int(entry))
    return found


def _kill_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def enter_netns(netns: str) -> None:
    """Move the calling thread (only it) into the namespace ``netns``, for good.

    Sockets the thread makes afterwards live in that namespace, and threads it
    starts inherit it. Call it first thing in a thread of your own to run a
    long-lived in-process server inside a node (``NetCluster.call`` covers short
    work). Never call it on the main thread.
    """
    if threading.current_thread() is threading.main_thread():
        raise NetClusterError("enter_netns() on the main thread would move the whole test process's sockets; use a thread")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({netns}): {os.strerror(err)}")
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- ownership markers


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _owner_alive(pid: int, start: int | None) -> bool:
    now = _start_time(pid)
    return now is not None and (start is None or now == start)


def _marker_path(name: str) -> Path:
    return MARKER_DIR / f"{name}.json"


def _write_marker(name: str, namespaces: Sequence[str], tmp_root: Path | None) -> None:
    MARKER_DIR.mkdir(parents=True, exist_ok=True)
    record = {
        "pid": os.getpid(),
        "start_time": _start_time(os.getpid()),
        "namespaces": list(namespaces),
        "tmp_root": str(tmp_root) if tmp_root else None,
        "created": time.time(),
    }
    path = _marker_path(name)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None


def sweep_stale() -> list[str]:
    """Delete what clusters of dead processes left behind; return the namespaces deleted.

    Only namespaces listed in a marker under :data:`MARKER_DIR` whose owner (pid
    and process start time) is gone are touched: their processes are killed, the
    namespaces deleted, the owner's temporary node directories removed.
    """
    if not MARKER_DIR.is_dir():
        return []
    swept: list[str] = []
    for path in sorted(MARKER_DIR.glob("*.json")):
        record = _read_marker(path)
        if record is None:
            # a marker being written right now, or a torn one: judge it by its age
            with contextlib.suppress(OSError):
                if time.time() - path.stat().st_mtime > 60:
                    log.warning("netcluster: removing unreadable marker %s", path)
                    path.unlink()
            continue
        if _owner_alive(record["pid"], record.get("start_time")):
            continue
        names = [str(n) for n in record.get("namespaces", []) if str(n).startswith(NAME_PREFIX)]
        _kill_all(_pids_in_netns(names), signal.SIGKILL)
        present = [n for n in names if n in _existing_netns()]
        _delete_netns(present)
        tmp_root = record.get("tmp_root")
        if tmp_root and Path(tmp_root).name.startswith(NAME_PREFIX):
            shutil.rmtree(tmp_root, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        if present:
            log.warning("netcluster: swept %d namespaces of dead process %d: %s", len(present), record["pid"], present)
        swept.extend(present)
    return swept


# ----------------------------------------------------------------------------- availability probe


@dataclass(frozen=True)
class _Probe:
    reason: str | None
    netem_reason: str | None


@functools.cache
def _probe() -> _Probe:
    if not sys.platform.startswith("linux"):
        return _Probe(f"network namespaces need Linux (this is {sys.platform})", "not Linux")
    if os.geteuid() != 0:
        return _Probe(f"network namespaces need root (euid {os.geteuid()})", "not root")
    for tool in ("ip", "tc"):
        if _tool(tool) is None:
            return _Probe(f"`{tool}` not found (Debian package iproute2)", f"no {tool}")
    try:
        MARKER_DIR.mkdir(parents=True, exist_ok=True)
        sweep_stale()
    except (OSError, NetClusterError) as exc:
        return _Probe(f"cannot keep markers in {MARKER_DIR}: {exc}", "no markers")
    ns = f"{NAME_PREFIX}{_base36(os.getpid())}-probe"
    steps = [
        ("creating a network namespace", [["ip", "netns", "add", ns]]),
        ("creating a bridge", [["ip", "-n", ns, "link", "add", BRIDGE, "type", "bridge"]]),
        ("creating a veth pair", [["ip", "-n", ns, "link", "add", "veth0", "type", "veth", "peer", "name", "veth1"],
                                  ["ip", "-n", ns, "link", "set", "veth1", "master", BRIDGE]]),
        ("adding an HTB qdisc", [["tc", "-n", ns, "qdisc", "add", "dev", "veth0", "root", "handle", "1:", "htb", "default", "2"],
                                 ["tc", "-n", ns, "class", "add", "dev", "veth0", "parent", "1:", "classid", "1:1", "htb", "rate", "1gbit"],
                                 ["tc", "-n", ns, "qdisc", "add", "dev", "veth0", "parent", "1:1", "handle", "2:", "bfifo", "limit", "100000"]]),
        ("adding a u32 filter", [["tc", "-n", ns, "filter", "add", "dev", "veth0", "parent", "1:", "protocol", "ip", "prio", "1",
                                  "u32", "match", "ip", "sport", "80", "0xffff", "flowid", "1:1"]]),
    ]
    try:
        _write_marker(ns, [ns], None)
    except OSError as exc:
        return _Probe(f"cannot write {_marker_path(ns)}: {exc}", "no markers")
    reason: str | None = None
    netem_reason: str | None = None
    try:
        for what, commands in steps:
            for argv in commands:
                done = _cmd([_require_tool(argv[0]), *argv[1:]], check=False)
                if done.returncode != 0:
                    reason = f"{what} failed: {' '.join(argv)}: {done.stderr.strip()}"
                    break
            if reason:
                break
        if reason is None:
            done = _cmd([_require_tool("tc"), "-n", ns, "qdisc", "add", "dev", "veth1", "root", "netem", "delay", "1ms"], check=False)
            if done.returncode != 0:
                netem_reason = f"netem is not available on this kernel ({os.uname().release}): {done.stderr.strip()}"
    finally:
        try:
            _delete_netns([ns])
        finally:
            with contextlib.suppress(FileNotFoundError):
                _marker_path(ns).unlink()
    return _Probe(reason, netem_reason if reason is None else reason)


def netns_unavailable_reason() -> str | None:
    """Why an emulated cluster cannot be built here (for ``pytest.skip``), or None when it can.

    Probes once per process: Linux, root, ``ip`` and ``tc``, a marker directory,
    and a throw-away namespace with a bridge, a veth pair, an HTB qdisc and a u32
    filter. netem is probed too, but its absence only disables the delay.
    """
    return _probe().reason


def netem_unavailable_reason() -> str | None:
    """Why links cannot be delayed here (no netem), or None when they can."""
    return _probe().netem_reason


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


# ----------------------------------------------------------------------------- teardown on exit and signals

_live: dict[int, NetCluster] = {}
_live_lock = threading.RLock()
_prev_handlers: dict[int, Any] = {}
_hooks_installed = False
_counter = 0
_busy = 0  # start()/close() calls in progress on the main thread
_pending: list[tuple[int, Any]] = []  # signals that arrived meanwhile


def _close_all() -> None:
    with _live_lock:
        clusters = list(_live.values())
    for cluster in clusters:
        if cluster._owner_pid == os.getpid():  # not in a forked child: the parent owns them
            try:
                cluster.close()
            except Exception:
                log.exception("netcluster %s: teardown failed", cluster.name)


def _on_signal(signum: int, frame: Any) -> None:
    if _busy:
        _pending.append((signum, frame))
        return
    _close_all()
    prev = _prev_handlers.get(signum)
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:
        # the default action (terminate): restore it and let the signal kill us as it would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_hooks() -> None:
    global _hooks_installed
    with _live_lock:
        if _hooks_installed:
            return
        _hooks_installed = True
        atexit.register(_close_all)
        if threading.current_thread() is not threading.main_thread():
            log.debug("netcluster: not in the main thread; teardown on signals is left to atexit and close()")
            return
        for sig in _SIGNALS:
            prev = signal.getsignal(sig)
            if prev == signal.SIG_IGN:
                continue
            _prev_handlers[sig] = prev
            signal.signal(sig, _on_signal)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold our signal handler while the main thread builds or tears down a cluster.

    Python runs signal handlers in the main thread between bytecodes, whichever
    thread the kernel delivered the signal to; a handler that tore down (and raised
    KeyboardInterrupt) in the middle of a start() or close() would leave half a
    cluster. It runs right after instead. Other threads need nothing: the handler's
    close() waits for their start()/close() on the cluster's lock.
    """
    global _busy
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _busy += 1
    try:
        yield
    finally:
        _busy -= 1
        if _busy == 0 and _pending:
            signum, frame = _pending[0]
            _pending.clear()
            _on_signal(signum, frame)


# ----------------------------------------------------------------------------- the cluster


class NetCluster:
    """A scheduler node and ``hosts`` host nodes, each in its own network namespace, linked by a bridge.

    Use it as a context manager, or call :meth:`start` and :meth:`close`. See the
    module docstring for the topology, the shaping, the counters and teardown.

    Args:
        hosts: number of host nodes (``host-0`` ... ``host-{hosts-1}``).
        rate: link rate per direction, tc syntax (``"1gbit"``, ``"100mbit"``) or bit/s; None: unshaped.
        delay_ms: one-way delay per link direction, applied only where netem exists.
        mtu: MTU of every link (9000: jumbo frames, see the module docstring).
        subnet: an IPv4 subnet inside 198.18.0.0/15 with room for .1 and .10+hosts.
        name: prefix of the namespace names (default: ``tpx<pid base 36>-<n>``, unique per process).
        count_ports: TCP ports whose bytes each link counts separately (e.g. the store daemon's port).
        root_dir: parent of the nodes' directories; default a temporary directory removed on close.
        kill_grace_s: how long processes get after SIGTERM on close before SIGKILL.
        queue_ms: each shaping queue holds this many milliseconds of the rate (at least 512 KiB);
            beyond it packets drop, as at a switch port whose buffer is full (several senders into
            one receiver), and TCP retransmits them: the senders' ``tx_bytes`` then exceed what the
            receiver's ``rx_bytes`` shows.
    """

    def __init__(
        self,
        hosts: int,
        *,
        rate: str | int | None = "1gbit",
        delay_ms: float = 0.2,
        mtu: int = 9000,
        subnet: str = "198.18.0.0/24",
        name: str | None = None,
        count_ports: Sequence[int] = (),
        root_dir: str | os.PathLike[str] | None = None,
        kill_grace_s: float = 5.0,
        queue_ms: float = 50.0,
    ) -> None:
        global _counter
        if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
            raise InvalidInput(f"hosts: expected a positive integer, got {hosts!r}")
        self.rate_bps: int | None = None if rate is None else parse_rate(rate)
        if isinstance(delay_ms, bool) or not isinstance(delay_ms, int | float) or not math.isfinite(delay_ms) or delay_ms < 0:
            raise InvalidInput(f"delay_ms: expected a finite number >= 0, got {delay_ms!r}")
        self.delay_ms = float(delay_ms)
        if isinstance(mtu, bool) or not isinstance(mtu, int) or not 576 <= mtu <= 65535:
            raise InvalidInput(f"mtu: expected an integer in [576, 65535], got {mtu!r}")
        self.mtu = mtu
        try:
            net = ipaddress.IPv4Network(subnet)
        except ValueError as exc:
            raise InvalidInput(f"subnet: {exc}") from exc
        if not net.subnet_of(BENCHMARK_NET):
            raise InvalidInput(f"subnet: {net} is outside {BENCHMARK_NET}, the benchmarking range the harness may use")
        last = FIRST_HOST_OFFSET + hosts - 1
        if last >= net.num_addresses - 1:
            raise InvalidInput(f"subnet: {net} has no room for {hosts} hosts (host addresses start at .{FIRST_HOST_OFFSET})")
        self.subnet = net
        ports = list(count_ports)
        if len(ports) > _MAX_PORTS or len(set(ports)) != len(ports) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= 65535 for p in ports
        ):
            raise InvalidInput(f"count_ports: expected at most {_MAX_PORTS} distinct TCP ports in [1, 65535], got {ports!r}")
        self.count_ports: tuple[int, ...] = tuple(ports)
        if name is None:
            with _live_lock:
                name = f"{NAME_PREFIX}{_base36(os.getpid())}-{_counter}"
                _counter += 1
        elif not _NAME_RE.match(name) or not name.startswith(NAME_PREFIX):
            raise InvalidInput(f"name: expected '{NAME_PREFIX}' followed by up to 21 of [a-z0-9-], got {name!r}")
        self.name = name
        if not math.isfinite(kill_grace_s) or kill_grace_s < 0:
            raise InvalidInput(f"kill_grace_s: expected a finite number >= 0, got {kill_grace_s!r}")
        self.kill_grace_s = float(kill_grace_s)
        if isinstance(queue_ms, bool) or not isinstance(queue_ms, int | float) or not math.isfinite(queue_ms) or queue_ms <= 0:
            raise InvalidInput(f"queue_ms: expected a finite number > 0, got {queue_ms!r}")
        self.queue_ms = float(queue_ms)

        self._own_root = root_dir is None
        self._root_dir = None if root_dir is None else Path(root_dir)
        self.switch_netns = f"{name}-sw"
        base = int(net.network_address)
        placeholder = Path(os.devnull)
        self.scheduler = EmuNode("scheduler", f"{name}-sched", str(ipaddress.IPv4Address(base + SCHEDULER_OFFSET)),
                                 NODE_IFACE, "scheduler", placeholder)
        self.hosts: list[EmuNode] = [
            EmuNode(f"host-{i}", f"{name}-h{i}", str(ipaddress.IPv4Address(base + FIRST_HOST_OFFSET + i)),
                    NODE_IFACE, f"host-{i}", placeholder)
            for i in range(hosts)
        ]
        self.delay_applied = False
        self.delay_unavailable_reason: str | None = None
        self._owner_pid = os.getpid()
        self._lock = threading.RLock()
        self._started = False
        self._closed = False
        self._procs: list[subprocess.Popen[Any]] = []
        self._executors: dict[str, ThreadPoolExecutor] = {}

    # -- naming

    @property
    def nodes(self) -> list[EmuNode]:
        """The scheduler, then the hosts."""
        return [self.scheduler, *self.hosts]

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the cluster, the switch's first."""
        return [self.switch_netns, *(n.netns for n in self.nodes)]

    def node(self, name: str | EmuNode) -> EmuNode:
        """The node called ``name`` ("scheduler", "host-0", ...); an :class:`EmuNode` is returned as is."""
        if isinstance(name, EmuNode):
            # compared by namespace: nodes taken before start() have no root directory yet
            for n in self.nodes:
                if n.netns == name.netns:
                    return n
            raise InvalidInput(f"node {name.name!r} ({name.netns}) belongs to another cluster than {self.name}")
        for n in self.nodes:
            if n.name == name:
                return n
        raise InvalidInput(f"no node {name!r} in cluster {self.name}; nodes: {[n.name for n in self.nodes]}")

    def __repr__(self) -> str:
        rate = "unshaped" if self.rate_bps is None else f"{self.rate_bps / 1e9:g} Gbit/s"
        state = "closed" if self._closed else "running" if self._started else "new"
        return f"NetCluster({self.name}: {len(self.hosts)} hosts, {rate}, mtu {self.mtu}, {state})"

    # -- lifecycle

    def __enter__(self) -> NetCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> NetCluster:
        """Build the namespaces, links, shaping and counters; returns self. Idempotent."""
        with self._lock, _signals_deferred():
            if self._closed:
                raise NetClusterError(f"cluster {self.name} is closed; make a new one")
            if self._started:
                return self
            reason = netns_unavailable_reason()
            if reason is not None:
                raise NetClusterError(f"cannot build an emulated cluster here: {reason}")
            sweep_stale()
            taken = sorted(set(self.namespaces) & _existing_netns())
            if _marker_path(self.name).exists() or taken:
                raise NetClusterError(
                    f"cluster name {self.name!r} is in use (marker {_marker_path(self.name)}, namespaces {taken}); pick another name"
                )
            with _live_lock:
                _live[id(self)] = self
            _install_hooks()
            self._started = True
            try:
                self._build()
            except BaseException:
                try:
                    self._teardown()
                except Exception:  # keep the build error; the marker stays for the next sweep
                    log.exception("netcluster %s: teardown after a failed start failed", self.name)
                raise
        return self

    def _build(self) -> None:
        if self._own_root:
            self._root_dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        assert self._root_dir is not None
        _write_marker(self.name, self.namespaces, self._root_dir if self._own_root else None)
        self.scheduler = dataclasses.replace(self.scheduler, root=self._root_dir / self.scheduler.name)
        self.hosts = [dataclasses.replace(h, root=self._root_dir / h.name) for h in self.hosts]
        for n in self.nodes:
            n.root.mkdir(parents=True, exist_ok=True)

        _batch("ip", None, [f"netns add {ns}" for ns in self.namespaces])
        prefix = self.subnet.prefixlen
        sw = [f"link add {BRIDGE} type bridge stp_state 0", f"link set {BRIDGE} addrgenmode none"]
        for n in self.nodes:
            sw += [
                f"link add {n.switch_port} mtu {self.mtu} type veth peer name {n.iface} mtu {self.mtu} netns {n.netns}",
                f"link set {n.switch_port} addrgenmode none",
                f"link set {n.switch_port} master {BRIDGE}",
                f"link set {n.switch_port} up",
            ]
        sw.append(f"link set {BRIDGE} mtu {self.mtu} up")
        _batch("ip", self.switch_netns, sw)
        for n in self.nodes:
            _batch("ip", n.netns, [
                "link set lo up",
                f"link set {n.iface} addrgenmode none",
                f"addr add {n.address}/{prefix} dev {n.iface}",
                f"link set {n.iface} up",
            ])

        if self.delay_ms > 0:
            self.delay_unavailable_reason = netem_unavailable_reason()
            self.delay_applied = self.delay_unavailable_reason is None
            if not self.delay_applied:
                log.warning("netcluster %s: links are NOT delayed (requested %.3g ms per link direction): %s",
                            self.name, self.delay_ms, self.delay_unavailable_reason)
        _batch("tc", self.switch_netns, [line for n in self.nodes for line in self._shaping(n.switch_port)])
        for n in self.nodes:
            _batch("tc", n.netns, self._shaping(n.iface))
        rate = "unshaped" if self.rate_bps is None else f"{self.rate_bps / 1e6:g} Mbit/s"
        delay = f"{self.delay_ms:g} ms delay" if self.delay_applied else "no delay"
        log.info("netcluster %s: scheduler %s and %d hosts %s..%s on %s, %s full duplex, %s, MTU %d, counting ports %s",
                 self.name, self.scheduler.address, len(self.hosts), self.hosts[0].address, self.hosts[-1].address,
                 self.subnet, rate, delay, self.mtu, list(self.count_ports) or "none")

    def _port_minors(self, index: int) -> tuple[int, int]:
        """HTB class minors of the i-th counted port: (source port class, destination port class)."""
        return _PORT_MINOR_BASE + 2 * index, _PORT_MINOR_BASE + 2 * index + 1

    def _shaping(self, dev: str) -> list[str]:
        """tc batch lines that shape and count one end of a link (``dev``'s egress)."""
        rate = self.rate_bps if self.rate_bps is not None else UNSHAPED_RATE_BPS
        byte_rate = rate / 8
        frame = self.mtu + 14
        burst = max(int(byte_rate * 0.002), 2 * (65536 + 14))
        queue = max(int(byte_rate * self.queue_ms / 1000), 512 * 1024)
        quantum = min(200_000, max(2 * frame, 65536 + 14))
        leaves = [_DEFAULT_MINOR] + [m for i in range(len(self.count_ports)) for m in self._port_minors(i)]
        leaf_rate = max(rate // len(leaves), 8000)
        shape = f"burst {burst} cburst {burst} quantum {quantum}"
        if self.delay_applied:
            packets = max(1000, int(queue / frame) * 4)
            leaf_qdisc = f"netem delay {self.delay_ms:g}ms limit {packets}"
        else:
            leaf_qdisc = f"bfifo limit {queue}"
        lines = [
            f"qdisc add dev {dev} root handle 1: htb default {_DEFAULT_MINOR:x}",
            f"class add dev {dev} parent 1: classid 1:{_LINK_MINOR:x} htb rate {rate}bit ceil {rate}bit {shape}",
        ]
        for minor in leaves:
            lines += [
                f"class add dev {dev} parent 1:{_LINK_MINOR:x} classid 1:{minor:x} htb rate {leaf_rate}bit ceil {rate}bit {shape}",
                f"qdisc add dev {dev} parent 1:{minor:x} handle {minor:x}: {leaf_qdisc}",
            ]
        for i, port in enumerate(self.count_ports):
            sport, dport = self._port_minors(i)
            match = "u32 match ip protocol 6 0xff"
            lines += [
                f"filter add dev {dev} parent 1: protocol ip prio 1 {match} match ip sport {port} 0xffff flowid 1:{sport:x}",
                f"filter add dev {dev} parent 1: protocol ip prio 2 {match} match ip dport {port} 0xffff flowid 1:{dport:x}",
            ]
        return lines

    def close(self) -> None:
        """Kill every process in the cluster, delete its namespaces and its temporary directories. Idempotent."""
        with self._lock, _signals_deferred():
            if self._closed:
                return
            self._closed = True
            if self._started:
                self._teardown()
            with _live_lock:
                _live.pop(id(self), None)

    def _teardown(self) -> None:
        self._closed = True
        errors: list[str] = []
        for ex in self._executors.values():
            ex.shutdown(wait=False, cancel_futures=True)
        self._executors.clear()
        try:
            self._stop_processes()
        except Exception as exc:  # go on: the namespaces must go in any case
            errors.append(f"stopping processes: {exc}")
        try:
            _delete_netns(self.namespaces)
        except NetClusterError as exc:
            errors.append(str(exc))
        if self._own_root and self._root_dir is not None:
            shutil.rmtree(self._root_dir, ignore_errors=True)
        if not errors:
            with contextlib.suppress(FileNotFoundError):
                _marker_path(self.name).unlink()
        with _live_lock:
            _live.pop(id(self), None)
        if errors:
            # the marker stays, so the next start of any cluster retries the sweep
            raise NetClusterError(f"cluster {self.name}: teardown incomplete: {'; '.join(errors)}")
        log.info("netcluster %s: torn down", self.name)

    def _stop_processes(self) -> None:
        my_group = os.getpgrp()

        def signal_tracked(sig: int) -> None:
            for p in self._procs:
                if p.poll() is not None:
                    continue
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    pgid = os.getpgid(p.pid)
                    if pgid != my_group:
                        os.killpg(pgid, sig)
                    else:
                        os.kill(p.pid, sig)

        signal_tracked(signal.SIGTERM)
        _kill_all(_pids_in_netns(self.namespaces), signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace_s
        while time.monotonic() < deadline:
            if all(p.poll() is not None for p in self._procs) and not _pids_in_netns(self.namespaces):
                break
            time.sleep(0.02)
        signal_tracked(signal.SIGKILL)
        _kill_all(_pids_in_netns(self.namespaces), signal.SIGKILL)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        self._procs.clear()

    def _require_running(self) -> None:
        if not self._started or self._closed:
            raise NetClusterError(f"cluster {self.name} is {'closed' if self._closed else 'not started'}")

    # -- processes

    def exec_prefix(self, node: EmuNode | str) -> list[str]:
        """The argv prefix that runs a command inside ``node``'s namespace (for code that spawns its own processes)."""
        return [_require_tool("ip"), "netns", "exec", self.node(node).netns]

    def popen(self, node: EmuNode | str, argv: Sequence[str | os.PathLike[str]], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``node``'s namespace with this environment; killed (its process group) on close.

        The process gets a session of its own (``start_new_session=True``) unless the
        caller says otherwise, so close() can kill its children too.
        """
        self._require_running()
        popen_kwargs.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = subprocess.Popen([*self.exec_prefix(node), *map(os.fspath, argv)], **popen_kwargs)
        with self._lock:
            self._procs = [p for p in self._procs if p.poll() is None]
            self._procs.append(proc)
        return proc

    def python(self, node: EmuNode | str, args: Sequence[str | os.PathLike[str]], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """:meth:`popen` of this interpreter (``sys.executable``, the venv's python) with ``args``."""
        return self.popen(node, [sys.executable, *args], **popen_kwargs)

    def run(self, node: EmuNode | str, argv: Sequence[str | os.PathLike[str]], **run_kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run`` of ``argv`` inside ``node``'s namespace (same keyword arguments)."""
        self._require_running()
        return subprocess.run([*self.exec_prefix(node), *map(os.fspath, argv)], **run_kwargs)

    def call(self, node: EmuNode | str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` in a thread that has entered ``node``'s namespace, and return its result.

        Sockets made inside ``fn`` live in that namespace: the test process can reach
        the cluster's servers "from" a node (e.g. the REST API from the scheduler's
        namespace, over its loopback) without starting a process. Threads that ``fn``
        starts inherit the namespace, so ``cluster.call(node, server.start)`` runs an
        in-process server (one that serves from its own thread) inside the node. Each
        node has a small pool of such threads, shut down on close.
        """
        return self.executor(node).submit(fn, *args, **kwargs).result()

    def executor(self, node: EmuNode | str) -> ThreadPoolExecutor:
        """The node's pool of threads inside its namespace (up to 8), for concurrent :meth:`call`-style work."""
        n = self.node(node)
        with self._lock:
            self._require_running()
            ex = self._executors.get(n.name)
            if ex is None:
                ex = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"{self.name}-{n.name}",
                                        initializer=enter_netns, initargs=(n.netns,))
                self._executors[n.name] = ex
            return ex

    # -- links

    def set_link(self, node: EmuNode | str, *, up: bool) -> None:
        """Take ``node``'s link down (its switch port; a pulled cable: peers time out, nothing is refused) or up."""
        self._require_running()
        n = self.node(node)
        _cmd([_require_tool("ip"), "-n", self.switch_netns, "link", "set", n.switch_port, "up" if up else "down"])

    def link_is_up(self, node: EmuNode | str) -> bool:
        """Whether ``node``'s switch port is administratively up."""
        self._require_running()
        n = self.node(node)
        (link,) = _json([_require_tool("ip"), "-n", self.switch_netns, "-j", "link", "show", n.switch_port])
        return "UP" in link.get("flags", [])

    # -- counters

    def counters(self) -> dict[str, LinkCounters]:
        """The counters of every node's link, keyed by node name (see :class:`LinkCounters`)."""
        self._require_running()
        ip, tc = _require_tool("ip"), _require_tool("tc")
        switch_q = _by_dev(_json([tc, "-n", self.switch_netns, "-s", "-j", "qdisc", "show"]))
        switch_if = {e["ifname"]: e.get("stats64", {}) for e in _json([ip, "-n", self.switch_netns, "-s", "-j", "link", "show"])}
        result: dict[str, LinkCounters] = {}
        for n in self.nodes:
            node_q = _by_dev(_json([tc, "-n", n.netns, "-s", "-j", "qdisc", "show", "dev", n.iface]), default_dev=n.iface)
            rx = _qdisc_stats(switch_q.get(n.switch_port, []), f"{self.name}/switch/{n.switch_port}")
            tx = _qdisc_stats(node_q.get(n.iface, []), f"{self.name}/{n.name}/{n.iface}")
            port_if = switch_if.get(n.switch_port, {})
            ports = {}
            for i, port in enumerate(self.count_ports):
                sport, dport = self._port_minors(i)
                ports[port] = PortCounters(rx.leaves.get(sport, 0), tx.leaves.get(sport, 0),
                                           rx.leaves.get(dport, 0), tx.leaves.get(dport, 0))
            result[n.name] = LinkCounters(
                rx_bytes=rx.bytes, tx_bytes=tx.bytes, rx_packets=rx.packets, tx_packets=tx.packets,
                rx_dropped=rx.drops, tx_dropped=tx.drops,
                # the switch port sends what the node receives, and receives what it sends
                iface_rx_bytes=int(port_if.get("tx", {}).get("bytes", 0)), iface_tx_bytes=int(port_if.get("rx", {}).get("bytes", 0)),
                iface_rx_packets=int(port_if.get("tx", {}).get("packets", 0)),
                iface_tx_packets=int(port_if.get("rx", {}).get("packets", 0)),
                ports=ports,
            )
        return result

    def snapshot(self) -> CounterSnapshot:
        """:meth:`counters` with the time; ``later - earlier`` gives a :class:`CounterDelta`."""
        taken_at = time.monotonic()
        links = self.counters()
        return CounterSnapshot((taken_at + time.monotonic()) / 2, links)


@dataclass(frozen=True)
class _QdiscStats:
    bytes: int
    packets: int
    drops: int
    leaves: dict[int, int]  # class minor -> bytes through its leaf qdisc


def _by_dev(entries: list[dict[str, Any]], default_dev: str | None = None) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        dev = e.get("dev", default_dev)
        if dev is not None:
            out.setdefault(dev, []).append(e)
    return out


def _qdisc_stats(entries: list[dict[str, Any]], where: str) -> _QdiscStats:
    root = next((e for e in entries if e.get("root") and e.get("kind") == "htb"), None)
    if root is None:
        raise NetClusterError(f"{where}: the HTB qdisc is gone (was the link's qdisc replaced?)")
    leaves = {}
    for e in entries:
        parent = str(e.get("parent", ""))
        if parent.startswith("1:"):
            leaves[int(parent[2:], 16)] = int(e.get("bytes", 0))
    return _QdiscStats(int(root.get("bytes", 0)), int(root.get("packets", 0)), int(root.get("drops", 0)), leaves)
