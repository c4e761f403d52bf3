"""Cluster backends: where hosts come from and how worker processes are run.

The controller speaks only to :class:`Backend`. Two implementations:
``local`` (here: emulated hosts, one store daemon each on its own 127.0.0.x
address, workers as OS processes with torchrun's environment) and
``kubernetes`` (tenplex.k8s: pods on GPU nodes, the store as a DaemonSet).
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from tenplex.core.auth import ENV_AUTH_KEYS
from tenplex.core.commands import PythonCommand, signal_group
from tenplex.core.protocol import ENV_STORE_ROOT
from tenplex.core.standby import StandbyClient
from tenplex.core.tls import client_context
from tenplex.errors import InvalidConfig, InvalidInput, NotFound, StoreUnavailable, TenplexError
from tenplex.sockets import free_port

log = logging.getLogger(__name__)

TRANSIENT_API_STATUS = frozenset({429, 500, 502, 503, 504})
"""HTTP statuses of a cluster API's answer that say "come back later" (throttled; a restarting or overloaded
server, e.g. kube-apiserver before its storage is ready): a backend lets the API client's exception for them
through unchanged, and the job's controller repeats the step (see :mod:`tenplex.scheduler.controller`)."""


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

    def heard_from(self, host: str) -> None:  # noqa: B027 - optional hook
        """``host``'s node daemon reported just now (it relayed its workers' heartbeats, or answered one of the
        scheduler's requests during a change): a backend that probes its hosts' daemons may skip the next probe
        of this one."""

    def gpus_held_by(self, job: str, worker_ids: Sequence[str]) -> dict[str, int]:
        """Host -> GPUs that :meth:`hosts` counts as taken by these workers of ``job`` (empty for a backend
        whose hosts report all their GPUs). A reconfiguration places its new workers on them: the launch
        stops the old workers, and waits until they are gone, before it starts the new ones."""
        return {}

    supports_standby: bool = False
    """Whether :meth:`keep_standby` keeps warm standbys (see :mod:`tenplex.standby`)."""

    def keep_standby(self, job: str, command: Sequence[str], env: Mapping[str, str], log_dir: Path) -> int:
        """Keep a warm standby of ``job`` on every usable host (started in the background; the next
        :meth:`launch` on that host forks its workers from it instead of starting fresh processes); how many
        standbys that is."""
        raise InvalidConfig(f"the {self.name} backend keeps no standbys")

    def release(self, job: str) -> None:  # noqa: B027 - optional hook
        """End what the backend keeps for ``job`` besides its workers (its standbys)."""

    def standby_ready(self, job: str) -> int:
        """How many standbys of ``job`` have their imports done."""
        return 0

    def forget_standbys(self, job: str) -> None:
        """The job's spec changed: its standbys (made with the old command and environment) must start no more
        workers; the running workers are left alone. By default the same as :meth:`release`; a backend whose
        standbys run the current workers themselves tells stale ones apart at its next launch instead."""
        self.release(job)

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

    Below the kernel's ephemeral range (:func:`tenplex.sockets.free_port` says
    why); the ones handed out recently (``hold`` seconds) are not handed out
    again, so two generations launched back to back never share one.
    """

    def __init__(self, *, hold: float = 120.0) -> None:
        self.hold = hold
        self._given: dict[tuple[str, int], float] = {}  # (address, port) -> when it was handed out
        self._lock = threading.Lock()

    def pick(self, address: str) -> int:
        now = time.monotonic()
        with self._lock:
            for key, when in list(self._given.items()):
                if now - when > self.hold:
                    del self._given[key]
            recent = frozenset(port for (addr, port) in self._given if addr == address)
            try:
                port = free_port(address, avoid=recent)
            except OSError as exc:
                raise InvalidConfig(f"no free rendezvous port on {address}: {exc.strerror}") from exc
            self._given[(address, port)] = now
            return port


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
    """Since when its daemon has been silent, once a probe went unanswered (the health watch): when it was last
    heard (an answered probe, a relay, an answer to the scheduler), or the first unanswered probe of a daemon never
    heard; None while it answers."""
    heard_at: float = float("-inf")
    """When (the cluster's clock) its daemon last answered a probe or reported to the scheduler: alive then."""


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

    With ``scheduler_url`` the started daemons relay their workers' heartbeats
    to that scheduler every ``relay_interval`` seconds, one report per node
    (:mod:`tenplex.node.relay`); a hosts file's daemons relay when they were
    started with it (their workers ask).

    ``memory_bytes`` gives each started host's daemon a memory tier of that
    budget (:mod:`tenplex.store.tiers`) in ``memory_root``/<host> (default: a
    new directory on ``/dev/shm``, removed by :meth:`stop`): the workers,
    which write into their host's store root directly, then snapshot into that
    memory, where peers read it at once, and the daemon spills it to disk.

    :meth:`watch` keeps every host's ``ready`` flag true to life: a host whose
    daemon process is gone, or whose daemon has not been heard (answered
    ``/healthz``, relayed, answered the scheduler) for ``lost_after`` seconds,
    is lost (and ready again once it answers a probe). A daemon heard within
    the last ``lost_after / 3`` seconds is not probed: during a change of a
    16,384-worker job no node relays for minutes, and probing all 2,048 every
    second cost the scheduler 11-12% of a core.
    """

    root: Path
    token: str | None = None
    auth_keys: Path | None = None
    """The key set the started daemons verify the scheduler's job-scoped credentials with."""
    gpus_per_host: int = 2
    memory_bytes: int | None = None
    memory_root: Path | None = None
    scheduler_url: str | None = None
    relay_interval: float = 1.0
    _own_memory_root: bool = False
    _hosts: dict[str, _LocalHost] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _watch_stop: threading.Event = field(default_factory=threading.Event)
    _watcher: threading.Thread | None = None
    _probes: dict[str, http.client.HTTPConnection] = field(default_factory=dict)
    """The health watch's kept-alive connection to each daemon (a new connection per probe and second cost the
    scheduler as much again: 11% of a core at 2,048 hosts)."""
    clock: Callable[[], float] = time.monotonic
    """The health watch's clock (seconds, never going back): when a daemon was heard, how long it has been
    silent. A test sets its own to check the loss bound exactly."""

    def start_host(self, name: str, address: str, *, timeout: float = 60.0) -> HostInfo:
        """Start a store daemon for host ``name`` bound to ``address`` and wait until it answers."""
        root = Path(self.root) / name
        root.mkdir(parents=True, exist_ok=True)
        port_file = root / "store.port"
        port_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "tenplex", "store", "serve", "--root", str(root / "store"),
               "--host", address, "--port", "0", "--port-file", str(port_file), *self._memory_flags(name),
               # its hosts share this machine's memory: no daemon holds transform buffers between transforms
               "--transform-resident", "0"]
        if self.scheduler_url:
            cmd += ["--scheduler-url", self.scheduler_url, "--relay-interval", str(self.relay_interval)]
        env = dict(os.environ)
        if self.token:
            env["TENPLEX_TOKEN"] = self.token
        if self.auth_keys is not None:
            env[ENV_AUTH_KEYS] = str(self.auth_keys)
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

    def _memory_flags(self, name: str) -> list[str]:
        """The daemon flags of host ``name``'s memory tier (none without ``memory_bytes``)."""
        if self.memory_bytes is None:
            if self.memory_root is not None:
                raise InvalidConfig("a memory tier directory was given without its budget (memory_bytes)")
            return []
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes < 1:
            raise InvalidConfig(f"memory_bytes must be a positive number of bytes, got {self.memory_bytes!r}")
        if self.memory_root is None:
            shm = Path("/dev/shm")
            if not (shm.is_dir() and os.access(shm, os.W_OK)):
                raise InvalidConfig("no memory tier directory given and /dev/shm is not writable here")
            self.memory_root = shm / f"tenplex-{uuid.uuid4().hex[:12]}"
            self._own_memory_root = True
        return ["--memory-root", str(Path(self.memory_root) / name), "--memory-bytes", str(self.memory_bytes)]

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
        """Look at every host every ``interval`` seconds in a background thread (see the class doc): probe the
        daemons not heard within ``heard_within(interval, lost_after)`` seconds."""
        if interval <= 0 or lost_after <= 0:
            raise InvalidConfig(f"health watch: interval {interval} and lost_after {lost_after} must be > 0")
        if self._watcher is not None:
            return
        self._watch_stop.clear()
        within = heard_within(interval, lost_after)

        def loop() -> None:
            while not self._watch_stop.wait(interval):
                try:
                    self.check_health(lost_after=lost_after, heard_within=within)
                except Exception:  # the watch must outlive anything one round meets
                    log.exception("host health check failed")

        self._watcher = threading.Thread(target=loop, name="tenplex-host-health", daemon=True)
        self._watcher.start()

    def heard_from(self, name: str) -> None:
        """Host ``name``'s daemon reported just now: the health watch need not probe it this round."""
        h = self._hosts.get(name)
        if h is not None:
            h.heard_at = self.clock()

    def check_health(self, *, lost_after: float = 5.0, probe_timeout: float = 1.0,
                     heard_within: float = 0.0) -> list[str]:
        """One round of the health watch; answers the hosts whose ``ready`` changed. A ready host whose daemon
        was heard within ``heard_within`` seconds (an answered probe; a relay of its workers' heartbeats, every
        second; its answers during a change) answers without a probe: at 2,048 hosts the probes alone cost the
        scheduler a fifth of a core. A host is lost only in a round whose probe of it went unanswered, and
        there once it has been silent ``lost_after`` seconds since it was last heard (since its first unanswered
        probe when never heard): with ``heard_within < lost_after`` that is no later than the first round from
        ``lost_after`` after it was last heard."""
        with self._lock:
            hosts = list(self._hosts.values())
        if not hosts:
            return []
        start = self.clock()
        heard = [h.info.ready and start - h.heard_at <= heard_within for h in hosts]
        probe = [h for h, ok in zip(hosts, heard, strict=True) if not ok]
        probed: Iterator[bool] = iter(())
        if probe:
            with ThreadPoolExecutor(max_workers=min(32, len(probe)), thread_name_prefix="tenplex-health") as pool:
                probed = iter(list(pool.map(lambda h: self._probe(h.info.store_url, probe_timeout), probe)))
        answers = [ok or next(probed) for ok in heard]
        changed = []
        now = self.clock()
        for h, answered, skipped in zip(hosts, answers, heard, strict=True):
            gone = h.pid is not None and not _running(h.pid, h.process)
            with self._lock:
                if answered and not gone:
                    if not skipped:  # it answered this round's probe: heard then
                        h.heard_at = max(h.heard_at, start)
                    h.unanswered_since = None
                    ready = True
                else:
                    if h.unanswered_since is None:  # silent since it was last heard
                        h.unanswered_since = h.heard_at if h.heard_at > float("-inf") else now
                    ready = h.info.ready and not gone and now - h.unanswered_since < lost_after
                if ready == h.info.ready:
                    continue
                h.info = replace(h.info, ready=ready)
            changed.append(h.info.name)
            if ready:
                log.warning("host %s: its store daemon answers again; the host is usable", h.info.name)
            else:
                log.warning("host %s lost: its store daemon %s", h.info.name,
                            "process is gone" if gone else f"was not heard for {lost_after:.0f} s")
        return changed

    def _probe(self, url: str, timeout: float) -> bool:
        """Whether the daemon at ``url`` answers ``/healthz``, on the connection kept from its last probe (once
        more on a new one when the daemon had closed that)."""
        with self._lock:
            conn = self._probes.pop(url, None)
        for reused in ((True, False) if conn is not None else (False,)):
            if not reused:
                conn = _connection(url, timeout)
                if conn is None:
                    return False
            assert conn is not None
            answered, open_ = _answers_on(conn)
            if answered and open_:
                with self._lock:
                    old = self._probes.pop(url, None)
                    self._probes[url] = conn
                if old is not None:
                    old.close()
            else:
                conn.close()
            if answered:
                return True
        return False

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
        with self._lock:
            probes, self._probes = list(self._probes.values()), {}
        for conn in probes:
            conn.close()

    def stop(self) -> None:
        """Stop the watch and every store daemon this cluster started (end of a demo or test)."""
        self.unwatch()
        with self._lock:
            hosts = [h for h in self._hosts.values() if h.managed]
        for h in hosts:
            if h.pid is not None and h.info.ready:
                signal_group(h.pid, signal.SIGTERM)
        for h in hosts:
            if h.process is not None:
                try:
                    h.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    signal_group(h.process.pid, signal.SIGKILL)
                    h.process.wait(timeout=10)
        if self._own_memory_root and self.memory_root is not None:
            shutil.rmtree(self.memory_root, ignore_errors=True)  # the tmpfs directory this cluster made


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


