"""Job records and their crash-safe persistence.

A job is its immutable :class:`JobSpec` (what the user asked for) plus its
mutable :class:`JobStatus` (where the state machine stands). A
:class:`JobStore` keeps both, written at every transition, together with the
PTC of every generation still referenced, so a scheduler killed at any point
restarts into the same phase and stage and resumes from there. Two
implementations: :class:`StateDir` (a directory; each write atomic: temp
file, fsync, rename) and, on Kubernetes, ``tenplex.k8s.jobstore.KubeJobStore``
(the ElasticJob's status and ConfigMaps it owns).
"""

from __future__ import annotations

import base64
import json
import math
import re
import shutil
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from tenplex.core.files import atomic_write
from tenplex.core.protocol import JOB_NAME_PATTERN
from tenplex.core.version import Version
from tenplex.errors import InvalidConfig, NotFound, TenplexError
from tenplex.ptc import PTC, DatasetState, ParallelConfig
from tenplex.scheduler.layouts import LayoutSpec
from tenplex.scheduler.policy import Policy

_NAME = re.compile(JOB_NAME_PATTERN)

class Phase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    RECONFIGURING = "Reconfiguring"
    SUSPENDED = "Suspended"
    """Scaled to 0 GPUs: no workers; the state stays on the node stores until a scale up resumes from it."""
    FAILED = "Failed"
    SUCCEEDED = "Succeeded"


class Stage(StrEnum):
    """The steps of a reconfiguration, in order."""

    STOPPING = "stopping"
    SNAPSHOT = "snapshot"
    PLANNING = "planning"
    TRANSFERRING = "transferring"
    RESTARTING = "restarting"


def check_job_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidConfig(
            f"job name {name!r} must be a DNS-1123 label: 1-63 lowercase letters, digits or '-', starting and ending with a letter or digit"
        )
    return name


CHECKPOINT_URI_SCHEMES = ("s3", "file")


@dataclass(frozen=True)
class CheckpointSpec:
    """Where and how often a job's state is copied beyond its nodes."""

    uri: str
    """``s3://bucket/prefix`` (any S3-compatible store; endpoint and credentials are the daemons') or
    ``file:///path`` (a shared filesystem or volume mounted on every node)."""
    interval_steps: int
    keep_last: int = 2

    def __post_init__(self) -> None:
        check_persistent_uri(self.uri, "checkpoint")
        for name in ("interval_steps", "keep_last"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidConfig(f"checkpoint {name} must be an integer >= 1, got {v!r}")

    def to_json(self) -> dict[str, Any]:
        return {"uri": self.uri, "interval_steps": self.interval_steps, "keep_last": self.keep_last}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any] | None) -> CheckpointSpec | None:
        return None if obj is None else cls(**_fields_of(cls, obj, "checkpoint", ("uri", "interval_steps")))


