"""torchtitan 0.3.0's own entry point and Trainer, elastic under the local scheduler.

The job's command is ``python -m torchtitan.train --module tests.integrations.titan_job --config
llama3_tiny`` (the llama3 debug model cut to 2 layers, fp32, deterministic); its config function ends in
``elastic(...)``, and the layout is the ``torchtitan`` provider over the same config function. Checked: the
job scales 2 -> 4 GPUs (dp2 -> dp4), survives a SIGKILLed worker, scales back to 2 GPUs as tp2 and
changes to pp2 on the same GPUs (torchtitan's 1F1B schedule), then to pp2; every step's samples, read from what the Trainer's dataloader fetched, follow the job's
sample order with nothing repeated or skipped (a step run again after the rollback takes the same
samples); every loss the Trainer computed matches an uninterrupted run of the same job within
:data:`LOSS_RTOL`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchtitan.trainer", reason="torchtitan's Trainer is installed by `make test` (.[clients])")

from tenplex.errors import TenplexError  # noqa: E402
from tenplex.ptc import DatasetState, ParallelConfig  # noqa: E402
from tenplex.scheduler.cli import SchedulerClient  # noqa: E402
from tenplex.scheduler.server import LocalScheduler  # noqa: E402
from tenplex.testing.faults import kill_worker  # noqa: E402
from tests.integrations.runs import check_like_an_uninterrupted_run, per_step  # noqa: E402
from tests.scheduler.test_e2e_local import wait_for  # noqa: E402

# six launches of torchtitan (4-5 s of imports each, a Trainer set up on 2 or 4 ranks): measured 252 s at a
# load of 15-20 on a shared 2-core machine, 891 s at 25-36
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("clients"), pytest.mark.timeout(1200)]

MODULE, CONFIG = "tests.integrations.titan_job", "llama3_tiny"
DATASET = DatasetState(num_samples=64, seed=0, global_batch_size=8)
STEPS = 32
"""Room for every generation to train: at 20 a clean-clone run on a quiet machine trained through to the last step
while the last change (to pp2) was being agreed, and that generation had nothing left to train."""
ORDER = DATASET.samples(0, STEPS * DATASET.global_batch_size).tolist()
"""The job's sample order over the whole run."""
LOSS_RTOL = 1e-5
"""fp32 on CPU. The layouts sum the same gradients in another order (FSDP2's reduce-scatter over 2 or 4
ranks, the loss's all-reduce over dp, tp's partial sums), which moves a loss by a few float32 ulps
(about 1e-7 relative); AdamW carries that on. Measured over a 20-step run (dp2, dp4, tp2, pp2): at most
2.8e-7; 0 in the first layout (the same numbers as the uninterrupted run)."""


def spec(name: str, results: Path, dump: Path, gpus: int, max_gpus: int, snapshot_every: int = 2) -> dict:
    return {
        "name": name,
        "layout": {"provider": "torchtitan", "model": {"module": MODULE, "config": CONFIG}},
        "dataset": DATASET.to_json(),
        "command": [sys.executable, "-m", "torchtitan.train", "--module", MODULE, "--config", CONFIG],
        "gpus": gpus,
        "max_gpus": max_gpus,
        "steps": STEPS,
        "snapshot_every": snapshot_every,
        "heartbeat_timeout": 120,
        "policy": {"table": {"2": {"dp": 2, "zero": 3}, "4": {"dp": 4, "zero": 3}}},
        "env": {"OMP_NUM_THREADS": "1", "TITAN_RESULTS": str(results), "TITAN_DUMP": str(dump)},
    }


def read(results: Path, generation: int, parallel: ParallelConfig) -> tuple[dict[int, list[int]], dict[int, float]]:
    """One generation's samples per step (all dp ranks, in dp order) and losses (the last pipeline stage's ranks
    agree; torchtitan logs -1 on the others)."""
    ranks = []
    for r in range(parallel.world_size):
        f = results / f"g{generation}-r{r}.json"
        ranks.append(json.loads(f.read_text()) if f.exists() else {"losses": {}, "samples": {}})
    last = parallel.pp - 1
    losses = {int(s): v for s, v in ranks[parallel.rank(0, 0, last)]["losses"].items()}
    for dp in range(parallel.dp):  # a SIGKILLed rank may lag behind the others by a step
        for tp in range(parallel.tp):
            res = ranks[parallel.rank(dp, tp, last)]
            assert all(losses[int(s)] == v for s, v in res["losses"].items() if int(s) in losses), res["losses"]
    firsts = [ranks[parallel.rank(dp, 0, 0)]["samples"] for dp in range(parallel.dp)]
    samples = per_step(firsts, ORDER, DATASET.global_batch_size)
    steps = {str(s) for s in samples}
    for dp in range(parallel.dp):  # every tp and pp rank of a dp rank takes the same samples
        for tp in range(parallel.tp):
            for pp in range(parallel.pp):
                other = ranks[parallel.rank(dp, tp, pp)]["samples"]
                assert all(other[s] == firsts[dp][s] for s in steps if s in other)
    return samples, {s: losses[s] for s in samples if s in losses}


