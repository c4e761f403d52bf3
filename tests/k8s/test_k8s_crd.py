"""The ElasticJob CRD as data: its CEL rules and their Python twins on the spec models (checked against a CEL
interpreter and against kube-apiserver), typed views, pod contracts, CLI."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes.client import ApiException

from tenplex.cli import main
from tenplex.errors import InvalidInput
from tenplex.k8s import crd
from tenplex.scheduler.jobspec import (
    IMMUTABLE,
    RULES,
    EnvVar,
    ResumeBody,
    TableEntry,
    immutable_changes,
)
from tenplex.testing.k8s import cel
from tenplex.testing.k8s.cluster import TestCluster


def job(**spec: Any) -> dict[str, Any]:
    base = {"image": "tenplex:test", "command": ["python", "-m", "examples.gpt.train"], "gpus": 4,
            "layout": {"provider": "example-gpt", "model": {"n_layers": 2}}}
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "j"}, "spec": {**base, **spec}}


SPEC_RULES = {
    "spec": ["minGpus must not exceed maxGpus", "gpus must be a multiple of gpusPerPod",
             "gpus must be 0 (suspended) or at least minGpus", "gpus must not exceed maxGpus",
             *(i.message for i in IMMUTABLE)],
    "spec.policy": ["a policy of type table needs a non-empty table", "stateMemoryFraction must be greater than 0"],
    "spec.policy.table[]": ["dp * tp * pp must equal gpus in every table entry"],
}


def test_the_crd_carries_the_models_rules() -> None:
    """Every rule the models apply is an x-kubernetes-validations entry of the schema at its place, with its
    message, and the schema has no other."""
    found = cel.rules(crd.openapi_schema())
    assert {loc: [r.message for r in found if r.location == loc] for loc in SPEC_RULES} == SPEC_RULES
    assert len(found) == sum(map(len, SPEC_RULES.values()))
    assert {(r.location, r.rule, r.message) for r in found} == {
        (loc, r.cel, r.message) for loc, rules in RULES.items() for r in rules} | {
        ("spec", i.cel, i.message) for i in IMMUTABLE}


_LIVE = {"image": "tenplex:test", "command": ["python", "-m", "examples.gpt.train"], "gpus": 4,
         "layout": {"provider": "example-gpt", "model": {"n_layers": 2}},
         "training": {"steps": 20, "dataset": {"numSamples": 512, "globalBatchSize": 8}}}
_MESSAGE = {i.field: i.message for i in IMMUTABLE}

TRANSITION_CASES = [
    # What only shapes the workers (or only the scheduler reads) may change.
    ({"env": [{"name": "LR", "value": "0.1"}], "args": ["--fast"], "image": "tenplex:new", "gpus": 8,
      "resources": {"limits": {"memory": "2Gi"}}, "standby": True, "minGpus": 2,
      "training": {**_LIVE["training"], "steps": 40, "snapshotEvery": 5, "maxRestarts": 9}}, []),
    ({"checkpoint": {"uri": "file:///ckpt", "keepLast": 3}}, [_MESSAGE["spec.checkpoint.uri"]]),
    # What the state is may not.
    ({"layout": {**_LIVE["layout"], "precision": "bf16"}}, [_MESSAGE["spec.layout"]]),
    ({"training": {"steps": 20, "dataset": {"numSamples": 512, "globalBatchSize": 8, "seed": 1}}},
     [_MESSAGE["spec.training.dataset"]]),
    ({"policy": {"zero": 1}}, [_MESSAGE["spec.policy"]]),
    ({"gpusPerPod": 2}, [_MESSAGE["spec.gpusPerPod"]]),
    ({"resumeFrom": {"uri": "file:///ckpt"}}, [_MESSAGE["spec.resumeFrom"]]),
]


@pytest.mark.parametrize(("change", "broken"), TRANSITION_CASES)
def test_the_transition_rules_and_their_twins_refuse_the_same_changes(change: dict[str, Any],
                                                                     broken: list[str]) -> None:
    """The CRD's transition rules (``oldSelf``), evaluated from its strings on an update, refuse exactly what
    :func:`immutable_changes` refuses of the scheduler's JobSpecs, with the same messages; neither runs on a
    create."""
    schema = crd.openapi_schema()
    old, new = job(**_LIVE), job(**{**_LIVE, **change})
    failures = cel.evaluate(schema, crd.apply_defaults(schema, new), old=crd.apply_defaults(schema, old))
    assert [f.message for f in failures] == broken
    assert not cel.evaluate(schema, crd.apply_defaults(schema, new))
    specs = [crd.parse_spec(o).to_job_spec("j") for o in (old, new)]
    assert [i.message for i in immutable_changes(*specs)] == broken


def test_the_free_form_model_is_immutable_too(api: TestCluster) -> None:
    """``spec.layout.model`` is free-form (x-kubernetes-preserve-unknown-fields): the API server refuses a
    change of it as of the rest of the layout, and so does the scheduler's twin."""
    old, new = job(**_LIVE), job(**{**_LIVE, "layout": {"provider": "example-gpt", "model": {"n_layers": 4}}})
    specs = [crd.parse_spec(o).to_job_spec("j") for o in (old, new)]
    assert [i.field for i in immutable_changes(*specs)] == ["spec.layout"]
    created = api.create("elasticjobs", old)
    with pytest.raises(ApiException) as refused:
        api.request("PUT", crd_path(created), {**created, "spec": {**created["spec"], "layout": new["spec"]["layout"]}})
    assert refused.value.status == 422 and _MESSAGE["spec.layout"] in refused.value.body


