"""Running an ASGI app on uvicorn: in the foreground (daemons) or in a thread (tests, embedding).

The store daemon and the scheduler both serve FastAPI apps with uvloop and
httptools (the fast path measured in the design notes). The socket is bound
before uvicorn starts, so ``port=0`` gives a real port that is known at once
(and can be handed to the app itself, or written to a port file for a parent
process).

uvicorn's httptools protocol is extended here with one ASGI extension,
``tenplex.sendfile`` (:class:`SendfileProtocol`): a response body may name
byte ranges of open files, which go to the socket with ``sendfile(2)``, so the
kernel hands page-cache pages to the socket without copying them through the
process. It is what the store daemon sends chunk files with.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from tenplex.core.files import atomic_write
from tenplex.core.tls import ServerTLS
from tenplex.errors import InvalidConfig, TenplexError
from tenplex.sockets import is_loopback, set_unpaced

log = logging.getLogger(__name__)

KEEP_ALIVE_S = 30
"""Idle keep-alive connections are closed after this; clients stop reusing them well before."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0``: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if is_loopback(host):  # every peer is on this node: accepted connections inherit it (see tenplex.sockets)
        set_unpaced(sock)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InvalidConfig(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_for(host: str, port: int, *, tls: bool = False) -> str:
    """The URL clients use (``https`` with ``tls``); a wildcard bind is reached on loopback."""
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


SENDFILE_EXTENSION = "tenplex.sendfile"
"""Scope extension (``scope["extensions"]``) announcing that the server accepts :data:`SENDFILE_MESSAGE`."""
SENDFILE_MESSAGE = "tenplex.response.sendfile"
"""``{"type": SENDFILE_MESSAGE, "files": [(fd, offset, count), ...], "more_body": bool}``: a body part made of
byte ranges of open files (the app keeps them open until ``send`` returns, and closes them). Only after
``http.response.start`` with a ``content-length``; the ranges count against it like a body message."""

SENDFILE_STALL_S = 60.0
"""A ``sendfile`` response whose client takes no bytes for this long is abandoned (connection closed)."""
_SENDFILE_THREADS = 32
_sendfile_pool: ThreadPoolExecutor | None = None
_sendfile_pool_lock = threading.Lock()


def _sendfile_executor() -> ThreadPoolExecutor:
    """Threads that run ``sendfile`` loops: own ones, so slow clients never starve the app's worker threads."""
    global _sendfile_pool
    with _sendfile_pool_lock:
        if _sendfile_pool is None:
            _sendfile_pool = ThreadPoolExecutor(_SENDFILE_THREADS, thread_name_prefix="tenplex-sendfile")
        return _sendfile_pool


def _sendfile_all(sock_fd: int, files: Sequence[tuple[int, int, int]], stall_s: float) -> None:
    """Send every ``(fd, offset, count)`` range to the (non-blocking) socket ``sock_fd``, waiting with ``poll``.

    Runs in a thread: ``sendfile`` reads cold pages from disk synchronously,
    which must not stall the event loop. Raises ``OSError`` when the client
    went away, a file ends early, or the client stalls for ``stall_s``.
    """
    poller = select.poll()
    poller.register(sock_fd, select.POLLOUT)
    for fd, offset, count in files:
        while count > 0:
            try:
                n = os.sendfile(sock_fd, fd, offset, count)
            except BlockingIOError:
                if not poller.poll(stall_s * 1000):
                    raise TimeoutError(errno.ETIMEDOUT, f"the client took no bytes for {stall_s:.0f} s") from None
                continue
            if n == 0:
                raise OSError(errno.EIO, f"file ended {count} bytes early (offset {offset})")
            offset += n
            count -= n


class SendfileProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus the ``tenplex.sendfile`` response extension.

    Why not the ASGI "zero copy send" extension: uvicorn does not implement
    it, and its messages carry one file each, where a store body is up to
    hundreds of chunk-file ranges (one thread hand-off for all of them here).
    How: once the headers have left the transport's buffer, a thread sends the
    ranges with ``sendfile(2)`` on a duplicate of the connection's descriptor
    (a client that disconnects meanwhile makes uvloop close its own
    descriptor, never one a thread is writing to); the event loop keeps
    serving other connections, and this one's response then completes
    through uvicorn's own bookkeeping (keep-alive, pipelining).
    """

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        cycle.scope.setdefault("extensions", {})[SENDFILE_EXTENSION] = {}  # type: ignore[typeddict-item]
        super()._start_asgi_task(cycle, _SendfileApp(app, cycle))


class _SendfileApp:
    """Wraps the app of one request so that its ``send`` also accepts :data:`SENDFILE_MESSAGE`."""

    __slots__ = ("app", "cycle")

    def __init__(self, app: Any, cycle: RequestResponseCycle) -> None:
        self.app = app
        self.cycle = cycle

    async def __call__(self, scope: Any, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]) -> None:
        cycle = self.cycle

        async def send_or_sendfile(message: Any) -> None:
            if message["type"] == SENDFILE_MESSAGE:
                await _send_files(cycle, message)
            else:
                await send(message)

        await self.app(scope, receive, send_or_sendfile)


async def _send_files(cycle: RequestResponseCycle, message: Any) -> None:
    files = [(int(fd), int(offset), int(count)) for fd, offset, count in message["files"]]
    more_body = bool(message.get("more_body", False))
    if cycle.disconnected:
        return
    if not cycle.response_started or cycle.response_complete or cycle.chunked_encoding is not False:
        raise RuntimeError(f"{SENDFILE_MESSAGE} needs a started response with a content-length, and before its end")
    total = sum(count for _fd, _offset, count in files)
    if total > cycle.expected_content_length:
        raise RuntimeError("Response content longer than Content-Length")
    transport = cycle.transport
    deadline = time.monotonic() + SENDFILE_STALL_S
    while transport.get_write_buffer_size():  # the headers (or an earlier part) must be on the wire first
        if transport.is_closing():
            return
        if time.monotonic() > deadline:
            log.info("sendfile response abandoned: the client took no bytes for %.0f s", SENDFILE_STALL_S)
            cycle.disconnected = True
            transport.close()
            return
        await asyncio.sleep(0.0005)
    sock = transport.get_extra_info("socket")
    if sock is None or transport.is_closing():
        return
    sock_fd = os.dup(sock.fileno())
    try:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(_sendfile_executor(), _sendfile_all, sock_fd, files, SENDFILE_STALL_S)
    except OSError as exc:
        # The client went away or stalled, or a file was short: the body cannot be completed on this
        # connection, so it is closed (the client sees a short body and retries).
        log.info("sendfile response abandoned: %s", exc)
        cycle.disconnected = True
        transport.close()
        return
    finally:
        os.close(sock_fd)
    cycle.expected_content_length -= total
    if not more_body:  # uvicorn's own end of response: keep-alive, the next pipelined request
        await cycle.send({"type": "http.response.body", "body": b"", "more_body": False})


def uvicorn_config(app: Any, log_level: str = "warning", *, tls: ServerTLS | None = None, **kwargs: Any) -> uvicorn.Config:
    # The extension hooks into uvicorn's protocol at one method; a uvicorn without it serves plainly (the
    # store then sends bodies from maps of the chunk files instead). Under TLS never: sendfile(2) on the
    # connection's socket would put plaintext into the encrypted stream (see tenplex.core.tls).
    sendfile = tls is None and callable(getattr(HttpToolsProtocol, "_start_asgi_task", None))
    http: Any = SendfileProtocol if sendfile else "httptools"
    if tls is not None:
        kwargs.update(tls.uvicorn_options())
    return uvicorn.Config(
        app,
        loop="uvloop",
        http=http,
        lifespan="off",
        access_log=False,
        log_level=log_level.lower(),
        timeout_keep_alive=KEEP_ALIVE_S,
        log_config=None,
        **kwargs,
    )


def write_port_file(path: str | Path, port: int) -> None:
    """Write the bound port atomically, so a parent polling the file never reads half of it."""
    atomic_write(path, f"{port}\n")


def serve_forever(app: Any, sock: socket.socket, *, log_level: str = "info", tls: ServerTLS | None = None) -> None:
    """Serve ``app`` on the bound ``sock`` in the foreground until SIGINT/SIGTERM (HTTPS with ``tls``)."""
    server = uvicorn.Server(uvicorn_config(app, log_level, tls=tls))
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn shut down cleanly and re-raised the signal
        server.run(sockets=[sock])


class BackgroundServer:
    """uvicorn in a daemon thread; ``start()`` returns once it accepts connections."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, sock: socket.socket | None = None,
                 log_level: str = "warning", tls: ServerTLS | None = None) -> None:
        """Serve ``app`` on ``host:port``, or on an already bound ``sock`` (see :func:`bind_socket`); HTTPS with
        ``tls``."""
        self.app = app
        self.host = host
        self._port = port
        self._sock = sock
        self.tls = tls
        self._server = uvicorn.Server(uvicorn_config(app, log_level, tls=tls))
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._sock is None:
            raise TenplexError(f"the server for {self.host} is not started")
        return int(self._sock.getsockname()[1])

    @property
    def url(self) -> str:
        return url_for(self._sock.getsockname()[0] if self._sock is not None else self.host, self.port,
                       tls=self.tls is not None)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        if self._thread is not None:
            return self
        if self._sock is None:
            self._sock = bind_socket(self.host, self._port)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=f"uvicorn-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise TenplexError(f"server on {self.url} did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout)
        self._thread = None
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
