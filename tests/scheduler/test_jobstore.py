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
        assert sorted(p.name for p in (store.root / "jobs").iterdir()) == ["alpha.json"]
        record = json.loads((store.root / "jobs" / "alpha.json").read_text())["status"]
        assert record["step"] == 4
        # The last plan is kept as what it is computed from, inline: no plan file.
        assert record["last_plan"]["inputs"]["format"] == "tenplex.plan-inputs/v1"
