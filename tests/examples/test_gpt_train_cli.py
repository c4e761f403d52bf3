"""The training script under torchrun, as a user launches it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_torchrun_trains_tp2_and_logs_a_falling_loss() -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(REPO / "examples" / "gpt" / "train.py"),
        "--tp", "2", "--steps", "6", "--layers", "2", "--dim", "32", "--vocab", "64", "--seq-len", "16",
        "--lr", "1e-2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    losses = [float(x) for x in re.findall(r"rank0 step \d+ loss ([0-9.]+)", out)]
    assert len(losses) == 6, out[-4000:]
    assert losses[-1] < losses[0], losses
    assert "dp1 x tp2 x pp1" in out


def test_bad_arguments_are_refused_before_any_process_group() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "gpt" / "train.py"), "--zero", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "invalid choice: 2" in proc.stderr
