"""Ending the processes a test or a benchmark started: asked first, killed if they do not go."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable


def stop_processes(procs: Iterable[subprocess.Popen], sig: int = signal.SIGINT, grace: float = 20.0) -> None:
    """Send ``sig`` to every process still running (a daemon's clean shutdown: SIGINT or SIGTERM), then wait up to
    ``grace`` seconds for each and SIGKILL the ones still there. All are signalled before any is waited for, so
    they shut down together."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    for p in procs:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
