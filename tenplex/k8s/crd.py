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
  address at ``STORE_PORT`` (hostPort); a worker pod learns its node's address
  through the downward API (``TENPLEX_NODE_IP`` is ``status.hostIP``).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.alias_generators import to_camel
from pydantic.dataclasses import dataclass

from tenplex.core.protocol import ENV_NODE_IP as ENV_NODE_IP
from tenplex.errors import InvalidInput
from tenplex.scheduler.jobspec import CRD, RULE_ERROR, ElasticJobSpec, structural_schema
from tenplex.scheduler.jobspec import DEFAULT_STORE_ROOT as DEFAULT_STORE_ROOT
from tenplex.scheduler.state import Phase as Phase

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
ENV_TOKEN = "TENPLEX_TOKEN"
GPU_RESOURCE = "nvidia.com/gpu"
LEADER_LEASE = "tenplex-scheduler"


# --------------------------------------------------------------------------- schema


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
            "status": structural_schema(ElasticJobStatus),
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


_STATUS_CONFIG = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True)
"""The status's camelCase names are its fields' aliases; Python code names the fields."""


def _no_default(schema: dict[str, Any]) -> None:
    """A default of the Python class that the CRD does not declare (the API server would write it into objects)."""
    schema.pop("default", None)


def _map_by_type(schema: dict[str, Any]) -> None:
    """A list of conditions is a map by their type (a patch merges conditions of the same type)."""
    _no_default(schema)
    schema.update({"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})


@dataclass(frozen=True, config=_STATUS_CONFIG)
class Parallel:
    """Data-, tensor- and pipeline-parallel degrees; their product is the GPU count."""

    dp: int = Field(ge=1)
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(frozen=True, config=_STATUS_CONFIG)
class Side:
    """A configuration before or after a reconfiguration; dp/tp/pp absent when nothing ran."""

    gpus: int = Field(ge=0)
    dp: int | None = Field(None, ge=1)
    tp: int | None = Field(None, ge=1)
    pp: int | None = Field(None, ge=1)

    @classmethod
    def of(cls, gpus: int, parallel: Parallel | None) -> Side:
        return cls(gpus, parallel.dp, parallel.tp, parallel.pp) if parallel else cls(gpus)


@dataclass(frozen=True, config=_STATUS_CONFIG)
class Condition:
    """A standard Kubernetes condition (metav1.Condition)."""

    type: str
    status: str = Field(json_schema_extra={"enum": ["True", "False", "Unknown"]})
    reason: str | None = None
    message: str | None = None
    observed_generation: int | None = Field(None, ge=0)
    last_transition_time: str = Field(default_factory=lambda: now_rfc3339(),  # a new condition's: now
                                      json_schema_extra={"format": "date-time"})

    def __post_init__(self) -> None:
        if self.status not in ("True", "False", "Unknown"):
            raise InvalidInput(f"condition {self.type}: status must be True, False or Unknown, got {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        return _dump(self)


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


@dataclass(frozen=True, config=_STATUS_CONFIG)
class Reconfiguration:
    """The latest reconfiguration that finished."""

    reason: str = Field(description="scale, suspend, resume, failure, node-drain, redeploy or spec")
    from_: Side = Field(alias="from")
    to: Side = Field()
    downtime_seconds: float = Field(ge=0)
    bytes_local: int = Field(ge=0)
    bytes_remote: int = Field(ge=0)
    steps_lost: int = Field(ge=0)
    finished_at: str = Field(json_schema_extra={"format": "date-time"})


@dataclass(frozen=True, config=_STATUS_CONFIG)
class ElasticJobStatus:
    """The status the scheduler writes through the status subresource."""

    phase: Phase = Field(Phase.PENDING, json_schema_extra=_no_default)
    gpus: int = Field(0, ge=0, description="GPUs the job runs on now.", json_schema_extra=_no_default)
    parallel: Parallel | None = None
    step: int | None = Field(None, ge=0, description="Last completed training step.")
    version: str | None = Field(None, description="Newest committed state version, s<step>-g<generation>.")
    selector: str | None = Field(None, description="Label selector of the worker pods (for the scale subresource).")
    conditions: tuple[Condition, ...] = Field((), json_schema_extra=_map_by_type)
    last_reconfiguration: Reconfiguration | None = None
    observed_generation: int | None = Field(None, ge=0)

    def to_dict(self) -> dict[str, Any]:
        return _dump(self)


def _dump(value: Any) -> dict[str, Any]:
    return TypeAdapter(type(value)).dump_python(value, mode="json", by_alias=True, exclude_none=True)


# --------------------------------------------------------------------------- pod contracts


def job_labels(job: str) -> dict[str, str]:
    """The labels of a job's worker pods."""
    return {LABEL_JOB: job, LABEL_ROLE: ROLE_WORKER}


def worker_selector(job: str) -> str:
    """``status.selector`` of a job: the label selector of its worker pods."""
    return f"{LABEL_JOB}={job},{LABEL_ROLE}={ROLE_WORKER}"


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
