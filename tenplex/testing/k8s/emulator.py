"""An in-process Kubernetes API server emulator for tests, spoken to over real HTTP.

No kube-apiserver can be obtained on the machines this project is built on
(see the shared notes), and ``kmock`` 0.8 lacks what the scheduler's
Kubernetes backend relies on: resourceVersion semantics, resuming and expiring
watches, label and field selectors, the scale and status subresources with
their write rules, optimistic concurrency on update. This module emulates
exactly that part of the API, as the real server behaves:

* resources: pods (with ``status``, ``binding`` and ``eviction``, which honours
  PodDisruptionBudgets), nodes, namespaces, services, configmaps, secrets, events,
  leases (``coordination.k8s.io``), poddisruptionbudgets (``policy/v1``) and the
  ``ElasticJob`` custom resource with its ``status`` and ``scale`` subresources;
* create (``generateName`` too), get, list, replace (PUT), patch
  (JSON merge patch, JSON patch, and a strategic merge patch for built-in
  resources that merges the common keyed lists), delete (finalizers,
  ``ownerReferences`` cascading like the garbage collector), delete collection;
* every write bumps one cluster-wide ``resourceVersion``; ``uid``,
  ``creationTimestamp`` and ``generation`` (bumped on spec changes only) are set;
  a PUT or patch carrying a stale ``resourceVersion`` is a 409 Conflict;
* writes to the main resource ignore ``status``; writes to ``/status`` touch
  only ``status``; ``/scale`` maps ``spec.replicas`` to ``spec.gpus``;
* ElasticJobs are validated against the CRD schema and its CEL rules
  (422 Invalid, as the API server answers);
* list and watch honour ``labelSelector`` (equality and set-based),
  ``fieldSelector`` (``metadata.name``, ``metadata.namespace``, ``spec.nodeName``,
  ``status.phase``) and ``timeoutSeconds``; a watch from a ``resourceVersion``
  replays what happened after it, or answers 410 Gone once the history was
  compacted; an object that stops matching a selector is sent as DELETED.

Test hooks (thread-safe, callable from the test thread) change the world the
way kubelets, node controllers and operators do: :meth:`add_node`,
:meth:`set_node_ready`, :meth:`cordon_node`, :meth:`drain_node` (evicts regardless of budgets),
:meth:`evict_node_pods` (one budget-respecting pass of ``kubectl drain``),
:meth:`set_pod_running`, :meth:`fail_pod`, :meth:`set_pod_succeeded`, and
:meth:`expire_watches` / :meth:`compact` to force 410 Gone.

Not emulated: authentication and RBAC, admission, server-side apply and
dry runs (both answered with a clear 4xx), protobuf (415, so clients fall back to JSON),
pagination (``limit`` returns everything), controllers (nothing schedules or
runs pods unless a test does), graceful pod termination (pods are deleted at
once). Namespaces need not exist before objects are created in them.

Usage::

    with ApiServerEmulator() as api:
        core = kubernetes.client.CoreV1Api(api.api_client())
        core.create_namespaced_pod("default", {...})
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import logging
import re
import secrets
import socket
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import jsonpatch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from tenplex.k8s import crd

LOG = logging.getLogger(__name__)

HISTORY_LIMIT = 20_000
"""Watch events kept for resuming; older resourceVersions answer 410 Gone."""

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


# --------------------------------------------------------------------------- resource types


@dataclass(frozen=True, slots=True)
class ScaleMapping:
    """Where the ``scale`` subresource reads and writes in the object (JSON paths without the dot)."""

    spec_replicas: tuple[str, ...]
    status_replicas: tuple[str, ...]
    label_selector: tuple[str, ...]


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
    """Custom resources reject strategic merge patches, as the real server does."""
    returns_object_on_delete: bool = False
    validate: Callable[[Mapping[str, Any]], list[str]] | None = None
    defaults: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    short_names: tuple[str, ...] = ()
    printer_columns: tuple[Mapping[str, Any], ...] = ()
    """additionalPrinterColumns; with them, ``Accept: ...;as=Table`` gets a server-side Table as from the real server."""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        """``plural`` for the core group, ``plural.group`` otherwise (as kubectl spells it)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


def _elasticjob_defaults(obj: dict[str, Any]) -> dict[str, Any]:
    return crd.apply_defaults(crd.openapi_schema(), obj)


def _pod_errors(pod: Mapping[str, Any]) -> list[str]:
    containers = (pod.get("spec") or {}).get("containers")
    if not isinstance(containers, list) or not containers:
        return ["spec.containers: Required value"]
    errors = []
    for i, c in enumerate(containers):
        if not isinstance(c, Mapping) or not c.get("name"):
            errors.append(f"spec.containers[{i}].name: Required value")
        elif not c.get("image"):
            errors.append(f"spec.containers[{i}].image: Required value")
    return errors


def default_resources() -> tuple[ResourceType, ...]:
    ej_scale = ScaleMapping(("spec", "gpus"), ("status", "gpus"), ("status", "selector"))
    return (
        ResourceType("", "v1", "pods", "Pod", True, status_subresource=True, returns_object_on_delete=True,
                     validate=_pod_errors, short_names=("po",)),
        ResourceType("", "v1", "nodes", "Node", False, status_subresource=True, short_names=("no",)),
        ResourceType("", "v1", "namespaces", "Namespace", False, status_subresource=True, short_names=("ns",)),
        ResourceType("", "v1", "services", "Service", True, status_subresource=True, short_names=("svc",)),
        ResourceType("", "v1", "configmaps", "ConfigMap", True, short_names=("cm",)),
        ResourceType("", "v1", "secrets", "Secret", True),
        ResourceType("", "v1", "events", "Event", True, short_names=("ev",)),
        ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True),
        ResourceType("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, status_subresource=True,
                     short_names=("pdb",)),
        ResourceType(crd.GROUP, crd.VERSION, crd.PLURAL, crd.KIND, True, status_subresource=True, scale=ej_scale,
                     custom=True, returns_object_on_delete=True, validate=crd.elasticjob_errors,
                     defaults=_elasticjob_defaults, short_names=crd.SHORT_NAMES,
                     printer_columns=crd.PRINTER_COLUMNS),
    )


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


def _not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.key} "{name}" not found', {"name": name, "group": rt.group, "kind": rt.plural})


