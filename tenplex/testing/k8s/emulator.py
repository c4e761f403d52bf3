"""An in-process Kubernetes API server for tests, spoken to over real HTTP, behaving as kube-apiserver does.

No kube-apiserver can be obtained on the machines this project is built on
(see the shared notes), and ``kmock`` 0.8 lacks what the scheduler's
Kubernetes backend relies on. This server emulates the part of the API an
operator meets, as the real server behaves wherever a difference could hide
an operator bug:

* resources: pods (``status``, ``binding``, ``eviction`` honouring
  PodDisruptionBudgets), nodes, namespaces, services, configmaps, secrets,
  serviceaccounts, events, leases, poddisruptionbudgets, daemonsets, the RBAC
  kinds, and custom resources served from their CRD (the ElasticJob, with its
  ``status`` and ``scale`` subresources);
* create (``generateName`` too), get, list, replace (PUT), patch (JSON merge
  patch, JSON patch, strategic merge patch for built-in kinds with keyed lists
  and set-merged finalizers), delete (graceful for pods, finalizers,
  foreground/background/orphan propagation), delete collection;
  :mod:`~tenplex.testing.k8s.store` says what each write checks and does;
* validation of built-in kinds against Kubernetes 1.33's OpenAPI schemas and
  the API server's semantic rules, of custom resources against their
  structural schema and CEL rules (:mod:`~tenplex.testing.k8s.admission`);
  unknown fields by ``fieldValidation``: ``Strict`` (kubectl's default) a 400,
  ``Warn`` (the default) dropped with a ``Warning`` header, ``Ignore`` dropped;
* admission: namespaces must exist, ServiceAccount admission, PodSecurity
  admission by namespace label;
* authentication by bearer token and RBAC authorization against the stored
  Roles and ClusterRoles; every request is recorded with the attributes RBAC
  decides on (:mod:`~tenplex.testing.k8s.rbac`);
* list and watch with label selectors and the field selectors each resource
  supports (another one is a 400), ``timeoutSeconds``, BOOKMARK events when
  asked for (every ``bookmark_interval`` seconds and 2 s before the watch's
  timeout), a small window of events per resource: resuming from before it is
  410 Gone;
* garbage collection and the namespace controller on a background thread.

Test hooks (thread-safe) change the world the way kubelets, node controllers
and operators do: :meth:`add_node`, :meth:`set_node_ready`,
:meth:`cordon_node`, :meth:`drain_node`, :meth:`evict_node_pods`,
:meth:`set_pod_running`, :meth:`fail_pod`, :meth:`set_pod_succeeded`,
:meth:`force_delete`, and :meth:`expire_watches` / :meth:`compact` to force
410 Gone. Graceful pod deletion needs a kubelet to confirm it: run a
:class:`~tenplex.testing.k8s.kubelet.LocalKubelet` or a
:class:`~tenplex.testing.k8s.kubelet.NodeAgent` per node.

Not emulated: server-side apply and dry runs (answered with a clear 4xx),
protobuf (415, so clients fall back to JSON), pagination (``limit`` returns
everything), controllers other than the garbage collector and the namespace
and service-account controllers (nothing schedules or runs pods unless a test
does), the node authorizer (nodes are trusted), aggregated discovery.

Usage::

    with ApiServerEmulator() as api:
        core = kubernetes.client.CoreV1Api(api.api_client())
        core.create_namespaced_pod("default", {...})
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import itertools
import json
import logging
import secrets
import socket
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from tenplex.k8s import crd
from tenplex.testing.k8s import rbac
from tenplex.testing.k8s.objects import (
    ApiError,
    Filter,
    ResourceType,
    apply_patch,
    get_path,
    merge_patch,
    now,
    parse_field_selector,
    parse_label_selector,
    selector_text,
)
from tenplex.testing.k8s.rbac import ADMIN_USER, Access, User
from tenplex.testing.k8s.store import (
    FIELD_VALIDATIONS,
    WATCH_WINDOW,
    DeleteOptions,
    Store,
    Watcher,
    WriteOptions,
    pod_gpus,
)

LOG = logging.getLogger(__name__)

BOOKMARK_INTERVAL = 60.0
"""Seconds between BOOKMARK events on a watch that asked for them (the real server's frequency)."""
ADMIN_TOKEN = "emulator-admin"
_POD_FIELDS = {f: tuple(f.split(".")) for f in (
    "spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName", "spec.hostNetwork",
    "status.phase", "status.podIP", "status.nominatedNodeName")}
_EVENT_FIELDS = {f: tuple(f.split(".")) for f in (
    "involvedObject.kind", "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
    "involvedObject.apiVersion", "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason",
    "reportingComponent", "source", "type")}


def default_resources() -> tuple[ResourceType, ...]:
    rbac_group = "rbac.authorization.k8s.io"
    return (
        ResourceType("", "v1", "pods", "Pod", True, status_subresource=True, returns_object_on_delete=True,
                     graceful=True, fields=_POD_FIELDS, short_names=("po",)),
        ResourceType("", "v1", "nodes", "Node", False, status_subresource=True,
                     fields={"spec.unschedulable": ("spec", "unschedulable")}, short_names=("no",)),
        ResourceType("", "v1", "namespaces", "Namespace", False, status_subresource=True,
                     fields={"status.phase": ("status", "phase")}, short_names=("ns",)),
        ResourceType("", "v1", "services", "Service", True, status_subresource=True, short_names=("svc",)),
        ResourceType("", "v1", "configmaps", "ConfigMap", True, short_names=("cm",)),
        ResourceType("", "v1", "secrets", "Secret", True, fields={"type": ("type",)}),
        ResourceType("", "v1", "serviceaccounts", "ServiceAccount", True, short_names=("sa",)),
        ResourceType("", "v1", "events", "Event", True, fields=_EVENT_FIELDS, short_names=("ev",)),
        ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True),
        ResourceType("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, status_subresource=True,
                     short_names=("pdb",)),
        ResourceType("apps", "v1", "daemonsets", "DaemonSet", True, status_subresource=True, short_names=("ds",)),
        ResourceType(rbac_group, "v1", "roles", "Role", True),
        ResourceType(rbac_group, "v1", "rolebindings", "RoleBinding", True),
        ResourceType(rbac_group, "v1", "clusterroles", "ClusterRole", False),
        ResourceType(rbac_group, "v1", "clusterrolebindings", "ClusterRoleBinding", False),
        ResourceType.from_crd(crd.crd_manifest()),
    )


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


