"""Which versions the housekeeping persists: the due ones (one per multiple of interval_steps), one upload at a
time, the newest due version waiting for the one in flight and superseding an older waiting one, never lost
because an older one was uploading (:class:`~tenplex.scheduler.persist.Housekeeper`; its threads are not
started here: the decisions are made when a version is reported complete, under the job's lock)."""

from __future__ import annotations

from tenplex.ptc.model import DatasetState
from tenplex.scheduler.context import JobContext, SchedulerSettings
from tenplex.scheduler.persist import Housekeeper
from tenplex.scheduler.policy import Policy
from tenplex.scheduler.state import CheckpointSpec, JobSpec, JobStatus, LayoutSpec, Phase


def housekeeper(interval: int) -> Housekeeper:
    spec = JobSpec(name="j", layout=LayoutSpec("megatron-gpt", {"num_layers": 2, "hidden": 8, "heads": 2, "vocab": 16}),
                   dataset=DatasetState(1000, 0, 8), command=("true",), gpus=2, policy=Policy(),
                   checkpoint=CheckpointSpec("file:///ckpt", interval))
    ctx = JobContext(spec, JobStatus(phase=Phase.RUNNING, gpus=2), backend=None, state=None,  # type: ignore[arg-type]
                     settings=SchedulerSettings("http://127.0.0.1:1"), client_for=lambda url: None)
    return Housekeeper(ctx)


def commit(h: Housekeeper, *versions: str) -> None:
    for v in versions:
        with h.ctx.lock:
            h.ctx.status.step = int(v[1:].split("-")[0])
            h.committed(v)


def test_the_newest_due_version_waits_for_the_upload_in_flight_and_supersedes_an_older_waiting_one() -> None:
    h = housekeeper(4)
    commit(h, "s2-g0")
    assert h._take() is None  # not due: before the first multiple
    commit(h, "s4-g0")
    assert h.ctx.status.persist["queued"] == "s4-g0"
    assert h._take() == "s4-g0" and h.ctx.status.persist["state"] == "uploading"
    assert h.ctx.status.persist["queued"] is None and h.ctx.status.persist["started_step"] == 4
    commit(h, "s6-g0", "s8-g0")  # s8 is due while s4 uploads: it waits
    assert h.ctx.status.persist["queued"] == "s8-g0" and not h.ctx.status.persist.get("skipped")
    commit(h, "s10-g0", "s12-g0")  # s4 still uploading (slower than an interval): s12 supersedes s8
    assert h.ctx.status.persist["queued"] == "s12-g0"
    [skipped] = h.ctx.status.persist["skipped"]
    assert skipped["version"] == "s8-g0" and "superseded by s12-g0" in skipped["reason"] and "s4-g0" in skipped["reason"]
    h.ctx.status.persisted = ["s4-g0"]  # s4's upload ends; the waiting one goes next
    h._inflight = None
    assert h._take() == "s12-g0" and h._take() is None


def test_due_versions_are_the_first_at_or_past_each_multiple_and_again_after_a_rollback() -> None:
    h = housekeeper(4)
    due = []
    for v in ["s3-g0", "s6-g0", "s9-g0", "s12-g0", "s13-g0"]:  # snapshots every 3, interval 4
        commit(h, v)
        taken = h._take()
        if taken is not None:
            due.append(taken)
            h.ctx.status.persisted.append(taken)
    assert due == ["s6-g0", "s9-g0", "s12-g0"]  # one per window [4k, 4k + 4): 6, 9, 12; not 3 nor 13
    # the job rolls back to s6 (a failure): s9 and s12 are due again in the new generation
    h.ctx.status.persisted = ["s6-g0"]
    for v in ["s7-g1", "s9-g1", "s12-g1"]:
        commit(h, v)
        taken = h._take()
        if taken is not None:
            due.append(taken)
            h.ctx.status.persisted.append(taken)
    assert due[3:] == ["s9-g1", "s12-g1"]
