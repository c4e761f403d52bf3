"""The ElasticJob custom resource: its CRD as Python data, and typed views of spec and status.

This module is the single source of truth for the resource. The chart's
``crds/elasticjobs.tenplex.io.yaml`` is generated from :func:`crd_manifest`
(``tenplex k8s crd > deploy/helm/tenplex/crds/elasticjobs.tenplex.io.yaml``;
a test keeps them equal), the test API server serves the resource from that
manifest, its cross-field CEL rules are evaluated from the manifest's own
strings (:mod:`tenplex.k8s.cel`), and the scheduler's Kubernetes backend reads
spec and writes status through :class:`ElasticJobSpec` and :class:`ElasticJobStatus`.

Contracts with the rest of the deployment (the chart implements them):

* Pods carry ``tenplex.io/job=<job name>`` and ``tenplex.io/role=worker|store|scheduler``.
* ``kubectl scale elasticjob/NAME --replicas=N`` writes ``spec.gpus`` through the
  ``scale`` subresource; ``status.gpus`` is what runs now and ``status.selector``
  selects the job's worker pods (so an HPA can target the job too).
* Each GPU node runs one store daemon (DaemonSet) listening on the node's
  address at ``STORE_PORT`` (hostPort). A worker pod finds the store of its
  node through the downward API: ``TENPLEX_NODE_IP`` is ``status.hostIP`` and
  ``TENPLEX_STORE_URL`` is ``http://$(TENPLEX_NODE_IP):<port>``, built by
  :func:`store_env`.
"""

from __future__ import annotations

import copy
import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tenplex import registry
from tenplex.core.protocol import ENV_NODE_IP, JOB_NAME_PATTERN
from tenplex.errors import InvalidInput
from tenplex.k8s import cel

GROUP = "tenplex.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ElasticJob"
PLURAL = "elasticjobs"
SINGULAR = "elasticjob"
SHORT_NAMES = ("ej",)
CRD_NAME = f"{PLURAL}.{GROUP}"

LABEL_JOB = "tenplex.io/job"
LABEL_ROLE = "tenplex.io/role"
ROLE_WORKER = "worker"
ROLE_STORE = "store"
ROLE_SCHEDULER = "scheduler"

STORE_PORT = 7070
SCHEDULER_PORT = 8080
DEFAULT_STORE_ROOT = "/var/lib/tenplex/store"
ENV_STORE_URL = "TENPLEX_STORE_URL"
ENV_TOKEN = "TENPLEX_TOKEN"
GPU_RESOURCE = "nvidia.com/gpu"
LEADER_LEASE = "tenplex-scheduler"
POLICY_TYPES = ("builtin", "table")
PRECISIONS = ("fp32", "bf16", "fp16")


