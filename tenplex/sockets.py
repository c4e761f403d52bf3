"""Socket helpers: settings for bulk transfers between processes of one node, and ports to listen on.

Ports (:func:`free_port`): a port a process will bind *later* (a rendezvous
port handed to workers that start seconds after, a daemon's port given on its
command line) is chosen below the kernel's ephemeral range. Port 0's answer is
an ephemeral port, and until the listener binds it any outgoing connection on
the machine may take it as its local port, which fails the bind with
EADDRINUSE (in a rendezvous: rank 0 exits, its peers wait). A port below the
range is only ever taken by another bind.

Congestion control, why it is set: where the node's default TCP congestion control paces its
sending (BBR does, in the kernel's TCP stack itself when the interface has no
``fq`` queueing discipline, as loopback never has), every segment arms a
timer. Between two processes of the same node there is no network to pace
for, and that pacing was most of what the store daemon spent sending: on the
2-core VM four parallel 64 MiB reads over loopback took 82-89 ms of daemon
CPU per 256 MiB with BBR and 36-40 ms with an unpaced algorithm (and ran at
~0.6x instead of ~1.0x the throughput of a plain ``http.server`` baseline).

The algorithm must be chosen before the connection is established (a
connection that started under BBR stays paced after a switch), so it is set
on a client's socket before ``connect`` when the destination is a loopback
address, and on a daemon's listening socket when it listens on a loopback
address only (every peer is then on the node). Connections to and from other
hosts keep the node's setting: that is the cluster operator's choice.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import random
import socket
from contextlib import ExitStack
from pathlib import Path

log = logging.getLogger(__name__)

UNPACED_CONGESTION = (b"cubic", b"reno")
"""Tried in order; an unprivileged process may set only what ``net.ipv4.tcp_allowed_congestion_control`` lists."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback IP address (127.0.0.0/8, ::1); names and other addresses are not."""
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def set_unpaced(sock: socket.socket) -> bool:
    """Give a TCP socket that is not connected yet an unpaced congestion control; whether one could be set."""
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None:
        return False
    for name in UNPACED_CONGESTION:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, option, name)
            return True
        except OSError:
            continue
    log.debug("no unpaced congestion control may be set here (see net.ipv4.tcp_allowed_congestion_control)")
    return False


def create_connection(
    address: tuple[str, int], timeout: float | None = None, source_address: tuple[str, int] | None = None
) -> socket.socket:
    """:func:`socket.create_connection`, with an unpaced congestion control towards a loopback address."""
    host, port = address
    last: OSError | None = None
    for family, kind, proto, _name, sockaddr in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            if is_loopback(str(sockaddr[0])):
                set_unpaced(sock)
            sock.settimeout(timeout)
            if source_address is not None:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    raise last if last is not None else OSError(f"getaddrinfo returned nothing for {host}:{port}")


PORT_FLOOR = 20000
"""The lowest port :func:`free_port` hands out (below it lie well-known services' registered ports)."""


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768, Linux's default, where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(address: str = "127.0.0.1", count: int = 1, *, avoid: frozenset[int] = frozenset()) -> int:
    """The first of ``count`` consecutive ports that are free on ``address`` now, below the ephemeral range.

    Free means this process could bind each of them (not in ``avoid``) a
    moment ago; nothing is held, so two callers may still pick the same one
    (1 in several thousand). Where the machine leaves fewer than 1000 ports
    between :data:`PORT_FLOOR` and its ephemeral range, a single port is the
    kernel's own choice (port 0), raced as it is, and a block cannot be had
    (OSError). An ``address`` this machine
    does not have (a host elsewhere, another network namespace) cannot be
    probed: any port not in ``avoid`` is taken as free.
    """
    low = ephemeral_low()
    if low - PORT_FLOOR < 1000 + count:
        if count != 1:
            raise OSError(errno.EADDRINUSE, f"no room for {count} consecutive ports below the ephemeral range ({low})")
        with socket.socket() as s:
            s.bind((address, 0))
            return int(s.getsockname()[1])
    span = low - PORT_FLOOR - count + 1
    start = random.randrange(span)
    for i in range(span):
        base = PORT_FLOOR + (start + i) % span
        if any(base + k in avoid for k in range(count)):
            continue
        try:
            with ExitStack() as stack:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket()).bind((address, port))
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                continue
        return base
    raise OSError(errno.EADDRINUSE, f"no {count} consecutive free ports on {address} in {PORT_FLOOR}-{low - 1}")
