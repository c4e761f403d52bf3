"""Same-node TCP connections start unpaced; others keep the node's congestion control. Ports to listen on
lie below the ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest

from tenplex.node.store_routes import StoreServer
from tenplex.ptc.region import Region
from tenplex.serving import bind_socket
from tenplex.sockets import (
    PORT_FLOOR,
    UNPACED_CONGESTION,
    create_connection,
    ephemeral_low,
    free_port,
    is_loopback,
    set_unpaced,
)
from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore


def _congestion(sock: socket.socket) -> bytes:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0")


@pytest.fixture(scope="module")
def unpaced_allowed() -> None:
    """Skips where the platform has no TCP_CONGESTION, or this process may set neither algorithm."""
    with socket.socket() as probe:
        if not set_unpaced(probe):
            pytest.skip(f"neither of {UNPACED_CONGESTION} is allowed for this process")


def test_loopback_addresses() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.0.0.5") and is_loopback("::1")
    assert not is_loopback("10.1.2.3") and not is_loopback("0.0.0.0") and not is_loopback("localhost")


def test_a_connection_to_this_node_starts_unpaced_on_both_ends(unpaced_allowed: None) -> None:
    listener = bind_socket("127.0.0.1", 0)  # a daemon listening on loopback only
    with listener:
        client = create_connection(listener.getsockname(), timeout=5)
        accepted, _ = listener.accept()
        with client, accepted:
            assert _congestion(client) in UNPACED_CONGESTION
            assert _congestion(accepted) in UNPACED_CONGESTION  # inherited from the listening socket


def test_a_daemon_listening_on_every_interface_keeps_the_node_setting(unpaced_allowed: None) -> None:
    with socket.socket() as fresh:
        default = _congestion(fresh)
    listener = bind_socket("0.0.0.0", 0)
    with listener:
        assert _congestion(listener) == default


def test_the_store_client_talks_unpaced_to_a_daemon_on_its_node(unpaced_allowed: None, tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    data = np.arange(64, dtype=np.float32).reshape(8, 8)
    with StoreServer(tmp_path, store=store) as srv, StoreClient(srv.url) as client:
        client.write_shard("j", "s1-g0", "w", Region.full((8, 8)), data, dtype="float32", global_shape=(8, 8))
        conn, _since = client._idle[-1]
        assert _congestion(conn.sock) in UNPACED_CONGESTION
        client.commit("j", "s1-g0")
        assert client.read("j", "s1-g0", "w", Region.full((8, 8)), "float32").tobytes() == data.tobytes()


def test_a_refused_connection_is_an_error_as_before() -> None:
    listener = bind_socket("127.0.0.1", 0)
    port = listener.getsockname()[1]
    listener.close()
    with pytest.raises(ConnectionRefusedError):
        create_connection(("127.0.0.1", port), timeout=5)


def test_free_ports_lie_below_the_ephemeral_range_consecutive_free_and_not_among_those_to_avoid() -> None:
    low = ephemeral_low()
    if low - PORT_FLOOR < 1100:
        pytest.skip(f"this kernel's ephemeral range starts at {low}: no room below it")
    base = free_port("127.0.0.1", 8)
    assert base >= PORT_FLOOR and base + 8 <= low
    with socket.socket() as a, socket.socket() as b:  # all 8 bindable; one held is not handed out again
        for port in range(base, base + 8):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
        a.bind(("127.0.0.1", base))
        a.listen()
        avoid = frozenset(range(PORT_FLOOR, low)) - {base, base + 1, base + 2}
        # of the three allowed, base is held: a block of 2 can only start at base + 1
        assert free_port("127.0.0.1", 2, avoid=avoid) == base + 1
        b.bind(("127.0.0.1", base + 1))
        with pytest.raises(OSError, match="no 2 consecutive free ports"):
            free_port("127.0.0.1", 2, avoid=avoid)
    # an address this machine does not have cannot be probed: any port not avoided is taken
    assert free_port("198.18.255.254", avoid=avoid) in {base, base + 1, base + 2}
