"""Hugging Face transformers' own ``Trainer`` (:class:`TenplexTrainer`), elastic under the local scheduler.

The job's command is a user's training script, ``python -m tests.integrations.hf_job`` (a tiny Qwen2 trained
by ``TenplexTrainer``, fp32); the layout is the ``transformers`` provider over the same model. Checked: the
job scales 2 -> 4 GPUs (DDP dp2 -> dp4), survives a SIGKILLed worker (recovery from the newest snapshot),
scales back to 2 GPUs (dp2) and finishes; every step's samples, read from what the Trainer's own data
collator collated, follow the job's sample order with nothing repeated or skipped (a step run again after
the rollback takes the same samples); every loss the Trainer logged matches an uninterrupted run of the
same job within :data:`LOSS_RTOL`. A tp change is refused when asked, and the job trains on (transformers'
Trainer runs a tp_plan model through accelerate's ParallelismConfig, which accelerate refuses on CPU;
:func:`~tenplex.integrations.transformers.layout.check_parallel`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is installed by `make test` (.[clients])")

from tenplex.errors import TenplexError  # noqa: E402
from tenplex.ptc import DatasetState  # noqa: E402
from tenplex.scheduler.cli import SchedulerClient  # noqa: E402
from tenplex.scheduler.server import LocalScheduler  # noqa: E402
from tenplex.testing.faults import kill_worker  # noqa: E402
from tests.integrations.hf_job import MODEL  # noqa: E402
from tests.integrations.runs import check_like_an_uninterrupted_run, per_step  # noqa: E402
from tests.scheduler.test_e2e_local import wait_for  # noqa: E402

# Not in torchtitan's xdist group: the two trainers' end-to-end tests (the suite's longest) run side by side.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DATASET = DatasetState(num_samples=64, seed=0, global_batch_size=8)
STEPS = 40
"""Five epochs of the 64 samples: room for the steps a fast machine trains between the test's polls, so that every
generation (the last one after the recovery's first step and a scale) still has steps of its own (at 24, one CI run
saw the last generation start at the final step)."""
ORDER = DATASET.samples(0, STEPS * DATASET.global_batch_size).tolist()
"""The job's sample order over the whole run."""
LOSS_RTOL = 1e-5
"""fp32 on CPU. dp2 and dp4 sum the same gradients in another order (DDP's all-reduce over 2 or 4 ranks, the
loss's token count and mean over the ranks), which moves a loss by a few float32 ulps; AdamW carries that on.
Measured (dp2, dp4, recovery, dp2): at most 1e-7 relative. Steps run in the first layout are bit-identical to
the uninterrupted run."""


def spec(name: str, results: Path, gpus: int, max_gpus: int, snapshot_every: int = 2) -> dict:
    return {
        "name": name,
        "layout": {"provider": "transformers", "model": MODEL},
        "dataset": DATASET.to_json(),
        "command": [sys.executable, "-m", "tests.integrations.hf_job"],
        "gpus": gpus,
        "max_gpus": max_gpus,
        "steps": STEPS,
        "snapshot_every": snapshot_every,
        "heartbeat_timeout": 120,
        "policy": {"table": {"2": {"dp": 2, "zero": 0}, "4": {"dp": 4, "zero": 0}}},
        "env": {"OMP_NUM_THREADS": "1", "HF_RESULTS": str(results), "HF_OUT": str(results / "out"),
                "HF_HUB_OFFLINE": "1"},
    }


def read(results: Path, generation: int, dp: int) -> tuple[dict[int, list[int]], dict[int, float]]:
    """One generation's samples per step (all dp ranks, in dp order) and the Trainer's logged losses (every rank
    logs the same mean over the ranks)."""
    ranks = []
    for r in range(dp):
        f = results / f"g{generation}-r{r}.json"
        ranks.append(json.loads(f.read_text()) if f.exists() else {"losses": {}, "samples": {}})
    losses = {int(s): v for s, v in ranks[0]["losses"].items()}
    for res in ranks[1:]:  # a SIGKILLed rank may lag behind the others by a step
        assert all(losses[int(s)] == v for s, v in res["losses"].items() if int(s) in losses), res["losses"]
    samples = per_step([r["samples"] for r in ranks], ORDER, DATASET.global_batch_size)
    return samples, {s: losses[s] for s in samples if s in losses}


