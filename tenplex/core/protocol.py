"""The worker <-> scheduler REST protocol: the request and reply bodies, and the paths.

Both sides import these models: the scheduler serves exactly them (FastAPI
validates the bodies and documents them in its OpenAPI), and
:mod:`tenplex.worker.control` sends and parses them. Keeping them in one
module is what keeps the two sides from drifting apart, and keeping that
module on the ground floor (not in ``tenplex.scheduler``) is what lets the
worker library speak it without importing the control plane. It stands on
the ground floor's :class:`~tenplex.core.parallel.ParallelConfig` (an
assignment's parallel configuration is checked against its world size) and
imports nothing above ``tenplex.core``.

The life of a worker, as the protocol sees it::

    POST {REGISTER_PATH}                 RegisterRequest  -> Assignment
    POST {HEARTBEAT_PATH}   (every few s) HeartbeatRequest -> HeartbeatReply
    POST {SNAPSHOT_PATH}    (per version) SnapshotReport   -> Ack
    POST {PEER_FAILURE_PATH}(on timeout)  PeerFailureReport-> Ack
    POST {EXIT_PATH}        (at the end)  ExitReport       -> Ack

Heartbeats usually go through the worker's node daemon instead (liveness
scales with nodes, not workers): the worker posts a :class:`RelayedHeartbeat`
to ``{store_url}{RELAY_HEARTBEAT_PATH}`` and gets the same
:class:`HeartbeatReply`; the daemon sends the scheduler one
:class:`NodeHeartbeats` per job and node per interval at
:data:`NODE_HEARTBEATS_PATH` and answers each worker with its part of the
:class:`NodeHeartbeatsReply`. A daemon relays only for the scheduler it was
started for (``GET {RELAY_PATH}`` says which: :class:`RelayInfo`); a worker
whose daemon does not relay for its scheduler heartbeats the scheduler itself.
The same daemon hands the worker its generation's PTC (``GET
{store_url}{RELAY_PTC_PATH}``, fetched from the scheduler's ``ptc_url`` once
per node); a worker whose daemon does not, fetches ``ptc_url`` itself.

A stop request ("stop after step N") travels in the :class:`Assignment` and in
every :class:`HeartbeatReply`; the worker finishes step N, snapshots it,
reports the snapshot and exits with :data:`EXIT_STOPPED`. The ranks agree on
the stop step collectively (the earliest any rank heard of). A request that
reaches the workers only after they completed step N cannot be honoured
exactly: they stop after the step they are at, and the SnapshotReport and
ExitReport say which. The scheduler uses that to stop as soon as it can: it
asks for the newest reported step, so the ranks stop after the very step at
which the first of them hears of it (all ranks agree on it in the same
collective), and the stop version is whichever step that was.

Every path but none of the bodies carries the job name; all requests carry
``Authorization: Bearer <token>`` when the scheduler has a token. Errors come
back as ``{"error": code, "detail": message}`` with the HTTP status of the
matching :class:`tenplex.errors.TenplexError` subclass.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tenplex.core.parallel import ParallelConfig
from tenplex.core.version import Version
from tenplex.errors import InvalidConfig, InvalidInput

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change of the bodies below."""

# -- environment of a launched worker ---------------------------------------------
# The scheduler's backends start every worker with these variables (plus
# torchrun's), so that ``ControlClient.from_env()`` needs no arguments.

