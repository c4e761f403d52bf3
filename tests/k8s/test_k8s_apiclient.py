"""No Kubernetes API call of the scheduler hangs on a connection that stays open but never answers
(tenplex.k8s.apiclient): plain calls time out, a silent watch is given up and listed again.

The servers here accept and then say nothing (or send a watch's headers and then nothing), as a dead peer
behind a live proxy or load balancer does; no control plane is needed.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import client

from tenplex.k8s.apiclient import timeouts_of, watch_timeouts, with_timeouts
from tenplex.k8s.informer import Informer

from .cluster import eventually

LIVENESS_S = 60.0
"""How long a call is given before the test calls it hung (the timeouts under test are a second or less)."""


class _Silent:
    """A listener that accepts connections and never reads or answers them."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.listener.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def silent() -> Iterator[_Silent]:
    server = _Silent()
    try:
        yield server
    finally:
        server.close()


def _client(port: int) -> client.ApiClient:
    return client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}"))


def _call_in_thread(call: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # what the call raised is the test's subject
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(LIVENESS_S)
    return thread, errors


def test_a_call_that_gets_no_answer_times_out(silent: _Silent) -> None:
    api_client = with_timeouts(_client(silent.port), connect=1.0, read=0.2)
    assert timeouts_of(api_client) == (1.0, 0.2)
    thread, errors = _call_in_thread(lambda: client.CoreV1Api(api_client).list_node())
    assert not thread.is_alive(), "the call hung on a connection that never answers"
    (error,) = errors
    assert isinstance(error, urllib3.exceptions.HTTPError)  # what the controller retries as transient
    assert "timed out" in str(error).lower(), error
    assert silent.accepted  # it did connect: the read timed out


def test_without_timeouts_the_official_client_waits_forever(silent: _Silent) -> None:
    """Why with_timeouts exists: the same call through a plain client is still waiting (given a second)."""
    api_client = _client(silent.port)
    assert timeouts_of(api_client) is None
    thread = threading.Thread(target=_call_in_thread, args=(lambda: client.CoreV1Api(api_client).list_node(),),
                              daemon=True)  # it ends once the fixture closes the connection
    thread.start()
    eventually(lambda: silent.accepted, "the connection")
    thread.join(1.0)
    assert thread.is_alive()


def test_a_call_s_own_timeout_wins_and_timeouts_are_checked(silent: _Silent) -> None:
    api_client = with_timeouts(_client(silent.port), connect=1.0, read=LIVENESS_S * 10)
    thread, errors = _call_in_thread(lambda: client.CoreV1Api(api_client).list_node(_request_timeout=(1.0, 0.2)))
    assert not thread.is_alive() and isinstance(errors[0], urllib3.exceptions.HTTPError)
    with_timeouts(api_client, connect=2.0, read=3.0)  # again: changed in place, one pool
    assert timeouts_of(api_client) == (2.0, 3.0)
    with pytest.raises(ValueError, match="must be positive"):
        with_timeouts(api_client, connect=0, read=1)
    assert watch_timeouts(60, margin=10) == (10.0, 70.0)


class _ListThenSilentWatch(http.server.BaseHTTPRequestHandler):
    """Answers a list of nodes; a watch gets its headers and then nothing, until the test ends."""

    protocol_version = "HTTP/1.1"
    done = threading.Event()
    watches = 0

    def do_GET(self) -> None:  # noqa: N802 (the base class's name)
        if "watch=true" in self.path:
            type(self).watches += 1
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            self.done.wait(LIVENESS_S)
            self.close_connection = True
            return
        body = json.dumps({"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": "5"},
                           "items": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass


def test_a_watch_that_goes_silent_is_given_up_and_listed_again() -> None:
    """The server never ends the watch (it is gone, its connection is not): the informer gives it up a margin
    past the watch's timeoutSeconds and lists again, instead of serving a cache that stopped."""
    handler = type("Handler", (_ListThenSilentWatch,), {"done": threading.Event(), "watches": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # Only the watch's own timeout can end it: the client's default read timeout is far longer than the test.
    api_client = with_timeouts(_client(server.server_address[1]), connect=1.0, read=LIVENESS_S * 10)
    informer = Informer("nodes", client.CoreV1Api(api_client).list_node, watch_timeout=1, read_margin=0.5,
                        retry_interval=0.1).start()
    try:
        assert informer.wait_synced(LIVENESS_S)
        eventually(lambda: informer.relists >= 3, "the silent watches given up and listed again", timeout=LIVENESS_S,
                   detail=lambda: f"relists {informer.relists}, watches {handler.watches}")
        assert handler.watches >= 2
    finally:
        informer.stop()
        handler.done.set()
        server.shutdown()
        server.server_close()
