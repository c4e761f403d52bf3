"""The job-store conformance suite on the state directory (the local backend's store)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tenplex.scheduler.state import StateDir
from tenplex.testing.jobstore import JobStoreTests, busy_status, job_spec


class TestStateDir(JobStoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> StateDir:
        return StateDir(tmp_path / "state")

    def test_a_record_is_one_complete_json_file_and_no_temp_file_stays(self, store: StateDir) -> None:
        store.save(job_spec("alpha"), busy_status(4))
        files = sorted(p.name for p in (store.root / "jobs").iterdir())
        assert files == ["alpha", "alpha.json"]  # the record, and the job's folder (its plan, its PTCs)
        assert sorted(p.name for p in (store.root / "jobs" / "alpha").iterdir()) == ["last-plan.json"]
        assert json.loads((store.root / "jobs" / "alpha.json").read_text())["status"]["step"] == 4

    def test_the_plan_is_written_once_per_plan_not_per_save(self, store: StateDir) -> None:
        status = busy_status(4)
        store.save(job_spec("alpha"), status)
        plan_file = store.root / "jobs" / "alpha" / "last-plan.json"
        written = plan_file.stat().st_mtime_ns
        status.step = 5
        store.save(job_spec("alpha"), status)  # the same plan object: its file is left alone
        assert plan_file.stat().st_mtime_ns == written
        assert json.loads((store.root / "jobs" / "alpha.json").read_text())["status"]["last_plan"] == "last-plan.json"
        status.last_plan = {"plan": {"format": "tenplex.plan/v1", "hosts": {"h1": {}}}}
        store.save(job_spec("alpha"), status)
        assert json.loads(plan_file.read_text()) == status.last_plan
        [(_, back)] = StateDir(store.root).load_all()  # a restarted scheduler reads it back
        assert back.last_plan == status.last_plan and back.step == 5