ENV_SCHEDULER_URL = "TENPLEX_SCHEDULER_URL"
"""Base URL of the scheduler's REST API, e.g. ``http://10.0.0.5:8470``."""
ENV_JOB = "TENPLEX_JOB"
"""The job name."""
ENV_WORKER_ID = "TENPLEX_WORKER_ID"
"""The scheduler's id for this worker process (unique within the job and generation)."""
ENV_TOKEN = "TENPLEX_TOKEN"
"""Bearer token for the scheduler and the store (absent: no auth)."""
ENV_STORE_URL = "TENPLEX_STORE_URL"
"""Base URL of the node-local store daemon of the host the worker runs on."""
ENV_STORE_ROOT = "TENPLEX_STORE_ROOT"
"""Optional: the node-local store's root directory as this worker sees it (a host path mounted into
the worker). When it exists, the worker snapshots and restores its own shards there directly, sharing
the root with the node's daemon (the store locks structural changes across processes): no HTTP upload,
about half the CPU of a snapshot (``benchmarks/snapshot_overhead.py``). Otherwise the daemon's URL is used."""
ENV_STORE_MEMORY_ROOT = "TENPLEX_STORE_MEMORY_ROOT"
"""Optional, with ``TENPLEX_STORE_ROOT``: the node store's memory tier (a node tmpfs directory) as this
worker sees it. The daemon records its tier (budget, directory) in the store root; a worker that has both
writes its snapshots into that memory (:mod:`tenplex.store.tiers`), where peers read them at once and the
daemon spills them to disk. Without the variable the recorded directory is used as it is."""
ENV_HOST = "TENPLEX_HOST"
"""The (emulated) host name the worker runs on, as named in the PTC."""
ENV_GENERATION = "TENPLEX_GENERATION"
"""The layout generation the worker was launched for."""
ENV_SNAPSHOT_EVERY = "TENPLEX_SNAPSHOT_EVERY"
"""The job's snapshot interval in steps: it bounds the steps a failure can lose."""
ENV_NODE_IP = "TENPLEX_NODE_IP"
"""A worker pod's node address (Kubernetes' downward API ``status.hostIP``): where its standby listens."""

# torchrun's variables, read as well.
ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"

# -- exit codes ----------------------------------------------------------------------

EXIT_COMPLETED = 0
"""The job reached its last step."""
EXIT_STOPPED = 0
"""The worker obeyed a stop request after snapshotting the requested step."""
EXIT_FAILED = 1
"""The worker failed (its ExitReport says why, when it could send one)."""

# -- paths ---------------------------------------------------------------------------

API_PREFIX = "/v1"
REGISTER_PATH = API_PREFIX + "/jobs/{job}/workers/register"
ASSIGNMENT_PATH = API_PREFIX + "/jobs/{job}/workers/{worker_id}/assignment"
HEARTBEAT_PATH = API_PREFIX + "/jobs/{job}/workers/{worker_id}/heartbeat"
SNAPSHOT_PATH = API_PREFIX + "/jobs/{job}/workers/{worker_id}/snapshot"
PEER_FAILURE_PATH = API_PREFIX + "/jobs/{job}/workers/{worker_id}/peer-failure"
EXIT_PATH = API_PREFIX + "/jobs/{job}/workers/{worker_id}/exit"
NODE_HEARTBEATS_PATH = API_PREFIX + "/jobs/{job}/nodes/{node}/heartbeats"
"""The scheduler's route for one node daemon's batch of its workers' heartbeats."""
NODE_REPORTS_PATH = API_PREFIX + "/jobs/{job}/nodes/{node}/reports"
"""The scheduler's route for one node daemon's batch of its workers' snapshot and exit reports (:class:`NodeReports`)."""
RELAY_PATH = API_PREFIX + "/relay"
"""The node daemon's description of its relay (:class:`RelayInfo`)."""
RELAY_HEARTBEAT_PATH = API_PREFIX + "/relay/jobs/{job}/workers/{worker_id}/heartbeat"
"""The node daemon's route for a worker's heartbeat, relayed to the scheduler in the node's next batch."""
RELAY_REPORT_PATH = API_PREFIX + "/relay/jobs/{job}/workers/{worker_id}/report"
"""The node daemon's route for a worker's snapshot or exit report (:class:`RelayedReport`), relayed to the scheduler
in a batch of the node's reports that came in within a short window."""
RELAY_PTC_PATH = API_PREFIX + "/relay/jobs/{job}/ptc"
"""The node daemon's route for a generation's PTC (``?generation=N&scheduler_url=URL``), fetched from the scheduler
once per job, generation and credential and served to the node's workers (gzipped for those that accept it)."""

# -- field types -----------------------------------------------------------------------

