"""The emulated API server's state and the rules of writing to it.

Objects, one cluster-wide ``resourceVersion`` counter, a small window of
watch events per resource (a watch resuming from before it answers 410 Gone,
as the watch cache does), the open watches, and what happens on create,
update and delete:

* **Create**: the namespace must exist and not be terminating; a numeric
  ``resourceVersion`` in the body is refused (the real server answers 500
  "resourceVersion should not be set on objects to be created"); defaults,
  ServiceAccount and PodSecurity admission for pods; validation (see
  :mod:`~tenplex.testing.k8s.admission`); unknown fields as the request's field
  validation says.
* **Update**: optimistic concurrency on ``resourceVersion``; a uid that is not
  the object's is a 409 Conflict; the main resource cannot write ``status`` and
  ``/status`` cannot write anything else; a pod's spec is immutable but for
  what the API allows; no finalizer may be added to an object being deleted;
  ``generation`` moves on spec changes.
* **Delete**: a pod bound to a node and not terminated is deleted gracefully:
  ``deletionTimestamp`` (now + grace period), ``deletionGracePeriodSeconds``,
  ``generation`` + 1, and it stays (Terminating) until its kubelet deletes it
  with grace period 0, as the pod strategy and the kubelet do; a shorter grace
  period may be given later, never a longer one. Finalizers hold any object
  (``deletionGracePeriodSeconds`` 0) until they are removed. Propagation
  ``Foreground`` adds the ``foregroundDeletion`` finalizer, ``Orphan`` the
  ``orphan`` finalizer, ``Background`` (the default) none.
* **Garbage collection** runs asynchronously on its own thread, as the
  controller does: a dependent is deleted once *all* its owners are gone (or
  being deleted in the foreground; it is then deleted in the foreground too);
  references to owners that are gone are removed from a dependent that still
  has a live owner; a foreground deletion ends when no dependent with
  ``blockOwnerDeletion`` is left; an orphaning deletion first removes the
  owner's references from its dependents. Owners of kinds the emulator does not
  serve cannot be looked up and count as present (the real collector cannot
  resolve them either and never deletes on their account).
* **Namespaces**: created with the ``kubernetes`` finalizer and their
  ``default`` ServiceAccount (the account controller's job); deleting one
  makes it Terminating, the namespace controller deletes its content (pods
  gracefully) and removes the finalizer once nothing is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import secrets
import threading
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tenplex.k8s import crd
from tenplex.testing.k8s import admission
from tenplex.testing.k8s.objects import (
    ApiError,
    Filter,
    Mutation,
    ResourceType,
    forbidden,
    gone,
    invalid,
    not_found,
    now,
    owner_refs,
    timestamp,
)
from tenplex.testing.k8s.rbac import ADMIN_USER, User

log = logging.getLogger(__name__)

WATCH_WINDOW = 100
"""Watch events kept per resource (the watch cache's classic default); older resourceVersions answer 410 Gone."""
FINALIZER_FOREGROUND = "foregroundDeletion"
FINALIZER_ORPHAN = "orphan"
FINALIZER_NAMESPACE = "kubernetes"
DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
FIELD_VALIDATIONS = ("Ignore", "Warn", "Strict")


@dataclass(slots=True)
class WriteOptions:
    """What a write request says besides its body; ``warnings`` collects what the answer's Warning headers say."""

    user: User = ADMIN_USER
    field_validation: str = "Warn"
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class DeleteOptions:
    propagation: str | None = None
    """Background (the default), Foreground or Orphan."""
    grace_period: int | None = None
    uid: str | None = None
    resource_version: str | None = None


@dataclass(slots=True)
class Event:
    rv: int
    rt: ResourceType
    type: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclass(eq=False, slots=True)
class Watcher:
    filt: Filter
    loop: asyncio.AbstractEventLoop
    bookmarks: bool = False
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)

    def offer(self, item: dict[str, Any] | None) -> None:
        with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def event_for(filt: Filter, ev: Event) -> dict[str, Any] | None:
    """The watch event a watcher with ``filt`` sees for ``ev`` (an object leaving the selector is DELETED)."""
    now_ = filt.matches(ev.rt, ev.obj)
    before = filt.matches(ev.rt, ev.old) if ev.old is not None else False
    if ev.type == "DELETED":
        return {"type": "DELETED", "object": ev.obj} if now_ or before else None
    if now_ and (before or ev.type == "ADDED"):
        return {"type": ev.type, "object": ev.obj}
    if now_:
        return {"type": "ADDED", "object": ev.obj}
    if before:
        return {"type": "DELETED", "object": ev.obj}
    return None


