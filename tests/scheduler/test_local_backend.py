"""The local backend's worker environment, with a real store daemon and a real worker process."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tenplex.core.protocol import ENV_STORE_ROOT
from tenplex.errors import NotFound
from tenplex.scheduler.backend import LocalBackend, LocalCluster, WorkerLaunch
from tenplex.store.local import LocalStore


def test_workers_get_their_hosts_store_root_and_use_it_directly(tmp_path: Path) -> None:
    cluster = LocalCluster(root=tmp_path / "cluster")
    backend = LocalBackend(cluster)
    try:
        cluster.start_host("host-0", "127.0.0.2")
        root = cluster.store_root("host-0")
        assert root.is_dir()  # the daemon created it: the same root it serves
        with pytest.raises(NotFound, match="host-9"):
            cluster.store_root("host-9")
        probe = "import os; print('root=' + os.environ['TENPLEX_STORE_ROOT'])"
        backend.launch("j", [sys.executable, "-c", probe], [WorkerLaunch("j-g0-r0", 0, "host-0", 0, {})], tmp_path / "logs")
        deadline = time.monotonic() + 60
        while not backend.exited("j", ["j-g0-r0"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.exited("j", ["j-g0-r0"]) == {"j-g0-r0": 0}
        assert f"root={root}" in (tmp_path / "logs" / "j-g0-r0.log").read_text()
        # The daemon serving that root also runs its transforms (the scheduler has no store of its own).
        from tenplex.store.client import StoreClient

        with StoreClient(backend.host("host-0").store_url) as client:
            assert client.request_json("GET", "/v1/jobs/j/transforms") == {"job": "j", "transforms": []}
    finally:
        backend.close()
        cluster.stop()


def test_worker_store_choice_follows_the_store_root(tmp_path: Path) -> None:
    from tenplex.store.client import StoreClient
    from tenplex.worker.session import node_store

    url = "http://127.0.0.2:7070"
    direct = node_store({ENV_STORE_ROOT: str(tmp_path)}, url, None)
    assert isinstance(direct, LocalStore) and direct.root == tmp_path.resolve()
    # Not mounted here (a path of another machine), or not given: the node's daemon over HTTP.
    for env in ({ENV_STORE_ROOT: str(tmp_path / "absent")}, {}):
        remote = node_store(env, url, "tok")
        assert isinstance(remote, StoreClient) and remote.url == url
        remote.close()


def test_rendezvous_ports_lie_below_the_ephemeral_range_and_are_not_handed_out_twice(tmp_path: Path) -> None:
    import socket

    from tenplex.scheduler.backend import RendezvousPorts
    from tenplex.sockets import PORT_FLOOR, ephemeral_low

    low = ephemeral_low()
    if low - PORT_FLOOR < 1100:
        pytest.skip("this kernel's ephemeral range leaves no room below it")
    picker = RendezvousPorts()
    ports = [picker.pick("127.0.0.1") for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(PORT_FLOOR <= p < low for p in ports)
    for p in ports:  # each was free when handed out
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    # A host whose address is not on this machine (another node, another network namespace): its ports
    # cannot be probed from here, but one is still handed out, never one handed out recently.
    far = [picker.pick("198.18.255.254") for _ in range(20)]
    assert len(set(far)) == 20 and all(PORT_FLOOR <= p < low for p in far)


def test_hosts_from_a_hosts_file_run_their_workers_through_their_launch_prefix(tmp_path: Path) -> None:
    """A described host: its workers start through its prefix, with its environment, and see its store root
    only where the file gives one; the scheduler neither stops its daemon nor invents a root."""
    from tenplex.node.daemon import NodeDaemon

    with NodeDaemon(tmp_path / "remote-store") as daemon:
        cluster = LocalCluster.attach(tmp_path / "cluster", [
            {"name": "a", "address": "127.0.0.1", "store_url": daemon.url, "gpus": 2,
             "launch_prefix": ["env", "VIA_PREFIX=yes"], "env": {"GLOO_SOCKET_IFNAME": "eth7"},
             "store_root": str(tmp_path / "remote-store")},
            {"name": "b", "address": "127.0.0.1", "store_url": daemon.url, "gpus": 1},
        ])
        backend = LocalBackend(cluster, host_timeout=None)
        probe = ("import os; print('|'.join(os.environ.get(k, '-') for k in "
                 "('VIA_PREFIX', 'GLOO_SOCKET_IFNAME', 'TENPLEX_STORE_ROOT')))")
        backend.launch("j", [sys.executable, "-c", probe],
                       [WorkerLaunch("j-g0-r0", 0, "a", 0, {}), WorkerLaunch("j-g0-r1", 1, "b", 0, {})], tmp_path / "logs")
        deadline = time.monotonic() + 60
        while len(backend.exited("j", ["j-g0-r0", "j-g0-r1"])) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.exited("j", ["j-g0-r0", "j-g0-r1"]) == {"j-g0-r0": 0, "j-g0-r1": 0}
        assert (tmp_path / "logs" / "j-g0-r0.log").read_text().strip() == f"yes|eth7|{tmp_path / 'remote-store'}"
        assert (tmp_path / "logs" / "j-g0-r1.log").read_text().strip() == "-|lo|-"
        described = {h["name"]: h for h in cluster.describe()}
        assert described["a"]["launch_prefix"] == ["env", "VIA_PREFIX=yes"] and described["a"]["managed"] is False
        again = LocalCluster.attach(tmp_path / "cluster", cluster.describe())  # what a restarted scheduler reads
        assert again.launch_prefix("a") == ("env", "VIA_PREFIX=yes") and again.store_root("b") is None
        cluster.stop()  # not ours to stop
        assert daemon.url and LocalCluster.attach(tmp_path / "c", []).hosts() == []
        from tenplex.store.client import StoreClient

        with StoreClient(daemon.url) as client:
            assert client.health()


@pytest.mark.parametrize(("host", "message"), [
    ({"name": "a", "address": "x", "store_url": "http://x:1"}, "missing gpus"),
    ({"name": "a", "address": "x", "store_url": "ftp://x", "gpus": 1}, "must look like http"),
    ({"name": "a", "address": "x", "store_url": "http://x:1", "gpus": 0}, "positive integer"),
    ({"name": "a", "address": "x", "store_url": "http://x:1", "gpus": 1, "launch_prefix": "ssh a"}, "list of strings"),
    ({"name": "a", "address": "x", "store_url": "http://x:1", "gpus": 1, "colour": "red"}, "unknown fields colour"),
    ({"name": "a", "address": "x", "store_url": "http://x:1", "gpus": 1, "env": {"A": 1}}, "env must map"),
])
def test_a_bad_hosts_file_is_refused_naming_the_host(tmp_path: Path, host: dict, message: str) -> None:
    from tenplex.errors import InvalidConfig

    with pytest.raises(InvalidConfig, match=message):
        LocalCluster.attach(tmp_path, [host])
    with pytest.raises(InvalidConfig, match="described twice"):
        LocalCluster.attach(tmp_path, [{"name": "a", "address": "x", "store_url": "http://x:1", "gpus": 1}] * 2)


def test_the_health_watch_loses_a_host_whose_daemon_is_gone_or_silent(tmp_path: Path) -> None:
    import os
    import signal
    import socket

    cluster = LocalCluster(root=tmp_path / "cluster")
    try:
        cluster.start_host("host-0", "127.0.0.2")
        cluster.start_host("host-1", "127.0.0.3")
        assert cluster.check_health(lost_after=0.5) == []
        pid = next(h["pid"] for h in cluster.describe() if h["name"] == "host-0")
        os.killpg(pid, signal.SIGKILL)  # from outside, as a crash would
        deadline = time.monotonic() + 10
        while cluster.check_health(lost_after=0.5) != ["host-0"]:
            assert time.monotonic() < deadline
        assert [h.ready for h in cluster.hosts()] == [False, True]
        # A daemon that answers nothing (a listening socket that never replies) is lost after lost_after.
        silent = socket.create_server(("127.0.0.4", 0))
        described = [*cluster.describe(), {"name": "host-2", "address": "127.0.0.4", "gpus": 2,
                                           "store_url": f"http://127.0.0.4:{silent.getsockname()[1]}"}]
        other = LocalCluster.attach(tmp_path / "cluster", described)
        start = time.monotonic()
        deadline = start + 60
        lost: list[str] = []
        while "host-2" not in lost:
            lost += other.check_health(lost_after=1.0, probe_timeout=0.2)
            assert time.monotonic() < deadline, "the silent daemon's host was never lost"
        assert time.monotonic() - start >= 1.0  # not before its timeout
        silent.close()
    finally:
        cluster.stop()


def test_a_host_whose_daemon_relayed_just_now_is_not_probed(tmp_path: Path) -> None:
    """The health watch skips a ready host heard from (its daemon relayed its workers' heartbeats) within
    ``heard_within``: 2,048 probes a second cost the scheduler a fifth of a core. Once that is older, the host is
    probed again, and a daemon that does not answer and was last heard ``lost_after`` ago is lost at once."""
    import socket

    silent = socket.create_server(("127.0.0.1", 0))
    port = silent.getsockname()[1]
    silent.close()  # nothing listens there: a probe is refused
    cluster = LocalCluster.attach(tmp_path, [{"name": "node-0", "address": "127.0.0.1", "gpus": 8,
                                              "store_url": f"http://127.0.0.1:{port}"}])
    now = [100.0]
    cluster.clock = lambda: now[0]
    cluster.heard_from("node-0")
    now[0] = 160.0
    assert cluster.check_health(lost_after=61.0, heard_within=60.0) == []  # not probed: still ready
    assert cluster.hosts()[0].ready
    now[0] = 161.0  # probed, refused, silent since 100.0: lost_after ends now
    assert cluster.check_health(lost_after=61.0, heard_within=60.0) == ["node-0"]
    assert not cluster.hosts()[0].ready
    cluster.heard_from("node-0")  # a lost host is probed whatever it relayed: it is ready when it answers
    assert cluster.check_health(lost_after=61.0, heard_within=60.0) == []
    assert not cluster.hosts()[0].ready


def test_the_health_watch_probes_a_heard_daemon_every_third_of_lost_after_and_loses_it_on_time(tmp_path: Path) -> None:
    """With the watch's own spacing (``heard_within``): a daemon that answered is probed again only a third of
    ``lost_after`` later (during a change no node relays, and 2,048 probes a second were 11-12% of the
    scheduler's core), and one that stops answering is lost in the first round ``lost_after`` after its last
    answer, not later: exact on a clock the test moves."""
    import http.server
    import threading

    from tenplex.scheduler.backend import heard_within

    probes: list[str] = []

    class Healthz(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            probes.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthz)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    cluster = LocalCluster.attach(tmp_path, [{"name": "node-0", "address": "127.0.0.1", "gpus": 8,
                                              "store_url": f"http://127.0.0.1:{server.server_address[1]}"}])
    lost_after, interval = 12.0, 1.0
    within = heard_within(interval, lost_after)
    assert within == 4.0  # a third of lost_after
    assert heard_within(1.0, 3.0) == 1.5  # two intervals, at most half of lost_after
    now = [0.0]
    cluster.clock = lambda: now[0]

    def round_at(t: float) -> list[str]:
        now[0] = t
        return cluster.check_health(lost_after=lost_after, heard_within=within, probe_timeout=1.0)

    try:
        assert round_at(0.0) == [] and probes == ["/healthz"]  # never heard: probed, answered at 0
        for t in (1.0, 2.0, 3.0, 4.0):
            assert round_at(t) == []
        assert len(probes) == 1  # heard within 4 s: not probed
        assert round_at(5.0) == [] and len(probes) == 2  # answered at 5
    finally:
        server.shutdown()
        server.server_close()  # from now on a probe is refused
    for t in (6.0, 9.0, 10.0, 12.0, 16.0):
        assert round_at(t) == [], t  # probed from 10 on, unanswered, but heard at 5: not yet 12 s silent
        assert cluster.hosts()[0].ready
    assert round_at(17.0) == ["node-0"]  # 12 s after its last answer: lost in this round
    assert not cluster.hosts()[0].ready
    assert len(probes) == 2