@pytest.mark.parametrize(("change", "broken"), [TRANSITION_CASES[0], TRANSITION_CASES[2], TRANSITION_CASES[3],
                                                TRANSITION_CASES[4]])
def test_the_api_server_refuses_changes_of_what_the_state_is(api: TestCluster, change: dict[str, Any],
                                                             broken: list[str]) -> None:
    """kube-apiserver evaluates the transition rules on an update of a live ElasticJob: a change of what the
    state is comes back 422 with the rule's message and leaves the object as it was."""
    created = api.create("elasticjobs", job(**_LIVE))
    body = {**created, "spec": {**created["spec"], **change}}
    if not broken:
        assert api.request("PUT", crd_path(created), body)["spec"]["image"] == change["image"]
        return
    with pytest.raises(ApiException) as refused:
        api.request("PUT", crd_path(created), body)
    assert refused.value.status == 422
    assert broken[0] in refused.value.body
    assert api.get("elasticjobs", "j")["spec"] == created["spec"]


def crd_path(obj: dict[str, Any]) -> str:
    return f"/apis/{crd.API_VERSION}/namespaces/{obj['metadata']['namespace']}/{crd.PLURAL}/{obj['metadata']['name']}"


RULE_CASES = [
    ({"gpus": 4, "gpusPerPod": 2, "minGpus": 2, "maxGpus": 8}, []),
    ({"gpus": 0, "gpusPerPod": 2, "minGpus": 2}, []),  # 0: suspended, below minGpus on purpose
    ({"gpus": 3, "gpusPerPod": 2}, ["gpus must be a multiple of gpusPerPod"]),
    ({"gpus": 2, "gpusPerPod": 1, "minGpus": 4, "maxGpus": 2},
     ["minGpus must not exceed maxGpus", "gpus must be 0 (suspended) or at least minGpus"]),
    ({"gpus": 16, "gpusPerPod": 1, "maxGpus": 8}, ["gpus must not exceed maxGpus"]),
    ({"gpus": 4, "gpusPerPod": 1, "policy": {"type": "table"}}, ["a policy of type table needs a non-empty table"]),
    ({"gpus": 4, "gpusPerPod": 1, "policy": {"type": "table", "table": []}},
     ["a policy of type table needs a non-empty table"]),
    ({"gpus": 4, "gpusPerPod": 1, "policy": {"type": "builtin", "stateMemoryFraction": 0}},
     ["stateMemoryFraction must be greater than 0"]),
    # An integer written where the schema says number is a double to CEL, as on the API server.
    ({"gpus": 4, "gpusPerPod": 1, "policy": {"type": "builtin", "stateMemoryFraction": 1}}, []),
    ({"gpus": 4, "gpusPerPod": 1, "policy": {"type": "table", "table": [
        {"gpus": 4, "dp": 2, "tp": 2, "pp": 1}, {"gpus": 8, "dp": 2, "tp": 2, "pp": 1}]}},
     ["dp * tp * pp must equal gpus in every table entry"]),
]


