"""The API server emulator's vocabulary: resource types, Status errors, selectors, patches, timestamps.

Kept apart from the store and the HTTP layer so that each can be read alone;
everything here is pure (no locks, no I/O).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import jsonpatch

# --------------------------------------------------------------------------- resource types


@dataclass(frozen=True, slots=True)
class ScaleMapping:
    """Where the ``scale`` subresource reads and writes in the object (JSON paths without the dot)."""

    spec_replicas: tuple[str, ...]
    status_replicas: tuple[str, ...]
    label_selector: tuple[str, ...]


COMMON_FIELDS: dict[str, tuple[str, ...]] = {
    "metadata.name": ("metadata", "name"),
    "metadata.namespace": ("metadata", "namespace"),
}
"""Field selectors every resource supports."""


@dataclass(frozen=True, slots=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    status_subresource: bool = False
    scale: ScaleMapping | None = None
    custom: bool = False
    """Custom resources: strategic merge patches refused, validated by their CRD's structural schema and CEL rules."""
    returns_object_on_delete: bool = False
    graceful: bool = False
    """Deletion waits for a grace period and a confirmation (pods: the kubelet's), as the pod strategy does."""
    fields: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Field selectors beyond ``metadata.name`` and ``metadata.namespace`` (a real server answers 400 for others)."""
    schema: Mapping[str, Any] | None = None
    """A custom resource's openAPIV3Schema (from its CRD)."""
    short_names: tuple[str, ...] = ()
    printer_columns: tuple[Mapping[str, Any], ...] = ()
    """additionalPrinterColumns; with them, ``Accept: ...;as=Table`` gets a server-side Table as from the real server."""
    categories: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        """``plural`` for the core group, ``plural.group`` otherwise (as kubectl spells it)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def field_paths(self) -> dict[str, tuple[str, ...]]:
        return {**COMMON_FIELDS, **self.fields}

    @classmethod
    def from_crd(cls, manifest: Mapping[str, Any]) -> ResourceType:
        """The resource a CustomResourceDefinition serves (its storage version), as the API server serves it."""
        spec = manifest["spec"]
        (version,) = [v for v in spec["versions"] if v.get("storage")]
        subresources = version.get("subresources") or {}
        scale = None
        if "scale" in subresources:
            s = subresources["scale"]

            def path(text: str | None) -> tuple[str, ...]:
                return tuple(p for p in (text or "").split(".") if p)

            scale = ScaleMapping(path(s["specReplicasPath"]), path(s["statusReplicasPath"]),
                                 path(s.get("labelSelectorPath")))
        names = spec["names"]
        return cls(spec["group"], version["name"], names["plural"], names["kind"], spec["scope"] == "Namespaced",
                   status_subresource="status" in subresources, scale=scale, custom=True,
                   returns_object_on_delete=True, schema=version["schema"]["openAPIV3Schema"],
                   short_names=tuple(names.get("shortNames") or ()),
                   printer_columns=tuple(version.get("additionalPrinterColumns") or ()),
                   categories=tuple(names.get("categories") or ()))


# --------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered as a Kubernetes ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.details = dict(details or {})

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.key} "{name}" not found', {"name": name, "group": rt.group, "kind": rt.plural})


def gone(rv: int, oldest: int) -> ApiError:
    return ApiError(410, "Expired", f"too old resource version: {rv} ({oldest})")


def invalid(rt: ResourceType, name: str, errors: list[str]) -> ApiError:
    """422 Invalid as the API server words it: one error inline, several in brackets."""
    text = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
    return ApiError(422, "Invalid", f'{rt.kind}{"." + rt.group if rt.group else ""} "{name}" is invalid: {text}',
                    {"name": name, "group": rt.group, "kind": rt.kind,
                     "causes": [{"reason": "FieldValueInvalid", "message": e, "field": e.split(":", 1)[0]}
                                for e in errors]})


def forbidden(rt: ResourceType, name: str, why: str) -> ApiError:
    return ApiError(403, "Forbidden", f'{rt.plural} "{name}" is forbidden: {why}',
                    {"name": name, "group": rt.group, "kind": rt.plural})


# --------------------------------------------------------------------------- time


def now() -> str:
    """An RFC 3339 timestamp with second resolution, as metav1.Time serializes."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def timestamp(seconds_from_now: float = 0.0) -> str:
    when = datetime.fromtimestamp(datetime.now(UTC).timestamp() + seconds_from_now, UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------- selectors


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        if self.op in ("=", "in"):
            return present and labels[self.key] in self.values
        return not present or labels[self.key] not in self.values  # "!=" and "notin"


_SET_RE = re.compile(r"^([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)$")
_EQ_RE = re.compile(r"^([\w./-]+)\s*(==|=|!=)\s*([\w.-]*)$")


def parse_label_selector(text: str | None) -> tuple[Requirement, ...]:
    """Parse a label selector (``a=b,c!=d,e in (x,y),!f,g``); a bad one is a 400 as on the real server."""
    if not text:
        return ()
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    reqs = []
    for raw in parts:
        part = raw.strip()
        if m := _SET_RE.match(part):
            values = frozenset(v.strip() for v in m.group(3).split(",") if v.strip())
            reqs.append(Requirement(m.group(1), m.group(2), values))
        elif m := _EQ_RE.match(part):
            reqs.append(Requirement(m.group(1), "!=" if m.group(2) == "!=" else "=", frozenset({m.group(3)})))
        elif part.startswith("!") and re.fullmatch(r"[\w./-]+", part[1:]):
            reqs.append(Requirement(part[1:], "!exists"))
        elif re.fullmatch(r"[\w./-]+", part):
            reqs.append(Requirement(part, "exists"))
        else:
            raise ApiError(400, "BadRequest", f"unable to parse requirement {part!r} in label selector {text!r}")
    return tuple(reqs)


FieldRequirement = tuple[tuple[str, ...], bool, str]


def parse_field_selector(rt: ResourceType, text: str | None) -> tuple[FieldRequirement, ...]:
    """Parse a field selector; a field the resource does not index is a 400 as on the real server."""
    if not text:
        return ()
    supported = rt.field_paths()
    out = []
    for raw in text.split(","):
        m = re.fullmatch(r"\s*([\w.\[\]'/-]+)\s*(==|=|!=)\s*(.*?)\s*", raw)
        if not m:
            raise ApiError(400, "BadRequest", f"invalid field selector {raw!r} in {text!r}")
        if m.group(1) not in supported:
            raise ApiError(400, "BadRequest", f'field label not supported: {m.group(1)}')
        out.append((supported[m.group(1)], m.group(2) != "!=", m.group(3)))
    return tuple(out)


def field_value(obj: Mapping[str, Any], path: tuple[str, ...]) -> str:
    cur: Any = obj
    for p in path:
        cur = cur.get(p) if isinstance(cur, Mapping) else None
    if cur is None:
        return "false" if path in (("spec", "unschedulable"), ("spec", "hostNetwork")) else ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


@dataclass(frozen=True, slots=True)
class Filter:
    rt: ResourceType
    namespace: str | None
    labels: tuple[Requirement, ...] = ()
    fields: tuple[FieldRequirement, ...] = ()

    def matches(self, rt: ResourceType, obj: Mapping[str, Any] | None) -> bool:
        if obj is None or rt is not self.rt:
            return False
        meta = obj.get("metadata", {})
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        labels = meta.get("labels") or {}
        if not all(r.matches(labels) for r in self.labels):
            return False
        return all((field_value(obj, path) == value) == equal for path, equal, value in self.fields)


def selector_text(selector: Mapping[str, Any] | None) -> str:
    """A metav1.LabelSelector (matchLabels, matchExpressions) as label-selector text."""
    selector = selector or {}
    parts = [f"{k}={v}" for k, v in (selector.get("matchLabels") or {}).items()]
    for e in selector.get("matchExpressions") or []:
        op, key, values = e.get("operator"), e.get("key"), ",".join(e.get("values") or [])
        parts.append({"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})", "Exists": key,
                      "DoesNotExist": f"!{key}"}[op])
    return ",".join(parts)


# --------------------------------------------------------------------------- patches


MERGE_KEYS = {
    "conditions": "type", "containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
    "volumeMounts": "mountPath", "ports": "containerPort", "ownerReferences": "uid", "taints": "key",
    "addresses": "type", "containerStatuses": "name", "imagePullSecrets": "name", "tolerations": "key",
}
"""The keyed lists of built-in types that a strategic merge patch merges item by item (patchMergeKey)."""
MERGE_PRIMITIVES = {"finalizers"}
"""Lists of strings a strategic merge patch merges as sets (``patchStrategy: merge`` without a key)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (``null`` deletes, lists replace)."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def strategic_merge_patch(target: Any, patch: Any, field_name: str = "") -> Any:
    """A strategic merge patch for built-in types: keyed lists (conditions by type, containers by name, ...)
    merged item by item, ``metadata.finalizers`` merged as a set; other lists replaced, as with a merge patch.

    Directives: an item ``{"<key>": ..., "$patch": "delete"}`` removes that item;
    ``$deleteFromPrimitiveList/<list>`` removes values from a merged list of strings;
    ``$setElementOrder/<list>`` and ``$retainKeys`` are accepted and ignored (order and pruning).
    """
    if isinstance(patch, list) and field_name in MERGE_PRIMITIVES:
        out_list = list(target) if isinstance(target, list) else []
        out_list += [v for v in patch if v not in out_list]
        return out_list
    if isinstance(patch, list) and field_name in MERGE_KEYS and isinstance(target, list):
        key = MERGE_KEYS[field_name]
        out = [copy.deepcopy(t) for t in target]
        for item in patch:
            if not isinstance(item, Mapping) or key not in item:
                raise ApiError(422, "Invalid", f"{field_name}: every item of a strategic merge patch needs {key!r}, got {item!r}")
            idx = next((i for i, t in enumerate(out) if isinstance(t, Mapping) and t.get(key) == item[key]), None)
            if item.get("$patch") == "delete":
                if idx is not None:
                    out.pop(idx)
            elif idx is None:
                out.append({k: v for k, v in item.items() if k != "$patch"})
            else:
                out[idx] = strategic_merge_patch(out[idx], item)
        return out
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out_map = dict(target) if isinstance(target, Mapping) else {}
    deletions: dict[str, list[Any]] = {}
    for k, v in patch.items():
        if k.startswith("$deleteFromPrimitiveList/"):
            deletions[k.split("/", 1)[1]] = list(v or [])
            continue
        if k.startswith("$"):
            continue
        if v is None:
            out_map.pop(k, None)
        else:
            out_map[k] = strategic_merge_patch(out_map.get(k), v, k)
    for name, values in deletions.items():
        if isinstance(out_map.get(name), list):
            kept = [x for x in out_map[name] if x not in values]
            if kept:
                out_map[name] = kept
            else:
                out_map.pop(name)
    return out_map


def apply_patch(rt: ResourceType, current: dict[str, Any], body: Any, content_type: str) -> dict[str, Any]:
    ctype = content_type.split(";")[0].strip().lower()
    if ctype == "application/json-patch+json":
        if not isinstance(body, list):
            raise ApiError(400, "BadRequest", f"a JSON patch must be a list of operations, got {type(body).__name__}")
        try:
            return jsonpatch.apply_patch(current, body)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise ApiError(422, "Invalid", f"the JSON patch {body!r} cannot be applied: {exc}") from exc
    if not isinstance(body, Mapping):
        raise ApiError(400, "BadRequest", f"a {ctype} body must be a JSON object, got {type(body).__name__}")
    if ctype == "application/merge-patch+json":
        return merge_patch(current, body)
    if ctype == "application/strategic-merge-patch+json":
        if rt.custom:
            raise ApiError(415, "UnsupportedMediaType",
                           f"the body of the request was in an unknown format - accepted media types include: "
                           f"application/json-patch+json, application/merge-patch+json (strategic merge patch "
                           f"is not supported for custom resource {rt.key})")
        return strategic_merge_patch(current, body)
    raise ApiError(415, "UnsupportedMediaType", f"patch content type {content_type!r} is not supported by the emulator")


Mutation = Callable[[dict[str, Any]], dict[str, Any]]


def get_path(obj: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    cur: Any = obj
    for p in path:
        cur = cur.get(p) if isinstance(cur, Mapping) else None
    return cur


def owner_refs(obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list((obj.get("metadata") or {}).get("ownerReferences") or [])