JOB_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
"""A DNS-1123 label: jobs become Kubernetes objects and label values."""
WORKER_ID_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,126}[A-Za-z0-9])?$"

JobName = Annotated[str, Field(pattern=JOB_NAME_PATTERN, description="Job name (DNS-1123 label).")]
WorkerId = Annotated[
    str, Field(pattern=WORKER_ID_PATTERN, description="Worker id given by the scheduler at launch.")
]
Step = Annotated[int, Field(ge=0, description="A training step (the number of steps completed).")]
Generation = Annotated[int, Field(ge=0, description="Layout generation, bumped by every reconfiguration.")]
Rank = Annotated[int, Field(ge=0)]
HostName = Annotated[str, Field(min_length=1, max_length=253, description="Host (node) name as in the PTC.")]


class _Model(BaseModel):
    """Strict about unknown fields, so a typo on either side is a 4xx and not silently dropped."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_version(value: str | None) -> str | None:
    """Pydantic reports only ValueError as a validation error; turn InvalidInput into one."""
    if value is not None:
        try:
            Version.parse(value)
        except InvalidInput as exc:
            raise ValueError(exc.detail) from None
    return value


# -- bodies ----------------------------------------------------------------------------


class RegisterRequest(_Model):
    """A worker process announcing itself; the reply is its :class:`Assignment`."""

    worker_id: WorkerId
    host: HostName | None = Field(None, description="The host the worker runs on, when it knows it.")
    pid: int | None = Field(None, ge=1, description="Process id, for people reading the job status.")
    rank: Rank | None = Field(None, description="torchrun's RANK when the launcher set one.")
    protocol_version: int = Field(PROTOCOL_VERSION, ge=1)


class Assignment(_Model):
    """Everything a worker needs to join the job in its current configuration."""

    job: JobName
    generation: Generation
    worker_id: WorkerId
    rank: Rank = Field(description="Global rank in the Megatron order of `parallel`.")
    world_size: int = Field(ge=1)
    local_rank: Rank = Field(description="Index of the worker's device on its host.")
    host: HostName
    parallel: dict[str, Any] = Field(
        description="The parallel configuration, as tenplex.ptc.ParallelConfig JSON (dp, tp, pp, zero, ...)."
    )
    master_addr: str = Field(min_length=1, description="Rendezvous address of torch.distributed.")
    master_port: int = Field(ge=1, le=65535)
    restore_version: str | None = Field(
        None, description="Version (s<step>-g<generation>) to restore before training; null: start fresh."
    )
    store_url: str = Field(min_length=1, description="Base URL of the node-local store daemon.")
    ptc: dict[str, Any] | None = Field(None, description="The job's PTC for this generation (tenplex.ptc/v1 JSON).")
    ptc_url: str | None = Field(None, description="Where to GET the PTC JSON instead, when it is large.")
    stop_at_step: Step | None = Field(None, description="Finish this step, snapshot it and exit.")
    total_steps: Step | None = Field(None, description="The step at which the job is complete, when bounded.")
    heartbeat_interval_s: float = Field(5.0, gt=0, le=3600)

    @field_validator("restore_version")
    @classmethod
    def _restore_version(cls, v: str | None) -> str | None:
        return _check_version(v)

    @model_validator(mode="after")
    def _consistent(self) -> Assignment:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if self.ptc is None and self.ptc_url is None:
            raise ValueError("an assignment needs the PTC: set ptc or ptc_url")
        try:
            parallel = ParallelConfig.from_json(self.parallel)
        except InvalidConfig as exc:
            raise ValueError(exc.detail) from None
        if parallel.world_size != self.world_size:
            raise ValueError(
                f"parallel config {parallel.describe()} has world size {parallel.world_size}, "
                f"the assignment says {self.world_size}"
            )
        return self


WORKER_MARKS = ("process_started", "registered", "process_group", "restore_started", "restored", "first_step",
                "stop_agreed", "snapshot_written")
"""A worker's milestones, as wall-clock times, from which a reconfiguration's downtime is split into phases:
the process started (interpreter), it registered (imports done), its process group is up (rendezvous), it
began and finished restoring, it finished its first step; and when stopping, the stop was agreed (training
stood still from here) and its last snapshot was written."""


def _check_marks(v: dict[str, float] | None) -> dict[str, float] | None:
    if v is None:
        return None
    unknown = sorted(set(v) - set(WORKER_MARKS))
    if unknown:
        raise ValueError(f"unknown marks {unknown}; known: {list(WORKER_MARKS)}")
    bad = {k: t for k, t in v.items() if not (math.isfinite(t) and t > 0)}
    if bad:
        raise ValueError(f"marks must be positive wall-clock times, got {bad}")
    return v


class HeartbeatRequest(_Model):
    """Proof of life with the last completed step; sent every ``heartbeat_interval_s``."""

    generation: Generation
    step: Step
    loss: float | None = Field(None, description="Loss of the last step, when this rank computes it.")
    marks: dict[str, float] | None = Field(
        None, description="Milestones reached since the last heartbeat (WORKER_MARKS -> wall-clock time).")

    @field_validator("marks")
    @classmethod
    def _marks_known(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return _check_marks(v)

    @field_validator("loss")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        # A NaN loss is legitimate training news, but JSON cannot carry it; send null then.
        if v is not None and not math.isfinite(v):
            raise ValueError(f"loss must be finite (send null for NaN/inf), got {v}")
        return v


class HeartbeatReply(_Model):
    """What the scheduler wants next. ``action="stop"`` means: exit now without a snapshot."""

    action: Literal["continue", "stop"] = "continue"
    generation: Generation
    stop_at_step: Step | None = Field(None, description="Finish this step, snapshot it and exit.")


class RelayedHeartbeat(HeartbeatRequest):
    """A heartbeat sent to the node daemon, with the scheduler it is meant for (the daemon relays only to its own)
    and the worker's host (the node its batch is reported for)."""

    scheduler_url: str = Field(min_length=1, max_length=2048)
    host: HostName