def _offline(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """(path, message) of every rule the models say ``spec`` breaks."""
    errors = crd.elasticjob_errors(job(**spec))
    assert all('Invalid value: "object": ' in e for e in errors), errors
    return [(e.split(": ", 1)[0], e.split('"object": ', 1)[1].split(" (got ", 1)[0]) for e in errors]


@pytest.mark.parametrize(("spec", "broken"), RULE_CASES)
def test_the_models_and_the_cel_strings_refuse_the_same(spec: dict[str, Any], broken: list[str]) -> None:
    failures = cel.evaluate(crd.openapi_schema(), {"spec": spec})
    assert [f.message for f in failures] == broken
    for f in failures:  # worded as the API server words them
        assert str(f) == f'{f.path}: Invalid value: "object": {f.message}' and f.error is None
    table = spec.get("policy", {}).get("table", [])
    if broken == ["dp * tp * pp must equal gpus in every table entry"]:
        assert [f.path for f in failures] == [f"spec.policy.table[{len(table) - 1}]"]
    assert _offline(spec) == [(f.path, f.message) for f in failures]


_GPUS = st.integers(min_value=0, max_value=9)
_ENTRY = st.fixed_dictionaries({"gpus": st.integers(1, 8), "dp": st.integers(1, 3), "tp": st.integers(1, 3),
                                "pp": st.integers(1, 2)})
_POLICY = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["builtin", "table"]),
    "table": st.lists(_ENTRY, max_size=3, unique_by=lambda e: e["gpus"]),
    "stateMemoryFraction": st.sampled_from([0, 0.0, 0.25, 1, 1.0])})
_SPEC = st.fixed_dictionaries({"gpus": _GPUS}, optional={
    "gpusPerPod": st.integers(1, 4), "minGpus": st.integers(1, 9), "maxGpus": st.integers(1, 9), "policy": _POLICY})


@settings(max_examples=200, deadline=None)
@given(_SPEC)
def test_the_models_agree_with_the_cel_strings_on_any_spec(spec: dict[str, Any]) -> None:
    """The oracle: the CRD's own CEL strings, evaluated by cel-python on the spec with the schema's defaults applied
    (as the API server does), break exactly the rules the models' validators report, at the same paths."""
    schema = crd.openapi_schema()
    failures = cel.evaluate(schema, {"spec": crd.apply_defaults(schema, job(**spec))["spec"]})
    assert all(f.error is None for f in failures)
    assert sorted(_offline(spec)) == sorted((f.path, f.message) for f in failures)


@pytest.mark.parametrize(("spec", "broken"), RULE_CASES)
def test_the_api_server_refuses_what_the_rules_refuse(api: TestCluster, spec: dict[str, Any],
                                                      broken: list[str]) -> None:
    """The same specs created on the test cluster: kube-apiserver evaluates the CRD's CEL rules itself, and
    refuses exactly the ones the offline evaluation refuses, with the same messages."""
    job = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "ej"},
           "spec": {"image": "tenplex:test", "command": ["python"], "layout": {"provider": "megatron-gpt"}, **spec}}
    if not broken:
        api.create("elasticjobs", job)
        return
    with pytest.raises(ApiException) as refused:
        api.create("elasticjobs", job)
    assert refused.value.status == 422
    causes = [c["message"] for c in json.loads(refused.value.body)["details"]["causes"]]
    assert sorted(m.split(": ", 1)[-1] for m in causes if "Invalid value" in m or m in broken) == sorted(broken), causes


def test_a_rule_that_cannot_be_evaluated_is_an_error_naming_it() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "x-kubernetes-validations": [{"rule": "self.a > 0", "message": "a must be positive"}]}
    (failure,) = cel.evaluate(schema, {})
    assert failure.error is not None and "no such" in failure.error.lower()
    assert "rule 'self.a > 0' could not be evaluated" in str(failure)


