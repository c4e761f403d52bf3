"""Assembling a scheduler process: backend + state directory + REST app.

``tenplex scheduler serve`` runs it in the foreground; :class:`LocalScheduler`
runs a whole emulated cluster (store daemons on 127.0.0.x and the scheduler)
inside one process for the demo and the tests.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from tenplex.core.auth import ENV_AUTH_KEYS, Issuer, KeySet
from tenplex.core.files import atomic_write
from tenplex.core.tls import ServerTLS
from tenplex.errors import InvalidConfig
from tenplex.scheduler.api import create_app
from tenplex.scheduler.backend import LocalBackend, LocalCluster
from tenplex.scheduler.controller import SchedulerSettings
from tenplex.scheduler.service import Scheduler, SchedulerOptions
from tenplex.scheduler.service import build_scheduler as build_service
from tenplex.scheduler.state import StateDir
from tenplex.serving import BackgroundServer, bind_socket, serve_forever, url_for, write_port_file

log = logging.getLogger(__name__)

AUTH_KEYS_FILE = "auth-keys.json"
"""The local backend's own key set, in its state directory (mode 0600)."""


def local_cluster(state_dir: Path, hosts: int, gpus_per_host: int, token: str | None,
                  hosts_file: Path | None = None, *, memory_bytes: int | None = None,
                  memory_root: Path | None = None, auth_keys: Path | None = None,
                  scheduler_url: str | None = None, relay_interval: float = 1.0) -> LocalCluster:
    """Start the emulated hosts, or re-attach to them after a scheduler restart, or take the hosts a hosts
    file describes (their daemons run already; see :meth:`LocalCluster.attach`). ``memory_bytes`` (and
    ``memory_root``): the started hosts' store memory tier (see :class:`LocalCluster`); ``scheduler_url``:
    the started daemons relay their workers' heartbeats to it every ``relay_interval`` seconds."""
    described = state_dir / "cluster.json"
    if described.exists():
        cluster = LocalCluster.attach(state_dir / "cluster", json.loads(described.read_text()), token=token)
        log.info("re-attached to %d local hosts", len(cluster.hosts()))
        return cluster
    if hosts_file is not None:
        try:
            listed = json.loads(Path(hosts_file).read_text())
        except (OSError, ValueError) as exc:
            raise InvalidConfig(f"cannot read the hosts file {str(hosts_file)!r}: {exc}") from None
        if not isinstance(listed, list) or not listed:
            raise InvalidConfig(f"the hosts file {str(hosts_file)!r} must hold a non-empty JSON list of hosts")
        cluster = LocalCluster.attach(state_dir / "cluster", listed, token=token)
        save_cluster(state_dir, cluster)
        log.info("%d hosts from %s", len(listed), hosts_file)
        return cluster
    cluster = LocalCluster(root=state_dir / "cluster", token=token, gpus_per_host=gpus_per_host,
                           memory_bytes=memory_bytes, memory_root=memory_root, auth_keys=auth_keys,
                           scheduler_url=scheduler_url, relay_interval=relay_interval)
    cluster.start(hosts)
    save_cluster(state_dir, cluster)
    return cluster


def save_cluster(state_dir: Path, cluster: LocalCluster) -> None:
    atomic_write(state_dir / "cluster.json", json.dumps(cluster.describe(), indent=1), durable=True, make_parents=True)


