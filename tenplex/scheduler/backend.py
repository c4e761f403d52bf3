"""Cluster backends: where hosts come from and how worker processes are run.

The controller speaks only to :class:`Backend`. Two implementations:
``local`` (here: emulated hosts, one store daemon each on its own 127.0.0.x
address, workers as OS processes with torchrun's environment) and
``kubernetes`` (tenplex.k8s: pods on GPU nodes, the store as a DaemonSet).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tenplex.errors import InvalidConfig, NotFound, StoreUnavailable
from tenplex.scheduler.protocol import ENV_STORE_ROOT

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostInfo:
    """A node as the scheduler sees it."""

    name: str
    gpus: int
    store_url: str
    address: str
    ready: bool = True
    """False when the node is lost (NotReady, store unreachable)."""
    schedulable: bool = True
    """False when cordoned or draining: keep its state, move its workers off."""


@dataclass(frozen=True)
class WorkerLaunch:
    worker_id: str
    rank: int
    host: str
    local_rank: int
    env: Mapping[str, str]


class Backend(ABC):
    """The cluster as the scheduler needs it."""

    name: str

    @abstractmethod
    def hosts(self) -> list[HostInfo]:
        """All known hosts, ready or not, in a stable order."""

    def host(self, name: str) -> HostInfo:
        for h in self.hosts():
            if h.name == name:
                return h
        raise NotFound(f"host {name!r} is not known to the {self.name} backend")

    @abstractmethod
    def launch(self, job: str, command: Sequence[str], workers: Sequence[WorkerLaunch], log_dir: Path) -> dict[str, int | None]:
        """Start the workers; returns worker id -> process id (None where there is none to report)."""

    @abstractmethod
    def stop(self, job: str, worker_ids: Sequence[str], *, grace: float = 10.0) -> None:
        """Terminate workers (SIGTERM, then SIGKILL after ``grace`` seconds)."""

    @abstractmethod
    def exited(self, job: str, worker_ids: Sequence[str]) -> dict[str, int | None]:
        """Workers among ``worker_ids`` that are no longer running -> exit code (None: unknown)."""

    def adopt(self, job: str, pids: Mapping[str, int]) -> None:  # noqa: B027 - optional hook
        """Take over workers started by a previous scheduler process (after a restart)."""

    def master_port(self, host: HostInfo) -> int:
        """A free TCP port on ``host`` for torch.distributed's rendezvous, below the ephemeral range.

        Not port 0's answer: that is an ephemeral port, and until rank 0 binds
        it (seconds later, after the workers start) any outgoing connection on
        the machine may take it, which fails the rendezvous with EADDRINUSE.
        A port below the kernel's ephemeral range is only ever taken by a bind;
        the ones handed out recently are not handed out again for a while.
        """
        low = _ephemeral_low()
        if low is None:  # no room below the ephemeral range: the kernel's choice, raced as it is
            with socket.socket() as s:
                s.bind((host.address, 0))
                return s.getsockname()[1]
        now = time.monotonic()
        with _MASTER_PORTS_LOCK:
            for key, when in list(_MASTER_PORTS.items()):
                if now - when > _MASTER_PORT_HOLD_S:
                    del _MASTER_PORTS[key]
            start = random.randrange(_MASTER_PORT_FLOOR, low)
            for i in range(low - _MASTER_PORT_FLOOR):
                port = _MASTER_PORT_FLOOR + (start - _MASTER_PORT_FLOOR + i) % (low - _MASTER_PORT_FLOOR)
                if (host.address, port) in _MASTER_PORTS:
                    continue
                with socket.socket() as s:
                    try:
                        s.bind((host.address, port))
                    except OSError:
                        continue
                _MASTER_PORTS[(host.address, port)] = now
                return port
        raise InvalidConfig(f"no free rendezvous port on {host.address} in {_MASTER_PORT_FLOOR}-{low - 1}")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the backend holds (not the workers: they outlive a scheduler restart)."""


_MASTER_PORT_FLOOR = 20000
_MASTER_PORT_HOLD_S = 120.0
_MASTER_PORTS: dict[tuple[str, int], float] = {}  # (address, port) -> when it was handed out
_MASTER_PORTS_LOCK = threading.Lock()


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read); None when it
    leaves fewer than 1000 ports above :data:`_MASTER_PORT_FLOOR` below it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return low if low > _MASTER_PORT_FLOOR + 1000 else None


# -- the local backend -------------------------------------------------------------


