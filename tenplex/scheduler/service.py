"""The scheduler service: all jobs of one scheduler process, their controllers and metrics.

Which cluster it runs on is a plug-in: a backend registers (entry points
``tenplex.backends``, see :mod:`tenplex.registry`) a function that builds a
:class:`Scheduler` on it from :class:`SchedulerOptions`. Tenplex registers
``local`` (:func:`tenplex.scheduler.server.local_scheduler`) and ``kubernetes``
(:func:`tenplex.k8s.operator.kubernetes_scheduler`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tenplex import registry
from tenplex.core.commands import PythonCommand
from tenplex.errors import Conflict, InvalidConfig, NotFound
from tenplex.scheduler.backend import Backend
from tenplex.scheduler.controller import JobController, SchedulerSettings
from tenplex.scheduler.state import JobSpec, JobStatus, JobStore, Phase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerOptions:
    """What ``tenplex scheduler serve`` tells the backend's scheduler factory."""

    state_dir: Path
    """The scheduler's own directory (job records on the local backend, logs)."""
    url: str
    """The scheduler's URL as its listening socket has it (a backend may advertise another one to workers)."""
    token: str | None = None
    auth_keys: Path | None = None
    """The key set that signs job-scoped credentials (local backend with its own hosts: one is made in the state
    directory when there is a token and none is given)."""
    heartbeat_interval: float = 1.0
    hosts: int = 2
    """Local backend: emulated hosts to start."""
    gpus_per_host: int = 2
    """Local backend: GPUs per emulated host."""
    hosts_file: Path | None = None
    """Local backend: hosts whose store daemons run already, instead of starting ``hosts``."""
    host_timeout: float = 10.0
    """Local backend: a host whose daemon does not answer for this long is lost."""
    memory_bytes: int | None = None
    """Local backend: each emulated host's store keeps this many bytes of versions in a memory tier."""
    memory_root: Path | None = None
    """Local backend: the directory (on tmpfs) under which the emulated hosts' memory tiers live."""


SchedulerFactory = Callable[[SchedulerOptions], "Scheduler"]


def registered_backends() -> list[str]:
    """Names of the installed backends (nothing is imported)."""
    return list(registry.registered(registry.BACKENDS))


def build_scheduler(backend: str, options: SchedulerOptions) -> Scheduler:
    """The scheduler on the backend registered as ``backend`` (or named by a ``module:function`` spec)."""
    factory = registry.resolve(registry.BACKENDS, backend, "backend")
    if not callable(factory):
        raise InvalidConfig(f"backend {backend!r} is a {type(factory).__name__}, not a function that builds a scheduler")
    scheduler = factory(options)
    if not isinstance(scheduler, Scheduler):
        raise InvalidConfig(f"backend {backend!r} built a {type(scheduler).__name__}, not a Scheduler")
    return scheduler


class SchedulerMetrics:
    """Prometheus series of one scheduler (its own registry: several may live in one test process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.step = Gauge("tenplex_job_step", "Last completed training step", ["job"], registry=self.registry)
        self.loss = Gauge("tenplex_job_loss", "Loss of the last reported step", ["job"], registry=self.registry)
        self.gpus = Gauge("tenplex_job_gpus", "GPUs the job runs on", ["job"], registry=self.registry)
        self.reconfigurations = Counter(
            "tenplex_reconfigurations", "Finished reconfigurations", ["job", "reason"], registry=self.registry
        )
        self.downtime = Histogram(
            "tenplex_reconfiguration_downtime_seconds", "Time without training per reconfiguration", ["job"],
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600), registry=self.registry,
        )
        self.phases = Histogram(
            "tenplex_reconfiguration_phase_seconds", "Seconds of each phase of a reconfiguration's downtime",
            ["job", "phase"], buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300), registry=self.registry,
        )
        self.persist = Counter(
            "tenplex_persist_attempts", "Copies of versions to persistent checkpoints, by outcome", ["job", "outcome"],
            registry=self.registry,
        )
        self.bytes_moved = Counter(
            "tenplex_transform_bytes", "State bytes moved by reconfigurations", ["job", "kind"], registry=self.registry
        )
        self.requests = Histogram(
            "tenplex_scheduler_request_seconds", "REST request latency", ["route", "method", "status"],
            registry=self.registry,
        )


class Scheduler:
    """Creates, recovers and removes job controllers."""

    def __init__(self, backend: Backend, state: JobStore, settings: SchedulerSettings, *,
                 store_client: Callable[[str], Any] | None = None) -> None:
        self.backend = backend
        self.state = state
        self.settings = settings
        self.metrics = SchedulerMetrics()
        self._jobs: dict[str, JobController] = {}
        self._lock = threading.Lock()
        self._clients: dict[str, Any] = {}
        self._make_client = store_client or self._default_client

    def _default_client(self, url: str) -> Any:
        from tenplex.store.client import StoreClient

        # Control messages only (versions, transform submissions and records): a node that does not answer
        # within seconds counts as unreachable.
        return StoreClient(url, self.settings.token, retries=2, timeout=10.0)

    def client(self, url: str) -> Any:
        with self._lock:
            if url not in self._clients:
                self._clients[url] = self._make_client(url)
            return self._clients[url]

    def _controller(self, spec: JobSpec, status: JobStatus) -> JobController:
        return JobController(spec, status, backend=self.backend, state=self.state, settings=self.settings,
                             clients=self.client, metrics=self.metrics)

    def recover(self) -> list[str]:
        """Reload every job of the state directory and resume its state machine where it was."""
        names = []
        for spec, status in self.state.load_all():
            ctl = self._controller(spec, status)
            with self._lock:
                self._jobs[spec.name] = ctl
            if status.phase not in (Phase.FAILED, Phase.SUCCEEDED):
                ctl.start()
            names.append(spec.name)
            log.info("recovered job %s in %s%s", spec.name, status.phase.value, f"/{status.stage.value}" if status.stage else "")
        return names

    def create(self, spec: JobSpec) -> JobController:
        if spec.standby:
            if not self.backend.supports_standby:
                raise InvalidConfig(f"the {self.backend.name} backend keeps no standbys; create the job without "
                                    "standby")
            PythonCommand.parse(spec.command)  # one a standby cannot become is refused now, with the reason
        with self._lock:
            if spec.name in self._jobs:
                raise Conflict(f"job {spec.name!r} already exists")
            ctl = self._controller(spec, JobStatus(requested_gpus=spec.gpus))
            self._jobs[spec.name] = ctl
        ctl.save()
        ctl.start()
        return ctl

    def update(self, name: str, spec: JobSpec) -> JobController:
        """Replace a live job's spec (:meth:`JobController.request_spec`); its ``gpus``, when it is not what the
        job is heading for, is a scale request (with the redeploy, one reconfiguration)."""
        ctl = self.get(name)
        ctl.request_spec(spec)
        if spec.gpus != ctl.desired_gpus():
            ctl.request_scale(spec.gpus)
        return ctl

    def get(self, name: str) -> JobController:
        with self._lock:
            ctl = self._jobs.get(name)
        if ctl is None:
            raise NotFound(f"job {name!r} does not exist")
        return ctl

    def list(self) -> list[JobController]:
        with self._lock:
            return list(self._jobs.values())

    def delete(self, name: str) -> None:
        ctl = self.get(name)
        ctl.delete()
        with self._lock:
            self._jobs.pop(name, None)

    def close(self) -> None:
        for ctl in self.list():
            ctl.close()
        for c in self._clients.values():
            close = getattr(c, "close", None)
            if close is not None:
                close()
        self.backend.close()