def _gone(rv: int, oldest: int) -> ApiError:
    return ApiError(410, "Expired", f"too old resource version: {rv} ({oldest})")


# --------------------------------------------------------------------------- selectors


@dataclass(frozen=True, slots=True)
class _Requirement:
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


def parse_label_selector(text: str | None) -> tuple[_Requirement, ...]:
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
            reqs.append(_Requirement(m.group(1), m.group(2), values))
        elif m := _EQ_RE.match(part):
            reqs.append(_Requirement(m.group(1), "!=" if m.group(2) == "!=" else "=", frozenset({m.group(3)})))
        elif part.startswith("!") and re.fullmatch(r"[\w./-]+", part[1:]):
            reqs.append(_Requirement(part[1:], "!exists"))
        elif re.fullmatch(r"[\w./-]+", part):
            reqs.append(_Requirement(part, "exists"))
        else:
            raise ApiError(400, "BadRequest", f"unable to parse requirement {part!r} in label selector {text!r}")
    return tuple(reqs)


_FIELDS: dict[str, tuple[str, ...]] = {
    "metadata.name": ("metadata", "name"),
    "metadata.namespace": ("metadata", "namespace"),
    "spec.nodeName": ("spec", "nodeName"),
    "status.phase": ("status", "phase"),
    "spec.unschedulable": ("spec", "unschedulable"),
}


def parse_field_selector(text: str | None) -> tuple[tuple[tuple[str, ...], bool, str], ...]:
    if not text:
        return ()
    out = []
    for raw in text.split(","):
        m = re.fullmatch(r"\s*([\w.]+)\s*(==|=|!=)\s*(.*?)\s*", raw)
        if not m:
            raise ApiError(400, "BadRequest", f"invalid field selector {raw!r} in {text!r}")
        if m.group(1) not in _FIELDS:
            raise ApiError(400, "BadRequest", f'field label not supported: "{m.group(1)}" (supported: {sorted(_FIELDS)})')
        out.append((_FIELDS[m.group(1)], m.group(2) != "!=", m.group(3)))
    return tuple(out)


def _field_value(obj: Mapping[str, Any], path: tuple[str, ...]) -> str:
    cur: Any = obj
    for p in path:
        cur = cur.get(p) if isinstance(cur, Mapping) else None
    if cur is None:
        return "false" if path == ("spec", "unschedulable") else ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


@dataclass(frozen=True, slots=True)
class _Filter:
    rt: ResourceType
    namespace: str | None
    labels: tuple[_Requirement, ...] = ()
    fields: tuple[tuple[tuple[str, ...], bool, str], ...] = ()

    def matches(self, rt: ResourceType, obj: Mapping[str, Any] | None) -> bool:
        if obj is None or rt is not self.rt:
            return False
        meta = obj.get("metadata", {})
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        labels = meta.get("labels") or {}
        if not all(r.matches(labels) for r in self.labels):
            return False
        return all((_field_value(obj, path) == value) == equal for path, equal, value in self.fields)


# --------------------------------------------------------------------------- patches


_MERGE_KEYS = {
    "conditions": "type", "containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
    "volumeMounts": "mountPath", "ports": "containerPort", "ownerReferences": "uid", "taints": "key",
    "addresses": "type", "containerStatuses": "name", "imagePullSecrets": "name",
}


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
    """A strategic merge patch for the keyed lists of built-in types (conditions by type, containers by name, ...).

    Lists without a known merge key are replaced, as with a merge patch; an
    item ``{"<key>": ..., "$patch": "delete"}`` removes that item.
    """
    if isinstance(patch, list) and field_name in _MERGE_KEYS and isinstance(target, list):
        key = _MERGE_KEYS[field_name]
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
    out = dict(target) if isinstance(target, Mapping) else {}
    for k, v in patch.items():
        if k.startswith("$"):
            continue
        if v is None:
            out.pop(k, None)
        else:
            out[k] = strategic_merge_patch(out.get(k), v, k)
    return out


def _apply_patch(rt: ResourceType, current: dict[str, Any], body: Any, content_type: str) -> dict[str, Any]:
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


# --------------------------------------------------------------------------- store


@dataclass(slots=True)
class _Event:
    rv: int
    rt: ResourceType
    type: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclass(eq=False, slots=True)
class _Watcher:
    filt: _Filter
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)

    def offer(self, item: dict[str, Any] | None) -> None:
        with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _event_for(filt: _Filter, ev: _Event) -> dict[str, Any] | None:
    """The watch event a watcher with ``filt`` sees for ``ev`` (an object leaving the selector is DELETED)."""
    now = filt.matches(ev.rt, ev.obj)
    before = filt.matches(ev.rt, ev.old) if ev.old is not None else False
    if ev.type == "DELETED":
        return {"type": "DELETED", "object": ev.obj} if now or before else None
    if now and (before or ev.type == "ADDED"):
        return {"type": ev.type, "object": ev.obj}
    if now:
        return {"type": "ADDED", "object": ev.obj}
    if before:
        return {"type": "DELETED", "object": ev.obj}
    return None


