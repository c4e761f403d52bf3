"""One job-spec model for both contracts: the REST body and the ElasticJob spec share their parts, the CRD's
schema is generated from the model as a structural schema, and both shapes convert to the same JobSpec."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import ValidationError

from tenplex.k8s import crd
from tenplex.scheduler.jobspec import CRD, ElasticJobSpec, JobCreate, structural_schema

LAYOUT = {"provider": "tenplex.testing.layouts:mlp_layout", "model": {"layers": 2, "dim": 8}}


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every schema object of a schema, with where it is."""
    out = [(path, node)]
    for key, sub in node.get("properties", {}).items():
        out += _walk(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            out += _walk(node[key], f"{path}[]")
    for i, sub in enumerate(node.get("anyOf", ())):
        out += _walk(sub, f"{path}|{i}")
    return out


def test_both_shapes_share_their_parts() -> None:
    for rest, kube in (("layout", "layout"), ("checkpoint", "checkpoint"), ("resume_from", "resume_from")):
        assert JobCreate.model_fields[rest].annotation == ElasticJobSpec.model_fields[kube].annotation
    training = ElasticJobSpec.model_fields["training"].annotation.__args__[0]  # Training | None
    assert training.model_fields["dataset"].annotation is JobCreate.model_fields["dataset"].annotation


def test_the_crd_schema_is_structural() -> None:
    """What the API server requires of a CRD's schema: no references, no nullable unions, no boolean
    additionalProperties, OpenAPI v3.0 bounds; every object typed."""
    nodes = _walk(crd.openapi_schema()["properties"]["spec"])
    for where, node in nodes:
        assert not {"$ref", "$defs", "title", "exclusiveMinimum"} & set(node), where
        assert not isinstance(node.get("additionalProperties"), bool), where
        assert {"type": "null"} not in node.get("anyOf", ()), where
        assert "type" in node or "anyOf" in node, where
    spec = dict(nodes)
    assert spec[".layout.model"] == {"type": "object", "description": spec[".layout.model"]["description"],
                                     "x-kubernetes-preserve-unknown-fields": True}
    assert spec[".resumeFrom"]["required"] == ["uri"] and spec[".resumeFrom.version"]["default"] == "latest"
    assert spec[".training.dataset"]["required"] == ["numSamples", "globalBatchSize"]
    assert structural_schema(ElasticJobSpec) == crd.openapi_schema()["properties"]["spec"]


def test_both_shapes_make_the_same_job_spec() -> None:
    rest = JobCreate.model_validate({
        "name": "j", "layout": LAYOUT, "image": "img", "command": ["python", "train.py"], "gpus": 4, "max_gpus": 8,
        "dataset": {"num_samples": 64, "global_batch_size": 8, "seed": 3},
        "policy": {"table": {"4": {"dp": 2, "tp": 2, "pp": 1}}, "state_memory_fraction": 0.25},
        "steps": 20, "snapshot_every": 5, "heartbeat_timeout": 30, "max_restarts": 1, "env": {"A": "1"},
        "checkpoint": {"uri": "file:///ckpt"}, "resume_from": {"uri": "s3://b/p", "version": "s40-g1"},
    }).to_job_spec()
    kube = crd.parse_spec({"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "j"}, "spec": {
        "image": "img", "command": ["python"], "args": ["train.py"], "gpus": 4, "maxGpus": 8, "layout": LAYOUT,
        "policy": {"type": "table", "table": [{"gpus": 4, "dp": 2, "tp": 2, "pp": 1}], "stateMemoryFraction": 0.25},
        "training": {"steps": 20, "snapshotEvery": 5, "heartbeatTimeoutSeconds": 30, "maxRestarts": 1,
                     "dataset": {"numSamples": 64, "globalBatchSize": 8, "seed": 3}},
        "env": [{"name": "A", "value": "1"}, {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}],
        "checkpoint": {"uri": "file:///ckpt"}, "resumeFrom": {"uri": "s3://b/p", "version": "s40-g1"},
    }}).to_job_spec("j")
    # What else the pods get (the Kubernetes backend makes them from the ElasticJob) is kept to see a change.
    assert kube.pod == {"envValueFrom": [{"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]}
    assert dataclasses.replace(kube, pod={}) == rest
    # Without intervalSteps every snapshot is persisted; two versions are kept unless told otherwise.
    assert (rest.checkpoint.interval_steps, rest.checkpoint.keep_last) == (5, 2)
    assert rest.to_json()["env"] == {"A": "1"}


def test_each_shape_reads_only_its_own_names() -> None:
    body = {"name": "j", "layout": LAYOUT, "command": ["x"], "gpus": 1,
            "dataset": {"numSamples": 64, "globalBatchSize": 8}}
    with pytest.raises(ValidationError, match="num_samples"):
        JobCreate.model_validate(body)  # the REST API's names are snake_case
    spec = {"image": "i", "command": ["x"], "gpus": 1, "layout": LAYOUT, "gpus_per_pod": 1}
    with pytest.raises(ValidationError, match="gpus_per_pod"):
        ElasticJobSpec.model_validate(spec, context=CRD)  # the CRD's are camelCase
    spec["gpusPerPod"] = spec.pop("gpus_per_pod")
    assert ElasticJobSpec.model_validate(spec, context=CRD).gpus_per_pod == 1