def test_validation_reports_every_error_with_its_values() -> None:
    bad = job(gpus=6, gpusPerPod=4, minGpus=8, maxGpus=4,
              policy={"type": "table", "table": [{"gpus": 4, "dp": 1, "tp": 2, "pp": 1}]})
    errors = crd.elasticjob_errors(bad)
    text = "\n".join(errors)
    assert "minGpus=8, maxGpus=4" in text and "gpus=6, gpusPerPod=4" in text
    assert "spec.policy.table[0]" in text and "dp=1, tp=2, pp=1, gpus=4" in text
    assert len(errors) == 5
    with pytest.raises(InvalidInput, match="ElasticJob j is invalid"):
        crd.parse_spec(bad)

    assert any("'command' is a required property" in e for e in crd.elasticjob_errors(
        {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "x"},
         "spec": {"image": "i", "gpus": 1, "layout": {"provider": "example-gpt"}}}))
    assert crd.elasticjob_errors({**job(), "apiVersion": "tenplex.io/v1"}) == [
        "apiVersion: expected 'tenplex.io/v1alpha1', got 'tenplex.io/v1'"]
    unknown = crd.elasticjob_errors(job(policy={"type": "builtin", "gpuMemory": 1}))
    assert unknown == ["spec.policy: Additional properties are not allowed ('gpuMemory' was unexpected)"]
    # The model block is the provider's business: unknown fields pass through.
    assert crd.elasticjob_errors(job(layout={"provider": "megatron-gpt", "model": {"anything": 1}})) == []
    # A provider is a registered name or a module:function spec (the scheduler resolves it when it creates the job).
    assert crd.elasticjob_errors(job(layout={"provider": "mypackage.layout:my_layout"})) == []
    [bad_provider] = crd.elasticjob_errors(job(layout={"provider": "Not A Provider"}))
    assert bad_provider.startswith("spec.layout.provider: 'Not A Provider' does not match"), bad_provider


def test_spec_view_applies_defaults_and_reads_everything() -> None:
    obj = job(gpusPerPod=2, minGpus=2, maxGpus=8, env=[{"name": "A", "value": "1"}],
              policy={"type": "table", "table": [{"gpus": 4, "dp": 2, "tp": 2, "pp": 1, "zero": 1}]},
              checkpoint={"uri": "/mnt/ckpt", "intervalSteps": 100})
    before = copy.deepcopy(obj)
    spec = crd.parse_spec(obj)
    assert obj == before, "parsing must not modify the object"
    assert spec.pods == 2 and spec.gpus_per_pod == 2 and spec.layout.precision == "fp32"
    assert spec.policy.lookup(4) == TableEntry(gpus=4, dp=2, tp=2, pp=1, zero=1)
    assert spec.policy.lookup(6) is None and spec.policy.state_memory_fraction == 0.5
    assert (spec.checkpoint.uri, spec.checkpoint.interval_steps, spec.checkpoint.keep_last) == ("/mnt/ckpt", 100, 2)
    assert spec.env == [EnvVar(name="A", value="1")]


def test_resume_from_is_validated_and_reaches_the_job_spec() -> None:
    from tenplex.k8s.operator import job_spec_from_elasticjob
    from tenplex.scheduler.state import ResumeSpec

    training = {"steps": 50, "snapshotEvery": 5, "heartbeatTimeoutSeconds": 60,
                "dataset": {"numSamples": 4096, "globalBatchSize": 8}}
    obj = job(training=training, resumeFrom={"uri": "s3://b/jobs", "job": "orig", "version": "s40-g1"})
    assert crd.elasticjob_errors(obj) == []
    assert crd.parse_spec(obj).resume_from == ResumeBody(uri="s3://b/jobs", job="orig", version="s40-g1")
    assert job_spec_from_elasticjob(obj).resume_from == ResumeSpec("s3://b/jobs", "orig", "s40-g1")
    latest = job(training=training, resumeFrom={"uri": "file:///mnt/ckpt"})
    assert job_spec_from_elasticjob(latest).resume_from == ResumeSpec("file:///mnt/ckpt", None, "latest")
    assert job_spec_from_elasticjob(job(training=training)).resume_from is None
    [bad_version] = crd.elasticjob_errors(job(resumeFrom={"uri": "file:///c", "version": "40"}))
    assert bad_version.startswith("spec.resumeFrom.version: '40' does not match"), bad_version
    [bad_job] = crd.elasticjob_errors(job(resumeFrom={"uri": "file:///c", "job": "Orig"}))
    assert bad_job.startswith("spec.resumeFrom.job: 'Orig' does not match"), bad_job
    [no_uri] = crd.elasticjob_errors(job(resumeFrom={"job": "orig"}))
    assert no_uri == "spec.resumeFrom: 'uri' is a required property", no_uri


