"""Running an ASGI app on uvicorn: in the foreground (daemons) or in a thread (tests, embedding).

Both the store daemon and the scheduler serve FastAPI apps with uvloop and
httptools (the fast path measured in the design notes). ``port=0`` binds an
ephemeral port; the real one is read back from the bound socket.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

log = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (with SO_REUSEADDR) before uvicorn starts, so the port is known and race-free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app: Any, *, log_level: str = "warning", **kwargs: Any) -> uvicorn.Config:
    return uvicorn.Config(app, loop="uvloop", http="httptools", log_level=log_level, access_log=False,
                          timeout_keep_alive=75, **kwargs)


def serve_forever(app: Any, host: str, port: int, *, port_file: str | Path | None = None,
                  what: str = "server", log_level: str = "info", sock: socket.socket | None = None) -> None:
    """Serve in the foreground until SIGINT/SIGTERM; write the bound port to ``port_file`` first.

    Pass ``sock`` (from :func:`bind_socket`) when the app must know its own port before serving.
    """
    sock = sock if sock is not None else bind_socket(host, port)
    bound = sock.getsockname()[1]
    url = f"http://{url_host(host)}:{bound}"
    log.info("%s listening on %s", what, url)
    if port_file is not None:
        tmp = Path(str(port_file) + ".tmp")
        tmp.write_text(f"{bound}\n")
        tmp.replace(port_file)
    server = uvicorn.Server(uvicorn_config(app, log_level=log_level))
    server.run(sockets=[sock])


class BackgroundServer:
    """uvicorn in a daemon thread; ``start()`` returns once it accepts connections."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, sock: socket.socket | None = None) -> None:
        """Serve ``app`` on ``host:port``, or on an already bound ``sock`` (see :func:`bind_socket`)."""
        self.app = app
        self._sock = sock if sock is not None else bind_socket(host, port)
        self.host = self._sock.getsockname()[0]
        self.port = self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn_config(app))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=f"uvicorn-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"server on {self.url} exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server on {self.url} did not start within {timeout}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
