"""One object that takes a training loop through an elastic job: :class:`ElasticWorker`.

A training script does::

    worker = ElasticWorker.from_scheduler()            # or ElasticWorker(WorkerSetup(...)) standalone
    worker.init_process_group()                        # rendezvous at the assignment's master
    model, optimizer, lr_scheduler = build(worker.parallel, ...)    # on "meta" + materialize() when
    worker.prepare(model, optimizer)                                 #   not worker.needs_initial_values
    start = worker.restore(model, optimizer, lr_scheduler)   # state and data position of the version
    for step, ids in worker.batches(dp_rank, start):           # this rank's sample ids per step
        loss = train_step(ids)
        if worker.step_done(step, loss, model, optimizer, lr_scheduler):
            break                                      # stop request obeyed, step snapshotted
    return worker.finish()                             # reports the exit; the process exit code

Everything the scheduler tells the worker arrives through the assignment and
the heartbeats; the decision to stop is taken collectively (one tiny
all-reduce per step, :func:`~tenplex.worker.control.agree_stop`) so that all
ranks snapshot the same step. A failing collective is reported to the
scheduler as a peer failure (:meth:`ElasticWorker.peer_failure`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tenplex.core import protocol as p
from tenplex.core.version import Version
from tenplex.errors import InvalidConfig, StateLost
from tenplex.ptc import PTC, DatasetState, ParallelConfig
from tenplex.store import StoreClient, TensorStore, open_store
from tenplex.worker.control import ControlClient, Heartbeat, agree_stop
from tenplex.worker.restore import RestoreResult, restore
from tenplex.worker.sampler import ElasticSampler
from tenplex.worker.snapshot import SnapshotResult, Snapshotter
from tenplex.worker.state import check_layout, ensure_optimizer_state, live_pieces

log = logging.getLogger(__name__)


COMMIT_WAIT_S = 3600.0
"""How long a new worker waits for its version to be committed on its node (the transfer's time, at most)."""


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    """Everything one worker process needs; from the scheduler's assignment or given explicitly."""

    job: str
    generation: int
    rank: int
    ptc: PTC
    store: str
    """The node-local store: an ``http(s)://`` URL of its daemon or its root directory on this machine."""
    parallel: ParallelConfig
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    restore_version: Version | None = None
    stop_at_step: int | None = None
    total_steps: int | None = None
    token: str | None = None
    heartbeat_interval_s: float = 5.0
    worker_id: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.parallel.world_size:
            raise InvalidConfig(f"rank {self.rank} is outside {self.parallel.describe()} (world size {self.parallel.world_size})")
        self.ptc.device(self.rank)  # the PTC must know this device

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def host(self) -> str:
        return self.ptc.device(self.rank).host

    @property
    def coords(self) -> dict[str, int]:
        return self.parallel.coords(self.rank)

    @classmethod
    def from_assignment(cls, a: p.Assignment, ptc: PTC, token: str | None) -> WorkerSetup:
        return cls(
            job=a.job,
            generation=a.generation,
            rank=a.rank,
            ptc=ptc,
            store=a.store_url,
            parallel=ParallelConfig.from_json(a.parallel),
            master_addr=a.master_addr,
            master_port=a.master_port,
            restore_version=Version.parse(a.restore_version) if a.restore_version else None,
            stop_at_step=a.stop_at_step,
            total_steps=a.total_steps,
            token=token,
            heartbeat_interval_s=a.heartbeat_interval_s,
            worker_id=a.worker_id,
        )


def node_store(env: Mapping[str, str], store_url: str, token: str | None) -> TensorStore:
    """The node-local store as this worker reaches it best: its root directory when the backend mounted
    it here (``TENPLEX_STORE_ROOT``, shared with the daemon), else the daemon at ``store_url``.

    With the root, the store uses the memory tier its daemon recorded there, at
    ``TENPLEX_STORE_MEMORY_ROOT`` when set (the tier's directory as mounted here):
    snapshots are then written into the node's memory, in room the daemon reserved
    for them (``POST .../reservation``, once per snapshot): the daemon alone places
    versions in its tier, evicts and moves them."""
    root = env.get(p.ENV_STORE_ROOT, "")
    if root and os.path.isdir(root):
        memory = env.get(p.ENV_STORE_MEMORY_ROOT) or None
        daemon = StoreClient(store_url, token=token) if store_url.startswith(("http://", "https://")) else None
        store = open_store(root, memory_root=memory, placement=daemon)
        log.info("node store at %s (direct, shared with the daemon at %s)%s", root, store_url,
                 f"; memory tier {memory or 'as recorded there'}" if getattr(store, "memory", None) is not None else "")
        return store
    if root:
        log.warning("%s=%s is not a directory here; using the store daemon at %s", p.ENV_STORE_ROOT, root, store_url)
    return open_store(store_url, token)


class ElasticWorker:
    """The glue between a training loop and Tenplex (see the module docstring)."""

    def __init__(
        self,
        setup: WorkerSetup,
        control: ControlClient | None = None,
        *,
        snapshot_every: int | None = None,
        store: TensorStore | None = None,
    ) -> None:
        if snapshot_every is not None and snapshot_every < 1:
            raise InvalidConfig(f"snapshot_every must be >= 1 or None, got {snapshot_every}")
        self.setup = setup
        self.control = control
        self.snapshot_every = snapshot_every
        self.store = store if store is not None else open_store(setup.store, setup.token)
        self.snapshotter = Snapshotter(
            self.store, setup.job, setup.ptc, setup.rank, on_done=self._report_snapshot if control else None
        )
        self.heartbeat = (
            Heartbeat(control, setup.generation, setup.heartbeat_interval_s, setup.stop_at_step,
                      node=(setup.store, setup.host) if setup.store.startswith(("http://", "https://")) else None).start()
            if control is not None
            else None
        )
        self.restored: RestoreResult | None = None
        self.dataset: DatasetState | None = setup.ptc.dataset
        self.step = 0
        self.status = "running"
        self.snapshots: list[Version] = []
        self._last_snapshot_step: int | None = None
        self._first_step_marked = False
        self.marks: dict[str, float] = {}
        """This worker's milestones so far (wall clock)."""

    @classmethod
    def from_scheduler(
        cls, environ: Mapping[str, str] | None = None, *, snapshot_every: int | None = None
    ) -> ElasticWorker:
        """Register with the scheduler named by ``TENPLEX_*`` variables and take its assignment.

        ``snapshot_every`` defaults to the job's interval (``TENPLEX_SNAPSHOT_EVERY``).
        """
        env = os.environ if environ is None else environ
        if snapshot_every is None and env.get(p.ENV_SNAPSHOT_EVERY):
            text = env[p.ENV_SNAPSHOT_EVERY]
            if not text.strip().isdigit():
                raise InvalidConfig(f"{p.ENV_SNAPSHOT_EVERY} must be a positive integer, got {text!r}")
            snapshot_every = int(text)
        control = ControlClient.from_env(env)
        if env.get(p.ENV_STORE_ROOT):
            # The node store will be opened from its directory: its implementation loads zarr (about 150 modules,
            # 0.1 s alone, up to 2 s measured while a reconfiguration loads the machine). Imported before
            # registering, it is part of the worker's imports (or of its standby's), not of the rendezvous.
            import tenplex.store.local  # noqa: F401
        rank = int(env[p.ENV_RANK]) if env.get(p.ENV_RANK) else None
        assignment = control.register(host=env.get(p.ENV_HOST) or None, rank=rank)
        registered = time.time()
        daemon = assignment.store_url if assignment.store_url.startswith(("http://", "https://")) else None
        ptc = control.fetch_ptc(assignment, daemon)  # through the node daemon when it relays for this scheduler
        setup = WorkerSetup.from_assignment(assignment, ptc, control.token)
        log.info(
            "registered as rank %d of %d (%s) on %s, generation %d, restore %s",
            setup.rank,
            setup.world_size,
            setup.parallel.describe(),
            setup.host,
            setup.generation,
            setup.restore_version or "nothing",
        )
        worker = cls(setup, control, snapshot_every=snapshot_every, store=node_store(env, setup.store, setup.token))
        worker.mark("registered", registered)
        started = process_start_time()
        if started is not None:
            worker.mark("process_started", started)
        return worker

    @property
    def parallel(self) -> ParallelConfig:
        return self.setup.parallel

    @property
    def needs_initial_values(self) -> bool:
        """Whether the model needs its initial values: False when the assignment restores a version.

        A restore overwrites every parameter and optimizer state tensor, so a
        job that restores should build and parallelize its model on the
        ``meta`` device and allocate it without values
        (:func:`~tenplex.worker.state.materialize`): no random draws, no
        collectives that distribute them. A fresh job builds its seeded values.
        """
        return self.setup.restore_version is None

    def mark(self, name: str, when: float | None = None) -> None:
        """Milestone ``name`` reached (:data:`~tenplex.core.protocol.WORKER_MARKS`): the scheduler splits
        a reconfiguration's downtime into phases with them (the slowest worker's), and this worker logs its
        own start-up with them at its first step."""
        when = time.time() if when is None else when
        self.marks[name] = when
        if self.heartbeat is not None:
            self.heartbeat.mark(name, when)

    # -- start ------------------------------------------------------------------------

    def init_process_group(self, backend: str | None = None, timeout_s: float = 300.0) -> None:
        """``torch.distributed`` rendezvous at the assignment's master (env:// style, set here).

        Rank 0 hosts the rendezvous store (torch's ``TCPStore``). A client that
        finds nothing listening yet backs off before it tries again: 0.4 to 0.7 s
        measured (torch 2.13), paid whenever rank 0 is even a few milliseconds
        later than a peer, which after a reconfiguration is a coin toss. So the
        other ranks first wait for rank 0's port to listen, polling every few
        milliseconds (:func:`wait_for_listener`), and connect at the first try.

        With CUDA the default backend is :func:`default_backend`'s ``cpu:gloo,cuda:nccl``: the model's
        collectives run on NCCL, and the few CPU ones Tenplex makes (the per-step stop agreement,
        :func:`~tenplex.worker.control.agree_stop`) on gloo, without a device round trip. The process
        group is bound to this rank's device (``device_id``, :func:`rank_device`; set as the current
        device): NCCL's communicator is made here, during the rendezvous, not lazily inside the first
        training step, and no collective can pick another GPU.
        """
        import datetime

        import torch.distributed as dist

        # torch's store-based barrier at the end of init_process_group polls for the slowest rank (about half a
        # second here); the job's first collective waits for every rank anyway. A user's own setting wins.
        os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "0")
        os.environ[p.ENV_MASTER_ADDR] = self.setup.master_addr
        os.environ[p.ENV_MASTER_PORT] = str(self.setup.master_port)
        os.environ[p.ENV_RANK] = str(self.setup.rank)
        os.environ[p.ENV_WORLD_SIZE] = str(self.setup.world_size)
        if backend is None:
            backend = default_backend()
        device = rank_device(os.environ) if "nccl" in backend else None
        if device is not None:
            torch.cuda.set_device(device)
        started = time.monotonic()
        waited = 0.0
        if self.setup.rank != 0 and self.setup.world_size > 1:
            waited = wait_for_listener(self.setup.master_addr, self.setup.master_port, timeout_s)
        dist.init_process_group(
            backend,
            rank=self.setup.rank,
            world_size=self.setup.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device,
        )
        self.mark("process_group")
        log.info("rank %d: process group up in %.3f s (%.3f s waiting for rank 0's store at %s:%d)", self.setup.rank,
                 time.monotonic() - started, waited, self.setup.master_addr, self.setup.master_port)

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Create the optimizer state eagerly and check the live layout against the PTC.

        Run right after building the parallelized model: a layout provider that
        disagrees with the live job is an error at start-up, naming the first
        differing tensor, not a corrupt snapshot later. Creating AdamW's state
        (zeros, step 0) before the first step does not change its updates; when
        a restore follows, the state is allocated without values (it is
        overwritten).
        """
        if optimizer is not None:
            ensure_optimizer_state(model, optimizer, self.setup.ptc, zeros=self.needs_initial_values)
        check_layout(live_pieces(model, optimizer), self.setup.ptc, self.setup.rank)

    def restore(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
        *,
        seed: int = 0,
    ) -> int:
        """Load the assigned version, if any; returns the number of steps already completed.

        New workers are started while their version is still being built on the nodes (their start-up
        overlaps the transfer), so the version may not be committed yet: it is waited for, up to
        ``commit_timeout_s`` (the scheduler stops this worker if the transfer fails).
        """
        self.mark("restore_started")
        if self.setup.restore_version is None:
            self.step = 0
            self.mark("restored")
            return 0
        self.wait_for_version(self.setup.restore_version)
        self.restored = restore(
            self.store,
            self.setup.job,
            self.setup.restore_version,
            self.setup.ptc,
            self.setup.rank,
            model,
            optimizer,
            lr_scheduler=lr_scheduler,
            seed=seed,
        )
        self.step = self.restored.step
        self.dataset = self.restored.dataset
        self._last_snapshot_step = self.step  # that state is stored already
        self.mark("restored")
        if self.heartbeat is not None:
            self.heartbeat.update(self.step)  # so the scheduler never sees step 0 from a resumed job
        return self.step

    def wait_for_version(self, version: Version, timeout_s: float = COMMIT_WAIT_S) -> None:
        """Until ``version`` of the job is committed in this node's store (at once when it is): the store
        answers when it commits it (the daemon's long poll), not when asked again."""
        if self.store.wait_committed(self.setup.job, version, 0.0):
            return
        log.info("rank %d: waiting for %s to be committed on this node", self.setup.rank, version)
        if not self.store.wait_committed(self.setup.job, version, timeout_s):
            raise StateLost(f"version {version} of job {self.setup.job!r} was not committed in this node's "
                            f"store within {timeout_s:.0f} s")
        log.info("rank %d: %s is committed on this node; restoring", self.setup.rank, version)

    def batches(self, dp_rank: int, start_step: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """``(step, sample ids)`` for this data-parallel rank, from the restored position on.

        ``step`` counts completed steps after this one (1 for the first step
        of a fresh job), matching the versions' step numbers. Stops at
        ``total_steps`` when the assignment bounds the job.
        """
        if self.dataset is None:
            raise InvalidConfig("the PTC has no dataset state; the elastic sampler needs one")
        start = self.step if start_step is None else start_step
        total = self.setup.total_steps
        steps = None if total is None else max(0, total - start)
        sampler = ElasticSampler(self.dataset, dp_rank, self.parallel.dp, steps)
        for offset, ids in enumerate(sampler.batches()):
            yield start + offset + 1, ids

    # -- every step -----------------------------------------------------------------------

    def step_done(
        self,
        step: int,
        loss: float | None,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any | None = None,
        *,
        extra: Mapping[str, Any] | None = None,
    ) -> bool:
        """Call after every completed step; returns True when the loop must end now.

        Snapshots every ``snapshot_every`` steps and at a stop request (the
        stop step is snapshotted and its write awaited before returning).
        """
        self.step = step
        if not self._first_step_marked:
            self._first_step_marked = True
            self.mark("first_step")
            self._log_start_up()
        if self.heartbeat is not None:
            self.heartbeat.update(step, loss)
        local_stop = self._local_stop_at()
        stop, abort = agree_stop(
            step, local_stop, self.heartbeat.abort if self.heartbeat is not None else False
        )
        if abort:
            log.warning("rank %d: the scheduler asked to exit at once after step %d", self.setup.rank, step)
            self.status = "stopped"
            return True
        if stop:
            self.mark("stop_agreed")  # training stands still from here
        periodic = self.snapshot_every is not None and step % self.snapshot_every == 0
        if (stop or periodic) and self._last_snapshot_step != step:
            self.snapshot(step, model, optimizer, lr_scheduler, extra=extra)
        if stop:
            self.snapshotter.wait()
            self.mark("snapshot_written")
            log.info("rank %d: stopping after step %d as requested; snapshot written", self.setup.rank, step)
            self.status = "stopped"
            return True
        if self.setup.total_steps is not None and step >= self.setup.total_steps:
            self.status = "completed"
            return True
        return False

    def snapshot(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any | None = None,
        *,
        extra: Mapping[str, Any] | None = None,
    ) -> Version:
        dataset = None
        if self.dataset is not None:
            dataset = self.dataset.advance(step - (self.restored.step if self.restored else 0))
        version = self.snapshotter.snapshot(
            step, self.setup.generation, model, optimizer, lr_scheduler=lr_scheduler, dataset=dataset, extra=extra
        )
        self._last_snapshot_step = step
        self.snapshots.append(version)
        return version

    def _log_start_up(self) -> None:
        """One line: each start-up milestone of this worker, in seconds after its first."""
        known = [(name, self.marks[name]) for name in p.WORKER_MARKS if name in self.marks]
        if known:
            first = min(t for _, t in known)
            log.info("rank %d start-up: %s", self.setup.rank,
                     ", ".join(f"{name} +{t - first:.3f}" for name, t in sorted(known, key=lambda kv: kv[1])))

    def _local_stop_at(self) -> int | None:
        candidates = [s for s in (self.setup.stop_at_step, self.heartbeat.stop_at_step if self.heartbeat else None) if s is not None]
        return min(candidates) if candidates else None

    # -- end ----------------------------------------------------------------------------

    def peer_failure(self, exc: BaseException) -> None:
        """Report a failed collective (a peer is likely gone) and mark this worker failed.

        The step reported is the one in progress (one past the last completed).
        """
        self.status = "failed"
        if self.control is not None:
            try:
                self.control.report_peer_failure(self.setup.generation, f"{type(exc).__name__}: {exc}", step=self.step + 1)
            except Exception as report_exc:  # the scheduler may be the one that is gone
                log.error("could not report the peer failure: %s", report_exc)

    def finish(self, detail: str | None = None) -> int:
        """Join the last snapshot, report the exit, stop heartbeats; returns the process exit code."""
        try:
            self.snapshotter.close()
        except Exception as exc:
            log.error("rank %d: the last snapshot failed: %s", self.setup.rank, exc)
            self.status, detail = "failed", f"snapshot failed: {exc}"
        marks: dict[str, float] = {}
        if self.heartbeat is not None:
            self.heartbeat.close()
            marks = self.heartbeat.take_marks()
        status = self.status if self.status != "running" else "completed"
        code = p.EXIT_FAILED if status == "failed" else p.EXIT_STOPPED
        if self.control is not None:
            try:
                self.control.report_exit(self.setup.generation, self.step, status, code, detail, marks,
                                         relay=self.heartbeat.relay if self.heartbeat is not None else None)
            except Exception as exc:
                log.error("could not report the exit: %s", exc)
        return code

    def _report_snapshot(self, result: SnapshotResult) -> None:
        assert self.control is not None
        try:
            self.control.report_snapshot(
                p.SnapshotReport(
                    generation=self.setup.generation,
                    step=result.version.step,
                    version=str(result.version),
                    host=result.host,
                    committed=result.committed,
                    bytes_written=result.bytes_written,
                    seconds=result.write_seconds,
                    consumed_samples=result.consumed_samples,
                ),
                relay=self.heartbeat.relay if self.heartbeat is not None else None,
            )
        except Exception as exc:
            log.warning("could not report snapshot %s: %s", result.version, exc)


def default_backend() -> str:
    """The process group's backend: gloo alone without CUDA; with CUDA, NCCL for CUDA tensors and gloo for
    CPU ones (a NCCL-only group refuses a CPU tensor, and the stop agreement is one)."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def rank_device(env: Mapping[str, str]) -> torch.device:
    """This rank's CUDA device: ``LOCAL_RANK`` among the visible devices when set (the launcher's and
    torchrun's convention), else the current device (a script that chose it itself)."""
    text = env.get(p.ENV_LOCAL_RANK, "")
    if not text:
        return torch.device("cuda", torch.cuda.current_device())
    if not text.strip().isdigit():
        raise InvalidConfig(f"{p.ENV_LOCAL_RANK} must be a non-negative integer, got {text!r}")
    index, count = int(text), torch.cuda.device_count()
    if index >= count:
        raise InvalidConfig(f"{p.ENV_LOCAL_RANK}={index}, but this process sees {count} CUDA device(s) "
                            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!s})")
    return torch.device("cuda", index)


LISTEN_POLL_S = 0.005


def wait_for_listener(host: str, port: int, timeout_s: float, poll_s: float = LISTEN_POLL_S) -> float:
    """Until something accepts TCP connections at ``host:port`` (a peer's rendezvous store); the seconds waited.

    Each probe connects and closes at once (the store drops a client that
    says nothing). A name that does not resolve yet (a pod not yet in DNS)
    counts as not listening. After ``timeout_s`` it returns anyway: the
    caller's own connect then fails with its own error.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=min(1.0, timeout_s)).close()
            break
        except OSError:
            if time.monotonic() >= deadline:
                log.warning("nothing listens at %s:%d after %.0f s", host, port, timeout_s)
                break
            time.sleep(poll_s)
    return time.monotonic() - started


def process_start_time() -> float | None:
    """When this process started (wall clock, from /proc: Linux), or None where that cannot be read."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