def test_status_round_trip_and_conditions() -> None:
    reconf = crd.Reconfiguration(reason="scale", from_=crd.Side.of(0, None), to=crd.Side.of(4, crd.Parallel(2, 2, 1)),
                                 downtime_seconds=3.5, bytes_local=10,
                                 bytes_remote=20, steps_lost=0, finished_at="2026-11-21T07:00:00Z")
    status = crd.ElasticJobStatus(phase=crd.Phase.RUNNING, gpus=4, parallel=crd.Parallel(2, 2, 1), step=10,
                                  version="s10-g1", selector=crd.worker_selector("j"),
                                  last_reconfiguration=reconf, observed_generation=3)
    data = status.to_dict()
    assert data["lastReconfiguration"]["from"] == {"gpus": 0}
    assert data["lastReconfiguration"]["to"] == {"gpus": 4, "dp": 2, "tp": 2, "pp": 1}
    assert crd.elasticjob_errors({**job(), "status": data}) == []

    first = crd.set_condition([], crd.Condition("Ready", "False", reason="Starting", last_transition_time="t0"))
    same = crd.set_condition(first, crd.Condition("Ready", "False", reason="StillStarting", last_transition_time="t1"))
    assert same[0]["lastTransitionTime"] == "t0" and same[0]["reason"] == "StillStarting"
    flipped = crd.set_condition(same, crd.Condition("Ready", "True", last_transition_time="t2"))
    assert flipped[0]["lastTransitionTime"] == "t2" and len(flipped) == 1
    both = crd.set_condition(flipped, crd.Condition("Reconfiguring", "True", observed_generation=2))
    assert [c["type"] for c in both] == ["Ready", "Reconfiguring"] and both[1]["observedGeneration"] == 2
    with pytest.raises(InvalidInput, match="'yes'"):
        crd.Condition("Ready", "yes")


def test_pod_contracts() -> None:
    assert crd.job_labels("gpt") == {"tenplex.io/job": "gpt", "tenplex.io/role": "worker"}
    assert crd.worker_selector("gpt") == "tenplex.io/job=gpt,tenplex.io/role=worker"
    ref = crd.owner_reference({"metadata": {"name": "gpt", "uid": "u-1"}})
    assert ref["controller"] is True and ref["kind"] == crd.KIND and ref["uid"] == "u-1"
    with pytest.raises(InvalidInput, match="uid"):
        crd.owner_reference({"metadata": {"name": "gpt"}})


def test_crd_manifest_shape() -> None:
    manifest = crd.crd_manifest()
    (version,) = manifest["spec"]["versions"]
    assert manifest["metadata"]["name"] == "elasticjobs.tenplex.io" and manifest["spec"]["scope"] == "Namespaced"
    assert manifest["spec"]["names"]["shortNames"] == ["ej"]
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.gpus", "statusReplicasPath": ".status.gpus",
                                                "labelSelectorPath": ".status.selector"}
    assert "status" in version["subresources"]
    shown = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert shown == ["Phase", "GPUs", "DP", "TP", "PP", "Step", "Age"]


def test_cli_prints_the_crd_and_validates_manifests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["k8s", "crd"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == crd.crd_manifest()

    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump(job()))
    bad.write_text(yaml.safe_dump_all([job(), {**job(gpus=3, gpusPerPod=2), "metadata": {"name": "odd"}}]))
    assert main(["k8s", "validate", str(good)]) == 0
    assert "ElasticJob j: valid" in capsys.readouterr().out
    assert main(["k8s", "validate", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "ElasticJob odd: invalid" in out and "gpus=3, gpusPerPod=2" in out
    empty = tmp_path / "empty.yaml"
    empty.write_text("kind: ConfigMap\n")
    assert main(["k8s", "validate", str(empty)]) == 1
    assert "no ElasticJob document" in capsys.readouterr().err
