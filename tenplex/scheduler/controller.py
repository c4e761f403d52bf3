"""One job's controller: its record, its requests, and the thread that drives its state machine.

Pending -> Running -> Reconfiguring (stopping, snapshot, planning,
transferring, restarting) -> Running, Suspended when scaled to 0, and Failed
only when the state cannot be recovered, with the reason; Succeeded when the
workers finish the last step.

The controller is small on purpose. Each tick it gathers what it observes
(hosts, exited workers and their reports, a peer failure, how long the stage
has lasted), asks the pure decision functions of
:mod:`tenplex.scheduler.decide` what follows, and applies the outcome through
the :class:`~tenplex.scheduler.launcher.WorkerLauncher` and the
:class:`~tenplex.scheduler.reconfigure.Orchestrator`. The REST API's requests
(scale, redeploy, the worker protocol's reports) change the record under the
job's lock and wake the loop. The transfer stage runs without the lock, so the
job's status answers while the node daemons move the state.

Every transition is persisted before it takes effect elsewhere, and every
stage is idempotent, so a scheduler killed at any point resumes the stage it
was in (see :mod:`tenplex.scheduler.reconfigure`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import urllib3

from tenplex.core.commands import PythonCommand
from tenplex.core.protocol import (
    Assignment,
    ErrorBody,
    ExitReport,
    HeartbeatReply,
    HeartbeatRequest,
    NodeHeartbeats,
    NodeHeartbeatsReply,
    PeerFailureReport,
    RegisterRequest,
    SnapshotReport,
)
from tenplex.errors import Conflict, InvalidConfig, NotFound, TenplexError
from tenplex.ptc import PTC, ParallelConfig, Placement
from tenplex.scheduler.backend import TRANSIENT_API_STATUS, Backend
from tenplex.scheduler.context import JobContext, SchedulerSettings
from tenplex.scheduler.decide import Observations, decide_running, decide_stopping
from tenplex.scheduler.jobspec import immutable_changes, spec_changes
from tenplex.scheduler.launcher import WorkerLauncher
from tenplex.scheduler.persist import Housekeeper
from tenplex.scheduler.reconfigure import STOP_MARGIN_STEPS, Orchestrator
from tenplex.scheduler.state import JobSpec, JobStatus, JobStore, Phase, Stage, WorkerRecord
from tenplex.transformer.plan import Plan

__all__ = ["STOP_MARGIN_STEPS", "JobController", "SchedulerSettings", "job_view", "log_dir_for"]

log = logging.getLogger(__name__)

TRANSIENT_RETRY_SECONDS = 1.0
"""Wait before a tick that met an unavailable cluster API runs again."""


def _transient(exc: BaseException) -> bool:
    """Whether ``exc`` says the cluster's API could not be reached or asked to come back (a kube-apiserver
    restart, its start-up's 5xx): not the job's failure. A step a tick left half done is idempotent (a
    launch takes the pods that exist; a stop the ones that are left), so the next tick repeats it."""
    if isinstance(exc, urllib3.exceptions.HTTPError):  # the Kubernetes client's connection refused or reset
        return True
    # An API client's error answer (the kubernetes client's ApiException carries the HTTP status); Tenplex's own
    # errors carry a status too, and are the job's business.
    status = getattr(exc, "status", None)
    return not isinstance(exc, TenplexError) and isinstance(status, int) and status in TRANSIENT_API_STATUS


class JobController:
    """Owns one job: its record, its workers, and the thread that drives its state machine."""

    def __init__(self, spec: JobSpec, status: JobStatus, *, backend: Backend, state: JobStore,
                 settings: SchedulerSettings, clients: Callable[[str], Any], metrics: Any = None) -> None:
        self.ctx = JobContext(spec, status, backend, state, settings, clients, metrics)
        self.launcher = WorkerLauncher(self.ctx)
        self.housekeeper = Housekeeper(self.ctx)
        self.orchestrator = Orchestrator(self.ctx, self.launcher, self.housekeeper)
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._index: dict[str, WorkerRecord] = {}
        """Worker id -> record of ``_index_of``, the record's worker list it was built for (the list is replaced,
        never changed in place): a node's batch looks its workers up without a scan of every worker."""
        self._index_of: list[WorkerRecord] | None = None
        self._replies: tuple[tuple[int, int | None], HeartbeatReply, NodeHeartbeatsReply] | None = None
        """The job's answer to a heartbeat and to a node's batch without errors, for (generation, stop step):
        made again only when either changes (the models are frozen)."""

    @property
    def spec(self) -> JobSpec:
        return self.ctx.spec

    @property
    def status(self) -> JobStatus:
        return self.ctx.status

    @property
    def lock(self) -> threading.RLock:
        return self.ctx.lock

    @property
    def backend(self) -> Backend:
        return self.ctx.backend

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"job-{self.spec.name}", daemon=True)
        self._thread.start()
        self.housekeeper.start()

    def close(self) -> None:
        self._closing.set()
        self._wake.set()
        self.housekeeper.close()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self.lock:
            self.ctx.save_if_due()

    def wake(self) -> None:
        """Look at the cluster now instead of at the next poll (a watch saw something)."""
        self._wake.set()

    def save(self) -> None:
        with self.lock:
            self.ctx.save()

    def ptc(self, generation: int) -> PTC:
        return self.ctx.ptc(generation)

    def plan(self) -> Plan:
        """The last reconfiguration's plan (computed again from the record after a restart); NotFound if none."""
        with self.lock:
            return self.orchestrator.current_plan()

    # -- requests from the REST API -----------------------------------------

    def request_scale(self, gpus: int, parallel: ParallelConfig | None = None) -> None:
        """Scale to ``gpus``, in ``parallel`` when given (else the policy's choice; the same GPU count in another
        configuration is a change of layout). 0 suspends the job: the workers stop after a snapshot and give their
        GPUs back, the state stays on the node stores, and a later scale to N resumes from it on N GPUs."""
        if gpus != 0 or isinstance(gpus, bool):
            self.spec.check_gpus(gpus)
        if parallel is not None:
            if gpus == 0:
                raise InvalidConfig("a suspend (0 GPUs) takes no parallel configuration")
            if parallel.world_size != gpus:
                raise InvalidConfig(f"{parallel.describe()} is {parallel.world_size} GPUs, the request asks for {gpus}")
            # A configuration the job's layout provider refuses (one its trainer cannot run) is refused now, with
            # the provider's reason: found only after the workers stopped, it would fail the job.
            self.spec.layout.build(parallel, Placement.uniform(gpus, gpus), self.spec.dataset)
        with self.lock:
            st = self.status
            if st.phase in (Phase.FAILED, Phase.SUCCEEDED):
                raise Conflict(f"job {self.spec.name!r} is {st.phase.value}; it cannot be scaled")
            if st.phase == Phase.SUSPENDED and gpus == 0:
                st.requested_gpus = st.pending_reason = None  # already there (withdraws a resume not begun)
            else:
                st.requested_gpus = gpus
                st.requested_parallel = parallel.to_json() if parallel is not None else None
                st.pending_reason = "scale"
            self.ctx.save()
        self._wake.set()

    def desired_gpus(self) -> int:
        """The GPU count the job is heading for: the newest request, else the change in progress's, else now's
        (0 when suspended)."""
        with self.lock:
            st = self.status
            if st.requested_gpus is not None:
                return st.requested_gpus
            if st.phase == Phase.RECONFIGURING and st.target_gpus is not None:
                return st.target_gpus
            return st.gpus

    def request_spec(self, new: JobSpec) -> dict[str, Any] | None:
        """Replace the live job's spec with ``new`` (its ``gpus`` aside: a scale is :meth:`request_scale`'s).

        An immutable part changed (:data:`~tenplex.scheduler.jobspec.IMMUTABLE`) is refused with its message,
        and nothing changes. Fields only the scheduler reads apply at once; fields the workers are started
        with (command, image, env, pod settings, steps, snapshot cadence, standby) make the job redeploy: the
        workers stop at a step boundary, snapshot, and the next generation starts with the new spec in the
        same layout (see :func:`~tenplex.scheduler.decide.decide_running`). The new spec is persisted with the
        record before this returns, so a restarted scheduler carries the change on. Returns the record's
        ``spec_update`` (None: nothing changed)."""
        with self.lock:  # one change at a time: each is compared with the spec the one before left
            old = self.spec
            if new.name != old.name:
                raise InvalidConfig(f"the spec names job {new.name!r}, not {old.name!r}")
            broken = immutable_changes(old, new)
            if broken:
                raise InvalidConfig("; ".join(i.message for i in broken))
            redeploy, in_place = spec_changes(old, new)
            if not redeploy and not in_place:
                return None
            if new.standby:
                if not self.backend.supports_standby:
                    raise InvalidConfig(f"the {self.backend.name} backend keeps no standbys; the job cannot have "
                                        "standby")
                PythonCommand.parse(new.command)  # one a standby cannot become is refused now, with the reason
            st = self.status
            if st.phase in (Phase.FAILED, Phase.SUCCEEDED):
                raise Conflict(f"job {old.name!r} is {st.phase.value}: its spec cannot change")
            if new.steps < old.steps and new.steps <= st.step:
                # The workers would be redeployed with nothing left to train, past the run's own end.
                raise InvalidConfig(f"steps {new.steps} is not after the step job {old.name!r} has reached "
                                    f"({st.step}): a shorter run must end after it")
            prev = st.spec_update if st.redeploy_pending else None
            fields = list(dict.fromkeys([*(prev["fields"] if prev else ()), *redeploy, *in_place]))
            pending = bool(redeploy) or prev is not None
            st.spec_update = {"fields": fields, "redeploy": pending, "pending": pending, "requested_at": time.time(),
                              "generation": None}
            self.ctx.spec = new
            if redeploy:
                # Standbys were made with the old command and environment: none may start a generation of the
                # new spec (they are made again once the redeployed generation trains).
                self.backend.forget_standbys(old.name)
            self.ctx.save()
            update = dict(st.spec_update)
        log.info("job %s: spec changed (%s)%s", old.name, ", ".join(fields),
                 "; the workers are redeployed with it at the next step boundary" if pending else "; applied in place")
        self._wake.set()
        return update

    def request_redeploy(self, reason: str) -> None:
        """Move the workers off unschedulable hosts (cordon/drain), same GPU count."""
        with self.lock:
            if self.status.pending_reason is None:
                self.status.pending_reason = reason
                self.ctx.save()
        self._wake.set()

    def register(self, req: RegisterRequest) -> Assignment:
        with self.lock:
            w = self._worker(req.worker_id)
            w.registered = True
            w.last_heartbeat = time.time()
            if req.pid:
                w.pid = req.pid
            self.ctx.touch()
            return self.launcher.assignment(w)

    def worker_assignment(self, worker_id: str) -> Assignment:
        """The current assignment of one worker of this generation (NotFound for another; it may ask again)."""
        with self.lock:
            return self.launcher.assignment(self._worker(worker_id))

    def heartbeat(self, worker_id: str, req: HeartbeatRequest) -> HeartbeatReply:
        """A worker's own heartbeat (one whose node daemon does not relay for this scheduler)."""
        with self.lock:
            w = self._worker(worker_id, req.generation)
            w.last_heartbeat = max(time.time(), w.last_heartbeat or 0.0)
            w.step = req.step
            if req.marks:
                self.ctx.worker_marks(w.generation, req.marks)
            if self._progress(req.step, req.loss, bool(req.marks)):
                self._wake.set()
            return self._reply()

    def node_heartbeats(self, node: str, batch: NodeHeartbeats) -> NodeHeartbeatsReply:
        """A node daemon's batch of its workers' heartbeats: each recorded as its own heartbeat would be, dated
        back by how long the daemon held it, so a worker's silence is measured from its last beat wherever
        the beat went. Each worker is answered as its own heartbeat would be: an error where that would have
        failed (a worker of another generation, of another node, unknown), else the job's reply.

        A node's batch arrives every second from every node: the loop below is the whole per-worker cost."""
        now = time.time()
        self.ctx.backend.heard_from(node)  # its daemon relayed this: a health probe of it can wait
        errors: dict[str, ErrorBody] = {}
        losses, steps, ages, generations = batch.losses, batch.steps, batch.ages, batch.generations
        top, top_loss = -1, None
        with self.lock:
            index = self._workers_index()
            for i, worker_id in enumerate(batch.workers):
                w = index.get(worker_id)
                if w is None or w.generation != generations[i] or w.host != node:
                    errors[worker_id] = self._beat_error(worker_id, generations[i], node)
                    continue
                when = now - ages[i]
                if w.last_heartbeat is None or when > w.last_heartbeat:
                    w.last_heartbeat = when
                w.step = step = steps[i]
                if step > top:
                    top, top_loss = step, losses[i] if losses else None
            marks = {wid: m for wid, m in (batch.marks or {}).items() if wid not in errors}
            for wid, m in marks.items():
                self.ctx.worker_marks(index[wid].generation, m)
            wake = top >= 0 and self._progress(top, top_loss, bool(marks))
            self._reply()
            assert self._replies is not None
            answer = self._replies[2] if not errors else NodeHeartbeatsReply(
                reply=self._replies[1] if len(errors) < len(batch.workers) else None, errors=errors)
        if wake:
            self._wake.set()
        return answer

    def _beat_error(self, worker_id: str, generation: int, node: str) -> ErrorBody:
        """What a worker's heartbeat that cannot be taken is answered (under the lock): the error its own
        heartbeat would get, or that it reports for another node than its own."""
        try:
            w = self._worker(worker_id, generation)
            exc: TenplexError = Conflict(f"worker {worker_id} runs on {w.host}, not on {node}")
        except TenplexError as error:
            exc = error
        return ErrorBody(error=exc.code, detail=exc.detail)

    def _progress(self, step: int, loss: float | None, marks: bool) -> bool:
        """The job's step after heartbeats up to ``step`` (under the lock); whether they should wake the loop."""
        st = self.status
        if step > st.step:
            st.step = step
            metrics = self.ctx.metrics
            if metrics is not None:
                metrics.step.labels(self.spec.name).set(step)
                if loss is not None:
                    metrics.loss.labels(self.spec.name).set(loss)
        # The loop looks at the job every poll interval anyway; a heartbeat wakes it at once only when it
        # may move the job on (a milestone, a stop step or the last step reached, a downtime to close: a step
        # past the restored one, as decide_running asks). At a thousand workers a wake per heartbeat meant a
        # thousand ticks a second over every worker; during a change of 16,384 workers the new ranks beat at
        # the restored step for minutes before the first step, and every node's batch woke a tick. Nor does a
        # beat move a stop on (the workers' exit reports do; the stop step reached wakes it below).
        return bool(marks or (st.phase != Phase.RUNNING and st.stage != Stage.STOPPING)
                    or (st.downtime_started_at is not None and step > (st.restored_step or 0))
                    or step >= self.spec.steps or (st.stop_at_step is not None and step >= st.stop_at_step))

    def _reply(self) -> HeartbeatReply:
        st = self.status
        key = (st.generation, st.stop_at_step)
        if self._replies is None or self._replies[0] != key:
            reply = HeartbeatReply(action="continue", generation=st.generation, stop_at_step=st.stop_at_step)
            self._replies = (key, reply, NodeHeartbeatsReply(reply=reply))
        return self._replies[1]

    def snapshot_report(self, worker_id: str, req: SnapshotReport) -> None:
        with self.lock:
            self._worker(worker_id, req.generation)
            if req.committed:
                st = self.status
                hosts = st.committed.setdefault(req.version, [])
                if req.host not in hosts:
                    hosts.append(req.host)
                st.version_generation[req.version] = req.generation
                if set(hosts) >= set(self.ctx.ptc(req.generation).hosts):
                    st.version = req.version
                    st.failures_without_progress = 0  # training got past its restart point
                    self.housekeeper.committed(req.version)
                self.ctx.touch()

    def peer_failure(self, worker_id: str, req: PeerFailureReport) -> None:
        with self.lock:
            self._worker(worker_id, req.generation)
            if self.ctx.peer_failure is None:
                self.ctx.peer_failure = f"worker {worker_id} reported a peer failure at step {req.step}: {req.detail}"
        self._wake.set()

    def report_failure(self, detail: str) -> None:
        """A failure seen outside the workers (an operator, a monitoring system)."""
        with self.lock:
            if self.status.phase not in (Phase.RUNNING, Phase.RECONFIGURING):
                raise Conflict(f"job {self.spec.name!r} is {self.status.phase.value}: there is nothing to fail")
            if self.ctx.peer_failure is None:
                self.ctx.peer_failure = detail
        self._wake.set()

    def exit_report(self, worker_id: str, req: ExitReport) -> None:
        with self.lock:
            w = self._worker(worker_id, req.generation)
            self.ctx.exit_reports[worker_id] = req
            if req.marks:
                self.ctx.worker_marks(req.generation, req.marks)
            w.step = max(w.step or 0, req.step)  # the last step may come after the last (timed) heartbeat
            self.status.step = max(self.status.step, req.step)
            # A worker that stopped as asked moves the job on only as the last one to: the loop is woken then (its
            # poll sees the others). A tick per report (each over every worker, under this lock) let 16,384
            # workers' reports through at about 70 a second.
            wake = req.status != "stopped" or len(self.ctx.exit_reports) >= len(self.status.workers)
        if wake:
            self._wake.set()

    def _workers_index(self) -> dict[str, WorkerRecord]:
        """Worker id -> record of the current generation (under the lock)."""
        workers = self.status.workers
        if self._index_of is not workers:
            self._index = {w.worker_id: w for w in workers}
            self._index_of = workers
        return self._index

    def _worker(self, worker_id: str, generation: int | None = None) -> WorkerRecord:
        w = self._workers_index().get(worker_id)
        if w is None:
            raise NotFound(f"job {self.spec.name!r} has no worker {worker_id!r} in generation {self.status.generation}")
        if generation is not None and generation != w.generation:
            raise Conflict(f"worker {worker_id} speaks for generation {generation}, the job is at {w.generation}")
        return w

    # -- the loop -----------------------------------------------------------

    def _run(self) -> None:
        self._resume()
        moved = False
        while not self._closing.is_set():
            if not moved:  # a tick that moved the job on is followed at once by the next stage's
                self._wake.wait(self.ctx.settings.poll_interval)
            self._wake.clear()
            if self._closing.is_set():
                break
            before = self.ctx.transitions
            try:
                if self.status.phase == Phase.RECONFIGURING and self.status.stage == Stage.TRANSFERRING:
                    self.orchestrator.transfer(self._closing.wait)  # long: takes the lock only for its updates
                else:
                    with self.lock:
                        self._tick()
                with self.lock:
                    self.ctx.save_if_due()
            except Exception as exc:  # the loop must survive anything and say what happened
                if _transient(exc):  # the cluster's API is restarting: the next tick does the same step again
                    log.warning("job %s: cluster API unavailable (%s: %s); retrying", self.spec.name,
                                type(exc).__name__, exc)
                    self._closing.wait(TRANSIENT_RETRY_SECONDS)
                    continue
                log.exception("job %s: controller error", self.spec.name)
                with self.lock:
                    self.orchestrator.fail(f"internal error: {exc}")
            moved = self.ctx.transitions != before and self.status.phase not in (Phase.FAILED, Phase.SUCCEEDED)

    def _resume(self) -> None:
        """After a scheduler restart: adopt the workers of the current generation."""
        with self.lock:
            pids = {w.worker_id: w.pid for w in self.status.workers if w.pid}
            if pids:
                self.backend.adopt(self.spec.name, pids)  # type: ignore[arg-type]

    def observe(self) -> Observations:
        """What the job's world looks like now (the decisions' only input besides the record)."""
        return Observations(
            now=time.time(), stage_age=self.ctx.stage_age, hosts=tuple(self.backend.hosts()),
            exits=self.backend.exited(self.spec.name, self.ctx.worker_ids()),
            exit_reports=dict(self.ctx.exit_reports), peer_failure=self.ctx.peer_failure,
        )

    def _tick(self) -> None:
        st, orch = self.status, self.orchestrator
        if st.phase == Phase.PENDING:
            orch.start_fresh()
        elif st.phase == Phase.RUNNING:
            self._running(self.observe())
        elif st.phase == Phase.SUSPENDED:
            orch.check_suspended()
        elif st.phase == Phase.RECONFIGURING:
            if st.stage == Stage.STOPPING:
                self._stopping(self.observe())
            elif st.stage == Stage.SNAPSHOT:
                orch.await_snapshot()
            elif st.stage == Stage.PLANNING:
                orch.plan()
            elif st.stage == Stage.RESTARTING:
                orch.restart()

    def _running(self, obs: Observations) -> None:
        st, orch = self.status, self.orchestrator
        outcome = decide_running(self.spec, st, obs, start_timeout=self.ctx.settings.start_timeout)
        if outcome.failure is not None:
            orch.begin_failure(outcome.failure)
            return
        if outcome.succeeded:
            # The workers may finish before a heartbeat past the restored step reaches the scheduler (relayed
            # beats come up to an interval late), or have restored the last step's version and had nothing left
            # to train (a failure as they finished): either way the change's record ends here.
            if st.downtime_started_at is not None:
                orch.finish_downtime()
            for w in st.workers:
                w.exit_code = obs.exits[w.worker_id]
            self.ctx.enter(Phase.SUCCEEDED, None, f"completed {st.step} steps")
            return
        if outcome.training_resumed:
            orch.finish_downtime()
        if self.spec.standby and any(w.step is not None and w.step > (st.restored_step or 0) for w in st.workers):
            self.launcher.keep_standby()
        if outcome.dropped is not None:
            log.info("job %s: %s", self.spec.name, outcome.dropped)
        if outcome.changes_pending:
            st.pending_reason = outcome.pending
            if outcome.clear_request:
                st.requested_gpus = None
            self.ctx.save()
        if outcome.begin_planned:
            orch.begin_planned()

    def _stopping(self, obs: Observations) -> None:
        outcome = decide_stopping(self.status, obs, stop_timeout=self.ctx.settings.stop_timeout)
        if outcome.failure is not None:
            self.orchestrator.begin_failure(outcome.failure)
        elif outcome.stopped:
            self.orchestrator.workers_stopped()

    def delete(self) -> None:
        with self.lock:
            self.backend.stop(self.spec.name, self.ctx.worker_ids(), grace=5.0)
            self.backend.release(self.spec.name)
        self.close()
        self.ctx.state.delete(self.spec.name)


def job_view(spec: JobSpec, status: JobStatus) -> Mapping[str, Any]:
    """The JSON the REST API returns for a job."""
    return {"spec": spec.to_json(), "status": status.to_json()}


def log_dir_for(state: JobStore, job: str) -> Path:
    return state.root / "logs" / job
