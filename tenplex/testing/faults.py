"""Fault injection for the tests, from outside the product, as real failures come.

A worker is killed by the pid its job's status shows (what an OOM killer or a
crashing driver would do); a host is lost by killing its store daemon and its
workers, and the scheduler notices through its own health watch, not through a
call that tells it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable, Mapping
from typing import Any

from tenplex.scheduler.backend import LocalCluster


def kill_worker(worker: Mapping[str, Any], sig: int = signal.SIGKILL) -> int:
    """Signal one worker of a job status view (``status["workers"][i]``) by its pid; returns the pid."""
    pid = worker.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        raise AssertionError(f"worker {worker.get('worker_id')!r} has no process id in the job status: {worker}")
    os.kill(pid, sig)
    return pid


def kill_host(cluster: LocalCluster, name: str, workers: Iterable[Mapping[str, Any]] = ()) -> None:
    """Lose host ``name`` of a local cluster: its store daemon's process group and ``workers`` (job status views
    of the workers on it) are killed with SIGKILL."""
    described = {h["name"]: h for h in cluster.describe()}
    if name not in described or not isinstance(described[name]["pid"], int):
        raise AssertionError(f"host {name!r} has no daemon process of this cluster: {sorted(described)}")
    pids = [described[name]["pid"]] + [w["pid"] for w in workers if w.get("host") == name and w.get("pid")]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