def test_scaled_failed_and_relaid_out_like_an_uninterrupted_run(tmp_path: Path) -> None:
    with LocalScheduler(tmp_path / "sched", hosts=2, gpus_per_host=2, heartbeat_interval=0.3) as sched:
        client = SchedulerClient(sched.url)
        client.create(spec("base", tmp_path / "base", tmp_path / "dump-base", 2, 2, snapshot_every=STEPS))
        wait_for(client, "base", lambda s: s["phase"] == "Succeeded", "the uninterrupted run", 300)

        client.create(spec("titan", tmp_path / "titan", tmp_path / "dump", 2, 4))
        wait_for(client, "titan", lambda s: s["phase"] == "Running" and s["step"] >= 2, "training on 2 GPUs", 300)
        client.scale("titan", 4)
        st = wait_for(client, "titan", lambda s: s["phase"] == "Running" and s["history"]
                      and s["history"][0]["downtime_seconds"] is not None, "training again on 4 GPUs", 300)
        back_at = st["step"]  # two more steps, so that generation 1 snapshots something of its own
        st = wait_for(client, "titan", lambda s: s["step"] >= back_at + 2, "training two steps on 4 GPUs", 300)
        kill_worker(st["workers"][-1])
        # Recovered, and a step past the restored one taken (the downtime closed), so that generation 2 trains
        # something of its own before the next change.
        wait_for(client, "titan", lambda s: s["generation"] >= 2 and s["phase"] == "Running"
                 and s["history"][-1]["reason"] == "failure" and s["history"][-1]["downtime_seconds"] is not None,
                 "recovering", 300)
        client.scale("titan", 2, {"dp": 1, "tp": 2, "pp": 1})
        st = wait_for(client, "titan", lambda s: s["generation"] >= 3 and s["phase"] == "Running"
                      and s["history"][-1]["downtime_seconds"] is not None, "back on 2 GPUs in tp2", 300)
        back_at = st["step"]
        wait_for(client, "titan", lambda s: s["step"] >= back_at + 1, "a step in tp2", 300)
        client.scale("titan", 2, {"dp": 1, "tp": 1, "pp": 2})
        st = wait_for(client, "titan", lambda s: s["phase"] == "Succeeded", "in pp2 on the same GPUs, finishing", 300)
    assert st["step"] == STEPS
    up, failure, down, layout = st["history"]
    assert (up["reason"], up["from_config"], up["to_config"], up["steps_lost"]) == (
        "scale", "dp2 x tp1 x pp1, zero3", "dp4 x tp1 x pp1, zero3", 0), up
    assert failure["reason"] == "failure" and failure["to_gpus"] == 4, failure
    assert (down["reason"], down["to_gpus"], down["to_config"], down["steps_lost"]) == (
        "scale", 2, "dp1 x tp2 x pp1", 0), down
    assert (layout["reason"], layout["to_config"], layout["steps_lost"]) == ("scale", "dp1 x tp1 x pp2", 0), layout

    layouts = {0: ParallelConfig(dp=2, zero=3), 1: ParallelConfig(dp=4, zero=3), 2: ParallelConfig(dp=4, zero=3),
               3: ParallelConfig(tp=2), 4: ParallelConfig(pp=2)}
    check_like_an_uninterrupted_run(
        [(g, parallel.describe(), *read(tmp_path / "titan", g, parallel)) for g, parallel in layouts.items()],
        read(tmp_path / "base", 0, ParallelConfig(dp=2, zero=3)),
        ORDER, STEPS, LOSS_RTOL, st["history"],
        tmp_path / "measured.json")


def test_bad_configs_are_refused_with_the_tensor_or_field_named(tmp_path: Path) -> None:
    """A config Tenplex cannot run is refused when the job is created; a worker whose live model disagrees with
    the layout (one layer more than the job's config function) fails the job with a message naming the
    tensor, before any step: nothing is trained, nothing is stored."""
    with LocalScheduler(tmp_path / "sched", hosts=1, gpus_per_host=2, heartbeat_interval=0.3) as sched:
        client = SchedulerClient(sched.url)
        bad = spec("streamed", tmp_path / "r", tmp_path / "d", 2, 2)
        bad["layout"]["model"]["config"] = "llama3_streamed"
        with pytest.raises(TenplexError, match="ElasticDataLoader"):
            client.create(bad)
        assert client.jobs() == []
        other = spec("other", tmp_path / "other", tmp_path / "d", 2, 2)
        other["command"] = [*other["command"][:-1], "llama3_tiny_3_layers"]
        other["max_restarts"] = 0
        client.create(other)
        deadline = time.monotonic() + 300
        while (st := client.job("other")["status"])["phase"] != "Failed":
            assert time.monotonic() < deadline, st
            time.sleep(0.3)
    assert "layers.2." in st["message"] and "layout mismatch" in st["message"], st["message"]
    assert st["step"] == 0 and not (tmp_path / "other").exists()  # no step trained, no loss logged