def _pod_healthy(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _blocking_budget(store: Store, namespace: str, pod: Mapping[str, Any]) -> str | None:
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
    for pdb in store.list(Filter(pdb_rt, namespace)):
        reqs = parse_label_selector(selector_text(pdb.get("spec", {}).get("selector")))
        if not reqs or not all(r.matches(labels) for r in reqs):
            continue
        selected = store.list(Filter(pods_rt, namespace, reqs))
        healthy = sum(1 for p in selected if _pod_healthy(p))
        spec = pdb.get("spec") or {}
        if "maxUnavailable" in spec:
            allowed = int(spec["maxUnavailable"]) - (len(selected) - healthy)
        else:
            allowed = healthy - int(spec.get("minAvailable", 1))
        if allowed <= 0:
            return str(pdb["metadata"]["name"])
    return None


def _verb(method: str, target: _Target, watch: bool) -> str:
    if method == "GET":
        return "get" if target.name is not None else ("watch" if watch else "list")
    return {"POST": "create", "PUT": "update", "PATCH": "patch",
            "DELETE": "delete" if target.name is not None else "deletecollection"}.get(method, method.lower())


def _int_param(value: Any, what: str) -> int | None:
    if value in (None, ""):
        return None
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, "BadRequest", f"{what} must be an integer, got {value!r}") from exc


