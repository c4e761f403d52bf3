"""What the units of one job share: its spec and record, the cluster, the persistence, the clients.

A :class:`JobContext` is owned by the job's controller; the launcher and the
reconfiguration orchestrator work on it. Every mutation of the record happens
under :attr:`JobContext.lock` (the controller takes it), and every transition
is persisted before it takes effect elsewhere (:meth:`JobContext.enter`).
Frequent small changes (a worker registered, a snapshot reported) are saved
soon rather than at once (:meth:`JobContext.touch`): with a thousand workers a
save per report would write the record a thousand times per snapshot, and the
stores, not the record, are the truth about which versions are committed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tenplex.core.auth import Issuer
from tenplex.core.protocol import ExitReport
from tenplex.core.version import Version
from tenplex.errors import InvalidConfig
from tenplex.ptc import PTC
from tenplex.scheduler.backend import Backend
from tenplex.scheduler.plans import PlanInputs
from tenplex.scheduler.state import JobSpec, JobStatus, JobStore, Phase, Stage, phase_split
from tenplex.transformer.plan import Plan

log = logging.getLogger(__name__)

SAVE_DELAY_S = 1.0
"""A :meth:`JobContext.touch` is persisted within this long."""


@dataclass(frozen=True)
class SchedulerSettings:
    url: str
    """The scheduler's base URL as the workers reach it."""
    token: str | None = None
    """The admin token: the scheduler's own credential towards the daemons (and the operator's)."""
    credentials: Issuer | None = None
    """Signs job-scoped credentials (:mod:`tenplex.core.auth`); None: workers and transforms get ``token``."""
    poll_interval: float = 0.2
    stop_timeout: float = 120.0
    """How long workers may take to reach the stop step and snapshot it."""
    start_timeout: float = 300.0
    """How long new workers may take to register and report their first heartbeat."""
    heartbeat_interval: float = 1.0
    ptc_inline_limit: int = 256 << 10
    """PTCs larger than this JSON size are fetched by the workers from ``/ptc`` instead of inlined."""

    def __post_init__(self) -> None:
        if self.credentials is not None and not self.token:
            raise InvalidConfig("job-scoped credentials (a key set) need the admin token as well (--token or "
                                "$TENPLEX_TOKEN): it is the scheduler's own credential towards the daemons and the "
                                "operator's towards the scheduler")

    def worker_credential(self, job: str) -> str | None:
        """What ``job``'s workers hold (``TENPLEX_TOKEN``): its own signed credential, or the shared token
        when the scheduler has no key set."""
        return self.credentials.worker(job) if self.credentials is not None else self.token

    def transform_grant(self, job: str) -> str | None:
        """What a transform of ``job`` reads its source daemons with: a read grant for that job alone."""
        return self.credentials.grant(job) if self.credentials is not None else self.token


