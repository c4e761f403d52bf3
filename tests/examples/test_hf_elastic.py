"""A tiny random Hugging Face LlamaForCausalLM, parallelized by transformers (TP plan, FSDP2), elastic under Tenplex.

Chain: FSDP2 dp2 -> TP2 -> FSDP2 dp2 x TP2 -> replicated dp2, 3 steps per layout,
the state transformed between layouts as the scheduler does. Measured: every
restored tensor equals the snapshot bit for bit, the sample order is exact, the
loss stays within 1e-3 (relative) of an uninterrupted FSDP2 dp2 run.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is installed by `make test` (.[clients])")

from tenplex.ptc import DatasetState, ParallelConfig, Placement  # noqa: E402
from tenplex.store.server import StoreServer  # noqa: E402
from tests.examples.elastic_chain import run_chain  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("clients")]

MODULE = "examples.hf.train"
JOB_ARGS = ["--samples", "64", "--global-batch", "8"]
DATASET = DatasetState(num_samples=64, seed=0, global_batch_size=8)


def hf_layout(parallel: ParallelConfig, placement: Placement, dataset: DatasetState):
    from examples.hf.job import HFConfig, hf_ptc

    return hf_ptc(HFConfig(), parallel, placement, dataset=dataset)


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[dict[str, StoreServer]]:
    servers = {h: StoreServer(tmp_path / "stores" / h).start() for h in ("node-0", "node-1")}
    yield servers
    for s in servers.values():
        s.stop()


def test_fsdp_dp2_tp2_dp2tp2_replicated_dp2(stores: dict[str, StoreServer], tmp_path: Path) -> None:
    chain = [ParallelConfig(dp=2, zero=3), ParallelConfig(tp=2), ParallelConfig(dp=2, tp=2, zero=3), ParallelConfig(dp=2)]
    measured = run_chain(MODULE, JOB_ARGS, hf_layout, chain, steps_each=3, dataset=DATASET, stores=stores,
                         tmp=tmp_path, job="hf")
    print(json.dumps(measured, indent=1), file=sys.stderr)  # the report's numbers (pytest -s shows them)
    for row in measured["rows"]:
        assert row["rel_diff"] <= 1e-3, row
    assert all(r["rel_diff"] == 0 for r in measured["rows"] if r["step"] <= 3)  # same layout, same numbers


def test_hf_layout_matches_transformers_meshes() -> None:
    """The provider reads transformers' own mesh names; a pipeline is refused with the reason."""
    from examples.hf.job import HFConfig, hf_ptc
    from tenplex.errors import InvalidConfig

    ptc = hf_layout(ParallelConfig(dp=2, tp=2, zero=3), Placement.uniform(4, 2), DATASET)
    assert ptc.config["mesh_roles"] == {"pp": "pp", "dp_replicate": "dp_replicate", "fsdp": "dp_shard", "tp": "tp",
                                        "efsdp": "ep", "ep": "ep"}
    q = ptc.tensor("model.layers.0.self_attn.q_proj.weight")  # TP rows, then FSDP inside each TP half
    assert [(str(s.region), s.devices) for s in q.shards] == [
        ("[0:16, 0:64]", (0,)), ("[32:48, 0:64]", (1,)), ("[16:32, 0:64]", (2,)), ("[48:64, 0:64]", (3,))]
    norm = ptc.tensor("model.layers.0.input_layernorm.weight")  # not TP: FSDP across dp only, same on both tp ranks
    assert [(str(s.region), s.devices) for s in norm.shards] == [("[0:32]", (0, 1)), ("[32:64]", (2, 3))]
    with pytest.raises(InvalidConfig, match="pp=2"):
        hf_ptc(HFConfig(), ParallelConfig(pp=2), Placement.uniform(2, 2))
