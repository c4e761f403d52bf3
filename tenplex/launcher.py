"""``tenplex worker launch -- COMMAND...``: run the ranks of a multi-GPU worker pod (torchrun's local part).

A worker pod with ``gpusPerPod`` > 1 runs that many ranks: NCCL's intra-node
paths (P2P, NVLink, shared memory) need the ranks of a node in one container,
sharing its GPUs and ``/dev/shm``. The pod's container runs this launcher,
which starts one child process per local rank and supervises them:

* The pod's environment is what all its ranks share. ``TENPLEX_POD_RANKS``
  holds a compact JSON list with one object per local rank: the variables that
  differ between them (``RANK``, ``LOCAL_RANK``, ``TENPLEX_WORKER_ID``, ...).
  Every object needs ``RANK`` and ``LOCAL_RANK`` (distinct non-negative
  integers). A child gets the shared environment, then its own overrides;
  ``TENPLEX_POD_RANKS`` itself is removed, and ``LOCAL_WORLD_SIZE`` defaults to
  the number of local ranks.
* ``CUDA_VISIBLE_DEVICES`` is left alone: every rank sees all of the pod's GPUs
  and selects its own by ``LOCAL_RANK``, as under torchrun, so that the ranks
  can reach each other's devices directly.
* SIGTERM and SIGINT (the kubelet's stop at the start of the pod's grace
  period) are forwarded to every child; the children decide how to end.
* When a child fails, the others are sent SIGTERM and, after
  ``--failure-grace`` seconds, SIGKILL: the pod then ends promptly with the
  failure, and the scheduler sees all its ranks exited instead of waiting for
  a collective timeout.
* The exit code is 0 when every child exited 0, else the first failure's code
  (a child killed by signal N counts as 128 + N, as the container runtime
  reports it). Bad input (no command, a missing or malformed
  ``TENPLEX_POD_RANKS``) exits 2 with a message naming the offending value; a
  command that cannot be executed exits 127, as a shell does.

Children inherit the launcher's stdout and stderr (the pod's log) and its
process group. The launcher imports neither torch nor the worker library, so it
starts in a fraction of a second and stays small while the ranks train.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType

from tenplex import standby
from tenplex.core.commands import (
    ENV_POD_RANKS,
    LocalRank,
    parse_pod_ranks,
    pod_rank_env,
)
from tenplex.errors import InvalidInput

log = logging.getLogger(__name__)

EXIT_BAD_INPUT = 2
EXIT_NOT_EXECUTABLE = 127
DEFAULT_FAILURE_GRACE = 5.0
POLL_SECONDS = 0.05
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(returncode: int) -> int:
    """A child's return code as a container runtime reports it (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class _Child:
    rank: LocalRank
    process: subprocess.Popen[bytes]
    code: int | None = None