def _fields_of(cls: Any, obj: Any, what: str, required: Sequence[str]) -> Mapping[str, Any]:
    """``obj`` checked as the JSON of dataclass ``cls``: an object with ``required`` and no unknown fields."""
    if not isinstance(obj, Mapping):
        raise InvalidConfig(f"{what} must be an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - {f.name for f in fields(cls)})
    if unknown:
        raise InvalidConfig(f"unknown {what} fields: {', '.join(unknown)}")
    if any(k not in obj for k in required):
        raise InvalidConfig(f"{what} needs {' and '.join(required)}")
    return obj


def check_persistent_uri(uri: Any, what: str) -> str:
    """A persistent location: ``s3://bucket/prefix`` or ``file:///path``, with nothing secret in it."""
    if not isinstance(uri, str):
        raise InvalidConfig(f"{what} uri must be a string, got {type(uri).__name__}")
    parts = urlsplit(uri)
    if parts.scheme not in CHECKPOINT_URI_SCHEMES or not (parts.netloc or parts.path.strip("/")):
        raise InvalidConfig(f"{what} uri must look like s3://bucket/prefix or file:///path, got {uri!r}")
    if parts.scheme == "s3" and not parts.netloc:
        raise InvalidConfig(f"{what} uri {uri!r} names no bucket")
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise InvalidConfig(f"{what} uri {uri!r}: no credentials, query or fragment in it (the store "
                            "daemons hold the credentials)")
    return uri


LATEST = "latest"
"""``resume_from.version``: the newest committed persistent version."""


@dataclass(frozen=True)
class ResumeSpec:
    """Start a new job from a persistent version (a resume after a cluster outage, or a copy of a job) instead
    of step 0: its state, step and dataset position are the version's; its layout is planned anew."""

    uri: str
    """The persistent location the version was saved to (a job's ``checkpoint.uri``)."""
    job: str | None = None
    """The job the version was saved under; None: the new job's own name."""
    version: str = LATEST
    """A version (``s40-g0``) or ``latest``: the newest committed one there."""

    def __post_init__(self) -> None:
        check_persistent_uri(self.uri, "resume_from")
        if self.job is not None:
            try:
                check_job_name(self.job)
            except InvalidConfig as exc:
                raise InvalidConfig(f"resume_from job: {exc.detail}") from None
        if not isinstance(self.version, str):
            raise InvalidConfig(f"resume_from version must be a string, got {type(self.version).__name__}")
        if self.version != LATEST:
            try:
                Version.parse(self.version)
            except TenplexError as exc:
                raise InvalidConfig(f"resume_from version must be 'latest' or a version: {exc.detail}") from None

    def source_job(self, own: str) -> str:
        return self.job if self.job is not None else own

    def to_json(self) -> dict[str, Any]:
        return {"uri": self.uri, "job": self.job, "version": self.version}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any] | None) -> ResumeSpec | None:
        if obj is None:
            return None
        return cls(**{**_fields_of(cls, obj, "resume_from", ("uri",)), "version": obj.get("version") or LATEST})


