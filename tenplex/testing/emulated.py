"""Tenplex itself on an emulated multi-host cluster: node daemons, the scheduler and its workers in namespaces.

:class:`~tenplex.testing.netcluster.NetCluster` gives every host and the
scheduler a network namespace with a shaped, counted link. This puts Tenplex
on it as it runs on real machines: a node daemon (``tenplex store serve``) in
every host's namespace, on the host's address, with its store under the
host's directory; the scheduler (``tenplex scheduler serve --backend local``)
in its own namespace, given the hosts by a hosts file, so that it starts each
worker inside its host's namespace (``ip netns exec`` as the host's launch
prefix, gloo on the host's interface) with the host's store root. Nothing
talks over the test machine's own network: the test process reaches the
cluster's servers from a thread inside the scheduler's namespace
(:meth:`NetCluster.call`).

Used by the multi-host tests (``tests/cluster``) and by
``benchmarks/cluster_reshard.py`` (daemons only, ``scheduler=False``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from tenplex.errors import TenplexError
from tenplex.scheduler.cli import SchedulerClient
from tenplex.store.client import StoreClient
from tenplex.testing.netcluster import EmuNode, NetCluster, NetClusterError

log = logging.getLogger(__name__)

T = TypeVar("T")

STORE_PORT = 7070
SCHEDULER_PORT = 8470
REPO = Path(__file__).resolve().parents[2]


class EmulatedTenplex:
    """Node daemons (and optionally the scheduler) started inside a started :class:`NetCluster`."""

    def __init__(self, net: NetCluster, *, token: str = "emulated", gpus_per_host: int = 2, scheduler: bool = True,
                 heartbeat_interval: float = 1.0, host_timeout: float = 20.0,
                 daemon_args: tuple[str, ...] = (), log_level: str = "WARNING") -> None:
        if STORE_PORT not in net.count_ports:
            raise NetClusterError(f"the cluster must count the store port {STORE_PORT} (count_ports)")
        self.net = net
        self.token = token
        self.gpus_per_host = gpus_per_host
        self.with_scheduler = scheduler
        self.heartbeat_interval = heartbeat_interval
        self.host_timeout = host_timeout
        self.daemon_args = daemon_args
        self.log_level = log_level
        self.daemons: dict[str, subprocess.Popen[Any]] = {}
        self.scheduler_proc: subprocess.Popen[Any] | None = None
        self.state_dir = net.scheduler.root / "state"
        self._clients: dict[str, StoreClient] = {}

    # -- addresses --------------------------------------------------------------------------

    def store_url(self, host: str | EmuNode) -> str:
        return self.net.node(host).url(STORE_PORT)

    def store_root(self, host: str | EmuNode) -> Path:
        return self.net.node(host).root / "store"

    @property
    def scheduler_url(self) -> str:
        return self.net.scheduler.url(SCHEDULER_PORT)

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> EmulatedTenplex:
        for host in self.net.hosts:
            self.start_daemon(host)
        for host in self.net.hosts:
            self.wait_daemon(host)
        if self.with_scheduler:
            self._start_scheduler()
        return self

    def start_daemon(self, host: str | EmuNode) -> subprocess.Popen[Any]:
        node = self.net.node(host)
        self.store_root(node).mkdir(parents=True, exist_ok=True)
        logf = open(node.root / "store.log", "ab")  # noqa: SIM115 - handed to the child process
        try:
            proc = self.net.python(node, [
                "-m", "tenplex", "--log-level", self.log_level, "store", "serve", "--root", str(self.store_root(node)),
                "--host", node.address, "--port", str(STORE_PORT), "--token", self.token, *self.daemon_args,
            ], stdout=logf, stderr=subprocess.STDOUT, cwd=REPO)
        finally:
            logf.close()
        self.daemons[node.name] = proc
        return proc

    def wait_daemon(self, host: str | EmuNode, timeout: float = 60.0) -> None:
        """Until ``host``'s daemon answers /healthz (from the scheduler's node)."""
        url = self.store_url(host)

        def healthy() -> bool:
            with StoreClient(url, timeout=2) as client:
                return client.health()

        self._wait(lambda: self.call(healthy), f"the daemon of {self.net.node(host).name}", timeout)

    def hosts_file(self) -> list[dict[str, Any]]:
        """The scheduler's hosts file: each host's daemon, its launch prefix, gloo's interface, its store root."""
        return [
            {"name": h.name, "address": h.address, "store_url": self.store_url(h), "gpus": self.gpus_per_host,
             "store_root": str(self.store_root(h)), "launch_prefix": self.net.exec_prefix(h),
             "env": {"GLOO_SOCKET_IFNAME": h.iface}, "pid": self.daemons[h.name].pid}
            for h in self.net.hosts
        ]

    def _start_scheduler(self) -> None:
        sched = self.net.scheduler
        self.state_dir.mkdir(parents=True, exist_ok=True)
        hosts_file = sched.root / "hosts.json"
        hosts_file.write_text(json.dumps(self.hosts_file(), indent=1))
        logf = open(sched.root / "scheduler.log", "ab")  # noqa: SIM115 - handed to the child process
        try:
            self.scheduler_proc = self.net.python(sched, [
                "-m", "tenplex", "--log-level", "INFO", "scheduler", "serve", "--backend", "local",
                "--state-dir", str(self.state_dir), "--host", sched.address, "--port", str(SCHEDULER_PORT),
                "--token", self.token, "--hosts-file", str(hosts_file), "--host-timeout", str(self.host_timeout),
            ], stdout=logf, stderr=subprocess.STDOUT, cwd=REPO)
        finally:
            logf.close()
        self._wait(lambda: self.api("jobs") is not None, "the scheduler")

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()
        procs = [p for p in [self.scheduler_proc, *self.daemons.values()] if p is not None]
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)

    def __enter__(self) -> EmulatedTenplex:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- talking to it -------------------------------------------------------------------------

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn`` in a thread inside the scheduler's namespace (where the cluster's addresses are reachable)."""
        return self.net.call(self.net.scheduler, fn, *args, **kwargs)

    def api(self, method: str, *args: Any) -> Any:
        """A :class:`SchedulerClient` call (``"create"``, ``"job"``, ``"scale"``, ...) made from the scheduler's node."""
        return self.call(lambda: getattr(SchedulerClient(self.scheduler_url, self.token, timeout=30), method)(*args))

    def store(self, host: str | EmuNode, method: str, *args: Any, **kwargs: Any) -> Any:
        """A :class:`StoreClient` call on ``host``'s daemon, made from the scheduler's node."""
        url = self.store_url(host)

        def go() -> Any:
            client = self._clients.get(url)
            if client is None:
                client = self._clients[url] = StoreClient(url, self.token, timeout=30)
            return getattr(client, method)(*args, **kwargs)

        return self.call(go)

    def kill_host(self, host: str | EmuNode) -> list[int]:
        """A host crashes: every process in its namespace (its daemon, its workers) is SIGKILLed; their pids."""
        node = self.net.node(host)
        out = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True, check=True).stdout
        pids = [int(p) for p in out.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def wait_job(self, name: str, pred: Callable[[Mapping[str, Any]], bool], what: str,
                 timeout: float = 300.0) -> Mapping[str, Any]:
        deadline = time.monotonic() + timeout
        status: Mapping[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                status = self.api("job", name)["status"]
            except TenplexError:
                time.sleep(0.3)
                continue
            if status["phase"] == "Failed":
                raise AssertionError(f"job {name} failed while {what}: {status['message']}")
            if pred(status):
                return status
            time.sleep(0.2)
        raise AssertionError(f"timed out while {what}; last status: {json.dumps(status)[:2000]}")

    def _wait(self, probe: Callable[[], Any], what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                if probe():
                    return
            except Exception as exc:  # not up yet
                last = exc
            time.sleep(0.1)
        raise NetClusterError(f"{what} did not come up within {timeout:.0f} s (last error: {last})")
