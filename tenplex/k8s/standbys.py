"""The scheduler's connections to its jobs' standby pods (worker pods that outlive their generation).

A job with ``standby`` on Kubernetes keeps its worker pods between
generations: each runs ``tenplex worker standby --port PORT`` (see
:mod:`tenplex.standby`), which forks the pod's workers, and the backend gives
a live pod the next generation's workers instead of creating a new pod, so a
worker starts without a pod start, an interpreter or imports. This module is
the control channel to those pods: one TCP connection per pod, to its node's
address and the port in its ``tenplex.io/standby-port`` annotation, carrying
JSON lines of worker environments, stops and exit codes (never tensor data).

One thread runs an asyncio loop holding every connection, so a thousand pods
cost one thread. Each connection says hello with the job's token and is
answered with a replay of every worker the pod has run, so what happened
while the scheduler was away (restarted, or a lost connection) is heard
again; a dropped connection is retried while the pod lives. Callers on other
threads read what each pod said (:meth:`StandbyLinks.exit_code`, which pid
runs which worker) and send requests (:meth:`StandbyLinks.launch`,
:meth:`StandbyLinks.request_stop`), waiting with a timeout for the answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tenplex.core.commands import STANDBY_READY
from tenplex.core.protocol import ENV_WORKER_ID
from tenplex.errors import InvalidConfig, StoreUnavailable

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
RETRY_MIN_S = 0.05
RETRY_MAX_S = 1.0


@dataclass
class PodLink:
    """What one standby pod has said over its connection."""

    pod: str
    """namespace/name, for messages."""
    job: str
    address: str
    port: int
    token: str | None = None
    """The credential its hello carries: the pod's own (its job's), None: the scheduler's token."""
    greeted: bool = False
    pids: dict[str, int] = field(default_factory=dict)
    """Worker id -> the pid the pod's standby runs it as."""
    codes: dict[int, int] = field(default_factory=dict)
    """Pid -> exit code, for the workers that ended."""
    refusals: list[str] = field(default_factory=list)
    writer: asyncio.StreamWriter | None = None
    task: asyncio.Task | None = None

    def running(self) -> list[str]:
        """The workers it runs now."""
        return [w for w, pid in self.pids.items() if pid not in self.codes]


