"""The job spec as users write it: one set of pydantic models for both of its contracts.

A job is asked for in two shapes: the REST API's ``POST /v1/jobs`` body
(:class:`JobCreate`, snake_case, a worker command for the local backend) and
the ElasticJob custom resource's ``spec`` (:class:`ElasticJobSpec`,
camelCase, pods and their image). The parts they share (layout, dataset,
persistent checkpoints, a resume) are the same models here, with one set of
bounds and descriptions; FastAPI derives the REST API's OpenAPI document from
them, and :func:`structural_schema` derives the CRD's ``openAPIV3Schema``
(CEL rules included), which the chart's CRD file is generated from. Each
cross-field rule is written twice, side by side in one :class:`Rule`: as CEL,
which the API server enforces on every write, and as a Python predicate, which
the models' validator applies (with the same message) so that an offline
``tenplex k8s validate`` refuses what a cluster refuses; the tests check the
two against kube-apiserver and against a CEL interpreter. Each
shape has one converter to the scheduler's :class:`~tenplex.scheduler.state.JobSpec`
(``to_job_spec``); nothing converts back: the scheduler's record keeps its own form.

The CRD shape is the serialization alias of every field (camelCase); an
object in that shape is read with ``model_validate(obj, context=CRD)``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AliasGenerator,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import InitErrorDetails, PydanticCustomError

from tenplex import registry
from tenplex.core import protocol as P
from tenplex.errors import InvalidConfig
from tenplex.ptc import DatasetState, ParallelConfig
from tenplex.scheduler.layouts import LayoutSpec
from tenplex.scheduler.policy import Policy
from tenplex.scheduler.state import (
    LATEST,
    CheckpointSpec,
    JobSpec,
    ResumeSpec,
    policy_from_json,
    policy_to_json,
)

CRD: dict[str, bool] = {"crd": True}
"""The validation context that reads an object in the CRD's camelCase shape."""
DEFAULT_STORE_ROOT = "/var/lib/tenplex/store"
VERSION_PATTERN = r"^(latest|s(0|[1-9][0-9]{0,17})-g(0|[1-9][0-9]{0,8}))$"
MAX_GPUS = 1 << 20
RULE_ERROR = "cel_rule"
"""The pydantic error type of a broken cross-field rule; its context holds the rule's CEL string."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One cross-field rule of the CRD: the CEL the API server evaluates, and the same test in Python."""

    cel: str
    """The ``x-kubernetes-validations`` rule, over the CRD's camelCase names."""
    message: str
    """What the API server (and the model's validator) says when the rule is broken."""
    reads: tuple[str, ...]
    """The model fields ``holds`` reads: a rule is not applied while one of them is invalid."""
    holds: Callable[[Any], bool]
    """The rule on the model (snake_case attributes; an absent optional field is None)."""


def _broken(model: Any, rules: tuple[Rule, ...], skip: set[str]) -> list[Rule]:
    return [r for r in rules if not skip.intersection(r.reads) and not r.holds(model)]


def _rule_error(rule: Rule, data: Any) -> InitErrorDetails:
    return InitErrorDetails(type=PydanticCustomError(RULE_ERROR, rule.message, {"rule": rule.cel}), loc=(),
                            input=data)


