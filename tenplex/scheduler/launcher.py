"""Starting a generation's workers, and what each is told when it registers.

A generation's workers are the ranks of its parallel configuration placed on
its hosts: each gets torchrun's environment (rank, world size, local rank,
the rendezvous at rank 0's host) and Tenplex's (the scheduler's URL, its
worker id, its host's store), is recorded in the job's record before any of
them can register, and is started by the backend. At registration it receives
its :class:`~tenplex.core.protocol.Assignment`: its rank and parallel
coordinates, the PTC of its generation (inline, or a URL when large), the
version to restore and the step to stop after.
"""

from __future__ import annotations

from tenplex.core.protocol import (
    ENV_GENERATION,
    ENV_HOST,
    ENV_JOB,
    ENV_SCHEDULER_URL,
    ENV_SNAPSHOT_EVERY,
    ENV_STORE_URL,
    ENV_TOKEN,
    ENV_WORKER_ID,
    Assignment,
)
from tenplex.ptc import PTC
from tenplex.scheduler import policy as policy_mod
from tenplex.scheduler.backend import WorkerLaunch
from tenplex.scheduler.context import JobContext
from tenplex.scheduler.state import WorkerRecord

LAUNCH_TEARDOWN_GRACE_S = 30.0
"""How long a stopped worker may take to exit before the next generation is started over it (then SIGKILL)."""


def ptc_digest(ptc: PTC) -> str:
    """What tells one PTC from another of the same job and generation (a job deleted and created again under its
    name): the CRC-32 and size of its JSON, the trailer of the gzipped JSON made once per PTC anyway. In a PTC's
    ``ptc_url``, so that a node daemon keeps a fetched PTC under it (:class:`tenplex.node.relay.PtcCache`) and the
    scheduler refuses a digest that is not its PTC's."""
    return ptc.gzipped_json[-8:].hex()


class WorkerLauncher:
    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self._ptc_json: dict[int, dict | None] = {}
        """Generation -> its PTC as inlined in assignments (None: too large, fetched from /ptc); made once, not
        once per registering worker."""
        self._ptc_url: dict[int, str] = {}
        """Generation -> where its workers fetch a PTC too large to inline (with its :func:`ptc_digest`)."""
        self._standby_generation: int | None = None

    def launch(self, decision: policy_mod.Decision, generation: int) -> None:
        """Record and start the workers of ``generation`` in ``decision``'s configuration and placement."""
        ctx = self.ctx
        st, spec, settings = ctx.status, ctx.spec, ctx.settings
        cfg, placement = decision.parallel, decision.placement
        if st.history and st.history[-1].finished_at is None:
            st.history[-1].to_generation = generation
        ctx.mark("launch_started")
        # The previous generation's workers may still be tearing down after reporting their stop: they end
        # (and free their GPUs) before the new ones start.
        previous = [w.worker_id for w in st.workers if w.generation != generation]
        if previous:
            ctx.backend.stop(spec.name, previous, grace=LAUNCH_TEARDOWN_GRACE_S)
        st.parallel = cfg.to_json()
        st.gpus = cfg.world_size
        st.hosts = list(placement.hosts)
        st.gpus_per_node = placement.gpus_per_node
        st.stop_at_step = None
        st.target_gpus = st.target_parallel = None
        ctx.exit_reports = {}
        ctx.peer_failure = None
        master = ctx.backend.host(placement.hosts[0])
        st.master_addr = master.address
        st.master_port = ctx.backend.master_port(master)
        workers, launches = [], []
        local_index: dict[str, int] = {}
        credential = settings.worker_credential(spec.name)  # one per generation, shared by its ranks
        for rank in range(cfg.world_size):
            host = placement.host_of(rank)
            local_rank = local_index.get(host, 0)
            local_index[host] = local_rank + 1
            wid = f"{spec.name}-g{generation}-r{rank}"
            info = ctx.backend.host(host)
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(cfg.world_size),
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(placement.gpus_per_node),
                "MASTER_ADDR": master.address,
                "MASTER_PORT": str(st.master_port),
                ENV_SCHEDULER_URL: settings.url,
                ENV_JOB: spec.name,
                ENV_WORKER_ID: wid,
                ENV_STORE_URL: info.store_url,
                ENV_HOST: host,
                ENV_GENERATION: str(generation),
                ENV_SNAPSHOT_EVERY: str(spec.snapshot_every),
                **dict(spec.env),
            }
            if credential:
                env[ENV_TOKEN] = credential
            workers.append(WorkerRecord(worker_id=wid, rank=rank, host=host, local_rank=local_rank, generation=generation))
            launches.append(WorkerLaunch(wid, rank, host, local_rank, env))
        st.workers = workers
        st.generation = generation
        if st.redeploy_pending:
            assert st.spec_update is not None
            st.spec_update = {**st.spec_update, "pending": False, "generation": generation}
        ctx.save()  # the workers exist in the record before any of them can register
        log_dir = ctx.state.root / "logs" / spec.name / f"g{generation}"
        pids = ctx.backend.launch(spec.name, spec.command, launches, log_dir)
        for w in workers:
            w.pid = pids.get(w.worker_id)
        ctx.mark("launched")
        ctx.save()

    def keep_standby(self) -> None:
        """Warm standbys for the next change (the job's ``standby``): asked for once the generation trains,
        so that their imports do not compete with its start for the CPU; kept across generations."""
        ctx = self.ctx
        if ctx.spec.standby and self._standby_generation != ctx.status.generation:
            self._standby_generation = ctx.status.generation
            log_dir = ctx.state.root / "logs" / ctx.name / "standby"
            ctx.status.standby_wanted = ctx.backend.keep_standby(ctx.name, ctx.spec.command, ctx.spec.env, log_dir)
        if ctx.spec.standby:
            ctx.status.standby_ready = ctx.backend.standby_ready(ctx.name)

    def assignment(self, w: WorkerRecord) -> Assignment:
        ctx = self.ctx
        st = ctx.status
        if w.generation not in self._ptc_json:
            ptc = ctx.ptc(w.generation)
            self._ptc_json[w.generation] = ptc.to_json() if len(ptc.dumps()) <= ctx.settings.ptc_inline_limit else None
            if self._ptc_json[w.generation] is None:
                self._ptc_url[w.generation] = (f"{ctx.settings.url}/v1/jobs/{ctx.name}/ptc?generation={w.generation}"
                                               f"&digest={ptc_digest(ptc)}")
        inline = self._ptc_json[w.generation]
        return Assignment(
            job=ctx.name,
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
            store_url=ctx.backend.host(w.host).store_url,
            ptc=inline,
            ptc_url=None if inline is not None else self._ptc_url[w.generation],
            stop_at_step=st.stop_at_step,
            total_steps=ctx.spec.steps,
            heartbeat_interval_s=ctx.settings.heartbeat_interval,
        )
