"""The job state machine and the reconfiguration engine.

Pending -> Running -> Reconfiguring (stopping, snapshot, planning,
transferring, restarting) -> Running, and Failed only when the state cannot be
recovered, with the reason; Succeeded when the workers finish the last step.

Every transition is persisted before it takes effect elsewhere, and every
stage is idempotent, so a scheduler killed at any point resumes the stage it
was in: workers outlive it (they are re-adopted), the stores are the truth
about which versions are committed, and a half-written target version is
deleted and redone.

Planned changes lose no step: the workers are asked to stop after a step
``N`` a little ahead of the newest reported one, snapshot it and exit; the new
configuration restores exactly that step. On a failure the workers are
stopped at once and the newest version fully held by the survivors is used;
the steps since that version are reported as lost.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenplex.errors import (
    Conflict,
    InvalidConfig,
    NotFound,
    StateLost,
    StoreUnavailable,
    TenplexError,
    TransformCancelled,
)
from tenplex.ptc import PTC, ParallelConfig, Placement
from tenplex.scheduler import policy as policy_mod
from tenplex.scheduler.backend import Backend, HostInfo, WorkerLaunch
from tenplex.scheduler.protocol import (
    ENV_GENERATION,
    ENV_HOST,
    ENV_JOB,
    ENV_SCHEDULER_URL,
    ENV_SNAPSHOT_EVERY,
    ENV_STORE_URL,
    ENV_TOKEN,
    ENV_WORKER_ID,
    Assignment,
    ExitReport,
    HeartbeatReply,
    HeartbeatRequest,
    PeerFailureReport,
    RegisterRequest,
    SnapshotReport,
)
from tenplex.scheduler.state import (
    JobSpec,
    JobStatus,
    JobStore,
    Phase,
    Reconfiguration,
    Stage,
    WorkerRecord,
)
from tenplex.store.version import Version
from tenplex.transformer.plan import Plan, make_plan
from tenplex.transformer.remote import PlanRun, TransformStatus
from tenplex.units import human_bytes

log = logging.getLogger(__name__)

STOP_MARGIN_STEPS = 2
"""Ranks of a job are within one step of each other; asking them to stop two steps
ahead of the newest reported step guarantees every rank learns it at a step
boundary before it passes that step."""


@dataclass(frozen=True)
class SchedulerSettings:
    url: str
    """The scheduler's base URL as the workers reach it."""
    token: str | None = None
    poll_interval: float = 0.2
    stop_timeout: float = 120.0
    """How long workers may take to reach the stop step and snapshot it."""
    start_timeout: float = 300.0
    """How long new workers may take to register and report their first heartbeat."""
    transfer_concurrency: int = 8
    heartbeat_interval: float = 1.0
    ptc_inline_limit: int = 256 << 10
    """PTCs larger than this JSON size are fetched by the workers from ``/ptc`` instead of inlined."""