class _Store:
    """Objects, the resourceVersion counter, the event history and the open watches, under one lock."""

    def __init__(self, resources: Iterable[ResourceType]) -> None:
        self.lock = threading.RLock()
        self.types = tuple(resources)
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.rv = 1  # as on a real cluster, no object is ever at "0" (which means "any" to a watch)
        self.history: deque[_Event] = deque(maxlen=HISTORY_LIMIT)
        self.oldest_rv = 0  # a watch may resume from any rv >= this
        self.watchers: set[_Watcher] = set()

    # -- lookup --------------------------------------------------------------

    def resource(self, group: str, version: str, plural: str) -> ResourceType:
        for rt in self.types:
            if (rt.group, rt.version, rt.plural) == (group, version, plural):
                return rt
        raise ApiError(404, "NotFound", f"the server could not find the requested resource ({group or 'core'}/{version}, {plural})")

    def resource_by_key(self, key: str) -> ResourceType:
        for rt in self.types:
            if key in (rt.key, rt.plural, rt.kind, rt.kind.lower(), *rt.short_names):
                return rt
        raise KeyError(f"unknown resource {key!r}; known: {[rt.key for rt in self.types]}")

    def _key(self, rt: ResourceType, namespace: str | None, name: str) -> tuple[str, str, str]:
        return (rt.key, namespace or "" if rt.namespaced else "", name)

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self.objects.get(self._key(rt, namespace, name))
        if obj is None:
            raise _not_found(rt, name)
        return obj

    def list(self, filt: _Filter) -> list[dict[str, Any]]:
        items = [o for (k, _, _), o in self.objects.items() if k == filt.rt.key and filt.matches(filt.rt, o)]
        return sorted(items, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))

    # -- writes --------------------------------------------------------------

    def _emit(self, rt: ResourceType, type_: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        ev = _Event(self.rv, rt, type_, copy.deepcopy(obj), copy.deepcopy(old) if old is not None else None)
        if len(self.history) == self.history.maxlen:
            self.oldest_rv = self.history[0].rv
        self.history.append(ev)
        for w in list(self.watchers):
            event = _event_for(w.filt, ev)
            if event is not None:
                w.offer(event)

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _check(self, rt: ResourceType, obj: dict[str, Any]) -> None:
        if rt.validate is not None:
            errors = rt.validate(obj)
            if errors:
                name = obj["metadata"]["name"]
                raise ApiError(422, "Invalid", f'{rt.kind}.{rt.group or "core"} "{name}" is invalid: ' + "; ".join(errors),
                               {"name": name, "group": rt.group, "kind": rt.kind,
                                "causes": [{"message": e} for e in errors]})

    def create(self, rt: ResourceType, namespace: str | None, body: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise ApiError(400, "BadRequest", f"the body of a create must be a JSON object, got {type(body).__name__}")
        obj = copy.deepcopy(dict(body))
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", f"{rt.kind}: metadata.name or metadata.generateName is required")
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        name = meta["name"]
        if not _NAME_RE.match(name) or len(name) > 253:
            raise ApiError(422, "Invalid", f'{rt.kind} "{name}" is invalid: metadata.name must be a lowercase RFC 1123 subdomain')
        if rt.namespaced:
            if meta.get("namespace") not in (None, namespace):
                raise ApiError(400, "BadRequest",
                               f"the namespace of the object ({meta['namespace']}) does not match the namespace on the request ({namespace})")
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        if rt.status_subresource:
            obj.pop("status", None)
        if rt.plural == "pods":
            obj["status"] = {"phase": "Pending"}
        if rt.defaults is not None:
            obj = rt.defaults(obj)
            meta = obj["metadata"]
        for k in ("resourceVersion", "deletionTimestamp"):
            meta.pop(k, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        self._check(rt, obj)
        with self.lock:
            key = self._key(rt, namespace, name)
            if key in self.objects:
                raise ApiError(409, "AlreadyExists", f'{rt.key} "{name}" already exists',
                               {"name": name, "group": rt.group, "kind": rt.plural})
            meta["resourceVersion"] = self._next_rv()
            self.objects[key] = obj
            self._emit(rt, "ADDED", obj, None)
            return copy.deepcopy(obj)

    def update(self, rt: ResourceType, namespace: str | None, name: str, mutate: Callable[[dict[str, Any]], dict[str, Any]],
               subresource: str | None, expected_rv: str | None = None) -> dict[str, Any]:
        """Replace an object by ``mutate(copy)``, keeping what that kind of write may not change."""
        with self.lock:
            current = self.get(rt, namespace, name)
            proposed = mutate(copy.deepcopy(current))
            if not isinstance(proposed, dict):
                raise ApiError(400, "BadRequest", f"the result of the write is not an object: {proposed!r}")
            meta = proposed.setdefault("metadata", {})
            rv = expected_rv if expected_rv is not None else meta.get("resourceVersion")
            if rv not in (None, "", current["metadata"]["resourceVersion"]):
                raise ApiError(409, "Conflict",
                               f'Operation cannot be fulfilled on {rt.key} "{name}": the object has been modified; '
                               f"please apply your changes to the latest version and try again "
                               f"(sent resourceVersion {rv}, current {current['metadata']['resourceVersion']})",
                               {"name": name, "group": rt.group, "kind": rt.plural})
            if subresource == "status":
                new = copy.deepcopy(current)
                if "status" in proposed:
                    new["status"] = proposed["status"]
                else:
                    new.pop("status", None)
            else:
                new = proposed
                if rt.status_subresource:
                    if "status" in current:
                        new["status"] = copy.deepcopy(current["status"])
                    else:
                        new.pop("status", None)
            for k in ("uid", "creationTimestamp", "name", "namespace", "generation", "deletionTimestamp"):
                if k in current["metadata"]:
                    new["metadata"][k] = current["metadata"][k]
                else:
                    new["metadata"].pop(k, None)
            new["apiVersion"], new["kind"] = rt.api_version, rt.kind
            if rt.defaults is not None:
                new = rt.defaults(new)
            new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            if new == current:
                return copy.deepcopy(current)  # a no-op write neither bumps resourceVersion nor notifies
            spec_changed = {k: v for k, v in new.items() if k not in ("metadata", "status")} != {
                k: v for k, v in current.items() if k not in ("metadata", "status")}
            if spec_changed:
                new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
            self._check(rt, new)
            new["metadata"]["resourceVersion"] = self._next_rv()
            key = self._key(rt, namespace, name)
            if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
                del self.objects[key]
                self._emit(rt, "DELETED", new, current)
                self._collect_dependents(new["metadata"]["uid"])
            else:
                self.objects[key] = new
                self._emit(rt, "MODIFIED", new, current)
            return copy.deepcopy(new)

    def delete(self, rt: ResourceType, namespace: str | None, name: str, propagation: str = "Background",
               precondition_uid: str | None = None, precondition_rv: str | None = None) -> dict[str, Any]:
        with self.lock:
            current = self.get(rt, namespace, name)
            meta = current["metadata"]
            if precondition_uid and precondition_uid != meta["uid"]:
                raise ApiError(409, "Conflict", f"Precondition failed: UID in precondition: {precondition_uid}, UID in object meta: {meta['uid']}")
            if precondition_rv and precondition_rv != meta["resourceVersion"]:
                raise ApiError(409, "Conflict", f"Precondition failed: ResourceVersion in precondition: {precondition_rv}, "
                                                f"ResourceVersion in object meta: {meta['resourceVersion']}")
            key = self._key(rt, namespace, name)
            if meta.get("finalizers"):
                if meta.get("deletionTimestamp"):
                    return copy.deepcopy(current)
                new = copy.deepcopy(current)
                new["metadata"]["deletionTimestamp"] = _now()
                new["metadata"]["resourceVersion"] = self._next_rv()
                self.objects[key] = new
                self._emit(rt, "MODIFIED", new, current)
                return copy.deepcopy(new)
            del self.objects[key]
            gone = copy.deepcopy(current)
            gone["metadata"]["resourceVersion"] = self._next_rv()
            self._emit(rt, "DELETED", gone, current)
            if propagation != "Orphan":
                self._collect_dependents(meta["uid"])
            return gone

    def _collect_dependents(self, owner_uid: str) -> None:
        """Delete what the garbage collector would: objects whose ownerReferences name ``owner_uid``."""
        for (key, ns, name), obj in list(self.objects.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if any(r.get("uid") == owner_uid for r in refs):
                rt = self.resource_by_key(key)
                if self._key(rt, ns or None, name) in self.objects:
                    self.delete(rt, ns or None, name)

    # -- watches -------------------------------------------------------------

    def open_watch(self, filt: _Filter, loop: asyncio.AbstractEventLoop, since: str | None) -> tuple[_Watcher, list[dict[str, Any]]]:
        """Register a watcher and return the events it must see first (atomically: nothing is missed)."""
        with self.lock:
            if since in (None, "", "0"):
                initial = [{"type": "ADDED", "object": copy.deepcopy(o)} for o in self.list(filt)]
            else:
                try:
                    rv = int(since)
                except ValueError as exc:
                    raise ApiError(400, "BadRequest", f"resourceVersion must be an integer, got {since!r}") from exc
                if rv < self.oldest_rv:
                    raise _gone(rv, self.oldest_rv)
                initial = [e for ev in self.history if ev.rv > rv and (e := _event_for(filt, ev)) is not None]
            watcher = _Watcher(filt, loop)
            self.watchers.add(watcher)
            return watcher, initial

    def close_watch(self, watcher: _Watcher) -> None:
        with self.lock:
            self.watchers.discard(watcher)

    def compact(self) -> None:
        with self.lock:
            self.history.clear()
            self.oldest_rv = self.rv

    def end_watches(self, gone: bool) -> int:
        with self.lock:
            watchers = list(self.watchers)
            for w in watchers:
                if gone:
                    w.offer({"type": "ERROR", "object": _gone(self.rv, self.oldest_rv).status()})
                w.offer(None)
            return len(watchers)


# --------------------------------------------------------------------------- HTTP


class _WatchResponse:
    """Streams watch events as JSON lines and stops when the client goes away.

    Starlette's StreamingResponse does not watch for disconnects under ASGI 2.4,
    so an idle watch whose client left would linger; this one races the
    stream against ``http.disconnect``. No content-length: uvicorn sends it chunked.
    """

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})

        async def pump() -> None:
            async for chunk in self._events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(pump()), asyncio.ensure_future(disconnected())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await t


@dataclass(frozen=True, slots=True)
class _Target:
    rt: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None


def _json_path(obj: Any, path: str) -> Any:
    """Evaluate a simple printer-column JSONPath such as ``.status.parallel.dp``."""
    cur = obj
    for part in path.lstrip(".").split("."):
        cur = cur.get(part) if isinstance(cur, Mapping) else None
    return cur


def _age(timestamp: str | None) -> str:
    """Human-readable age, as kubectl prints it (``45s``, ``12m``, ``3h``, ``2d``)."""
    if not timestamp:
        return "<unknown>"
    seconds = max(0, int((datetime.now(UTC) - datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _table(rt: ResourceType, items: list[dict[str, Any]], rv: int) -> dict[str, Any]:
    columns = [{"name": "Name", "type": "string", "format": "name", "description": "Name of the object", "priority": 0}]
    columns += [{"name": c["name"], "type": c["type"], "format": c.get("format", ""), "description": c.get("description", ""),
                 "priority": c.get("priority", 0)} for c in rt.printer_columns]
    rows = []
    for obj in items:
        cells: list[Any] = [obj["metadata"]["name"]]
        for c in rt.printer_columns:
            value = _json_path(obj, c["jsonPath"])
            cells.append(_age(value) if c["type"] == "date" else value)
        rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                                 "metadata": obj["metadata"]}})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": str(rv)},
            "columnDefinitions": columns, "rows": rows}


def _wants_table(request: Request, rt: ResourceType) -> bool:
    return bool(rt.printer_columns) and "as=Table" in request.headers.get("accept", "")


def selector_text(selector: Mapping[str, Any] | None) -> str:
    """A metav1.LabelSelector (matchLabels, matchExpressions) as label-selector text."""
    selector = selector or {}
    parts = [f"{k}={v}" for k, v in (selector.get("matchLabels") or {}).items()]
    for e in selector.get("matchExpressions") or []:
        op, key, values = e.get("operator"), e.get("key"), ",".join(e.get("values") or [])
        parts.append({"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})", "Exists": key,
                      "DoesNotExist": f"!{key}"}[op])
    return ",".join(parts)


def _pod_healthy(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _blocking_budget(store: _Store, namespace: str, pod: Mapping[str, Any]) -> str | None:
    """The name of a PodDisruptionBudget that forbids evicting ``pod`` now, or None.

    As the disruption controller computes it: of the pods a budget selects,
    the healthy (Running and Ready) ones may drop to ``minAvailable``, or
    ``maxUnavailable`` of all may be unhealthy. A pod that is not healthy
    itself may always be evicted (it disrupts nothing), like a terminated one.
    """
    if not _pod_healthy(pod):
        return None
    pods_rt = store.resource_by_key("pods")
    pdb_rt = store.resource_by_key("poddisruptionbudgets")
    labels = pod["metadata"].get("labels") or {}
    for pdb in store.list(_Filter(pdb_rt, namespace)):
        reqs = parse_label_selector(selector_text(pdb.get("spec", {}).get("selector")))
        if not reqs or not all(r.matches(labels) for r in reqs):
            continue
        selected = store.list(_Filter(pods_rt, namespace, reqs))
        healthy = sum(1 for p in selected if _pod_healthy(p))
        spec = pdb.get("spec") or {}
        if "maxUnavailable" in spec:
            allowed = int(spec["maxUnavailable"]) - (len(selected) - healthy)
        else:
            allowed = healthy - int(spec.get("minAvailable", 1))
        if allowed <= 0:
            return str(pdb["metadata"]["name"])
    return None


class _App:
    def __init__(self, store: _Store, stopping: threading.Event) -> None:
        self.store = store
        self.stopping = stopping
        routes = [
            Route("/version", self.version, methods=["GET"]),
            Route("/api", self.api_versions, methods=["GET"]),
            Route("/apis", self.api_groups, methods=["GET"]),
            Route("/{path:path}", self.dispatch, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
        ]
        self.asgi = Starlette(routes=routes)

    # -- discovery -------------------------------------------------------------

    async def version(self, request: Request) -> Response:
        return JSONResponse({"major": "1", "minor": "33", "gitVersion": "v1.33.0-tenplex-emulator", "platform": "linux/amd64"})

    async def api_versions(self, request: Request) -> Response:
        return JSONResponse({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})

    async def api_groups(self, request: Request) -> Response:
        groups: dict[str, list[str]] = {}
        for rt in self.store.types:
            if rt.group and rt.version not in groups.setdefault(rt.group, []):
                groups[rt.group].append(rt.version)
        return JSONResponse({"kind": "APIGroupList", "apiVersion": "v1", "groups": [
            {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
             "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]}} for g, vs in groups.items()]})

    def _resource_list(self, group: str, version: str) -> dict[str, Any]:
        resources = []
        for rt in self.store.types:
            if (rt.group, rt.version) != (group, version):
                continue
            verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
            resources.append({"name": rt.plural, "singularName": rt.kind.lower(), "namespaced": rt.namespaced,
                              "kind": rt.kind, "verbs": verbs, "shortNames": list(rt.short_names)})
            if rt.status_subresource:
                resources.append({"name": f"{rt.plural}/status", "singularName": "", "namespaced": rt.namespaced,
                                  "kind": rt.kind, "verbs": ["get", "patch", "update"]})
            if rt.scale is not None:
                resources.append({"name": f"{rt.plural}/scale", "singularName": "", "namespaced": rt.namespaced,
                                  "group": "autoscaling", "version": "v1", "kind": "Scale", "verbs": ["get", "patch", "update"]})
        if not resources:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource {group}/{version}")
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{group}/{version}" if group else version,
                "resources": resources}

    # -- resources -------------------------------------------------------------

    def _target(self, path: str) -> _Target | dict[str, Any]:
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        elif parts[:1] == ["apis"] and len(parts) == 2:
            raise ApiError(404, "NotFound", f"group discovery for /{path} is not emulated; use /apis")
        else:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource /{path}")
        if not rest:
            return self._resource_list(group, version)
        namespace = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        rt = self.store.resource(group, version, rest[0])
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if len(rest) > 3 or (sub is not None and sub not in ("status", "scale", "eviction", "binding")):
            raise ApiError(404, "NotFound", f"the server could not find the requested resource /{path}")
        if rt.namespaced and namespace is None and name is not None:
            raise ApiError(404, "NotFound", f"{rt.key} is namespaced: use /namespaces/<ns>/{rt.plural}/{name}")
        if sub == "status" and not rt.status_subresource or sub == "scale" and rt.scale is None or \
                sub in ("eviction", "binding") and rt.plural != "pods":
            raise ApiError(404, "NotFound", f"{rt.key} has no {sub} subresource")
        return _Target(rt, namespace, name, sub)

    async def dispatch(self, request: Request) -> Response | _WatchResponse:
        try:
            target = self._target(request.path_params["path"])
            if isinstance(target, dict):
                return JSONResponse(target)
            return await self._serve(request, target)
        except ApiError as err:
            return JSONResponse(err.status(), status_code=err.code)

    async def _body(self, request: Request) -> Any:
        raw = await request.body()
        if not raw:
            return None
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if "json" not in ctype:
            # e.g. protobuf from kubectl: a 415 makes client-go fall back to JSON, as against an API server without it.
            raise ApiError(415, "UnsupportedMediaType", f"the emulator accepts JSON bodies only, got {ctype!r}")
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ApiError(400, "BadRequest", f"the request body is not JSON: {exc}") from exc

    async def _delete_options(self, request: Request) -> Mapping[str, Any]:
        """DeleteOptions of a DELETE; kubectl sends them as protobuf, which the emulator reads as the defaults."""
        ctype = request.headers.get("content-type", "application/json")
        if "json" not in ctype:
            await request.body()
            return {}
        body = await self._body(request)
        return body if isinstance(body, Mapping) else {}

    async def _serve(self, request: Request, t: _Target) -> Response | _WatchResponse:
        method, q, store = request.method, request.query_params, self.store
        if q.get("dryRun") and method != "GET":
            # Refused rather than ignored: an ignored dry run would change the state a test relies on.
            raise ApiError(400, "BadRequest", f"dryRun={q.get('dryRun')} is not supported by the emulator")
        if t.name is None:
            filt = _Filter(t.rt, t.namespace, parse_label_selector(q.get("labelSelector")),
                           parse_field_selector(q.get("fieldSelector")))
            if method == "GET" and q.get("watch") in ("true", "1"):
                return self._watch(filt, q.get("resourceVersion"), q.get("timeoutSeconds"))
            if method == "GET":
                with store.lock:
                    items, rv = copy.deepcopy(store.list(filt)), store.rv
                if _wants_table(request, t.rt):
                    return JSONResponse(_table(t.rt, items, rv))
                return JSONResponse({"kind": f"{t.rt.kind}List", "apiVersion": t.rt.api_version,
                                     "metadata": {"resourceVersion": str(rv)}, "items": items})
            if method == "POST":
                return JSONResponse(store.create(t.rt, t.namespace, await self._body(request)), status_code=201)
            if method == "DELETE":
                with store.lock:
                    names = [(o["metadata"].get("namespace"), o["metadata"]["name"]) for o in store.list(filt)]
                    for ns, name in names:
                        store.delete(t.rt, ns, name)
                return JSONResponse({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                     "details": {"kind": t.rt.plural, "group": t.rt.group}})
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on a collection")

        if t.subresource == "scale":
            return await self._scale(request, t)
        if t.subresource == "binding":
            if method != "POST":
                raise ApiError(405, "MethodNotAllowed", "bindings are created with POST")
            body = await self._body(request)
            target = (body or {}).get("target") or {}
            if target.get("kind", "Node") != "Node" or not target.get("name"):
                raise ApiError(400, "BadRequest", f"a Binding needs target.kind Node and target.name, got {target!r}")

            def bind(cur: dict[str, Any]) -> dict[str, Any]:
                bound = cur.get("spec", {}).get("nodeName")
                if bound:
                    raise ApiError(409, "Conflict", f'pod {t.name} is already assigned to node "{bound}"')
                cur.setdefault("spec", {})["nodeName"] = target["name"]
                return cur

            store.update(t.rt, t.namespace, t.name, bind, None)
            return JSONResponse({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201},
                                status_code=201)
        if t.subresource == "eviction":
            if method != "POST":
                raise ApiError(405, "MethodNotAllowed", "evictions are created with POST")
            with store.lock:
                blocking = _blocking_budget(store, t.namespace or "", store.get(t.rt, t.namespace, t.name))
                if blocking is not None:
                    raise ApiError(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption "
                                   "budget.", {"causes": [{"reason": "DisruptionBudget",
                                                            "message": f"The disruption budget {blocking} is not met"}]})
                store.delete(t.rt, t.namespace, t.name)
            return JSONResponse({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201},
                                status_code=201)
        if method == "GET":
            with store.lock:
                obj, rv = copy.deepcopy(store.get(t.rt, t.namespace, t.name)), store.rv
            return JSONResponse(_table(t.rt, [obj], rv) if _wants_table(request, t.rt) else obj)
        if method == "PUT":
            body = await self._body(request)
            if not isinstance(body, Mapping):
                raise ApiError(400, "BadRequest", "the body of an update must be a JSON object")
            meta = body.get("metadata") or {}
            if meta.get("name") not in (None, t.name):
                raise ApiError(400, "BadRequest", f"the name of the object ({meta.get('name')}) does not match the name on the URL ({t.name})")
            return JSONResponse(store.update(t.rt, t.namespace, t.name, lambda _cur: copy.deepcopy(dict(body)), t.subresource))
        if method == "PATCH":
            body = await self._body(request)
            ctype = request.headers.get("content-type", "")
            return JSONResponse(store.update(t.rt, t.namespace, t.name,
                                             lambda cur: _apply_patch(t.rt, cur, body, ctype), t.subresource))
        if method == "DELETE":
            if t.subresource:
                raise ApiError(405, "MethodNotAllowed", f"DELETE is not allowed on /{t.subresource}")
            opts = await self._delete_options(request)
            propagation = q.get("propagationPolicy") or opts.get("propagationPolicy") or "Background"
            pre = opts.get("preconditions") or {}
            gone = store.delete(t.rt, t.namespace, t.name, propagation, pre.get("uid"), pre.get("resourceVersion"))
            if t.rt.returns_object_on_delete:
                return JSONResponse(gone)
            return JSONResponse({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                 "details": {"name": t.name, "group": t.rt.group, "kind": t.rt.plural,
                                             "uid": gone["metadata"]["uid"]}})
        raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")

    # -- scale -----------------------------------------------------------------

    @staticmethod
    def _get_path(obj: Mapping[str, Any], path: tuple[str, ...]) -> Any:
        cur: Any = obj
        for p in path:
            cur = cur.get(p) if isinstance(cur, Mapping) else None
        return cur

    def _scale_view(self, rt: ResourceType, obj: Mapping[str, Any]) -> dict[str, Any]:
        assert rt.scale is not None
        meta = obj["metadata"]
        status: dict[str, Any] = {"replicas": self._get_path(obj, rt.scale.status_replicas) or 0}
        selector = self._get_path(obj, rt.scale.label_selector)
        if selector:
            status["selector"] = selector
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp") if k in meta},
                "spec": {"replicas": self._get_path(obj, rt.scale.spec_replicas) or 0}, "status": status}

    async def _scale(self, request: Request, t: _Target) -> Response:
        rt, store = t.rt, self.store
        assert rt.scale is not None and t.name is not None
        if request.method == "GET":
            with store.lock:
                return JSONResponse(self._scale_view(rt, store.get(rt, t.namespace, t.name)))
        if request.method not in ("PUT", "PATCH"):
            raise ApiError(405, "MethodNotAllowed", f"{request.method} is not allowed on /scale")
        body = await self._body(request)
        ctype = request.headers.get("content-type", "")
        mapping = rt.scale
        with store.lock:
            view = self._scale_view(rt, store.get(rt, t.namespace, t.name))
            if request.method == "PUT":
                if not isinstance(body, Mapping):
                    raise ApiError(400, "BadRequest", "the body of a scale update must be a Scale object")
                new_view = dict(body)
            else:
                new_view = _apply_patch(rt, view, body, ctype)
            replicas = (new_view.get("spec") or {}).get("replicas")
            if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
                raise ApiError(422, "Invalid", f'Scale.autoscaling "{t.name}" is invalid: spec.replicas must be a '
                                               f"non-negative integer, got {replicas!r}")

            def mutate(cur: dict[str, Any]) -> dict[str, Any]:
                target = cur
                for p in mapping.spec_replicas[:-1]:
                    target = target.setdefault(p, {})
                target[mapping.spec_replicas[-1]] = replicas
                return cur

            # A Scale carrying a stale resourceVersion is a conflict, as for the object itself.
            sent_rv = (new_view.get("metadata") or {}).get("resourceVersion")
            updated = store.update(rt, t.namespace, t.name, mutate, None, expected_rv=sent_rv)
        return JSONResponse(self._scale_view(rt, updated))

    # -- watch -----------------------------------------------------------------

    def _watch(self, filt: _Filter, since: str | None, timeout: str | None) -> _WatchResponse:
        try:
            seconds = float(timeout) if timeout else None
        except ValueError as exc:
            raise ApiError(400, "BadRequest", f"timeoutSeconds must be a number, got {timeout!r}") from exc
        loop = asyncio.get_running_loop()
        try:
            watcher, initial = self.store.open_watch(filt, loop, since)
        except ApiError as err:
            if err.code != 410:
                raise
            # The real server answers an expired watch with 200 and one ERROR event.
            line = json.dumps({"type": "ERROR", "object": err.status()}).encode() + b"\n"

            async def once() -> AsyncIterator[bytes]:
                yield line

            return _WatchResponse(once())
        return _WatchResponse(self._stream(watcher, initial, seconds))

    async def _stream(self, watcher: _Watcher, initial: list[dict[str, Any]], seconds: float | None) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        deadline = None if seconds is None else loop.time() + seconds
        try:
            for event in initial:
                yield json.dumps(event).encode() + b"\n"
            while not self.stopping.is_set():
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    return
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), remaining)
                except TimeoutError:
                    return
                if item is None:
                    return
                yield json.dumps(item).encode() + b"\n"
                if item["type"] == "ERROR":
                    return
        finally:
            self.store.close_watch(watcher)


# --------------------------------------------------------------------------- the server


class ApiServerEmulator:
    """The emulator's HTTP server on ``host``:ephemeral port in a background thread, plus test hooks."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, resources: Iterable[ResourceType] | None = None) -> None:
        self._store = _Store(resources if resources is not None else default_resources())
        self._stopping = threading.Event()
        self._app = _App(self._store, self._stopping)
        self._host, self._port = host, port
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._ip_counter = itertools.count(10)

    # -- lifecycle -----------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> ApiServerEmulator:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        self._port = sock.getsockname()[1]
        config = uvicorn.Config(self._app.asgi, log_level="warning", lifespan="off", timeout_graceful_shutdown=2,
                                access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name=f"k8s-emulator-{self._port}", daemon=True)
        self._thread.start()
        waited = 0.0
        while not self._server.started:
            if not self._thread.is_alive() or waited > timeout:
                raise RuntimeError(f"the API server emulator did not start on {self.url} within {timeout}s")
            threading.Event().wait(0.01)
            waited += 0.01
        LOG.info("Kubernetes API server emulator listening on %s", self.url)
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._store.end_watches(gone=False)
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                LOG.warning("the API server emulator on %s did not stop within 10 s", self.url)

    def __enter__(self) -> ApiServerEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        """The API server is down inside the block (connections refused, watches ended), then back on the same
        address with every object kept, as after an API server restart: for testing clients' retries."""
        self.stop()
        try:
            yield
        finally:
            self._stopping.clear()
            self.start()

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._port}"

    def client_configuration(self) -> Any:
        """A ``kubernetes.client.Configuration`` pointing at the emulator."""
        from kubernetes import client

        cfg = client.Configuration(host=self.url)
        cfg.verify_ssl = False
        return cfg

    def api_client(self) -> Any:
        """A fresh ``kubernetes.client.ApiClient`` for the emulator (close it when done)."""
        from kubernetes import client

        return client.ApiClient(self.client_configuration())

    def kubeconfig(self) -> dict[str, Any]:
        """A kubeconfig (as data) for tools such as kubectl."""
        return {"apiVersion": "v1", "kind": "Config", "current-context": "emulator",
                "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
                "users": [{"name": "test", "user": {"token": "emulator"}}],
                "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "test", "namespace": "default"}}]}

    # -- direct state access (bypasses HTTP, same rules) ------------------------------

    @property
    def resource_version(self) -> int:
        with self._store.lock:
            return self._store.rv

    def get(self, resource: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        rt = self._store.resource_by_key(resource)
        with self._store.lock:
            return copy.deepcopy(self._store.get(rt, namespace, name))

    def list(self, resource: str, namespace: str | None = None, label_selector: str | None = None) -> list[dict[str, Any]]:
        rt = self._store.resource_by_key(resource)
        with self._store.lock:
            return copy.deepcopy(self._store.list(_Filter(rt, namespace, parse_label_selector(label_selector))))

    def create(self, resource: str, obj: Mapping[str, Any], namespace: str | None = None) -> dict[str, Any]:
        rt = self._store.resource_by_key(resource)
        ns = namespace or (obj.get("metadata") or {}).get("namespace") or ("default" if rt.namespaced else None)
        return self._store.create(rt, ns, obj)

    def patch(self, resource: str, name: str, patch: Mapping[str, Any], namespace: str | None = None,
              subresource: str | None = None) -> dict[str, Any]:
        """JSON-merge-patch an object (``subresource="status"`` to write its status)."""
        rt = self._store.resource_by_key(resource)
        return self._store.update(rt, namespace, name, lambda cur: merge_patch(cur, patch), subresource)

    def delete(self, resource: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        return self._store.delete(self._store.resource_by_key(resource), namespace, name)

    # -- the world: nodes --------------------------------------------------------------

    def add_node(self, name: str, *, gpus: int = 8, address: str | None = None, labels: Mapping[str, str] | None = None,
                 ready: bool = True) -> dict[str, Any]:
        """A node with ``gpus`` allocatable ``nvidia.com/gpu``, an InternalIP and a Ready condition."""
        address = address or f"10.0.0.{next(self._ip_counter)}"
        self.create("nodes", {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
                               "spec": {}})
        capacity = {crd.GPU_RESOURCE: str(gpus), "cpu": "64", "memory": "512Gi", "pods": "110"}
        status = {"capacity": capacity, "allocatable": dict(capacity),
                  "addresses": [{"type": "InternalIP", "address": address}, {"type": "Hostname", "address": name}],
                  "conditions": [self._ready_condition(ready)]}
        return self.patch("nodes", name, {"status": status}, subresource="status")

    @staticmethod
    def _ready_condition(ready: bool | None) -> dict[str, Any]:
        status = {True: "True", False: "False", None: "Unknown"}[ready]
        reason = {True: "KubeletReady", False: "KubeletNotReady", None: "NodeStatusUnknown"}[ready]
        return {"type": "Ready", "status": status, "reason": reason, "lastTransitionTime": _now(), "lastHeartbeatTime": _now(),
                "message": "kubelet is posting ready status" if ready else "Kubelet stopped posting node status."}

    def set_node_ready(self, name: str, ready: bool | None) -> dict[str, Any]:
        """Set the node's Ready condition: True, False, or None for Unknown (the node controller's view of a lost node)."""
        with self._store.lock:
            node = self.get("nodes", name)
            conds = [c for c in node.get("status", {}).get("conditions", []) if c.get("type") != "Ready"]
            conds.append(self._ready_condition(ready))
            patch: dict[str, Any] = {"status": {"conditions": conds}}
            updated = self.patch("nodes", name, patch, subresource="status")
            taints = [t for t in updated.get("spec", {}).get("taints", []) if t.get("key") != "node.kubernetes.io/not-ready"]
            if ready is not True:
                taints.append({"key": "node.kubernetes.io/not-ready", "effect": "NoExecute", "timeAdded": _now()})
            return self.patch("nodes", name, {"spec": {"taints": taints or None}})

    def cordon_node(self, name: str, cordoned: bool = True) -> dict[str, Any]:
        """``kubectl cordon``/``uncordon``: spec.unschedulable and its taint."""
        with self._store.lock:
            node = self.get("nodes", name)
            taints = [t for t in node.get("spec", {}).get("taints", []) if t.get("key") != "node.kubernetes.io/unschedulable"]
            if cordoned:
                taints.append({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule", "timeAdded": _now()})
            return self.patch("nodes", name, {"spec": {"unschedulable": True if cordoned else None, "taints": taints or None}})

    def drain_node(self, name: str) -> list[str]:
        """``kubectl drain``: cordon, then evict every pod bound to the node; returns ``ns/name`` of the evicted pods."""
        self.cordon_node(name)
        evicted = []
        with self._store.lock:
            pods = [p for p in self.list("pods") if p.get("spec", {}).get("nodeName") == name]
            for pod in pods:
                meta = pod["metadata"]
                self.delete("pods", meta["name"], meta["namespace"])
                evicted.append(f"{meta['namespace']}/{meta['name']}")
        return evicted

    def evict_node_pods(self, name: str) -> tuple[list[str], list[str]]:
        """One pass of ``kubectl drain --ignore-daemonsets``: cordon, then evict (through the eviction API's rules,
        PodDisruptionBudgets included) every pod on the node that no DaemonSet owns.

        Returns ``ns/name`` of the evicted pods and of those a budget protected; a drain retries the latter.
        """
        self.cordon_node(name)
        evicted, blocked = [], []
        with self._store.lock:
            pods = [p for p in self.list("pods") if p.get("spec", {}).get("nodeName") == name
                    and not any(o.get("kind") == "DaemonSet" for o in p["metadata"].get("ownerReferences") or [])]
            for pod in pods:
                meta = pod["metadata"]
                if _blocking_budget(self._store, meta["namespace"], pod) is not None:
                    blocked.append(f"{meta['namespace']}/{meta['name']}")
                    continue
                self.delete("pods", meta["name"], meta["namespace"])
                evicted.append(f"{meta['namespace']}/{meta['name']}")
        return evicted, blocked

    def node_address(self, name: str) -> str:
        for addr in self.get("nodes", name).get("status", {}).get("addresses", []):
            if addr.get("type") == "InternalIP":
                return str(addr["address"])
        raise KeyError(f"node {name} has no InternalIP address")

    # -- the world: pods (what a kubelet would report) ---------------------------------

    def set_pod_running(self, name: str, namespace: str = "default", node: str | None = None,
                        pod_ip: str | None = None) -> dict[str, Any]:
        """Bind the pod to ``node`` (unless already bound) and report it Running and Ready."""
        with self._store.lock:
            pod = self.get("pods", name, namespace)
            bound = pod.get("spec", {}).get("nodeName")
            if node is not None and bound not in (None, node):
                raise ValueError(f"pod {namespace}/{name} is bound to {bound}, not {node}")
            node = bound or node
            if node is None:
                raise ValueError(f"pod {namespace}/{name} is not bound to a node; pass node=")
            if not bound:
                self.patch("pods", name, {"spec": {"nodeName": node}}, namespace)
            containers = pod.get("spec", {}).get("containers", [])
            status = {
                "phase": "Running", "hostIP": self.node_address(node), "podIP": pod_ip or self.node_address(node),
                "startTime": _now(),
                "conditions": [{"type": t, "status": "True", "lastTransitionTime": _now()}
                               for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
                "containerStatuses": [{"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": True,
                                       "restartCount": 0, "started": True,
                                       "state": {"running": {"startedAt": _now()}}} for c in containers],
            }
            return self.patch("pods", name, {"status": status}, namespace, subresource="status")

    def _terminate_pod(self, name: str, namespace: str, phase: str, exit_code: int, reason: str, message: str) -> dict[str, Any]:
        with self._store.lock:
            pod = self.get("pods", name, namespace)
            containers = pod.get("spec", {}).get("containers", [])
            status = dict(pod.get("status", {}))
            status.update(phase=phase, reason=reason, message=message)
            status["conditions"] = [{"type": t, "status": "False" if t in ("Ready", "ContainersReady") else "True",
                                     "lastTransitionTime": _now()}
                                    for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
            status["containerStatuses"] = [
                {"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": False, "restartCount": 0,
                 "started": False, "state": {"terminated": {"exitCode": exit_code, "reason": reason, "message": message,
                                                            "finishedAt": _now()}}}
                for c in containers]
            return self.patch("pods", name, {"status": status}, namespace, subresource="status")

    def fail_pod(self, name: str, namespace: str = "default", *, exit_code: int = 137, reason: str = "Error",
                 message: str = "the container exited with a failure") -> dict[str, Any]:
        """Report the pod Failed, its containers terminated with ``exit_code``."""
        return self._terminate_pod(name, namespace, "Failed", exit_code, reason, message)

    def set_pod_succeeded(self, name: str, namespace: str = "default") -> dict[str, Any]:
        return self._terminate_pod(name, namespace, "Succeeded", 0, "Completed", "")

    # -- watches -----------------------------------------------------------------------

    def compact(self) -> None:
        """Forget the watch history: resuming from any resourceVersion seen so far answers 410 Gone."""
        self._store.compact()

    def expire_watches(self) -> int:
        """Compact, and end every open watch with an ERROR 410 Gone event; returns how many were open."""
        self._store.compact()
        return self._store.end_watches(gone=True)

    def close_watches(self) -> int:
        """End every open watch normally (as a server-side timeout does); returns how many were open."""
        return self._store.end_watches(gone=False)

    def open_watches(self) -> int:
        with self._store.lock:
            return len(self._store.watchers)
