"""The node daemon's process: its app assembled from the package's routes and services, and how it is served.

It is what ``tenplex store serve`` starts (the chart's DaemonSet, the local
backend's emulated hosts): the store's routes (:mod:`tenplex.node.store_routes`),
the transform routes (:mod:`tenplex.node.transforms`) and the routes of
uploads to the persistent tier (:mod:`tenplex.node.uploads`) on one port,
behind one credential check (the admin token and, with a key set, the
scheduler's job-scoped credentials: :mod:`tenplex.core.auth`), optionally over
TLS (:mod:`tenplex.core.tls`), with one Prometheus registry. During a
reconfiguration this process pulls its host's new shards from the other
nodes' daemons and writes them into its own store; the scheduler only sends
it the plan. With a memory tier (``--memory-root``, ``--memory-bytes``) it
owns the tier (:class:`~tenplex.store.memory.MemoryTier`): it makes it,
records it in the store root (workers writing there directly use it too),
runs its one spiller and closes it.
Started for a scheduler (``--scheduler-url``), it relays its workers'
heartbeats to it as one report per node and interval
(:mod:`tenplex.node.relay`): liveness scales with nodes, not workers.

Serving: uvicorn with uvloop and httptools on a socket bound before it
starts (``port=0`` gives a real port at once, written to ``port_file`` for a
parent), optionally several worker processes on that socket.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tenplex.core.auth import ENV_AUTH_KEYS, Authenticator
from tenplex.core.tls import ENV_TLS_CERT, ENV_TLS_KEY, ServerTLS
from tenplex.errors import InvalidInput
from tenplex.node.relay import DEFAULT_INTERVAL_S, HeartbeatRelay, relay_router
from tenplex.node.store_routes import MULTIPROC_ENV, create_app
from tenplex.node.transforms import TransformService, TransformSettings, transform_router
from tenplex.node.uploads import UploadService, UploadSettings, upload_router
from tenplex.serving import (
    BackgroundServer,
    bind_socket,
    serve_forever,
    url_for,
    uvicorn_config,
    write_port_file,
)
from tenplex.store.local import LocalStore
from tenplex.store.memory import MemoryTier
from tenplex.store.wire import TOKEN_ENV

log = logging.getLogger(__name__)

_ROOT_ENV = "TENPLEX_STORE_ROOT"
_OPTIONS_ENV = "TENPLEX_STORE_OPTIONS"
_RELAY_ENV = "TENPLEX_STORE_RELAY"
"""The worker processes' relay configuration (JSON: scheduler URL, interval), set by the supervising one."""


def create_node_app(store: LocalStore, *, token: str | None, transforms: TransformSettings | None = None,
                    uploads: UploadSettings | None = None, auth_keys: str | Path | None = None,
                    relay: HeartbeatRelay | None = None, **store_options: Any) -> tuple[FastAPI, TransformService]:
    """The daemon's app over ``store`` and the transform service behind its transform routes (the upload
    service behind the upload routes is ``app.state.uploads``, the heartbeat relay ``app.state.relay``).

    ``token`` is the admin token; ``auth_keys`` (default ``$TENPLEX_AUTH_KEYS``) the key set whose signed
    credentials it accepts too. ``relay``: this node's workers' heartbeats go through it to its scheduler
    (None: the daemon relays none; its workers heartbeat their scheduler themselves). ``store_options`` go to
    :func:`tenplex.node.store_routes.create_app` (request size bounds).
    """
    auth = Authenticator.from_env(token, auth_keys)
    registry = CollectorRegistry(auto_describe=True)
    if store.memory is not None:
        registry.register(_MemoryTierCollector(store.memory))
    if relay is not None:
        registry.register(_RelayCollector(relay))
    service = TransformService(store, token=token, settings=transforms, registry=registry)
    upload_service = UploadService(store, settings=uploads, registry=registry)
    app = create_app(store, token=token, auth=auth, routers=[transform_router(service), upload_router(upload_service),
                                                             relay_router(relay)],
                     registry=registry, **store_options)
    app.state.transforms = service
    app.state.uploads = upload_service
    app.state.relay = relay
    return app, service


