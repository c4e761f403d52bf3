"""The reference GPT on 4 real gloo processes: the derived PTC is what every rank holds.

One launch of 4 worker processes (torchrun-style environment) runs every
configuration below in turn; the assertions are per configuration:

* each rank's parameters (global offset and local shape from DTensor, and
  the local values) are exactly the regions the PTC assigns to that device,
  cut from the single-process model with the same seed;
* AdamW's ``exp_avg``/``exp_avg_sq`` are sharded like their parameter and
  ``step`` is 0-d, as the PTC lists them;
* two training steps give the losses of the single-process reference on the
  same global batches (1e-5 relative).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from examples.gpt.layout import gpt_ptc
from examples.gpt.model import GPT, GPTConfig, cross_entropy_loss
from examples.gpt.train import SyntheticTokens
from tenplex.ptc import DatasetState, ParallelConfig, Placement, Region
from tenplex.sockets import free_port
from tests.ranks import rank_env, run_rank_processes

WORKER = Path(__file__).with_name("gpt_worker.py")
WORLD = 4
# vocab 66 is not divisible by 4: uneven vocab shards under tp4 and FSDP2 dp4
MODEL = {"vocab": 66, "dim": 32, "n_layers": 4, "n_heads": 4, "ffn_dim": 48, "seq_len": 16, "gated": True}
COMMON = {"model": MODEL, "seed": 7, "lr": 1e-2, "samples": 64, "global_batch": 8, "steps": 2}

CONFIGS: dict[str, dict] = {
    "dp4": {"dp": 4},
    "dp4-zero3": {"dp": 4, "zero": 3},
    "dp2-tp2": {"dp": 2, "tp": 2},
    "dp2-tp2-zero3": {"dp": 2, "tp": 2, "zero": 3},
    "tp2-pp2": {"tp": 2, "pp": 2},
    "dp2-pp2-zero3-gpipe": {"dp": 2, "pp": 2, "zero": 3, "schedule": "gpipe"},
    "dp2-pp2": {"dp": 2, "pp": 2},
    "tp2-pp2-uneven-stages": {"tp": 2, "pp": 2, "layers_per_stage": [1, 3]},
    "tp4": {"tp": 4},
    "pp4": {"pp": 4},
}


def _parallel(key: str) -> ParallelConfig:
    return ParallelConfig.from_json({k: v for k, v in CONFIGS[key].items() if k != "schedule"})


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Run every configuration on 4 gloo processes; results[config][rank]."""
    tmp = tmp_path_factory.mktemp("gpt_parallel")
    specs = {}
    for key, conf in CONFIGS.items():
        spec = dict(COMMON)
        spec["parallel"] = {k: v for k, v in conf.items() if k != "schedule"}
        if "schedule" in conf:
            spec["schedule"] = conf["schedule"]
        specs[key] = spec
    (tmp / "spec.json").write_text(json.dumps(specs))
    port = free_port()
    run_rank_processes([[sys.executable, str(WORKER), str(tmp / "spec.json"), str(tmp)]] * WORLD,
                       [rank_env(r, WORLD, port, WORLD) for r in range(WORLD)], [tmp / f"rank{r}.log" for r in range(WORLD)],
                       what="gloo workers", timeout=240)
    per_rank = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return {key: [per_rank[r][key] for r in range(WORLD)] for key in CONFIGS}


@pytest.fixture(scope="module")
def reference() -> dict:
    """The single-process model: full parameters and the losses of two AdamW steps."""
    cfg = GPTConfig(**MODEL)
    model = GPT(cfg, seed=COMMON["seed"])
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=COMMON["lr"], weight_decay=0.0)
    data = SyntheticTokens(COMMON["samples"], cfg.seq_len, cfg.vocab, seed=COMMON["seed"])
    state = DatasetState(COMMON["samples"], COMMON["seed"], COMMON["global_batch"])
    losses = []
    for step in range(COMMON["steps"]):
        tokens = data.batch(state.rank_batch(step, 0, 1))
        opt.zero_grad()
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"full": full, "losses": losses}


# One xdist worker runs the module: the gloo run behind ``gloo_results`` (every configuration, one launch of 4
# ranks, 40-50 s on 2 cores) is a module fixture, which each worker that got some of its tests would run again.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420), pytest.mark.xdist_group("gpt-parallel")]


@pytest.mark.parametrize("key", list(CONFIGS))
def test_ranks_hold_exactly_their_ptc_shards(key: str, gloo_results: dict, reference: dict) -> None:
    parallel = _parallel(key)
    ptc = gpt_ptc(GPTConfig(**MODEL), parallel, Placement.uniform(WORLD, 4))
    for rank, res in enumerate(gloo_results[key]):
        assert res["coords"] == parallel.coords(rank)
        expected: dict[str, set[Region]] = defaultdict(set)
        for tensor, shard in ptc.shards_of_device(rank):
            expected[tensor.name].add(shard.region)
        held_nonempty = set()
        for name, (offset, shape, values) in res["held"].items():
            if 0 in shape:
                assert name not in expected, f"{key} rank {rank}: PTC lists {name} but the rank holds nothing"
                continue
            held_nonempty.add(name)
            region = Region.from_offsets(offset, shape)
            assert expected[name] == {region}, f"{key} rank {rank} {name}: holds {region}, PTC says {expected[name]}"
            torch.testing.assert_close(values, reference["full"][name][region.slices()], rtol=0, atol=0)
            opt = res["optim"][name]
            for state in ("exp_avg", "exp_avg_sq"):
                o_offset, o_shape = opt[state]
                assert Region.from_offsets(o_offset, o_shape) == region, f"{key} rank {rank} {name} {state}"
                assert expected[f"optim/{name}/{state}"] == {region}
            assert opt["step"] == ()
            assert expected[f"optim/{name}/step"] == {Region.full(())}
        params_in_ptc = {n for n in expected if not n.startswith("optim/")}
        assert params_in_ptc == held_nonempty, f"{key} rank {rank}: PTC {sorted(params_in_ptc ^ held_nonempty)} differ"


@pytest.mark.parametrize("key", list(CONFIGS))
def test_losses_match_single_process(key: str, gloo_results: dict, reference: dict) -> None:
    per_rank = [res["losses"] for res in gloo_results[key]]
    for rank, losses in enumerate(per_rank):
        assert losses == per_rank[0], f"{key}: rank {rank} reports {losses}, rank 0 {per_rank[0]}"
    for step, (got, want) in enumerate(zip(per_rank[0], reference["losses"], strict=True)):
        assert got == pytest.approx(want, rel=1e-5), f"{key} step {step}: {got} vs single-process {want}"