def pod_gpus(pod: dict[str, Any], resource: str = crd.GPU_RESOURCE) -> int:
    total = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        value = (res.get("limits") or {}).get(resource) or (res.get("requests") or {}).get(resource) or 0
        try:
            total += int(str(value))
        except ValueError:
            continue
    return total


def pod_terminated(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


class Store:
    """Objects, the resourceVersion counter, the watch windows and the open watches, under one lock."""

    def __init__(self, resources: Iterable[ResourceType], *, watch_window: int = WATCH_WINDOW) -> None:
        self.lock = threading.RLock()
        self.types = tuple(resources)
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.rv = 1  # as on a real cluster, no object is ever at "0" (which means "any" to a watch)
        self.window = watch_window
        self.windows: dict[str, deque[Event]] = {rt.key: deque(maxlen=watch_window) for rt in self.types}
        self.expired_upto: dict[str, int] = {rt.key: 0 for rt in self.types}
        """A watch of that resource may resume from any resourceVersion at or after this one."""
        self.watchers: set[Watcher] = set()
        self.schemas = admission.BuiltinSchemas()
        self.warnings: list[tuple[str, str]] = []
        """(user, warning) for every unknown field dropped under fieldValidation=Warn."""
        self.overbooked: list[str] = []
        """Every moment a node's pods (Terminating ones included) were given more GPUs than it has."""
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._controllers: threading.Thread | None = None
        with self.lock:
            for ns in DEFAULT_NAMESPACES:
                self.create(self.resource_by_key("namespaces"), None, {"metadata": {"name": ns}})

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

    def resource_by_kind(self, api_version: str, kind: str) -> ResourceType | None:
        for rt in self.types:
            if rt.api_version == api_version and rt.kind == kind:
                return rt
        return None

    @staticmethod
    def _key(rt: ResourceType, namespace: str | None, name: str) -> tuple[str, str, str]:
        return (rt.key, namespace or "" if rt.namespaced else "", name)

    def find(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self.objects.get(self._key(rt, namespace, name))

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self.find(rt, namespace, name)
        if obj is None:
            raise not_found(rt, name)
        return obj

    def list(self, filt: Filter) -> list[dict[str, Any]]:
        items = [o for (k, _, _), o in self.objects.items() if k == filt.rt.key and filt.matches(filt.rt, o)]
        return sorted(items, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))

    def rbac_objects(self) -> list[dict[str, Any]]:
        kinds = ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")
        return [o for o in self.objects.values() if o.get("kind") in kinds]

    # -- events --------------------------------------------------------------

    def _emit(self, rt: ResourceType, type_: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        ev = Event(self.rv, rt, type_, copy.deepcopy(obj), copy.deepcopy(old) if old is not None else None)
        window = self.windows[rt.key]
        if len(window) == window.maxlen:
            self.expired_upto[rt.key] = window[0].rv
        window.append(ev)
        for w in list(self.watchers):
            event = event_for(w.filt, ev)
            if event is not None:
                w.offer(event)
        if owner_refs(obj) or (obj.get("metadata") or {}).get("deletionTimestamp") or type_ == "DELETED" \
                or rt.plural == "namespaces":
            self._dirty.set()

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    # -- checks ----------------------------------------------------------------

    def _validate(self, rt: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None, opts: WriteOptions,
                  *, subresource: str | None = None) -> dict[str, Any]:
        """Decode errors (400), unknown fields (by the field validation), invalid fields (422); returns ``obj``
        with the unknown fields dropped."""
        if rt.custom:
            verdict = admission.custom_check(rt, obj)
            kind_text = f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}'
        else:
            verdict = self.schemas.check(obj)
            kind_text = f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}'
            if not verdict.decode:
                try:
                    decode, semantic = admission.semantic_errors(rt, obj, old if subresource is None else None, old)
                except (AttributeError, TypeError) as exc:  # a null where the checks expect an object
                    decode, semantic = [f"{kind_text}: {exc}"], []
                verdict.decode += decode
                verdict.invalid += semantic
        if verdict.decode:
            raise ApiError(400, "BadRequest", "; ".join(verdict.decode))
        unknown = [admission.path_text(p) for p in verdict.unknown]
        if unknown:
            if opts.field_validation == "Strict":
                raise ApiError(400, "BadRequest", f"{kind_text}: strict decoding error: "
                               + ", ".join(f'unknown field "{u}"' for u in unknown))
            if opts.field_validation == "Warn":
                opts.warnings += [f'unknown field "{u}"' for u in unknown]
                self.warnings += [(opts.user.name, f'unknown field "{u}"') for u in unknown]
            obj = admission.prune(obj, verdict.unknown)
            if rt.custom:
                verdict = admission.custom_check(rt, obj)
        if verdict.invalid:
            raise invalid(rt, obj["metadata"].get("name", ""), verdict.invalid)
        return obj

    def _namespace_usable(self, rt: ResourceType, namespace: str | None, name: str) -> None:
        if not rt.namespaced:
            return
        ns = self.find(self.resource_by_key("namespaces"), None, namespace or "")
        if ns is None:
            raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found',
                           {"name": namespace, "kind": "namespaces"})
        if ns["metadata"].get("deletionTimestamp"):
            raise ApiError(403, "Forbidden", f'{rt.plural} "{name}" is forbidden: unable to create new content in '
                           f"namespace {namespace} because it is being terminated",
                           {"name": name, "kind": rt.plural, "causes": [{"reason": "NamespaceTerminating",
                                                                         "field": "metadata.namespace"}]})

    def _admit_pod(self, pod: dict[str, Any], namespace: str) -> None:
        """ServiceAccount admission: the account must exist; its token is mounted unless opted out."""
        spec = pod["spec"]
        account = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
        spec["serviceAccountName"] = spec["serviceAccount"] = account
        sa = self.find(self.resource_by_key("serviceaccounts"), namespace, account)
        name = pod["metadata"]["name"]
        if sa is None:
            raise forbidden(self.resource_by_key("pods"), name, f"error looking up service account "
                            f'{namespace}/{account}: serviceaccount "{account}" not found')
        admission.mount_service_account_token(pod, sa)

    def _pod_security(self, pod: dict[str, Any], namespace: str) -> None:
        ns = self.find(self.resource_by_key("namespaces"), None, namespace) or {}
        level = ((ns.get("metadata") or {}).get("labels") or {}).get(admission.LABEL_ENFORCE, "privileged")
        violations = admission.pod_security_violations(level, pod)
        if violations:
            raise forbidden(self.resource_by_key("pods"), pod["metadata"]["name"],
                            f'violates PodSecurity "{level}:latest": ' + ", ".join(violations))

    def _check_gpus(self, pod: dict[str, Any]) -> None:
        """Record (never refuse: that is the kubelet's admission) a node given more GPUs than it has."""
        node_name = (pod.get("spec") or {}).get("nodeName")
        wanted = pod_gpus(pod)
        if not node_name or not wanted:
            return
        node = self.find(self.resource_by_key("nodes"), None, node_name)
        if node is None:
            return
        try:
            capacity = int(str(((node.get("status") or {}).get("allocatable") or {}).get(crd.GPU_RESOURCE, 0)))
        except ValueError:
            return
        holders = [p for p in self.list(Filter(self.resource_by_key("pods"), None))
                   if (p.get("spec") or {}).get("nodeName") == node_name and not pod_terminated(p)
                   and p["metadata"]["uid"] != pod["metadata"].get("uid")]
        used = sum(pod_gpus(p) for p in holders)
        if used + wanted > capacity:
            names = ", ".join(f"{p['metadata']['name']}" + (" (Terminating)" if p["metadata"].get("deletionTimestamp")
                                                            else "") for p in holders)
            self.overbooked.append(f"node {node_name}: pod {pod['metadata']['name']} needs {wanted} GPUs, {used} of "
                                   f"{capacity} are held by {names}")

    # -- create ------------------------------------------------------------------

    def create(self, rt: ResourceType, namespace: str | None, body: Any, opts: WriteOptions | None = None) -> dict[str, Any]:
        opts = opts or WriteOptions()
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", f"the body of a create must be a JSON object, got {type(body).__name__}")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise ApiError(400, "BadRequest", "metadata must be an object")
        for key, expected in (("apiVersion", rt.api_version), ("kind", rt.kind)):
            if obj.get(key) not in (None, "", expected):
                raise ApiError(400, "BadRequest", f"the {key} of the object ({obj[key]}) does not match the expected "
                                                  f"{key} ({expected})")
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise invalid(rt, "", ["metadata.name: Required value: name or generateName is required"])
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        name = meta["name"]
        rv = str(meta.get("resourceVersion") or "")
        if rv.isdigit() and int(rv) != 0:
            raise ApiError(500, "", "resourceVersion should not be set on objects to be created")
        if rt.namespaced:
            if meta.get("namespace") not in (None, "", namespace):
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the namespace "
                                                  "sent on the request")
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        for k in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds", "uid", "creationTimestamp",
                  "generation", "selfLink"):
            meta.pop(k, None)
        if rt.status_subresource and rt.plural != "nodes":
            obj.pop("status", None)
        with self.lock:
            self._namespace_usable(rt, namespace, name)
            if rt.custom and rt.schema is not None:
                obj = admission.custom_defaults(rt.schema, obj)
            if rt.plural == "pods":
                obj["status"] = {"phase": "Pending"}
                admission.pod_defaults(obj)
            obj = self._validate(rt, obj, None, opts)
            if rt.plural == "pods":
                self._admit_pod(obj, namespace or "")
                self._pod_security(obj, namespace or "")
            if rt.plural == "namespaces":
                obj.setdefault("spec", {})["finalizers"] = [FINALIZER_NAMESPACE]
                obj["status"] = {"phase": "Active"}
            meta = obj["metadata"]
            key = self._key(rt, namespace, name)
            if key in self.objects:
                raise ApiError(409, "AlreadyExists", f'{rt.key} "{name}" already exists',
                               {"name": name, "group": rt.group, "kind": rt.plural})
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
            meta["resourceVersion"] = self._next_rv()
            if rt.plural == "pods":
                self._check_gpus(obj)
            self.objects[key] = obj
            self._emit(rt, "ADDED", obj, None)
            if rt.plural == "namespaces":  # the ServiceAccount controller's part
                self.create(self.resource_by_key("serviceaccounts"), name, {"metadata": {"name": "default"}})
            return copy.deepcopy(obj)

    # -- update ------------------------------------------------------------------

    def update(self, rt: ResourceType, namespace: str | None, name: str, mutate: Mutation, subresource: str | None,
               expected_rv: str | None = None, opts: WriteOptions | None = None, *,
               expected_uid: str | None = None) -> dict[str, Any]:
        """Replace an object by ``mutate(copy)``, keeping what that kind of write may not change."""
        opts = opts or WriteOptions()
        with self.lock:
            current = self.get(rt, namespace, name)
            proposed = mutate(copy.deepcopy(current))
            if not isinstance(proposed, dict):
                raise ApiError(400, "BadRequest", f"the result of the write is not an object: {proposed!r}")
            meta = proposed.setdefault("metadata", {})
            cur_meta = current["metadata"]
            uid = expected_uid if expected_uid is not None else meta.get("uid")
            if uid not in (None, "", cur_meta["uid"]):
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rt.key} "{name}": Precondition '
                               f"failed: UID in precondition: {uid}, UID in object meta: {cur_meta['uid']}",
                               {"name": name, "group": rt.group, "kind": rt.plural})
            rv = expected_rv if expected_rv is not None else meta.get("resourceVersion")
            if rv not in (None, "", cur_meta["resourceVersion"]):
                raise ApiError(409, "Conflict",
                               f'Operation cannot be fulfilled on {rt.key} "{name}": the object has been modified; '
                               f"please apply your changes to the latest version and try again "
                               f"(sent resourceVersion {rv}, current {cur_meta['resourceVersion']})",
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
            new_meta = new.setdefault("metadata", {})
            for k in ("uid", "creationTimestamp", "name", "namespace", "generation", "deletionTimestamp",
                      "deletionGracePeriodSeconds"):
                if k in cur_meta:
                    new_meta[k] = cur_meta[k]
                else:
                    new_meta.pop(k, None)
            new["apiVersion"], new["kind"] = rt.api_version, rt.kind
            if cur_meta.get("deletionTimestamp"):
                added = [f for f in new_meta.get("finalizers") or [] if f not in (cur_meta.get("finalizers") or [])]
                if added:
                    raise invalid(rt, name, [f"metadata.finalizers: Forbidden: no new finalizers can be added if the "
                                             f"object is being deleted, found new finalizers {added}"])
            if rt.custom and rt.schema is not None:
                new = admission.custom_defaults(rt.schema, new)
            if rt.plural == "pods" and subresource is None:
                admission.pod_defaults(new)
            new["metadata"]["resourceVersion"] = cur_meta["resourceVersion"]
            if new == current:
                return copy.deepcopy(current)  # a no-op write neither bumps resourceVersion nor notifies
            new = self._validate(rt, new, current, opts, subresource=subresource)
            new["metadata"]["resourceVersion"] = cur_meta["resourceVersion"]
            if new == current:  # what was left after dropping unknown fields changes nothing
                return copy.deepcopy(current)
            spec_changed = {k: v for k, v in new.items() if k not in ("metadata", "status")} != {
                k: v for k, v in current.items() if k not in ("metadata", "status")}
            if spec_changed:
                new["metadata"]["generation"] = cur_meta.get("generation", 1) + 1
            new["metadata"]["resourceVersion"] = self._next_rv()
            key = self._key(rt, namespace, name)
            nm = new["metadata"]
            if nm.get("deletionTimestamp") and not nm.get("finalizers") and not nm.get("deletionGracePeriodSeconds") \
                    and not (rt.plural == "namespaces" and (new.get("spec") or {}).get("finalizers")):
                del self.objects[key]
                self._emit(rt, "DELETED", new, current)
            else:
                self.objects[key] = new
                self._emit(rt, "MODIFIED", new, current)
            return copy.deepcopy(new)

    def bind(self, namespace: str, name: str, node: str) -> dict[str, Any]:
        """The ``pods/binding`` subresource: set ``spec.nodeName`` of an unbound pod (409 once bound)."""
        pods = self.resource_by_key("pods")
        with self.lock:
            pod = self.get(pods, namespace, name)
            bound = (pod.get("spec") or {}).get("nodeName")
            if bound:
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on pods/binding "{name}": pod {name} '
                                                f'is already assigned to node "{bound}"')
            if pod["metadata"].get("deletionTimestamp"):
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on pods/binding "{name}": pod {name} '
                                                "is being deleted, cannot be assigned to a host")
            new = copy.deepcopy(pod)
            new["spec"]["nodeName"] = node
            new["metadata"]["resourceVersion"] = self._next_rv()
            self._check_gpus(new)
            self.objects[self._key(pods, namespace, name)] = new
            self._emit(pods, "MODIFIED", new, pod)
            return copy.deepcopy(new)

    # -- delete ------------------------------------------------------------------

    def delete(self, rt: ResourceType, namespace: str | None, name: str,
               opts: DeleteOptions = DeleteOptions()) -> dict[str, Any]:
        """Delete as the API server does (see the module docstring); returns the object as it is afterwards."""
        with self.lock:
            current = self.get(rt, namespace, name)
            meta = current["metadata"]
            if opts.uid and opts.uid != meta["uid"]:
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rt.key} "{name}": Precondition '
                               f"failed: UID in precondition: {opts.uid}, UID in object meta: {meta['uid']}")
            if opts.resource_version and opts.resource_version != meta["resourceVersion"]:
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rt.key} "{name}": Precondition '
                               f"failed: ResourceVersion in precondition: {opts.resource_version}, ResourceVersion "
                               f"in object meta: {meta['resourceVersion']}")
            if opts.propagation not in (None, "Background", "Foreground", "Orphan"):
                raise ApiError(400, "BadRequest", f'propagationPolicy "{opts.propagation}" is not supported: one of '
                               "Background, Foreground, Orphan")
            new = copy.deepcopy(current)
            nm = new["metadata"]
            finalizers = list(nm.get("finalizers") or [])
            if opts.propagation == "Foreground" and FINALIZER_FOREGROUND not in finalizers:
                finalizers.append(FINALIZER_FOREGROUND)
            if opts.propagation == "Orphan" and FINALIZER_ORPHAN not in finalizers:
                finalizers.append(FINALIZER_ORPHAN)
            if meta.get("deletionTimestamp"):
                pending = meta.get("deletionGracePeriodSeconds") or 0
                asked = opts.grace_period if rt.graceful else None
                asked = 1 if asked is not None and asked < 0 else asked
                if pending and asked is not None and asked < pending:  # only a shorter grace period may be given
                    nm["deletionTimestamp"] = timestamp(asked)
                    nm["deletionGracePeriodSeconds"] = asked
                elif pending and finalizers == (meta.get("finalizers") or []):
                    return copy.deepcopy(current)  # the graceful deletion goes on
            else:
                grace = self._grace(rt, current, opts) or 0
                nm["deletionTimestamp"] = timestamp(grace)
                nm["deletionGracePeriodSeconds"] = grace
                nm["generation"] = nm.get("generation", 1) + 1
            if finalizers:
                nm["finalizers"] = finalizers
            key = self._key(rt, namespace, name)
            keep = bool(finalizers) or bool(nm.get("deletionGracePeriodSeconds"))
            if rt.plural == "namespaces":
                keep = True
                new.setdefault("status", {})["phase"] = "Terminating"
            if keep:
                if new == current:
                    return copy.deepcopy(current)
                nm["resourceVersion"] = self._next_rv()
                self.objects[key] = new
                self._emit(rt, "MODIFIED", new, current)
                return copy.deepcopy(new)
            del self.objects[key]
            nm["resourceVersion"] = self._next_rv()
            self._emit(rt, "DELETED", new, current)
            return new

    @staticmethod
    def _grace(rt: ResourceType, pod: dict[str, Any], opts: DeleteOptions) -> int | None:
        """The pod strategy's grace period: the request's, else the pod's own; 0 for a pod on no node or already
        terminated; negative means 1. None for kinds deleted at once."""
        if not rt.graceful:
            return None
        period = opts.grace_period
        if period is None:
            period = int((pod.get("spec") or {}).get("terminationGracePeriodSeconds") or 0)
        if not (pod.get("spec") or {}).get("nodeName") or pod_terminated(pod):
            period = 0
        return 1 if period < 0 else period

    # -- garbage collector and namespace controller ----------------------------------

    def start_controllers(self) -> None:
        self._stop.clear()
        self._controllers = threading.Thread(target=self._controllers_loop, name="k8s-emulator-gc", daemon=True)
        self._controllers.start()

    def stop_controllers(self) -> None:
        self._stop.set()
        self._dirty.set()
        if self._controllers is not None:
            self._controllers.join(timeout=5)

    def _controllers_loop(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait(0.5)
            if self._stop.is_set():
                return
            self._dirty.clear()
            try:
                for _ in range(100):  # until nothing is left to do (bounded, so a bug cannot spin forever)
                    if not self.collect_once():
                        break
            except Exception:  # never let a bug kill the controllers silently
                log.exception("emulated garbage collector failed")

    def collect_once(self) -> bool:
        """One pass of the garbage collector and the namespace controller; whether it changed anything."""
        with self.lock:
            by_uid = {o["metadata"]["uid"]: (k, o) for k, o in self.objects.items()}
            changed = False
            for key, obj in list(self.objects.items()):
                if key not in self.objects:
                    continue
                refs = owner_refs(obj)
                if not refs:
                    continue
                solid, dangling, waiting = [], [], []
                for ref in refs:
                    state = self._owner_state(ref, key, by_uid)
                    {"solid": solid, "dangling": dangling, "waiting": waiting}[state].append(ref)
                rt = self.resource_by_key(key[0])
                ns = key[1] or None
                if not solid and (dangling or waiting):
                    if obj["metadata"].get("deletionTimestamp"):
                        continue
                    policy = "Foreground" if waiting else "Background"
                    self.delete(rt, ns, key[2], DeleteOptions(propagation=policy))
                    changed = True
                elif solid and (dangling or waiting):
                    drop = {r["uid"] for r in dangling + waiting}
                    self._set_refs(rt, ns, key[2], [r for r in refs if r["uid"] not in drop])
                    changed = True
            for key, obj in list(self.objects.items()):
                meta = obj["metadata"]
                if not meta.get("deletionTimestamp"):
                    continue
                rt = self.resource_by_key(key[0])
                ns = key[1] or None
                uid = meta["uid"]
                finalizers = meta.get("finalizers") or []
                if FINALIZER_ORPHAN in finalizers:
                    for dkey, dep in list(self.objects.items()):
                        if any(r.get("uid") == uid for r in owner_refs(dep)):
                            self._set_refs(self.resource_by_key(dkey[0]), dkey[1] or None, dkey[2],
                                           [r for r in owner_refs(dep) if r.get("uid") != uid])
                    self._remove_finalizer(rt, ns, key[2], FINALIZER_ORPHAN)
                    changed = True
                elif FINALIZER_FOREGROUND in finalizers:
                    blocking = [d for d in self.objects.values()
                                if any(r.get("uid") == uid and r.get("blockOwnerDeletion") for r in owner_refs(d))]
                    if not blocking:
                        self._remove_finalizer(rt, ns, key[2], FINALIZER_FOREGROUND)
                        changed = True
                if rt.plural == "namespaces" and key in self.objects:
                    changed |= self._finalize_namespace(key[2])
            return changed

    def _owner_state(self, ref: dict[str, Any], dependent: tuple[str, str, str],
                     by_uid: dict[str, tuple[tuple[str, str, str], dict[str, Any]]]) -> str:
        owner_rt = self.resource_by_kind(str(ref.get("apiVersion")), str(ref.get("kind")))
        if owner_rt is None:
            return "solid"  # a kind this server does not serve cannot be looked up: never collect on its account
        found = by_uid.get(str(ref.get("uid")))
        if found is None:
            return "dangling"
        (okey, owner) = found
        if okey[0] != owner_rt.key or okey[2] != ref.get("name") or (owner_rt.namespaced and okey[1] != dependent[1]):
            return "dangling"
        meta = owner["metadata"]
        if meta.get("deletionTimestamp") and FINALIZER_FOREGROUND in (meta.get("finalizers") or []):
            return "waiting"
        return "solid"

    def _set_refs(self, rt: ResourceType, ns: str | None, name: str, refs: list[dict[str, Any]]) -> None:
        def mutate(cur: dict[str, Any]) -> dict[str, Any]:
            if refs:
                cur["metadata"]["ownerReferences"] = refs
            else:
                cur["metadata"].pop("ownerReferences", None)
            return cur

        self.update(rt, ns, name, mutate, None)

    def _remove_finalizer(self, rt: ResourceType, ns: str | None, name: str, finalizer: str) -> None:
        def mutate(cur: dict[str, Any]) -> dict[str, Any]:
            kept = [f for f in cur["metadata"].get("finalizers") or [] if f != finalizer]
            if kept:
                cur["metadata"]["finalizers"] = kept
            else:
                cur["metadata"].pop("finalizers", None)
            return cur

        self.update(rt, ns, name, mutate, None)

    def _finalize_namespace(self, name: str) -> bool:
        """The namespace controller: delete what is in a Terminating namespace; finalize it once it is empty."""
        content = [(k, o) for k, o in self.objects.items() if k[1] == name and k[0] != "namespaces"]
        changed = False
        for key, obj in content:
            if not obj["metadata"].get("deletionTimestamp"):
                self.delete(self.resource_by_key(key[0]), name, key[2])
                changed = True
        if content:
            return changed
        namespaces = self.resource_by_key("namespaces")
        ns = self.get(namespaces, None, name)
        if FINALIZER_NAMESPACE in ((ns.get("spec") or {}).get("finalizers") or []):
            new = copy.deepcopy(ns)
            new["spec"]["finalizers"] = [f for f in new["spec"]["finalizers"] if f != FINALIZER_NAMESPACE]
            key = self._key(namespaces, None, name)
            new["metadata"]["resourceVersion"] = self._next_rv()
            if not new["spec"]["finalizers"] and not new["metadata"].get("finalizers"):
                del self.objects[key]
                self._emit(namespaces, "DELETED", new, ns)
            else:
                self.objects[key] = new
                self._emit(namespaces, "MODIFIED", new, ns)
            return True
        return changed

    # -- watches -------------------------------------------------------------

    def open_watch(self, filt: Filter, loop: asyncio.AbstractEventLoop, since: str | None,
                   bookmarks: bool = False) -> tuple[Watcher, list[dict[str, Any]]]:
        """Register a watcher and return the events it must see first (atomically: nothing is missed)."""
        with self.lock:
            if since in (None, "", "0"):
                initial = [{"type": "ADDED", "object": copy.deepcopy(o)} for o in self.list(filt)]
            else:
                try:
                    rv = int(str(since))
                except ValueError as exc:
                    raise ApiError(400, "BadRequest", f"resourceVersion must be an integer, got {since!r}") from exc
                oldest = self.expired_upto[filt.rt.key]
                if rv < oldest:
                    raise gone(rv, oldest)
                initial = [e for ev in self.windows[filt.rt.key] if ev.rv > rv
                           and (e := event_for(filt, ev)) is not None]
            watcher = Watcher(filt, loop, bookmarks)
            self.watchers.add(watcher)
            return watcher, initial

    def bookmark(self, watcher: Watcher) -> None:
        """Queue a BOOKMARK with the current resourceVersion behind every event already queued for ``watcher``."""
        with self.lock:
            rt = watcher.filt.rt
            watcher.offer({"type": "BOOKMARK", "object": {"kind": rt.kind, "apiVersion": rt.api_version,
                                                          "metadata": {"resourceVersion": str(self.rv)}}})

    def close_watch(self, watcher: Watcher) -> None:
        with self.lock:
            self.watchers.discard(watcher)

    def compact(self) -> None:
        with self.lock:
            for key in self.windows:
                self.windows[key].clear()
                self.expired_upto[key] = self.rv

    def end_watches(self, gone_: bool) -> int:
        with self.lock:
            watchers = list(self.watchers)
            for w in watchers:
                if gone_:
                    w.offer({"type": "ERROR", "object": gone(self.rv, self.expired_upto[w.filt.rt.key]).status()})
                w.offer(None)
            return len(watchers)