@dataclass
class _LocalHost:
    info: HostInfo
    root: Path
    process: subprocess.Popen | None = None
    pid: int | None = None


@dataclass
class LocalCluster:
    """Emulated hosts on one machine: a store daemon per host, each on its own loopback address.

    The daemons are separate ``tenplex store serve`` processes in their own
    session, so they survive the scheduler being killed, as real nodes would.
    """

    root: Path
    token: str | None = None
    gpus_per_host: int = 2
    _hosts: dict[str, _LocalHost] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start_host(self, name: str, address: str, *, timeout: float = 60.0) -> HostInfo:
        """Start a store daemon for host ``name`` bound to ``address`` and wait until it answers."""
        root = Path(self.root) / name
        root.mkdir(parents=True, exist_ok=True)
        port_file = root / "store.port"
        port_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "tenplex", "store", "serve", "--root", str(root / "store"),
               "--host", address, "--port", "0", "--port-file", str(port_file)]
        env = dict(os.environ)
        if self.token:
            env["TENPLEX_TOKEN"] = self.token
        logf = open(root / "store.log", "ab")  # noqa: SIM115 - handed to the child process
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        logf.close()
        deadline = time.monotonic() + timeout
        while not port_file.exists() or not port_file.read_text().strip():
            if proc.poll() is not None:
                raise StoreUnavailable(f"store daemon for {name} exited with {proc.returncode}; see {root / 'store.log'}")
            if time.monotonic() > deadline:
                proc.kill()
                raise StoreUnavailable(f"store daemon for {name} did not start within {timeout:.0f}s; see {root / 'store.log'}")
            time.sleep(0.05)
        port = int(port_file.read_text().strip())
        info = HostInfo(name=name, gpus=self.gpus_per_host, store_url=f"http://{address}:{port}", address=address)
        with self._lock:
            self._hosts[name] = _LocalHost(info, root, proc, proc.pid)
        log.info("host %s: store daemon pid %d at %s", name, proc.pid, info.store_url)
        return info

    def start(self, count: int, *, first_address: int = 2) -> list[HostInfo]:
        """Start ``count`` hosts ``host-0..`` on ``127.0.0.<first_address + i>``."""
        if not 0 < count <= 200:
            raise InvalidConfig(f"host count must be in 1..200, got {count}")
        return [self.start_host(f"host-{i}", f"127.0.0.{first_address + i}") for i in range(count)]

    def hosts(self) -> list[HostInfo]:
        with self._lock:
            return [h.info for h in self._hosts.values()]

    def store_root(self, name: str) -> Path:
        """The root directory of ``name``'s store (its daemon's ``--root``), which its workers share."""
        with self._lock:
            h = self._hosts.get(name)
        if h is None:
            raise NotFound(f"host {name!r} is not part of this local cluster")
        return h.root / "store"

    def kill_host(self, name: str) -> None:
        """Lose a host: its store daemon dies (its workers are killed by the caller or the test)."""
        with self._lock:
            h = self._hosts.get(name)
            if h is None:
                raise NotFound(f"no local host {name!r}")
            h.info = replace(h.info, ready=False)
            pid = h.pid
        if pid is not None:
            _kill_group(pid, signal.SIGKILL)
        if h.process is not None:
            h.process.wait(timeout=10)

    def set_schedulable(self, name: str, schedulable: bool) -> None:
        """Cordon (False) or uncordon (True) a host."""
        with self._lock:
            h = self._hosts.get(name)
            if h is None:
                raise NotFound(f"no local host {name!r}")
            h.info = replace(h.info, schedulable=schedulable)

    def describe(self) -> list[dict[str, object]]:
        """What a restarted scheduler needs to reattach: name, address, URL, pid."""
        with self._lock:
            return [
                {"name": h.info.name, "address": h.info.address, "store_url": h.info.store_url, "gpus": h.info.gpus,
                 "pid": h.pid, "ready": h.info.ready, "schedulable": h.info.schedulable}
                for h in self._hosts.values()
            ]

    @classmethod
    def attach(cls, root: Path, hosts: Sequence[Mapping[str, object]], token: str | None = None) -> LocalCluster:
        """Re-attach to running store daemons described by :meth:`describe`."""
        cluster = cls(root=root, token=token)
        for h in hosts:
            info = HostInfo(
                name=str(h["name"]), gpus=int(h["gpus"]), store_url=str(h["store_url"]), address=str(h["address"]),  # type: ignore[call-overload]
                ready=bool(h.get("ready", True)), schedulable=bool(h.get("schedulable", True)),
            )
            pid = h.get("pid")
            cluster._hosts[info.name] = _LocalHost(info, Path(root) / info.name, None, int(pid) if pid else None)  # type: ignore[call-overload]
        return cluster

    def stop(self) -> None:
        """Stop every store daemon (end of a demo or test)."""
        with self._lock:
            hosts = list(self._hosts.values())
        for h in hosts:
            if h.pid is not None and h.info.ready:
                _kill_group(h.pid, signal.SIGTERM)
        for h in hosts:
            if h.process is not None:
                try:
                    h.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    _kill_group(h.process.pid, signal.SIGKILL)
                    h.process.wait(timeout=10)


