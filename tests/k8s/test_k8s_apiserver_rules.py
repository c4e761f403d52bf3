"""The emulator behaves as kube-apiserver does where an operator could tell: deletion, garbage collection,
finalizers, watches, validation, admission and RBAC (each test names the real server's rule it checks)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from kubernetes import client, watch

from tenplex.k8s import crd
from tenplex.testing.k8s.emulator import ADMIN_TOKEN, ApiServerEmulator
from tenplex.testing.k8s.kubelet import wait_for
from tenplex.testing.k8s.rbac import User

from .cluster import NodeAgents
from .conftest import Clients

NS = "default"


def pod(name: str, node: str | None = None, gpus: int = 0, **spec: Any) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "tenplex:test"}
    if gpus:
        container["resources"] = {"limits": {crd.GPU_RESOURCE: str(gpus)}}
    body: dict[str, Any] = {"metadata": {"name": name}, "spec": {"containers": [container], **spec}}
    if node:
        body["spec"]["nodeName"] = node
    return body


def cm(name: str, owners: list[dict[str, Any]] | None = None, **meta: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, **meta}
    if owners:
        metadata["ownerReferences"] = owners
    return {"metadata": metadata, "data": {"k": "v"}}


def ref(obj: Any, block: bool = False) -> dict[str, Any]:
    meta = obj.metadata
    out = {"apiVersion": "v1", "kind": "ConfigMap", "name": meta.name, "uid": meta.uid}
    if block:
        out["blockOwnerDeletion"] = True
    return out


def status_of(exc: client.ApiException) -> tuple[int, str]:
    return exc.status, json.loads(exc.body)["message"]


def timed(call: Callable[[], Any]) -> tuple[datetime, Any, datetime]:
    """``call()`` with the clock read before and after it: a timestamp the server set during the call lies
    between the two (RFC 3339 timestamps have whole seconds: the lower end is truncated likewise)."""
    before = datetime.now(UTC).replace(microsecond=0)
    out = call()
    return before, out, datetime.now(UTC)


# --------------------------------------------------------------------------- graceful deletion


def test_a_bound_pod_is_deleted_gracefully_until_its_kubelet_confirms(api: ApiServerEmulator, k8s: Clients) -> None:
    api.add_node("n1")
    created = k8s.core.create_namespaced_pod(NS, pod("w", node="n1"))
    api.set_pod_running("w", NS)
    assert created.spec.termination_grace_period_seconds == 30  # defaulted, as the API server does

    before, first, after = timed(lambda: k8s.core.delete_namespaced_pod("w", NS))
    meta = first.metadata
    grace = timedelta(seconds=30)
    assert meta.deletion_grace_period_seconds == 30 and before + grace <= meta.deletion_timestamp <= after + grace
    assert meta.generation == created.metadata.generation + 1  # a deletion bumps the generation
    assert k8s.core.read_namespaced_pod("w", NS).metadata.deletion_timestamp is not None  # Terminating
    # A later deletion may shorten the grace period, never lengthen it.
    assert k8s.core.delete_namespaced_pod("w", NS, grace_period_seconds=60).metadata.deletion_grace_period_seconds == 30
    before, shorter, after = timed(lambda: k8s.core.delete_namespaced_pod("w", NS, grace_period_seconds=5).metadata)
    grace = timedelta(seconds=5)
    assert shorter.deletion_grace_period_seconds == 5 and before + grace <= shorter.deletion_timestamp <= after + grace
    # The kubelet's confirmation: grace period 0, for this uid only.
    wrong = client.V1DeleteOptions(grace_period_seconds=0, preconditions=client.V1Preconditions(uid="not-the-uid"))
    with pytest.raises(client.ApiException) as err:
        k8s.core.delete_namespaced_pod("w", NS, body=wrong)
    assert err.value.status == 409 and "Precondition failed: UID in precondition: not-the-uid" in err.value.body
    confirm = client.V1DeleteOptions(grace_period_seconds=0, preconditions=client.V1Preconditions(uid=created.metadata.uid))
    k8s.core.delete_namespaced_pod("w", NS, body=confirm)
    assert k8s.core.list_namespaced_pod(NS).items == []


def test_unbound_and_terminated_pods_go_at_once(api: ApiServerEmulator, k8s: Clients) -> None:
    api.add_node("n1")
    k8s.core.create_namespaced_pod(NS, pod("pending"))
    k8s.core.create_namespaced_pod(NS, pod("done", node="n1"))
    api.set_pod_running("done", NS)
    api.set_pod_succeeded("done", NS)
    for name in ("pending", "done"):
        k8s.core.delete_namespaced_pod(name, NS)
    assert k8s.core.list_namespaced_pod(NS).items == []
    # A terminated pod stays terminated: a kubelet's late report cannot revive it.
    k8s.core.create_namespaced_pod(NS, pod("failed", node="n1"))
    api.fail_pod("failed", NS)
    with pytest.raises(client.ApiException) as err:
        k8s.core.patch_namespaced_pod_status("failed", NS, {"status": {"phase": "Running"}})
    assert status_of(err.value) == (422, 'Pod "failed" is invalid: status.phase: Forbidden: cannot transition from '
                                         'terminal phase "Failed" to "Running"')


def test_finalizers_hold_a_deletion_and_cannot_be_added_to_it(k8s: Clients) -> None:
    created = k8s.core.create_namespaced_config_map(NS, cm("c", finalizers=["example.com/hold"]))
    k8s.core.delete_namespaced_config_map("c", NS)
    held = k8s.core.read_namespaced_config_map("c", NS).metadata
    assert held.deletion_timestamp is not None and held.deletion_grace_period_seconds == 0
    assert held.generation == created.metadata.generation + 1
    with pytest.raises(client.ApiException) as err:
        k8s.core.patch_namespaced_config_map("c", NS, {"metadata": {"finalizers": ["example.com/more"]}})
    assert err.value.status == 422 and "no new finalizers can be added if the object is being deleted" in err.value.body
    k8s.core.patch_namespaced_config_map("c", NS, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["example.com/hold"]}})
    assert k8s.core.list_namespaced_config_map(NS).items == []


# --------------------------------------------------------------------------- garbage collection


def names(k8s: Clients) -> list[str]:
    return [c.metadata.name for c in k8s.core.list_namespaced_config_map(NS).items]


def test_a_dependent_goes_only_when_all_its_owners_are_gone(k8s: Clients) -> None:
    a = k8s.core.create_namespaced_config_map(NS, cm("owner-a"))
    b = k8s.core.create_namespaced_config_map(NS, cm("owner-b"))
    k8s.core.create_namespaced_config_map(NS, cm("shared", [ref(a), ref(b)]))
    k8s.core.delete_namespaced_config_map("owner-a", NS)
    # One owner left: the dependent stays, and the reference to the gone owner is removed.
    wait_for(lambda: [r.name for r in k8s.core.read_namespaced_config_map("shared", NS).metadata.owner_references]
             == ["owner-b"], what="the dangling reference removed")
    k8s.core.delete_namespaced_config_map("owner-b", NS)
    wait_for(lambda: names(k8s) == [], what="the dependent collected once both owners are gone")
    # A dependent created for an owner that is already gone is collected too.
    k8s.core.create_namespaced_config_map(NS, cm("late", [ref(a)]))
    wait_for(lambda: names(k8s) == [], what="a dependent of a gone owner collected")


def test_foreground_deletion_waits_for_blocking_dependents(api: ApiServerEmulator, k8s: Clients,
                                                           agents: NodeAgents) -> None:
    api.add_node("n1")
    owner = k8s.core.create_namespaced_config_map(NS, cm("owner"))
    k8s.core.create_namespaced_config_map(NS, cm("blocker", [ref(owner, block=True)]))
    worker = pod("worker", node="n1")
    worker["metadata"]["ownerReferences"] = [ref(owner, block=True)]
    k8s.core.create_namespaced_pod(NS, worker)
    api.set_pod_running("worker", NS)
    k8s.core.delete_namespaced_config_map("owner", NS, propagation_policy="Foreground")
    held = k8s.core.read_namespaced_config_map("owner", NS).metadata
    assert held.finalizers == ["foregroundDeletion"] and held.deletion_timestamp is not None
    # The dependents are deleted (the pod gracefully: it has no kubelet yet), the owner waits for them.
    wait_for(lambda: "blocker" not in names(k8s), what="the configmap dependent deleted")
    assert k8s.core.read_namespaced_pod("worker", NS).metadata.deletion_timestamp is not None
    time.sleep(0.3)
    assert "owner" in names(k8s)
    agents.start("n1")  # the node's kubelet confirms the pod's deletion; then the owner goes
    wait_for(lambda: names(k8s) == [] and k8s.core.list_namespaced_pod(NS).items == [], timeout=15,
             what="the owner gone after its last blocking dependent")


def test_orphan_deletion_keeps_the_dependents_without_the_reference(k8s: Clients) -> None:
    owner = k8s.core.create_namespaced_config_map(NS, cm("owner"))
    k8s.core.create_namespaced_config_map(NS, cm("child", [ref(owner)]))
    k8s.core.delete_namespaced_config_map("owner", NS, propagation_policy="Orphan")
    wait_for(lambda: names(k8s) == ["child"], what="the owner gone, the child kept")
    assert k8s.core.read_namespaced_config_map("child", NS).metadata.owner_references is None


# --------------------------------------------------------------------------- writes


def test_resource_version_on_create_and_uid_on_update(k8s: Clients) -> None:
    with pytest.raises(client.ApiException) as err:
        k8s.core.create_namespaced_config_map(NS, {"metadata": {"name": "c", "resourceVersion": "12"}})
    # What the real server answers (storage.ErrResourceVersionSetOnCreate, not a Status error: a 500).
    assert status_of(err.value) == (500, "resourceVersion should not be set on objects to be created")
    k8s.core.create_namespaced_config_map(NS, cm("c"))
    with pytest.raises(client.ApiException) as err:  # a PUT for another object of that name
        k8s.core.replace_namespaced_config_map("c", NS, client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name="c", uid="6f1f0c1e-0000-4000-8000-000000000000"), data={"k": "w"}))
    assert err.value.status == 409 and "Precondition failed: UID in precondition" in err.value.body
    assert k8s.core.read_namespaced_config_map("c", NS).data == {"k": "v"}


def test_namespaces_must_exist_and_terminate_with_their_content(api: ApiServerEmulator, k8s: Clients) -> None:
    with pytest.raises(client.ApiException) as err:
        k8s.core.create_namespaced_config_map("ml", cm("c"))
    assert status_of(err.value) == (404, 'namespaces "ml" not found')
    api.create_namespace("ml")
    assert [sa.metadata.name for sa in k8s.core.list_namespaced_service_account("ml").items] == ["default"]
    k8s.core.create_namespaced_config_map("ml", cm("c"))
    ns = k8s.core.delete_namespace("ml")
    assert ns is not None
    with pytest.raises(client.ApiException) as err:
        k8s.core.create_namespaced_config_map("ml", cm("d"))
    assert err.value.status in (403, 404)  # Forbidden while Terminating, NotFound once gone
    wait_for(lambda: api.find("namespaces", "ml") is None, what="the namespace emptied and gone")
    assert api.list("configmaps", "ml") == []


# --------------------------------------------------------------------------- validation and admission


@pytest.mark.parametrize(("spec_change", "code", "expected"), [
    ({"containers": [{"name": "Main", "image": "x"}]}, 422, 'spec.containers[0].name: Invalid value: "Main"'),
    ({"containers": [{"name": "main"}]}, 422, "spec.containers[0].image: Required value"),
    ({"containers": [{"name": "main", "image": "x", "env": [{"name": "1A", "value": "x"}]}]}, 422,
     'spec.containers[0].env[0].name: Invalid value: "1A"'),
    ({"containers": [{"name": "main", "image": "x", "resources": {"requests": {crd.GPU_RESOURCE: "2"},
                                                                   "limits": {crd.GPU_RESOURCE: "1"}}}]}, 422,
     "must be equal to nvidia.com/gpu limit"),
    ({"containers": [{"name": "main", "image": "x", "resources": {"limits": {"memory": "lots"}}}]}, 422,
     "quantities must match the regular expression"),
    ({"containers": [{"name": "main", "image": "x", "volumeMounts": [{"name": "v", "mountPath": "/v"}]}]}, 422,
     'volumeMounts[0].name: Not found: "v"'),
    ({"restartPolicy": "Sometimes"}, 422, 'spec.restartPolicy: Unsupported value: "Sometimes"'),
    ({"containers": [{"name": "main", "image": "x", "ports": [{"containerPort": "http"}]}]}, 400,
     "cannot unmarshal string"),
])
def test_pods_are_checked_against_the_real_schema_and_rules(k8s: Clients, spec_change: dict[str, Any], code: int,
                                                           expected: str) -> None:
    body = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "main", "image": "x"}], **spec_change}}
    with httpx.Client(headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
        answer = http.post(f"{k8s.api_client.configuration.host}/api/v1/namespaces/{NS}/pods", json=body)
    assert answer.status_code == code and expected in answer.json()["message"], answer.text


def test_configmaps_and_secrets_are_limited_to_1_mib(k8s: Clients) -> None:
    with pytest.raises(client.ApiException) as err:
        k8s.core.create_namespaced_config_map(NS, {"metadata": {"name": "big"}, "data": {"a": "x" * ((1 << 20) + 1)}})
    assert status_of(err.value) == (422, 'ConfigMap "big" is invalid: []: Too long: must have at most 1048576 bytes')
    with pytest.raises(client.ApiException) as err:
        k8s.core.create_namespaced_config_map(NS, {"metadata": {"name": "bad key"}, "data": {"a b": "x"}})
    assert err.value.status == 422 and "a valid config key must consist of" in err.value.body
    with pytest.raises(client.ApiException) as err:
        k8s.core.create_namespaced_secret(NS, {"metadata": {"name": "s"}, "data": {"token": "not base64!"}})
    assert err.value.status == 400 and "illegal base64 data" in err.value.body


def test_service_account_admission(k8s: Clients) -> None:
    mounted = k8s.core.create_namespaced_pod(NS, pod("default-sa"))
    assert mounted.spec.service_account_name == "default"
    mount = [m for m in mounted.spec.containers[0].volume_mounts if m.name.startswith("kube-api-access-")]
    assert mount and mount[0].mount_path == "/var/run/secrets/kubernetes.io/serviceaccount"
    unmounted = k8s.core.create_namespaced_pod(NS, pod("no-token", automountServiceAccountToken=False))
    assert not unmounted.spec.volumes and not unmounted.spec.containers[0].volume_mounts
    with pytest.raises(client.ApiException) as err:
        k8s.core.create_namespaced_pod(NS, pod("ghost", serviceAccountName="ghost"))
    assert status_of(err.value) == (403, 'pods "ghost" is forbidden: error looking up service account default/ghost: '
                                         'serviceaccount "ghost" not found')


def test_pod_security_admission_by_namespace_label(api: ApiServerEmulator, k8s: Clients) -> None:
    api.create_namespace("base", {"pod-security.kubernetes.io/enforce": "baseline"})
    api.create_namespace("priv", {"pod-security.kubernetes.io/enforce": "privileged"})
    host = pod("h", hostNetwork=True, volumes=[{"name": "store", "hostPath": {"path": "/var/lib/x"}}])
    host["spec"]["containers"][0]["volumeMounts"] = [{"name": "store", "mountPath": "/x"}]
    with pytest.raises(client.ApiException) as err:
        k8s.core.create_namespaced_pod("base", host)
    assert status_of(err.value) == (403, 'pods "h" is forbidden: violates PodSecurity "baseline:latest": host '
                                         "namespaces (hostNetwork=true), hostPath volumes (volume 'store')")
    assert k8s.core.create_namespaced_pod("priv", host).spec.host_network is True
    assert k8s.core.create_namespaced_pod("base", pod("plain")).metadata.name == "plain"


def test_rbac_is_enforced_for_service_accounts_and_recorded(api: ApiServerEmulator) -> None:
    robot = User.service_account(NS, "robot")
    with api.api_client(robot) as api_client:
        core = client.CoreV1Api(api_client)
        with pytest.raises(client.ApiException) as err:
            core.list_namespaced_config_map(NS)
        assert status_of(err.value) == (403, 'configmaps is forbidden: User "system:serviceaccount:default:robot" '
                                             'cannot list resource "configmaps" in API group "" in the namespace "default"')
        api.create("roles", {"metadata": {"name": "read"}, "rules": [
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}]}, NS)
        api.create("rolebindings", {"metadata": {"name": "read"}, "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read"},
            "subjects": [{"kind": "ServiceAccount", "name": "robot", "namespace": NS}]}, NS)
        assert core.list_namespaced_config_map(NS).items == []
        with pytest.raises(client.ApiException) as err:  # a Role does not reach other namespaces
            core.list_config_map_for_all_namespaces()
        assert err.value.status == 403 and "at the cluster scope" in err.value.body
    calls = [(a.verb, a.resource, a.namespace, a.allowed) for a in api.accesses(robot.name)]
    assert calls == [("list", "configmaps", NS, False), ("list", "configmaps", NS, True), ("list", "configmaps", "", False)]
    with httpx.Client() as http:  # an unknown token is refused before anything else
        assert http.get(f"{api.url}/api/v1/namespaces", headers={"Authorization": "Bearer nope"}).status_code == 401


# --------------------------------------------------------------------------- watches


def test_bookmarks_carry_the_current_resource_version(k8s: Clients) -> None:
    api_rv = int(k8s.core.list_namespaced_pod(NS).metadata.resource_version)
    k8s.core.create_namespaced_config_map(NS, cm("elsewhere"))  # moves the resourceVersion, not a pod event
    events = []
    w = watch.Watch()
    for event in w.stream(k8s.core.list_namespaced_pod, NS, resource_version=str(api_rv), timeout_seconds=3,
                          allow_watch_bookmarks=True):
        events.append(event)
    (bookmark,) = events  # 2 s before the watch's timeout, as the real server sends it
    assert bookmark["type"] == "BOOKMARK" and int(bookmark["raw_object"]["metadata"]["resourceVersion"]) > api_rv
    # Without allowWatchBookmarks, none.
    assert list(watch.Watch().stream(k8s.core.list_namespaced_pod, NS, resource_version=str(api_rv),
                                     timeout_seconds=1)) == []


def test_bookmarks_come_periodically() -> None:
    with ApiServerEmulator(bookmark_interval=0.3) as api, api.api_client() as api_client:
        core = client.CoreV1Api(api_client)
        rv = core.list_namespaced_pod(NS).metadata.resource_version
        kinds = [e["type"] for e in watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=rv,
                                                          timeout_seconds=1, allow_watch_bookmarks=True)]
        assert kinds.count("BOOKMARK") >= 2


def test_the_watch_window_is_per_resource_and_small() -> None:
    with ApiServerEmulator(watch_window=5) as api, api.api_client() as api_client:
        core = client.CoreV1Api(api_client)
        pods_rv = core.list_namespaced_pod(NS).metadata.resource_version
        for i in range(20):  # other resources' events do not push pods out of their window
            core.create_namespaced_config_map(NS, cm(f"c{i}"))
        assert list(watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=pods_rv,
                                         timeout_seconds=1)) == []
        for i in range(6):
            core.create_namespaced_pod(NS, pod(f"p{i}"))
        with pytest.raises(client.ApiException) as err:
            list(watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=pods_rv, timeout_seconds=1))
        assert err.value.status == 410
