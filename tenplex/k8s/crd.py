"""The ElasticJob custom resource: its CRD as Python data, and typed views of spec and status.

This module is the single source of truth for the resource. Its spec is the
pydantic model :class:`tenplex.scheduler.jobspec.ElasticJobSpec` (which
shares its parts with the REST API's job body), its schema and CEL rules
generated from that model. The chart's ``crds/elasticjobs.tenplex.io.yaml``
is generated from :func:`crd_manifest` (``tenplex k8s crd >
deploy/helm/tenplex/crds/elasticjobs.tenplex.io.yaml``; a test keeps them
equal). The API server enforces the schema and the CEL rules on every write;
offline (``tenplex k8s validate``), :func:`elasticjob_errors` checks the same
schema and the models' twins of the rules, which say the same messages. The
scheduler's Kubernetes backend reads spec through :func:`parse_spec` and
writes status through :class:`ElasticJobStatus`.

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
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tenplex.core.protocol import ENV_NODE_IP
from tenplex.errors import InvalidInput
from tenplex.scheduler.jobspec import CRD, RULE_ERROR, ElasticJobSpec, structural_schema
from tenplex.scheduler.jobspec import DEFAULT_STORE_ROOT as DEFAULT_STORE_ROOT

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
ENV_STORE_URL = "TENPLEX_STORE_URL"
ENV_TOKEN = "TENPLEX_TOKEN"
GPU_RESOURCE = "nvidia.com/gpu"
LEADER_LEASE = "tenplex-scheduler"


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


_PARALLEL = {
    "type": "object",
    "description": "Data-, tensor- and pipeline-parallel degrees; their product is the GPU count.",
    "required": ["dp", "tp", "pp"],
    "properties": {"dp": _int(1), "tp": _int(1), "pp": _int(1)},
}

_SIDE = {
    "type": "object",
    "description": "A configuration before or after a reconfiguration; dp/tp/pp absent when nothing ran.",
    "required": ["gpus"],
    "properties": {"gpus": _int(0), "dp": _int(1), "tp": _int(1), "pp": _int(1)},
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
            "reason": _str("scale, suspend, resume, failure, node-drain, redeploy or spec"),
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
    return copy.deepcopy(_openapi_schema())


@functools.cache
def _openapi_schema() -> dict[str, Any]:
    # Built once: pydantic's JSON schema generation is the dearest part of validating an object.
    return {
        "type": "object",
        "description": "A training job whose GPU count can change while it runs.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": structural_schema(ElasticJobSpec),
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


def _where(loc: Sequence[int | str]) -> str:
    """A pydantic error location below spec as a field path, ``spec.policy.table[0]`` style."""
    return "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)


def _camel(loc: Sequence[int | str]) -> list[int | str]:
    return [p if isinstance(p, int) else re.sub(r"_(\w)", lambda m: m[1].upper(), p) for p in loc]


def rule_errors(spec: Mapping[str, Any]) -> list[str]:
    """The CRD's cross-field rules that ``spec`` (schema-valid, defaults applied) breaks, worded as the API server
    words them, ``<path>: Invalid value: "object": <message>``, with the values the rule reads (for people)."""
    from pydantic import ValidationError

    try:
        ElasticJobSpec.model_validate(spec, context=CRD)
    except ValidationError as exc:
        out = []
        for err in exc.errors():
            where = _where(_camel(err["loc"]))
            if err["type"] != RULE_ERROR:
                out.append(f"{where}: {err['msg']}")
                continue
            rule, value = err["ctx"]["rule"], err["input"]
            fields = dict.fromkeys(re.findall(r"self\.(\w+)", rule))
            got = ", ".join(f"{f}={value[f]!r}" for f in fields if f in value)
            out.append(f'{where}: Invalid value: "object": {err["msg"]} (got {got}; rule {rule!r})')
        return out
    return []


def elasticjob_errors(obj: Mapping[str, Any], *, defaults: bool = True) -> list[str]:
    """Every way ``obj`` violates the ElasticJob schema and its cross-field rules ([] when valid).

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
        errors.extend(rule_errors(obj["spec"]))
    return errors


def validate_elasticjob(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``obj`` with defaults applied, or raise :class:`InvalidInput` listing every error."""
    errors = elasticjob_errors(obj)
    if errors:
        name = obj.get("metadata", {}).get("name", "<unnamed>") if isinstance(obj.get("metadata"), Mapping) else "<unnamed>"
        raise InvalidInput(f"ElasticJob {name} is invalid: " + "; ".join(errors))
    return apply_defaults(openapi_schema(), obj)


# --------------------------------------------------------------------------- typed views


def parse_spec(obj: Mapping[str, Any]) -> ElasticJobSpec:
    """The spec of a whole ElasticJob object, validated first (schema and CEL rules; defaults applied)."""
    return ElasticJobSpec.model_validate(validate_elasticjob(obj)["spec"], context=CRD)


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