class RelayInfo(_Model):
    """What a node daemon relays: heartbeats to ``scheduler_url`` (None: it relays nothing)."""

    scheduler_url: str | None = None
    interval_s: float = Field(gt=0, description="How often the daemon sends its node's batch.")


MAX_NODE_HEARTBEATS = 4096
"""The most heartbeats one node's batch may carry (a node has a handful of workers per job)."""

_Age = Annotated[float, Field(ge=0, le=86400)]
_Loss = Annotated[float | None, Field(allow_inf_nan=False)]


class NodeHeartbeats(_Model):
    """A node daemon's batch: the heartbeats its workers of one job sent since its last batch, once each.

    Column by column (the i-th entry of each list is the i-th worker's), so that the scheduler parses a node's
    report as a few lists of numbers: it handles one of these per node every second. ``ages`` is how long ago
    the daemon received each heartbeat; the scheduler dates the beat back by that, so a relayed beat counts
    from when the worker sent it, on the scheduler's clock.
    """

    workers: list[WorkerId] = Field(min_length=1, max_length=MAX_NODE_HEARTBEATS)
    generations: list[Generation]
    steps: list[Step]
    ages: list[_Age] = Field(description="Seconds since the daemon received each heartbeat.")
    losses: list[_Loss] | None = Field(None, description="Each worker's loss of its last step (null: none).")
    marks: dict[WorkerId, dict[str, float]] | None = Field(
        None, description="Milestones reached since the last heartbeat, of the workers that have any.")

    @model_validator(mode="after")
    def _consistent(self) -> NodeHeartbeats:
        n = len(self.workers)
        lengths = {"generations": len(self.generations), "steps": len(self.steps), "ages": len(self.ages)}
        if self.losses is not None:
            lengths["losses"] = len(self.losses)
        wrong = {k: v for k, v in lengths.items() if v != n}
        if wrong:
            raise ValueError(f"every column needs one entry per worker ({n}): {wrong}")
        if len(set(self.workers)) != n:
            raise ValueError("a worker appears more than once in the batch")
        if self.marks:
            strangers = sorted(set(self.marks) - set(self.workers))
            if strangers:
                raise ValueError(f"marks of workers not in the batch: {strangers[:4]}")
            for m in self.marks.values():
                _check_marks(m)
        return self