class _Model(BaseModel):
    """Unknown fields are errors; the camelCase name of a field is its CRD name; ``CEL_RULES`` are applied."""

    model_config = ConfigDict(extra="forbid", frozen=True,
                              alias_generator=AliasGenerator(serialization_alias=to_camel))
    CEL_RULES: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="wrap")
    @classmethod
    def _cel_rules(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        """Every broken rule is an error, as on the API server, even where a field below is invalid too."""
        if not cls.CEL_RULES:
            return handler(data)
        try:
            model = handler(data)
        except ValidationError as exc:
            # The fields that did validate are read as given (defaults for the absent ones), the rest skipped.
            errors = exc.errors()
            if not isinstance(data, Mapping):
                raise
            names = {f.serialization_alias or n: n for n, f in cls.model_fields.items()}
            given = {names.get(k, k): v for k, v in data.items() if names.get(k, k) in cls.model_fields}
            try:
                broken = _broken(cls.model_construct(**given), cls.CEL_RULES,
                                 {str(e["loc"][0]) for e in errors if e["loc"]})
            except (TypeError, ValueError, AttributeError):
                broken = []  # a value the schema would refuse: its own error says so
            if not broken:
                raise
            raise ValidationError.from_exception_data(cls.__name__, [
                *(_rule_error(r, data) for r in broken),
                *(InitErrorDetails(type=PydanticCustomError(e["type"], e["msg"].replace("{", "{{").replace("}", "}}"),
                                                            e.get("ctx") if e["type"] == RULE_ERROR else None),
                                   loc=e["loc"], input=e["input"]) for e in errors)]) from None
        broken = _broken(model, cls.CEL_RULES, set())
        if broken:
            raise ValidationError.from_exception_data(cls.__name__, [_rule_error(r, data) for r in broken])
        return model

    @model_validator(mode="before")
    @classmethod
    def _from_crd(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, Mapping) and isinstance(info.context, Mapping) and info.context.get("crd"):
            names = {f.serialization_alias or n: n for n, f in cls.model_fields.items()}
            for key in data:
                if key not in names and key in cls.model_fields:
                    raise ValueError(f"{key!r} is the REST API's name: the ElasticJob's is "
                                     f"{cls.model_fields[key].serialization_alias!r}")
            return {names.get(k, k): v for k, v in data.items()}
        return data


# --------------------------------------------------------------------------- shared by both shapes


class LayoutBody(_Model):
    provider: str = Field(
        min_length=1, max_length=253, pattern=f"^(?:{registry.REFERENCE_PATTERN})$",
        description="A layout provider registered with the scheduler (entry points 'tenplex.layouts', e.g. "
                    "megatron-gpt, example-gpt), or 'package.module:function' naming one the scheduler can import.")
    model: dict[str, Any] = Field(
        default_factory=dict, description="The model as the provider expects it: dimensions (layers, hidden size, ...) and, for "
                    "megatron-gpt, its conventions (naming, pad_vocab, normalization, ...).")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Training precision of parameters and gradients.")

    def to_spec(self) -> LayoutSpec:
        return LayoutSpec(self.provider, copy.deepcopy(self.model), self.precision)


class DatasetBody(_Model):
    num_samples: int = Field(ge=1, le=1 << 48,
                             description="Samples in the dataset (the sample order is a permutation of them).")
    seed: int = Field(0, ge=0, le=1 << 62, description="Seed of the sample order.")
    global_batch_size: int = Field(ge=1, le=1 << 30,
                                   description="Samples per training step over all data-parallel ranks.")
    consumed_samples: int = Field(0, ge=0, le=1 << 62, description="Samples consumed before the job starts.")

    def to_state(self) -> DatasetState:
        return DatasetState(self.num_samples, self.seed, self.global_batch_size, self.consumed_samples)


class CheckpointBody(_Model):
    uri: str = Field(min_length=1, max_length=2048, description=(
        "Persistent location: s3://bucket/prefix (any S3-compatible store; endpoint and credentials are the store "
        "daemons') or file:///path (a filesystem mounted on every node)."))
    interval_steps: int | None = Field(None, ge=1, le=1 << 40, description=(
        "Copy a committed version there every this many steps (default: every snapshot)."))
    keep_last: int = Field(2, ge=1, le=1000, description="Persistent versions kept (older ones are deleted).")

    def to_spec(self, snapshot_every: int) -> CheckpointSpec:
        # Without interval_steps every snapshot that completes is also persisted.
        return CheckpointSpec(self.uri, self.interval_steps or snapshot_every, self.keep_last)


class ResumeBody(_Model):
    uri: str = Field(min_length=1, max_length=2048, description=(
        "The persistent location the version was saved to (a job's checkpoint.uri): s3://bucket/prefix or "
        "file:///path."))
    job: P.JobName | None = Field(None, description=(
        "The job the version was saved under (another job's name for a copy of it); default: this job's name."))
    version: str = Field(LATEST, pattern=VERSION_PATTERN, description=(
        "A committed persistent version (s<step>-g<generation>) or 'latest': the newest committed one."))

    def to_spec(self) -> ResumeSpec:
        return ResumeSpec(self.uri, self.job, self.version)


# --------------------------------------------------------------------------- the REST API's body


class PolicyBody(_Model):
    table: dict[str, dict[str, Any]] = Field(default_factory=dict, description="GPU count -> {dp, tp, pp, zero}.")
    gpu_memory_bytes: int | None = Field(None, gt=0)
    state_memory_fraction: float = Field(0.5, gt=0, le=1)
    zero: int = Field(0, ge=0, le=3)


_EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


class JobCreate(_Model):
    name: P.JobName
    layout: LayoutBody
    dataset: DatasetBody
    command: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(
        default_factory=list, max_length=256, description="Worker command (local backend).")
    image: str | None = Field(None, min_length=1, max_length=1024, description="Worker image (kubernetes backend).")
    gpus: int = Field(ge=1, le=MAX_GPUS)
    min_gpus: int = Field(1, ge=1, le=MAX_GPUS)
    max_gpus: int = Field(MAX_GPUS, ge=1, le=MAX_GPUS)
    policy: PolicyBody = Field(default_factory=PolicyBody)
    steps: int = Field(100, ge=1, le=1 << 40)
    snapshot_every: int = Field(10, ge=1, le=1 << 40)
    heartbeat_timeout: float = Field(60.0, gt=0, le=86400)
    max_restarts: int = Field(3, ge=0, le=1_000_000, description=(
        "Failure recoveries allowed in a row without a newer snapshot; the next failure fails the job."))
    checkpoint: CheckpointBody | None = Field(None, description=(
        "Persistent checkpoints, the fall-back when no replica of some region survives."))
    resume_from: ResumeBody | None = Field(None, description=(
        "Start from a persistent version (a resume after an outage, or a copy of a job) instead of step 0: its "
        "state, step and data position, in a layout planned for this job's GPUs."))
    standby: bool = Field(False, description=(
        "Keep a warm standby on every usable host: a process with the job's code imported that forks the new "
        "workers of a reconfiguration (local backend)."))
    env: dict[_EnvName, Annotated[str, Field(max_length=65536)]] = Field(default_factory=dict)

    def to_job_spec(self) -> JobSpec:
        return JobSpec(
            name=self.name, layout=self.layout.to_spec(), dataset=self.dataset.to_state(),
            command=tuple(self.command), image=self.image, gpus=self.gpus, min_gpus=self.min_gpus,
            max_gpus=self.max_gpus, policy=policy_from_json(self.policy.model_dump()), steps=self.steps,
            snapshot_every=self.snapshot_every, heartbeat_timeout=self.heartbeat_timeout,
            max_restarts=self.max_restarts, standby=self.standby, env=dict(self.env),
            checkpoint=self.checkpoint.to_spec(self.snapshot_every) if self.checkpoint is not None else None,
            resume_from=self.resume_from.to_spec() if self.resume_from is not None else None,
        )


# --------------------------------------------------------------------------- the ElasticJob's spec

# The CRD's cross-field rules (x-kubernetes-validations), by schema location; each model below applies its own.
RULES: dict[str, tuple[Rule, ...]] = {
    "spec": (
        Rule("!has(self.minGpus) || !has(self.maxGpus) || self.minGpus <= self.maxGpus",
             "minGpus must not exceed maxGpus", ("min_gpus", "max_gpus"),
             lambda s: s.min_gpus is None or s.max_gpus is None or s.min_gpus <= s.max_gpus),
        Rule("self.gpus % self.gpusPerPod == 0", "gpus must be a multiple of gpusPerPod", ("gpus", "gpus_per_pod"),
             lambda s: s.gpus % s.gpus_per_pod == 0),
        Rule("self.gpus == 0 || !has(self.minGpus) || self.gpus >= self.minGpus",
             "gpus must be 0 (suspended) or at least minGpus", ("gpus", "min_gpus"),
             lambda s: s.gpus == 0 or s.min_gpus is None or s.gpus >= s.min_gpus),
        Rule("!has(self.maxGpus) || self.gpus <= self.maxGpus", "gpus must not exceed maxGpus", ("gpus", "max_gpus"),
             lambda s: s.max_gpus is None or s.gpus <= s.max_gpus),
    ),
    "spec.policy": (
        Rule("self.type != 'table' || (has(self.table) && size(self.table) > 0)",
             "a policy of type table needs a non-empty table", ("type", "table"),
             lambda p: p.type != "table" or len(p.table) > 0),
        Rule("!has(self.stateMemoryFraction) || self.stateMemoryFraction > 0.0",
             "stateMemoryFraction must be greater than 0", ("state_memory_fraction",),
             lambda p: p.state_memory_fraction > 0.0),
    ),
    "spec.policy.table[]": (
        Rule("self.dp * self.tp * self.pp == self.gpus", "dp * tp * pp must equal gpus in every table entry",
             ("dp", "tp", "pp", "gpus"), lambda e: e.dp * e.tp * e.pp == e.gpus),
    ),
}



@dataclass(frozen=True, slots=True)
class Immutable:
    """A part of a live job's spec that cannot change: the CRD's transition rule (CEL with ``oldSelf``, which the
    API server evaluates on every update of an ElasticJob) and the same test on the scheduler's
    :class:`~tenplex.scheduler.state.JobSpec` (``of`` of the old and of the new spec must be equal), which
    refuses the change with the same message where no transition rule stands in between: the REST API's
    ``PUT``, and a cluster whose CRD predates the rules (``helm upgrade`` never upgrades a chart's CRDs)."""

    field: str
    """The part, as the ElasticJob names it."""
    cel: str
    """The transition rule on ``spec``."""
    message: str
    of: Callable[[JobSpec], Any]


IMMUTABLE: tuple[Immutable, ...] = (
    Immutable("spec.layout", "self.layout == oldSelf.layout",
              "spec.layout is immutable: the job's state is laid out for this model and precision (for another, "
              "create a new ElasticJob with resumeFrom a persistent checkpoint of this one)",
              lambda s: s.layout.to_json()),
    Immutable("spec.training.dataset",
              "!has(oldSelf.training) || (has(self.training) && self.training.dataset == oldSelf.training.dataset)",
              "spec.training.dataset is immutable (and spec.training cannot be removed): the sample order and data "
              "position of the job's state follow from it", lambda s: s.dataset.to_json()),
    Immutable("spec.policy",
              "has(self.policy) == has(oldSelf.policy) && (!has(self.policy) || self.policy == oldSelf.policy)",
              "spec.policy is immutable: the job's stored layouts were chosen by it (ZeRO stage, parallel "
              "configurations)", lambda s: policy_to_json(s.policy)),
    Immutable("spec.gpusPerPod", "self.gpusPerPod == oldSelf.gpusPerPod",
              "spec.gpusPerPod is immutable: the job's placement is in whole pods of this many GPUs",
              lambda s: s.gpus_per_pod),
    Immutable("spec.resumeFrom",
              "has(self.resumeFrom) == has(oldSelf.resumeFrom) && (!has(self.resumeFrom) || "
              "self.resumeFrom == oldSelf.resumeFrom)",
              "spec.resumeFrom is immutable: it is where the job's state came from",
              lambda s: s.resume_from.to_json() if s.resume_from is not None else None),
    Immutable("spec.checkpoint.uri",
              "has(self.checkpoint) == has(oldSelf.checkpoint) && (!has(self.checkpoint) || "
              "self.checkpoint.uri == oldSelf.checkpoint.uri)",
              "spec.checkpoint.uri is immutable, and a checkpoint cannot be added to or removed from a job: its "
              "persistent versions are there (intervalSteps and keepLast may change)",
              lambda s: s.checkpoint.uri if s.checkpoint is not None else None),
)
"""What a ``kubectl apply`` (or the REST API's ``PUT``) may not change on a live job: what its state is (model,
data order, layouts, where it is persisted or came from). Everything else may change: see :func:`spec_changes`."""

REDEPLOY_FIELDS = ("command", "image", "env", "pod", "steps", "snapshot_every", "standby")
"""JobSpec fields the workers are started with: a change of one is applied by a planned redeploy (stop at a step
boundary, snapshot, the next generation launched with the new spec in the same layout)."""
IN_PLACE_FIELDS = ("min_gpus", "max_gpus", "heartbeat_timeout", "max_restarts", "checkpoint")
"""JobSpec fields only the scheduler reads: a change of one takes effect at once, the workers keep running."""
CRD_FIELD_NAMES = {
    "command": "command/args", "image": "image", "env": "env",
    "pod": "imagePullPolicy/resources/tolerations/env valueFrom", "steps": "training.steps",
    "snapshot_every": "training.snapshotEvery", "standby": "standby", "min_gpus": "minGpus", "max_gpus": "maxGpus",
    "heartbeat_timeout": "training.heartbeatTimeoutSeconds", "max_restarts": "training.maxRestarts",
    "checkpoint": "checkpoint.intervalSteps/keepLast",
}
"""How the ElasticJob names the JobSpec fields above (what its ``SpecUpdated`` condition says changed)."""


def immutable_changes(old: JobSpec, new: JobSpec) -> list[Immutable]:
    """The immutable parts ``new`` changes (empty: the change may be applied)."""
    return [i for i in IMMUTABLE if i.of(old) != i.of(new)]


def spec_changes(old: JobSpec, new: JobSpec) -> tuple[list[str], list[str]]:
    """The changed fields of a live job's spec besides ``gpus`` (a scale) and the immutable parts: (those that
    need a redeploy, those applied in place), JobSpec names."""
    a, b = old.to_json(), new.to_json()
    return ([f for f in REDEPLOY_FIELDS if a[f] != b[f]], [f for f in IN_PLACE_FIELDS if a[f] != b[f]])


def _rules(location: str) -> dict[str, Any]:
    rules = [{"rule": r.cel, "message": r.message} for r in RULES[location]]
    if location == "spec":
        rules += [{"rule": i.cel, "message": i.message} for i in IMMUTABLE]
    return {"x-kubernetes-validations": rules}


_ZERO = "ZeRO stage: 0 replicated optimizer, 1/2 optimizer state sharded across dp, 3 parameters too."
_Quantity = Annotated[int | str, WithJsonSchema(
    {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True})]


class TableEntry(_Model):
    model_config = ConfigDict(json_schema_extra=_rules("spec.policy.table[]"))
    CEL_RULES = RULES["spec.policy.table[]"]

    gpus: int = Field(ge=1)
    dp: int = Field(ge=1)
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    zero: int = Field(0, ge=0, le=3, description=_ZERO)


class PolicySpec(_Model):
    """How a GPU count becomes (dp, tp, pp): a table, or the built-in cost model."""

    model_config = ConfigDict(json_schema_extra=_rules("spec.policy"))
    CEL_RULES = RULES["spec.policy"]

    type: Literal["builtin", "table"] = "builtin"
    table: list[TableEntry] = Field(default_factory=list, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["gpus"]})
    gpu_memory_bytes: int | None = Field(None, ge=1, description="Memory of one GPU for the built-in policy.")
    # ge=0 here, > 0 in the rules: a structural schema has no numeric exclusiveMinimum.
    state_memory_fraction: float = Field(0.5, ge=0, le=1, description=(
        "Part of a GPU's memory that model and optimizer state may use."))
    zero: int = Field(0, ge=0, le=3, description=_ZERO)

    def lookup(self, gpus: int) -> TableEntry | None:
        """The table entry for ``gpus`` GPUs, if the table has one."""
        return next((e for e in self.table if e.gpus == gpus), None)

    def to_policy(self) -> Policy:
        table = {e.gpus: ParallelConfig(e.dp, e.tp, e.pp, zero=e.zero) for e in self.table} \
            if self.type == "table" else {}
        return Policy(table=table, gpu_memory_bytes=self.gpu_memory_bytes,
                      state_memory_fraction=self.state_memory_fraction, zero=self.zero)


