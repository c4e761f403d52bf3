"""Running an ASGI app on uvicorn: in the foreground (daemons) or in a thread (tests, embedding).

The store daemon and the scheduler both serve FastAPI apps with uvloop and
httptools (the fast path measured in the design notes). The socket is bound
before uvicorn starts, so ``port=0`` gives a real port that is known at once
(and can be handed to the app itself, or written to a port file for a parent
process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from tenplex.errors import InvalidConfig, TenplexError

log = logging.getLogger(__name__)

KEEP_ALIVE_S = 30
"""Idle keep-alive connections are closed after this; clients stop reusing them well before."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0``: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InvalidConfig(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_for(host: str, port: int) -> str:
    """The URL clients use; a wildcard bind is reached on loopback."""
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def uvicorn_config(app: Any, log_level: str = "warning", **kwargs: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        loop="uvloop",
        http="httptools",
        lifespan="off",
        access_log=False,
        log_level=log_level.lower(),
        timeout_keep_alive=KEEP_ALIVE_S,
        log_config=None,
        **kwargs,
    )


def write_port_file(path: str | Path, port: int) -> None:
    """Write the bound port atomically, so a parent polling the file never reads half of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


def serve_forever(app: Any, sock: socket.socket, *, log_level: str = "info") -> None:
    """Serve ``app`` on the bound ``sock`` in the foreground until SIGINT/SIGTERM."""
    server = uvicorn.Server(uvicorn_config(app, log_level))
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn shut down cleanly and re-raised the signal
        server.run(sockets=[sock])


class BackgroundServer:
    """uvicorn in a daemon thread; ``start()`` returns once it accepts connections."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, sock: socket.socket | None = None,
                 log_level: str = "warning") -> None:
        """Serve ``app`` on ``host:port``, or on an already bound ``sock`` (see :func:`bind_socket`)."""
        self.app = app
        self.host = host
        self._port = port
        self._sock = sock
        self._server = uvicorn.Server(uvicorn_config(app, log_level))
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._sock is None:
            raise TenplexError(f"the server for {self.host} is not started")
        return int(self._sock.getsockname()[1])

    @property
    def url(self) -> str:
        return url_for(self._sock.getsockname()[0] if self._sock is not None else self.host, self.port)

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
