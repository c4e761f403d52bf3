"""Cluster backends: where hosts come from and how worker processes are run.

The controller speaks only to :class:`Backend`. Two implementations:
``local`` (here: emulated hosts, one store daemon each on its own 127.0.0.x
address, workers as OS processes with torchrun's environment) and
``kubernetes`` (tenplex.k8s: pods on GPU nodes, the store as a DaemonSet).
"""

from __future__ import annotations

import contextlib
import errno
import http.client
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from tenplex.errors import InvalidConfig, InvalidInput, NotFound, StoreUnavailable
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

    def set_schedulable(self, host: str, schedulable: bool) -> None:
        """Cordon (False) or uncordon (True) ``host`` for the scheduler's own API.

        Backends whose cluster has its own way (``kubectl cordon`` on Kubernetes)
        refuse: the cluster is the truth, and the backend follows it.
        """
        raise InvalidInput(f"the {self.name} backend takes {'uncordon' if schedulable else 'cordon'} from the "
                           "cluster itself, not from the scheduler's API")

    @abstractmethod
    def master_port(self, host: HostInfo) -> int:
        """A TCP port on ``host`` for torch.distributed's rendezvous of a new generation's rank 0."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the backend holds (not the workers: they outlive a scheduler restart)."""


class RendezvousPorts:
    """Hands out rendezvous ports on hosts whose ports this machine can probe (the local backend).

    Not port 0's answer: that is an ephemeral port, and until rank 0 binds it
    (seconds later, after the workers start) any outgoing connection on the
    machine may take it, which fails the rendezvous with EADDRINUSE. A port
    below the kernel's ephemeral range is only ever taken by a bind; the ones
    handed out recently (``hold`` seconds) are not handed out again, so two
    generations launched back to back never share one.
    """

    FLOOR = 20000

    def __init__(self, *, hold: float = 120.0) -> None:
        self.hold = hold
        self._given: dict[tuple[str, int], float] = {}  # (address, port) -> when it was handed out
        self._lock = threading.Lock()

    def pick(self, address: str) -> int:
        low = _ephemeral_low()
        if low is None:  # no room below the ephemeral range: the kernel's choice, raced as it is
            with socket.socket() as s:
                s.bind((address, 0))
                return s.getsockname()[1]
        floor = self.FLOOR
        now = time.monotonic()
        with self._lock:
            for key, when in list(self._given.items()):
                if now - when > self.hold:
                    del self._given[key]
            start = random.randrange(floor, low)
            for i in range(low - floor):
                port = floor + (start - floor + i) % (low - floor)
                if (address, port) in self._given:
                    continue
                with socket.socket() as s:
                    try:
                        s.bind((address, port))
                    except OSError as exc:
                        # Not an address of this machine (a host elsewhere, or in another network namespace):
                        # its ports cannot be probed from here; the ones handed out recently are still avoided.
                        if exc.errno != errno.EADDRNOTAVAIL:
                            continue
                self._given[(address, port)] = now
                return port
        raise InvalidConfig(f"no free rendezvous port on {address} in {floor}-{low - 1}")


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read); None when it
    leaves fewer than 1000 ports above :attr:`RendezvousPorts.FLOOR` below it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return low if low > RendezvousPorts.FLOOR + 1000 else None


# -- the local backend -------------------------------------------------------------


@dataclass
class _LocalHost:
    info: HostInfo
    root: Path
    process: subprocess.Popen | None = None
    pid: int | None = None
    store_root: Path | None = None
    """The store's directory as workers on the host see it (None: they use the daemon's URL)."""
    launch_prefix: tuple[str, ...] = ()
    """argv prefix that runs a command on the host (e.g. ``ip netns exec NS``, ``ssh HOST``); empty: here."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment for the host's workers (e.g. ``GLOO_SOCKET_IFNAME`` of its interface)."""
    managed: bool = True
    """Whether this cluster started the daemon (and stops it); hosts from a hosts file are not."""
    unanswered_since: float | None = None
    """When its daemon's /healthz first went unanswered (the health watch), None while it answers."""