class LocalBackend(Backend):
    """Workers as local processes (each in its own session) on emulated hosts."""

    name = "local"

    def __init__(self, cluster: LocalCluster, *, cwd: Path | None = None) -> None:
        self.cluster = cluster
        self.cwd = cwd
        self._procs: dict[tuple[str, str], subprocess.Popen] = {}
        self._adopted: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def hosts(self) -> list[HostInfo]:
        return self.cluster.hosts()

    def launch(self, job: str, command: Sequence[str], workers: Sequence[WorkerLaunch], log_dir: Path) -> dict[str, int | None]:
        if not command:
            raise InvalidConfig(f"job {job!r} has no worker command for the local backend")
        log_dir.mkdir(parents=True, exist_ok=True)
        pids: dict[str, int | None] = {}
        for w in workers:
            # All emulated hosts share this machine's loopback: gloo must bind there (the job's env may override).
            # Workers write their snapshots into their host's store directly (same machine, shared root).
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", ENV_STORE_ROOT: str(self.cluster.store_root(w.host)), **w.env}
            logf = open(log_dir / f"{w.worker_id}.log", "ab")  # noqa: SIM115 - handed to the child process
            try:
                proc = subprocess.Popen(list(command), env=env, stdout=logf, stderr=subprocess.STDOUT,
                                        cwd=self.cwd, start_new_session=True)
            finally:
                logf.close()
            with self._lock:
                self._procs[(job, w.worker_id)] = proc
            pids[w.worker_id] = proc.pid
            log.info("job %s: launched %s (rank %d on %s) pid %d", job, w.worker_id, w.rank, w.host, proc.pid)
        return pids

    def adopt(self, job: str, pids: Mapping[str, int]) -> None:
        with self._lock:
            for wid, pid in pids.items():
                if (job, wid) not in self._procs:
                    self._adopted[(job, wid)] = pid

    def stop(self, job: str, worker_ids: Sequence[str], *, grace: float = 10.0) -> None:
        targets: list[tuple[str, int, subprocess.Popen | None]] = []
        with self._lock:
            for wid in worker_ids:
                proc = self._procs.get((job, wid))
                if proc is not None:
                    targets.append((wid, proc.pid, proc))
                elif (job, wid) in self._adopted:
                    targets.append((wid, self._adopted[(job, wid)], None))
        for _wid, pid, _proc in targets:
            _kill_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for _wid, pid, proc in targets:
            while _running(pid, proc) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _running(pid, proc):
                _kill_group(pid, signal.SIGKILL)
                if proc is not None:
                    proc.wait(timeout=10)

    def exited(self, job: str, worker_ids: Sequence[str]) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        with self._lock:
            for wid in worker_ids:
                proc = self._procs.get((job, wid))
                if proc is not None:
                    code = proc.poll()
                    if code is not None:
                        out[wid] = code
                elif (job, wid) in self._adopted:
                    if not _running(self._adopted[(job, wid)], None):
                        out[wid] = None
                else:
                    out[wid] = None
        return out

    def kill_worker(self, job: str, worker_id: str, sig: int = signal.SIGKILL) -> None:
        """Fault injection for the demo and tests: kill one worker process."""
        with self._lock:
            proc = self._procs.get((job, worker_id))
            pid = proc.pid if proc is not None else self._adopted.get((job, worker_id))
        if pid is None:
            raise NotFound(f"job {job!r} has no running worker {worker_id!r}")
        os.kill(pid, sig)


def _running(pid: int, proc: subprocess.Popen | None) -> bool:
    if proc is not None:
        return proc.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not reaped by its dead parent) is not running
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _kill_group(pid: int, sig: int) -> None:
    """Signal the process group (the worker and anything it started); fall back to the process."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