class JobController:
    """Owns one job: its status, its workers, and the thread that drives its state machine."""

    def __init__(self, spec: JobSpec, status: JobStatus, *, backend: Backend, state: JobStore,
                 settings: SchedulerSettings, clients: Callable[[str], Any], metrics: Any = None) -> None:
        self.spec = spec
        self.status = status
        self.backend = backend
        self.state = state
        self.settings = settings
        self._client_for = clients
        self.metrics = metrics
        self.lock = threading.RLock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._ptc_cache: dict[int, PTC] = {}
        self._exit_reports: dict[str, ExitReport] = {}
        self._peer_failure: str | None = None
        self._stage_started = time.monotonic()

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"job-{self.spec.name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def wake(self) -> None:
        """Look at the cluster now instead of at the next poll (a watch saw something)."""
        self._wake.set()

    def _save(self) -> None:
        self.state.save(self.spec, self.status)

    def ptc(self, generation: int) -> PTC:
        if generation not in self._ptc_cache:
            self._ptc_cache[generation] = self.state.load_ptc(self.spec.name, generation)
        return self._ptc_cache[generation]

    def _set_ptc(self, generation: int, ptc: PTC) -> None:
        self.state.save_ptc(self.spec.name, generation, ptc)
        self._ptc_cache[generation] = ptc

    def _enter(self, phase: Phase, stage: Stage | None, message: str) -> None:
        self.status.phase = phase
        self.status.stage = stage
        self.status.message = message
        self._stage_started = time.monotonic()
        self._save()
        log.info("job %s: %s%s - %s", self.spec.name, phase.value, f"/{stage.value}" if stage else "", message)

    # -- requests from the REST API -----------------------------------------

    def request_scale(self, gpus: int) -> None:
        """Scale to ``gpus``. 0 suspends the job: the workers stop after a snapshot and give their GPUs back, the
        state stays on the node stores, and a later scale to N resumes from it on N GPUs."""
        if gpus != 0 or isinstance(gpus, bool):
            self.spec.check_gpus(gpus)
        with self.lock:
            st = self.status
            if st.phase in (Phase.FAILED, Phase.SUCCEEDED):
                raise Conflict(f"job {self.spec.name!r} is {st.phase.value}; it cannot be scaled")
            if st.phase == Phase.SUSPENDED and gpus == 0:
                st.requested_gpus = st.pending_reason = None  # already there (withdraws a resume not begun)
            else:
                st.requested_gpus = gpus
                st.pending_reason = "scale"
            self._save()
        self._wake.set()

    def request_redeploy(self, reason: str) -> None:
        """Move the workers off unschedulable hosts (cordon/drain), same GPU count."""
        with self.lock:
            if self.status.pending_reason is None:
                self.status.pending_reason = reason
                self._save()
        self._wake.set()

    def register(self, req: RegisterRequest) -> Assignment:
        with self.lock:
            w = self._worker(req.worker_id)
            w.registered = True
            w.last_heartbeat = time.time()
            if req.pid:
                w.pid = req.pid
            self._save()
            return self.assignment(w)

    def assignment(self, w: WorkerRecord) -> Assignment:
        st = self.status
        ptc = self.ptc(w.generation)
        text = ptc.dumps()
        inline = len(text) <= self.settings.ptc_inline_limit
        return Assignment(
            job=self.spec.name,
            generation=w.generation,
            worker_id=w.worker_id,
            rank=w.rank,
            world_size=len(st.workers),
            local_rank=w.local_rank,
            host=w.host,
            parallel=dict(st.parallel or {}),
            master_addr=st.master_addr or "127.0.0.1",
            master_port=st.master_port or 29500,
            restore_version=st.restore_version,
            store_url=self.backend.host(w.host).store_url,
            ptc=ptc.to_json() if inline else None,
            ptc_url=None if inline else f"{self.settings.url}/v1/jobs/{self.spec.name}/ptc?generation={w.generation}",
            stop_at_step=st.stop_at_step,
            total_steps=self.spec.steps,
            heartbeat_interval_s=self.settings.heartbeat_interval,
        )

    def worker_assignment(self, worker_id: str) -> Assignment:
        """The current assignment of one worker of this generation (NotFound for another)."""
        with self.lock:
            return self.assignment(self._worker(worker_id))

    def heartbeat(self, worker_id: str, req: HeartbeatRequest) -> HeartbeatReply:
        with self.lock:
            w = self._worker(worker_id, req.generation)
            w.last_heartbeat = time.time()
            w.step = req.step
            if req.step > self.status.step:
                self.status.step = req.step
                if self.metrics is not None:
                    self.metrics.step.labels(self.spec.name).set(req.step)
                if req.loss is not None and self.metrics is not None:
                    self.metrics.loss.labels(self.spec.name).set(req.loss)
            self._wake.set()
            return HeartbeatReply(action="continue", generation=self.status.generation, stop_at_step=self.status.stop_at_step)

    def snapshot_report(self, worker_id: str, req: SnapshotReport) -> None:
        with self.lock:
            self._worker(worker_id, req.generation)
            if req.committed:
                hosts = self.status.committed.setdefault(req.version, [])
                if req.host not in hosts:
                    hosts.append(req.host)
                self.status.version_generation[req.version] = req.generation
                if set(hosts) >= set(self.ptc(req.generation).hosts):
                    self.status.version = req.version
                    self.status.failures_without_progress = 0  # training got past its restart point
                self._save()

    def peer_failure(self, worker_id: str, req: PeerFailureReport) -> None:
        with self.lock:
            self._worker(worker_id, req.generation)
            if self._peer_failure is None:
                self._peer_failure = f"worker {worker_id} reported a peer failure at step {req.step}: {req.detail}"
        self._wake.set()

    def report_failure(self, detail: str) -> None:
        """A failure seen outside the workers (an operator, a monitoring system)."""
        with self.lock:
            if self.status.phase not in (Phase.RUNNING, Phase.RECONFIGURING):
                raise Conflict(f"job {self.spec.name!r} is {self.status.phase.value}: there is nothing to fail")
            if self._peer_failure is None:
                self._peer_failure = detail
        self._wake.set()

    def exit_report(self, worker_id: str, req: ExitReport) -> None:
        with self.lock:
            w = self._worker(worker_id, req.generation)
            self._exit_reports[worker_id] = req
            w.step = max(w.step or 0, req.step)  # the last step may come after the last (timed) heartbeat
            self.status.step = max(self.status.step, req.step)
        self._wake.set()

    def _worker(self, worker_id: str, generation: int | None = None) -> WorkerRecord:
        for w in self.status.workers:
            if w.worker_id == worker_id:
                if generation is not None and generation != w.generation:
                    raise Conflict(f"worker {worker_id} speaks for generation {generation}, the job is at {w.generation}")
                return w
        raise NotFound(f"job {self.spec.name!r} has no worker {worker_id!r} in generation {self.status.generation}")

    # -- the loop -----------------------------------------------------------

    def _run(self) -> None:
        self._resume()
        while not self._closing.is_set():
            self._wake.wait(self.settings.poll_interval)
            self._wake.clear()
            if self._closing.is_set():
                break
            try:
                if self.status.phase == Phase.RECONFIGURING and self.status.stage == Stage.TRANSFERRING:
                    self._transfer()  # long: takes the lock only for its status updates
                else:
                    with self.lock:
                        self._tick()
            except Exception as exc:  # the loop must survive anything and say what happened
                log.exception("job %s: controller error", self.spec.name)
                with self.lock:
                    self._fail(f"internal error: {exc}")

    def _resume(self) -> None:
        """After a scheduler restart: adopt the workers of the current generation."""
        with self.lock:
            pids = {w.worker_id: w.pid for w in self.status.workers if w.pid}
            if pids:
                self.backend.adopt(self.spec.name, pids)  # type: ignore[arg-type]

    def _tick(self) -> None:
        st = self.status
        if st.phase == Phase.PENDING:
            self._start_fresh()
        elif st.phase == Phase.RUNNING:
            self._check_running()
        elif st.phase == Phase.RECONFIGURING:
            self._advance_reconfiguration()
        elif st.phase == Phase.SUSPENDED:
            self._check_suspended()

    # -- starting -------------------------------------------------------------

    def _usable_hosts(self) -> list[HostInfo]:
        return [h for h in self.backend.hosts() if h.ready and h.schedulable]

    def _slots(self, host: HostInfo) -> int:
        """The GPUs of ``host`` the job can use: whole groups of ``gpus_per_pod`` (a pod's ranks share a host)."""
        g = self.spec.gpus_per_pod
        return host.gpus // g * g

    def _decide(self, gpus: int, prefer: list[str], dataset_consumed: int) -> policy_mod.Decision:
        g = self.spec.gpus_per_pod
        if gpus % g:
            raise InvalidConfig(f"{gpus} GPUs is not a multiple of gpus_per_pod {g}")
        hosts = [h for h in self._usable_hosts() if self._slots(h)]
        if not hosts:
            raise InvalidConfig("no ready, schedulable hosts" + (f" with {g} GPUs for a pod" if g > 1 else ""))
        order = sorted(hosts, key=lambda h: (h.name not in prefer, prefer.index(h.name) if h.name in prefer else 0, h.name))
        gpus_per_node = min(self._slots(h) for h in order)
        dataset = self.spec.dataset.__class__(
            self.spec.dataset.num_samples, self.spec.dataset.seed, self.spec.dataset.global_batch_size, dataset_consumed
        )

        def build(cfg: ParallelConfig, placement: Placement) -> PTC:
            return self.spec.layout.build(cfg, placement, dataset)

        return policy_mod.choose(gpus, self.spec.policy, build, [h.name for h in order], gpus_per_node)

    def _start_fresh(self) -> None:
        if self.status.requested_gpus == 0:  # suspended before it ever started
            self.status.requested_gpus = self.status.pending_reason = None
            self._suspend()
            return
        try:
            decision = self._decide(self.status.requested_gpus or self.spec.gpus, [], self.spec.dataset.consumed_samples)
        except TenplexError as exc:
            self.status.message = f"waiting: {exc.detail}"
            return
        self._set_ptc(0, decision.ptc)
        self.status.generation = 0
        self.status.restore_version = None
        self.status.requested_gpus = None
        self.status.pending_reason = None
        self._launch(decision, generation=0)
        self._enter(Phase.RUNNING, None, f"started in {decision.parallel.describe()} on {len(decision.placement.hosts)} hosts ({decision.reason})")

    def _launch(self, decision: policy_mod.Decision, generation: int) -> None:
        st = self.status
        cfg, placement = decision.parallel, decision.placement
        st.parallel = cfg.to_json()
        st.gpus = cfg.world_size
        st.hosts = list(placement.hosts)
        st.gpus_per_node = placement.gpus_per_node
        st.stop_at_step = None
        st.target_gpus = None
        self._exit_reports = {}
        self._peer_failure = None
        master = self.backend.host(placement.hosts[0])
        st.master_addr = master.address
        st.master_port = self.backend.master_port(master)
        workers, launches = [], []
        local_index: dict[str, int] = {}
        for rank in range(cfg.world_size):
            host = placement.host_of(rank)
            local_rank = local_index.get(host, 0)
            local_index[host] = local_rank + 1
            wid = f"{self.spec.name}-g{generation}-r{rank}"
            info = self.backend.host(host)
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(cfg.world_size),
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(placement.gpus_per_node),
                "MASTER_ADDR": master.address,
                "MASTER_PORT": str(st.master_port),
                ENV_SCHEDULER_URL: self.settings.url,
                ENV_JOB: self.spec.name,
                ENV_WORKER_ID: wid,
                ENV_STORE_URL: info.store_url,
                ENV_HOST: host,
                ENV_GENERATION: str(generation),
                ENV_SNAPSHOT_EVERY: str(self.spec.snapshot_every),
                **dict(self.spec.env),
            }
            if self.settings.token:
                env[ENV_TOKEN] = self.settings.token
            workers.append(WorkerRecord(worker_id=wid, rank=rank, host=host, local_rank=local_rank, generation=generation))
            launches.append(WorkerLaunch(wid, rank, host, local_rank, env))
        st.workers = workers
        st.generation = generation
        self._save()  # the workers exist in the record before any of them can register
        log_dir = self.state.root / "logs" / self.spec.name / f"g{generation}"
        pids = self.backend.launch(self.spec.name, self.spec.command, launches, log_dir)
        for w in workers:
            w.pid = pids.get(w.worker_id)
        self._save()

    # -- running --------------------------------------------------------------

    def _check_running(self) -> None:
        st = self.status
        failure = self._detect_failure()
        if failure is not None:
            self._begin_failure(failure)
            return
        ids = [w.worker_id for w in st.workers]
        exits = self.backend.exited(self.spec.name, ids)
        if ids and len(exits) == len(ids) and all(
            (r := self._exit_reports.get(wid)) is not None and r.status == "completed" for wid in ids
        ):
            for w in st.workers:
                w.exit_code = exits[w.worker_id]
            self._enter(Phase.SUCCEEDED, None, f"completed {st.step} steps")
            return
        # A step past the restored one means every rank took part in it (its collectives): training is back.
        if st.downtime_started_at is not None and any(
            w.step is not None and w.step > (st.restored_step or 0) for w in st.workers
        ):
            self._finish_downtime()
        unschedulable = {h.name for h in self.backend.hosts() if not h.schedulable}
        if st.pending_reason is None and unschedulable.intersection(st.hosts):
            st.pending_reason = "redeploy"
        elif st.pending_reason not in (None, "scale") and not unschedulable.intersection(st.hosts):
            # A cordon seen while the job was still on that host, applied after the move off it (or undone
            # since): moving again would only cost a restart.
            log.info("job %s: %s request dropped: none of %s is unschedulable now", self.spec.name,
                     st.pending_reason, st.hosts)
            st.pending_reason = None
            self._save()
        if st.pending_reason == "scale" and st.requested_gpus == st.gpus:
            st.pending_reason = st.requested_gpus = None  # already there
            self._save()
        elif st.pending_reason is not None and not any(w.step is None for w in st.workers):
            self._begin_planned()

    def _detect_failure(self) -> str | None:
        st = self.status
        if self._peer_failure is not None:
            return self._peer_failure
        lost = [h.name for h in self.backend.hosts() if not h.ready and h.name in st.hosts]
        if lost:
            return f"host {', '.join(lost)} lost"
        exits = self.backend.exited(self.spec.name, [w.worker_id for w in st.workers])
        for wid, code in exits.items():
            report = self._exit_reports.get(wid)
            if report is not None and report.status == "completed" and code in (0, None):
                continue
            if report is not None and report.status == "stopped" and st.stop_at_step is not None:
                continue
            return f"worker {wid} exited with code {code}" + (f" ({report.detail})" if report and report.detail else "")
        now = time.time()
        for w in st.workers:
            if w.last_heartbeat is not None and now - w.last_heartbeat > self.spec.heartbeat_timeout and w.worker_id not in exits:
                return f"worker {w.worker_id} missed heartbeats for {now - w.last_heartbeat:.0f}s"
        started = time.monotonic() - self._stage_started
        if started > self.settings.start_timeout and any(not w.registered for w in st.workers):
            missing = [w.worker_id for w in st.workers if not w.registered]
            return f"workers {', '.join(missing[:4])} did not register within {self.settings.start_timeout:.0f}s"
        return None

    # -- planned reconfiguration ------------------------------------------------

    def _begin_planned(self) -> None:
        st = self.status
        if st.downtime_started_at is not None:  # the previous change's workers are training: close its record
            self._finish_downtime()
        newest = max([w.step for w in st.workers if w.step is not None] + [st.step])
        st.stop_at_step = newest + STOP_MARGIN_STEPS
        st.target_gpus = st.requested_gpus if st.requested_gpus is not None else st.gpus
        reason = "suspend" if st.target_gpus == 0 else st.pending_reason or "scale"
        st.pending_reason = st.requested_gpus = None
        st.history.append(
            Reconfiguration(reason=reason, started_at=time.time(),
                            from_config=self._config_text(), from_gpus=st.gpus, from_hosts=list(st.hosts))
        )
        self._enter(Phase.RECONFIGURING, Stage.STOPPING, f"asked the workers to stop after step {st.stop_at_step}")

    def _config_text(self) -> str | None:
        cfg = self.status.parallel_config
        return cfg.describe() if cfg else None

    def _advance_reconfiguration(self) -> None:
        st = self.status
        if st.stage == Stage.STOPPING:
            self._await_stop()
        elif st.stage == Stage.SNAPSHOT:
            self._await_snapshot()
        elif st.stage == Stage.PLANNING:
            self._plan()
        elif st.stage == Stage.RESTARTING:
            self._restart()

    def _await_stop(self) -> None:
        st = self.status
        failure = self._peer_failure
        lost = [h.name for h in self.backend.hosts() if not h.ready and h.name in st.hosts]
        ids = [w.worker_id for w in st.workers]
        exits = self.backend.exited(self.spec.name, ids)
        # An unknown exit code (a worker adopted after a scheduler restart) is not a failure by itself:
        # the snapshot stage asks the stores whether the stop step was committed.
        bad = {wid: c for wid, c in exits.items() if c not in (0, None)}
        if failure or lost or bad:
            reason = failure or (f"host {', '.join(lost)} lost" if lost else f"workers exited abnormally while stopping: {bad}")
            self._begin_failure(reason)
            return
        if len(exits) == len(ids):
            st.downtime_started_at = time.time()
            self._enter(Phase.RECONFIGURING, Stage.SNAPSHOT, f"workers stopped after step {st.stop_at_step}")
            return
        if time.monotonic() - self._stage_started > self.settings.stop_timeout:
            self._begin_failure(f"workers did not stop at step {st.stop_at_step} within {self.settings.stop_timeout:.0f}s")

    def _await_snapshot(self) -> None:
        """Find the stop version on the stores: the requested step, or a later one when the request came late."""
        st = self.status
        assert st.stop_at_step is not None
        holders = self._holders()
        need = set(self.ptc(st.generation).hosts)
        candidates: dict[str, set[str]] = {}
        for host, versions in holders.items():
            for v in versions:
                parsed = Version.parse(v)
                if parsed.generation == st.generation and parsed.step >= st.stop_at_step:
                    candidates.setdefault(v, set()).add(host)
        complete = [v for v, have in candidates.items() if need <= have]
        if complete:
            version = max(complete, key=Version.parse)
            st.committed[version] = sorted(candidates[version])
            st.version_generation[version] = st.generation
            st.version = version
            self._enter(Phase.RECONFIGURING, Stage.PLANNING, f"version {version} committed on {len(need)} hosts")
        elif time.monotonic() - self._stage_started > self.settings.stop_timeout:
            partial = {v: sorted(need - have) for v, have in candidates.items()}
            self._begin_failure(f"no version at or after step {st.stop_at_step} is committed on every host {sorted(need)}"
                                f" (missing: {partial or 'all'})")

    def _holders(self) -> dict[str, list[str]]:
        """Committed versions of this job on every ready host's store (the ground truth)."""
        out: dict[str, list[str]] = {}
        for h in self.backend.hosts():
            if not h.ready:
                continue
            try:
                infos = self._client_for(h.store_url).versions(self.spec.name)
            except NotFound:
                out[h.name] = []
                continue
            except TenplexError as exc:
                log.warning("job %s: store of %s unreachable: %s", self.spec.name, h.name, exc.detail)
                continue
            out[h.name] = [str(v.version) for v in infos if v.committed]
        return out

    def _plan(self) -> None:
        st = self.status
        if st.target_gpus == 0:
            self._suspend()
            return
        version = Version.parse(st.version or "")
        old_gen = st.version_generation.get(str(version), version.generation)
        old_ptc = self.ptc(old_gen)
        consumed = self._consumed_at(version)
        gpus = st.target_gpus or st.gpus
        try:
            decision = self._decide_feasible(gpus, self._preferred_hosts(), consumed)
        except TenplexError as exc:
            self._fail(f"no configuration for the new allocation: {exc.detail}")
            return
        # Never reuse a generation: a failed attempt may have committed its version name on some hosts.
        new_gen = self._next_generation()
        new_version = Version(version.step, new_gen)
        holders = self._holders()
        alive = [h for h in holders]
        try:
            plan = make_plan(
                old_ptc, decision.ptc, job=self.spec.name, old_version=version, new_version=new_version,
                holders={h: version for h, vs in holders.items() if str(version) in vs}, alive=alive,
            )
        except StateLost as exc:
            self._fail(f"state lost: {exc.detail}")
            return
        self._set_ptc(new_gen, decision.ptc)
        rec = st.history[-1]
        rec.to_config = decision.parallel.describe()
        rec.to_gpus = decision.parallel.world_size
        rec.to_hosts = list(decision.placement.hosts)
        rec.version_from = str(version)
        rec.version_to = str(new_version)
        rec.lower_bound_bytes = plan.lower_bound_bytes
        st.last_plan = {"plan": plan.to_json(), "explain": plan.explain(), "parallel": decision.parallel.to_json(),
                        "hosts": list(decision.placement.hosts), "gpus_per_node": decision.placement.gpus_per_node}
        st.target_gpus = decision.parallel.world_size
        self._enter(Phase.RECONFIGURING, Stage.TRANSFERRING,
                    f"plan {version} -> {new_version}: {plan.network_bytes} B over the network (lower bound {plan.lower_bound_bytes} B), {plan.local_bytes} B local")

    def _next_generation(self) -> int:
        """A generation no earlier attempt used: a failed or cancelled transfer may have left its version's name
        (committed on some hosts, or as a transform record on the daemons, which would attach a new submission
        of that name to the old attempt), so the last plan's target counts as used too."""
        st = self.status
        used = [st.generation, *st.version_generation.values()]
        if st.last_plan is not None:
            used.append(Version.parse(st.last_plan["plan"]["new_version"]).generation)
        return max(used) + 1

    def _consumed_at(self, version: Version) -> int:
        """The dataset position after ``version``'s step: where the next generation's sample order resumes."""
        return self.spec.dataset.consumed_samples + version.step * self.spec.dataset.global_batch_size

    def _preferred_hosts(self) -> list[str]:
        """Where the workers run, or for a suspended job, where its state is: the plan moves less from there."""
        return list(self.status.hosts) or sorted(self.status.committed.get(self.status.version or "", []))

    # -- suspend and resume -----------------------------------------------------

    def _suspend(self) -> None:
        """Scaled to 0: the workers have stopped after the snapshot ``status.version`` (None: nothing ran yet)."""
        st = self.status
        self.backend.stop(self.spec.name, [w.worker_id for w in st.workers], grace=2.0)
        version = st.version
        held = sorted(st.committed.get(version, [])) if version else []
        if st.history and st.history[-1].finished_at is None:
            rec = st.history[-1]
            rec.to_gpus, rec.to_hosts, rec.version_from = 0, [], version
            rec.finished_at = time.time()
            if self.metrics is not None:
                self.metrics.reconfigurations.labels(self.spec.name, rec.reason).inc()
        st.workers, st.hosts, st.gpus = [], [], 0
        st.target_gpus = st.stop_at_step = st.downtime_started_at = st.restored_step = None
        st.restore_version = version
        if version is None:
            self._enter(Phase.SUSPENDED, None, "suspended before its first snapshot: a scale up starts it at step 0")
        else:
            self._enter(Phase.SUSPENDED, None, f"suspended: state {version} kept on {held}; a scale up resumes from it")

    def _check_suspended(self) -> None:
        st = self.status
        gpus = st.requested_gpus
        if not gpus:
            return
        if st.version is None:  # suspended before it ever ran: start as a new job would
            st.pending_reason = None
            self._enter(Phase.PENDING, None, f"resuming on {gpus} GPUs from step 0")
            return
        version = Version.parse(st.version)
        consumed = self._consumed_at(version)
        try:
            self._decide_feasible(gpus, self._preferred_hosts(), consumed)
        except TenplexError as exc:
            st.message = f"suspended; resume on {gpus} GPUs waiting: {exc.detail}"
            return
        st.requested_gpus = st.pending_reason = None
        st.history.append(Reconfiguration(reason="resume", started_at=time.time(), from_config=None, from_gpus=0,
                                          from_hosts=[]))
        st.target_gpus = gpus
        st.downtime_started_at = time.time()
        self._enter(Phase.RECONFIGURING, Stage.PLANNING, f"resuming from {st.version} on {gpus} GPUs")

    def _decide_feasible(self, gpus: int, prefer: list[str], consumed: int) -> policy_mod.Decision:
        """The wanted GPU count if it fits on what is usable, else the largest count >= min_gpus that does
        (counts in whole pods: multiples of ``gpus_per_pod``)."""
        capacity = sum(self._slots(h) for h in self._usable_hosts())
        g = self.spec.gpus_per_pod
        errors = []
        for n in range(min(gpus, capacity) // g * g, self.spec.min_gpus - 1, -g):
            try:
                return self._decide(n, prefer, consumed)
            except InvalidConfig as exc:
                errors.append(f"{n} GPUs: {exc.detail}")
        raise InvalidConfig("; ".join(errors[:3]) or f"only {capacity} GPUs usable, the job needs at least {self.spec.min_gpus}")

    def _transfer(self) -> None:
        """The target hosts' daemons build the new version; this thread sends them their sub-plans and follows.

        Runs without the job's lock (status, plan and scale requests answer
        meanwhile) except for the moments it reads or changes the status. Not a
        byte of state passes through the scheduler: each daemon pulls its pieces
        from the source daemons itself. Submissions are idempotent, so a
        scheduler restarted here submits again and attaches to what runs.
        """
        with self.lock:
            st = self.status
            assert st.last_plan is not None
            plan = Plan.from_json(st.last_plan["plan"])
        stores = {h.name: h.store_url for h in self.backend.hosts() if h.ready}
        run: PlanRun | None = None
        try:
            run = PlanRun(plan, stores, token=self.settings.token, client_for=self._client_for)
            statuses = run.submit()
            while not all(s.finished for s in statuses.values()) and run.failure(statuses) is None:
                lost = [h.name for h in self.backend.hosts() if h.name in plan.hosts and not h.ready]
                if lost:
                    run.cancel()
                    with self.lock:
                        self._begin_failure(f"host {', '.join(lost)} lost during the transfer to {plan.new_version}")
                    return
                with self.lock:
                    st.message = _transfer_progress(plan, statuses)
                if self._closing.wait(self.settings.poll_interval):
                    return  # the daemons carry on; a restarted scheduler attaches to them
                statuses = run.poll()
        except TenplexError as exc:  # a daemon unreachable (after retries): as for a lost host
            if run is not None:
                with contextlib.suppress(TenplexError):
                    run.cancel()
            with self.lock:
                self._begin_failure(f"transfer interrupted: {exc.detail}")
            return
        failed = run.failure(statuses)
        if failed is not None:
            run.cancel()
            detail = "; ".join(f"{h}: {s.state}: {s.error}" for h, s in statuses.items() if s.finished and s.state != "committed")
            with self.lock:
                if failed.error_code in ("interrupted", TransformCancelled.code, StoreUnavailable.code):
                    self._begin_failure(f"transfer interrupted: {detail}")
                else:
                    self._fail(f"transfer failed: {detail}")
            return
        reports = [s.transform_report() for s in statuses.values()]
        new_version = str(plan.new_version)
        with self.lock:
            rec = st.history[-1]
            rec.bytes_local += sum(r.bytes_local for r in reports)
            rec.bytes_remote += sum(r.bytes_remote for r in reports)
            rec.bytes_zero += sum(r.bytes_zero for r in reports)
            if self.metrics is not None:
                self.metrics.bytes_moved.labels(self.spec.name, "remote").inc(sum(r.bytes_remote for r in reports))
                self.metrics.bytes_moved.labels(self.spec.name, "local").inc(sum(r.bytes_local for r in reports))
            st.committed[new_version] = sorted(plan.hosts)
            st.version_generation[new_version] = plan.new_version.generation
            st.version = new_version
            st.restore_version = new_version
            self._enter(Phase.RECONFIGURING, Stage.RESTARTING, f"state {new_version} in place on {len(plan.hosts)} hosts")

    def _restart(self) -> None:
        st = self.status
        assert st.last_plan is not None and st.restore_version is not None
        gen = Version.parse(st.restore_version).generation
        cfg = ParallelConfig.from_json(st.last_plan["parallel"])
        if st.workers and all(w.generation == gen and w.pid for w in st.workers):
            # Launched just before a scheduler restart: they are adopted; wait for them as for new workers.
            self._enter(Phase.RUNNING, None, f"restarted in {cfg.describe()} from {st.restore_version}")
            return
        if st.workers and any(w.generation == gen for w in st.workers):
            self.backend.stop(self.spec.name, [w.worker_id for w in st.workers], grace=2.0)  # a half-done launch
        placement = Placement(st.last_plan["gpus_per_node"], tuple(st.last_plan["hosts"]))
        decision = policy_mod.Decision(cfg, placement, self.ptc(gen), "planned")
        st.restored_step = Version.parse(st.restore_version).step
        st.step = st.restored_step  # a rollback after a failure goes back to the version's step
        if st.downtime_started_at is None:
            st.downtime_started_at = time.time()
        self._launch(decision, generation=gen)
        self._enter(Phase.RUNNING, None, f"restarted in {cfg.describe()} from {st.restore_version}")

    def _finish_downtime(self) -> None:
        st = self.status
        assert st.downtime_started_at is not None
        rec = st.history[-1] if st.history else None
        if rec is not None and rec.finished_at is None:
            rec.finished_at = time.time()
            rec.downtime_seconds = round(rec.finished_at - st.downtime_started_at, 3)
            if self.metrics is not None:
                self.metrics.reconfigurations.labels(self.spec.name, rec.reason).inc()
                self.metrics.downtime.labels(self.spec.name).observe(rec.downtime_seconds)
        st.downtime_started_at = None
        st.restored_step = None
        self._save()

    # -- failures -------------------------------------------------------------

    def _begin_failure(self, reason: str) -> None:
        """Stop everything now, then recover from the newest version the survivors hold."""
        st = self.status
        log.warning("job %s: failure: %s", self.spec.name, reason)
        suspending = st.phase == Phase.RECONFIGURING and st.target_gpus == 0
        ids = [w.worker_id for w in st.workers]
        self.backend.stop(self.spec.name, ids, grace=2.0)
        self._peer_failure = None
        if st.history and st.history[-1].finished_at is None and st.history[-1].reason != "failure":
            # The change in progress ends here; its downtime so far is its own. Before its new workers were
            # launched it did not happen: say so.
            if st.phase == Phase.RECONFIGURING:
                st.history[-1].error = st.history[-1].error or f"interrupted by a failure: {reason}"
            if st.downtime_started_at is not None:
                self._finish_downtime()
            else:  # still stopping the workers: no downtime yet
                st.history[-1].finished_at = time.time()
        st.downtime_started_at = st.downtime_started_at or time.time()
        if not st.history or st.history[-1].finished_at is not None or st.history[-1].reason != "failure":
            st.history.append(Reconfiguration(reason="failure", started_at=time.time(), from_config=self._config_text(),
                                              from_gpus=st.gpus, from_hosts=list(st.hosts)))
        rec = st.history[-1]
        # A failure during the recovery from another one joins its record: keep every cause, first first.
        rec.error = f"{rec.error}; then {reason}" if rec.error else reason
        st.failures_without_progress += 1
        if st.failures_without_progress > self.spec.max_restarts:
            n = st.failures_without_progress
            self._fail(f"giving up after {n} failure{'s' if n > 1 else ''} in a row without a newer snapshot "
                       f"(max_restarts {self.spec.max_restarts}): {rec.error}")
            return
        holders = self._holders()
        candidates = sorted({v for vs in holders.values() for v in vs}, key=lambda v: Version.parse(v), reverse=True)
        reached = max([st.step] + [w.step for w in st.workers if w.step is not None])
        for version in candidates:
            gen = st.version_generation.get(version, Version.parse(version).generation)
            try:
                ptc = self.ptc(gen)
            except NotFound:
                continue
            have = {h for h, vs in holders.items() if version in vs}
            if not _covers(ptc, have):
                continue
            st.version = version
            rec.steps_lost = max(0, reached - Version.parse(version).step)
            if suspending:  # the state is held: suspended from there, nothing to restart
                self._suspend()
                return
            st.target_gpus = st.requested_gpus or st.target_gpus or st.gpus
            st.stop_at_step = None
            self._enter(Phase.RECONFIGURING, Stage.PLANNING,
                        f"{reason}; recovering from {version} held by {sorted(have)} ({rec.steps_lost} steps lost)")
            return
        if st.version is None:
            if suspending:
                self._suspend()
            else:
                self._restart_from_beginning(reason, reached)
            return
        self._fail(f"{reason}; no version of the state is fully held by the surviving hosts {sorted(holders)}")

    def _restart_from_beginning(self, reason: str, reached: int) -> None:
        """A failure before any version was committed everywhere: nothing to recover, so start again at step 0.

        Only the steps since the start are lost; failing the job instead would
        lose the same steps and need a person to resubmit it.
        """
        st = self.status
        try:
            decision = self._decide_feasible(st.requested_gpus or st.target_gpus or st.gpus, list(st.hosts),
                                             self.spec.dataset.consumed_samples)
        except TenplexError as exc:
            self._fail(f"{reason}; no configuration to restart on: {exc.detail}")
            return
        gen = self._next_generation()
        self._set_ptc(gen, decision.ptc)
        rec = st.history[-1]
        rec.steps_lost = reached
        rec.to_config = decision.parallel.describe()
        rec.to_gpus = decision.parallel.world_size
        rec.to_hosts = list(decision.placement.hosts)
        st.restore_version = None
        st.restored_step = st.step = 0
        self._launch(decision, generation=gen)
        self._enter(Phase.RUNNING, None, f"{reason}; no snapshot yet: restarted from step 0 in "
                                         f"{decision.parallel.describe()} ({reached} steps lost)")

    def _fail(self, reason: str) -> None:
        st = self.status
        self.backend.stop(self.spec.name, [w.worker_id for w in st.workers], grace=2.0)
        if st.history and st.history[-1].finished_at is None:
            st.history[-1].error = reason
            st.history[-1].finished_at = time.time()
        self._enter(Phase.FAILED, None, reason)

    def delete(self) -> None:
        with self.lock:
            self.backend.stop(self.spec.name, [w.worker_id for w in self.status.workers], grace=5.0)
        self.close()
        self.state.delete(self.spec.name)


def _transfer_progress(plan: Plan, statuses: Mapping[str, TransformStatus]) -> str:
    done = sum(s.bytes_done for s in statuses.values())
    total = sum(s.bytes_total for s in statuses.values()) or 1
    running = sum(1 for s in statuses.values() if not s.finished)
    rate = sum(s.rate for s in statuses.values() if not s.finished)
    return (f"transfer to {plan.new_version}: {100 * done / total:.0f}% of {human_bytes(total)}, "
            f"{running} of {len(statuses)} hosts still at work, {human_bytes(rate)}/s")


def _covers(ptc: PTC, hosts: set[str]) -> bool:
    """Whether devices on ``hosts`` hold at least one replica of every shard of ``ptc``."""
    held = {d.id for d in ptc.devices if d.host in hosts}
    return all(held.intersection(s.devices) for t in ptc.tensors for s in t.shards)


def job_view(spec: JobSpec, status: JobStatus) -> Mapping[str, Any]:
    """The JSON the REST API returns for a job."""
    return {"spec": spec.to_json(), "status": status.to_json()}


def log_dir_for(state: JobStore, job: str) -> Path:
    return state.root / "logs" / job