@dataclass(frozen=True)
class JobSpec:
    """What the user asked for. A live job's spec may be replaced by a changed one (``kubectl apply``, the REST
    API's ``PUT``) within the bounds of :data:`~tenplex.scheduler.jobspec.IMMUTABLE`; it is kept in the job's
    record, so a restarted scheduler goes on with the newest."""

    name: str
    layout: LayoutSpec
    dataset: DatasetState
    command: tuple[str, ...]
    gpus: int
    min_gpus: int = 1
    max_gpus: int = 1 << 20
    policy: Policy = field(default_factory=Policy)
    steps: int = 100
    snapshot_every: int = 10
    heartbeat_timeout: float = 60.0
    max_restarts: int = 3
    """Failure recoveries allowed in a row without a newer snapshot: the next failure fails the job (a crash loop ends)."""
    gpus_per_pod: int = 1
    """Ranks start in groups of this many on one host (a Kubernetes worker pod's GPUs): the job's GPU counts and
    the ranks placed on each host are multiples of it."""
    image: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    checkpoint: CheckpointSpec | None = None
    """Persistent checkpoints: the fall-back when no replica of some region survives (:mod:`tenplex.scheduler.persist`)."""
    resume_from: ResumeSpec | None = None
    """Start from a persistent version instead of step 0 (see :class:`ResumeSpec`)."""
    standby: bool = False
    """Keep a warm standby on every usable host (:mod:`tenplex.standby`): one process with the job's code
    imported that forks a reconfiguration's new workers, so they start without the interpreter's and the
    imports' seconds. It holds a few hundred MB of host memory with torch, no GPU."""
    pod: Mapping[str, Any] = field(default_factory=dict)
    """Kubernetes only: what else the ElasticJob puts into its worker pods (``imagePullPolicy``, ``resources``,
    ``tolerations``, ``env`` entries ``valueFrom`` a source), as it gives them. The backend makes the pods from
    the ElasticJob itself; the record keeps them so that a changed spec is seen and redeployed."""

    def __post_init__(self) -> None:
        check_job_name(self.name)
        if isinstance(self.gpus_per_pod, bool) or not isinstance(self.gpus_per_pod, int) or self.gpus_per_pod < 1:
            raise InvalidConfig(f"gpus_per_pod must be an integer >= 1, got {self.gpus_per_pod!r}")
        if not 1 <= self.min_gpus <= self.max_gpus:
            raise InvalidConfig(f"need 1 <= min_gpus <= max_gpus, got min {self.min_gpus}, max {self.max_gpus}")
        self.check_gpus(self.gpus)
        if self.steps < 1:
            raise InvalidConfig(f"steps must be >= 1, got {self.steps}")
        if self.snapshot_every < 1:
            raise InvalidConfig(f"snapshot_every must be >= 1, got {self.snapshot_every}")
        if self.heartbeat_timeout <= 0:
            raise InvalidConfig(f"heartbeat_timeout must be positive, got {self.heartbeat_timeout}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise InvalidConfig(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if not self.command and not self.image:
            raise InvalidConfig("a job needs a worker command (local backend) or an image (kubernetes backend)")
        if not isinstance(self.standby, bool):
            raise InvalidConfig(f"standby must be true or false, got {self.standby!r}")
        for gpus, cfg in sorted(self.policy.table.items()):
            try:
                self.layout.check_parallel(cfg)
            except InvalidConfig as exc:
                raise InvalidConfig(f"the policy table's entry for {gpus} GPUs cannot run: {exc.detail}") from None

    def check_gpus(self, gpus: int) -> None:
        if isinstance(gpus, bool) or not isinstance(gpus, int) or not self.min_gpus <= gpus <= self.max_gpus:
            raise InvalidConfig(f"gpus must be an integer in [{self.min_gpus}, {self.max_gpus}] for job {self.name!r}, got {gpus!r}")
        if gpus % self.gpus_per_pod:
            raise InvalidConfig(f"gpus must be a multiple of gpus_per_pod {self.gpus_per_pod} for job {self.name!r}, "
                                f"got {gpus}")

    def to_json(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "layout": self.layout.to_json(), "dataset": self.dataset.to_json(), "command": list(self.command),
                "policy": policy_to_json(self.policy), "env": dict(self.env), "pod": dict(self.pod),
                "checkpoint": self.checkpoint.to_json() if self.checkpoint is not None else None,
                "resume_from": self.resume_from.to_json() if self.resume_from is not None else None}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> JobSpec:
        """The spec of :meth:`to_json`; a field it lacks takes its default."""
        plain = {f.name: obj[f.name] for f in fields(cls) if f.name in obj and f.name not in _CONVERTED}
        return cls(**plain, layout=LayoutSpec.from_json(obj["layout"]), dataset=DatasetState.from_json(obj["dataset"]),
                   command=tuple(obj.get("command", ())), policy=policy_from_json(obj.get("policy", {})),
                   env=dict(obj.get("env", {})), standby=bool(obj.get("standby", False)),
                   pod=dict(obj.get("pod") or {}), checkpoint=CheckpointSpec.from_json(obj.get("checkpoint")),
                   resume_from=ResumeSpec.from_json(obj.get("resume_from")))


_CONVERTED = ("layout", "dataset", "command", "policy", "env", "standby", "pod", "checkpoint", "resume_from")
"""The JobSpec fields whose JSON is not their value (read by :meth:`JobSpec.from_json` one by one)."""


def policy_to_json(p: Policy) -> dict[str, Any]:
    return {
        "table": {str(k): v.to_json() for k, v in p.table.items()},
        "gpu_memory_bytes": p.gpu_memory_bytes,
        "state_memory_fraction": p.state_memory_fraction,
        "zero": p.zero,
    }


def policy_from_json(obj: Mapping[str, Any]) -> Policy:
    if not isinstance(obj, Mapping):
        raise InvalidConfig(f"policy must be an object, got {type(obj).__name__}")
    unknown = set(obj) - {"table", "gpu_memory_bytes", "state_memory_fraction", "zero"}
    if unknown:
        raise InvalidConfig(f"unknown policy keys: {', '.join(sorted(unknown))}")
    table = {}
    for k, v in dict(obj.get("table") or {}).items():
        try:
            gpus = int(k)
        except (TypeError, ValueError):
            raise InvalidConfig(f"policy table keys must be GPU counts, got {k!r}") from None
        table[gpus] = ParallelConfig.from_json(v)
    return Policy(
        table=table,
        gpu_memory_bytes=obj.get("gpu_memory_bytes"),
        state_memory_fraction=obj.get("state_memory_fraction", 0.5),
        zero=obj.get("zero", 0),
    )


@dataclass
class WorkerRecord:
    """One training process of the current generation."""

    worker_id: str
    rank: int
    host: str
    local_rank: int
    generation: int
    pid: int | None = None
    registered: bool = False
    last_heartbeat: float | None = None
    step: int | None = None
    exit_code: int | None = None


@dataclass
class Reconfiguration:
    """One entry of a job's history: an event and what it cost."""

    reason: str
    started_at: float
    from_config: str | None
    to_config: str | None = None
    from_gpus: int = 0
    to_gpus: int = 0
    from_hosts: list[str] = field(default_factory=list)
    to_hosts: list[str] = field(default_factory=list)
    version_from: str | None = None
    version_to: str | None = None
    finished_at: float | None = None
    downtime_seconds: float | None = None
    bytes_local: int = 0
    bytes_remote: int = 0
    bytes_zero: int = 0
    lower_bound_bytes: int = 0
    steps_lost: int = 0
    error: str | None = None
    source: str | None = None
    """Where ``version_from`` was read from when not the job's node stores: a resume's persistent location."""
    to_generation: int | None = None
    """The generation whose workers this change launched (their start-up milestones land here)."""
    marks: dict[str, float] = field(default_factory=dict)
    """Wall-clock times of the change's milestones (see :data:`MARKS`): the scheduler's own and the slowest
    worker's (:data:`~tenplex.core.protocol.WORKER_MARKS`)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds of each phase of the downtime (see :func:`phase_split`), known so far."""

    def to_json(self) -> dict[str, Any]:
        """JSON-ready, in fresh containers."""
        return {**vars(self), "from_hosts": list(self.from_hosts), "to_hosts": list(self.to_hosts),
                "marks": dict(self.marks), "phases": dict(self.phases)}


MARKS = ("requested", "stop_agreed", "stopped", "committed", "planned", "launch_started", "launched",
         "transfer_started", "transferred",
         "registered", "process_group", "restore_started", "restored", "first_step")
"""A reconfiguration's milestones in the order they usually happen (with overlap, new workers start while
the state is still moving: ``transferred`` may come after ``restore_started``)."""

PHASES = ("stop_agreement", "final_snapshot", "planning", "transfer", "launch", "imports", "rendezvous",
          "model_build", "wait_for_state", "restore", "first_step")
"""The phases of a reconfiguration's downtime, between consecutive milestones."""

DATA_PHASES = ("final_snapshot", "transfer", "restore")
"""The phases whose length grows with the state's size (writing it, moving it, loading it); the others are
the fixed cost of a reconfiguration."""



def phase_split(marks: Mapping[str, float]) -> dict[str, float]:
    """Seconds per phase from the milestones known so far (a phase whose ends are not both known is left out):

    - ``stop_agreement``: the request until the workers agreed on the step to stop after (planned changes);
    - ``final_snapshot``: until that step was committed on every host;
    - ``planning``: new configuration, placement, PTC and plan;
    - ``transfer``: the node daemons building the new version;
    - ``launch``: starting the new worker processes;
    - ``imports``: interpreter, imports and registration (the slowest worker);
    - ``rendezvous``: the process group;
    - ``model_build``: building the parallelized model;
    - ``wait_for_state``: workers ready before the new version was committed (the start-up overlapped it);
    - ``restore``: loading the version into the live tensors;
    - ``first_step``: until the first training step in the new layout finished.
    """
    m = marks

    def span(a: str | None, b: str) -> float | None:
        if a is None or a not in m or b not in m:
            return None
        return round(max(0.0, m[b] - m[a]), 3)

    restore_from = None
    if "restore_started" in m:
        restore_from = "restore_started" if "transferred" not in m or m["transferred"] <= m["restore_started"] \
            else "transferred"
    out = {
        "stop_agreement": span("requested", "stop_agreed"),
        "final_snapshot": span("stop_agreed" if "stop_agreed" in m else None, "committed"),
        "planning": span("committed" if "committed" in m else "requested", "planned"),
        "transfer": span("transfer_started" if "transfer_started" in m else "planned", "transferred"),
        "launch": span("launch_started", "launched"),
        "imports": span("launched", "registered"),
        "rendezvous": span("registered", "process_group"),
        "model_build": span("process_group", "restore_started"),
        "wait_for_state": span("restore_started", "transferred") if restore_from == "transferred" else None,
        "restore": span(restore_from, "restored"),
        "first_step": span("restored" if "restored" in m else "process_group", "first_step"),
    }
    return {k: v for k, v in out.items() if v is not None}


def _map_hosts(record: Mapping[str, Any], convert: Callable[[Any], Any]) -> dict[str, Any]:
    """A copy of a status record with its host lists (``hosts``, ``committed``'s, the history's, the plan
    inputs' ``hosts``, ``inputs.alive`` and ``inputs.not_holding``) passed through ``convert``: packed into runs
    for the record (a 2,048-host job names its hosts in six lists: 140 KiB as JSON), or unpacked from it."""
    out = {**record, "hosts": convert(record.get("hosts", [])),
           "committed": {v: convert(hosts) for v, hosts in record.get("committed", {}).items()},
           "history": [{**h, "from_hosts": convert(h.get("from_hosts", [])), "to_hosts": convert(h.get("to_hosts", []))}
                       for h in record.get("history", [])]}
    if isinstance(out.get("last_plan"), Mapping):
        plan = out["last_plan"] = dict(out["last_plan"])
        if "hosts" in plan:
            plan["hosts"] = convert(plan["hosts"])
        if isinstance(plan.get("inputs"), Mapping):
            inputs = plan["inputs"] = dict(plan["inputs"])
            for key in ("alive", "not_holding"):
                if key in inputs:
                    inputs[key] = convert(inputs[key])
    return out


@dataclass
class JobStatus:
    """Where the job stands. Mutated only by its controller, persisted at every change."""

    phase: Phase = Phase.PENDING
    stage: Stage | None = None
    generation: int = 0
    gpus: int = 0
    parallel: dict[str, Any] | None = None
    hosts: list[str] = field(default_factory=list)
    gpus_per_node: int = 1
    step: int = 0
    """Last step any worker reported as completed."""
    version: str | None = None
    """Newest fully committed version (the restart point after a failure)."""
    committed: dict[str, list[str]] = field(default_factory=dict)
    """Version -> hosts whose store committed it."""
    version_generation: dict[str, int] = field(default_factory=dict)
    requested_gpus: int | None = None
    """The newest scale request not yet acted on."""
    requested_parallel: dict[str, Any] | None = None
    """The configuration the newest scale request asks for (None: the policy chooses)."""
    pending_reason: str | None = None
    """Why a planned reconfiguration is wanted (scale, redeploy), until one begins."""
    target_gpus: int | None = None
    """The GPU count the reconfiguration in progress aims for."""
    target_parallel: dict[str, Any] | None = None
    """The configuration the reconfiguration in progress aims for, when a request named one."""
    master_addr: str | None = None
    master_port: int | None = None
    downtime_started_at: float | None = None
    """When the workers stopped training (wall clock), until the new ones train again."""
    restored_step: int | None = None
    stop_at_step: int | None = None
    restore_version: str | None = None
    failures_without_progress: int = 0
    """Failures since the last newly committed version (compared with the spec's ``max_restarts``)."""
    workers: list[WorkerRecord] = field(default_factory=list)
    history: list[Reconfiguration] = field(default_factory=list)
    message: str = ""
    persisted: list[str] = field(default_factory=list)
    """Versions committed in the job's persistent location (its checkpoint), oldest first."""
    resumed_from: dict[str, Any] | None = None
    """The persistent version the job started from (its spec's ``resume_from``, resolved): uri, job, version,
    step and consumed_samples (the dataset position there); None for a job started at step 0."""
    persist: dict[str, Any] | None = None
    """The latest copy to the persistent location: version, state (uploading, retrying, committed, abandoned),
    attempts, error, bytes uploaded, times (``started_at``/``finished_at``) and the job's steps then
    (``started_step``/``finished_step``); ``queued``: the due version waiting for it; ``skipped``: due versions
    not persisted, each with the reason (:class:`~tenplex.scheduler.persist.Housekeeper`)."""
    spec_update: dict[str, Any] | None = None
    """The last change of the live job's spec: ``fields`` (JobSpec names: those that need a redeploy, then
    those applied in place), ``redeploy`` (whether the workers must be started again for it), ``pending``
    (True until a generation is launched with the new spec), ``requested_at`` and, once launched,
    ``generation`` (the first generation that runs it). Changes made before the redeploy began add up."""
    standby_ready: int = 0
    """Warm standbys (the spec's ``standby``) whose imports are done, ready for the next change."""
    standby_wanted: int = 0
    last_plan: dict[str, Any] | None = None
    updated_at: float = field(default_factory=time.time)

    @property
    def redeploy_pending(self) -> bool:
        """Whether the workers run an older spec than the job's (a changed spec awaits its redeploy)."""
        return bool(self.spec_update and self.spec_update.get("pending"))

    @property
    def parallel_config(self) -> ParallelConfig | None:
        return ParallelConfig.from_json(self.parallel) if self.parallel else None

    def to_record(self) -> dict[str, Any]:
        """The status as a job store keeps it: :meth:`to_json` with the workers as one compact table
        (:func:`workers_table`; a job of 16,384 workers is 3 MiB of worker objects as JSON). Read back by
        :meth:`from_json`."""
        return {**_map_hosts(self.to_json(), pack_names), "workers": workers_table(self.workers)}

    def to_json(self, *, plan: bool = True) -> dict[str, Any]:
        """The status as JSON-ready data, in fresh containers (a view can be serialized after the lock is let
        go), except ``last_plan``: the controller replaces it, never changes it, so it is shared (``plan=False``
        leaves it out: it is large, and views serve it apart). Not ``asdict``: that deep-copies the plan, and a
        job of a thousand workers is read many times a second."""
        out = {name: _fresh(getattr(self, name)) for name in _COPIED}
        out.update(phase=self.phase.value, stage=self.stage.value if self.stage else None,
                   committed={v: list(hosts) for v, hosts in self.committed.items()},
                   workers=[dict(vars(w)) for w in self.workers], history=[h.to_json() for h in self.history],
                   spec_update=_copy_update(self.spec_update))
        if plan:
            out["last_plan"] = self.last_plan
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> JobStatus:
        data = _map_hosts(obj, unpack_names)
        data["phase"] = Phase(data["phase"])
        data["stage"] = Stage(data["stage"]) if data.get("stage") else None
        workers = data.get("workers", [])
        data["workers"] = (workers_from_table(workers) if isinstance(workers, Mapping)
                           else [WorkerRecord(**w) for w in workers])
        data["history"] = [Reconfiguration(**h) for h in data["history"]]
        return cls(**data)


_COPIED = tuple(f.name for f in fields(JobStatus) if f.name != "last_plan")
"""The fields :meth:`JobStatus.to_json` copies (the plan is shared)."""


def _copy_update(update: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if update is None else {**update, "fields": list(update.get("fields", ()))}


def _fresh(value: Any) -> Any:
    """A shallow copy of a dict or a list; anything else as it is."""
    return dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else value


_NUMBERED = re.compile(r"^(.*?)(0|[1-9][0-9]*)$")


def pack_names(names: Sequence[str]) -> list[str] | dict[str, str]:
    """A list of host names, in order, as runs: ``{"runs": "node-0..95,node-128,node-97..127"}`` (``..``
    joins names that differ only in a number counting up by one; DNS names hold no ``,`` and no ``..``).
    Short lists stay lists."""
    if len(names) < 16:
        return list(names)
    runs: list[list[Any]] = []  # [prefix, first, last] or [name]
    for name in names:
        m = _NUMBERED.match(name)
        if m is not None:
            prefix, n = m.group(1), int(m.group(2))
            last = runs[-1] if runs else None
            if last is not None and len(last) == 3 and last[0] == prefix and last[2] + 1 == n:
                last[2] = n
                continue
            runs.append([prefix, n, n])
        else:
            runs.append([name])
    text = ",".join(r[0] if len(r) == 1 else f"{r[0]}{r[1]}" if r[1] == r[2] else f"{r[0]}{r[1]}..{r[2]}"
                    for r in runs)
    return {"runs": text}


def unpack_names(value: Any) -> list[str]:
    """The names :func:`pack_names` packed (a plain list passes through)."""
    if isinstance(value, list):
        return list(value)
    if not isinstance(value, Mapping) or not isinstance(value.get("runs"), str):
        raise InvalidConfig(f"a host list in the job record must be a list or {{'runs': ...}}, got {value!r}")
    out: list[str] = []
    for part in value["runs"].split(","):
        first, sep, last = part.partition("..")
        if not sep:
            out.append(first)
            continue
        m = _NUMBERED.match(first)
        if m is None or not last.isdigit():
            raise InvalidConfig(f"a host run in the job record must look like node-0..7, got {part!r}")
        out.extend(f"{m.group(1)}{n}" for n in range(int(m.group(2)), int(last) + 1))
    return out


WORKERS_FORMAT = "tenplex.workers/v1"
_NO_PID, _NO_BEAT, _NO_STEP, _NO_CODE = 0, -1, -1, 1 << 24
"""What stands for None in the worker table's columns (a worker's pid is never 0, heartbeats are kept after the
table's base time, steps are >= 0, exit codes lie in -255..255): small numbers, so the columns fit int32."""
_WORKER_COLUMNS = ("rank", "local_rank", "generation", "host", "pid", "registered", "last_heartbeat", "step",
                   "exit_code")


def workers_table(workers: Sequence[WorkerRecord]) -> dict[str, Any]:
    """Worker records as a compact table: the names once (worker ids as ``<prefix>-g<generation>-r<rank>``
    when they all are, as the launcher names them; hosts as indices), the numbers as delta-coded int64
    columns, zlib-compressed and base64-encoded. Heartbeat times are kept in whole seconds after ``base``,
    rounded up: a restarted scheduler sees each worker at most a second younger than it was, never older
    (no false timeout). A pid of 0 reads back as None (no worker process has pid 0)."""
    n = len(workers)
    ids = [w.worker_id for w in workers]
    prefix = ids[0].rsplit("-g", 1)[0] if ids else ""
    derived = all(i == f"{prefix}-g{w.generation}-r{w.rank}" for i, w in zip(ids, workers, strict=True))
    hosts = list(dict.fromkeys(w.host for w in workers))
    host_index = {h: i for i, h in enumerate(hosts)}
    beats = [w.last_heartbeat for w in workers if w.last_heartbeat is not None]
    base = math.floor(min(beats)) if beats else 0

    def opt(v: int | None, none: int) -> int:
        return none if v is None else int(v)

    columns = np.array([
        [w.rank for w in workers], [w.local_rank for w in workers], [w.generation for w in workers],
        [host_index[w.host] for w in workers], [opt(w.pid, _NO_PID) for w in workers],
        [int(w.registered) for w in workers],
        [_NO_BEAT if w.last_heartbeat is None else math.ceil(w.last_heartbeat - base) for w in workers],
        [opt(w.step, _NO_STEP) for w in workers], [opt(w.exit_code, _NO_CODE) for w in workers],
    ], dtype=np.int64).reshape(len(_WORKER_COLUMNS), n)
    deltas = np.diff(columns, axis=1, prepend=0) if n else columns
    dtype = "<i4" if not n or (int(deltas.max()) < 2**31 and int(deltas.min()) >= -(2**31)) else "<i8"
    return {"format": WORKERS_FORMAT, "count": n, "ids": {"prefix": prefix} if derived else {"list": ids},
            "hosts": pack_names(hosts), "base": base, "columns": list(_WORKER_COLUMNS), "dtype": dtype,
            "data": base64.b64encode(zlib.compress(deltas.astype(dtype).tobytes(), 9)).decode()}


def workers_from_table(obj: Mapping[str, Any]) -> list[WorkerRecord]:
    """The worker records of :func:`workers_table`; InvalidConfig for a table this version cannot read."""
    if obj.get("format") != WORKERS_FORMAT or list(obj.get("columns", ())) != list(_WORKER_COLUMNS):
        raise InvalidConfig(f"the job record's workers are in format {obj.get('format')!r} with columns "
                            f"{obj.get('columns')!r}; this scheduler reads {WORKERS_FORMAT!r}")
    n = int(obj["count"])
    dtype = obj.get("dtype")
    if dtype not in ("<i4", "<i8"):
        raise InvalidConfig(f"the job record's worker table has dtype {dtype!r}; this scheduler reads <i4 and <i8")
    raw = np.frombuffer(zlib.decompress(base64.b64decode(obj["data"])), dtype=dtype).astype(np.int64)
    if raw.size != n * len(_WORKER_COLUMNS):
        raise InvalidConfig(f"the job record's worker table holds {raw.size} values for {n} workers")
    cols = np.cumsum(raw.reshape(len(_WORKER_COLUMNS), n), axis=1).tolist()
    rank, local, gen, host, pid, registered, beat, step, code = cols
    hosts, base = unpack_names(obj["hosts"]), int(obj["base"])
    ids = obj["ids"]
    names = list(ids["list"]) if "list" in ids else [f"{ids['prefix']}-g{g}-r{r}" for g, r in zip(gen, rank, strict=True)]

    def opt(v: int, none: int) -> int | None:
        return None if v == none else v

    return [WorkerRecord(names[i], rank[i], hosts[host[i]], local[i], gen[i], pid=opt(pid[i], _NO_PID),
                         registered=bool(registered[i]),
                         last_heartbeat=None if beat[i] == _NO_BEAT else float(base + beat[i]),
                         step=opt(step[i], _NO_STEP), exit_code=opt(code[i], _NO_CODE)) for i in range(n)]


class JobStore(ABC):
    """Where a scheduler keeps its jobs: what the job controllers write and a restarted scheduler reads.

    Every method is safe to call from several job controllers' threads at once
    (each controller writes only its own job). A write that returns is durable:
    a scheduler killed right after it finds that record on its restart.
    """

    root: Path
    """A directory on the scheduler's own machine for its files that are not job state (the local backend's
    worker logs); it exists."""

    @abstractmethod
    def save(self, spec: JobSpec, status: JobStatus) -> None:
        """Record the job's spec and status (``status.updated_at`` is set to now), replacing the last record."""

    @abstractmethod
    def save_ptc(self, name: str, generation: int, ptc: PTC) -> None:
        """Record the PTC of one generation of the job (written once per generation)."""

    @abstractmethod
    def load_ptc(self, name: str, generation: int) -> PTC:
        """The PTC recorded for ``generation``; :class:`NotFound` when there is none."""

    @abstractmethod
    def load_all(self) -> list[tuple[JobSpec, JobStatus]]:
        """Every recorded job, each with its newest record (what a restarted scheduler resumes)."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Forget the job and its PTCs (nothing happens when nothing is recorded)."""


class StateDir(JobStore):
    """One directory per scheduler: ``jobs/<name>.json`` plus ``jobs/<name>/ptc-g<N>.json``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        (self.root / "jobs").mkdir(parents=True, exist_ok=True)

    def _job_file(self, name: str) -> Path:
        return self.root / "jobs" / f"{check_job_name(name)}.json"

    def _ptc_file(self, name: str, generation: int) -> Path:
        return self.root / "jobs" / check_job_name(name) / f"ptc-g{generation}.json"

    def save(self, spec: JobSpec, status: JobStatus) -> None:
        """The record, one file. It stays small at any scale: the last plan is kept as what it is computed from
        (:mod:`tenplex.scheduler.plans`), the PTCs in files of their own."""
        status.updated_at = time.time()
        # Compact: json's C encoder serves only indent=None (indented output is encoded in Python, ten times slower,
        # and a record is rewritten at every worker's registration).
        atomic_write(self._job_file(spec.name),
                     json.dumps({"spec": spec.to_json(), "status": status.to_record()}, separators=(",", ":")),
                     durable=True, make_parents=True)

    def save_ptc(self, name: str, generation: int, ptc: PTC) -> None:
        atomic_write(self._ptc_file(name, generation), ptc.dumps(), durable=True, make_parents=True)

    def load_ptc(self, name: str, generation: int) -> PTC:
        path = self._ptc_file(name, generation)
        if not path.exists():
            raise NotFound(f"job {name!r} has no PTC for generation {generation}")
        return PTC.load(path)

    def load_all(self) -> list[tuple[JobSpec, JobStatus]]:
        out = []
        for path in sorted((self.root / "jobs").glob("*.json")):
            obj = json.loads(path.read_text())
            spec = JobSpec.from_json(obj["spec"])
            out.append((spec, JobStatus.from_json(obj["status"])))
        return out

    def delete(self, name: str) -> None:
        self._job_file(name).unlink(missing_ok=True)
        shutil.rmtree(self.root / "jobs" / check_job_name(name), ignore_errors=True)


