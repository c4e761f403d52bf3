"""The scheduler's connections to its jobs' standby pods (worker pods that outlive their generation, each
running ``tenplex worker standby --port PORT``: see :mod:`tenplex.k8s.backend` and :mod:`tenplex.standby`).

One TCP connection per pod, to its node's address and the port in its ``tenplex.io/standby-port``
annotation, carrying JSON lines of worker environments, stops and exit codes (never tensor data).

One thread runs an asyncio loop holding every connection, so a thousand pods
cost one thread. Each connection says hello with the job's token and is
answered with a replay of every worker the pod has run, so what happened
while the scheduler was away (restarted, or a lost connection) is heard
again; a dropped connection is retried while the pod lives. Each pod's link is
the standby protocol's one client (:class:`~tenplex.core.standby.StandbyClient`,
the local backend's too) over this connection: callers on other threads read
what each pod said and send requests through it, waiting with a timeout for
the answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Sequence

from tenplex.core.standby import StandbyClient
from tenplex.errors import StoreUnavailable

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
RETRY_MIN_S = 0.05
RETRY_MAX_S = 1.0


class PodLink(StandbyClient):
    """One standby pod's connection: the standby protocol's client over TCP, on the links' event loop."""

    def __init__(self, pod: str, job: str, address: str, port: int, token: str | None,
                 loop: asyncio.AbstractEventLoop, on_exit: Callable[[PodLink, str, int], None] | None) -> None:
        super().__init__(pod, on_exit)  # type: ignore[arg-type]  # it calls back with this link
        self.pod = pod
        """namespace/name, for messages."""
        self.job = job
        self.address = address
        self.port = port
        self.token = token
        """The credential its hello carries: the pod's own (its job's), None: the scheduler's token."""
        self._loop = loop
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Task | None = None

    def send(self, lines: Sequence[str], timeout: float) -> None:
        future = asyncio.run_coroutine_threadsafe(self._write(lines), self._loop)
        try:
            future.result(timeout)
        except (TimeoutError, OSError, ConnectionError) as exc:
            future.cancel()
            raise StoreUnavailable(f"could not reach the standby pod {self.pod}: {exc or type(exc).__name__}") from None

    async def _write(self, lines: Sequence[str]) -> None:
        if self.writer is None:
            raise ConnectionError("not connected")
        self.writer.write("".join(line + "\n" for line in lines).encode())
        await self.writer.drain()

    async def keep(self, default_token: str | None) -> None:
        """Connect, greet, read; again after a pause whenever the connection ends, until cancelled."""
        pause = RETRY_MIN_S
        while True:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(self.address, self.port),
                                                        CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError):
                await asyncio.sleep(pause)  # its standby is still importing, or the pod is starting
                pause = min(RETRY_MAX_S, pause * 2)
                continue
            self.writer = writer
            try:
                hello = self.token if self.token is not None else default_token
                writer.write((json.dumps({"hello": {"token": hello or ""}}) + "\n").encode())
                await writer.drain()
                while raw := await reader.readline():
                    self.heard(raw.decode(errors="replace").strip())
                    pause = RETRY_MIN_S
            except (OSError, ConnectionError) as exc:
                log.info("standby pod %s: connection lost (%s)", self.pod, exc)
            finally:
                self.writer = None
                self.lost()
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
            await asyncio.sleep(pause)
            pause = min(RETRY_MAX_S, pause * 2)


class StandbyLinks:
    """Connections to standby pods, by pod uid (see the module docstring)."""

    def __init__(self, token: str | None, on_exit: Callable[[PodLink, str, int], None] | None = None) -> None:
        """``on_exit(link, worker_id, code)`` is called (on the links' thread) when a pod says a worker ended."""
        self._token = token
        self._on_exit = on_exit
        self._links: dict[str, PodLink] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tenplex-standby-links", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Close every connection (the pods and their workers go on) and end the thread."""
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.lost(gone=True)
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

    def watch(self, uid: str, pod: str, job: str, address: str, port: int, *, token: str | None = None) -> None:
        """Keep a connection to the standby of pod ``uid`` at ``address:port`` (a no-op when there is one);
        ``token``: what the pod's environment holds (its job's credential), default the scheduler's."""
        with self._lock:
            if uid in self._links:
                return
            link = self._links[uid] = PodLink(pod, job, address, port, token, self._loop, self._on_exit)
        self._loop.call_soon_threadsafe(self._start, link)

    def _start(self, link: PodLink) -> None:
        link.task = self._loop.create_task(link.keep(self._token), name=f"standby-{link.pod}")

    def forget(self, uid: str) -> None:
        """The pod is gone (or no longer a standby): drop its connection and what it said."""
        with self._lock:
            link = self._links.pop(uid, None)
        if link is not None:
            link.lost(gone=True)
            self._loop.call_soon_threadsafe(self._cancel, link)

    @staticmethod
    def _cancel(link: PodLink) -> None:
        if link.task is not None:
            link.task.cancel()

    def link(self, uid: str) -> PodLink | None:
        """The pod's link (what its standby said, and requests to it); None for a pod not watched."""
        with self._lock:
            return self._links.get(uid)

    def get(self, uid: str) -> PodLink:
        """The link of a watched pod (StoreUnavailable for another)."""
        link = self.link(uid)
        if link is None:
            raise StoreUnavailable(f"the standby pod {uid} is not connected")
        return link

    def ready(self, uid: str) -> bool:
        """Whether the pod's standby answers (connected, greeted): requests to it can be made now."""
        link = self.link(uid)
        return link is not None and link.greeted

    def idle(self, uid: str) -> bool:
        """Greeted, and running no worker: the pod can take the next generation's."""
        link = self.link(uid)
        return link is not None and link.greeted and not link.running()