@dataclass
class LocalCluster:
    """The local backend's hosts: a store daemon per host, on this machine or reachable from it.

    Started here (:meth:`start`, the demo and the embedded default): each
    host's daemon is a separate ``tenplex store serve`` process in its own
    session on its own loopback address, so it survives the scheduler being
    killed, as a real node would. Described (:meth:`attach`, a hosts file):
    daemons started by someone else, each maybe with an argv prefix that runs a
    command on its host (``ip netns exec NS``, ``ssh HOST``), environment for
    its workers, and the directory of its store as its workers see it.

    :meth:`watch` keeps every host's ``ready`` flag true to life: a host whose
    daemon process is gone, or whose daemon has not answered ``/healthz`` for
    ``lost_after`` seconds, is lost (and ready again once it answers).
    """

    root: Path
    token: str | None = None
    gpus_per_host: int = 2
    _hosts: dict[str, _LocalHost] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _watch_stop: threading.Event = field(default_factory=threading.Event)
    _watcher: threading.Thread | None = None

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
            self._hosts[name] = _LocalHost(info, root, proc, proc.pid, store_root=root / "store")
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

    def _host(self, name: str) -> _LocalHost:
        with self._lock:
            h = self._hosts.get(name)
        if h is None:
            raise NotFound(f"host {name!r} is not part of this local cluster")
        return h

    def store_root(self, name: str) -> Path | None:
        """The directory of ``name``'s store as its workers see it (its daemon's ``--root``); None when the
        workers reach their store only through the daemon."""
        return self._host(name).store_root

    def launch_prefix(self, name: str) -> tuple[str, ...]:
        """The argv prefix that runs a command on host ``name`` (empty: on this machine, as it is)."""
        return self._host(name).launch_prefix

    def host_env(self, name: str) -> Mapping[str, str]:
        return self._host(name).env

    def set_schedulable(self, name: str, schedulable: bool) -> None:
        """Cordon (False) or uncordon (True) a host."""
        h = self._host(name)
        with self._lock:
            h.info = replace(h.info, schedulable=schedulable)

    # -- health -------------------------------------------------------------------

    def watch(self, *, interval: float = 1.0, lost_after: float = 5.0) -> None:
        """Probe every host's daemon every ``interval`` seconds in a background thread (see the class doc)."""
        if interval <= 0 or lost_after <= 0:
            raise InvalidConfig(f"health watch: interval {interval} and lost_after {lost_after} must be > 0")
        if self._watcher is not None:
            return
        self._watch_stop.clear()

        def loop() -> None:
            while not self._watch_stop.wait(interval):
                try:
                    self.check_health(lost_after=lost_after)
                except Exception:  # the watch must outlive anything one round meets
                    log.exception("host health check failed")

        self._watcher = threading.Thread(target=loop, name="tenplex-host-health", daemon=True)
        self._watcher.start()

    def check_health(self, *, lost_after: float = 5.0, probe_timeout: float = 1.0) -> list[str]:
        """One round of the health watch; answers the hosts whose ``ready`` changed."""
        with self._lock:
            hosts = list(self._hosts.values())
        if not hosts:
            return []
        with ThreadPoolExecutor(max_workers=min(32, len(hosts)), thread_name_prefix="tenplex-health") as pool:
            answers = list(pool.map(lambda h: _answers(h.info.store_url, probe_timeout), hosts))
        changed = []
        now = time.monotonic()
        for h, answered in zip(hosts, answers, strict=True):
            gone = h.pid is not None and not _running(h.pid, h.process)
            with self._lock:
                if answered and not gone:
                    h.unanswered_since = None
                    ready = True
                else:
                    if h.unanswered_since is None:
                        h.unanswered_since = now
                    ready = h.info.ready and not gone and now - h.unanswered_since < lost_after
                if ready == h.info.ready:
                    continue
                h.info = replace(h.info, ready=ready)
            changed.append(h.info.name)
            if ready:
                log.warning("host %s: its store daemon answers again; the host is usable", h.info.name)
            else:
                log.warning("host %s lost: its store daemon %s", h.info.name,
                            "process is gone" if gone else f"did not answer for {lost_after:.0f} s")
        return changed

    # -- description ------------------------------------------------------------------

    def describe(self) -> list[dict[str, object]]:
        """What a restarted scheduler needs to reattach (the hosts file format, see :meth:`attach`)."""
        with self._lock:
            out = []
            for h in self._hosts.values():
                d: dict[str, object] = {
                    "name": h.info.name, "address": h.info.address, "store_url": h.info.store_url, "gpus": h.info.gpus,
                    "pid": h.pid, "ready": h.info.ready, "schedulable": h.info.schedulable, "managed": h.managed,
                }
                if h.store_root is not None:
                    d["store_root"] = str(h.store_root)
                if h.launch_prefix:
                    d["launch_prefix"] = list(h.launch_prefix)
                if h.env:
                    d["env"] = dict(h.env)
                out.append(d)
            return out

    @classmethod
    def attach(cls, root: Path, hosts: Sequence[Mapping[str, object]], token: str | None = None) -> LocalCluster:
        """Hosts whose daemons already run: described by :meth:`describe` (a restarted scheduler) or by a
        hosts file (JSON list; per host ``name``, ``address``, ``store_url``, ``gpus``, and optionally
        ``store_root``, ``launch_prefix`` (argv list), ``env`` (object), ``pid``, ``schedulable``)."""
        cluster = cls(root=root, token=token)
        for i, h in enumerate(hosts):
            cluster._hosts_add(_parse_host(h, i, Path(root)))
        return cluster

    def _hosts_add(self, host: _LocalHost) -> None:
        if host.info.name in self._hosts:
            raise InvalidConfig(f"host {host.info.name!r} is described twice")
        self._hosts[host.info.name] = host

    def unwatch(self) -> None:
        """Stop the health watch (the hosts keep running)."""
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
            self._watcher = None

    def stop(self) -> None:
        """Stop the watch and every store daemon this cluster started (end of a demo or test)."""
        self.unwatch()
        with self._lock:
            hosts = [h for h in self._hosts.values() if h.managed]
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