class Training(_Model):
    steps: int = Field(100, ge=1, description="Total training steps.")
    snapshot_every: int = Field(10, ge=1, description="Snapshot the state to the node-local stores every this many "
                                                      "steps.")
    heartbeat_timeout_seconds: int = Field(60, ge=1, description="A worker silent this long counts as failed.")
    max_restarts: int = Field(3, ge=0, description="Failure recoveries allowed in a row without a newer snapshot; "
                                                   "the next failure fails the job.")
    dataset: DatasetBody


class EnvVar(_Model):
    name: str = Field(min_length=1)
    value: str | None = None
    value_from: dict[str, Any] | None = None


class Resources(_Model):
    limits: dict[str, _Quantity] | None = None
    requests: dict[str, _Quantity] | None = None


class ElasticJobSpec(_Model):
    """What to run and on how many GPUs. spec.gpus is the scale subresource's replicas."""

    model_config = ConfigDict(json_schema_extra=_rules("spec"))
    CEL_RULES = RULES["spec"]

    image: str = Field(min_length=1, description="Container image of the workers.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    command: list[str] = Field(min_length=1, description="Entry point of each worker process (it imports "
                                                         "tenplex.worker).")
    args: list[str] = Field(default_factory=list)
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment of the workers (Kubernetes "
                                                                "EnvVar objects).")
    gpus_per_pod: int = Field(1, ge=1, description=(
        "GPUs (nvidia.com/gpu) and ranks of each worker pod, and the granularity of gpus. Above 1, a pod runs that "
        "many ranks of one node under 'tenplex worker launch', each selecting its GPU by LOCAL_RANK."))
    standby: bool = Field(False, description=(
        "Keep the worker pods between generations, each running a warm standby of the job's code (tenplex worker "
        "standby): a reconfiguration gives a live pod on a kept node the next generation's workers (no pod start, "
        "interpreter or imports). The pods hold their GPUs between generations; the command must be `python -m "
        "MODULE` or `python SCRIPT`."))
    gpus: int = Field(ge=0, description="Desired total GPU count; 0 suspends the job keeping its state.")
    min_gpus: int | None = Field(None, ge=1, description="Fewest GPUs the job may run on (failures below this fail "
                                                         "the job).")
    max_gpus: int | None = Field(None, ge=1, description="Most GPUs the job may be scaled to.")
    layout: LayoutBody = Field(description="How the training state is laid out: a layout provider and its model "
                                       "description.")
    policy: PolicySpec = Field(default_factory=PolicySpec)
    resources: Resources = Field(default_factory=Resources, description=(
        "Worker container resources besides the GPUs (which follow gpusPerPod)."))
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    training: Training | None = Field(None, description=(
        "How long to train and the sample order: the scheduler needs them to lay out the state and to resume the "
        "data position after a reconfiguration."))
    checkpoint: CheckpointBody | None = Field(None, description=(
        "Optional persistent checkpoints, the fall-back when no replica survives."))
    resume_from: ResumeBody | None = Field(None, description=(
        "Optional: start from a persistent version (a resume after an outage, or a copy of a job) instead of step "
        "0, in a layout planned for this job's GPUs."))

    @property
    def pods(self) -> int:
        """Worker pods needed for the desired GPU count."""
        return self.gpus // self.gpus_per_pod

    def to_job_spec(self, name: str) -> JobSpec:
        """The scheduler's JobSpec for the ElasticJob ``name`` with this spec."""
        if self.training is None:
            raise InvalidConfig(f"ElasticJob {name} has no spec.training: the scheduler needs the run length and the "
                                "dataset order (spec.training.dataset.numSamples and globalBatchSize)")
        if self.gpus == 0:
            raise InvalidConfig(f"ElasticJob {name} asks for 0 GPUs: creating a suspended job is not supported")
        t = self.training
        return JobSpec(
            name=name, layout=self.layout.to_spec(), dataset=t.dataset.to_state(),
            command=(*self.command, *self.args), gpus=self.gpus, min_gpus=self.min_gpus or 1,
            max_gpus=self.max_gpus or MAX_GPUS, policy=self.policy.to_policy(), steps=t.steps,
            snapshot_every=t.snapshot_every, heartbeat_timeout=float(t.heartbeat_timeout_seconds),
            max_restarts=t.max_restarts, gpus_per_pod=self.gpus_per_pod, standby=self.standby, image=self.image,
            env={e.name: e.value or "" for e in self.env if e.value_from is None},
            checkpoint=self.checkpoint.to_spec(t.snapshot_every) if self.checkpoint is not None else None,
            resume_from=self.resume_from.to_spec() if self.resume_from is not None else None,
            pod=self.pod_settings(),
        )

    def pod_settings(self) -> dict[str, Any]:
        """What else the worker pods get from this spec besides image, command and plain env values (the
        JobSpec's ``pod``; only what is set)."""
        out: dict[str, Any] = {
            "imagePullPolicy": self.image_pull_policy,
            "resources": self.resources.model_dump(by_alias=True, exclude_none=True) or None,
            "tolerations": [dict(t) for t in self.tolerations] or None,
            "envValueFrom": [e.model_dump(by_alias=True, exclude_none=True) for e in self.env if e.value_from is not None]
            or None,
        }
        return {k: v for k, v in out.items() if v is not None}


# --------------------------------------------------------------------------- the CRD's schema

_ORDER = ("type", "description", "required", "properties", "items")


def structural_schema(model: type[Any]) -> dict[str, Any]:
    """``model``'s (a pydantic model or dataclass) JSON schema in the CRD's shape, a Kubernetes structural schema (OpenAPI v3.0).

    camelCase names, every ``$ref`` inlined, no titles, ``X | None`` as ``X``
    (an absent field), ``additionalProperties: true`` (a free-form object) as
    ``x-kubernetes-preserve-unknown-fields``, no ``additionalProperties:
    false`` (the API server drops unknown fields, ``kubectl`` refuses them by
    default), and a numeric
    ``exclusiveMinimum`` as ``minimum`` (OpenAPI v3.0's is a boolean: a
    strict bound is a CEL rule).
    """
    raw = TypeAdapter(model).json_schema(by_alias=True, mode="serialization")
    defs = raw.pop("$defs", {})

    def walk(node: dict[str, Any]) -> dict[str, Any]:
        node = dict(node)
        if "$ref" in node:
            node = {**defs[node.pop("$ref").rsplit("/", 1)[1]], **node}
        options = node.get("anyOf")
        if options is not None and {"type": "null"} in options:
            rest = [o for o in options if o != {"type": "null"}]
            del node["anyOf"]
            node = {**rest[0], **node} if len(rest) == 1 else {**node, "anyOf": rest}
            if node.get("default", 0) is None:
                del node["default"]
            if "$ref" in node:
                return walk(node)
        node.pop("title", None)
        if node.get("additionalProperties") is True:
            node["x-kubernetes-preserve-unknown-fields"] = True
        if isinstance(node.get("additionalProperties"), bool):
            del node["additionalProperties"]
        if "exclusiveMinimum" in node:
            node["minimum"] = node.pop("exclusiveMinimum")
        if "properties" in node:
            node["properties"] = {k: walk(v) for k, v in node["properties"].items()}
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                node[key] = walk(node[key])
        if "anyOf" in node:
            node["anyOf"] = [walk(o) for o in node["anyOf"]]
        return {**{k: node[k] for k in _ORDER if k in node}, **{k: v for k, v in node.items() if k not in _ORDER}}

    return walk(raw)
