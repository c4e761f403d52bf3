"""The state machine's decisions, driven without processes: a record, what was observed, what follows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tenplex.core.protocol import ExitReport
from tenplex.ptc import DatasetState, ParallelConfig
from tenplex.ptc.megatron import GPTSpec, megatron_gpt_ptc
from tenplex.scheduler.backend import HostInfo
from tenplex.scheduler.decide import (
    Observations,
    choose_recovery,
    covers,
    decide_running,
    decide_stopping,
    detect_failure,
    find_stop_version,
    missing_text,
    steps_reached,
)
from tenplex.scheduler.layouts import LayoutSpec
from tenplex.scheduler.policy import Policy
from tenplex.scheduler.state import JobSpec, JobStatus, Phase, WorkerRecord

NOW = 1_000_000.0
HOSTS = (HostInfo("h0", 2, "http://h0:1", "h0"), HostInfo("h1", 2, "http://h1:1", "h1"),
         HostInfo("h2", 2, "http://h2:1", "h2"))


def spec() -> JobSpec:
    return JobSpec(name="j", layout=LayoutSpec("megatron-gpt", {"num_layers": 2, "hidden": 8, "heads": 2, "vocab": 16}),
                   dataset=DatasetState(1000, 0, 8), command=("true",), gpus=4, policy=Policy(),
                   heartbeat_timeout=30.0)


def status(**kw: object) -> JobStatus:
    workers = [WorkerRecord(f"j-g0-r{r}", r, "h0" if r < 2 else "h1", r % 2, 0, registered=True,
                            last_heartbeat=NOW - 1, step=10) for r in range(4)]
    base = JobStatus(phase=Phase.RUNNING, gpus=4, hosts=["h0", "h1"], step=10, workers=workers)
    for k, v in kw.items():
        setattr(base, k, v)
    return base


def obs(**kw: object) -> Observations:
    return Observations(**{"now": NOW, "stage_age": 5.0, "hosts": HOSTS, "exits": {}, **kw})  # type: ignore[arg-type]


def exit_report(wid: str, state: str, step: int = 10) -> ExitReport:
    return ExitReport(generation=0, status=state, step=step, exit_code=0)


# -- failures ----------------------------------------------------------------------------------------------


def test_each_kind_of_failure_is_named() -> None:
    assert detect_failure(spec(), status(), obs(), start_timeout=60) is None
    assert detect_failure(spec(), status(), obs(peer_failure="rank 3 saw a reset"), start_timeout=60) == "rank 3 saw a reset"
    lost = (replace(HOSTS[0], ready=False), *HOSTS[1:])
    assert detect_failure(spec(), status(), obs(hosts=lost), start_timeout=60) == "host h0 lost"
    # a host that is not the job's may come and go
    assert detect_failure(spec(), status(), obs(hosts=(*HOSTS[:2], replace(HOSTS[2], ready=False))),
                          start_timeout=60) is None
    assert detect_failure(spec(), status(), obs(exits={"j-g0-r2": 137}), start_timeout=60) == \
        "worker j-g0-r2 exited with code 137"
    st = status()
    st.workers[1].last_heartbeat = NOW - 45
    assert detect_failure(spec(), st, obs(), start_timeout=60) == "worker j-g0-r1 missed heartbeats for 45s"
    st = status()
    st.workers[3].registered = False
    assert detect_failure(spec(), st, obs(stage_age=30), start_timeout=60) is None
    assert "did not register within 60s" in detect_failure(spec(), st, obs(stage_age=61), start_timeout=60)


def test_completed_and_requested_stops_are_not_failures() -> None:
    done = {"j-g0-r0": exit_report("j-g0-r0", "completed")}
    assert detect_failure(spec(), status(), obs(exits={"j-g0-r0": 0}, exit_reports=done), start_timeout=60) is None
    # completed but a non-zero code: something broke after the last step
    assert detect_failure(spec(), status(), obs(exits={"j-g0-r0": 1}, exit_reports=done), start_timeout=60)
    stopped = {"j-g0-r0": exit_report("j-g0-r0", "stopped")}
    assert detect_failure(spec(), status(stop_at_step=12), obs(exits={"j-g0-r0": 0}, exit_reports=stopped),
                          start_timeout=60) is None
    # a stop nobody asked for is a failure
    assert detect_failure(spec(), status(), obs(exits={"j-g0-r0": 0}, exit_reports=stopped), start_timeout=60)


# -- running ------------------------------------------------------------------------------------------------


def test_all_workers_completed_is_success() -> None:
    ids = [f"j-g0-r{r}" for r in range(4)]
    out = decide_running(spec(), status(), obs(exits=dict.fromkeys(ids, 0),
                                               exit_reports={w: exit_report(w, "completed") for w in ids}),
                         start_timeout=60)
    assert out.succeeded and out.failure is None
    # three of four: not yet
    out = decide_running(spec(), status(), obs(exits=dict.fromkeys(ids[:3], 0),
                                               exit_reports={w: exit_report(w, "completed") for w in ids[:3]}),
                         start_timeout=60)
    assert not out.succeeded and out.failure is None


def test_training_is_back_once_a_step_past_the_restored_one_is_reported() -> None:
    st = status(downtime_started_at=NOW - 10, restored_step=10)
    assert not decide_running(spec(), st, obs(), start_timeout=60).training_resumed
    st.workers[0].step = 11
    assert decide_running(spec(), st, obs(), start_timeout=60).training_resumed


def test_a_cordon_asks_for_a_redeploy_and_a_stale_one_is_dropped() -> None:
    cordoned = (replace(HOSTS[0], schedulable=False), *HOSTS[1:])
    out = decide_running(spec(), status(), obs(hosts=cordoned), start_timeout=60)
    assert out.changes_pending and out.pending == "redeploy" and out.begin_planned
    # a redeploy request when none of the job's hosts is unschedulable any more: dropped, nothing begins
    out = decide_running(spec(), status(pending_reason="node-drain"), obs(), start_timeout=60)
    assert out.changes_pending and out.pending is None and not out.begin_planned and "dropped" in out.dropped


def test_a_scale_request_begins_at_once_unless_it_is_already_done_or_a_worker_has_not_stepped() -> None:
    out = decide_running(spec(), status(pending_reason="scale", requested_gpus=6), obs(), start_timeout=60)
    assert out.begin_planned and not out.changes_pending
    out = decide_running(spec(), status(pending_reason="scale", requested_gpus=4), obs(), start_timeout=60)
    assert out.clear_request and out.pending is None and not out.begin_planned
    st = status(pending_reason="scale", requested_gpus=6)
    st.workers[2].step = None  # still starting: its stop request could come too late
    assert not decide_running(spec(), st, obs(), start_timeout=60).begin_planned


# -- stopping and the stop snapshot ------------------------------------------------------------------------------


def test_a_changed_spec_asks_for_a_redeploy_that_no_cordon_rule_drops() -> None:
    """The workers run an older spec than the job's: a planned redeploy begins (with no host unschedulable, which
    drops a stale cordon's request); a scale back to the current GPU count in the same change leaves the redeploy
    to do; once a generation runs the new spec a leftover request is dropped."""
    pending = {"fields": ["env"], "redeploy": True, "pending": True, "requested_at": NOW, "generation": None}
    out = decide_running(spec(), status(spec_update=pending), obs(), start_timeout=60)
    assert out.changes_pending and out.pending == "spec" and out.begin_planned and out.dropped is None
    out = decide_running(spec(), status(spec_update=pending, pending_reason="spec"), obs(), start_timeout=60)
    assert not out.changes_pending and out.begin_planned
    out = decide_running(spec(), status(spec_update=pending, pending_reason="scale", requested_gpus=4), obs(),
                         start_timeout=60)
    assert out.clear_request and out.pending == "spec" and out.begin_planned
    out = decide_running(spec(), status(spec_update=pending, pending_reason="node-drain"), obs(), start_timeout=60)
    assert out.pending == "spec" and out.begin_planned
    done = {**pending, "pending": False, "generation": 1}
    out = decide_running(spec(), status(spec_update=done, pending_reason="spec"), obs(), start_timeout=60)
    assert out.pending is None and not out.begin_planned and "already run" in out.dropped
    assert not decide_running(spec(), status(spec_update=done), obs(), start_timeout=60).begin_planned
    st = status(spec_update=pending)
    st.workers[1].step = None  # a worker that has not stepped yet: the stop waits
    assert not decide_running(spec(), st, obs(), start_timeout=60).begin_planned


def test_stopping() -> None:
    st = status(phase=Phase.RECONFIGURING, stop_at_step=12)
    ids = [f"j-g0-r{r}" for r in range(4)]
    assert decide_stopping(st, obs(exits=dict.fromkeys(ids[:2], 0)), stop_timeout=60) == decide_stopping(st, obs(), stop_timeout=60)
    assert decide_stopping(st, obs(exits=dict.fromkeys(ids, 0)), stop_timeout=60).stopped
    # adopted workers after a scheduler restart have no known exit code: not a failure by itself
    assert decide_stopping(st, obs(exits=dict.fromkeys(ids)), stop_timeout=60).stopped
    assert "abnormally" in decide_stopping(st, obs(exits={ids[0]: 1}), stop_timeout=60).failure
    assert "did not stop at step 12 within 60s" in decide_stopping(st, obs(stage_age=61), stop_timeout=60).failure
    assert decide_stopping(st, obs(peer_failure="reset"), stop_timeout=60).failure == "reset"
    # every worker said it stopped (its snapshot written): stopped, while their processes still tear down;
    # one crashing in its teardown after saying so is no failure
    said = {w: exit_report(w, "stopped", 12) for w in ids}
    assert decide_stopping(st, obs(exit_reports=said), stop_timeout=60).stopped
    assert decide_stopping(st, obs(exits={ids[0]: -11}, exit_reports=said), stop_timeout=60).stopped
    three = {w: said[w] for w in ids[:3]}
    assert not decide_stopping(st, obs(exit_reports=three), stop_timeout=60).stopped


def test_the_stop_version_is_the_newest_committed_on_every_host() -> None:
    st = status(stop_at_step=12)
    held = {"h0": ["s12-g0", "s13-g0", "s9-g0"], "h1": ["s12-g0"]}
    out = find_stop_version(st, held, {"h0", "h1"}, stage_age=1, stop_timeout=60)
    assert (out.version, out.holders) == ("s12-g0", ("h0", "h1"))
    held["h1"].append("s13-g0")  # the request came late: both went one step further
    assert find_stop_version(st, held, {"h0", "h1"}, stage_age=1, stop_timeout=60).version == "s13-g0"
    partial = {"h0": ["s12-g0"], "h1": []}
    assert find_stop_version(st, partial, {"h0", "h1"}, stage_age=1, stop_timeout=60).version is None
    failed = find_stop_version(st, partial, {"h0", "h1"}, stage_age=61, stop_timeout=60).failure
    assert "missing: {'s12-g0': ['h1']}" in failed


# -- recovery ---------------------------------------------------------------------------------------------------


def test_recovery_takes_the_newest_version_the_survivors_cover() -> None:
    gspec = GPTSpec(num_layers=2, hidden=8, heads=2, vocab=16, make_vocab_size_divisible_by=4)
    dp2 = megatron_gpt_ptc(gspec, ParallelConfig(dp=2, tp=2), gpus_per_node=2, hosts=["h0", "h1"], precision="fp32")
    assert covers(dp2, {"h0"}) and covers(dp2, {"h1"}) and not covers(dp2, set())
    st = status(step=20, version_generation={"s18-g0": 0, "s15-g0": 0})
    ptcs = {0: dp2}
    # h1 is gone; h0 holds s18 whole (a full replica): 2 steps lost
    rec = choose_recovery(st, {"h0": ["s15-g0", "s18-g0"]}, ptcs.get)
    assert rec is not None and (rec.version, rec.holders, rec.steps_lost) == ("s18-g0", ("h0",), 2)
    tp4 = megatron_gpt_ptc(gspec, ParallelConfig(tp=2, pp=2), gpus_per_node=2, hosts=["h0", "h1"], precision="fp32")
    st = status(step=20, version_generation={"s18-g1": 1, "s15-g0": 0})
    # s18 of the pp2 layout needs both hosts; only h0 survives: the older dp2 version it holds whole
    rec = choose_recovery(st, {"h0": ["s15-g0", "s18-g1"]}, {0: dp2, 1: tp4}.get)
    assert rec is not None and rec.version == "s15-g0" and rec.steps_lost == 5
    assert choose_recovery(st, {"h0": ["s18-g1"]}, {0: dp2, 1: tp4}.get) is None
    assert choose_recovery(st, {"h0": ["s18-g1"]}, {}.get) is None  # a layout no longer known is skipped


def test_steps_lost_count_from_the_newest_committed_version_when_heartbeats_lag() -> None:
    # A CI run: the relayed heartbeats had said step 5 while s14 was committed everywhere; the host died and the
    # job went back to the persisted s12. Two steps were lost, not zero.
    gspec = GPTSpec(num_layers=2, hidden=8, heads=2, vocab=16, make_vocab_size_divisible_by=4)
    tp2pp2 = megatron_gpt_ptc(gspec, ParallelConfig(tp=2, pp=2), gpus_per_node=2, hosts=["h0", "h1"], precision="fp32")
    st = status(step=5, version="s14-g0", version_generation={"s14-g0": 0, "s12-g0": 0})
    assert steps_reached(st) == 14
    rec = choose_recovery(st, {"h0": ["s14-g0"]}, {0: tp2pp2}.get, persisted=["s4-g0", "s12-g0"])
    assert rec is not None and (rec.version, rec.steps_lost) == ("s12-g0", 2)
    # A failure that joins another's recovery counts from the step reached before the first one.
    st = status(step=12, version="s12-g0", version_generation={"s12-g0": 0})
    rec = choose_recovery(st, {"h0": []}, {0: tp2pp2}.get, persisted=["s4-g0", "s12-g0"], reached=14)
    assert rec is not None and (rec.version, rec.steps_lost) == ("s12-g0", 2)


@pytest.mark.parametrize("stage_age", [0.0, 1e9])
def test_decisions_do_not_change_the_record(stage_age: float) -> None:
    st = status(pending_reason="scale", requested_gpus=6, downtime_started_at=NOW, restored_step=9)
    before = st.to_json()
    decide_running(spec(), st, obs(stage_age=stage_age, hosts=(replace(HOSTS[0], schedulable=False), *HOSTS[1:])),
                   start_timeout=60)
    decide_stopping(st, obs(stage_age=stage_age), stop_timeout=60)
    assert st.to_json() == before


def test_without_a_surviving_replica_recovery_falls_back_to_the_persistent_tier() -> None:
    gspec = GPTSpec(num_layers=2, hidden=8, heads=2, vocab=16, make_vocab_size_divisible_by=4)
    tp2pp2 = megatron_gpt_ptc(gspec, ParallelConfig(tp=2, pp=2), gpus_per_node=2, hosts=["h0", "h1"], precision="fp32")
    st = status(step=20, version_generation={"s18-g0": 0, "s12-g0": 0})
    survivors = {"h0": ["s12-g0", "s18-g0"]}  # h1 (stage 1) is gone: no survivor covers any version
    assert choose_recovery(st, survivors, {0: tp2pp2}.get) is None
    rec = choose_recovery(st, survivors, {0: tp2pp2}.get, persisted=["s12-g0"])
    assert rec is not None and (rec.version, rec.persistent, rec.steps_lost, rec.holders) == ("s12-g0", True, 8, ("h0",))
    # a newer version the survivors do cover wins over an older persistent one
    dp2 = megatron_gpt_ptc(gspec, ParallelConfig(dp=2, tp=2), gpus_per_node=2, hosts=["h0", "h1"], precision="fp32")
    st = status(step=20, version_generation={"s18-g1": 1, "s12-g0": 0})
    rec = choose_recovery(st, {"h0": ["s18-g1"]}, {0: tp2pp2, 1: dp2}.get, persisted=["s12-g0"])
    assert rec is not None and (rec.version, rec.persistent) == ("s18-g1", False)


def test_what_the_survivors_lack_is_named_with_its_holders() -> None:
    gspec = GPTSpec(num_layers=2, hidden=8, heads=2, vocab=16, make_vocab_size_divisible_by=4)
    tp2pp2 = megatron_gpt_ptc(gspec, ParallelConfig(tp=2, pp=2), gpus_per_node=2, hosts=["h0", "h1"], precision="fp32")
    assert missing_text(tp2pp2, {"h0", "h1"}) == ""
    text = missing_text(tp2pp2, {"h0"}, limit=100)
    lost = [(t.name, s.region.format()) for t in tp2pp2.tensors for s in t.shards
            if all(tp2pp2.device(d).host == "h1" for d in s.devices)]
    assert lost and all(f"{n} {r} (held by h1)" in text for n, r in lost) and "h0)" not in text
    assert missing_text(tp2pp2, {"h0"}, limit=2).endswith(f" and {len(lost) - 2} more")


def test_uploads_take_each_region_once_spread_over_its_holders() -> None:
    from tenplex.errors import NotFound
    from tenplex.scheduler.persist import assign_uploads

    gspec = GPTSpec(num_layers=4, hidden=16, heads=2, vocab=32, make_vocab_size_divisible_by=4)
    dp3 = megatron_gpt_ptc(gspec, ParallelConfig(dp=3, tp=2), gpus_per_node=2, hosts=["h0", "h1", "h2"],
                           precision="fp32")
    parts = assign_uploads(dp3, ["h0", "h1", "h2"])
    taken = [s for shards in parts.values() for s in shards]
    distinct = {(t.name, s.region.format()) for t in dp3.tensors for s in t.shards}
    assert sorted(taken) == sorted(distinct)  # each region once
    size = {(t.name, s.region.format()): s.region.volume * t.itemsize for t in dp3.tensors for s in t.shards}
    loads = {h: sum(size[s] for s in shards) for h, shards in parts.items()}
    assert max(loads.values()) <= 1.25 * min(loads.values())  # spread evenly over the three replicas
    assert set(assign_uploads(dp3, ["h1"])) == {"h1"}
    tp2pp2 = megatron_gpt_ptc(gspec, ParallelConfig(tp=2, pp=2), gpus_per_node=2, hosts=["h0", "h1"], precision="fp32")
    with pytest.raises(NotFound, match="no holder of"):
        assign_uploads(tp2pp2, ["h0"])
