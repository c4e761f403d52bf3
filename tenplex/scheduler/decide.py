"""The job state machine's decisions: pure functions of the job's record and of what was observed.

Each tick the controller gathers :class:`Observations` (the cluster's hosts,
which workers have exited and what they reported, a peer's failure report,
how long the current stage has lasted) and asks these functions what follows;
they read the :class:`~tenplex.scheduler.state.JobStatus` and never change it
or do I/O. So every transition can be driven by a test without a process, a
store or a clock. What an outcome does (launch workers, plan, move state) is
the job of :mod:`tenplex.scheduler.launcher` and
:mod:`tenplex.scheduler.reconfigure`; the controller applies the outcome.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tenplex.core.protocol import ExitReport
from tenplex.core.version import Version
from tenplex.ptc import PTC
from tenplex.scheduler.backend import HostInfo
from tenplex.scheduler.state import JobSpec, JobStatus


@dataclass(frozen=True)
class Observations:
    """What the controller saw of the job's world at one moment."""

    now: float
    """Wall clock (heartbeats are stamped with it)."""
    stage_age: float
    """Seconds since the job entered its current phase or stage."""
    hosts: Sequence[HostInfo]
    exits: Mapping[str, int | None]
    """Workers of the current generation that are no longer running -> exit code (None: unknown)."""
    exit_reports: Mapping[str, ExitReport] = field(default_factory=dict)
    """What exited workers said about their exit (completed, stopped, failed)."""
    peer_failure: str | None = None
    """A worker's (or an operator's) report of a failure not seen otherwise."""

    def lost(self, names: Sequence[str]) -> list[str]:
        """Which of ``names`` are hosts that are not ready (gone, NotReady, daemon silent)."""
        return [h.name for h in self.hosts if not h.ready and h.name in names]

    def unschedulable(self) -> set[str]:
        return {h.name for h in self.hosts if not h.schedulable}


# -- running ------------------------------------------------------------------------------------------------


def detect_failure(spec: JobSpec, status: JobStatus, obs: Observations, *, start_timeout: float) -> str | None:
    """Why the running job has failed, or None.

    A worker that exits after completing or after a requested stop has not
    failed; one silent for longer than the spec's heartbeat timeout has, and so
    has a generation whose workers did not all register within
    ``start_timeout`` of their launch.
    """
    if obs.peer_failure is not None:
        return obs.peer_failure
    lost = obs.lost(status.hosts)
    if lost:
        return f"host {', '.join(lost)} lost"
    for wid, code in obs.exits.items():
        report = obs.exit_reports.get(wid)
        if report is not None and report.status == "completed" and code in (0, None):
            continue
        if report is not None and report.status == "stopped" and status.stop_at_step is not None:
            continue
        return f"worker {wid} exited with code {code}" + (f" ({report.detail})" if report and report.detail else "")
    for w in status.workers:
        if (w.last_heartbeat is not None and obs.now - w.last_heartbeat > spec.heartbeat_timeout
                and w.worker_id not in obs.exits):
            return f"worker {w.worker_id} missed heartbeats for {obs.now - w.last_heartbeat:.0f}s"
    if obs.stage_age > start_timeout and any(not w.registered for w in status.workers):
        missing = [w.worker_id for w in status.workers if not w.registered]
        return f"workers {', '.join(missing[:4])} did not register within {start_timeout:.0f}s"
    return None


_KEEP = "keep"


@dataclass(frozen=True)
class RunningOutcome:
    """What follows for a running job; fields are applied in this order."""

    failure: str | None = None
    """Recover from the newest version the survivors hold (nothing else applies)."""
    succeeded: bool = False
    """Every worker completed the last step."""
    training_resumed: bool = False
    """The first step past the restored one: the change that restarted the job is over (its downtime ends)."""
    pending: str | None = _KEEP
    """The new pending request (None clears it; :data:`_KEEP` leaves it)."""
    dropped: str | None = None
    """Why a pending request was dropped, for the log."""
    clear_request: bool = False
    """The requested GPU count is the current one: the request is done."""
    begin_planned: bool = False
    """Ask the workers to stop at a step boundary for the pending request."""

    @property
    def changes_pending(self) -> bool:
        return self.pending != _KEEP


