"""The API server emulator, driven by the official kubernetes client over real HTTP."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from kubernetes import client, watch

from tenplex.k8s import crd
from tenplex.testing.k8s.emulator import ADMIN_TOKEN, ApiServerEmulator
from tenplex.testing.k8s.kubelet import wait_for

from .conftest import Clients

NS = "default"
EJ = (crd.GROUP, crd.VERSION, NS, crd.PLURAL)


def pod(name: str, job: str = "j", role: str = "worker", node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "worker", "image": "tenplex:test"}]}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "labels": crd.job_labels(job, role)}, "spec": spec}


def job(name: str = "j", gpus: int = 2, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name},
            "spec": {"image": "tenplex:test", "command": ["python", "-m", "examples.gpt.train"], "gpus": gpus,
                     "layout": {"provider": "example-gpt", "model": {"layers": 2}}, **spec}}


def when_watching(api: ApiServerEmulator, action: Callable[[], None], watches: int = 1) -> threading.Thread:
    """Run ``action`` in a thread as soon as ``watches`` watches are open (so no event predates them)."""

    def run() -> None:
        deadline = time.monotonic() + 5
        while api.open_watches() < watches and time.monotonic() < deadline:
            time.sleep(0.01)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def collect(func: Callable[..., Any], *args: Any, count: int, timeout: int = 5, **kwargs: Any) -> list[dict[str, Any]]:
    """The first ``count`` watch events (or fewer if the server ends the watch after ``timeout`` s)."""
    events: list[dict[str, Any]] = []
    w = watch.Watch()
    for event in w.stream(func, *args, timeout_seconds=timeout, **kwargs):
        events.append(event)
        if len(events) >= count:
            w.stop()
    return events


def message(exc: client.ApiException) -> str:
    """The ``message`` of the Status the server answered with (plus its reason)."""
    status = json.loads(exc.body)
    return f"{status['reason']}: {status['message']}"


def summary(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["type"], e["raw_object"]["metadata"]["name"]) for e in events]


# --------------------------------------------------------------------------- objects


def test_pod_lifecycle_sets_uid_and_increasing_resource_versions(k8s: Clients) -> None:
    created = k8s.core.create_namespaced_pod(NS, pod("w0"))
    assert created.metadata.uid and created.metadata.creation_timestamp is not None
    assert created.status.phase == "Pending"
    got = k8s.core.read_namespaced_pod("w0", NS)
    assert got.metadata.uid == created.metadata.uid

    patched = k8s.core.patch_namespaced_pod("w0", NS, {"metadata": {"labels": {"extra": "1"}}})
    assert int(patched.metadata.resource_version) > int(created.metadata.resource_version)
    assert patched.metadata.labels == {**crd.job_labels("j"), "extra": "1"}

    listed = k8s.core.list_namespaced_pod(NS)
    assert [p.metadata.name for p in listed.items] == ["w0"]
    assert int(listed.metadata.resource_version) >= int(patched.metadata.resource_version)

    deleted = k8s.core.delete_namespaced_pod("w0", NS)
    assert deleted.metadata.name == "w0"
    with pytest.raises(client.ApiException) as err:
        k8s.core.read_namespaced_pod("w0", NS)
    assert err.value.status == 404 and '"w0" not found' in message(err.value)


def test_create_conflicts_generate_name_and_invalid_pods(k8s: Clients) -> None:
    k8s.core.create_namespaced_pod(NS, pod("w0"))
    with pytest.raises(client.ApiException) as err:
        k8s.core.create_namespaced_pod(NS, pod("w0"))
    assert err.value.status == 409 and "AlreadyExists" in message(err.value)

    generated = k8s.core.create_namespaced_pod(NS, {"metadata": {"generateName": "w-"}, "spec": pod("x")["spec"]})
    assert generated.metadata.name.startswith("w-") and len(generated.metadata.name) == 7

    with pytest.raises(client.ApiException) as err:
        k8s.core.create_namespaced_pod(NS, {"metadata": {"name": "Bad_Name"}, "spec": pod("x")["spec"]})
    assert err.value.status == 422 and "Bad_Name" in message(err.value)
    with pytest.raises(client.ApiException) as err:
        k8s.core.create_namespaced_pod(NS, {"metadata": {"name": "empty"}, "spec": {"containers": []}})
    assert err.value.status == 422 and "spec.containers" in message(err.value)


def test_nodes_are_cluster_scoped(api: ApiServerEmulator, k8s: Clients) -> None:
    api.add_node("gpu-a", gpus=4, address="10.1.0.1")
    node = k8s.core.read_node("gpu-a")
    assert node.status.allocatable[crd.GPU_RESOURCE] == "4"
    assert node.status.addresses[0].address == "10.1.0.1"
    assert [c.status for c in node.status.conditions if c.type == "Ready"] == ["True"]
    k8s.core.patch_node("gpu-a", {"metadata": {"labels": {"pool": "h100"}}})
    assert k8s.core.list_node(label_selector="pool=h100").items[0].metadata.name == "gpu-a"
    status = k8s.core.delete_node("gpu-a")
    assert k8s.core.list_node().items == []
    assert status is not None


def test_label_and_field_selectors(api: ApiServerEmulator, k8s: Clients) -> None:
    api.add_node("n1")
    k8s.core.create_namespaced_pod(NS, pod("a0", job="a", node="n1"))
    k8s.core.create_namespaced_pod(NS, pod("a1", job="a"))
    k8s.core.create_namespaced_pod(NS, pod("b0", job="b", role="store", node="n1"))
    api.create_namespace("other")
    k8s.core.create_namespaced_pod("other", pod("c0", job="c"))

    def names(**kwargs: Any) -> list[str]:
        return [p.metadata.name for p in k8s.core.list_namespaced_pod(NS, **kwargs).items]

    assert names(label_selector="tenplex.io/job=a") == ["a0", "a1"]
    assert names(label_selector="tenplex.io/job==a,tenplex.io/role=worker") == ["a0", "a1"]
    assert names(label_selector="tenplex.io/job!=a") == ["b0"]
    assert names(label_selector="tenplex.io/role in (store, scheduler)") == ["b0"]
    assert names(label_selector="tenplex.io/job notin (a,b)") == []
    assert names(label_selector="tenplex.io/job,!missing") == ["a0", "a1", "b0"]
    assert names(field_selector="spec.nodeName=n1") == ["a0", "b0"]
    assert names(field_selector="spec.nodeName=n1", label_selector="tenplex.io/role=worker") == ["a0"]
    assert names(field_selector="metadata.name!=a0,status.phase=Pending") == ["a1", "b0"]
    everywhere = k8s.core.list_pod_for_all_namespaces(label_selector="tenplex.io/job in (c)").items
    assert [(p.metadata.namespace, p.metadata.name) for p in everywhere] == [("other", "c0")]

    for bad in ("a in (x", "=x"):
        with pytest.raises(client.ApiException) as err:
            k8s.core.list_namespaced_pod(NS, label_selector=bad)
        assert err.value.status == 400 and "unable to parse" in message(err.value)
    assert names(field_selector="spec.schedulerName=default-scheduler,spec.hostNetwork=false") == ["a0", "a1", "b0"]
    # A field the resource does not index is refused, as by the real server (each kind has its own list).
    for bad, listing in (("spec.priority=1", lambda sel: k8s.core.list_namespaced_pod(NS, field_selector=sel)),
                         ("spec.nodeName=n1", lambda sel: k8s.core.list_namespaced_config_map(NS, field_selector=sel)),
                         ("spec.gpus=2", lambda sel: k8s.custom.list_namespaced_custom_object(*EJ, field_selector=sel))):
        with pytest.raises(client.ApiException) as err:
            listing(bad)
        assert err.value.status == 400 and message(err.value) == f"BadRequest: field label not supported: {bad.split('=')[0]}"
    assert [n.metadata.name for n in k8s.core.list_node(field_selector="metadata.name=n1").items] == ["n1"]


def test_stale_resource_version_is_a_conflict_for_leader_election(k8s: Clients) -> None:
    lease = k8s.coordination.create_namespaced_lease(NS, {"metadata": {"name": crd.LEADER_LEASE},
                                                          "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15}})
    # Two candidates read the same version; the first to write wins, the second gets 409.
    first = client.V1Lease(metadata=lease.metadata, spec=client.V1LeaseSpec(holder_identity="b", lease_duration_seconds=15))
    second = client.V1Lease(metadata=lease.metadata, spec=client.V1LeaseSpec(holder_identity="c", lease_duration_seconds=15))
    won = k8s.coordination.replace_namespaced_lease(crd.LEADER_LEASE, NS, first)
    assert won.spec.holder_identity == "b"
    with pytest.raises(client.ApiException) as err:
        k8s.coordination.replace_namespaced_lease(crd.LEADER_LEASE, NS, second)
    assert err.value.status == 409 and "the object has been modified" in message(err.value)
    assert k8s.coordination.read_namespaced_lease(crd.LEADER_LEASE, NS).spec.holder_identity == "b"
    # A patch carrying the stale resourceVersion is refused the same way.
    with pytest.raises(client.ApiException) as err:
        k8s.coordination.patch_namespaced_lease(
            crd.LEADER_LEASE, NS, {"metadata": {"resourceVersion": lease.metadata.resource_version}, "spec": {"holderIdentity": "c"}})
    assert err.value.status == 409


def test_patch_flavours(api: ApiServerEmulator, k8s: Clients) -> None:
    k8s.core.create_namespaced_pod(NS, pod("w0"))
    # Strategic merge (the client's default for dicts): keyed lists merged item by item (taints by key)...
    api.add_node("n1")
    k8s.core.patch_node("n1", {"spec": {"taints": [{"key": "a", "effect": "NoSchedule"}]}})
    k8s.core.patch_node("n1", {"spec": {"taints": [{"key": "b", "effect": "NoExecute"}]}})
    assert [(t.key, t.effect) for t in k8s.core.read_node("n1").spec.taints] == [("a", "NoSchedule"), ("b", "NoExecute")]
    # ... and finalizers merged as a set, as their patchStrategy says (a merge patch replaces the list).
    k8s.core.patch_namespaced_pod("w0", NS, {"metadata": {"finalizers": ["example.com/a"]}})
    k8s.core.patch_namespaced_pod("w0", NS, {"metadata": {"finalizers": ["example.com/b", "example.com/a"]}})
    assert k8s.core.read_namespaced_pod("w0", NS).metadata.finalizers == ["example.com/a", "example.com/b"]
    k8s.core.patch_namespaced_pod("w0", NS, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["example.com/a"]}})
    assert k8s.core.read_namespaced_pod("w0", NS).metadata.finalizers == ["example.com/b"]
    k8s.core.patch_namespaced_pod("w0", NS, {"metadata": {"finalizers": ["example.com/c"]}},
                                  _content_type="application/merge-patch+json")
    assert k8s.core.read_namespaced_pod("w0", NS).metadata.finalizers == ["example.com/c"]
    k8s.core.patch_namespaced_pod("w0", NS, {"metadata": {"finalizers": None}}, _content_type="application/merge-patch+json")
    # A pod's spec is immutable but for images, the deadline and added tolerations.
    with pytest.raises(client.ApiException) as err:
        k8s.core.patch_namespaced_pod("w0", NS, {"spec": {"containers": [{"name": "worker", "env": [{"name": "A", "value": "1"}]}]}})
    assert err.value.status == 422 and "pod updates may not change fields other than" in message(err.value)
    k8s.core.patch_namespaced_pod("w0", NS, {"spec": {"containers": [{"name": "worker", "image": "tenplex:next"}]}})
    assert k8s.core.read_namespaced_pod("w0", NS).spec.containers[0].image == "tenplex:next"
    # JSON patch (a list body).
    k8s.core.patch_namespaced_pod("w0", NS, [{"op": "add", "path": "/metadata/annotations", "value": {"k": "v"}}])
    assert k8s.core.read_namespaced_pod("w0", NS).metadata.annotations == {"k": "v"}
    with pytest.raises(client.ApiException) as err:
        k8s.core.patch_namespaced_pod("w0", NS, [{"op": "test", "path": "/metadata/name", "value": "other"}])
    assert err.value.status == 422
    # Custom resources refuse strategic merge patches, as the real server does.
    k8s.custom.create_namespaced_custom_object(*EJ, job())
    with pytest.raises(client.ApiException) as err:
        k8s.custom.patch_namespaced_custom_object(*EJ, "j", {"spec": {"gpus": 4}},
                                                  _content_type="application/strategic-merge-patch+json")
    assert err.value.status == 415
    assert k8s.custom.patch_namespaced_custom_object(*EJ, "j", {"spec": {"gpus": 4}})["spec"]["gpus"] == 4


# --------------------------------------------------------------------------- ElasticJob


def test_elasticjob_defaults_and_validation(k8s: Clients) -> None:
    created = k8s.custom.create_namespaced_custom_object(*EJ, job())
    assert created["spec"]["gpusPerPod"] == 1 and created["spec"]["storeRoot"] == crd.DEFAULT_STORE_ROOT
    assert created["metadata"]["generation"] == 1 and created["metadata"]["uid"]

    with pytest.raises(client.ApiException) as err:
        k8s.custom.create_namespaced_custom_object(*EJ, job("bad", gpus=3, gpusPerPod=2, minGpus=4, maxGpus=2))
    # The CRD's CEL rules, evaluated from its own strings, worded as the API server words them.
    assert err.value.status == 422
    assert message(err.value) == (
        'Invalid: ElasticJob.tenplex.io "bad" is invalid: [spec: Invalid value: "object": minGpus must not exceed '
        'maxGpus, spec: Invalid value: "object": gpus must be a multiple of gpusPerPod, spec: Invalid value: '
        '"object": gpus must be 0 (suspended) or at least minGpus, spec: Invalid value: "object": gpus must not '
        'exceed maxGpus]')
    with pytest.raises(client.ApiException) as err:
        k8s.custom.patch_namespaced_custom_object(*EJ, "j", {"spec": {"layout": {"provider": "My Bert"}}})
    # Providers are plug-ins (any registered name or module:function), so the schema checks the form only.
    assert err.value.status == 422 and "spec.layout.provider in body 'My Bert' does not match" in message(err.value), \
        message(err.value)
    with pytest.raises(client.ApiException) as err:
        k8s.custom.patch_namespaced_custom_object(*EJ, "j", {"spec": {"gpus": "two"}})
    assert err.value.status == 422 and "spec.gpus in body must be of type integer" in message(err.value)
    assert k8s.custom.get_namespaced_custom_object(*EJ, "j")["spec"]["layout"]["provider"] == "example-gpt"


def test_unknown_fields_follow_the_requests_field_validation(api: ApiServerEmulator, k8s: Clients) -> None:
    """Strict (kubectl's default) refuses them with 400, Warn (the API's default) drops them with a Warning header,
    Ignore drops them silently; on built-in kinds (their OpenAPI schema) and custom resources (their CRD's)."""
    base = f"{api.url}/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{NS}/{crd.PLURAL}"
    typo = job("typo", gpu=1)
    with httpx.Client(headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
        strict = http.post(f"{base}?fieldValidation=Strict", json=typo)
        assert strict.status_code == 400
        assert strict.json()["message"] == ('ElasticJob in version "v1alpha1" cannot be handled as a ElasticJob: '
                                            'strict decoding error: unknown field "spec.gpu"')
        warned = http.post(base, json=typo)
        assert warned.status_code == 201 and "gpu" not in warned.json()["spec"]
        assert warned.headers["warning"] == '299 - "unknown field \\"spec.gpu\\""'
        ignored = http.post(f"{base}?fieldValidation=Ignore", json={**job("quiet"), "extra": {"a": 1}})
        assert ignored.status_code == 201 and "extra" not in ignored.json() and "warning" not in ignored.headers
        assert http.post(f"{base}?fieldValidation=Loose", json=job("x")).status_code == 400

        pods = f"{api.url}/api/v1/namespaces/{NS}/pods"
        body = pod("p0")
        body["spec"]["containers"][0]["imagePullPolcy"] = "Always"
        strict = http.post(f"{pods}?fieldValidation=Strict", json=body)
        assert strict.status_code == 400 and 'unknown field "spec.containers[0].imagePullPolcy"' in strict.json()["message"]
        patched = http.post(pods, json=pod("p1"))
        assert patched.status_code == 201
        # A patch is judged by what it makes: here a field of no pod.
        merge = http.patch(f"{pods}/p1?fieldValidation=Strict", json={"metadata": {"labelz": {"a": "b"}}},
                           headers={"Content-Type": "application/merge-patch+json"})
        assert merge.status_code == 400 and 'unknown field "metadata.labelz"' in merge.json()["message"]
    assert api.warnings() == ['unknown field "spec.gpu"']


def test_elasticjob_status_subresource_write_rules(k8s: Clients) -> None:
    k8s.custom.create_namespaced_custom_object(*EJ, job())
    status = crd.ElasticJobStatus(phase=crd.Phase.RUNNING, gpus=2, parallel=crd.Parallel(2, 1, 1), step=5,
                                  version="s5-g0", selector=crd.worker_selector("j"), observed_generation=1)
    written = k8s.custom.patch_namespaced_custom_object_status(*EJ, "j", {"status": status.to_dict(), "spec": {"gpus": 8}})
    assert written["spec"]["gpus"] == 2, "a /status write must not change the spec"
    assert crd.ElasticJobStatus.from_dict(written["status"]) == status
    assert written["metadata"]["generation"] == 1

    main = k8s.custom.patch_namespaced_custom_object(*EJ, "j", {"spec": {"gpus": 4}, "status": {"phase": "Failed"}})
    assert main["status"]["phase"] == "Running", "a main-resource write must not change the status"
    assert main["metadata"]["generation"] == 2, "a spec change bumps the generation"
    labels = k8s.custom.patch_namespaced_custom_object(*EJ, "j", {"metadata": {"labels": {"team": "x"}}})
    assert labels["metadata"]["generation"] == 2, "a metadata change does not"

    # A PUT of the whole object with an old resourceVersion is a conflict.
    stale = dict(written, spec={**written["spec"], "gpus": 6})
    with pytest.raises(client.ApiException) as err:
        k8s.custom.replace_namespaced_custom_object(*EJ, "j", stale)
    assert err.value.status == 409


def test_scale_subresource_maps_replicas_to_gpus(k8s: Clients) -> None:
    k8s.custom.create_namespaced_custom_object(*EJ, job(gpus=2, gpusPerPod=2, maxGpus=8))
    k8s.custom.patch_namespaced_custom_object_status(*EJ, "j", {"status": {"gpus": 2, "selector": crd.worker_selector("j")}})
    scale = k8s.custom.get_namespaced_custom_object_scale(*EJ, "j")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 2
    assert scale["status"] == {"replicas": 2, "selector": crd.worker_selector("j")}

    scaled = k8s.custom.patch_namespaced_custom_object_scale(*EJ, "j", {"spec": {"replicas": 6}})
    assert scaled["spec"]["replicas"] == 6
    obj = k8s.custom.get_namespaced_custom_object(*EJ, "j")
    assert obj["spec"]["gpus"] == 6 and obj["metadata"]["generation"] == 2

    for replicas, expected in ((5, "multiple of gpusPerPod"), (10, "must not exceed maxGpus")):
        with pytest.raises(client.ApiException) as err:
            k8s.custom.patch_namespaced_custom_object_scale(*EJ, "j", {"spec": {"replicas": replicas}})
        assert err.value.status == 422 and expected in message(err.value)
    assert k8s.custom.get_namespaced_custom_object(*EJ, "j")["spec"]["gpus"] == 6

    scale = k8s.custom.get_namespaced_custom_object_scale(*EJ, "j")
    scale["spec"]["replicas"] = 4
    assert k8s.custom.replace_namespaced_custom_object_scale(*EJ, "j", scale)["spec"]["replicas"] == 4
    scale["spec"]["replicas"] = 8  # same, now stale, resourceVersion
    with pytest.raises(client.ApiException) as err:
        k8s.custom.replace_namespaced_custom_object_scale(*EJ, "j", scale)
    assert err.value.status == 409


def test_deleting_a_job_collects_its_pods_and_finalizers_hold_deletion(api: ApiServerEmulator, k8s: Clients) -> None:
    owner = k8s.custom.create_namespaced_custom_object(*EJ, job())
    ref = crd.owner_reference(owner)
    for i in range(2):
        body = pod(f"j-{i}")
        body["metadata"]["ownerReferences"] = [ref]
        k8s.core.create_namespaced_pod(NS, body)
    k8s.core.create_namespaced_pod(NS, pod("unrelated", job="other"))
    k8s.custom.patch_namespaced_custom_object(*EJ, "j", {"metadata": {"finalizers": ["tenplex.io/state"]}})

    held = k8s.custom.delete_namespaced_custom_object(*EJ, "j")
    assert held["metadata"]["deletionTimestamp"], "a finalizer keeps the object, marked for deletion"
    assert len(k8s.core.list_namespaced_pod(NS, label_selector="tenplex.io/job=j").items) == 2

    k8s.custom.patch_namespaced_custom_object(*EJ, "j", {"metadata": {"finalizers": None}})
    with pytest.raises(client.ApiException) as err:
        k8s.custom.get_namespaced_custom_object(*EJ, "j")
    assert err.value.status == 404
    # The garbage collector works on its own time, as the controller does.
    wait_for(lambda: [p.metadata.name for p in k8s.core.list_namespaced_pod(NS).items] == ["unrelated"],
             what="the job's pods collected")


# --------------------------------------------------------------------------- the world


def test_kubelet_and_node_controller_hooks(api: ApiServerEmulator, k8s: Clients) -> None:
    api.add_node("n1", address="10.2.0.1")
    api.add_node("n2", address="10.2.0.2")
    k8s.core.create_namespaced_pod(NS, pod("w0", node="n1"))
    k8s.core.create_namespaced_pod(NS, pod("w1"))
    running = api.set_pod_running("w1", NS, node="n2")
    assert running["spec"]["nodeName"] == "n2" and running["status"]["hostIP"] == "10.2.0.2"
    api.set_pod_running("w0", NS)
    failed = k8s.core.read_namespaced_pod("w0", NS)
    assert failed.status.phase == "Running" and failed.status.host_ip == "10.2.0.1"

    api.fail_pod("w0", NS, exit_code=137, reason="OOMKilled")
    failed = k8s.core.read_namespaced_pod("w0", NS)
    assert failed.status.phase == "Failed"
    assert failed.status.container_statuses[0].state.terminated.exit_code == 137
    assert failed.status.container_statuses[0].state.terminated.reason == "OOMKilled"

    api.set_node_ready("n1", False)
    n1 = k8s.core.read_node("n1")
    assert [c.status for c in n1.status.conditions if c.type == "Ready"] == ["False"]
    assert [t.key for t in n1.spec.taints] == ["node.kubernetes.io/not-ready"]
    api.set_node_ready("n1", None)
    assert [c.status for c in k8s.core.read_node("n1").status.conditions if c.type == "Ready"] == ["Unknown"]
    api.set_node_ready("n1", True)
    assert k8s.core.read_node("n1").spec.taints is None

    api.cordon_node("n2")
    n2 = k8s.core.read_node("n2")
    assert n2.spec.unschedulable is True and n2.spec.taints[0].key == "node.kubernetes.io/unschedulable"
    assert [n.metadata.name for n in k8s.core.list_node(field_selector="spec.unschedulable=false").items] == ["n1"]
    assert api.drain_node("n2") == [f"{NS}/w1"]
    # w1 runs on n2: it is Terminating until n2's kubelet confirms (there is none here), then forced away.
    assert k8s.core.read_namespaced_pod("w1", NS).metadata.deletion_timestamp is not None
    api.force_delete("pods", "w1", NS)
    assert [p.metadata.name for p in k8s.core.list_namespaced_pod(NS).items] == ["w0"]
    api.cordon_node("n2", cordoned=False)
    assert not k8s.core.read_node("n2").spec.unschedulable


def test_unsupported_requests_are_refused_not_ignored(k8s: Clients) -> None:
    with pytest.raises(client.ApiException) as err:
        k8s.core.create_namespaced_pod(NS, pod("w0"), dry_run="All")
    assert err.value.status == 400 and "dryRun" in message(err.value)
    assert k8s.core.list_namespaced_pod(NS).items == []
    k8s.core.create_namespaced_pod(NS, pod("w0"))
    with pytest.raises(client.ApiException) as err:
        k8s.core.patch_namespaced_pod("w0", NS, {"metadata": {"labels": {"a": "b"}}},
                                      _content_type="application/apply-patch+yaml")
    assert err.value.status == 415
    with pytest.raises(client.ApiException) as err:
        k8s.custom.list_namespaced_custom_object("example.com", "v1", NS, "widgets")
    assert err.value.status == 404


def test_eviction_subresource_deletes_the_pod(k8s: Clients) -> None:
    k8s.core.create_namespaced_pod(NS, pod("w0"))
    k8s.core.create_namespaced_pod_eviction("w0", NS, {"metadata": {"name": "w0", "namespace": NS}})
    assert k8s.core.list_namespaced_pod(NS).items == []


# --------------------------------------------------------------------------- watches


def test_watch_streams_pod_node_and_job_events_live(api: ApiServerEmulator, k8s: Clients) -> None:
    api.add_node("n1")
    k8s.core.create_namespaced_pod(NS, pod("w0", node="n1"))
    k8s.custom.create_namespaced_custom_object(*EJ, job())

    def world() -> None:
        api.fail_pod("w0", NS)
        api.set_node_ready("n1", False)
        k8s.custom.patch_namespaced_custom_object_scale(*EJ, "j", {"spec": {"replicas": 4}})

    results: dict[str, list[dict[str, Any]]] = {}
    watchers = [
        threading.Thread(target=lambda: results.__setitem__("pods", collect(k8s.core.list_namespaced_pod, NS, count=2))),
        threading.Thread(target=lambda: results.__setitem__("nodes", collect(k8s.core.list_node, count=3))),
        threading.Thread(target=lambda: results.__setitem__(
            "jobs", collect(k8s.custom.list_namespaced_custom_object, *EJ, count=2))),
    ]
    for t in watchers:
        t.start()
    actor = when_watching(api, world, watches=3)
    for t in [*watchers, actor]:
        t.join(10)

    pods = results["pods"]
    assert summary(pods) == [("ADDED", "w0"), ("MODIFIED", "w0")]
    assert pods[1]["object"].status.phase == "Failed"
    nodes = results["nodes"]
    assert summary(nodes) == [("ADDED", "n1"), ("MODIFIED", "n1"), ("MODIFIED", "n1")]
    ready = [c.status for c in nodes[1]["object"].status.conditions if c.type == "Ready"]
    assert ready == ["False"]
    jobs = results["jobs"]
    assert summary(jobs) == [("ADDED", "j"), ("MODIFIED", "j")]
    assert jobs[1]["object"]["spec"]["gpus"] == 4


def test_watch_resumes_from_a_resource_version(k8s: Clients) -> None:
    start = k8s.core.list_namespaced_pod(NS).metadata.resource_version
    k8s.core.create_namespaced_pod(NS, pod("w0"))
    k8s.core.create_namespaced_pod(NS, pod("x0", job="other"))
    k8s.core.delete_namespaced_pod("w0", NS)
    events = collect(k8s.core.list_namespaced_pod, NS, count=2, timeout=2, resource_version=start,
                     label_selector="tenplex.io/job=j")
    assert summary(events) == [("ADDED", "w0"), ("DELETED", "w0")]
    rvs = [int(e["raw_object"]["metadata"]["resourceVersion"]) for e in events]
    assert rvs == sorted(rvs) and rvs[0] > int(start)


def test_watch_from_a_compacted_resource_version_is_410_gone(api: ApiServerEmulator, k8s: Clients) -> None:
    old = k8s.core.create_namespaced_pod(NS, pod("w0")).metadata.resource_version
    k8s.core.patch_namespaced_pod("w0", NS, {"metadata": {"labels": {"a": "b"}}})
    api.compact()
    with pytest.raises(client.ApiException) as err:
        collect(k8s.core.list_namespaced_pod, NS, count=1, resource_version=old)
    assert err.value.status == 410
    # Listing gives a fresh resourceVersion that can be watched from again.
    fresh = k8s.core.list_namespaced_pod(NS).metadata.resource_version
    thread = when_watching(api, lambda: api.fail_pod("w0", NS))
    events = collect(k8s.core.list_namespaced_pod, NS, count=1, resource_version=fresh)
    thread.join(5)
    assert summary(events) == [("MODIFIED", "w0")]


def test_expire_watches_ends_open_watches_with_410(api: ApiServerEmulator, k8s: Clients) -> None:
    k8s.core.create_namespaced_pod(NS, pod("w0"))
    k8s.custom.create_namespaced_custom_object(*EJ, job())
    errors: list[int] = []

    def watch_jobs() -> None:
        try:
            collect(k8s.custom.list_namespaced_custom_object, *EJ, count=10)
        except client.ApiException as exc:
            errors.append(exc.status)

    watcher = threading.Thread(target=watch_jobs)
    watcher.start()
    deadline = time.monotonic() + 5
    while api.open_watches() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert api.expire_watches() == 1
    watcher.join(5)
    assert errors == [410]
    assert api.open_watches() == 0

    # The client's own recovery: without timeout_seconds it retries once from its last
    # resourceVersion, which is gone too, and then raises 410 to the caller.
    w = watch.Watch()
    stream = w.stream(k8s.core.list_namespaced_pod, NS)
    first = next(stream)
    assert first["type"] == "ADDED"
    when_watching(api, api.expire_watches)
    with pytest.raises(client.ApiException) as err:
        next(stream)
    assert err.value.status == 410


def test_watch_selector_sends_deleted_when_an_object_stops_matching(api: ApiServerEmulator, k8s: Clients) -> None:
    k8s.core.create_namespaced_pod(NS, pod("w0"))

    def relabel() -> None:
        k8s.core.patch_namespaced_pod("w0", NS, {"metadata": {"labels": {crd.LABEL_ROLE: "retired"}}})
        k8s.core.patch_namespaced_pod("w0", NS, {"metadata": {"labels": {crd.LABEL_ROLE: "worker"}}})

    thread = when_watching(api, relabel)
    events = collect(k8s.core.list_namespaced_pod, NS, count=3, label_selector=crd.worker_selector("j"))
    thread.join(5)
    assert summary(events) == [("ADDED", "w0"), ("DELETED", "w0"), ("ADDED", "w0")]


def test_watch_timeout_seconds_ends_the_stream(api: ApiServerEmulator, k8s: Clients) -> None:
    # Nothing happens in the namespace: the stream can only end because the server ended it (not before).
    started = time.monotonic()
    events = collect(k8s.core.list_namespaced_pod, NS, count=1, timeout=1)
    assert events == []
    assert time.monotonic() - started >= 0.9
    assert api.open_watches() == 0
