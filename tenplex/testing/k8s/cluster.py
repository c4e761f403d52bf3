"""The test cluster as tests use it: a :class:`~tenplex.testing.k8s.controlplane.ControlPlane` plus the
cluster admin's verbs (get, list, create, apply, patch, delete), the node side a test plays where no kubelet
runs (a node's Ready condition, a pod's reported status), and a reset between tests sharing one cluster.

Everything goes through the real API server over HTTPS as the admin (``system:masters``): what a test writes
is validated, defaulted, admitted and stored exactly as any client's request would be, and what the test
kubelets and the scheduler see of it comes from the server's watches.

Sharing: one cluster serves every test of a pytest worker (its start costs seconds). :meth:`TestCluster.reset`
returns it to its first state after each test: every namespace a test made is deleted, the ``default``
namespace is emptied (finalizers stripped, pods removed at once), and every Node and every cluster-scoped
object a test created goes, so the next test may reuse node and object names.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from tenplex.k8s import crd

from .controlplane import ControlPlane, User

LOG = logging.getLogger(__name__)

SYSTEM_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
        if subresource:
            base += f"/{subresource}"
        return base


_RBAC = "rbac.authorization.k8s.io"
RESOURCES = {r.plural: r for r in (
    Resource("", "v1", "pods", "Pod", True),
    Resource("", "v1", "nodes", "Node", False),
    Resource("", "v1", "namespaces", "Namespace", False),
    Resource("", "v1", "services", "Service", True),
    Resource("", "v1", "endpoints", "Endpoints", True),
    Resource("", "v1", "configmaps", "ConfigMap", True),
    Resource("", "v1", "secrets", "Secret", True),
    Resource("", "v1", "serviceaccounts", "ServiceAccount", True),
    Resource("", "v1", "events", "Event", True),
    Resource("", "v1", "resourcequotas", "ResourceQuota", True),
    Resource("", "v1", "limitranges", "LimitRange", True),
    Resource("coordination.k8s.io", "v1", "leases", "Lease", True),
    Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True),
    Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True),
    Resource("apps", "v1", "daemonsets", "DaemonSet", True),
    Resource("apps", "v1", "deployments", "Deployment", True),
    Resource("apps", "v1", "replicasets", "ReplicaSet", True),
    Resource(_RBAC, "v1", "roles", "Role", True),
    Resource(_RBAC, "v1", "rolebindings", "RoleBinding", True),
    Resource(_RBAC, "v1", "clusterroles", "ClusterRole", False),
    Resource(_RBAC, "v1", "clusterrolebindings", "ClusterRoleBinding", False),
    Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False),
    Resource("admissionregistration.k8s.io", "v1", "validatingadmissionpolicies", "ValidatingAdmissionPolicy", False),
    Resource("admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations", "ValidatingWebhookConfiguration",
             False),
    Resource("admissionregistration.k8s.io", "v1", "validatingadmissionpolicybindings",
             "ValidatingAdmissionPolicyBinding", False),
    Resource("monitoring.coreos.com", "v1", "servicemonitors", "ServiceMonitor", True),
    Resource(crd.GROUP, crd.VERSION, crd.PLURAL, crd.KIND, True),
)}
_BY_KIND = {(r.api_version, r.kind): r for r in RESOURCES.values()}
_CLEARED = ("elasticjobs", "networkpolicies", "daemonsets", "deployments", "replicasets", "poddisruptionbudgets", "configmaps", "secrets",
            "leases", "roles", "rolebindings", "serviceaccounts", "services", "events", "resourcequotas", "limitranges")
"""What :meth:`TestCluster.reset` empties in ``default`` (pods first), keeping what the control plane made."""
_KEPT = {("serviceaccounts", "default"), ("configmaps", "kube-root-ca.crt"), ("services", "kubernetes")}


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ready_condition(ready: bool | None) -> dict[str, Any]:
    status = {True: "True", False: "False", None: "Unknown"}[ready]
    reason = {True: "KubeletReady", False: "KubeletNotReady", None: "NodeStatusUnknown"}[ready]
    return {"type": "Ready", "status": status, "reason": reason, "lastTransitionTime": now(),
            "lastHeartbeatTime": now(),
            "message": "kubelet is posting ready status" if ready else "Kubelet stopped posting node status."}


def node_status(gpus: int, address: str, name: str, ready: bool | None = True) -> dict[str, Any]:
    """A Node's status as its kubelet first posts it: ``gpus`` allocatable ``nvidia.com/gpu``, an InternalIP."""
    capacity = {crd.GPU_RESOURCE: str(gpus), "cpu": "64", "memory": "512Gi", "pods": "110"}
    return {"capacity": capacity, "allocatable": dict(capacity),
            "addresses": [{"type": "InternalIP", "address": address}, {"type": "Hostname", "address": name}],
            "conditions": [_ready_condition(ready)]}


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


