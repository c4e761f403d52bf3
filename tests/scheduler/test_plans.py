"""The plan is derived, not stored: the record keeps its inputs and a restarted scheduler computes the same plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tenplex.errors import InvalidConfig, InvalidInput
from tenplex.ptc import ParallelConfig
from tenplex.ptc.megatron import GPTSpec, megatron_gpt_ptc
from tenplex.scheduler.plans import PlanInputs
from tenplex.scheduler.state import (
    JobStatus,
    StateDir,
    WorkerRecord,
    pack_names,
    unpack_names,
    workers_from_table,
    workers_table,
)
from tenplex.testing.jobstore import job_spec

SPEC = GPTSpec(num_layers=4, hidden=32, heads=4, vocab=96, seq_len=8)
HOSTS = [f"node-{i}" for i in range(8)]


def ptcs():
    old = megatron_gpt_ptc(SPEC, ParallelConfig(dp=4, tp=2, pp=2), gpus_per_node=2, hosts=HOSTS, precision="fp32")
    new = megatron_gpt_ptc(SPEC, ParallelConfig(dp=2, tp=2, pp=2), gpus_per_node=2, hosts=HOSTS[:4],
                           precision="fp32")
    return old, new


def test_the_plan_computed_again_from_the_persisted_record_equals_the_original(tmp_path: Path) -> None:
    old, new = ptcs()
    # node-7 died; node-6 answers but holds an older version only: neither may serve a piece.
    alive = HOSTS[:7]
    inputs = PlanInputs.of(job="alpha", old_version="s10-g0", new_version="s10-g1", old_generation=0, alive=alive,
                           holders=HOSTS[:6])
    original = inputs.plan(old, new)
    assert inputs.not_holding == ("node-6",)

    store = StateDir(tmp_path)
    store.save_ptc("alpha", 0, old)
    store.save_ptc("alpha", 1, new)
    status = JobStatus(generation=0, last_plan={"inputs": inputs.to_json(), "parallel": {"dp": 2, "tp": 2, "pp": 2},
                                                "hosts": HOSTS[:4], "gpus_per_node": 2})
    store.save(job_spec("alpha"), status)

    # A restarted scheduler: a fresh store object, the record and the PTCs read back from disk.
    restarted = StateDir(tmp_path)
    [(_, back)] = restarted.load_all()
    assert back.last_plan is not None
    again_inputs = PlanInputs.from_json(back.last_plan["inputs"])
    assert again_inputs == inputs
    again = again_inputs.plan(restarted.load_ptc("alpha", again_inputs.old_generation or 0),
                              restarted.load_ptc("alpha", again_inputs.new_generation))
    assert again.to_json() == original.to_json()
    assert again.network_bytes == again.lower_bound_bytes > 0
    # No piece is read from the dead host or from the one holding another version.
    sources = {t.source for hp in again.hosts.values() for t in hp.transfers}
    assert not sources & {"node-6", "node-7"}


def test_the_record_holds_inputs_not_the_plan(tmp_path: Path) -> None:
    old, new = ptcs()
    inputs = PlanInputs.of(job="alpha", old_version="s10-g0", new_version="s10-g1", old_generation=0, alive=HOSTS,
                           holders=HOSTS)
    plan_text = inputs.plan(old, new).dumps()
    record_text = json.dumps(inputs.to_json())
    assert len(record_text) * 20 < len(plan_text)
    assert "not_holding" in record_text and json.loads(record_text)["not_holding"] == []


def test_inputs_that_cannot_be_read_are_a_clear_error() -> None:
    with pytest.raises(InvalidInput, match="a record written before plans were derived"):
        PlanInputs.from_json({"format": "tenplex.plan/v1", "hosts": {}})
    with pytest.raises(InvalidInput, match="malformed plan inputs"):
        PlanInputs.from_json({"format": "tenplex.plan-inputs/v1", "job": "a", "old_version": "s1-g0",
                              "new_version": "s1-g1", "old_generation": 0, "alive": "node-0"})
    with pytest.raises(InvalidInput, match="not among the alive hosts"):
        PlanInputs.of(job="a", old_version="s1-g0", new_version="s1-g1", old_generation=0, alive=["h0"],
                      holders=["h1"])


def test_the_worker_table_reads_back_every_field() -> None:
    workers = [WorkerRecord(f"alpha-g3-r{r}", r, f"node-{r // 2}", r % 2, 3, pid=100 + 7 * r if r != 2 else None,
                            registered=r != 1, last_heartbeat=None if r == 3 else 1_000.25 + r, step=r or None,
                            exit_code=-9 if r == 4 else None) for r in range(6)]
    back = workers_from_table(json.loads(json.dumps(workers_table(workers))))
    for w, b in zip(workers, back, strict=True):
        # Heartbeats are kept in whole seconds, rounded up: never older than they were, at most 1 s younger.
        beat = w.last_heartbeat
        assert (b.last_heartbeat is None) == (beat is None)
        if beat is not None:
            assert b.last_heartbeat is not None and 0 <= b.last_heartbeat - beat < 1
        assert vars(b) | {"last_heartbeat": None} == vars(w) | {"last_heartbeat": None}
    # Ids not named as the launcher names them are kept one by one.
    odd = [WorkerRecord("standby-7", 0, "node-0", 0, 1)]
    assert workers_from_table(workers_table(odd))[0].worker_id == "standby-7"
    assert workers_from_table(workers_table([])) == []


def test_a_1024_worker_record_stays_small() -> None:
    hosts = [f"node-{i}" for i in range(128)]
    inputs = PlanInputs.of(job="big", old_version="s9-g0", new_version="s9-g1", old_generation=0, alive=hosts,
                           holders=hosts)
    status = JobStatus(generation=1, hosts=hosts, workers=[
        WorkerRecord(f"big-g1-r{r}", r, hosts[r // 8], r % 8, 1, pid=5000 + 3 * r, registered=True,
                     last_heartbeat=2e9 + r / 1024, step=40) for r in range(1024)],
        last_plan={"inputs": inputs.to_json(), "parallel": {}, "hosts": hosts, "gpus_per_node": 8})
    text = json.dumps(status.to_record(), separators=(",", ":"))
    assert len(text) < 16 << 10, len(text)  # 180 KiB with the workers as objects
    assert JobStatus.from_json(json.loads(text)).workers[1023].worker_id == "big-g1-r1023"


def test_host_lists_are_kept_as_runs_in_order() -> None:
    names = ([f"node-{i}" for i in range(20)] + ["node-07", "node-08", "node-09", "node-10", "gpu-a", "gpu-b3", "7"]
             + [f"node-{i}" for i in range(100, 80, -1)] + ["node-5"])
    packed = pack_names(names)
    assert isinstance(packed, dict) and packed["runs"].startswith("node-0..19,node-07..9,node-10,gpu-a,gpu-b3,7,")
    assert unpack_names(json.loads(json.dumps(packed))) == names
    assert pack_names(["a", "b"]) == ["a", "b"]
    with pytest.raises(InvalidConfig, match="host run"):
        unpack_names({"runs": "node-x..y"})