def serve(
    root: str | Path,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    *,
    port_file: str | Path | None = None,
    chunk_bytes: int | None = None,
    log_level: str = "info",
    tune_malloc: bool = True,
    map_chunks: bool = True,
    workers: int = 1,
    transforms: TransformSettings | None = None,
    uploads: UploadSettings | None = None,
    memory_root: str | Path | None = None,
    memory_bytes: int | None = None,
    evict_grace_s: float | None = None,
    spill_interval_s: float = 0.0,
    auth_keys: str | Path | None = None,
    tls: ServerTLS | None = None,
    scheduler_url: str | None = None,
    relay_interval_s: float = DEFAULT_INTERVAL_S,
) -> None:
    """Run the node daemon until interrupted (blocking). ``port=0`` picks a free port.

    ``scheduler_url``: relay this node's workers' heartbeats to that scheduler, one batch per job every
    ``relay_interval_s`` (:mod:`tenplex.node.relay`); None: relay none.

    ``memory_root`` and ``memory_bytes``: the store's memory tier (a tmpfs
    directory and its budget); this daemon owns it (records it in the root,
    spills it, each job's newest version at most every ``spill_interval_s``).
    Without them the root is recorded as having none.

    The bound URL is logged, and with ``port_file`` the port is written there
    (atomically) once the socket listens, so a parent process can find it.
    ``token`` defaults to the ``TENPLEX_TOKEN`` environment variable, ``auth_keys`` (the key set of signed
    credentials) to ``TENPLEX_AUTH_KEYS``; with ``tls`` it serves HTTPS. A
    transform still running when the daemon stops is recorded as
    ``interrupted`` (nothing of it committed); its scheduler submits it again.
    """
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    auth_keys = str(auth_keys) if auth_keys else os.environ.get(ENV_AUTH_KEYS) or None
    if workers < 1:
        raise InvalidInput(f"workers must be >= 1, got {workers}")
    transforms = transforms or TransformSettings()
    uploads = uploads or UploadSettings()
    if (memory_root is None) != (memory_bytes is None):
        raise InvalidInput("a memory tier needs both its directory (memory_root) and its budget (memory_bytes)")
    relay_config = {"scheduler_url": scheduler_url, "interval_s": relay_interval_s} if scheduler_url else None
    relay = HeartbeatRelay(**relay_config) if relay_config else None  # checked here, before anything starts
    options: dict[str, Any] = {"map_chunks": map_chunks}
    if chunk_bytes is not None:
        options["chunk_bytes"] = chunk_bytes
    # this process owns the tier: records it in the root (or that there is none) and runs its spiller
    tier = MemoryTier.open(root, memory_root, memory_bytes, evict_grace_s, owner=True)
    store = LocalStore(root, memory=tier, **options)
    if tier is not None:
        tier.start_spilling(interval_s=spill_interval_s)
    sock = bind_socket(host, port)
    bound = sock.getsockname()[1]
    if port_file is not None:
        write_port_file(port_file, bound)
    log.info(
        "tenplex node daemon serving %s at %s (auth %s, %d worker process%s; transforms: %d at once, %d reads each, "
        "%d MiB of buffers)",
        store.root, url_for(host, bound, tls=tls is not None),
        ("job-scoped credentials" if auth_keys else "admin token only") if token or auth_keys else "off", workers, "" if workers == 1 else "es",
        transforms.max_running, transforms.concurrency, transforms.memory_bytes >> 20,
    )
    if relay is not None:
        log.info("relaying this node's workers' heartbeats to %s every %.1fs", relay.scheduler_url, relay.interval_s)
    if workers > 1:
        try:
            _serve_workers(sock, store, token, workers, log_level, tune_malloc=tune_malloc, transforms=transforms,
                           uploads=uploads, auth_keys=auth_keys, tls=tls, relay=relay_config)
        finally:
            store.close()  # the spiller runs in this (the supervising) process
        log.info("tenplex node daemon at %s stopped", url_for(host, bound, tls=tls is not None))
        return
    if tune_malloc:
        _keep_freed_memory()
    app, service = create_node_app(store, token=token, transforms=transforms, uploads=uploads, auth_keys=auth_keys,
                                   relay=relay)
    try:
        serve_forever(app, sock, log_level=log_level, tls=tls)
    finally:
        service.close()
        app.state.uploads.close()
        store.close()
    log.info("tenplex node daemon at %s stopped", url_for(host, bound, tls=tls is not None))