class _App:
    def __init__(self, server: ApiServerEmulator) -> None:
        self.server = server
        self.store = server.store
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
                              "kind": rt.kind, "verbs": verbs, "shortNames": list(rt.short_names),
                              "categories": list(rt.categories)})
            if rt.status_subresource:
                resources.append({"name": f"{rt.plural}/status", "singularName": "", "namespaced": rt.namespaced,
                                  "kind": rt.kind, "verbs": ["get", "patch", "update"]})
            if rt.scale is not None:
                resources.append({"name": f"{rt.plural}/scale", "singularName": "", "namespaced": rt.namespaced,
                                  "group": "autoscaling", "version": "v1", "kind": "Scale", "verbs": ["get", "patch", "update"]})
            if rt.plural == "pods":
                resources.append({"name": "pods/binding", "singularName": "", "namespaced": True, "kind": "Binding",
                                  "verbs": ["create"]})
                resources.append({"name": "pods/eviction", "singularName": "", "namespaced": True, "group": "policy",
                                  "version": "v1", "kind": "Eviction", "verbs": ["create"]})
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

    def _user(self, request: Request) -> User:
        auth = request.headers.get("authorization", "")
        if not auth:
            # kubectl (client-go) sends no token over plain HTTP: such requests act as the admin, as on the API
            # server's old insecure port. Every client this project writes sends its token.
            return ADMIN_USER
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        user = self.server.user_of(token)
        if user is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return user

    def _authorize(self, user: User, t: _Target, verb: str) -> None:
        access = Access(user.name, verb, t.rt.group, t.rt.plural, t.subresource or "", t.namespace or "", t.name or "")
        with self.store.lock:
            allowed = rbac.authorize(self.store.rbac_objects(), user, access)
        self.server.record(access, allowed)
        if not allowed:
            res = f"{t.rt.plural}/{t.subresource}" if t.subresource else t.rt.plural
            scope = f'in the namespace "{t.namespace}"' if t.namespace else "at the cluster scope"
            named = f'"{t.name}" ' if t.name is not None else ""
            raise ApiError(403, "Forbidden", f'{t.rt.key} {named}is forbidden: User "{user.name}" cannot {verb} '
                           f'resource "{res}" in API group "{t.rt.group}" {scope}',
                           {"name": t.name or "", "group": t.rt.group, "kind": t.rt.plural})

    async def dispatch(self, request: Request) -> Response | _WatchResponse:
        warnings: list[str] = []
        try:
            target = self._target(request.path_params["path"])
            if isinstance(target, dict):
                return JSONResponse(target)
            user = self._user(request)
            q = request.query_params
            self._authorize(user, target, _verb(request.method, target, q.get("watch") in ("true", "1")))
            field_validation = q.get("fieldValidation") or "Warn"
            if field_validation not in FIELD_VALIDATIONS:
                raise ApiError(400, "BadRequest", f"fieldValidation must be one of {', '.join(FIELD_VALIDATIONS)}, "
                                                  f"got {field_validation!r}")
            opts = WriteOptions(user=user, field_validation=field_validation, warnings=warnings)
            response = await self._serve(request, target, opts)
        except ApiError as err:
            response = JSONResponse(err.status(), status_code=err.code)
        if warnings and isinstance(response, Response):
            response.headers["Warning"] = ", ".join(f'299 - "{w.replace(chr(34), chr(92) + chr(34))}"' for w in warnings)
        return response

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

    async def _delete_options(self, request: Request) -> DeleteOptions:
        """DeleteOptions from the body (JSON) and the query; kubectl's protobuf bodies read as the defaults."""
        ctype = request.headers.get("content-type", "application/json")
        body: Any = {}
        if "json" in ctype:
            body = await self._body(request) or {}
        else:
            await request.body()
        if not isinstance(body, Mapping):
            body = {}
        q = request.query_params
        propagation = q.get("propagationPolicy") or body.get("propagationPolicy")
        orphan = q.get("orphanDependents") or body.get("orphanDependents")
        if propagation is None and orphan is not None:
            propagation = "Orphan" if str(orphan).lower() == "true" else "Background"
        grace = _int_param(q.get("gracePeriodSeconds", body.get("gracePeriodSeconds")), "gracePeriodSeconds")
        pre = body.get("preconditions") or {}
        return DeleteOptions(propagation, grace, pre.get("uid"), pre.get("resourceVersion"))

    async def _serve(self, request: Request, t: _Target, opts: WriteOptions) -> Response | _WatchResponse:
        method, q, store = request.method, request.query_params, self.store
        if q.get("dryRun") and method != "GET":
            # Refused rather than ignored: an ignored dry run would change the state a test relies on.
            raise ApiError(400, "BadRequest", f"dryRun={q.get('dryRun')} is not supported by the emulator")
        if t.name is None:
            filt = Filter(t.rt, t.namespace, parse_label_selector(q.get("labelSelector")),
                          parse_field_selector(t.rt, q.get("fieldSelector")))
            if method == "GET" and q.get("watch") in ("true", "1"):
                return self._watch(filt, q.get("resourceVersion"), q.get("timeoutSeconds"),
                                   q.get("allowWatchBookmarks") in ("true", "1"))
            if method == "GET":
                with store.lock:
                    items, rv = copy.deepcopy(store.list(filt)), store.rv
                if _wants_table(request, t.rt):
                    return JSONResponse(_table(t.rt, items, rv))
                return JSONResponse({"kind": f"{t.rt.kind}List", "apiVersion": t.rt.api_version,
                                     "metadata": {"resourceVersion": str(rv)}, "items": items})
            if method == "POST":
                return JSONResponse(store.create(t.rt, t.namespace, await self._body(request), opts), status_code=201)
            if method == "DELETE":
                options = await self._delete_options(request)
                with store.lock:
                    names = [(o["metadata"].get("namespace"), o["metadata"]["name"]) for o in store.list(filt)]
                    for ns, name in names:
                        store.delete(t.rt, ns, name, options)
                return JSONResponse({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                     "details": {"kind": t.rt.plural, "group": t.rt.group}})
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on a collection")

        if t.subresource == "scale":
            return await self._scale(request, t, opts)
        if t.subresource == "binding":
            if method != "POST":
                raise ApiError(405, "MethodNotAllowed", "bindings are created with POST")
            body = await self._body(request)
            target = (body or {}).get("target") or {}
            if target.get("kind", "Node") != "Node" or not target.get("name"):
                raise ApiError(400, "BadRequest", f"a Binding needs target.kind Node and target.name, got {target!r}")
            store.bind(t.namespace or "", t.name, target["name"])
            return JSONResponse({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201},
                                status_code=201)
        if t.subresource == "eviction":
            if method != "POST":
                raise ApiError(405, "MethodNotAllowed", "evictions are created with POST")
            body = await self._body(request) or {}
            del_opts = (body.get("deleteOptions") or {}) if isinstance(body, Mapping) else {}
            with store.lock:
                blocking = _blocking_budget(store, t.namespace or "", store.get(t.rt, t.namespace, t.name))
                if blocking is not None:
                    raise ApiError(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption "
                                   "budget.", {"causes": [{"reason": "DisruptionBudget",
                                                            "message": f"The disruption budget {blocking} is not met"}]})
                store.delete(t.rt, t.namespace, t.name, DeleteOptions(
                    grace_period=_int_param(del_opts.get("gracePeriodSeconds"), "gracePeriodSeconds")))
            return JSONResponse({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201},
                                status_code=201)
        if method == "GET":
            with store.lock:
                obj, rv = copy.deepcopy(store.get(t.rt, t.namespace, t.name)), store.rv
            return JSONResponse(_table(t.rt, [obj], rv) if _wants_table(request, t.rt) else obj)
        if method == "PUT":
            body = await self._body(request)
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "the body of an update must be a JSON object")
            meta = body.get("metadata") or {}
            if meta.get("name") not in (None, t.name):
                raise ApiError(400, "BadRequest", f"the name of the object ({meta.get('name')}) does not match the name on the URL ({t.name})")
            return JSONResponse(store.update(t.rt, t.namespace, t.name, lambda _cur: copy.deepcopy(body), t.subresource,
                                             opts=opts))
        if method == "PATCH":
            body = await self._body(request)
            ctype = request.headers.get("content-type", "")
            return JSONResponse(store.update(t.rt, t.namespace, t.name,
                                             lambda cur: apply_patch(t.rt, cur, body, ctype), t.subresource, opts=opts))
        if method == "DELETE":
            if t.subresource:
                raise ApiError(405, "MethodNotAllowed", f"DELETE is not allowed on /{t.subresource}")
            after = store.delete(t.rt, t.namespace, t.name, await self._delete_options(request))
            with store.lock:
                pending = store.find(t.rt, t.namespace, t.name) is not None
            if t.rt.returns_object_on_delete or pending:  # a deletion still pending answers the object as it is
                return JSONResponse(after)
            return JSONResponse({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                 "details": {"name": t.name, "group": t.rt.group, "kind": t.rt.plural,
                                             "uid": after["metadata"]["uid"]}})
        raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")

    # -- scale -----------------------------------------------------------------

    def _scale_view(self, rt: ResourceType, obj: Mapping[str, Any]) -> dict[str, Any]:
        assert rt.scale is not None
        meta = obj["metadata"]
        status: dict[str, Any] = {"replicas": get_path(obj, rt.scale.status_replicas) or 0}
        selector = get_path(obj, rt.scale.label_selector)
        if selector:
            status["selector"] = selector
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp") if k in meta},
                "spec": {"replicas": get_path(obj, rt.scale.spec_replicas) or 0}, "status": status}

    async def _scale(self, request: Request, t: _Target, opts: WriteOptions) -> Response:
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
                new_view = apply_patch(rt, view, body, ctype)
            replicas = (new_view.get("spec") or {}).get("replicas")
            if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
                raise ApiError(422, "Invalid", f'Scale.autoscaling "{t.name}" is invalid: spec.replicas: Invalid value: '
                                               f"{replicas!r}: must be greater than or equal to 0")

            def mutate(cur: dict[str, Any]) -> dict[str, Any]:
                target = cur
                for p in mapping.spec_replicas[:-1]:
                    target = target.setdefault(p, {})
                target[mapping.spec_replicas[-1]] = replicas
                return cur

            # A Scale carrying a stale resourceVersion is a conflict, as for the object itself.
            sent_rv = (new_view.get("metadata") or {}).get("resourceVersion")
            updated = store.update(rt, t.namespace, t.name, mutate, None, expected_rv=sent_rv, opts=opts)
        return JSONResponse(self._scale_view(rt, updated))

    # -- watch -----------------------------------------------------------------

    def _watch(self, filt: Filter, since: str | None, timeout: str | None, bookmarks: bool) -> _WatchResponse:
        try:
            seconds = float(timeout) if timeout else None
        except ValueError as exc:
            raise ApiError(400, "BadRequest", f"timeoutSeconds must be a number, got {timeout!r}") from exc
        loop = asyncio.get_running_loop()
        try:
            watcher, initial = self.store.open_watch(filt, loop, since, bookmarks)
        except ApiError as err:
            if err.code != 410:
                raise
            # The real server answers an expired watch with 200 and one ERROR event.
            line = json.dumps({"type": "ERROR", "object": err.status()}).encode() + b"\n"

            async def once() -> AsyncIterator[bytes]:
                yield line

            return _WatchResponse(once())
        return _WatchResponse(self._stream(watcher, initial, seconds))

    async def _stream(self, watcher: Watcher, initial: list[dict[str, Any]], seconds: float | None) -> AsyncIterator[bytes]:
        """The watch's events, with BOOKMARKs when asked for, until its timeout, an ERROR or the server's stop.

        One pending ``queue.get()`` is kept across the waits (``asyncio.wait`` with a timeout never cancels it):
        cancelling a get that has just taken an item, as ``asyncio.wait_for`` does on Python 3.11, would lose that
        event, and a later BOOKMARK would carry the client's resourceVersion past it.
        """
        loop = asyncio.get_running_loop()
        deadline = None if seconds is None else loop.time() + seconds
        interval = self.server.bookmark_interval
        next_bookmark = loop.time() + interval
        if deadline is not None and seconds is not None and seconds > 2:  # one 2 s before the end, as the real server
            next_bookmark = min(next_bookmark, deadline - 2)
        getter: asyncio.Future[dict[str, Any] | None] | None = None
        try:
            for event in initial:
                yield json.dumps(event).encode() + b"\n"
            while not self.server.stopping.is_set():
                current = loop.time()
                remaining = None if deadline is None else deadline - current
                if remaining is not None and remaining <= 0:
                    return
                if watcher.bookmarks and current >= next_bookmark:
                    self.store.bookmark(watcher)
                    next_bookmark = current + interval
                    if deadline is not None and deadline - 2 > current:
                        next_bookmark = min(next_bookmark, deadline - 2)
                wait = remaining
                if watcher.bookmarks:
                    wait = next_bookmark - current if wait is None else min(wait, max(0.0, next_bookmark - current))
                if getter is None:
                    getter = asyncio.ensure_future(watcher.queue.get())
                done, _ = await asyncio.wait({getter}, timeout=wait)
                if not done:
                    continue
                item, getter = getter.result(), None
                if item is None:
                    return
                yield json.dumps(item).encode() + b"\n"
                if item["type"] == "ERROR":
                    return
        finally:
            if getter is not None:
                getter.cancel()
            self.store.close_watch(watcher)


