"""The reconfiguration orchestration: from a decision to change to the new workers training.

Planned (a scale request, a redeploy off cordoned hosts, a redeploy with a changed spec)::

    Running -> stopping (workers stop after step N) -> snapshot (step N committed everywhere)
            -> planning (new configuration, placement, PTC, plan) -> transferring (the target nodes'
               daemons build the new version) -> restarting (new workers launched) -> Running

On a failure the workers are stopped at once and the newest version the
survivors hold (:func:`~tenplex.scheduler.decide.choose_recovery`) is the
old version of the plan; the steps since are reported as lost. Scaling to 0
suspends (state kept on the stores); a later scale resumes from it. Every
stage is idempotent, so a scheduler restarted in any stage carries on:
workers are re-adopted, the stores say what is committed, the daemons'
transforms are attached to again, never run twice.

Not a byte of state passes through this module: it decides, plans and sends
plans; the node daemons move the bytes (:mod:`tenplex.node.transforms`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

from tenplex.core.units import human_bytes
from tenplex.core.version import Version
from tenplex.errors import (
    InvalidConfig,
    NotFound,
    StateLost,
    StoreUnavailable,
    TenplexError,
    TransformCancelled,
)
from tenplex.ptc import PTC, ParallelConfig, Placement
from tenplex.scheduler import policy as policy_mod
from tenplex.scheduler import resume as resume_mod
from tenplex.scheduler.backend import HostInfo
from tenplex.scheduler.context import JobContext
from tenplex.scheduler.decide import choose_recovery, find_stop_version, missing_text, steps_reached
from tenplex.scheduler.launcher import WorkerLauncher
from tenplex.scheduler.persist import Housekeeper
from tenplex.scheduler.plans import PlanInputs
from tenplex.scheduler.state import Phase, Reconfiguration, Stage, phase_split
from tenplex.transformer.plan import Plan
from tenplex.transformer.remote import COMMITTED, INTERRUPTED, PlanRun, TransformStatus

log = logging.getLogger(__name__)

TRANSFER_POLL_S = 1.0
"""Longest wait of one status read of the daemons during a transfer (lost hosts are checked between reads)."""

STOP_MARGIN_STEPS = 0
"""A planned stop is asked for at the newest reported step: the ranks stop after the step at which the first
of them hears of it (they agree on the earliest request in one collective per step, see
:func:`~tenplex.worker.control.agree_stop`), so training stands still at the next step boundary they all
reach instead of some steps later. The stop snapshot is whichever step that was."""


class Orchestrator:
    """One job's reconfigurations (see the module doc); every method runs with the job's lock held,
    except :meth:`transfer`, which takes it only to read and change the record."""

    def __init__(self, ctx: JobContext, launcher: WorkerLauncher, housekeeper: Housekeeper | None = None) -> None:
        self.ctx = ctx
        self.launcher = launcher
        self.housekeeper = housekeeper
        self._saved: resume_mod.SavedVersion | None = None
        """The persistent version a ``resume_from`` job starts from, once read (not re-read while it waits)."""

    # -- placement --------------------------------------------------------------------------------------

    def _usable_hosts(self, reachable: set[str] | None = None) -> list[HostInfo]:
        """Ready, schedulable hosts (and, given ``reachable``, only those whose store answered just now: a
        host whose daemon has died is not placed on before the backend notices it is lost), with the GPUs
        the job's own current workers hold counted as free: they are stopped before the new ones start."""
        ctx = self.ctx
        own = ctx.backend.gpus_held_by(ctx.name, ctx.worker_ids())
        return [dataclasses.replace(h, gpus=h.gpus + own.get(h.name, 0)) if own.get(h.name) else h
                for h in ctx.backend.hosts()
                if h.ready and h.schedulable and (reachable is None or h.name in reachable)]

    def _slots(self, host: HostInfo) -> int:
        """The GPUs of ``host`` the job can use: whole groups of ``gpus_per_pod`` (a pod's ranks share a host)."""
        g = self.ctx.spec.gpus_per_pod
        return host.gpus // g * g

    def decide(self, gpus: int, prefer: list[str], dataset_consumed: int,
               reachable: set[str] | None = None, old: PTC | None = None,
               state_holders: set[str] | None = None) -> policy_mod.Decision:
        """The configuration and placement for ``gpus`` GPUs; with ``old`` (the layout of the state the change
        starts from, held by ``state_holders``), placed where that state is (see :mod:`tenplex.scheduler.policy`)."""
        spec = self.ctx.spec
        st = self.ctx.status
        policy = spec.policy
        if st.target_parallel is not None and ParallelConfig.from_json(st.target_parallel).world_size == gpus:
            # the change asks for a configuration: it is this job's policy for this change
            policy = policy_mod.Policy(table={gpus: ParallelConfig.from_json(st.target_parallel)})
        g = spec.gpus_per_pod
        if gpus % g:
            raise InvalidConfig(f"{gpus} GPUs is not a multiple of gpus_per_pod {g}")
        hosts = [h for h in self._usable_hosts(reachable) if self._slots(h)]
        if not hosts:
            raise InvalidConfig("no ready, schedulable hosts" + (f" with {g} GPUs for a pod" if g > 1 else ""))
        order = sorted(hosts, key=lambda h: (h.name not in prefer, prefer.index(h.name) if h.name in prefer else 0, h.name))
        gpus_per_node = min(self._slots(h) for h in order)
        dataset = spec.dataset.__class__(
            spec.dataset.num_samples, spec.dataset.seed, spec.dataset.global_batch_size, dataset_consumed
        )

        def build(cfg: ParallelConfig, placement: Placement) -> PTC:
            return spec.layout.build(cfg, placement, dataset)

        return policy_mod.choose(gpus, policy, build, [h.name for h in order], gpus_per_node, old=old,
                                 holders=state_holders)

    def decide_feasible(self, gpus: int, prefer: list[str], consumed: int,
                        reachable: set[str] | None = None, old: PTC | None = None,
                        state_holders: set[str] | None = None) -> policy_mod.Decision:
        """The wanted GPU count if it fits on what is usable, else the largest count >= min_gpus that does
        (counts in whole pods: multiples of ``gpus_per_pod``)."""
        capacity = sum(self._slots(h) for h in self._usable_hosts(reachable))
        g = self.ctx.spec.gpus_per_pod
        errors = []
        for n in range(min(gpus, capacity) // g * g, self.ctx.spec.min_gpus - 1, -g):
            try:
                return self.decide(n, prefer, consumed, reachable, old, state_holders)
            except InvalidConfig as exc:
                errors.append(f"{n} GPUs: {exc.detail}")
        raise InvalidConfig("; ".join(errors[:3]) or f"only {capacity} GPUs usable, the job needs at least {self.ctx.spec.min_gpus}")

    def preferred_hosts(self) -> list[str]:
        """Where the workers run, or for a suspended job, where its state is: the plan moves less from there."""
        st = self.ctx.status
        return list(st.hosts) or sorted(st.committed.get(st.version or "", []))

    def holders(self) -> dict[str, list[str]]:
        """Committed versions of this job on every ready host's store (the ground truth), asked in parallel;
        an unreachable store is left out."""
        ctx = self.ctx
        hosts = [h for h in ctx.backend.hosts() if h.ready]

        def one(h: HostInfo) -> tuple[str, list[str] | None]:
            try:
                infos = ctx.client_for(h.store_url).versions(ctx.name)
            except NotFound:
                return h.name, []
            except TenplexError as exc:
                log.warning("job %s: store of %s unreachable: %s", ctx.name, h.name, exc.detail)
                return h.name, None
            ctx.backend.heard_from(h.name)  # its daemon answered: the health watch need not probe it this round
            return h.name, [str(v.version) for v in infos if v.committed]

        if not hosts:
            return {}
        with ThreadPoolExecutor(max_workers=min(32, len(hosts)), thread_name_prefix="tenplex-holders") as pool:
            answers = list(pool.map(one, hosts))
        return {name: versions for name, versions in answers if versions is not None}

    # -- starting ---------------------------------------------------------------------------------------

    def start_fresh(self) -> None:
        ctx, st = self.ctx, self.ctx.status
        if st.workers and ctx.spec.resume_from is None:  # a first launch begun and cut short
            self._finish_first_launch()
            return
        if st.requested_gpus == 0:  # suspended before it ever started
            st.requested_gpus = st.pending_reason = None
            self.suspend()
            return
        if ctx.spec.resume_from is not None:
            self.start_resumed()
            return
        try:
            decision = self.decide(st.requested_gpus or ctx.spec.gpus, [], ctx.spec.dataset.consumed_samples)
        except TenplexError as exc:
            st.message = f"waiting: {exc.detail}"
            return
        ctx.set_ptc(0, decision.ptc)
        st.generation = 0
        st.restore_version = None
        st.requested_gpus = None
        st.pending_reason = None
        self.launcher.launch(decision, generation=0)
        ctx.enter(Phase.RUNNING, None,
                  f"started in {decision.parallel.describe()} on {len(decision.placement.hosts)} hosts ({decision.reason})")

    def _finish_first_launch(self) -> None:
        """Finish the first launch, begun and cut short (the cluster's API went away mid-launch, or the scheduler
        restarted): its workers are in the record (they are saved before any pod or process is made), and so is
        its decision (configuration, placement, the PTC of generation 0), which is carried out, not made again.

        A new decision would see the GPUs that the launch's own pods hold as taken, and any scale request that
        came in meanwhile: it could wait for GPUs while those pods run unwatched (a Pending job looks at no
        worker: one that fails is never noticed), or adopt pods made for another layout as its own. A request
        that came in meanwhile is acted on once the job runs. As a restart's half-done launch, the workers not
        known to run (no process id: a pod, or a process never started) are stopped and launched again whole,
        so that every rank gets the same rendezvous."""
        ctx, st = self.ctx, self.ctx.status
        if st.parallel is None or not st.hosts:
            raise StateLost(f"job {ctx.name}: its record lists workers {ctx.worker_ids()} of a first launch "
                            "without that launch's configuration and placement")
        cfg = ParallelConfig.from_json(st.parallel)
        placement = Placement(st.gpus_per_node, tuple(st.hosts))
        if not all(w.pid for w in st.workers):
            log.info("job %s: finishing its first launch (%s on %s), cut short before", ctx.name, cfg.describe(),
                     ", ".join(placement.hosts))
            ctx.backend.stop(ctx.name, ctx.worker_ids(), grace=2.0)
            self.launcher.launch(policy_mod.Decision(cfg, placement, ctx.ptc(0), "as decided before"), generation=0)
        ctx.enter(Phase.RUNNING, None, f"started in {cfg.describe()} on {len(placement.hosts)} hosts "
                                       "(a launch cut short, finished as decided)")

    def start_resumed(self) -> None:
        """The first start of a job with ``resume_from``: plan its layout from the persistent version's PTC,
        every region read from the checkpoint (the job it was saved under, which may be another one), launch
        the workers to restore it at its step and data position; :meth:`transfer` has the daemons build it."""
        ctx, st = self.ctx, self.ctx.status
        rf = ctx.spec.resume_from
        assert rf is not None
        hosts = [h for h in ctx.backend.hosts() if h.ready]
        if not hosts:
            st.message = "waiting: no ready host whose store daemon can read the persistent version"
            return
        source_job = rf.source_job(ctx.name)
        what = f"cannot resume from {rf.version} of job {source_job!r} at {rf.uri}"
        clients = [ctx.client_for(h.store_url).request_json for h in hosts]
        try:
            saved = self._saved or resume_mod.find_saved(clients, rf, ctx.name)
            resume_mod.check_dataset(saved, ctx.spec.dataset.num_samples, ctx.spec.dataset.seed)
            if ctx.spec.steps <= saved.version.step:
                raise InvalidConfig(f"the job's steps ({ctx.spec.steps}) must go past the version's step "
                                    f"{saved.version.step}: there would be nothing left to train")
        except TenplexError as exc:
            self.fail(f"{what}: {exc.detail}")
            return
        self._saved = saved
        try:
            decision = self.decide(st.requested_gpus or ctx.spec.gpus, [], saved.consumed_samples)
        except TenplexError as exc:
            st.message = f"waiting: {exc.detail}"
            return
        mismatch = resume_mod.model_mismatch(saved.ptc, decision.ptc)
        if mismatch:
            shown = "; ".join(mismatch[:10]) + (f"; and {len(mismatch) - 10} more" if len(mismatch) > 10 else "")
            self.fail(f"{what}: the job's model does not match the saved state ({len(mismatch)} difference"
                      f"{'s' if len(mismatch) > 1 else ''}): {shown}")
            return
        # A generation after the saved version's (its name differs from it, under any job name) that no earlier
        # attempt used.
        gen = max(saved.version.generation + 1, ctx.next_generation() if st.last_plan is not None else 0)
        new_version = Version(saved.version.step, gen)
        inputs = PlanInputs.of(job=ctx.name, old_version=saved.version, new_version=new_version, old_generation=None,
                               alive=[h.name for h in hosts], holders=[], checkpoint=rf.uri, old_job=source_job)
        try:
            plan = inputs.plan(saved.ptc, decision.ptc)
        except TenplexError as exc:
            self.fail(f"{what}: {exc.detail}")
            return
        ctx.set_ptc(gen, decision.ptc)
        st.resumed_from = {"uri": rf.uri, "job": source_job, "version": str(saved.version),
                           "step": saved.version.step, "consumed_samples": saved.consumed_samples}
        st.requested_gpus = st.pending_reason = None
        st.history.append(Reconfiguration(
            reason="resume", started_at=time.time(), from_config=saved.describe(), from_gpus=len(saved.ptc.devices),
            to_config=decision.parallel.describe(), to_gpus=decision.parallel.world_size,
            to_hosts=list(decision.placement.hosts), version_from=str(saved.version), version_to=str(new_version),
            lower_bound_bytes=plan.lower_bound_bytes, source=f"{rf.uri} (job {source_job})"))
        ctx.mark("requested")
        self._record_plan(inputs, plan, decision)
        ctx.mark("planned")
        st.restore_version = str(new_version)
        self._launch_generation(decision, gen)
        ctx.enter(Phase.RECONFIGURING, Stage.TRANSFERRING,
                  f"resuming from {saved.version} of job {source_job!r} at {rf.uri} (step {saved.version.step}, "
                  f"{saved.consumed_samples} samples consumed) in {decision.parallel.describe()}: "
                  f"{plan.network_bytes} B from the checkpoint; new workers starting")

    # -- planned --------------------------------------------------------------------------------------------

    def begin_planned(self) -> None:
        ctx, st = self.ctx, self.ctx.status
        if st.downtime_started_at is not None:  # the previous change's workers are training: close its record
            self.finish_downtime()
        newest = max([w.step for w in st.workers if w.step is not None] + [st.step])
        st.stop_at_step = newest + STOP_MARGIN_STEPS
        st.target_gpus = st.requested_gpus if st.requested_gpus is not None else st.gpus
        st.target_parallel = st.requested_parallel
        # A changed spec is what this change is for when it brings one (a scale in the same apply comes along).
        reason = "suspend" if st.target_gpus == 0 else "spec" if st.redeploy_pending else st.pending_reason or "scale"
        st.pending_reason = st.requested_gpus = st.requested_parallel = None
        st.history.append(Reconfiguration(reason=reason, started_at=time.time(), from_config=ctx.config_text(),
                                          from_gpus=st.gpus, from_hosts=list(st.hosts)))
        ctx.mark("requested")
        ctx.enter(Phase.RECONFIGURING, Stage.STOPPING, f"asked the workers to stop after step {st.stop_at_step}")

    def workers_stopped(self) -> None:
        self.ctx.status.downtime_started_at = time.time()
        self.ctx.mark("stopped")
        self.ctx.enter(Phase.RECONFIGURING, Stage.SNAPSHOT, f"workers stopped after step {self.ctx.status.stop_at_step}")

    def await_snapshot(self) -> None:
        """The stop version, once it is committed on every host of the generation. The workers' snapshot
        reports say so first (each committing worker reports its host's commit): when they cover every host the
        stores are not asked; otherwise (a report lost with its worker) the stores, the ground truth, are."""
        ctx, st = self.ctx, self.ctx.status
        need = set(ctx.ptc(st.generation).hosts)
        reported: dict[str, list[str]] = {}
        for version, hosts in st.committed.items():
            for host in hosts:
                reported.setdefault(host, []).append(version)
        # stage_age 0: incomplete reports are never a failure; the stores decide that below
        outcome = find_stop_version(st, reported, need, stage_age=0.0, stop_timeout=ctx.settings.stop_timeout)
        if outcome.version is None:
            outcome = find_stop_version(st, self.holders(), need, stage_age=ctx.stage_age,
                                        stop_timeout=ctx.settings.stop_timeout)
        if outcome.failure is not None:
            self.begin_failure(outcome.failure)
        elif outcome.version is not None:
            st.committed[outcome.version] = list(outcome.holders)
            st.version_generation[outcome.version] = st.generation
            st.version = outcome.version
            ctx.mark("committed")
            ctx.enter(Phase.RECONFIGURING, Stage.PLANNING, f"version {outcome.version} committed on {len(need)} hosts")

    def plan(self) -> None:
        ctx, st = self.ctx, self.ctx.status
        if st.target_gpus == 0:
            self.suspend()
            return
        version = Version.parse(st.version or "")
        old_generation = st.version_generation.get(str(version), version.generation)
        old_ptc = ctx.ptc(old_generation)
        gpus = st.target_gpus or st.gpus
        # Placement and planning see the same hosts alive: those whose stores answer now.
        holders = self.holders()
        try:
            decision = self.decide_feasible(gpus, self.preferred_hosts(), ctx.consumed_at(version), set(holders),
                                            old_ptc, {h for h, vs in holders.items() if str(version) in vs})
        except TenplexError as exc:
            self.fail(f"no configuration for the new allocation: {exc.detail}")
            return
        new_gen = ctx.next_generation()
        new_version = Version(version.step, new_gen)
        # Regions no survivor holds come from the persistent checkpoint, when it has this version.
        checkpoint = ctx.spec.checkpoint.uri if ctx.spec.checkpoint is not None and str(version) in st.persisted else None
        inputs = PlanInputs.of(job=ctx.name, old_version=version, new_version=new_version,
                               old_generation=old_generation, alive=list(holders),
                               holders=[h for h, vs in holders.items() if str(version) in vs], checkpoint=checkpoint)
        try:
            plan = inputs.plan(old_ptc, decision.ptc)
        except StateLost as exc:
            gone = sorted(set(st.committed.get(str(version), ())) - set(holders))
            if gone:
                # A host that held the version was lost after the recovery chose it (its daemon still answered
                # then): another failure, so choose again from what is left (max_restarts bounds the repeats).
                self.begin_failure(f"{', '.join(gone)} lost before the plan from {version} was made")
                return
            self.fail(f"state lost: {exc.detail}")
            return
        ctx.set_ptc(new_gen, decision.ptc)
        rec = st.history[-1]
        rec.to_config = decision.parallel.describe()
        rec.to_gpus = decision.parallel.world_size
        rec.to_hosts = list(decision.placement.hosts)
        rec.version_from = str(version)
        rec.version_to = str(new_version)
        rec.lower_bound_bytes = plan.lower_bound_bytes
        self._record_plan(inputs, plan, decision)
        st.target_gpus = decision.parallel.world_size
        ctx.mark("planned")
        # The new workers start now: their interpreter, imports, model build and rendezvous overlap the
        # transfer, and each restores as soon as the version is committed on its node.
        st.restore_version = str(new_version)
        self._launch_generation(decision, new_gen)
        ctx.enter(Phase.RECONFIGURING, Stage.TRANSFERRING,
                  f"plan {version} -> {new_version}: {plan.network_bytes} B over the network "
                  f"(lower bound {plan.lower_bound_bytes} B), {plan.local_bytes} B local; new workers starting")

    def _record_plan(self, inputs: PlanInputs, plan: Plan, decision: policy_mod.Decision) -> None:
        """Keep what the plan is computed from in the record (small at any scale), the plan itself in memory."""
        self.ctx.status.last_plan = {"inputs": inputs.to_json(), "parallel": decision.parallel.to_json(),
                                     "hosts": list(decision.placement.hosts),
                                     "gpus_per_node": decision.placement.gpus_per_node}
        self.ctx.plan_cache = (inputs, plan)

    def current_plan(self) -> Plan:
        """The last reconfiguration's plan: the one made in this process, else computed again from the record's
        inputs and the persisted PTCs (after a scheduler restart; the planner is deterministic, so it is the same
        plan). Call with the job's lock held."""
        ctx, st = self.ctx, self.ctx.status
        if st.last_plan is None:
            raise NotFound(f"job {ctx.name!r} has not been reconfigured yet")
        inputs = PlanInputs.from_json(st.last_plan.get("inputs"))
        cached = ctx.plan_cache
        if cached is not None and cached[0] == inputs:
            return cached[1]
        if inputs.old_generation is not None:
            old = ctx.ptc(inputs.old_generation)
        else:  # a resumed job's first plan: the old layout is the persistent version's, read from there again
            old = self._saved_version(inputs.old_version).ptc
        start = time.perf_counter()
        plan = inputs.plan(old, ctx.ptc(inputs.new_generation))
        log.info("job %s: plan %s -> %s computed again from its inputs in %.2f s", ctx.name, inputs.old_version,
                 inputs.new_version, time.perf_counter() - start)
        ctx.plan_cache = (inputs, plan)
        return plan

    def _saved_version(self, version: str) -> resume_mod.SavedVersion:
        """The persistent version this resumed job started from (``version``, as resolved when it was planned)."""
        ctx = self.ctx
        rf = ctx.spec.resume_from
        if rf is None:
            raise NotFound(f"job {ctx.name!r} has no resume_from: no persistent version to plan from")
        if self._saved is None or str(self._saved.version) != version:
            clients = [ctx.client_for(h.store_url).request_json for h in ctx.backend.hosts() if h.ready]
            self._saved = resume_mod.find_saved(clients, dataclasses.replace(rf, version=version), ctx.name)
        return self._saved

    def transfer(self, closing: Callable[[float], bool]) -> None:
        """The target hosts' daemons build the new version; this thread sends them their sub-plans and follows.

        Runs without the job's lock (status, plan and scale requests answer
        meanwhile) except for the moments it reads or changes the record.
        Submissions are idempotent, so a scheduler restarted here submits again
        and attaches to what runs. ``closing(seconds)`` waits between polls and
        says whether the scheduler is shutting down (the daemons carry on).
        """
        ctx = self.ctx
        with ctx.lock:
            st = ctx.status
            plan = self.current_plan()
            if "transfer_started" not in (st.history[-1].marks if st.history else {}):
                ctx.mark("transfer_started")
        stores = {h.name: h.store_url for h in ctx.backend.hosts() if h.ready}
        run: PlanRun | None = None
        try:
            run = PlanRun(plan, stores, token=ctx.settings.transform_grant(plan.job), client_for=ctx.client_for)
            statuses = run.submit()
            # Every target's daemon answers its submission and then each poll until its transform ends (a poll
            # that one of them does not answer raises): between two generations no worker relays heartbeats,
            # and these answers are what keeps the health watch from probing a thousand daemons every second.
            self._heard(statuses)
            while not all(s.finished for s in statuses.values()) and run.failure(statuses) is None:
                lost = [h.name for h in ctx.backend.hosts() if h.name in plan.hosts and not h.ready]
                if lost:
                    run.cancel()
                    with ctx.lock:
                        self.begin_failure(f"host {', '.join(lost)} lost during the transfer to {plan.new_version}")
                    return
                with ctx.lock:
                    st.message = _transfer_progress(plan, statuses)
                if closing(0):
                    return
                # Each daemon answers as soon as its transform ends: the commit is learnt of at once.
                asked = [h for h, s in statuses.items() if not s.finished]
                statuses = run.poll(wait=TRANSFER_POLL_S)
                self._heard(asked)
        except TenplexError as exc:  # a daemon unreachable (after retries): as for a lost host
            if run is not None:
                with contextlib.suppress(TenplexError):
                    run.cancel()
            with ctx.lock:
                self.begin_failure(f"transfer interrupted: {exc.detail}")
            return
        failed = run.failure(statuses)
        if failed is not None:
            run.cancel()
            detail = "; ".join(f"{h}: {s.state}: {s.error}" for h, s in statuses.items()
                               if s.finished and s.state != COMMITTED)
            with ctx.lock:
                # Interrupted (a daemon restarted), cancelled (by an operator) or a daemon unreachable: the
                # change failed, not the job; anything else (no source left for a piece) is the state lost.
                if failed.error_code in (INTERRUPTED, TransformCancelled.code, StoreUnavailable.code):
                    self.begin_failure(f"transfer interrupted: {detail}")
                else:
                    self.fail(f"transfer failed: {detail}")
            return
        reports = [s.transform_report() for s in statuses.values()]
        new_version = str(plan.new_version)
        with ctx.lock:
            rec = st.history[-1]
            rec.bytes_local += sum(r.bytes_local for r in reports)
            rec.bytes_remote += sum(r.bytes_remote for r in reports)
            rec.bytes_zero += sum(r.bytes_zero for r in reports)
            if ctx.metrics is not None:
                ctx.metrics.bytes_moved.labels(ctx.name, "remote").inc(sum(r.bytes_remote for r in reports))
                ctx.metrics.bytes_moved.labels(ctx.name, "local").inc(sum(r.bytes_local for r in reports))
            st.committed[new_version] = sorted(plan.hosts)
            st.version_generation[new_version] = plan.new_version.generation
            st.version = new_version
            st.restore_version = new_version
            ctx.mark("transferred")
            if self.housekeeper is not None:
                self.housekeeper.committed(new_version)
            if st.workers and all(w.generation == plan.new_version.generation for w in st.workers):
                ctx.enter(Phase.RUNNING, None, f"running in {ctx.config_text()} from {new_version} (its workers "
                                               "started during the transfer)")
            else:
                ctx.enter(Phase.RECONFIGURING, Stage.RESTARTING, f"state {new_version} in place on {len(plan.hosts)} hosts")

    def _heard(self, hosts: Iterable[str]) -> None:
        for host in hosts:
            self.ctx.backend.heard_from(host)

    def restart(self) -> None:
        ctx, st = self.ctx, self.ctx.status
        assert st.last_plan is not None and st.restore_version is not None
        gen = Version.parse(st.restore_version).generation
        cfg = ParallelConfig.from_json(st.last_plan["parallel"])
        if st.workers and all(w.generation == gen and w.pid for w in st.workers):
            # Launched just before a scheduler restart: they are adopted; wait for them as for new workers.
            ctx.enter(Phase.RUNNING, None, f"restarted in {cfg.describe()} from {st.restore_version}")
            return
        if st.workers and any(w.generation == gen for w in st.workers):
            ctx.backend.stop(ctx.name, ctx.worker_ids(), grace=2.0)  # a half-done launch
        placement = Placement(st.last_plan["gpus_per_node"], tuple(st.last_plan["hosts"]))
        self._launch_generation(policy_mod.Decision(cfg, placement, ctx.ptc(gen), "planned"), gen)
        ctx.enter(Phase.RUNNING, None, f"restarted in {cfg.describe()} from {st.restore_version}")

    def _launch_generation(self, decision: policy_mod.Decision, generation: int) -> None:
        """Start ``generation``'s workers to restore ``status.restore_version``."""
        st = self.ctx.status
        assert st.restore_version is not None
        st.restored_step = Version.parse(st.restore_version).step
        st.step = st.restored_step  # a rollback after a failure goes back to the version's step
        if st.downtime_started_at is None:
            st.downtime_started_at = time.time()
        self.launcher.launch(decision, generation=generation)

    def finish_downtime(self) -> None:
        ctx, st = self.ctx, self.ctx.status
        assert st.downtime_started_at is not None
        rec = st.history[-1] if st.history else None
        if rec is not None and rec.finished_at is None:
            # Training stood still from the agreed stop step (the workers' own clocks; else from their exit) to
            # the end of the first step in the new layout (the worker's clock; else when it was heard of).
            rec.finished_at = rec.marks.get("first_step") or time.time()
            began = rec.marks.get("stop_agreed") or st.downtime_started_at
            rec.downtime_seconds = round(max(0.0, rec.finished_at - began), 3)
            rec.phases = phase_split(rec.marks)
            if ctx.metrics is not None:
                ctx.metrics.reconfigurations.labels(ctx.name, rec.reason).inc()
                ctx.metrics.downtime.labels(ctx.name).observe(rec.downtime_seconds)
                for phase, seconds in rec.phases.items():
                    ctx.metrics.phases.labels(ctx.name, phase).observe(seconds)
        st.downtime_started_at = None
        st.restored_step = None
        ctx.save()

    # -- suspend and resume ----------------------------------------------------------------------------

    def suspend(self) -> None:
        """Scaled to 0: the workers have stopped after the snapshot ``status.version`` (None: nothing ran yet)."""
        ctx, st = self.ctx, self.ctx.status
        ctx.backend.stop(ctx.name, ctx.worker_ids(), grace=2.0)
        version = st.version
        held = sorted(st.committed.get(version, [])) if version else []
        if st.history and st.history[-1].finished_at is None:
            rec = st.history[-1]
            rec.to_gpus, rec.to_hosts, rec.version_from = 0, [], version
            rec.finished_at = time.time()
            if ctx.metrics is not None:
                ctx.metrics.reconfigurations.labels(ctx.name, rec.reason).inc()
        st.workers, st.hosts, st.gpus = [], [], 0
        st.target_gpus = st.target_parallel = st.stop_at_step = st.downtime_started_at = st.restored_step = None
        st.restore_version = version
        if version is None:
            ctx.enter(Phase.SUSPENDED, None, "suspended before its first snapshot: a scale up starts it at step 0")
        else:
            ctx.enter(Phase.SUSPENDED, None, f"suspended: state {version} kept on {held}; a scale up resumes from it")

    def check_suspended(self) -> None:
        ctx, st = self.ctx, self.ctx.status
        gpus = st.requested_gpus
        if not gpus:
            return
        if st.version is None:  # suspended before it ever ran: start as a new job would
            st.pending_reason = None
            ctx.enter(Phase.PENDING, None, f"resuming on {gpus} GPUs from step 0")
            return
        try:
            self.decide_feasible(gpus, self.preferred_hosts(), ctx.consumed_at(Version.parse(st.version)))
        except TenplexError as exc:
            st.message = f"suspended; resume on {gpus} GPUs waiting: {exc.detail}"
            return
        st.requested_gpus = st.pending_reason = None
        st.history.append(Reconfiguration(reason="resume", started_at=time.time(), from_config=None, from_gpus=0,
                                          from_hosts=[]))
        ctx.mark("requested")
        st.target_gpus = gpus
        st.downtime_started_at = time.time()
        ctx.enter(Phase.RECONFIGURING, Stage.PLANNING, f"resuming from {st.version} on {gpus} GPUs")

    # -- failures -----------------------------------------------------------------------------------------

    def begin_failure(self, reason: str) -> None:
        """Stop everything now, then recover from the newest version the survivors hold."""
        ctx, st = self.ctx, self.ctx.status
        log.warning("job %s: failure: %s", ctx.name, reason)
        suspending = st.phase == Phase.RECONFIGURING and st.target_gpus == 0
        ctx.backend.stop(ctx.name, ctx.worker_ids(), grace=2.0)
        ctx.peer_failure = None
        if st.history and st.history[-1].finished_at is None and st.history[-1].reason != "failure":
            # The change in progress ends here; its downtime so far is its own. Before its new workers were
            # launched it did not happen: say so.
            if st.phase == Phase.RECONFIGURING:
                st.history[-1].error = st.history[-1].error or f"interrupted by a failure: {reason}"
            if st.downtime_started_at is not None:
                self.finish_downtime()
            else:  # still stopping the workers: no downtime yet
                st.history[-1].finished_at = time.time()
        st.downtime_started_at = st.downtime_started_at or time.time()
        reached: int | None = None
        if not st.history or st.history[-1].finished_at is not None or st.history[-1].reason != "failure":
            st.history.append(Reconfiguration(reason="failure", started_at=time.time(), from_config=ctx.config_text(),
                                              from_gpus=st.gpus, from_hosts=list(st.hosts)))
            ctx.mark("requested")
        elif st.version is not None:
            # Joined: the first failure went back to st.version, losing rec.steps_lost steps, and nothing trained
            # since (a trained step closes the record); the steps lost count from the step it had reached.
            reached = Version.parse(st.version).step + st.history[-1].steps_lost
        rec = st.history[-1]
        # A failure during the recovery from another one joins its record: keep every cause, first first.
        rec.error = f"{rec.error}; then {reason}" if rec.error else reason
        st.failures_without_progress += 1
        if st.failures_without_progress > ctx.spec.max_restarts:
            n = st.failures_without_progress
            self.fail(f"giving up after {n} failure{'s' if n > 1 else ''} in a row without a newer snapshot "
                      f"(max_restarts {ctx.spec.max_restarts}): {rec.error}")
            return
        holders = self.holders()

        def ptc_of(generation: int) -> PTC | None:
            try:
                return ctx.ptc(generation)
            except NotFound:
                return None

        recovery = choose_recovery(st, holders, ptc_of, st.persisted, reached)
        if recovery is not None:
            st.version = recovery.version
            rec.steps_lost = recovery.steps_lost
            if recovery.persistent:
                reason = f"{reason}; the survivors do not hold every region of {recovery.version}: the rest comes " \
                         f"from the persistent checkpoint"
            if suspending:  # the state is held: suspended from there, nothing to restart
                self.suspend()
                return
            st.target_gpus = st.requested_gpus or st.target_gpus or st.gpus
            st.stop_at_step = None
            ctx.enter(Phase.RECONFIGURING, Stage.PLANNING,
                      f"{reason}; recovering from {recovery.version} held by {list(recovery.holders)} "
                      f"({recovery.steps_lost} steps lost)")
            return
        if st.version is None:
            if suspending:
                self.suspend()
            elif ctx.spec.resume_from is not None:
                self.resume_again(reason)
            else:
                self.restart_from_beginning(reason, steps_reached(st))
            return
        newest = ptc_of(st.version_generation.get(st.version, Version.parse(st.version).generation))
        lacking = missing_text(newest, set(holders)) if newest is not None else ""
        self.fail(f"{reason}; no version of the state is fully held by the surviving hosts {sorted(holders)}"
                  + (f" or the persistent checkpoint {ctx.spec.checkpoint.uri} (it holds "
                     f"{', '.join(st.persisted) or 'no version yet'})" if ctx.spec.checkpoint is not None
                     else " and the job has no persistent checkpoint")
                  + (f"; of {st.version} they lack {lacking}" if lacking else ""))

    def resume_again(self, reason: str) -> None:
        """A failure before a job resumed from a persistent version committed one of its own: start over from
        that persistent version (not from step 0), under a generation no attempt used."""
        ctx, st = self.ctx, self.ctx.status
        ctx.backend.stop(ctx.name, ctx.worker_ids(), grace=2.0)
        rec = st.history[-1]
        rec.finished_at = time.time()
        st.workers, st.hosts, st.gpus = [], [], 0
        st.downtime_started_at = st.restored_step = st.restore_version = st.stop_at_step = None
        st.resumed_from = None
        self._saved = None
        ctx.enter(Phase.PENDING, None, f"{reason}; resuming again from the persistent version")

    def restart_from_beginning(self, reason: str, reached: int) -> None:
        """A failure before any version was committed everywhere: nothing to recover, so start again at step 0.

        Only the steps since the start are lost; failing the job instead would
        lose the same steps and need a person to resubmit it.
        """
        ctx, st = self.ctx, self.ctx.status
        try:
            decision = self.decide_feasible(st.requested_gpus or st.target_gpus or st.gpus, list(st.hosts),
                                            ctx.spec.dataset.consumed_samples)
        except TenplexError as exc:
            self.fail(f"{reason}; no configuration to restart on: {exc.detail}")
            return
        gen = ctx.next_generation()  # never reuse a generation's names
        ctx.set_ptc(gen, decision.ptc)
        rec = st.history[-1]
        rec.steps_lost = reached
        rec.to_config = decision.parallel.describe()
        rec.to_gpus = decision.parallel.world_size
        rec.to_hosts = list(decision.placement.hosts)
        st.restore_version = None
        st.restored_step = st.step = 0
        self.launcher.launch(decision, generation=gen)
        ctx.enter(Phase.RUNNING, None, f"{reason}; no snapshot yet: restarted from step 0 in "
                                       f"{decision.parallel.describe()} ({reached} steps lost)")

    def fail(self, reason: str) -> None:
        ctx, st = self.ctx, self.ctx.status
        ctx.backend.stop(ctx.name, ctx.worker_ids(), grace=2.0)
        if st.history and st.history[-1].finished_at is None:
            st.history[-1].error = reason
            st.history[-1].finished_at = time.time()
        ctx.enter(Phase.FAILED, None, reason)


def _transfer_progress(plan: Plan, statuses: Mapping[str, TransformStatus]) -> str:
    done = sum(s.bytes_done for s in statuses.values())
    total = sum(s.bytes_total for s in statuses.values()) or 1
    running = sum(1 for s in statuses.values() if not s.finished)
    rate = sum(s.rate for s in statuses.values() if not s.finished)
    return (f"transfer to {plan.new_version}: {100 * done / total:.0f}% of {human_bytes(total)}, "
            f"{running} of {len(statuses)} hosts still at work, {human_bytes(rate)}/s")