def heard_within(interval: float, lost_after: float) -> float:
    """How long a daemon heard (an answered probe, a relay) goes without a probe, for a health watch looking
    every ``interval`` seconds and losing a host silent ``lost_after`` seconds: a third of ``lost_after`` (two
    intervals if longer, so that a daemon relaying every interval is not probed), at most half of it, so that an
    unanswered probe comes before a silent host's ``lost_after`` ends and it is lost on time."""
    return min(max(2 * interval, lost_after / 3), lost_after / 2)


def _connection(url: str, timeout: float) -> http.client.HTTPConnection | None:
    """A (not yet connected) connection to the daemon at ``url`` with ``timeout`` (``https``: verified against
    ``$TENPLEX_TLS_CA``, see :mod:`tenplex.core.tls`); None for a URL without a usable host and port."""
    parts = url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = parts.rpartition(":")
    try:
        if url.startswith("https://"):
            return http.client.HTTPSConnection(host.strip("[]"), int(port), timeout=timeout, context=client_context())
        return http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    except ValueError:
        return None


def _answers_on(conn: http.client.HTTPConnection) -> tuple[bool, bool]:
    """Whether ``GET /healthz`` on ``conn`` is answered with 200, and whether the connection stays open."""
    try:
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        resp.read()
        return resp.status == 200, not resp.will_close
    except (OSError, http.client.HTTPException, ValueError):
        return False, False


