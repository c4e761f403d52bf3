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


def test_outside_a_scheduler_the_config_is_the_users(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan.components.checkpoint import CheckpointManager

    from tests.integrations import titan_job

    monkeypatch.delenv("TENPLEX_SCHEDULER_URL", raising=False)
    config = titan_job.llama3_tiny()
    assert type(config.checkpoint) is CheckpointManager.Config
    assert (config.parallelism.data_parallel_shard_degree, config.parallelism.tensor_parallel_degree,
            config.training.local_batch_size, config.training.steps) == (-1, 1, 4, 12)


def test_the_dataloader_follows_the_sample_order_from_any_position() -> None:
    """Rank r of d takes the r-th part of each global batch of the order, in the Trainer's micro-batches; after
    a dp change the position is the consumed samples; its own state resumes where it was."""
    from tenplex.integrations.torchtitan import ElasticDataLoader

    def loader(dp_rank: int, dp: int, micro: int) -> ElasticDataLoader:
        config = ElasticDataLoader.Config(dataset="tests.integrations.titan_job:tokens")
        return config.build(dp_world_size=dp, dp_rank=dp_rank, tokenizer=None, seq_len=8, local_batch_size=micro)

    def ids(batch: tuple) -> list[int]:
        inputs, labels = batch
        assert inputs["input"].shape[1] == labels.shape[1] == 8 and inputs["positions"].shape == inputs["input"].shape
        return inputs["input"][:, 0].tolist()  # a sample's first token is its id

    order = DATASET.samples(0, 3 * 8).tolist()
    consumed = DatasetState(DATASET.num_samples, DATASET.seed, DATASET.global_batch_size, consumed_samples=8)
    parts = []
    for r in range(4):  # dp4 from step 2 on, micro-batches of 1
        lo = loader(r, 4, 1)
        lo.follow(consumed)
        it = iter(lo)
        parts.append([ids(next(it)) + ids(next(it)) for _ in range(2)])
    assert sum((p[0] for p in parts), []) == order[8:16] and sum((p[1] for p in parts), []) == order[16:24]
    lo = loader(1, 2, 4)
    lo.follow(DATASET)
    it = iter(lo)
    assert ids(next(it)) == order[4:8]
    saved = lo.state_dict()
    again = loader(1, 2, 4)
    again.load_state_dict(saved)
    assert ids(next(iter(again))) == ids(next(it)) == order[12:16]
    with pytest.raises(InvalidConfig, match="has 64"):
        lo.follow(DatasetState(num_samples=100, seed=0, global_batch_size=8))
