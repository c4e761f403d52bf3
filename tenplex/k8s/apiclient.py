"""Client-side timeouts on every Kubernetes API call the scheduler makes.

The official client sends a request without a timeout unless the call passes
``_request_timeout``; a connection that dies without a FIN or RST (a node or
load balancer gone, a NAT entry dropped, a server restarting behind a proxy)
then blocks its thread forever. In the scheduler that thread is a job's
controller (a hung call holds the job's lock: it never sees a failed worker
again), an informer (its cache stops), or the leader election. So every API
client the scheduler uses gets default connect and read timeouts
(:func:`with_timeouts`), and the watches their own read timeout a margin above
the server's ``timeoutSeconds`` (:func:`watch_timeouts`): a watch is quiet
for as long as nothing changes, but the server ends it by then.

A call that times out raises urllib3's ``TimeoutError`` (an ``HTTPError``):
the controller retries the step, as for a refused connection, and an informer
lists again.
"""

from __future__ import annotations

from typing import Any

from kubernetes import client
from kubernetes.client import rest

CONNECT_TIMEOUT_S = 10.0
"""Time to set up a connection (TCP and TLS) to the API server."""
READ_TIMEOUT_S = 60.0
"""Longest silence while waiting for an answer: the API server's own limit for a request (its
``--request-timeout``, 1 minute), past which it would have answered with an error itself."""
WATCH_READ_MARGIN_S = 10.0
"""How long past the server's ``timeoutSeconds`` a silent watch is given up as a dead connection."""


class _TimedRESTClient(rest.RESTClientObject):
    """The official REST client, with a (connect, read) timeout for the calls that pass none."""

    def __init__(self, configuration: client.Configuration, timeout: tuple[float, float]) -> None:
        super().__init__(configuration)
        self.timeout = timeout

    def request(self, method: str, url: str, headers: Any = None, body: Any = None, post_params: Any = None,
                _request_timeout: Any = None) -> Any:
        return super().request(method, url, headers=headers, body=body, post_params=post_params,
                               _request_timeout=_request_timeout or self.timeout)


def with_timeouts(api_client: client.ApiClient, *, connect: float = CONNECT_TIMEOUT_S,
                  read: float = READ_TIMEOUT_S) -> client.ApiClient:
    """Give ``api_client``'s calls that pass no ``_request_timeout`` these timeouts (in seconds); returns it.

    Changes the client in place (its connection pool is replaced): every API object made on it, before or
    after, gets them."""
    if connect <= 0 or read <= 0:
        raise ValueError(f"API timeouts must be positive, got connect={connect}, read={read}")
    current = api_client.rest_client
    if isinstance(current, _TimedRESTClient):
        current.timeout = (connect, read)
        return api_client
    api_client.rest_client = _TimedRESTClient(api_client.configuration, (connect, read))
    current.close()
    return api_client


def timeouts_of(api_client: client.ApiClient) -> tuple[float, float] | None:
    """The default (connect, read) timeouts :func:`with_timeouts` gave ``api_client``, None if none."""
    rest_client = api_client.rest_client
    return rest_client.timeout if isinstance(rest_client, _TimedRESTClient) else None


def watch_timeouts(server_timeout: float, margin: float = WATCH_READ_MARGIN_S) -> tuple[float, float]:
    """The ``_request_timeout`` of a watch the server ends after ``server_timeout`` seconds."""
    return (CONNECT_TIMEOUT_S, server_timeout + margin)
