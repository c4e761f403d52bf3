"""The rank runner of the gloo tests fails fast and shows where a hung rank stood."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests.ranks import run_rank_processes


def test_a_failed_rank_ends_its_hung_peer_at_once_and_the_failure_quotes_both_logs(tmp_path: Path) -> None:
    hang = [sys.executable, "-c", "import threading; print('peer waiting', flush=True); threading.Event().wait()"]
    fail = [sys.executable, "-c", "import time, sys; time.sleep(0.5); print('bind failed'); sys.exit(3)"]
    logs = [tmp_path / "r0.log", tmp_path / "r1.log"]
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        run_rank_processes([hang, fail], [dict(os.environ)] * 2, logs, what="ranks", timeout=60)
    assert time.monotonic() - started < 20  # not the 60 s deadline
    text = str(failure.value)
    assert "ranks: rank 1 exited with 3" in text and "bind failed" in text
    # the hung rank was asked for its stacks (faulthandler on SIGABRT) before it ended
    assert "was still running" in text and "peer waiting" in text
    assert "Fatal Python error: Aborted" in logs[0].read_text() and "threading.py" in logs[0].read_text()


def test_ranks_that_all_exit_zero_pass_and_a_deadline_fails(tmp_path: Path) -> None:
    ok = [sys.executable, "-c", "pass"]
    run_rank_processes([ok, ok], [dict(os.environ)] * 2, [tmp_path / "a", tmp_path / "b"], what="ranks")
    slow = [sys.executable, "-c", "import time; time.sleep(30)"]
    with pytest.raises(pytest.fail.Exception, match="ranks: not done after 1 s"):
        run_rank_processes([slow], [dict(os.environ)], [tmp_path / "c"], what="ranks", timeout=1)
