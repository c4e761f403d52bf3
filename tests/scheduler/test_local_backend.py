"""The local backend's worker environment, with a real store daemon and a real worker process."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tenplex.errors import NotFound
from tenplex.scheduler.backend import LocalBackend, LocalCluster, WorkerLaunch
from tenplex.scheduler.protocol import ENV_STORE_ROOT
from tenplex.worker.stores import DirectStore


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
    assert isinstance(direct, DirectStore) and direct.local.root == tmp_path.resolve()
    # Not mounted here (a path of another machine), or not given: the node's daemon over HTTP.
    for env in ({ENV_STORE_ROOT: str(tmp_path / "absent")}, {}):
        remote = node_store(env, url, "tok")
        assert isinstance(remote, StoreClient) and remote.url == url
        remote.close()


def test_rendezvous_ports_lie_below_the_ephemeral_range_and_are_not_handed_out_twice(tmp_path: Path) -> None:
    import socket

    from tenplex.scheduler.backend import Backend, HostInfo, _ephemeral_low

    low = _ephemeral_low()
    if low is None:
        pytest.skip("this kernel's ephemeral range leaves no room below it")
    host = HostInfo("h0", 1, "http://127.0.0.1:1", "127.0.0.1")
    ports = [Backend.master_port(None, host) for _ in range(50)]  # type: ignore[arg-type]  # needs no backend state
    assert len(set(ports)) == 50
    assert all(20000 <= p < low for p in ports)
    for p in ports:  # each was free when handed out
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
