"""The ``torchtitan`` layout provider: the PTC derived from a job's own config function, and what it refuses."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.trainer", reason="torchtitan's Trainer is installed by `make test` (.[clients])")

from tenplex.errors import InvalidConfig  # noqa: E402
from tenplex.integrations.torchtitan.layout import TorchtitanJob, torchtitan_layout  # noqa: E402
from tenplex.ptc import DatasetState, ParallelConfig, Placement, TensorKind  # noqa: E402
from tenplex.registry import LAYOUTS, resolve  # noqa: E402

pytestmark = pytest.mark.xdist_group("clients")

JOB = TorchtitanJob("tests.integrations.titan_job", "llama3_tiny")
DATASET = DatasetState(num_samples=64, seed=0, global_batch_size=8)
QKV = "layers.{}.attention.qkv_linear.wqkv.weight"


def _ptc(parallel: ParallelConfig, job: TorchtitanJob = JOB):
    return torchtitan_layout(job, parallel, Placement.uniform(parallel.world_size, 4), DATASET, "fp32")


def test_registered_as_torchtitan() -> None:
    assert resolve(LAYOUTS, "torchtitan", "layout provider") is torchtitan_layout


def test_names_and_regions_are_torchtitans_own() -> None:
    """Parameter names as the Trainer's model part has them (activation checkpointing's wrapper left out), rows
    of the fused QKV split over tp (ColwiseParallel), FSDP2 inside each tp half, pipeline_llm's stage split."""
    both = _ptc(ParallelConfig(dp=2, tp=2, zero=3))
    params = {t.name: t.shape for t in both.tensors if t.kind is TensorKind.PARAM}
    assert QKV.format(0) in params and "lm_head.weight" in params and len(params) == 2 + 2 * 7 + 1
    assert both.config["model"] == {"library": "torchtitan", "module": JOB.module, "config": JOB.config,
                                    "name": "llama3", "flavor": "debugmodel"}
    assert [(str(s.region), s.devices) for s in both.tensor(QKV.format(0)).shards] == [
        ("[0:192, 0:256]", (0,)), ("[384:576, 0:256]", (1,)), ("[192:384, 0:256]", (2,)), ("[576:768, 0:256]", (3,))]
    assert both.tensor(f"optim/{QKV.format(0)}/exp_avg").shards == both.tensor(QKV.format(0)).shards
    pp = _ptc(ParallelConfig(pp=2))  # embeddings and layer 0, then layer 1, norm and head
    assert {t.name for t in pp.tensors if t.kind is TensorKind.PARAM} == set(params)
    assert pp.tensor("tok_embeddings.weight").shards[0].devices == (0,)
    assert pp.tensor(QKV.format(1)).shards[0].devices == (1,)
    assert pp.tensor("lm_head.weight").shards[0].devices == (1,)


def test_configurations_it_cannot_run_are_refused_with_the_reason() -> None:
    with pytest.raises(InvalidConfig, match="Config function 'nope' not found"):
        TorchtitanJob(JOB.module, "nope")
    with pytest.raises(InvalidConfig, match="Cannot import module 'no_such_package'"):
        TorchtitanJob("no_such_package", "llama3_tiny")
    with pytest.raises(InvalidConfig, match="ElasticDataLoader"):  # torchtitan's streamed text loader
        TorchtitanJob(JOB.module, "llama3_streamed")
    with pytest.raises(InvalidConfig, match="zero=1"):
        _ptc(ParallelConfig(dp=2, zero=1))
    with pytest.raises(InvalidConfig, match="not divisible by data-parallel size 3"):
        _ptc(ParallelConfig(dp=3, zero=3))
    with pytest.raises(InvalidConfig, match="module"):
        TorchtitanJob("", "llama3_tiny")
    with pytest.raises(InvalidConfig, match="pipeline_parallel_schedule is 'Interleaved1F1B'"):
        TorchtitanJob(JOB.module, "llama3_interleaved")