@dataclass
class PodLauncher:
    """Starts one process per local rank and supervises them (see the module docstring)."""

    command: Sequence[str]
    ranks: Sequence[LocalRank]
    base_env: Mapping[str, str]
    failure_grace: float = DEFAULT_FAILURE_GRACE
    _children: list[_Child] = field(default_factory=list)
    _stop_signal: int | None = None
    _forwarded: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.command:
            raise InvalidInput("no command to launch: give it after '--', e.g. "
                               "tenplex worker launch -- python -m examples.gpt.train")
        if not self.ranks:
            raise InvalidInput("no local ranks to launch")
        if self.failure_grace < 0:
            raise InvalidInput(f"the failure grace must be >= 0 seconds, got {self.failure_grace}")

    def child_env(self, rank: LocalRank) -> dict[str, str]:
        """The environment of one rank's process: the shared environment, then its overrides."""
        return pod_rank_env(self.base_env, rank, len(self.ranks))

    def run(self) -> int:
        """Start the ranks, wait for all of them, and return the pod's exit code."""
        previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED_SIGNALS}
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self) -> int:
        for rank in self.ranks:
            if self._stop_signal is not None:
                log.warning("received signal %d while starting the ranks: rank %d and later are not started",
                            self._stop_signal, rank.rank)
                break
            try:
                process = subprocess.Popen(list(self.command), env=self.child_env(rank))
            except OSError as exc:
                log.error("cannot start rank %d (local rank %d): %s: %s", rank.rank, rank.local_rank,
                          self.command[0], exc)
                self._terminate_all(signal.SIGKILL)
                for child in self._children:
                    child.process.wait()
                return EXIT_NOT_EXECUTABLE
            self._children.append(_Child(rank, process))
            log.info("started rank %d (local rank %d) as pid %d", rank.rank, rank.local_rank, process.pid)
        first_failure: _Child | None = None
        kill_at: float | None = None
        while True:
            while self._forwarded:
                log.info("received signal %d: forwarded it to ranks %s", self._forwarded.pop(0),
                         [c.rank.rank for c in self._running()])
            for child in self._children:
                if child.code is not None:
                    continue
                returncode = child.process.poll()
                if returncode is None:
                    continue
                child.code = exit_status(returncode)
                how = f"signal {-returncode}" if returncode < 0 else f"code {returncode}"
                stopping = first_failure is not None or self._stop_signal is not None
                level = logging.INFO if child.code == 0 or stopping else logging.ERROR
                log.log(level, "rank %d (local rank %d, pid %d) exited with %s", child.rank.rank,
                        child.rank.local_rank, child.process.pid, how)
                if child.code != 0 and first_failure is None:
                    first_failure = child
                    # After a forwarded stop the ranks are ending anyway, within the pod's grace period.
                    if self._stop_signal is None and self._running():
                        log.error("rank %d failed: terminating the other ranks of the pod (SIGKILL after %.1fs)",
                                  child.rank.rank, self.failure_grace)
                        self._terminate_all(signal.SIGTERM)
                        kill_at = time.monotonic() + self.failure_grace
            if not self._running():
                break
            if kill_at is not None and time.monotonic() >= kill_at:
                log.error("ranks %s still running %.1fs after a failure: killing them",
                          [c.rank.rank for c in self._children if c.code is None], self.failure_grace)
                self._terminate_all(signal.SIGKILL)
                kill_at = None
            time.sleep(POLL_SECONDS)
        code = first_failure.code if first_failure is not None and first_failure.code is not None else 0
        log.info("all %d ranks exited; pod exit code %d", len(self._children), code)
        return code

    def _running(self) -> list[_Child]:
        """The children whose exit has not been recorded yet."""
        return [c for c in self._children if c.code is None]

    def _terminate_all(self, sig: int) -> None:
        for child in self._children:
            if child.process.poll() is None:
                try:
                    child.process.send_signal(sig)
                except ProcessLookupError:
                    continue

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        """Signal handler: pass the kubelet's stop on to every rank (they share the pod's grace period)."""
        self._stop_signal = signum
        self._forwarded.append(signum)  # logged by the supervising loop, not here (no logging in a handler)
        self._terminate_all(signum)


def launch(command: Sequence[str], environ: Mapping[str, str] | None = None, *,
           failure_grace: float = DEFAULT_FAILURE_GRACE) -> int:
    """Run ``command`` once per local rank described by ``environ`` (default ``os.environ``); the pod's exit code."""
    env = os.environ if environ is None else environ
    ranks = parse_pod_ranks(env.get(ENV_POD_RANKS))
    return PodLauncher(list(command), ranks, dict(env), failure_grace).run()


def register(sub: argparse._SubParsersAction) -> None:
    worker = sub.add_parser("worker", help="the worker side: run the ranks of a multi-GPU worker pod")
    cmds = worker.add_subparsers(dest="worker_command", metavar="SUBCOMMAND", required=True)
    run = cmds.add_parser(
        "launch", help=f"start one process per local rank listed in ${ENV_POD_RANKS} and supervise them",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--failure-grace", type=float, default=DEFAULT_FAILURE_GRACE, metavar="SECONDS",
                     help="after a rank fails, how long the others get between SIGTERM and SIGKILL "
                          f"(default {DEFAULT_FAILURE_GRACE:g})")
    run.add_argument("command", nargs=argparse.REMAINDER, help="the worker command, after '--'")
    run.set_defaults(func=_launch)
    standby.register(cmds)


def _launch(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        return launch(command, failure_grace=args.failure_grace)
    except InvalidInput as exc:
        print(f"tenplex worker launch: error: {exc.detail}", file=sys.stderr)
        return EXIT_BAD_INPUT