class StandbyLinks:
    """Connections to standby pods, by pod uid (see the module docstring)."""

    def __init__(self, token: str | None, on_exit: Callable[[PodLink, str, int], None] | None = None) -> None:
        """``on_exit(link, worker_id, code)`` is called (on the links' thread) when a pod says a worker ended."""
        self._token = token
        self._on_exit = on_exit
        self._links: dict[str, PodLink] = {}
        self._changed = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tenplex-standby-links", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Close every connection (the pods and their workers go on) and end the thread."""
        with self._changed:
            links = list(self._links.values())
            self._links.clear()
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._end(links), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    @staticmethod
    async def _end(links: Sequence[PodLink]) -> None:
        tasks = [link.task for link in links if link.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- which pods -----------------------------------------------------------------------------

    def watch(self, uid: str, pod: str, job: str, address: str, port: int, *, token: str | None = None) -> None:
        """Keep a connection to the standby of pod ``uid`` at ``address:port`` (a no-op when there is one);
        ``token``: what the pod's environment holds (its job's credential), default the scheduler's."""
        with self._changed:
            if uid in self._links:
                return
            link = self._links[uid] = PodLink(pod, job, address, port, token=token)
        self._loop.call_soon_threadsafe(self._start, uid, link)

    def _start(self, uid: str, link: PodLink) -> None:
        link.task = self._loop.create_task(self._keep(uid, link), name=f"standby-{link.pod}")

    def forget(self, uid: str) -> None:
        """The pod is gone (or no longer a standby): drop its connection and what it said."""
        with self._changed:
            link = self._links.pop(uid, None)
            self._changed.notify_all()
        if link is not None:
            self._loop.call_soon_threadsafe(self._cancel, link)

    @staticmethod
    def _cancel(link: PodLink) -> None:
        if link.task is not None:
            link.task.cancel()

    def link(self, uid: str) -> PodLink | None:
        with self._changed:
            return self._links.get(uid)

    # -- what they said -------------------------------------------------------------------------

    def ready(self, uid: str) -> bool:
        """Whether the pod's standby answers (connected, greeted): requests to it can be made now."""
        with self._changed:
            link = self._links.get(uid)
            return link is not None and link.greeted

    def exit_code(self, uid: str, worker_id: str) -> int | None:
        """The exit code of ``worker_id`` in the pod (None while it runs or before the pod has said)."""
        with self._changed:
            link = self._links.get(uid)
            pid = link.pids.get(worker_id) if link is not None else None
            return link.codes.get(pid) if link is not None and pid is not None else None

    def idle(self, uid: str) -> bool:
        """Greeted, and running no worker: the pod can take the next generation's."""
        with self._changed:
            link = self._links.get(uid)
            return link is not None and link.greeted and not link.running()

    # -- requests -------------------------------------------------------------------------------

    def launch(self, uid: str, requests: Sequence[Mapping[str, object]], timeout: float = 10.0) -> dict[str, int]:
        """Ask the pod's standby to start these workers; worker id -> pid once it has said so.

        StoreUnavailable when the pod does not answer in time (the caller may replace the pod); InvalidConfig
        when it refuses."""
        wanted = [str(dict(r["env"]).get(ENV_WORKER_ID, "-")) for r in requests]  # type: ignore[call-overload]
        with self._changed:
            link = self._links.get(uid)
            if link is None or not link.greeted:
                raise StoreUnavailable(f"the standby of pod {link.pod if link else uid} is not connected")
            for wid in wanted:  # a worker id is started once: a stale pid of the same id must not answer
                link.pids.pop(wid, None)
            refused_before = len(link.refusals)
        self._send(uid, [json.dumps(dict(r), separators=(",", ":")) for r in requests], timeout)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                link = self._links.get(uid)
                if link is None:
                    raise StoreUnavailable(f"the standby pod {uid} went away while starting {wanted}")
                if len(link.refusals) > refused_before:
                    raise InvalidConfig(f"the standby of pod {link.pod} refused the launch: {link.refusals[-1]}")
                if all(w in link.pids for w in wanted):
                    return {w: link.pids[w] for w in wanted}
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreUnavailable(f"the standby of pod {link.pod} did not start {wanted} within {timeout:.0f}s")
                self._changed.wait(left)

    def request_stop(self, uid: str, worker_ids: Sequence[str], grace: float, timeout: float = 5.0) -> dict[str, int]:
        """Ask the pod's standby to stop these workers (SIGTERM, SIGKILL after ``grace``); the pids asked for
        (those it runs). StoreUnavailable when the request cannot be sent."""
        with self._changed:
            link = self._links.get(uid)
            pids = {w: link.pids[w] for w in worker_ids if link is not None and w in link.pids
                    and link.pids[w] not in link.codes}
        if pids:
            self._send(uid, [json.dumps({"stop": pid, "grace": grace}) for pid in pids.values()], timeout)
        return pids

    def wait_ended(self, uid: str, pids: Mapping[str, int], deadline: float) -> list[str]:
        """Wait until these workers of the pod have ended (or ``deadline``, a monotonic time); those left."""
        with self._changed:
            while True:
                link = self._links.get(uid)
                if link is None:
                    return list(pids)
                left = [w for w, pid in pids.items() if pid not in link.codes]
                if not left or time.monotonic() >= deadline:
                    return left
                self._changed.wait(max(0.0, deadline - time.monotonic()))

    def _send(self, uid: str, lines: Sequence[str], timeout: float) -> None:
        future = asyncio.run_coroutine_threadsafe(self._write(uid, lines), self._loop)
        try:
            future.result(timeout)
        except (TimeoutError, OSError, ConnectionError) as exc:
            future.cancel()
            raise StoreUnavailable(f"could not reach the standby pod {uid}: {exc or type(exc).__name__}") from None

    async def _write(self, uid: str, lines: Sequence[str]) -> None:
        link = self._links.get(uid)
        if link is None or link.writer is None:
            raise ConnectionError("not connected")
        link.writer.write("".join(line + "\n" for line in lines).encode())
        await link.writer.drain()

    # -- the connection -------------------------------------------------------------------------

    async def _keep(self, uid: str, link: PodLink) -> None:
        """Connect, greet, read; again after a pause whenever the connection ends, until forgotten."""
        pause = RETRY_MIN_S
        while True:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(link.address, link.port),
                                                        CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError):
                await asyncio.sleep(pause)  # its standby is still importing, or the pod is starting
                pause = min(RETRY_MAX_S, pause * 2)
                continue
            link.writer = writer
            try:
                hello = link.token if link.token is not None else self._token
                writer.write((json.dumps({"hello": {"token": hello or ""}}) + "\n").encode())
                await writer.drain()
                while raw := await reader.readline():
                    self._heard(link, raw.decode(errors="replace").strip())
                    pause = RETRY_MIN_S
            except (OSError, ConnectionError) as exc:
                log.info("standby pod %s: connection lost (%s)", link.pod, exc)
            finally:
                link.writer = None
                with self._changed:
                    link.greeted = False
                    self._changed.notify_all()
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
            await asyncio.sleep(pause)
            pause = min(RETRY_MAX_S, pause * 2)

    def _heard(self, link: PodLink, line: str) -> None:
        words = line.split()
        ended: tuple[str, int] | None = None
        with self._changed:
            if line == STANDBY_READY:
                link.greeted = True
            elif words[:1] == ["started"] and len(words) == 3 and words[1].isdigit():
                link.pids[words[2]] = int(words[1])
            elif words[:1] == ["exited"] and len(words) == 3 and words[1].isdigit():
                pid, code = int(words[1]), int(words[2])
                if pid not in link.codes:
                    ended = next(((w, code) for w, p in link.pids.items() if p == pid), None)
                link.codes[pid] = code
            elif words[:1] == ["refused"]:
                log.warning("standby pod %s refused a request: %s", link.pod, line[len("refused "):])
                link.refusals.append(line[len("refused "):])
            else:
                log.warning("standby pod %s said something unexpected: %r", link.pod, line[:200])
            self._changed.notify_all()
        if ended is not None and self._on_exit is not None:
            try:
                self._on_exit(link, *ended)
            except Exception:
                log.exception("standby pod %s: the exit listener failed", link.pod)