class ErrorBody(_Model):
    """An error as every Tenplex service answers it (``{"error": code, "detail": message}``)."""

    error: str = Field(min_length=1, max_length=64)
    detail: str = Field(max_length=4000)


class NodeHeartbeatsReply(_Model):
    """The answer to each worker of a batch: its error when it has one in ``errors`` (what its own heartbeat
    would have got: an unknown worker, another generation, another node), else ``reply`` (the job's answer to
    each of its workers: the same for all of them, so sent once)."""

    reply: HeartbeatReply | None = Field(None, description="The answer of every worker without an error.")
    errors: dict[WorkerId, ErrorBody] = Field(default_factory=dict)


class SnapshotReport(_Model):
    """A worker finished writing its part of a version (and maybe committed its host's copy)."""

    generation: Generation
    step: Step
    version: str = Field(description="The version written, s<step>-g<generation>.")
    host: HostName
    committed: bool = Field(description="Whether this worker saw its host's copy complete and committed it.")
    bytes_written: int = Field(0, ge=0)
    seconds: float = Field(0.0, ge=0, description="Wall time of the background write.")
    consumed_samples: int | None = Field(
        None, ge=0, description="The dataset position of the version: the next generation's PTC dataset state."
    )

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        return _check_version(v)  # type: ignore[return-value]

    @model_validator(mode="after")
    def _step_matches(self) -> SnapshotReport:
        if Version.parse(self.version).step != self.step:
            raise ValueError(f"version {self.version} is not of step {self.step}")
        return self


class PeerFailureReport(_Model):
    """A collective failed or timed out: some other worker is probably gone."""

    generation: Generation
    step: Step | None = Field(None, description="The step during which it happened.")
    detail: str = Field(min_length=1, max_length=4000, description="The error as the worker saw it.")


class ExitReport(_Model):
    """The worker is about to exit."""

    generation: Generation
    step: Step = Field(description="The last completed step.")
    status: Literal["completed", "stopped", "failed"]
    exit_code: int = Field(ge=0, le=255)
    detail: str | None = Field(None, max_length=4000)
    marks: dict[str, float] | None = Field(
        None, description="Milestones not yet reported (WORKER_MARKS -> wall-clock time), e.g. when the stop was agreed.")

    @field_validator("marks")
    @classmethod
    def _marks_known(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return _check_marks(v)


class NodeReport(_Model):
    """One worker's snapshot or exit report (exactly one of them) in a node's batch or sent to its node daemon."""

    worker_id: WorkerId
    snapshot: SnapshotReport | None = None
    exit: ExitReport | None = None

    @model_validator(mode="after")
    def _one(self) -> NodeReport:
        if (self.snapshot is None) == (self.exit is None):
            raise ValueError("a report carries a snapshot or an exit report, exactly one")
        return self


class RelayedReport(NodeReport):
    """A worker's report sent to its node daemon, with the scheduler it is meant for (the daemon relays only to
    its own) and the worker's host (the node its batch is reported for)."""

    scheduler_url: str = Field(min_length=1, max_length=2048)
    host: HostName


class NodeReports(_Model):
    """A node daemon's batch of its workers' snapshot and exit reports of one job, in the order they came in: at a
    planned change every worker sends both within a second, so the scheduler handles a few requests per node
    instead of two per worker."""

    reports: list[NodeReport] = Field(min_length=1, max_length=MAX_NODE_HEARTBEATS)


class NodeReportsReply(_Model):
    """The answer to each report of a batch: its error (what the report sent directly would have got) under its
    index in the batch, an :class:`Ack` for each of the others."""

    errors: dict[int, ErrorBody] = Field(default_factory=dict)


class Ack(_Model):
    """The reply to reports."""

    ok: bool = True