def test_scaled_failed_and_refused_like_an_uninterrupted_run(tmp_path: Path) -> None:
    """One scheduler, three jobs at once (a 2-core machine spends most of each launch importing torch and
    transformers; the jobs overlap their start-ups): the uninterrupted baseline, the elastic job, and a job whose
    workers run one layer more than its layout (it fails before any step with the tensor named). Bad models and a
    layout the Trainer cannot run are refused first."""
    with LocalScheduler(tmp_path / "sched", hosts=4, gpus_per_host=2, heartbeat_interval=0.3) as sched:
        client = SchedulerClient(sched.url)
        bad = spec("bad", tmp_path / "r", 2, 2)
        bad["layout"]["model"] = {"architecture": "Qwen2ForCausalLM", "config": {**MODEL["config"], "hiden_size": 48}}
        with pytest.raises(TenplexError, match="'hiden_size'"):
            client.create(bad)
        bad["layout"]["model"] = {"architecture": "Qwen2Model", "config": MODEL["config"]}
        with pytest.raises(TenplexError, match="'Qwen2Model' is not a causal LM"):
            client.create(bad)
        assert client.jobs() == []
        # a policy table entry the Trainer cannot run (FSDP): refused at creation, naming the entry
        fsdp = spec("fsdp", tmp_path / "fsdp", 2, 2)
        fsdp["policy"] = {"table": {"2": {"dp": 2, "zero": 0}, "4": {"dp": 4, "zero": 3}}}
        with pytest.raises(TenplexError, match="entry for 4 GPUs cannot run: .*zero=3"):
            client.create(fsdp)
        assert client.jobs() == []

        client.create(spec("base", tmp_path / "base", 2, 2, snapshot_every=STEPS))
        client.create(spec("hf", tmp_path / "hf", 2, 4))
        other = spec("other", tmp_path / "other", 1, 1)  # one worker: one launch is all it takes
        other["policy"] = {"table": {"1": {"dp": 1, "zero": 0}}}
        other["env"]["HF_LAYERS"] = "3"
        other["max_restarts"] = 0
        client.create(other)
        wait_for(client, "hf", lambda s: s["phase"] == "Running" and s["step"] >= 2, "training on 2 GPUs", 300)
        with pytest.raises(TenplexError, match="tp=2"):  # refused with the reason; the job trains on
            client.scale("hf", 2, {"dp": 1, "tp": 2, "pp": 1})
        client.scale("hf", 4)
        st = wait_for(client, "hf", lambda s: s["phase"] == "Running" and s["history"]
                      and s["history"][0]["downtime_seconds"] is not None, "training again on 4 GPUs", 300)
        back_at = st["step"]  # two more steps, so that generation 1 snapshots something of its own
        st = wait_for(client, "hf", lambda s: s["step"] >= back_at + 2, "training two steps on 4 GPUs", 300)
        kill_worker(st["workers"][-1])
        # Recovered, and a step past the restored one taken (the downtime closed), so that generation 2 trains
        # something of its own before the next change.
        wait_for(client, "hf", lambda s: s["generation"] >= 2 and s["phase"] == "Running"
                 and s["history"][-1]["reason"] == "failure" and s["history"][-1]["downtime_seconds"] is not None,
                 "recovering", 300)
        client.scale("hf", 2)
        st = wait_for(client, "hf", lambda s: s["phase"] == "Succeeded", "back on 2 GPUs, finishing", 300)
        wait_for(client, "base", lambda s: s["phase"] == "Succeeded", "the uninterrupted run", 300)
        deadline = time.monotonic() + 120
        while (mismatch := client.job("other")["status"])["phase"] != "Failed" and time.monotonic() < deadline:
            time.sleep(0.3)
    assert mismatch["phase"] == "Failed", mismatch
    assert "model.layers.2." in mismatch["message"] and "layout mismatch" in mismatch["message"], mismatch["message"]
    assert mismatch["step"] == 0 and not list((tmp_path / "other").glob("*.json"))  # no step trained, no loss logged

    assert st["step"] == STEPS
    up, failure, down = st["history"]
    assert (up["reason"], up["from_config"], up["to_config"], up["steps_lost"]) == (
        "scale", "dp2 x tp1 x pp1", "dp4 x tp1 x pp1", 0), up
    assert failure["reason"] == "failure" and failure["to_gpus"] == 4, failure
    assert (down["reason"], down["to_gpus"], down["to_config"], down["steps_lost"]) == (
        "scale", 2, "dp2 x tp1 x pp1", 0), down

    layouts = {0: 2, 1: 4, 2: 4, 3: 2}  # generation -> dp
    check_like_an_uninterrupted_run(
        [(g, f"dp{dp}", *read(tmp_path / "hf", g, dp)) for g, dp in layouts.items()], read(tmp_path / "base", 0, 2),
        ORDER, STEPS, LOSS_RTOL, st["history"],
        tmp_path / "measured.json")
