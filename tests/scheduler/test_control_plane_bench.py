"""The control-plane benchmark's machinery at a small scale: real daemons, simulated workers, a reconfiguration."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_simulated_workers_go_through_a_reconfiguration(tmp_path: Path) -> None:
    """16 simulated workers on 8 hosts of 2 (tp2 x pp4 x dp2) register, train, stop at the agreed step, snapshot
    into the daemons' stores, and 8 new ones restore the transformed version and train (benchmarks/control_plane.py)."""
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "control_plane.py"), "--hosts", "8", "--gpus-per-host", "2",
         "--scale-to", "8", "--window", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=280, cwd=REPO,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "job on 16 GPUs (2x2x4) registered and training" in text, text
    assert re.search(r"steady training, .*: \d+ heartbeats/s", text), text
    assert "dp2 x tp2 x pp4, zero1 -> dp1 x tp2 x pp4, zero1 (16 -> 8 GPUs)" in text, text
    network = re.search(r"state: (\d+) B over the network \(lower bound (\d+) B\)", text)
    assert network is not None and network.group(1) == network.group(2), text
    assert re.search(r"workers: register 8, ptc \d+, snapshot 16, exit 16", text), text
    assert "transforms on 4 daemons" in text and "training again" in text, text
    # The time line comes from the job record's milestones: the scheduler's stages are all there.
    for mark in ("stopped (scheduler)", "committed (scheduler)", "planned (scheduler)", "transferred (scheduler)"):
        assert mark in text, text
    assert re.search(r"planning [\d.]+ s \+ .* \+ orchestration -?[\d.]+ s", text), text