class LocalBackend(Backend):
    """Workers as local processes (each in its own session) on emulated hosts."""

    name = "local"

    def __init__(self, cluster: LocalCluster, *, cwd: Path | None = None, host_timeout: float | None = 10.0) -> None:
        """``host_timeout``: a host whose daemon does not answer for this long is lost (None: not watched)."""
        self.cluster = cluster
        self.cwd = cwd
        self._procs: dict[tuple[str, str], subprocess.Popen] = {}
        self._adopted: dict[tuple[str, str], int] = {}
        self._standby: dict[tuple[str, str], _ForkServer] = {}  # (job, host) -> its warm standby
        self._forked: dict[tuple[str, str], tuple[_ForkServer, int]] = {}  # (job, worker) -> its standby, pid
        self._gone_since: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._ports = RendezvousPorts()
        if host_timeout is not None:
            cluster.watch(interval=min(1.0, host_timeout / 3), lost_after=host_timeout)

    def close(self) -> None:
        self.cluster.unwatch()
        with self._lock:
            jobs = {job for job, _host in self._standby}
        for job in jobs:
            self.release(job)

    def hosts(self) -> list[HostInfo]:
        return self.cluster.hosts()

    def heard_from(self, host: str) -> None:
        self.cluster.heard_from(host)

    def _worker_env(self, host: str, extra: Mapping[str, str]) -> dict[str, str]:
        # Emulated hosts share this machine's loopback: gloo binds there unless the host's or the job's
        # environment says otherwise. Workers write their snapshots into their host's store directly when
        # they see its directory; a host may run them elsewhere through its launch prefix.
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", **self.cluster.host_env(host), **extra}
        root = self.cluster.store_root(host)
        if root is not None:
            env[ENV_STORE_ROOT] = str(root)
        return env

    supports_standby = True

    def keep_standby(self, job: str, command: Sequence[str], env: Mapping[str, str], log_dir: Path) -> int:
        PythonCommand.parse(command)  # a command a standby cannot run is refused here, with the reason
        log_dir.mkdir(parents=True, exist_ok=True)
        for host in self.cluster.hosts():
            if not (host.ready and host.schedulable):
                continue
            with self._lock:
                server = self._standby.get((job, host.name))
                if server is not None and server.alive():
                    continue
            argv = [*self.cluster.launch_prefix(host.name), command[0], "-m", "tenplex", "worker", "standby",
                    "--", *command]
            server = _ForkServer.start(argv, self._worker_env(host.name, env), log_dir / f"standby-{host.name}.log",
                                       self.cwd)
            with self._lock:
                self._standby[(job, host.name)] = server
            log.info("job %s: standby pid %d on %s", job, server.proc.pid, host.name)
        with self._lock:
            return sum(1 for (j, _h), srv in self._standby.items() if j == job and srv.alive())

    def standby_ready(self, job: str) -> int:
        with self._lock:
            return sum(1 for (j, _h), srv in self._standby.items() if j == job and srv.alive() and srv.greeted)

    def release(self, job: str) -> None:
        """The job's standbys end (their input closes; workers they started keep running)."""
        with self._lock:
            servers = [srv for (j, _h), srv in self._standby.items() if j == job]
            for key in [k for k in self._standby if k[0] == job]:
                del self._standby[key]
        for srv in servers:
            srv.close()
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
            env = self._worker_env(w.host, w.env)
            log_path = log_dir / f"{w.worker_id}.log"
            with self._lock:
                server = self._standby.get((job, w.host))
            if server is not None and server.alive() and server.greeted:
                try:  # forked from the warm standby: no interpreter start, no imports
                    [pid] = server.launch([{"env": env, "log": str(log_path)}], timeout=30.0).values()
                except TenplexError as exc:
                    log.warning("job %s: the standby on %s could not start %s (%s); starting it afresh", job,
                                w.host, w.worker_id, exc.detail)
                else:
                    with self._lock:
                        self._forked[(job, w.worker_id)] = (server, pid)
                    pids[w.worker_id] = pid
                    log.info("job %s: launched %s (rank %d on %s) pid %d, forked from the standby", job,
                             w.worker_id, w.rank, w.host, pid)
                    continue
            argv = [*self.cluster.launch_prefix(w.host), *command]
            logf = open(log_path, "ab")  # noqa: SIM115 - handed to the child process
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
                elif (job, wid) in self._forked:
                    targets.append((wid, self._forked[(job, wid)][1], None))
                elif (job, wid) in self._adopted:
                    targets.append((wid, self._adopted[(job, wid)], None))
        for _wid, pid, _proc in targets:
            signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for _wid, pid, proc in targets:
            while _running(pid, proc) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _running(pid, proc):
                signal_group(pid, signal.SIGKILL)
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
                elif (job, wid) in self._forked:
                    server, pid = self._forked[(job, wid)]
                    code = server.exit_code_of(pid)  # its standby reaped it and said how it ended
                    if code is not None:
                        out[wid] = code
                    elif not _running(pid, None):
                        # Gone before its standby's report (the standby reaps every 0.2 s): give the report a
                        # moment; if the standby is gone too, the code stays unknown.
                        since = self._gone_since.setdefault((job, wid), time.monotonic())
                        if not server.alive() or time.monotonic() - since > _EXIT_REPORT_WAIT_S:
                            out[wid] = None
                elif (job, wid) in self._adopted:
                    if not _running(self._adopted[(job, wid)], None):
                        out[wid] = None
                else:
                    out[wid] = None
        return out


_EXIT_REPORT_WAIT_S = 2.0


class _ForkServer(StandbyClient):
    """A job's warm standby on one host (:mod:`tenplex.standby`): the standby protocol's client over the
    standby process's standard input and output (a thread reads its replies)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        super().__init__(f"pid {proc.pid}")
        self.proc = proc
        self._reader = threading.Thread(target=self._read, name=f"tenplex-standby-{proc.pid}", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path | None) -> _ForkServer:
        logf = open(log_path, "ab")  # noqa: SIM115 - handed to the child process
        try:
            proc = subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=logf, cwd=cwd, start_new_session=True)
        finally:
            logf.close()
        return cls(proc)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.heard(raw.decode(errors="replace").strip())
        self.lost(gone=True)

    def send(self, lines: Sequence[str], timeout: float) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("".join(line + "\n" for line in lines).encode())
            self.proc.stdin.flush()
        except (OSError, ValueError) as exc:
            raise StoreUnavailable(f"the standby (pid {self.proc.pid}) is gone: {exc}") from None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """No more workers: the standby exits (the ones it started go on)."""
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


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