def _serve_workers(sock: socket.socket, store: LocalStore, token: str | None, workers: int, log_level: str, *,
                   tune_malloc: bool, transforms: TransformSettings, uploads: UploadSettings,
                   auth_keys: str | None = None, tls: ServerTLS | None = None,
                   relay: dict[str, Any] | None = None) -> None:
    """Several uvicorn worker processes on one listening socket (uvicorn's supervisor restarts dead ones).

    One event loop sends every response body from one thread, so on a node
    with several cores one process cannot keep several parallel transfers
    busy. Workers share the root safely (the store's structural changes take
    a file lock; a transform is run by the process that took its submission,
    the others read its record, see :mod:`tenplex.node.tasks`);
    their Prometheus metrics are summed through a shared multiprocess
    directory. Each process may run ``transforms.max_running`` transforms.
    """
    from uvicorn.supervisors import Multiprocess

    metrics_dir = tempfile.mkdtemp(prefix="tenplex-store-metrics-")
    env = {
        _ROOT_ENV: str(store.root),
        _OPTIONS_ENV: json.dumps({"chunk_bytes": store.chunk_bytes, "map_chunks": store.map_chunks,
                                  "tune_malloc": tune_malloc, "transforms": dataclasses.asdict(transforms),
                                  "uploads": dataclasses.asdict(uploads)}),
        MULTIPROC_ENV: metrics_dir,
        _RELAY_ENV: json.dumps(relay) if relay else "",
        TOKEN_ENV: token or "",
        ENV_AUTH_KEYS: auth_keys or "",
        ENV_TLS_CERT: tls.certfile if tls else "",
        ENV_TLS_KEY: tls.keyfile if tls else "",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the spawned workers read their configuration from the environment
    try:
        config = uvicorn_config("tenplex.node.daemon:app_from_env", log_level, factory=True, workers=workers, tls=tls)
        with contextlib.suppress(KeyboardInterrupt):
            Multiprocess(config, sockets=[sock]).run()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(metrics_dir, ignore_errors=True)


def app_from_env() -> FastAPI:
    """The app of one worker process of :func:`serve` with ``workers > 1`` (configured by the parent's environment)."""
    root = os.environ.get(_ROOT_ENV)
    if not root:
        raise InvalidInput(f"{_ROOT_ENV} is not set: app_from_env is only for worker processes started by serve()")
    options = json.loads(os.environ.get(_OPTIONS_ENV, "{}"))
    if options.pop("tune_malloc", False):
        _keep_freed_memory()
    transforms = TransformSettings(**options.pop("transforms", {}))
    uploads = UploadSettings(**options.pop("uploads", {}))
    relay = os.environ.get(_RELAY_ENV)
    app, _service = create_node_app(LocalStore(root, **options), token=os.environ.get(TOKEN_ENV) or None,
                                    transforms=transforms, uploads=uploads,
                                    relay=HeartbeatRelay(**json.loads(relay)) if relay else None)
    return app


def _keep_freed_memory() -> None:
    """Make glibc reuse freed region buffers instead of returning them to the kernel.

    Every region read allocates a buffer of up to ``single_pass_bytes``; by
    default glibc serves such sizes with a fresh ``mmap`` and unmaps them on
    free, so every request pays page faults on all of its bytes (measured: a
    fresh 64 MiB buffer fills 3-10x slower than a reused one on a loaded VM).
    With ``mmap`` off and a high trim threshold the daemon's heap keeps the
    freed buffers (bounded by the peak of concurrent requests) and reuses them.
    Only the daemon process does this; embedding processes keep their settings.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        log.debug("not glibc: malloc left as it is")
        return
    m_trim_threshold, m_mmap_max = -1, -4
    ok = libc.mallopt(m_mmap_max, 0) == 1 and libc.mallopt(m_trim_threshold, 1 << 30) == 1
    log.debug("malloc tuned for buffer reuse: %s", ok)


class _MemoryTierCollector(Collector):
    """The memory tier's state on every scrape: budget, bytes used, versions there and not yet durable, spills."""

    def __init__(self, tier: MemoryTier) -> None:
        self._tier = tier

    def collect(self) -> Any:
        stats = self._tier.stats()
        for name, key, text in (
            ("tenplex_store_memory_budget_bytes", "budget", "Bytes of versions the memory tier may hold"),
            ("tenplex_store_memory_used_bytes", "used", "Bytes of versions in the memory tier"),
            ("tenplex_store_memory_versions", "versions", "Versions committed in the memory tier"),
            ("tenplex_store_memory_unspilled_versions", "unspilled", "Versions in memory not yet durable on disk"),
            ("tenplex_store_memory_spill_lag_seconds", "spill_lag",
             "Seconds since the oldest version not yet durable on disk was committed in memory (0: all are)"),
        ):
            yield GaugeMetricFamily(name, text, value=stats.get(key, 0))
        spiller = self._tier.spiller
        if spiller is not None:
            yield CounterMetricFamily("tenplex_store_spilled_versions", "Versions spilled to disk", value=spiller.spilled)
            yield CounterMetricFamily("tenplex_store_spilled_bytes", "Bytes of versions spilled to disk",
                                      value=spiller.spilled_bytes)
            yield CounterMetricFamily("tenplex_store_spill_failures", "Spills that failed (retried)", value=spiller.failures)
            yield GaugeMetricFamily("tenplex_store_spill_in_progress", "1 while a version is being spilled to disk",
                                    value=1 if spiller.busy else 0)


class _RelayCollector(Collector):
    """The heartbeat relay's counters on every scrape: batches sent, heartbeats in them, batches unanswered; PTCs
    fetched from the scheduler and handed to workers."""

    def __init__(self, relay: HeartbeatRelay) -> None:
        self._relay = relay

    def collect(self) -> Any:
        relay = self._relay
        yield CounterMetricFamily("tenplex_relay_batches", "Batches of this node's heartbeats sent to the scheduler",
                                  value=relay.batches)
        yield CounterMetricFamily("tenplex_relay_heartbeats", "Worker heartbeats relayed in them", value=relay.heartbeats)
        yield CounterMetricFamily("tenplex_relay_report_batches", "Batches of this node's snapshot and exit reports sent",
                                  value=relay.report_batches)
        yield CounterMetricFamily("tenplex_relay_reports", "Worker snapshot and exit reports relayed in them",
                                  value=relay.reports)
        yield CounterMetricFamily("tenplex_relay_failures", "Batches the scheduler did not answer", value=relay.failures)
        yield CounterMetricFamily("tenplex_relay_ptc_fetches", "Generations' PTCs fetched from the scheduler",
                                  value=relay.ptc.fetches)
        yield CounterMetricFamily("tenplex_relay_ptc_served", "PTCs handed to this node's workers", value=relay.ptc.served)


class NodeDaemon(BackgroundServer):
    """A node daemon (store and transforms) in a background thread, for tests and embedding.

    ``with NodeDaemon(root, token=...) as d: d.url``; stopping it interrupts its running transforms.
    """

    def __init__(self, root: str | Path, host: str = "127.0.0.1", port: int = 0, token: str | None = None, *,
                 store: LocalStore | None = None, transforms: TransformSettings | None = None,
                 uploads: UploadSettings | None = None, log_level: str = "warning", auth_keys: str | Path | None = None,
                 tls: ServerTLS | None = None, relay: HeartbeatRelay | None = None, **store_options: Any) -> None:
        self.store = store if store is not None else LocalStore(root)
        self.token = token
        self.relay = relay
        app, self.transforms = create_node_app(self.store, token=token, transforms=transforms, uploads=uploads,
                                               auth_keys=auth_keys, relay=relay, **store_options)
        self.uploads: UploadService = app.state.uploads
        super().__init__(app, host, port, log_level=log_level, tls=tls)

    def start(self, timeout: float = 30.0) -> NodeDaemon:
        super().start(timeout)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        super().stop(timeout)
        self.transforms.close()
        self.uploads.close()
        self.store.close()
