"""Policy decisions and crash-safe job state, without processes."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from tenplex.errors import InvalidConfig
from tenplex.ptc import DatasetState, ParallelConfig, Placement
from tenplex.scheduler.layouts import LayoutSpec
from tenplex.scheduler.policy import Policy, choose
from tenplex.scheduler.state import (
    JobSpec,
    JobStatus,
    Phase,
    Reconfiguration,
    ResumeSpec,
    Stage,
    StateDir,
    WorkerRecord,
)

MODEL = {"num_layers": 8, "hidden": 64, "heads": 8, "vocab": 500, "seq_len": 32, "make_vocab_size_divisible_by": 8}
LAYOUT = LayoutSpec("megatron-gpt", MODEL, "fp32")
DATA = DatasetState(num_samples=1024, seed=1, global_batch_size=16)


def build(cfg, placement):
    return LAYOUT.build(cfg, placement, DATA)


def hosts(n):
    return [f"node-{i}" for i in range(n)]


def test_builtin_prefers_tp_inside_node_then_dp():
    d = choose(8, Policy(), build, hosts(2), gpus_per_node=4)
    assert (d.parallel.tp, d.parallel.pp, d.parallel.dp) == (4, 1, 2)
    assert d.placement.hosts == ("node-0", "node-1")
    assert d.ptc.config["dp"] == 2


def test_builtin_takes_the_smallest_pipeline_that_fits():
    # One GPU per node: no tensor parallelism; 4 GPUs are pp1/dp4, pp2/dp2 or pp4/dp1.
    per_stage = {pp: max(choose(4, Policy(table={4: ParallelConfig(dp=4 // pp, pp=pp)}), build, hosts(4), 1)
                         .ptc.bytes_per_device().values()) for pp in (1, 2, 4)}
    assert per_stage[1] > per_stage[2] > per_stage[4]
    budget = (per_stage[1] + per_stage[2]) // 2  # too small for pp1, enough for pp2
    d = choose(4, Policy(gpu_memory_bytes=budget * 2, state_memory_fraction=0.5), build, hosts(4), gpus_per_node=1)
    assert (d.parallel.dp, d.parallel.tp, d.parallel.pp) == (2, 1, 2)
    assert max(d.ptc.bytes_per_device().values()) <= budget


def test_impossible_gpu_count_is_rejected_with_reasons():
    # 9 GPUs, 4 per node: tp must divide the node and 9 -> tp1; dp9 and dp3 do not divide the batch of 16,
    # and 9 stages exceed 8 layers.
    with pytest.raises(InvalidConfig) as err:
        choose(9, Policy(), build, hosts(3), gpus_per_node=4)
    detail = err.value.detail
    assert "no parallel configuration runs this job on 9 GPUs" in detail
    assert "dp9 x tp1 x pp1: global batch size 16 is not divisible by data-parallel size 9" in detail
    assert "dp1 x tp1 x pp9" in detail
    with pytest.raises(InvalidConfig, match="17 GPUs requested but the 2 available hosts x 4 GPUs hold 8"):
        choose(17, Policy(), build, hosts(2), gpus_per_node=4)
    budget = Policy(gpu_memory_bytes=1024)
    with pytest.raises(InvalidConfig, match=r"exceeds the budget 512 B"):
        choose(1, budget, build, hosts(1), gpus_per_node=1)


def test_table_is_used_and_checked():
    table = {4: ParallelConfig(dp=1, tp=2, pp=2)}
    d = choose(4, Policy(table=table), build, hosts(1), gpus_per_node=4)
    assert d.parallel == table[4]
    with pytest.raises(InvalidConfig, match="no entry for 2 GPUs"):
        choose(2, Policy(table=table), build, hosts(1), gpus_per_node=4)
    with pytest.raises(InvalidConfig, match="policy table entry for 4 GPUs is dp1 x tp1 x pp2 = 2 GPUs"):
        Policy(table={4: ParallelConfig(pp=2)})


def test_layout_spec_rejects_bad_models_at_creation():
    with pytest.raises(InvalidConfig, match="unknown layout provider 'nope'; registered .*megatron-gpt"):
        LayoutSpec("nope", {})
    with pytest.raises(InvalidConfig, match="cannot import 'no_such_module'"):
        LayoutSpec("no_such_module:layout", {})
    with pytest.raises(InvalidConfig, match="'tenplex.testing.layouts' has no 'nothing'"):
        LayoutSpec("tenplex.testing.layouts:nothing", {})
    with pytest.raises(InvalidConfig, match="is a function, not a layout provider"):
        LayoutSpec("tenplex.ptc.megatron:megatron_gpt_ptc", {})
    with pytest.raises(InvalidConfig, match="tenplex.testing.layouts:mlp_layout model: unknown fields width"):
        LayoutSpec("tenplex.testing.layouts:mlp_layout", {"layers": 1, "width": 4})
    with pytest.raises(InvalidConfig, match="an MLP needs layers >= 1"):
        LayoutSpec("tenplex.testing.layouts:mlp_layout", {"layers": 0, "dim": 4})
    with pytest.raises(InvalidConfig, match="unknown fields bogus"):
        LayoutSpec("megatron-gpt", {**MODEL, "bogus": 1})
    with pytest.raises(InvalidConfig, match="precision"):
        LayoutSpec("megatron-gpt", MODEL, "fp8")


def test_layout_spec_passes_megatron_conventions():
    """The megatron-gpt model object carries the naming, padding and bucket conventions to the PTC."""
    layout = LayoutSpec.from_json({"provider": "megatron-gpt", "precision": "bf16", "model": {
        **MODEL, "naming": "megatron-core", "normalization": "RMSNorm", "overlap_grad_reduce": True}})
    ptc = layout.build(ParallelConfig(tp=2, zero=1), Placement.uniform(2, 2), DATA)
    assert ptc.tensor("embedding.word_embeddings.weight").shape == (500, 64)  # megatron-core does not pad
    assert ptc.has_tensor("decoder.layers.7.input_layernorm.weight")
    assert LayoutSpec.from_json(layout.to_json()) == layout
    with pytest.raises(InvalidConfig, match="naming must be one of megatron-lm, megatron-core, got 'hf'"):
        LayoutSpec("megatron-gpt", {**MODEL, "naming": "hf"})


def spec(**kw):
    base = dict(name="gpt", layout=LAYOUT, dataset=DATA, command=("python", "train.py"), gpus=4, min_gpus=1, max_gpus=8)
    base.update(kw)
    return JobSpec(**base)


def test_job_spec_validation_messages():
    with pytest.raises(InvalidConfig, match="DNS-1123"):
        spec(name="Bad_Name")
    with pytest.raises(InvalidConfig, match=r"gpus must be an integer in \[1, 8\]"):
        spec(gpus=9)
    with pytest.raises(InvalidConfig, match="min_gpus <= max_gpus"):
        spec(min_gpus=4, max_gpus=2)
    with pytest.raises(InvalidConfig, match="worker command"):
        spec(command=())
    with pytest.raises(InvalidConfig, match="gpus must be a multiple of gpus_per_pod 4 for job 'gpt', got 6"):
        spec(gpus=6, gpus_per_pod=4)
    with pytest.raises(InvalidConfig, match="gpus_per_pod must be an integer >= 1, got 0"):
        spec(gpus_per_pod=0)
    with pytest.raises(InvalidConfig, match="max_restarts must be an integer >= 0, got -1"):
        spec(max_restarts=-1)


def test_resume_from_is_checked_and_round_trips() -> None:
    r = ResumeSpec("s3://bucket/jobs", job="orig", version="s40-g1")
    assert ResumeSpec.from_json(r.to_json()) == r and r.source_job("copy") == "orig"
    assert ResumeSpec.from_json({"uri": "file:///ckpt"}) == ResumeSpec("file:///ckpt", None, "latest")
    assert ResumeSpec("file:///ckpt").source_job("gpt") == "gpt"
    s = spec(resume_from=r)
    assert JobSpec.from_json(json.loads(json.dumps(s.to_json()))) == s
    assert JobSpec.from_json({k: v for k, v in spec().to_json().items() if k != "resume_from"}).resume_from is None
    for bad, says in (({"uri": "http://x/y"}, "resume_from uri must look like"),
                      ({"uri": "s3://b/p?secret=1"}, "no credentials"),
                      ({"uri": "file:///c", "version": "40"}, "resume_from version must be 'latest' or a version"),
                      ({"uri": "file:///c", "job": "Bad_Name"}, "resume_from job"),
                      ({"uri": "file:///c", "extra": 1}, "unknown resume_from fields: extra"),
                      ({"job": "orig"}, "resume_from needs uri"),
                      ("file:///c", "resume_from must be an object")):
        with pytest.raises(InvalidConfig, match=re.escape(says)):
            ResumeSpec.from_json(bad)  # type: ignore[arg-type]


def test_state_round_trips_and_writes_atomically(tmp_path):
    state = StateDir(tmp_path)
    s = spec(gpus_per_pod=2, max_restarts=5)
    status = JobStatus(phase=Phase.RECONFIGURING, stage=Stage.TRANSFERRING, generation=2, gpus=4,
                       parallel=ParallelConfig(dp=2, tp=2).to_json(), hosts=["host-0", "host-1"], step=17,
                       version="s17-g2", committed={"s17-g2": ["host-0"]}, failures_without_progress=2,
                       workers=[WorkerRecord("gpt-g2-r0", 0, "host-0", 0, 2, pid=123)],
                       history=[Reconfiguration(reason="scale", started_at=1.0, from_config="dp1 x tp1 x pp1")])
    state.save(s, status)
    state.save_ptc("gpt", 2, build(ParallelConfig(dp=2, tp=2), choose(4, Policy(), build, hosts(1), 4).placement))
    [(s2, st2)] = state.load_all()
    assert s2.to_json() == s.to_json()
    assert st2.to_json() == status.to_json()
    assert st2.parallel_config == ParallelConfig(dp=2, tp=2)
    assert state.load_ptc("gpt", 2).config["dp"] == 2
    # No temp files are left behind, and the file is complete JSON.
    files = sorted(p.name for p in (tmp_path / "jobs").iterdir())
    assert files == ["gpt", "gpt.json"]
    json.loads((tmp_path / "jobs" / "gpt.json").read_text())
    state.delete("gpt")
    assert state.load_all() == []


def test_providers_are_registered_by_entry_points_and_resolved_by_name():
    from tenplex.ptc.megatron import megatron_gpt_layout
    from tenplex.scheduler.layouts import registered_providers, resolve_provider
    from tenplex.testing.layouts import mlp_layout

    # Tenplex registers megatron-gpt, torchtitan and transformers; the tenplex-examples distribution
    # (examples/pyproject.toml) example-gpt.
    assert {"megatron-gpt", "torchtitan", "transformers", "example-gpt"} <= set(registered_providers())
    assert resolve_provider("megatron-gpt") is megatron_gpt_layout
    assert resolve_provider("tenplex.testing.layouts:mlp_layout") is mlp_layout
    spec = LayoutSpec("tenplex.testing.layouts:mlp_layout", {"layers": 2, "dim": 8}, "bf16")
    ptc = spec.build(ParallelConfig(dp=2, tp=2), Placement(2, ("a", "b")), None)
    assert [t.name for t in ptc.tensors] == ["layers.0.weight", "layers.1.weight"]
    assert ptc.tensors[0].dtype == "bfloat16" and ptc.hosts == ("a", "b")
    with pytest.raises(InvalidConfig, match="the MLP runs on one stage"):
        spec.build(ParallelConfig(pp=2), Placement(2, ("a",)), None)


def test_the_product_never_imports_the_examples():
    """The example providers are found through entry-point metadata: naming them imports nothing until used."""
    import subprocess
    import sys

    code = ("import sys; from tenplex.scheduler.server import LocalScheduler; "
            "from tenplex.scheduler.layouts import LayoutSpec, registered_providers; "
            "from tenplex.k8s.operator import KubernetesScheduler; import tenplex.cli, tenplex.demo; "
            "assert 'example-gpt' in registered_providers(); "
            "LayoutSpec('megatron-gpt', {'num_layers': 2, 'hidden': 8, 'heads': 2, 'vocab': 16}); "
            "print(sorted(m for m in sys.modules if m == 'examples' or m.startswith('examples.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_status_serializes_every_field_and_round_trips() -> None:
    """``JobStatus.to_json`` is written field by field (for speed): a field added to the dataclass and not to
    the JSON would be lost at the next save. Every field is set to a value other than its default here."""
    status = JobStatus(
        phase=Phase.RECONFIGURING, stage=Stage.TRANSFERRING, generation=3, gpus=4, parallel={"dp": 2},
        hosts=["h0"], gpus_per_node=2, step=9, version="s8-g2", committed={"s8-g2": ["h0"]},
        version_generation={"s8-g2": 2}, requested_gpus=8, requested_parallel={"dp": 4}, pending_reason="scale",
        target_gpus=4, target_parallel={"dp": 2}, master_addr="10.0.0.1", master_port=29501,
        downtime_started_at=5.0, restored_step=8, stop_at_step=9, restore_version="s8-g2",
        failures_without_progress=1, workers=[WorkerRecord("w-g3-r0", 0, "h0", 0, 3, pid=7)],
        history=[Reconfiguration(reason="scale", started_at=1.0, from_config="dp1 x tp1 x pp1",
                                 marks={"requested": 1.0}, phases={"planning": 0.1})],
        message="m", persisted=["s4-g1"], persist={"version": "s8-g2", "state": "uploading"},
        resumed_from={"uri": "file:///ckpt", "job": "orig", "version": "s6-g0", "step": 6, "consumed_samples": 48},
        spec_update={"fields": ["env"], "redeploy": True, "pending": True, "requested_at": 2.0, "generation": None},
        standby_ready=1,
        standby_wanted=2, last_plan={"plan": {}}, updated_at=3.0)
    defaults = JobStatus()
    for f in dataclasses.fields(JobStatus):
        assert getattr(status, f.name) != getattr(defaults, f.name), f"set {f.name} in this test"
    data = status.to_json()
    assert set(data) == {f.name for f in dataclasses.fields(JobStatus)}
    assert JobStatus.from_json(json.loads(json.dumps(data))) == status
    assert "last_plan" not in status.to_json(plan=False)