class Phase(enum.StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    RECONFIGURING = "Reconfiguring"
    SUSPENDED = "Suspended"
    FAILED = "Failed"
    SUCCEEDED = "Succeeded"


# --------------------------------------------------------------------------- schema


def _int(minimum: int | None = None, description: str = "", **extra: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", **extra}
    if minimum is not None:
        schema["minimum"] = minimum
    if description:
        schema["description"] = description
    return schema


def _str(description: str = "", **extra: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", **extra}
    if description:
        schema["description"] = description
    return schema


_QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}

_PARALLEL = {
    "type": "object",
    "description": "Data-, tensor- and pipeline-parallel degrees; their product is the GPU count.",
    "required": ["dp", "tp", "pp"],
    "properties": {"dp": _int(1), "tp": _int(1), "pp": _int(1)},
}

_ZERO = _int(0, "ZeRO stage: 0 replicated optimizer, 1/2 optimizer state sharded across dp, 3 parameters too.",
             maximum=3)

_SIDE = {
    "type": "object",
    "description": "A configuration before or after a reconfiguration; dp/tp/pp absent when nothing ran.",
    "required": ["gpus"],
    "properties": {"gpus": _int(0), "dp": _int(1), "tp": _int(1), "pp": _int(1)},
}

# The CRD's cross-field rules (x-kubernetes-validations), by schema location. They are evaluated from these
# strings, by the API server and by tenplex.k8s.cel (cel-python) for `tenplex k8s validate`, the scheduler and the
# test API server; their estimated cost is checked against the API server's limits (tenplex.k8s.cel.estimate).
_RULES: dict[str, tuple[tuple[str, str], ...]] = {
    "spec": (
        ("!has(self.minGpus) || !has(self.maxGpus) || self.minGpus <= self.maxGpus", "minGpus must not exceed maxGpus"),
        ("self.gpus % self.gpusPerPod == 0", "gpus must be a multiple of gpusPerPod"),
        ("self.gpus == 0 || !has(self.minGpus) || self.gpus >= self.minGpus",
         "gpus must be 0 (suspended) or at least minGpus"),
        ("!has(self.maxGpus) || self.gpus <= self.maxGpus", "gpus must not exceed maxGpus"),
    ),
    "spec.policy": (
        ("self.type != 'table' || (has(self.table) && size(self.table) > 0)",
         "a policy of type table needs a non-empty table"),
        ("!has(self.stateMemoryFraction) || self.stateMemoryFraction > 0.0", "stateMemoryFraction must be greater than 0"),
    ),
    "spec.policy.table[]": (
        ("self.dp * self.tp * self.pp == self.gpus", "dp * tp * pp must equal gpus in every table entry"),
    ),
}


def _rules_at(location: str) -> list[dict[str, str]]:
    return [{"rule": rule, "message": message} for rule, message in _RULES[location]]


def _spec_schema() -> dict[str, Any]:
    table_entry = {
        "type": "object",
        "required": ["gpus", "dp", "tp", "pp"],
        "properties": {"gpus": _int(1), "dp": _int(1), "tp": _int(1), "pp": _int(1), "zero": _ZERO},
        "x-kubernetes-validations": _rules_at("spec.policy.table[]"),
    }
    return {
        "type": "object",
        "description": "What to run and on how many GPUs. spec.gpus is the scale subresource's replicas.",
        "required": ["image", "command", "gpus", "layout"],
        "properties": {
            "image": _str("Container image of the workers.", minLength=1),
            "imagePullPolicy": _str(enum=["Always", "IfNotPresent", "Never"]),
            "command": {
                "type": "array",
                "minItems": 1,
                "items": {"type": "string"},
                "description": "Entry point of each worker process (it imports tenplex.worker).",
            },
            "args": {"type": "array", "items": {"type": "string"}},
            "env": {
                "type": "array",
                "description": "Extra environment of the workers (Kubernetes EnvVar objects).",
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": _str(minLength=1),
                        "value": _str(),
                        "valueFrom": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                    },
                },
            },
            "gpusPerPod": _int(1, "GPUs (nvidia.com/gpu) and ranks of each worker pod, and the granularity of gpus. "
                                     "Above 1, a pod runs that many ranks of one node under 'tenplex worker "
                                     "launch', each selecting its GPU by LOCAL_RANK.", default=1),
            "standby": {
                "type": "boolean", "default": False,
                "description": "Keep the worker pods between generations, each running a warm standby of the job's "
                               "code (tenplex worker standby): a reconfiguration gives a live pod on a kept node the "
                               "next generation's workers (no pod start, interpreter or imports). The pods hold their "
                               "GPUs between generations; the command must be `python -m MODULE` or `python SCRIPT`.",
            },
            "gpus": _int(0, "Desired total GPU count; 0 suspends the job keeping its state."),
            "minGpus": _int(1, "Fewest GPUs the job may run on (failures below this fail the job)."),
            "maxGpus": _int(1, "Most GPUs the job may be scaled to."),
            "layout": {
                "type": "object",
                "description": "How the training state is laid out: a layout provider and its model description.",
                "required": ["provider"],
                "properties": {
                    "provider": _str("A layout provider registered with the scheduler (entry points "
                                     "'tenplex.layouts', e.g. megatron-gpt, example-gpt), or 'package.module:function' "
                                     "naming one the scheduler can import.",
                                     pattern=f"^(?:{registry.REFERENCE_PATTERN})$", maxLength=253),
                    "model": {
                        "type": "object",
                        "description": "The model as the provider expects it: dimensions (layers, hidden size, ...) and, "
                                       "for megatron-gpt, its conventions (naming, pad_vocab, normalization, ...).",
                        "x-kubernetes-preserve-unknown-fields": True,
                    },
                    "precision": _str("Training precision of parameters and gradients.", enum=list(PRECISIONS), default="fp32"),
                },
            },
            "policy": {
                "type": "object",
                "description": "How a GPU count becomes (dp, tp, pp): a table, or the built-in cost model.",
                "properties": {
                    "type": _str(enum=list(POLICY_TYPES), default="builtin"),
                    "table": {
                        "type": "array",
                        "items": table_entry,
                        "x-kubernetes-list-type": "map",
                        "x-kubernetes-list-map-keys": ["gpus"],
                    },
                    "gpuMemoryBytes": _int(1, "Memory of one GPU for the built-in policy."),
                    "stateMemoryFraction": {
                        "type": "number", "minimum": 0, "maximum": 1, "default": 0.5,
                        "description": "Part of a GPU's memory that model and optimizer state may use.",
                    },
                    "zero": _ZERO,
                    "gpusPerNode": _int(1, "GPUs per node; tensor parallelism stays inside a node."),
                },
                "x-kubernetes-validations": _rules_at("spec.policy"),
            },
            "resources": {
                "type": "object",
                "description": "Worker container resources besides the GPUs (which follow gpusPerPod).",
                "properties": {
                    "limits": {"type": "object", "additionalProperties": _QUANTITY},
                    "requests": {"type": "object", "additionalProperties": _QUANTITY},
                },
            },
            "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
            "tolerations": {
                "type": "array",
                "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
            "training": {
                "type": "object",
                "description": "How long to train and the sample order: the scheduler needs them to lay out the "
                               "state and to resume the data position after a reconfiguration.",
                "required": ["dataset"],
                "properties": {
                    "steps": _int(1, "Total training steps.", default=100),
                    "snapshotEvery": _int(1, "Snapshot the state to the node-local stores every this many steps.",
                                          default=10),
                    "heartbeatTimeoutSeconds": _int(1, "A worker silent this long counts as failed.", default=60),
                    "maxRestarts": _int(0, "Failure recoveries allowed in a row without a newer snapshot; the next "
                                           "failure fails the job.", default=3),
                    "dataset": {
                        "type": "object",
                        "required": ["numSamples", "globalBatchSize"],
                        "properties": {
                            "numSamples": _int(1, "Samples in the dataset (the sample order is a permutation of them)."),
                            "seed": _int(0, "Seed of the sample order.", default=0),
                            "globalBatchSize": _int(1, "Samples per training step over all data-parallel ranks."),
                            "consumedSamples": _int(0, "Samples consumed before the job starts.", default=0),
                        },
                    },
                },
            },
            "storeRoot": _str("Directory of the node-local store as seen by the store daemon.", default=DEFAULT_STORE_ROOT),
            "checkpoint": {
                "type": "object",
                "description": "Optional persistent checkpoints, the fall-back when no replica survives.",
                "required": ["uri"],
                "properties": {
                    "uri": _str("Persistent location, e.g. file:///mnt/ckpt/job or a mounted volume path.", minLength=1),
                    "intervalSteps": _int(1, "Write a persistent checkpoint every this many steps (default: every "
                                             "snapshot)."),
                    "keepLast": _int(1, "Persistent checkpoints kept; older ones are deleted (default 2)."),
                },
            },
            "resumeFrom": {
                "type": "object",
                "description": "Optional: start from a persistent version (a resume after an outage, or a copy of "
                               "a job) instead of step 0, in a layout planned for this job's GPUs.",
                "required": ["uri"],
                "properties": {
                    "uri": _str("The persistent location the version was saved to (a job's checkpoint.uri), "
                                "s3://bucket/prefix or file:///path.", minLength=1),
                    "job": _str("The job the version was saved under (default: this job's name).",
                                pattern=JOB_NAME_PATTERN),
                    "version": _str("A committed persistent version (s<step>-g<generation>) or 'latest' (the "
                                    "default): the newest committed one.",
                                    pattern=r"^(latest|s(0|[1-9][0-9]{0,17})-g(0|[1-9][0-9]{0,8}))$"),
                },
            },
        },
        "x-kubernetes-validations": _rules_at("spec"),
    }


def _status_schema() -> dict[str, Any]:
    condition = {
        "type": "object",
        "required": ["type", "status"],
        "properties": {
            "type": _str(),
            "status": _str(enum=["True", "False", "Unknown"]),
            "observedGeneration": _int(0),
            "lastTransitionTime": _str(format="date-time"),
            "reason": _str(),
            "message": _str(),
        },
    }
    reconfiguration = {
        "type": "object",
        "properties": {
            "reason": _str("scale, suspend, resume, failure, node-drain or redeploy"),
            "from": _SIDE,
            "to": _SIDE,
            "downtimeSeconds": {"type": "number", "minimum": 0},
            "bytesLocal": _int(0),
            "bytesRemote": _int(0),
            "stepsLost": _int(0),
            "finishedAt": _str(format="date-time"),
        },
    }
    return {
        "type": "object",
        "properties": {
            "phase": _str(enum=[p.value for p in Phase]),
            "gpus": _int(0, "GPUs the job runs on now."),
            "parallel": _PARALLEL,
            "step": _int(0, "Last completed training step."),
            "version": _str("Newest committed state version, s<step>-g<generation>."),
            "selector": _str("Label selector of the worker pods (for the scale subresource)."),
            "conditions": {
                "type": "array",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            "lastReconfiguration": reconfiguration,
            "observedGeneration": _int(0),
        },
    }


def openapi_schema() -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ElasticJob (a fresh copy each call)."""
    return {
        "type": "object",
        "description": "A training job whose GPU count can change while it runs.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _spec_schema(),
            "status": _status_schema(),
        },
    }


PRINTER_COLUMNS: tuple[dict[str, Any], ...] = (
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "GPUs", "type": "integer", "jsonPath": ".status.gpus", "description": "GPUs in use"},
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.gpus", "priority": 1},
    {"name": "DP", "type": "integer", "jsonPath": ".status.parallel.dp"},
    {"name": "TP", "type": "integer", "jsonPath": ".status.parallel.tp"},
    {"name": "PP", "type": "integer", "jsonPath": ".status.parallel.pp"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
    {"name": "Version", "type": "string", "jsonPath": ".status.version", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition ``elasticjobs.tenplex.io`` (apiextensions.k8s.io/v1)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "tenplex"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "plural": PLURAL,
                "singular": SINGULAR,
                "kind": KIND,
                "listKind": f"{KIND}List",
                "shortNames": list(SHORT_NAMES),
                "categories": ["tenplex"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.gpus",
                            "statusReplicasPath": ".status.gpus",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [dict(c) for c in PRINTER_COLUMNS],
                }
            ],
        },
    }


def crd_yaml() -> str:
    import yaml

    header = (
        "# Generated from tenplex/k8s/crd.py by `tenplex k8s crd`; do not edit by hand.\n"
        "# Helm installs files in crds/ before the templates and never upgrades or deletes them.\n"
    )
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=120)


# --------------------------------------------------------------------------- validation


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """Fill in schema defaults the way the API server does before validation (returns a copy)."""
    value = copy.deepcopy(value)
    _default_into(schema, value)
    return value


def _default_into(schema: Mapping[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _default_into(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _default_into(schema["items"], item)


def _strict(schema: Mapping[str, Any]) -> dict[str, Any]:
    """Copy of a structural schema where unknown fields are errors (kubectl's default Strict field validation)."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
        if not out.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in out:
            out["additionalProperties"] = False
    if isinstance(out.get("items"), Mapping):
        out["items"] = _strict(out["items"])
    if isinstance(out.get("additionalProperties"), Mapping):
        out["additionalProperties"] = _strict(out["additionalProperties"])
    return out


def _metadata_free(schema: dict[str, Any]) -> dict[str, Any]:
    schema["properties"]["metadata"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return schema


def rule_failures(obj: Mapping[str, Any]) -> list[cel.Failure]:
    """The CRD's CEL rules that ``obj`` (schema-valid, defaults applied) breaks, evaluated from the schema's strings."""
    return cel.evaluate(openapi_schema(), obj)


def _explained(failure: cel.Failure) -> str:
    """A failure with the values its rule reads, for people (the API server says only the message)."""
    target = failure.value if isinstance(failure.value, Mapping) else {}
    fields = dict.fromkeys(re.findall(r"self\.(\w+)", failure.rule))
    got = ", ".join(f"{f}={target[f]!r}" for f in fields if f in target)
    return f"{failure} (got {got}; rule {failure.rule!r})"


def elasticjob_errors(obj: Mapping[str, Any], *, defaults: bool = True) -> list[str]:
    """Every way ``obj`` violates the ElasticJob schema and its CEL rules ([] when valid).

    Unknown fields count as errors, as with kubectl's default strict field
    validation. With ``defaults`` the schema defaults are applied first, as the
    API server does.
    """
    import jsonschema

    schema = openapi_schema()
    if defaults:
        obj = apply_defaults(schema, obj)
    errors: list[str] = []
    if obj.get("apiVersion") not in (None, API_VERSION):
        errors.append(f"apiVersion: expected {API_VERSION!r}, got {obj.get('apiVersion')!r}")
    if obj.get("kind") not in (None, KIND):
        errors.append(f"kind: expected {KIND!r}, got {obj.get('kind')!r}")
    validator = jsonschema.Draft7Validator(_strict(_metadata_free(schema)))
    for err in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        where = ".".join(str(p) for p in err.absolute_path) or "<root>"
        errors.append(f"{where}: {err.message}")
    if not errors:
        errors.extend(_explained(f) for f in rule_failures(obj))
    return errors


def validate_elasticjob(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``obj`` with defaults applied, or raise :class:`InvalidInput` listing every error."""
    errors = elasticjob_errors(obj)
    if errors:
        name = obj.get("metadata", {}).get("name", "<unnamed>") if isinstance(obj.get("metadata"), Mapping) else "<unnamed>"
        raise InvalidInput(f"ElasticJob {name} is invalid: " + "; ".join(errors))
    return apply_defaults(openapi_schema(), obj)


# --------------------------------------------------------------------------- typed views


@dataclass(frozen=True, slots=True)
class TableEntry:
    gpus: int
    dp: int
    tp: int
    pp: int
    zero: int = 0


@dataclass(frozen=True, slots=True)
class PolicySpec:
    type: str = "builtin"
    table: tuple[TableEntry, ...] = ()
    gpu_memory_bytes: int | None = None
    state_memory_fraction: float = 0.5
    zero: int = 0
    gpus_per_node: int | None = None

    def lookup(self, gpus: int) -> TableEntry | None:
        """The table entry for ``gpus`` GPUs, if the table has one."""
        return next((e for e in self.table if e.gpus == gpus), None)


@dataclass(frozen=True, slots=True)
class TrainingSpec:
    """``spec.training``: the run length and the sample order."""

    num_samples: int
    global_batch_size: int
    seed: int = 0
    consumed_samples: int = 0
    steps: int = 100
    snapshot_every: int = 10
    heartbeat_timeout_seconds: int = 60
    max_restarts: int = 3


@dataclass(frozen=True, slots=True)
class ElasticJobSpec:
    """A validated ElasticJob spec, with the schema defaults applied."""

    image: str
    command: tuple[str, ...]
    gpus: int
    layout_provider: str
    model: Mapping[str, Any]
    precision: str = "fp32"
    gpus_per_pod: int = 1
    standby: bool = False
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    min_gpus: int | None = None
    max_gpus: int | None = None
    policy: PolicySpec = field(default_factory=PolicySpec)
    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    image_pull_policy: str | None = None
    store_root: str = DEFAULT_STORE_ROOT
    checkpoint_uri: str | None = None
    checkpoint_interval_steps: int | None = None
    checkpoint_keep_last: int | None = None
    resume_from: Mapping[str, Any] | None = None
    """``spec.resumeFrom`` as given: uri, job, version."""
    training: TrainingSpec | None = None
    """None when the ElasticJob has no ``spec.training`` (the scheduler then cannot run it)."""

    @property
    def pods(self) -> int:
        """Worker pods needed for the desired GPU count."""
        return self.gpus // self.gpus_per_pod

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> ElasticJobSpec:
        """Parse the spec of a whole ElasticJob object, validating it first."""
        spec = validate_elasticjob(obj)["spec"]
        policy = spec.get("policy", {})
        checkpoint = spec.get("checkpoint", {})
        training = spec.get("training")
        return cls(
            image=spec["image"],
            command=tuple(spec["command"]),
            gpus=spec["gpus"],
            layout_provider=spec["layout"]["provider"],
            model=copy.deepcopy(spec["layout"].get("model", {})),
            precision=spec["layout"]["precision"],
            gpus_per_pod=spec["gpusPerPod"],
            standby=bool(spec.get("standby", False)),
            args=tuple(spec.get("args", ())),
            env=tuple(spec.get("env", ())),
            min_gpus=spec.get("minGpus"),
            max_gpus=spec.get("maxGpus"),
            policy=PolicySpec(
                type=policy.get("type", "builtin"),
                table=tuple(TableEntry(**e) for e in policy.get("table", ())),
                gpu_memory_bytes=policy.get("gpuMemoryBytes"),
                state_memory_fraction=float(policy.get("stateMemoryFraction", 0.5)),
                zero=policy.get("zero", 0),
                gpus_per_node=policy.get("gpusPerNode"),
            ),
            resources=copy.deepcopy(spec.get("resources", {})),
            node_selector=dict(spec.get("nodeSelector", {})),
            tolerations=tuple(spec.get("tolerations", ())),
            image_pull_policy=spec.get("imagePullPolicy"),
            store_root=spec["storeRoot"],
            checkpoint_uri=checkpoint.get("uri"),
            checkpoint_interval_steps=checkpoint.get("intervalSteps"),
            checkpoint_keep_last=checkpoint.get("keepLast"),
            resume_from=dict(spec["resumeFrom"]) if spec.get("resumeFrom") is not None else None,
            training=TrainingSpec(
                num_samples=training["dataset"]["numSamples"],
                global_batch_size=training["dataset"]["globalBatchSize"],
                seed=training["dataset"]["seed"],
                consumed_samples=training["dataset"]["consumedSamples"],
                steps=training["steps"],
                snapshot_every=training["snapshotEvery"],
                heartbeat_timeout_seconds=training["heartbeatTimeoutSeconds"],
                max_restarts=training["maxRestarts"],
            ) if training is not None else None,
        )


@dataclass(frozen=True, slots=True)
class Parallel:
    dp: int
    tp: int
    pp: int

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def to_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp}


@dataclass(frozen=True, slots=True)
class Condition:
    """A standard Kubernetes condition (metav1.Condition)."""

    type: str
    status: str
    reason: str = ""
    message: str = ""
    observed_generation: int | None = None
    last_transition_time: str = ""

    def __post_init__(self) -> None:
        if self.status not in ("True", "False", "Unknown"):
            raise InvalidInput(f"condition {self.type}: status must be True, False or Unknown, got {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "status": self.status}
        if self.observed_generation is not None:
            out["observedGeneration"] = self.observed_generation
        out["lastTransitionTime"] = self.last_transition_time or now_rfc3339()
        if self.reason:
            out["reason"] = self.reason
        if self.message:
            out["message"] = self.message
        return out


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(conditions: Sequence[Mapping[str, Any]], new: Condition) -> list[dict[str, Any]]:
    """Conditions with ``new`` put in place of the one of its type.

    As with ``meta.SetStatusCondition`` in Go: ``lastTransitionTime`` changes only
    when the status flips, so watchers can tell how long a condition has held.
    """
    out: list[dict[str, Any]] = []
    replaced = False
    for cond in conditions:
        if cond.get("type") != new.type:
            out.append(dict(cond))
            continue
        replaced = True
        entry = new.to_dict()
        if cond.get("status") == new.status and cond.get("lastTransitionTime"):
            entry["lastTransitionTime"] = cond["lastTransitionTime"]
        out.append(entry)
    if not replaced:
        out.append(new.to_dict())
    return out


@dataclass(frozen=True, slots=True)
class Reconfiguration:
    reason: str
    from_gpus: int
    to_gpus: int
    from_parallel: Parallel | None
    to_parallel: Parallel | None
    downtime_seconds: float
    bytes_local: int
    bytes_remote: int
    steps_lost: int
    finished_at: str

    def to_dict(self) -> dict[str, Any]:
        def side(p: Parallel | None, gpus: int) -> dict[str, int]:
            # A job that starts from nothing has no "from" configuration, only 0 GPUs.
            return {"gpus": gpus, **(p.to_dict() if p else {})}

        return {
            "reason": self.reason,
            "from": side(self.from_parallel, self.from_gpus),
            "to": side(self.to_parallel, self.to_gpus),
            "downtimeSeconds": self.downtime_seconds,
            "bytesLocal": self.bytes_local,
            "bytesRemote": self.bytes_remote,
            "stepsLost": self.steps_lost,
            "finishedAt": self.finished_at,
        }


@dataclass(frozen=True, slots=True)
class ElasticJobStatus:
    """The status the scheduler writes through the ``status`` subresource."""

    phase: Phase
    gpus: int = 0
    parallel: Parallel | None = None
    step: int | None = None
    version: str | None = None
    selector: str = ""
    conditions: tuple[Mapping[str, Any], ...] = ()
    last_reconfiguration: Reconfiguration | None = None
    observed_generation: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"phase": self.phase.value, "gpus": self.gpus}
        if self.parallel is not None:
            out["parallel"] = self.parallel.to_dict()
        if self.step is not None:
            out["step"] = self.step
        if self.version is not None:
            out["version"] = self.version
        if self.selector:
            out["selector"] = self.selector
        if self.conditions:
            out["conditions"] = [dict(c) for c in self.conditions]
        if self.last_reconfiguration is not None:
            out["lastReconfiguration"] = self.last_reconfiguration.to_dict()
        if self.observed_generation is not None:
            out["observedGeneration"] = self.observed_generation
        return out

    @classmethod
    def from_dict(cls, status: Mapping[str, Any] | None) -> ElasticJobStatus:
        """Read a stored status back (e.g. after a scheduler restart); an empty one is Pending."""
        status = status or {}
        try:
            phase = Phase(status.get("phase", Phase.PENDING.value))
        except ValueError as exc:
            raise InvalidInput(f"status.phase {status.get('phase')!r} is not one of {[p.value for p in Phase]}") from exc
        par = status.get("parallel")
        last = status.get("lastReconfiguration")
        reconf = None
        if last:
            src, dst = last.get("from", {}), last.get("to", {})
            reconf = Reconfiguration(
                reason=last.get("reason", ""),
                from_gpus=src.get("gpus", 0),
                to_gpus=dst.get("gpus", 0),
                from_parallel=Parallel(src["dp"], src["tp"], src["pp"]) if "dp" in src else None,
                to_parallel=Parallel(dst["dp"], dst["tp"], dst["pp"]) if "dp" in dst else None,
                downtime_seconds=float(last.get("downtimeSeconds", 0.0)),
                bytes_local=last.get("bytesLocal", 0),
                bytes_remote=last.get("bytesRemote", 0),
                steps_lost=last.get("stepsLost", 0),
                finished_at=last.get("finishedAt", ""),
            )
        return cls(
            phase=phase,
            gpus=status.get("gpus", 0),
            parallel=Parallel(par["dp"], par["tp"], par["pp"]) if par else None,
            step=status.get("step"),
            version=status.get("version"),
            selector=status.get("selector", ""),
            conditions=tuple(status.get("conditions", ())),
            last_reconfiguration=reconf,
            observed_generation=status.get("observedGeneration"),
        )


# --------------------------------------------------------------------------- pod contracts


def job_labels(job: str, role: str = ROLE_WORKER) -> dict[str, str]:
    """The labels of a job's pods; ``role`` is worker, store or scheduler."""
    if role not in (ROLE_WORKER, ROLE_STORE, ROLE_SCHEDULER):
        raise InvalidInput(f"role must be {ROLE_WORKER}, {ROLE_STORE} or {ROLE_SCHEDULER}, got {role!r}")
    return {LABEL_JOB: job, LABEL_ROLE: role}


def worker_selector(job: str) -> str:
    """``status.selector`` of a job: the label selector of its worker pods."""
    return f"{LABEL_JOB}={job},{LABEL_ROLE}={ROLE_WORKER}"


def store_env(port: int = STORE_PORT) -> list[dict[str, Any]]:
    """Environment entries that give a worker pod its node's store address via the downward API.

    ``$(TENPLEX_NODE_IP)`` is expanded by the kubelet because the variable is
    defined earlier in the same list.
    """
    if not 0 < port < 65536:
        raise InvalidInput(f"store port must be in 1..65535, got {port}")
    return [
        {"name": ENV_NODE_IP, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.hostIP"}}},
        {"name": ENV_STORE_URL, "value": f"http://$({ENV_NODE_IP}):{port}"},
    ]


def owner_reference(job: Mapping[str, Any]) -> dict[str, Any]:
    """An ownerReference to an ElasticJob object, so deleting the job deletes its pods."""
    meta = job.get("metadata", {})
    if not meta.get("name") or not meta.get("uid"):
        raise InvalidInput(f"an owner reference needs metadata.name and metadata.uid, got {dict(meta)}")
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