# --------------------------------------------------------------------------- the server


class ApiServerEmulator:
    """The emulator's HTTP server on ``host``:ephemeral port in a background thread, plus test hooks.

    ``watch_window``: watch events kept per resource (resuming from before them is 410 Gone);
    ``bookmark_interval``: seconds between BOOKMARKs on watches that ask for them.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, resources: Iterable[ResourceType] | None = None, *,
                 watch_window: int = WATCH_WINDOW, bookmark_interval: float = BOOKMARK_INTERVAL) -> None:
        self.store = Store(resources if resources is not None else default_resources(), watch_window=watch_window)
        self.bookmark_interval = bookmark_interval
        self.stopping = threading.Event()
        self._tokens: dict[str, User] = {ADMIN_TOKEN: ADMIN_USER}
        self._accesses: list[Access] = []
        self._access_lock = threading.Lock()
        self._app = _App(self)
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
        self.store.start_controllers()
        LOG.info("Kubernetes API server emulator listening on %s", self.url)
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.store.stop_controllers()
        self.store.end_watches(gone_=False)
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
            self.stopping.clear()
            self.start()

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._port}"

    # -- users and what they did -----------------------------------------------------

    def token_for(self, user: User) -> str:
        """A bearer token that authenticates as ``user`` (a new one each call)."""
        token = secrets.token_urlsafe(16)
        self._tokens[token] = user
        return token

    def user_of(self, token: str) -> User | None:
        return self._tokens.get(token)

    def record(self, access: Access, allowed: bool) -> None:
        entry = Access(access.user, access.verb, access.group, access.resource, access.subresource, access.namespace,
                       access.name, allowed)
        with self._access_lock:
            self._accesses.append(entry)

    def accesses(self, user: str | None = None) -> list[Access]:
        """Every request made so far (of ``user``), with its RBAC attributes and whether RBAC allowed it."""
        with self._access_lock:
            return [a for a in self._accesses if user is None or a.user == user]

    def warnings(self, user: str | None = None) -> list[str]:
        """The unknown-field warnings the server answered (to ``user``)."""
        with self.store.lock:
            return [w for u, w in self.store.warnings if user is None or u == user]

    def gpu_overbookings(self) -> list[str]:
        """Every time a node was given more GPUs than it has (its Terminating pods' GPUs count until they are gone)."""
        with self.store.lock:
            return list(self.store.overbooked)

    def client_configuration(self, user: User | None = None) -> Any:
        """A ``kubernetes.client.Configuration`` pointing at the emulator, authenticated as ``user`` (admin by default)."""
        from kubernetes import client

        cfg = client.Configuration(host=self.url)
        cfg.verify_ssl = False
        cfg.api_key = {"authorization": self.token_for(user) if user is not None else ADMIN_TOKEN}
        cfg.api_key_prefix = {"authorization": "Bearer"}
        return cfg

    def api_client(self, user: User | None = None) -> Any:
        """A fresh ``kubernetes.client.ApiClient`` for the emulator (close it when done)."""
        from kubernetes import client

        return client.ApiClient(self.client_configuration(user))

    def kubeconfig(self, user: User | None = None) -> dict[str, Any]:
        """A kubeconfig (as data) for tools such as kubectl."""
        token = self.token_for(user) if user is not None else ADMIN_TOKEN
        return {"apiVersion": "v1", "kind": "Config", "current-context": "emulator",
                "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
                "users": [{"name": "test", "user": {"token": token}}],
                "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "test", "namespace": "default"}}]}

    # -- direct state access (bypasses HTTP, same rules, as the admin) ------------------

    @property
    def resource_version(self) -> int:
        with self.store.lock:
            return self.store.rv

    def get(self, resource: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        rt = self.store.resource_by_key(resource)
        with self.store.lock:
            return copy.deepcopy(self.store.get(rt, namespace, name))

    def find(self, resource: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        rt = self.store.resource_by_key(resource)
        with self.store.lock:
            obj = self.store.find(rt, namespace, name)
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, resource: str, namespace: str | None = None, label_selector: str | None = None) -> list[dict[str, Any]]:
        rt = self.store.resource_by_key(resource)
        with self.store.lock:
            return copy.deepcopy(self.store.list(Filter(rt, namespace, parse_label_selector(label_selector))))

    def create(self, resource: str, obj: Mapping[str, Any], namespace: str | None = None) -> dict[str, Any]:
        rt = self.store.resource_by_key(resource)
        ns = namespace or (obj.get("metadata") or {}).get("namespace") or ("default" if rt.namespaced else None)
        return self.store.create(rt, ns, copy.deepcopy(dict(obj)))

    def apply(self, manifests: Iterable[Mapping[str, Any]], namespace: str = "default") -> list[dict[str, Any]]:
        """Create rendered manifests (``helm template`` output) of kinds this server serves, as ``helm install`` would;
        returns what was created."""
        out = []
        for doc in manifests:
            rt = self.store.resource_by_kind(str(doc.get("apiVersion")), str(doc.get("kind")))
            if rt is None:
                continue
            ns = (doc.get("metadata") or {}).get("namespace") or namespace
            if rt.namespaced and self.find("namespaces", ns) is None:
                self.create_namespace(ns)
            out.append(self.store.create(rt, ns if rt.namespaced else None, copy.deepcopy(dict(doc))))
        return out

    def create_namespace(self, name: str, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name}
        if labels:
            meta["labels"] = dict(labels)
        return self.create("namespaces", {"metadata": meta})

    def patch(self, resource: str, name: str, patch: Mapping[str, Any], namespace: str | None = None,
              subresource: str | None = None) -> dict[str, Any]:
        """JSON-merge-patch an object (``subresource="status"`` to write its status)."""
        rt = self.store.resource_by_key(resource)
        return self.store.update(rt, namespace, name, lambda cur: merge_patch(cur, patch), subresource)

    def delete(self, resource: str, name: str, namespace: str | None = None, *, grace_period: int | None = None,
               propagation: str | None = None) -> dict[str, Any]:
        """Delete as ``kubectl delete`` does (a bound pod is deleted gracefully: its kubelet must confirm)."""
        return self.store.delete(self.store.resource_by_key(resource), namespace, name,
                                 DeleteOptions(propagation=propagation, grace_period=grace_period))

    def force_delete(self, resource: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        """``kubectl delete --grace-period=0 --force``: gone at once, whatever its kubelet is doing."""
        return self.delete(resource, name, namespace, grace_period=0)

    def collect_garbage(self) -> None:
        """Run the garbage collector and the namespace controller until they have nothing left to do."""
        while self.store.collect_once():
            pass

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
        return {"type": "Ready", "status": status, "reason": reason, "lastTransitionTime": now(), "lastHeartbeatTime": now(),
                "message": "kubelet is posting ready status" if ready else "Kubelet stopped posting node status."}

    def set_node_ready(self, name: str, ready: bool | None) -> dict[str, Any]:
        """Set the node's Ready condition: True, False, or None for Unknown (the node controller's view of a lost node)."""
        with self.store.lock:
            node = self.get("nodes", name)
            conds = [c for c in node.get("status", {}).get("conditions", []) if c.get("type") != "Ready"]
            conds.append(self._ready_condition(ready))
            patch: dict[str, Any] = {"status": {"conditions": conds}}
            updated = self.patch("nodes", name, patch, subresource="status")
            taints = [t for t in updated.get("spec", {}).get("taints", []) if t.get("key") != "node.kubernetes.io/not-ready"]
            if ready is not True:
                taints.append({"key": "node.kubernetes.io/not-ready", "effect": "NoExecute", "timeAdded": now()})
            return self.patch("nodes", name, {"spec": {"taints": taints or None}})

    def cordon_node(self, name: str, cordoned: bool = True) -> dict[str, Any]:
        """``kubectl cordon``/``uncordon``: spec.unschedulable and its taint."""
        with self.store.lock:
            node = self.get("nodes", name)
            taints = [t for t in node.get("spec", {}).get("taints", []) if t.get("key") != "node.kubernetes.io/unschedulable"]
            if cordoned:
                taints.append({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule", "timeAdded": now()})
            return self.patch("nodes", name, {"spec": {"unschedulable": True if cordoned else None, "taints": taints or None}})

    def drain_node(self, name: str) -> list[str]:
        """``kubectl drain`` with budgets disregarded: cordon, then delete every pod bound to the node (gracefully:
        they stay Terminating until their kubelet confirms); returns ``ns/name`` of those pods."""
        self.cordon_node(name)
        evicted = []
        with self.store.lock:
            pods = [p for p in self.list("pods") if p.get("spec", {}).get("nodeName") == name]
            for pod in pods:
                meta = pod["metadata"]
                if not meta.get("deletionTimestamp"):
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
        with self.store.lock:
            pods = [p for p in self.list("pods") if p.get("spec", {}).get("nodeName") == name
                    and not any(o.get("kind") == "DaemonSet" for o in p["metadata"].get("ownerReferences") or [])]
            for pod in pods:
                meta = pod["metadata"]
                if _blocking_budget(self.store, meta["namespace"], pod) is not None:
                    blocked.append(f"{meta['namespace']}/{meta['name']}")
                    continue
                if not meta.get("deletionTimestamp"):
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
        """Bind the pod to ``node`` (through the binding subresource, unless already bound) and report it Running
        and Ready."""
        with self.store.lock:
            pod = self.get("pods", name, namespace)
            bound = pod.get("spec", {}).get("nodeName")
            if node is not None and bound not in (None, node):
                raise ValueError(f"pod {namespace}/{name} is bound to {bound}, not {node}")
            node = bound or node
            if node is None:
                raise ValueError(f"pod {namespace}/{name} is not bound to a node; pass node=")
            if not bound:
                self.store.bind(namespace, name, node)
            containers = pod.get("spec", {}).get("containers", [])
            status = {
                "phase": "Running", "hostIP": self.node_address(node), "podIP": pod_ip or self.node_address(node),
                "startTime": now(),
                "conditions": [{"type": t, "status": "True", "lastTransitionTime": now()}
                               for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
                "containerStatuses": [{"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": True,
                                       "restartCount": 0, "started": True,
                                       "state": {"running": {"startedAt": now()}}} for c in containers],
            }
            return self.patch("pods", name, {"status": status}, namespace, subresource="status")

    def _terminate_pod(self, name: str, namespace: str, phase: str, exit_code: int, reason: str, message: str) -> dict[str, Any]:
        with self.store.lock:
            pod = self.get("pods", name, namespace)
            status = terminated_status(pod, phase, exit_code, reason, message)
            return self.patch("pods", name, {"status": status}, namespace, subresource="status")

    def fail_pod(self, name: str, namespace: str = "default", *, exit_code: int = 137, reason: str = "Error",
                 message: str = "the container exited with a failure") -> dict[str, Any]:
        """Report the pod Failed, its containers terminated with ``exit_code``."""
        return self._terminate_pod(name, namespace, "Failed", exit_code, reason, message)

    def set_pod_succeeded(self, name: str, namespace: str = "default") -> dict[str, Any]:
        return self._terminate_pod(name, namespace, "Succeeded", 0, "Completed", "")

    def gpus_in_use(self, node: str) -> int:
        """GPUs the node's pods hold (every pod not terminated, Terminating ones included)."""
        return sum(pod_gpus(p) for p in self.list("pods") if (p.get("spec") or {}).get("nodeName") == node
                   and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))

    # -- watches -----------------------------------------------------------------------

    def compact(self) -> None:
        """Forget the watch history: resuming from any resourceVersion seen so far answers 410 Gone."""
        self.store.compact()

    def expire_watches(self) -> int:
        """Compact, and end every open watch with an ERROR 410 Gone event; returns how many were open."""
        self.store.compact()
        return self.store.end_watches(gone_=True)

    def close_watches(self) -> int:
        """End every open watch normally (as a server-side timeout does); returns how many were open."""
        return self.store.end_watches(gone_=False)

    def open_watches(self) -> int:
        with self.store.lock:
            return len(self.store.watchers)


def terminated_status(pod: Mapping[str, Any], phase: str, exit_code: int, reason: str, message: str = "") -> dict[str, Any]:
    """A pod's status once its containers ended (what a kubelet reports)."""
    containers = (pod.get("spec") or {}).get("containers") or []
    status = dict(pod.get("status") or {})
    status.update(phase=phase, reason=reason, message=message)
    if not message:
        status.pop("message", None)
    status["conditions"] = [{"type": t, "status": "False" if t in ("Ready", "ContainersReady") else "True",
                             "lastTransitionTime": now()}
                            for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
    status["containerStatuses"] = [
        {"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": False, "restartCount": 0,
         "started": False, "state": {"terminated": {"exitCode": exit_code, "reason": reason,
                                                    **({"message": message} if message else {}),
                                                    "finishedAt": now()}}}
        for c in containers]
    return status


def secret_data(values: Mapping[str, str]) -> dict[str, str]:
    """A Secret's ``data`` from plain strings (base64, as the API stores them)."""
    return {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}
