"""The one client of the standby protocol (:mod:`tenplex.standby`), whatever carries its lines.

A standby answers in lines: ``ready`` (imports done, or a hello accepted), ``started PID WORKER`` for each worker
it forks, ``exited PID CODE`` when one ends, ``refused REASON`` for a request it will not serve. The local backend
reaches its standbys over their standard input and output, the Kubernetes backend its standby pods over TCP; each
transport subclasses :class:`StandbyClient` with its :meth:`~StandbyClient.send` and feeds every line it reads to
:meth:`~StandbyClient.heard`, and both backends ask and wait through the same methods.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence

from tenplex.core.commands import STANDBY_READY
from tenplex.core.protocol import ENV_WORKER_ID
from tenplex.errors import InvalidConfig, StoreUnavailable

log = logging.getLogger(__name__)


class StandbyClient(ABC):
    """What one standby has said, and the requests to it; thread-safe (a transport's thread calls :meth:`heard`,
    callers on others wait for what it hears)."""

    def __init__(self, name: str, on_exit: Callable[[StandbyClient, str, int], None] | None = None) -> None:
        """``name`` for messages; ``on_exit(client, worker_id, code)`` is called (on the transport's thread)
        when the standby says a worker it started ended."""
        self.name = name
        self._on_exit = on_exit
        self.greeted = False
        """It said ``ready``: requests to it can be made now."""
        self.gone = False
        """The standby is gone for good (no transport will hear it again)."""
        self.pids: dict[str, int] = {}
        """Worker id -> the pid the standby runs it as."""
        self.codes: dict[int, int] = {}
        """Pid -> exit code, for the workers that ended."""
        self.refusals: list[str] = []
        self.changed = threading.Condition()

    @abstractmethod
    def send(self, lines: Sequence[str], timeout: float) -> None:
        """Write these request lines to the standby; StoreUnavailable when they cannot be written in time."""

    # -- what the transport hears ---------------------------------------------------------------

    def heard(self, line: str) -> None:
        """One line the standby said."""
        words = line.split()
        ended: tuple[str, int] | None = None
        with self.changed:
            if line == STANDBY_READY:
                self.greeted = True
            elif words[:1] == ["started"] and len(words) == 3 and words[1].isdigit():
                self.pids[words[2]] = int(words[1])
            elif words[:1] == ["exited"] and len(words) == 3 and words[1].isdigit():
                pid, code = int(words[1]), int(words[2])
                if pid not in self.codes:
                    ended = next(((w, code) for w, p in self.pids.items() if p == pid), None)
                self.codes[pid] = code
            elif words[:1] == ["refused"]:
                log.warning("standby %s refused a request: %s", self.name, line[len("refused "):])
                self.refusals.append(line[len("refused "):])
            else:
                log.warning("standby %s said something unexpected: %r", self.name, line[:200])
            self.changed.notify_all()
        if ended is not None and self._on_exit is not None:
            try:
                self._on_exit(self, *ended)
            except Exception:
                log.exception("standby %s: the exit listener failed", self.name)

    def lost(self, gone: bool = False) -> None:
        """The transport ended (``gone``: for good); a new one greets again."""
        with self.changed:
            self.greeted = False
            self.gone = self.gone or gone
            self.changed.notify_all()

    # -- what it said -----------------------------------------------------------------------------

    def running(self) -> list[str]:
        """The workers it runs now."""
        with self.changed:
            return [w for w, pid in self.pids.items() if pid not in self.codes]

    def exit_code(self, worker_id: str) -> int | None:
        """The exit code of ``worker_id`` (None while it runs or before the standby has said)."""
        with self.changed:
            pid = self.pids.get(worker_id)
            return self.codes.get(pid) if pid is not None else None

    def exit_code_of(self, pid: int) -> int | None:
        """The exit code of the worker the standby runs as ``pid`` (None while it runs or before it has said)."""
        with self.changed:
            return self.codes.get(pid)

    # -- requests ---------------------------------------------------------------------------------

    def launch(self, requests: Sequence[Mapping[str, object]], timeout: float = 10.0) -> dict[str, int]:
        """Ask the standby to start these workers (``{"env": ..., ...}`` each); worker id -> pid once it has said
        so. StoreUnavailable when it does not answer in time (the caller may start them elsewhere); InvalidConfig
        when it refuses."""
        wanted = [str(dict(r["env"]).get(ENV_WORKER_ID, "-")) for r in requests]  # type: ignore[call-overload]
        with self.changed:
            if self.gone or not self.greeted:
                raise StoreUnavailable(f"the standby {self.name} is not connected")
            for wid in wanted:  # a worker id is started once: a stale pid of the same id must not answer
                self.pids.pop(wid, None)
            refused_before = len(self.refusals)
        self.send([json.dumps(dict(r), separators=(",", ":")) for r in requests], timeout)
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                if len(self.refusals) > refused_before:
                    raise InvalidConfig(f"the standby {self.name} refused the launch: {self.refusals[-1]}")
                if all(w in self.pids for w in wanted):
                    return {w: self.pids[w] for w in wanted}
                left = deadline - time.monotonic()
                if self.gone or left <= 0:
                    raise StoreUnavailable(f"the standby {self.name} did not start {wanted} within {timeout:.0f}s"
                                           + (" (it went away)" if self.gone else ""))
                self.changed.wait(left)

    def request_stop(self, worker_ids: Sequence[str], grace: float, timeout: float = 5.0) -> dict[str, int]:
        """Ask the standby to stop these workers (SIGTERM, SIGKILL after ``grace``); the pids asked for (those it
        runs). StoreUnavailable when the request cannot be sent."""
        with self.changed:
            pids = {w: self.pids[w] for w in worker_ids if w in self.pids and self.pids[w] not in self.codes}
        if pids:
            self.send([json.dumps({"stop": pid, "grace": grace}) for pid in pids.values()], timeout)
        return pids

    def wait_ended(self, pids: Mapping[str, int], deadline: float) -> list[str]:
        """Wait until these workers have ended (or ``deadline``, a monotonic time); those left."""
        with self.changed:
            while True:
                left = [w for w, pid in pids.items() if pid not in self.codes]
                if not left or self.gone or time.monotonic() >= deadline:
                    return left
                self.changed.wait(max(0.0, deadline - time.monotonic()))