@dataclass
class JobContext:
    spec: JobSpec
    status: JobStatus
    backend: Backend
    state: JobStore
    settings: SchedulerSettings
    client_for: Callable[[str], Any]
    """A store daemon's client by URL (the scheduler's pool; control messages only)."""
    metrics: Any = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    exit_reports: dict[str, ExitReport] = field(default_factory=dict)
    peer_failure: str | None = None
    stage_started: float = field(default_factory=time.monotonic)
    transitions: int = 0
    """Counts :meth:`enter` calls: the loop goes on at once after a tick that moved the job on."""
    plan_cache: tuple[PlanInputs, Plan] | None = None
    """(PlanInputs, Plan) of the last plan made or computed again in this process (the record keeps only the
    inputs: see :mod:`tenplex.scheduler.plans`)."""
    _ptcs: dict[int, PTC] = field(default_factory=dict)
    _dirty_since: float | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    # -- persistence --------------------------------------------------------------------------------

    def save(self) -> None:
        self.state.save(self.spec, self.status)
        self._dirty_since = None

    def touch(self) -> None:
        """The record changed in a way that may be persisted a little later (see the module doc)."""
        if self._dirty_since is None:
            self._dirty_since = time.monotonic()

    def save_if_due(self) -> None:
        if self._dirty_since is not None and time.monotonic() - self._dirty_since >= SAVE_DELAY_S:
            self.save()

    def enter(self, phase: Phase, stage: Stage | None, message: str) -> None:
        st = self.status
        st.phase, st.stage, st.message = phase, stage, message
        self.stage_started = time.monotonic()
        self.transitions += 1
        self.save()
        if phase in (Phase.FAILED, Phase.SUCCEEDED, Phase.SUSPENDED) and self.spec.standby:
            self.backend.release(self.name)  # no next generation to keep warm workers for
            self.status.standby_ready = self.status.standby_wanted = 0
        log.info("job %s: %s%s - %s", self.name, phase.value, f"/{stage.value}" if stage else "", message)

    @property
    def stage_age(self) -> float:
        return time.monotonic() - self.stage_started

    # -- milestones ---------------------------------------------------------------------------------

    def mark(self, name: str, when: float | None = None) -> None:
        """Record milestone ``name`` of the change in progress (the last history record, if unfinished)."""
        hist = self.status.history
        if hist and hist[-1].finished_at is None:
            rec = hist[-1]
            rec.marks[name] = time.time() if when is None else when
            rec.phases = phase_split(rec.marks)

    def worker_marks(self, generation: int, marks: Mapping[str, float]) -> None:
        """A worker's milestones: its start-up ones belong to the change that launched its generation, its stop
        ones to the change in progress; each is the slowest worker's (the latest time)."""
        start = {k: t for k, t in marks.items() if k not in ("stop_agreed", "snapshot_written")}
        stop = {k: t for k, t in marks.items() if k in ("stop_agreed", "snapshot_written")}
        for rec in reversed(self.status.history):
            if not start and not stop:
                break
            if start and rec.to_generation == generation:
                for k, t in start.items():
                    rec.marks[k] = max(t, rec.marks.get(k, 0.0))
                rec.phases = phase_split(rec.marks)
                start = {}
            if stop and rec.finished_at is None and generation == self.status.generation:
                for k, t in stop.items():
                    rec.marks[k] = max(t, rec.marks.get(k, 0.0))
                rec.phases = phase_split(rec.marks)
                stop = {}

    # -- layouts -----------------------------------------------------------------------------------

    def ptc(self, generation: int) -> PTC:
        if generation not in self._ptcs:
            self._ptcs[generation] = self.state.load_ptc(self.name, generation)
        return self._ptcs[generation]

    def set_ptc(self, generation: int, ptc: PTC) -> None:
        self.state.save_ptc(self.name, generation, ptc)
        self._ptcs[generation] = ptc

    # -- small facts ----------------------------------------------------------------------------------

    def consumed_at(self, version: Version) -> int:
        """The dataset position after ``version``'s step: where the next generation's sample order resumes
        (for a job resumed from a persistent version, counted from that version's position)."""
        base = self.status.resumed_from
        if base is not None:
            return int(base["consumed_samples"]) + (version.step - int(base["step"])) * self.spec.dataset.global_batch_size
        return self.spec.dataset.consumed_samples + version.step * self.spec.dataset.global_batch_size

    def config_text(self) -> str | None:
        cfg = self.status.parallel_config
        return cfg.describe() if cfg else None

    def next_generation(self) -> int:
        """A generation no earlier attempt used: a failed or cancelled transfer may have left its version's
        name (committed on some hosts, or as a transform record on the daemons, which would attach a new
        submission of that name to the old attempt), so the last plan's target counts as used too."""
        st = self.status
        used = [st.generation, *st.version_generation.values()]
        if st.last_plan is not None:
            target = (st.last_plan.get("inputs") or {}).get("new_version")
            if target is not None:
                used.append(Version.parse(target).generation)
        return max(used) + 1

    def worker_ids(self) -> list[str]:
        return [w.worker_id for w in self.status.workers]