def decide_running(spec: JobSpec, status: JobStatus, obs: Observations, *, start_timeout: float) -> RunningOutcome:
    failure = detect_failure(spec, status, obs, start_timeout=start_timeout)
    if failure is not None:
        return RunningOutcome(failure=failure)
    # Every tick of a running job comes here: the workers are looked at only once all of them have exited.
    if status.workers and len(obs.exits) == len(status.workers) and all(
        (r := obs.exit_reports.get(w.worker_id)) is not None and r.status == "completed" for w in status.workers
    ):
        return RunningOutcome(succeeded=True)
    # A step past the restored one means every rank took part in it (its collectives): training is back.
    resumed = status.downtime_started_at is not None and any(
        w.step is not None and w.step > (status.restored_step or 0) for w in status.workers
    )
    unschedulable = obs.unschedulable()
    pending: str | None = status.pending_reason
    respec = status.redeploy_pending
    changed, dropped = False, None
    if pending is None and unschedulable.intersection(status.hosts):
        pending, changed = "redeploy", True
    elif pending is None and respec:
        # The workers run an older spec than the job's (a kubectl apply, a PUT): redeploy them with it.
        pending, changed = "spec", True
    elif pending == "spec" and not respec:
        # A generation was launched with the new spec since (a failure's recovery, a scale in between).
        dropped = "spec request dropped: the workers already run the job's spec"
        pending, changed = None, True
    elif pending not in (None, "scale", "spec") and not unschedulable.intersection(status.hosts):
        # A cordon seen while the job was still on that host, applied after the move off it (or undone
        # since): moving again would only cost a restart. Not a spec change: that one is about the workers.
        dropped = f"{pending} request dropped: none of {status.hosts} is unschedulable now"
        pending, changed = ("spec" if respec else None), True
    begin = clear = False
    if pending == "scale" and status.requested_gpus == status.gpus and (
            status.requested_parallel is None or _same_config(status.requested_parallel, status.parallel)):
        # Already there; a spec change that came with it still needs its redeploy.
        pending, changed, clear = ("spec" if respec else None), True, True
    if pending is not None and not any(w.step is None for w in status.workers):
        begin = True
    return RunningOutcome(training_resumed=resumed, pending=pending if changed else _KEEP, dropped=dropped,
                          clear_request=clear, begin_planned=begin)


def _same_config(a: Mapping[str, object] | None, b: Mapping[str, object] | None) -> bool:
    keys = ("dp", "tp", "pp", "zero")
    return a is not None and b is not None and all(a.get(k, 0) == b.get(k, 0) for k in keys)


# -- stopping for a planned change ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StopOutcome:
    failure: str | None = None
    stopped: bool = False
    """Every worker has exited at the stop step: look for its snapshot on the stores."""


def decide_stopping(status: JobStatus, obs: Observations, *, stop_timeout: float) -> StopOutcome:
    """Stopped once every worker has said it stopped (its exit report, sent after its snapshot was written) or
    has exited: the processes' teardown (seconds, with torch loaded) overlaps the next stages, and the
    launcher ends them before it starts the next generation on their hosts."""
    lost = obs.lost(status.hosts)
    said_stopped = {wid for wid, r in obs.exit_reports.items() if r.status == "stopped"}
    # An unknown exit code (a worker adopted after a scheduler restart) is not a failure by itself:
    # the snapshot stage asks the stores whether the stop step was committed. Nor is a crash in the teardown
    # of a worker that had reported its stop.
    bad = {wid: c for wid, c in obs.exits.items() if c not in (0, None) and wid not in said_stopped}
    if obs.peer_failure or lost or bad:
        reason = obs.peer_failure or (f"host {', '.join(lost)} lost" if lost
                                      else f"workers exited abnormally while stopping: {bad}")
        return StopOutcome(failure=reason)
    if all(w.worker_id in obs.exits or w.worker_id in said_stopped for w in status.workers):
        return StopOutcome(stopped=True)
    if obs.stage_age > stop_timeout:
        return StopOutcome(failure=f"workers did not stop at step {status.stop_at_step} within {stop_timeout:.0f}s")
    return StopOutcome()