class TestCluster:
    """The admin's view of a running :class:`ControlPlane` (see the module docstring)."""

    __test__ = False  # not a pytest test class

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self._client = plane.api_client()
        self._created_cluster_scoped: list[tuple[str, str]] = []
        self.kubelets: dict[str, Any] = {}
        """The test kubelets started for this test (node -> kubelet), so that the node side a test plays
        (:meth:`set_node_ready`) goes through the node's own kubelet where it has one."""
        self._ip_counter = 10

    # -- identity and clients ---------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.plane.url

    def client_configuration(self, user: User | None = None) -> Any:
        return self.plane.client_configuration(user)

    def api_client(self, user: User | None = None) -> Any:
        return self.plane.api_client(user)

    def kubeconfig(self, user: User | None = None, namespace: str = "default") -> dict[str, Any]:
        return self.plane.kubeconfig(user, namespace)

    def accesses(self, user: str | None = None) -> list[Any]:
        return self.plane.accesses(user)

    def open_watches(self) -> int:
        return self.plane.open_watches()

    # -- REST as the admin ---------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, *, query: Mapping[str, Any] | None = None,
                content_type: str = "application/json") -> Any:
        """One request as the admin; the JSON answer (an ``ApiException`` for an error status)."""
        url = self.plane.url + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        response = self._client.call_api(method, url, header_params={"Accept": "application/json",
                                                                      "Content-Type": content_type},
                                         body=body, _request_timeout=30)
        data = response.read()
        if not 200 <= response.status < 300:
            raise client.ApiException.from_response(http_resp=response, body=data.decode(errors="replace"), data=None)
        return json.loads(data) if data else None

    @staticmethod
    def resource(key: str) -> Resource:
        try:
            return RESOURCES[key]
        except KeyError:
            raise KeyError(f"unknown resource {key!r} (known: {sorted(RESOURCES)})") from None

    def get(self, resource: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        rt = self.resource(resource)
        return dict(self.request("GET", rt.path(namespace or ("default" if rt.namespaced else None), name)))

    def find(self, resource: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        try:
            return self.get(resource, name, namespace)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, resource: str, namespace: str | None = None, label_selector: str | None = None,
             field_selector: str | None = None) -> list[dict[str, Any]]:
        rt = self.resource(resource)
        query = {k: v for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v}
        items = self.request("GET", rt.path(namespace), query=query)["items"]
        for item in items:  # list items carry no apiVersion/kind; a get's do
            item.setdefault("apiVersion", rt.api_version)
            item.setdefault("kind", rt.kind)
        return list(items)

    def create(self, resource: str, obj: Mapping[str, Any], namespace: str | None = None) -> dict[str, Any]:
        rt = self.resource(resource)
        body = {"apiVersion": rt.api_version, "kind": rt.kind, **obj}
        ns = (namespace or (obj.get("metadata") or {}).get("namespace") or "default") if rt.namespaced else None
        if ns is not None:
            body["metadata"] = {**(body.get("metadata") or {}), "namespace": ns}
        created = dict(self.request("POST", rt.path(ns), body))
        if not rt.namespaced and resource not in ("nodes", "namespaces"):
            self._created_cluster_scoped.append((resource, created["metadata"]["name"]))
        return created

    def apply(self, manifests: Iterable[Mapping[str, Any]], namespace: str = "default") -> list[dict[str, Any]]:
        """Create rendered manifests (``helm template`` output), their namespaces first where missing."""
        out = []
        for doc in manifests:
            rt = _BY_KIND.get((str(doc.get("apiVersion")), str(doc.get("kind"))))
            if rt is None:
                raise KeyError(f"no resource for {doc.get('apiVersion')} {doc.get('kind')}")
            ns = (doc.get("metadata") or {}).get("namespace") or namespace
            if rt.namespaced and self.find("namespaces", ns) is None:
                self.create_namespace(ns)
            out.append(self.create(rt.plural, doc, ns if rt.namespaced else None))
        return out

    def create_namespace(self, name: str, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        """A namespace, once its ``default`` ServiceAccount exists (pods cannot be created in it before)."""
        meta: dict[str, Any] = {"name": name}
        if labels:
            meta["labels"] = dict(labels)
        created = self.create("namespaces", {"metadata": meta})
        deadline = time.monotonic() + 30
        while self.find("serviceaccounts", "default", name) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"namespace {name}: the controller-manager made no default ServiceAccount in 30s")
            time.sleep(0.05)
        return created

    def patch(self, resource: str, name: str, patch: Mapping[str, Any], namespace: str | None = None,
              subresource: str | None = None) -> dict[str, Any]:
        """JSON-merge-patch an object (``subresource="status"`` to write its status)."""
        rt = self.resource(resource)
        ns = (namespace or "default") if rt.namespaced else None
        return dict(self.request("PATCH", rt.path(ns, name, subresource), dict(patch),
                                 content_type="application/merge-patch+json"))

    def delete(self, resource: str, name: str, namespace: str | None = None, *, grace_period: int | None = None,
               propagation: str | None = None) -> dict[str, Any]:
        """Delete as ``kubectl delete`` does (a pod stays Terminating until its kubelet confirms)."""
        rt = self.resource(resource)
        ns = (namespace or "default") if rt.namespaced else None
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if grace_period is not None:
            body["gracePeriodSeconds"] = grace_period
        if propagation is not None:
            body["propagationPolicy"] = propagation
        return dict(self.request("DELETE", rt.path(ns, name), body) or {})

    def force_delete(self, resource: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        """``kubectl delete --grace-period=0 --force``: gone at once, whatever its kubelet is doing."""
        return self.delete(resource, name, namespace, grace_period=0)

    def evict(self, name: str, namespace: str = "default") -> None:
        """Evict a pod through the Eviction API (PodDisruptionBudgets apply: 429 when one forbids it)."""
        self.request("POST", RESOURCES["pods"].path(namespace, name, "eviction"),
                     {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace}})

    # -- nodes (the side a kubelet plays, where the test has none) ---------------------------------

    def add_node(self, name: str, *, gpus: int = 8, address: str | None = None, labels: Mapping[str, str] | None = None,
                 ready: bool = True) -> dict[str, Any]:
        """A Node with ``gpus`` allocatable ``nvidia.com/gpu``, an InternalIP and a Ready condition, as its kubelet
        registers it (a kubelet started for it later keeps its status current)."""
        if address is None:
            self._ip_counter += 1
            address = f"10.0.0.{self._ip_counter}"
        self.create("nodes", {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
                              "spec": {}})
        return self.patch("nodes", name, {"status": node_status(gpus, address, name, ready)}, subresource="status")

    def set_node_ready(self, name: str, ready: bool | None) -> dict[str, Any]:
        """The node's Ready condition: True, False, or None for Unknown. A node whose test kubelet runs reports
        it through that kubelet (which keeps reporting it); otherwise it is written as the kubelet would. The
        node lifecycle controller taints a node that is not Ready, as in any cluster."""
        kubelet = self.kubelets.get(name)
        if kubelet is not None and getattr(kubelet, "running", False):
            kubelet.set_node_ready(ready)
            return self.get("nodes", name)
        node = self.get("nodes", name)
        conds = [c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") != "Ready"]
        return self.patch("nodes", name, {"status": {"conditions": [*conds, _ready_condition(ready)]}},
                          subresource="status")

    def cordon_node(self, name: str, cordoned: bool = True) -> dict[str, Any]:
        """``kubectl cordon``/``uncordon`` (the node lifecycle controller adds or removes the taint)."""
        return self.patch("nodes", name, {"spec": {"unschedulable": True if cordoned else None}})

    def drain_node(self, name: str) -> list[str]:
        """``kubectl drain --disable-eviction``: cordon, then delete every pod bound to the node (gracefully: they
        stay Terminating until their kubelet confirms); returns ``ns/name`` of those pods."""
        self.cordon_node(name)
        out = []
        for pod in self.list("pods", field_selector=f"spec.nodeName={name}"):
            meta = pod["metadata"]
            if not meta.get("deletionTimestamp"):
                with contextlib.suppress(client.ApiException):
                    self.delete("pods", meta["name"], meta["namespace"])
            out.append(f"{meta['namespace']}/{meta['name']}")
        return out

    def evict_node_pods(self, name: str) -> tuple[list[str], list[str]]:
        """One pass of ``kubectl drain --ignore-daemonsets``: cordon, then evict through the Eviction API every
        pod on the node that no DaemonSet owns. Returns ``ns/name`` of the evicted pods and of those a
        PodDisruptionBudget protected (429); a drain retries the latter."""
        self.cordon_node(name)
        evicted, blocked = [], []
        for pod in self.list("pods", field_selector=f"spec.nodeName={name}"):
            meta = pod["metadata"]
            if any(o.get("kind") == "DaemonSet" for o in meta.get("ownerReferences") or []):
                continue
            key = f"{meta['namespace']}/{meta['name']}"
            try:
                self.evict(meta["name"], meta["namespace"])
                evicted.append(key)
            except client.ApiException as exc:
                if exc.status == 404:  # gone meanwhile: kubectl drain counts it as done
                    evicted.append(key)
                elif exc.status == 429:
                    blocked.append(key)
                else:
                    raise
        return evicted, blocked

    def node_address(self, name: str) -> str:
        for addr in (self.get("nodes", name).get("status") or {}).get("addresses") or []:
            if addr.get("type") == "InternalIP":
                return str(addr["address"])
        raise KeyError(f"node {name} has no InternalIP address")

    # -- pods (what a kubelet reports, where the test plays its containers) ------------------------

    def bind(self, name: str, namespace: str, node: str) -> None:
        """Bind a pending pod to ``node`` through the binding subresource (what kube-scheduler does)."""
        self.request("POST", RESOURCES["pods"].path(namespace, name, "binding"),
                     {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "namespace": namespace},
                      "target": {"apiVersion": "v1", "kind": "Node", "name": node}})

    def set_pod_running(self, name: str, namespace: str = "default", node: str | None = None,
                        pod_ip: str | None = None) -> dict[str, Any]:
        """Bind the pod to ``node`` (unless already bound) and report it Running and Ready."""
        pod = self.get("pods", name, namespace)
        bound = (pod.get("spec") or {}).get("nodeName")
        if node is not None and bound not in (None, node):
            raise ValueError(f"pod {namespace}/{name} is bound to {bound}, not {node}")
        node = bound or node
        if node is None:
            raise ValueError(f"pod {namespace}/{name} is not bound to a node; pass node=")
        if not bound:
            self.bind(name, namespace, node)
        address = self.node_address(node)
        containers = (pod.get("spec") or {}).get("containers") or []
        status = {
            "phase": "Running", "hostIP": address, "podIP": pod_ip or address, "startTime": now(),
            "conditions": [{"type": t, "status": "True", "lastTransitionTime": now()}
                           for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
            "containerStatuses": [{"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": True,
                                   "restartCount": 0, "started": True,
                                   "state": {"running": {"startedAt": now()}}} for c in containers],
        }
        return self.patch("pods", name, {"status": status}, namespace, subresource="status")

    def set_pod_ready(self, name: str, ready: bool, namespace: str = "default") -> dict[str, Any]:
        """Report a Running pod's Ready and ContainersReady conditions as ``ready``; its phase stays."""
        status = self.get("pods", name, namespace).get("status") or {}
        if status.get("phase") != "Running":
            raise ValueError(f"pod {namespace}/{name} is {status.get('phase')}, not Running")
        value = "True" if ready else "False"
        conditions = [{**c, "status": value, "lastTransitionTime": now()}
                      if c.get("type") in ("Ready", "ContainersReady") else c for c in status.get("conditions") or []]
        containers = [{**c, "ready": ready} for c in status.get("containerStatuses") or []]
        return self.patch("pods", name, {"status": {"conditions": conditions, "containerStatuses": containers}},
                          namespace, subresource="status")

    def fail_pod(self, name: str, namespace: str = "default", *, exit_code: int = 137, reason: str = "Error",
                 message: str = "the container exited with a failure") -> dict[str, Any]:
        """Report the pod Failed, its containers terminated with ``exit_code``."""
        pod = self.get("pods", name, namespace)
        return self.patch("pods", name, {"status": terminated_status(pod, "Failed", exit_code, reason, message)},
                          namespace, subresource="status")

    def set_pod_succeeded(self, name: str, namespace: str = "default") -> dict[str, Any]:
        pod = self.get("pods", name, namespace)
        return self.patch("pods", name, {"status": terminated_status(pod, "Succeeded", 0, "Completed")},
                          namespace, subresource="status")

    def gpu_overbookings(self) -> list[str]:
        """Every pod a test kubelet refused because its node had no GPUs left for it (a scheduler that gave a
        node more GPUs than it has: a Terminating pod's GPUs count until its containers end)."""
        return [r for k in self.kubelets.values() for r in getattr(k, "rejected", []) if "nvidia.com/gpu" in r]

    # -- outages ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        """kube-apiserver is down inside the block (connections refused, watches ended), then back."""
        with self.plane.apiserver_down():
            yield
        self._client.close()
        self._client = self.plane.api_client()

    def expire_watches(self) -> None:
        """Restart kube-apiserver with etcd's history compacted: every watch ends, and a client resuming from a
        resourceVersion it saw is answered 410 Gone, so it must list again."""
        self.plane.restart_apiserver(compact=True)
        self._client.close()
        self._client = self.plane.api_client()

    # -- between tests ------------------------------------------------------------------------------

    def reset(self) -> None:
        """Return the cluster to its first state (see the module docstring)."""
        self.kubelets.clear()
        self._ip_counter = 10
        for ns in self.list("namespaces"):
            name = ns["metadata"]["name"]
            if name not in SYSTEM_NAMESPACES and not ns["metadata"].get("deletionTimestamp"):
                self._strip_finalizers("elasticjobs", name)
                with contextlib.suppress(client.ApiException):
                    self.delete("namespaces", name)
                with contextlib.suppress(client.ApiException):  # no kubelet is left to confirm their deletion
                    self.request("DELETE", RESOURCES["pods"].path(name), {"gracePeriodSeconds": 0})
        self._strip_finalizers("elasticjobs", "default")
        self.request("DELETE", RESOURCES["pods"].path("default"), {"gracePeriodSeconds": 0})
        for key in _CLEARED:
            rt = RESOURCES[key]
            for obj in self.list(key, "default"):
                name = obj["metadata"]["name"]
                if (key, name) in _KEPT:
                    continue
                with contextlib.suppress(client.ApiException):
                    self.request("DELETE", rt.path("default", name), {"gracePeriodSeconds": 0,
                                                                      "propagationPolicy": "Background"})
        for node in self.list("nodes"):
            with contextlib.suppress(client.ApiException):
                self.delete("nodes", node["metadata"]["name"])
        for lease in self.list("leases", "kube-node-lease"):
            with contextlib.suppress(client.ApiException):
                self.delete("leases", lease["metadata"]["name"], "kube-node-lease")
        created, self._created_cluster_scoped = self._created_cluster_scoped, []
        for key in ("clusterrolebindings", "clusterroles"):
            for obj in self.list(key, label_selector="app.kubernetes.io/name=tenplex"):
                created.append((key, obj["metadata"]["name"]))
        for key, name in created:
            if key == "customresourcedefinitions" and name == crd.CRD_NAME:
                continue
            with contextlib.suppress(client.ApiException):
                self.delete(key, name)
        self.plane.forget_tokens()
        # The next test may reuse the names: wait until the namespace controller has finished.
        deadline = time.monotonic() + 60
        while (self.list("elasticjobs", "default") or self.list("pods", "default")
               or any(ns["metadata"]["name"] not in SYSTEM_NAMESPACES for ns in self.list("namespaces"))):
            if time.monotonic() > deadline:
                left = [ns["metadata"]["name"] for ns in self.list("namespaces")
                        if ns["metadata"]["name"] not in SYSTEM_NAMESPACES]
                raise TimeoutError(f"the test's objects were not gone within 60s (namespaces left: {left})")
            time.sleep(0.05)

    def _strip_finalizers(self, resource: str, namespace: str) -> None:
        with contextlib.suppress(client.ApiException):
            for obj in self.list(resource, namespace):
                if obj["metadata"].get("finalizers"):
                    with contextlib.suppress(client.ApiException):
                        self.patch(resource, obj["metadata"]["name"], {"metadata": {"finalizers": None}}, namespace)

    def install_crd(self, timeout: float = 30.0) -> None:
        """The ElasticJob CRD (as the chart's ``crds/`` holds it), once Established."""
        if self.find("customresourcedefinitions", crd.CRD_NAME) is None:
            self.create("customresourcedefinitions", crd.crd_manifest())
        deadline = time.monotonic() + timeout
        while True:
            conds = (self.get("customresourcedefinitions", crd.CRD_NAME).get("status") or {}).get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conds):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the CRD {crd.CRD_NAME} was not Established within {timeout}s")
            time.sleep(0.05)
        # Discovery of the new group lags the Established condition by a moment.
        while True:
            try:
                self.list("elasticjobs", "default")
                return
            except client.ApiException as exc:
                if exc.status != 404 or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def close(self) -> None:
        self._client.close()


@contextlib.contextmanager
def running_cluster(root: Any, bin_dir: Any) -> Iterator[TestCluster]:
    """A control plane under ``root`` from the binaries in ``bin_dir``, with the ElasticJob CRD installed (before
    the controllers start, so the garbage collector knows the kind at once); stopped at the end."""
    plane = ControlPlane(root, bin_dir, crds=(crd.crd_manifest(),)).start()
    cluster = TestCluster(plane)
    try:
        cluster.install_crd()
        yield cluster
    finally:
        cluster.close()
        plane.stop()
