"""The ElasticJob CRD as data: CEL rules vs their Python twins, typed views, pod contracts, CLI."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex.cli import main
from tenplex.errors import InvalidInput
from tenplex.k8s import crd


def job(**spec: Any) -> dict[str, Any]:
    base = {"image": "tenplex:test", "command": ["python", "-m", "examples.gpt.train"], "gpus": 4,
            "layout": {"provider": "example-gpt", "model": {"n_layers": 2}}}
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "j"}, "spec": {**base, **spec}}


def schema_rules(schema: dict[str, Any], path: str = "") -> list[tuple[str, str]]:
    """Every (location, CEL rule) in the schema; ``[]`` marks list items."""
    found = [(path.lstrip("."), r["rule"]) for r in schema.get("x-kubernetes-validations", [])]
    for key, sub in schema.get("properties", {}).items():
        found += schema_rules(sub, f"{path}.{key}")
    if "items" in schema:
        found += schema_rules(schema["items"], f"{path}[]")
    return found


def test_every_cel_rule_in_the_schema_has_a_python_twin() -> None:
    in_schema = schema_rules(crd.openapi_schema())
    assert sorted(in_schema) == sorted(crd._RULES)
    assert len(in_schema) >= 6


CEL = celpy.Environment()
PROGRAMS = {key: CEL.program(CEL.compile(key[1])) for key in crd._RULES}

policies = st.fixed_dictionaries(
    {"type": st.sampled_from(crd.POLICY_TYPES)},
    optional={
        "table": st.lists(st.fixed_dictionaries({"gpus": st.integers(1, 16), "dp": st.integers(1, 4),
                                                 "tp": st.integers(1, 4), "pp": st.integers(1, 4)}), max_size=3),
        "stateMemoryFraction": st.sampled_from([0.0, 0.25, 0.5, 1.0]),
    },
)
specs = st.fixed_dictionaries(
    {"gpus": st.integers(0, 16), "gpusPerPod": st.integers(1, 8)},
    optional={"minGpus": st.integers(1, 16), "maxGpus": st.integers(1, 16), "policy": policies},
)


@settings(max_examples=150, deadline=None)
@given(specs)
def test_cel_rules_and_python_twins_agree(spec: dict[str, Any]) -> None:
    targets = {"spec": [spec], "spec.policy": [spec["policy"]] if "policy" in spec else [],
               "spec.policy.table[]": spec.get("policy", {}).get("table", [])}
    for (location, rule), program in PROGRAMS.items():
        message, twin = crd._RULES[(location, rule)]
        for target in targets[location]:
            expected = bool(program.evaluate({"self": celpy.json_to_cel(target)}))
            assert twin(target) == expected, f"{rule!r} on {target}: CEL says {expected}"


def test_validation_reports_every_error_with_its_values() -> None:
    bad = job(gpus=6, gpusPerPod=4, minGpus=8, maxGpus=4,
              policy={"type": "table", "table": [{"gpus": 4, "dp": 1, "tp": 2, "pp": 1}]})
    errors = crd.elasticjob_errors(bad)
    text = "\n".join(errors)
    assert "minGpus=8, maxGpus=4" in text and "gpus=6, gpusPerPod=4" in text
    assert "spec.policy.table[0]" in text and "dp=1, tp=2, pp=1, gpus=4" in text
    assert len(errors) == 5
    with pytest.raises(InvalidInput, match="ElasticJob j is invalid"):
        crd.ElasticJobSpec.from_object(bad)

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
              checkpoint={"uri": "/mnt/ckpt", "intervalSteps": 100}, nodeSelector={"pool": "a"})
    before = copy.deepcopy(obj)
    spec = crd.ElasticJobSpec.from_object(obj)
    assert obj == before, "parsing must not modify the object"
    assert spec.pods == 2 and spec.gpus_per_pod == 2 and spec.precision == "fp32"
    assert spec.store_root == crd.DEFAULT_STORE_ROOT
    assert spec.policy.lookup(4) == crd.TableEntry(gpus=4, dp=2, tp=2, pp=1, zero=1)
    assert spec.policy.lookup(6) is None and spec.policy.state_memory_fraction == 0.5
    assert (spec.checkpoint_uri, spec.checkpoint_interval_steps) == ("/mnt/ckpt", 100)
    assert spec.node_selector == {"pool": "a"} and spec.env == ({"name": "A", "value": "1"},)


def test_status_round_trip_and_conditions() -> None:
    reconf = crd.Reconfiguration(reason="scale", from_gpus=0, to_gpus=4, from_parallel=None,
                                 to_parallel=crd.Parallel(2, 2, 1), downtime_seconds=3.5, bytes_local=10,
                                 bytes_remote=20, steps_lost=0, finished_at="2026-11-21T07:00:00Z")
    status = crd.ElasticJobStatus(phase=crd.Phase.RUNNING, gpus=4, parallel=crd.Parallel(2, 2, 1), step=10,
                                  version="s10-g1", selector=crd.worker_selector("j"),
                                  last_reconfiguration=reconf, observed_generation=3)
    data = status.to_dict()
    assert data["lastReconfiguration"]["from"] == {"gpus": 0}
    assert data["lastReconfiguration"]["to"] == {"gpus": 4, "dp": 2, "tp": 2, "pp": 1}
    assert crd.ElasticJobStatus.from_dict(data) == status
    assert crd.elasticjob_errors({**job(), "status": data}) == []
    assert crd.ElasticJobStatus.from_dict(None).phase is crd.Phase.PENDING
    with pytest.raises(InvalidInput, match="'Exploded'"):
        crd.ElasticJobStatus.from_dict({"phase": "Exploded"})

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
    with pytest.raises(InvalidInput, match="'trainer'"):
        crd.job_labels("gpt", "trainer")
    assert crd.worker_selector("gpt") == "tenplex.io/job=gpt,tenplex.io/role=worker"
    env = crd.store_env(7171)
    assert env[0] == {"name": "TENPLEX_NODE_IP", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.hostIP"}}}
    assert env[1] == {"name": "TENPLEX_STORE_URL", "value": "http://$(TENPLEX_NODE_IP):7171"}
    with pytest.raises(InvalidInput, match="70000"):
        crd.store_env(70000)
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
