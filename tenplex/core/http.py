"""The HTTP client policy every tenplex client shares: which failures are retried, the wait between tries, and
how an error answer becomes the :mod:`tenplex.errors` exception the server raised.

The retry policy is a urllib3 :class:`~urllib3.util.Retry`. Clients that speak through urllib3 (the worker's
control client, the node daemon's heartbeat relay, the command line's scheduler client) hand it to urllib3, which
applies it; the store client keeps its own ``http.client`` connections (a bulk body is received with ``readinto``
straight into the caller's buffer; urllib3's ``readinto`` reads into a new bytes object and copies it) and steps
the same policy with :func:`next_try`.
"""

from __future__ import annotations

import functools
import json
import ssl
from collections.abc import Collection

import urllib3
from urllib3.exceptions import MaxRetryError
from urllib3.util import Retry

from tenplex import errors
from tenplex.errors import InvalidInput, TenplexError

GATEWAY_STATUSES = frozenset({502, 503, 504})
"""Answers of a server that is restarting or behind a proxy that lost it: worth another try."""

SERVER_ERRORS = frozenset(range(500, 600))

BACKOFF_MAX_S = 5.0

_BY_STATUS: dict[int, type[TenplexError]] = {
    400: errors.InvalidInput,
    401: errors.Unauthorized,
    403: errors.Forbidden,
    404: errors.NotFound,
    409: errors.Conflict,
    416: errors.RegionOutOfBounds,
}


def retry_policy(retries: int, backoff_s: float, statuses: Collection[int] = GATEWAY_STATUSES) -> Retry:
    """Up to ``retries`` more tries after the first, of any method, on a connection or read error or an answer in
    ``statuses``; the waits are 0, then ``2 * backoff_s`` doubling, at most :data:`BACKOFF_MAX_S`. An answer in
    ``statuses`` on the last try is returned (not raised), so its body is decoded like any error answer."""
    return Retry(total=retries, redirect=0, allowed_methods=None, status_forcelist=frozenset(statuses),
                 backoff_factor=backoff_s, backoff_max=BACKOFF_MAX_S, raise_on_status=False,
                 respect_retry_after_header=False)


def next_try(retry: Retry, method: str, url: str, error: Exception | None = None) -> Retry | None:
    """The policy after a failed try (``error``, or an answer in its statuses when None), once its wait has
    passed; None when the tries are spent."""
    try:
        retry = retry.increment(method, url, error=error)
    except MaxRetryError:
        return None
    retry.sleep()
    return retry


def error_from(status: int, payload: bytes, where: str, unavailable: type[TenplexError], *,
               where_last: bool = False) -> TenplexError:
    """The exception an error answer stands for: the class of its body's ``error`` code (the servers answer
    :meth:`TenplexError.to_json`), else one by HTTP status, else :class:`InvalidInput` for 4xx and
    ``unavailable`` for 5xx; the message is ``where: detail``, or ``detail (where)`` with ``where_last``: a
    store's answer is passed on as the daemon said it (the scheduler's messages quote it), its server after it."""
    code: object = None
    detail = payload[:500].decode("utf-8", "replace") or f"HTTP {status}"
    try:
        obj = json.loads(payload)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        code = obj.get("error")
        raw = obj.get("detail", detail)
        detail = raw if isinstance(raw, str) else json.dumps(raw)[:500]
    cls = (errors.error_class(code) if isinstance(code, str) else None) or _BY_STATUS.get(status) or (
        InvalidInput if status < 500 else unavailable)
    return cls(f"{detail} ({where})" if where_last else f"{where}: {detail}")


@functools.cache
def pool(context: ssl.SSLContext) -> urllib3.PoolManager:
    """The kept-alive connections of this process's urllib3 clients verifying servers with ``context`` (up to 8
    per server: a worker's heartbeat thread and its training loop may call the scheduler at once)."""
    return urllib3.PoolManager(ssl_context=context, maxsize=8)