def _parse_host(h: Mapping[str, object], index: int, root: Path) -> _LocalHost:
    """One host of a hosts file / :meth:`LocalCluster.describe`, checked."""
    where = f"host {index} ({h.get('name', '?')!r})" if isinstance(h, Mapping) else f"host {index}"
    if not isinstance(h, Mapping):
        raise InvalidConfig(f"{where}: a host is a JSON object, got {type(h).__name__}")
    unknown = sorted(set(h) - {"name", "address", "store_url", "gpus", "pid", "ready", "schedulable", "managed",
                               "store_root", "launch_prefix", "env"})
    if unknown:
        raise InvalidConfig(f"{where}: unknown fields {', '.join(unknown)}")
    missing = [k for k in ("name", "address", "store_url", "gpus") if k not in h]
    if missing:
        raise InvalidConfig(f"{where}: missing {', '.join(missing)}")
    name, address, url, gpus = h["name"], h["address"], h["store_url"], h["gpus"]
    if not isinstance(name, str) or not name or not isinstance(address, str) or not isinstance(url, str):
        raise InvalidConfig(f"{where}: name, address and store_url must be strings")
    if not url.startswith(("http://", "https://")):
        raise InvalidConfig(f"{where}: store_url {url!r} must look like http://HOST:PORT")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise InvalidConfig(f"{where}: gpus must be a positive integer, got {gpus!r}")
    prefix = h.get("launch_prefix", [])
    if not isinstance(prefix, list) or not all(isinstance(a, str) for a in prefix):
        raise InvalidConfig(f"{where}: launch_prefix must be a list of strings")
    env = h.get("env", {})
    if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise InvalidConfig(f"{where}: env must map names to strings")
    pid = h.get("pid")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int)):
        raise InvalidConfig(f"{where}: pid must be an integer")
    store_root = h.get("store_root")
    if store_root is not None and not isinstance(store_root, str):
        raise InvalidConfig(f"{where}: store_root must be a path")
    info = HostInfo(name=name, gpus=gpus, store_url=url, address=address, ready=bool(h.get("ready", True)),
                    schedulable=bool(h.get("schedulable", True)))
    return _LocalHost(info, root / name, None, pid, store_root=Path(store_root) if store_root else None,
                      launch_prefix=tuple(prefix), env=dict(env), managed=bool(h.get("managed", False)))


def _answers(url: str, timeout: float) -> bool:
    """Whether the daemon at ``url`` answers ``GET /healthz`` with 200 within ``timeout``."""
    parts = url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = parts.rpartition(":")
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    try:
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        resp.read()
        return resp.status == 200
    except (OSError, http.client.HTTPException, ValueError):
        return False
    finally:
        conn.close()


class LocalBackend(Backend):
    """Workers as local processes (each in its own session) on emulated hosts."""

    name = "local"

    def __init__(self, cluster: LocalCluster, *, cwd: Path | None = None, host_timeout: float | None = 10.0) -> None:
        """``host_timeout``: a host whose daemon does not answer for this long is lost (None: not watched)."""
        self.cluster = cluster
        self.cwd = cwd
        self._procs: dict[tuple[str, str], subprocess.Popen] = {}
        self._adopted: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._ports = RendezvousPorts()
        if host_timeout is not None:
            cluster.watch(interval=min(1.0, host_timeout / 3), lost_after=host_timeout)

    def close(self) -> None:
        self.cluster.unwatch()

    def hosts(self) -> list[HostInfo]:
        return self.cluster.hosts()

    def master_port(self, host: HostInfo) -> int:
        return self._ports.pick(host.address)

    def set_schedulable(self, host: str, schedulable: bool) -> None:
        self.cluster.set_schedulable(host, schedulable)

    def launch(self, job: str, command: Sequence[str], workers: Sequence[WorkerLaunch], log_dir: Path) -> dict[str, int | None]:
        if not command:
            raise InvalidConfig(f"job {job!r} has no worker command for the local backend")
        log_dir.mkdir(parents=True, exist_ok=True)
        pids: dict[str, int | None] = {}
        for w in workers:
            # Emulated hosts share this machine's loopback: gloo binds there unless the host's or the job's
            # environment says otherwise. Workers write their snapshots into their host's store directly when
            # they see its directory; a host may run them elsewhere through its launch prefix.
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", **self.cluster.host_env(w.host), **w.env}
            root = self.cluster.store_root(w.host)
            if root is not None:
                env[ENV_STORE_ROOT] = str(root)
            argv = [*self.cluster.launch_prefix(w.host), *command]
            logf = open(log_dir / f"{w.worker_id}.log", "ab")  # noqa: SIM115 - handed to the child process
            try:
                proc = subprocess.Popen(argv, env=env, stdout=logf, stderr=subprocess.STDOUT,
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