@dataclass(frozen=True)
class SnapshotOutcome:
    version: str | None = None
    """The stop version, committed on every host of the generation."""
    holders: tuple[str, ...] = ()
    failure: str | None = None


def find_stop_version(status: JobStatus, holders: Mapping[str, Sequence[str]], need: set[str], *,
                      stage_age: float, stop_timeout: float) -> SnapshotOutcome:
    """The stop version on the stores: the requested step, or a later one when the request came late."""
    assert status.stop_at_step is not None
    candidates: dict[str, set[str]] = {}
    for host, versions in holders.items():
        for v in versions:
            parsed = Version.parse(v)
            if parsed.generation == status.generation and parsed.step >= status.stop_at_step:
                candidates.setdefault(v, set()).add(host)
    complete = [v for v, have in candidates.items() if need <= have]
    if complete:
        version = max(complete, key=Version.parse)
        return SnapshotOutcome(version=version, holders=tuple(sorted(candidates[version])))
    if stage_age > stop_timeout:
        partial = {v: sorted(need - have) for v, have in candidates.items()}
        return SnapshotOutcome(failure=f"no version at or after step {status.stop_at_step} is committed on every "
                                       f"host {sorted(need)} (missing: {partial or 'all'})")
    return SnapshotOutcome()


# -- recovery -------------------------------------------------------------------------------------------------


def covers(ptc: PTC, hosts: set[str]) -> bool:
    """Whether devices on ``hosts`` hold at least one replica of every shard of ``ptc``."""
    held = {d.id for d in ptc.devices if d.host in hosts}
    return all(held.intersection(s.devices) for t in ptc.tensors for s in t.shards)


@dataclass(frozen=True)
class Recovery:
    version: str
    holders: tuple[str, ...]
    steps_lost: int
    persistent: bool = False
    """Some regions come from the persistent tier (no survivor holds them)."""


def choose_recovery(status: JobStatus, holders: Mapping[str, Sequence[str]],
                    ptc_of: Callable[[int], PTC | None], persisted: Sequence[str] = (),
                    reached: int | None = None) -> Recovery | None:
    """The newest version the survivors cover (``holders``: host -> committed versions, the survivors
    only) or, with them, the persistent tier (``persisted``: versions committed there, each whole), with the
    steps lost since the step ``reached`` (default: :func:`steps_reached`); None when there is none."""
    reached = max(reached or 0, steps_reached(status))
    candidates = sorted({v for vs in holders.values() for v in vs} | set(persisted), key=Version.parse, reverse=True)
    for version in candidates:
        ptc = ptc_of(status.version_generation.get(version, Version.parse(version).generation))
        if ptc is None:
            continue
        have = {h for h, vs in holders.items() if version in vs}
        lost = max(0, reached - Version.parse(version).step)
        if covers(ptc, have):
            return Recovery(version, tuple(sorted(have)), lost)
        if version in persisted:
            return Recovery(version, tuple(sorted(have)), lost, persistent=True)
    return None


def missing_text(ptc: PTC, survivors: set[str], limit: int = 6) -> str:
    """What the ``survivors`` lack of ``ptc``: each region no device on them holds, with the hosts that held it
    (``"layers.1.w 0:32,0:64 (held by host-1), ... and 9 more"``); empty when they cover it."""
    items = []
    for t in ptc.tensors:
        for s in t.shards:
            hosts = sorted({ptc.device(d).host for d in s.devices})
            if not survivors.intersection(hosts):
                items.append(f"{t.name} {s.region.format()} (held by {', '.join(hosts)})")
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def steps_reached(status: JobStatus) -> int:
    """The newest step the job is known to have reached: any worker's report, or its newest committed version
    (committed at its step, so reached even when the heartbeats that carry the step are still on their way)."""
    committed = Version.parse(status.version).step if status.version is not None else 0
    return max([status.step, committed] + [w.step for w in status.workers if w.step is not None])
