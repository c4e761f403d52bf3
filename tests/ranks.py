"""One process per rank of a gloo job, started by a test: the first failure ends them all, and says why.

A rank that fails or hangs leaves its peers waiting in a collective (or in the
rendezvous) until torch's own timeout, minutes away: waiting for each rank in
turn turns one failure into a pytest-timeout with no log at all. Here the first
rank to exit non-zero, or the deadline, ends the others, and the test fails with
every rank's exit status and log tail. A rank still running then is first sent
SIGABRT: with ``PYTHONFAULTHANDLER`` set (it is, for every rank started here) its
log then shows where each of its threads stood.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STACK_DUMP_S = 5.0
"""How long a hung rank is given to write its threads' stacks before it is killed."""


def run_rank_processes(
    argvs: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    logs: Sequence[Path],
    *,
    what: str,
    timeout: float = 150.0,
) -> None:
    """Run ``argvs[r]`` with ``envs[r]`` (stdout and stderr to ``logs[r]``) for every rank; all must exit 0."""
    procs: list[subprocess.Popen] = []
    for argv, env, log in zip(argvs, envs, logs, strict=True):
        with open(log, "wb") as out:
            procs.append(subprocess.Popen(list(argv), cwd=REPO, env={**env, "PYTHONFAULTHANDLER": "1"},
                                          stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    why = ""
    try:
        while True:
            codes = [p.poll() for p in procs]  # every rank's: one that failed may not be the first still running
            failed = [r for r, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                why = f"rank {failed[0]} exited with {codes[failed[0]]}"
                break
            if None not in codes:
                break
            if time.monotonic() > deadline:
                why = f"not done after {timeout:.0f} s"
                break
            time.sleep(0.1)
    finally:
        hung = [p for p in procs if p.poll() is None]
        for p in hung:
            p.send_signal(signal.SIGABRT)
        end = time.monotonic() + STACK_DUMP_S
        for p in hung:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if why:
        tails = "\n".join(
            f"--- rank {r} (exit {p.returncode}{', was still running' if p in hung else ''}) ---\n"
            + _tail(logs[r]) for r, p in enumerate(procs))
        pytest.fail(f"{what}: {why}\n{tails}")


def rank_env(rank: int, world: int, port: int, gpus_per_node: int) -> dict[str, str]:
    """torchrun's environment for one rank on 127.0.0.1 (one thread each: the CI machine has 2 cores)."""
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % gpus_per_node),
            "LOCAL_WORLD_SIZE": str(gpus_per_node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _tail(path: Path, size: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-size:]
    except OSError as exc:
        return f"(no log: {exc})"
