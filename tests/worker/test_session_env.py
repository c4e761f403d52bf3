"""The job's snapshot interval reaches the worker through the environment, checked."""

from __future__ import annotations

import pytest

from tenplex.core import protocol as p
from tenplex.errors import InvalidConfig
from tenplex.worker.session import ElasticWorker


def test_a_malformed_snapshot_interval_is_a_clear_error():
    env = {p.ENV_SNAPSHOT_EVERY: "every-four", p.ENV_SCHEDULER_URL: "http://127.0.0.1:9", p.ENV_JOB: "j",
           p.ENV_WORKER_ID: "j-g0-r0"}
    with pytest.raises(InvalidConfig, match="TENPLEX_SNAPSHOT_EVERY must be a positive integer, got 'every-four'"):
        ElasticWorker.from_scheduler(env)