def local_scheduler(options: SchedulerOptions) -> Scheduler:
    """The ``local`` backend (registered in Tenplex's entry points): emulated hosts or a hosts file, job records
    in the state directory."""
    state_dir = Path(options.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    keys = local_auth_keys(state_dir, options)
    settings = SchedulerSettings(url=options.url, token=options.token, heartbeat_interval=options.heartbeat_interval,
                                 credentials=Issuer(KeySet(keys)) if keys is not None else None)
    cluster = local_cluster(state_dir, options.hosts, options.gpus_per_host, options.token, options.hosts_file,
                            memory_bytes=options.memory_bytes, memory_root=options.memory_root, auth_keys=keys,
                            scheduler_url=options.url, relay_interval=options.heartbeat_interval)
    backend = LocalBackend(cluster, cwd=Path.cwd(), host_timeout=options.host_timeout)
    return Scheduler(backend, StateDir(state_dir), settings)


def local_auth_keys(state_dir: Path, options: SchedulerOptions) -> Path | None:
    """The key set of the local backend's job-scoped credentials: the one given; with a token and hosts of its
    own, one made once in the state directory (their daemons are started with it, so jobs are kept apart out of
    the box); else none (a hosts file's daemons run already: give them and the scheduler ``--auth-keys``)."""
    if options.auth_keys is not None:
        return Path(options.auth_keys)
    path = state_dir / AUTH_KEYS_FILE
    if path.exists():  # made at the first start: the daemons run with it
        return path
    if not options.token or options.hosts_file is not None or (state_dir / "cluster.json").exists():
        return None
    KeySet.generate(path)
    return path


def build_scheduler(backend_name: str, state_dir: Path, url: str, token: str | None, *, hosts: int = 2,
                    gpus_per_host: int = 2, heartbeat_interval: float = 1.0, hosts_file: Path | None = None,
                    host_timeout: float = 10.0, memory_bytes: int | None = None,
                    memory_root: Path | None = None, auth_keys: Path | None = None) -> Scheduler:
    """The scheduler on the registered backend ``backend_name`` (see :func:`tenplex.scheduler.service.build_scheduler`)."""
    return build_service(backend_name, SchedulerOptions(
        state_dir=Path(state_dir), url=url, token=token, heartbeat_interval=heartbeat_interval, hosts=hosts,
        gpus_per_host=gpus_per_host, hosts_file=hosts_file, host_timeout=host_timeout, memory_bytes=memory_bytes,
        memory_root=memory_root, auth_keys=auth_keys))


def serve(backend_name: str, state_dir: Path, host: str, port: int, token: str | None, *, hosts: int,
          gpus_per_host: int, port_file: Path | None = None, hosts_file: Path | None = None,
          host_timeout: float = 10.0, memory_bytes: int | None = None, memory_root: Path | None = None,
          auth_keys: Path | None = None, tls: ServerTLS | None = None) -> None:
    sock = bind_socket(host, port)
    url = url_for(host, sock.getsockname()[1], tls=tls is not None)
    scheduler = build_scheduler(backend_name, state_dir, url, token, hosts=hosts, gpus_per_host=gpus_per_host,
                                hosts_file=hosts_file, host_timeout=host_timeout, memory_bytes=memory_bytes,
                                memory_root=memory_root, auth_keys=auth_keys)
    recovered = scheduler.recover()
    if recovered:
        log.info("resumed jobs: %s", ", ".join(recovered))
    try:
        if port_file is not None:
            write_port_file(port_file, sock.getsockname()[1])
        log.info("scheduler (%s backend) listening on %s", backend_name, url)
        serve_forever(create_app(scheduler, token=token), sock, log_level="info", tls=tls)
    finally:
        scheduler.close()


class LocalScheduler:
    """A scheduler and its emulated hosts inside this process (the REST server runs in a thread)."""

    def __init__(self, state_dir: Path, *, hosts: int = 3, gpus_per_host: int = 2, token: str | None = None,
                 heartbeat_interval: float = 0.5, memory_bytes: int | None = None) -> None:
        self.state_dir = Path(state_dir)
        self._memory_bytes = memory_bytes
        """Each emulated host's store memory tier budget (on /dev/shm), None: none."""
        self.token = token
        self._sock_host = "127.0.0.1"
        self._hosts = hosts
        self._gpus = gpus_per_host
        self._heartbeat = heartbeat_interval
        self.scheduler: Scheduler | None = None
        self.server: BackgroundServer | None = None

    def start(self) -> LocalScheduler:
        # The app needs its URL before it serves: bind first, then build.
        sock = bind_socket(self._sock_host, 0)
        url = url_for(self._sock_host, sock.getsockname()[1])
        self.scheduler = build_scheduler("local", self.state_dir, url, self.token, hosts=self._hosts,
                                         gpus_per_host=self._gpus, heartbeat_interval=self._heartbeat,
                                         memory_bytes=self._memory_bytes)
        self.scheduler.recover()
        self.server = BackgroundServer(create_app(self.scheduler, token=self.token), sock=sock).start()
        return self

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    @property
    def cluster(self) -> LocalCluster:
        assert self.scheduler is not None
        backend = self.scheduler.backend
        assert isinstance(backend, LocalBackend)
        return backend.cluster

    def stop(self, *, stop_hosts: bool = True) -> None:
        if self.server is not None:
            self.server.stop()
        if self.scheduler is not None:
            for ctl in self.scheduler.list():
                with ctl.lock:
                    ids = [w.worker_id for w in ctl.status.workers]
                self.scheduler.backend.stop(ctl.spec.name, ids, grace=5.0)
            self.scheduler.close()
            if stop_hosts:
                self.cluster.stop()

    def __enter__(self) -> LocalScheduler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def token_from(value: str | None) -> str | None:
    return value or os.environ.get("TENPLEX_TOKEN") or None


def auth_keys_from(value: Path | None) -> Path | None:
    text = str(value) if value else os.environ.get(ENV_AUTH_KEYS)
    return Path(text) if text else None
