"""A list-and-watch cache of Kubernetes objects (what client-go calls an informer).

The scheduler must not list pods and nodes on every poll of every job
controller, and must learn of a failed pod or a NotReady node promptly. An
:class:`Informer` lists a resource once, then watches it from the list's
``resourceVersion``, keeping a cache of plain JSON objects (``dict``, the
API's camelCase) and calling its handlers on every real change.

Watches end: the server times them out, connections drop (one that dies
silently is given up a margin past the server's timeout: a client-side read
timeout), and a ``resourceVersion`` too old for the server's history is
answered with 410 Gone. All of these lead to a fresh list, and the cache is reconciled
against it: objects that vanished meanwhile are reported DELETED, changed
ones MODIFIED. An event whose ``resourceVersion`` the cache already holds
(a replay after resuming) calls no handler, so handlers see each change
once and may assume nothing about how many watches it took.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from tenplex.k8s.apiclient import WATCH_READ_MARGIN_S, watch_timeouts

log = logging.getLogger(__name__)

Key = tuple[str, str]
"""(namespace, name); namespace is "" for cluster-scoped objects."""

Handler = Callable[[str, dict[str, Any], "dict[str, Any] | None"], None]
"""Called as ``handler(event_type, object, previous)``; event_type is ADDED, MODIFIED or DELETED."""


def key_of(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return (meta.get("namespace") or "", meta["name"])


def _rv(obj: Mapping[str, Any] | None) -> str | None:
    return None if obj is None else (obj.get("metadata") or {}).get("resourceVersion")


class Informer:
    """Lists, then watches, one resource; keeps a cache and calls handlers on changes.

    ``list_fn`` is a list function of the official client (e.g.
    ``CoreV1Api.list_node`` or a ``functools.partial`` of
    ``CustomObjectsApi.list_cluster_custom_object``); ``kwargs`` are its
    filters (``label_selector``, ``field_selector``, ``namespace``...).
    """

    def __init__(self, name: str, list_fn: Callable[..., Any], *, watch_timeout: int = 60,
                 retry_interval: float = 1.0, read_margin: float = WATCH_READ_MARGIN_S, **kwargs: Any) -> None:
        """``watch_timeout``: the server ends each watch after that many seconds; ``read_margin``: a watch silent
        that much longer is a dead connection (see :mod:`tenplex.k8s.apiclient`), given up and listed again."""
        self.name = name
        self._list_fn = list_fn
        self._kwargs = kwargs
        self._watch_timeout = watch_timeout
        self._read_margin = read_margin
        self._retry = retry_interval
        self._cache: dict[Key, dict[str, Any]] = {}
        self._pending_added: set[Key] = set()
        """Keys put in by :meth:`add_created` whose ADDED event the watch has not delivered yet."""
        self._lock = threading.RLock()
        self._handlers: list[Handler] = []
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._resp: Any = None
        """The open watch's HTTP response (urllib3), while one is open."""
        self._thread: threading.Thread | None = None
        self.relists = 0
        """How many times the informer listed (1 + the watches it could not resume): for tests and metrics."""

    # -- lifecycle -----------------------------------------------------------------

    def add_handler(self, handler: Handler) -> None:
        with self._lock:
            self._handlers.append(handler)

    def start(self) -> Informer:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"informer-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        resp = self._resp
        if resp is not None:  # unblock a read on a quiet stream: shut the socket down under it
            sock = getattr(getattr(resp, "connection", None), "sock", None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            # A watch blocked on a quiet stream notices the flag at its next event or server timeout;
            # the thread is a daemon, so do not hold the caller up for that.
            self._thread.join(timeout=2.0)

    def wait_synced(self, timeout: float) -> bool:
        """Whether the first list arrived within ``timeout`` seconds."""
        return self._synced.wait(timeout)

    # -- the cache ---------------------------------------------------------------------

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._cache.get((namespace or "", name))

    def items(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._cache.values())

    def add_created(self, obj: dict[str, Any]) -> None:
        """Put an object this process just created into the cache, unless the watch delivered it already.

        So that a reader right after the create sees it. Only a new key is added: replacing a
        cached object with our write's answer would hide from the handlers the changes made by
        others in between (their events would then look stale). No handler runs here: the
        watch's ADDED event, handled on the informer's thread, is reported as usual."""
        key = key_of(obj)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = obj
                self._pending_added.add(key)

    # -- list and watch ----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                rv = self._relist()
                self._synced.set()
                while not self._stop.is_set():
                    rv = self._watch_from(rv)
            except client.ApiException as exc:
                if self._stop.is_set():
                    break
                if exc.status == 410:
                    log.info("informer %s: watch expired (410 Gone), listing again", self.name)
                else:
                    log.warning("informer %s: API error %s (%s), listing again in %.1fs", self.name, exc.status,
                                exc.reason, self._retry)
                    self._stop.wait(self._retry)
            except Exception as exc:  # connection reset, server gone: list again until stopped
                if self._stop.is_set():
                    break
                log.warning("informer %s: watch failed (%s: %s), listing again in %.1fs", self.name,
                            type(exc).__name__, exc, self._retry)
                self._stop.wait(self._retry)

    def _relist(self) -> str:
        resp = self._list_fn(_preload_content=False, **self._kwargs)
        try:
            listed = json.loads(resp.data)
        finally:
            resp.release_conn()
        self.relists += 1
        items = listed.get("items") or []
        seen: set[Key] = set()
        for obj in items:
            seen.add(key_of(obj))
            self._apply("ADDED", obj)
        with self._lock:
            gone = [k for k in self._cache if k not in seen]
        for k in gone:
            if (old := self.get(*k)) is not None:
                self._apply("DELETED", old)
        return str(listed.get("metadata", {}).get("resourceVersion", ""))

    def _watch_from(self, rv: str) -> str:
        """One watch from ``rv`` until the server ends it; returns the resourceVersion to resume from.

        The watch's lines are read here rather than through ``kubernetes.watch.Watch``: with
        ``deserialize=False`` that client (37.0.2) fails on an ERROR event with a KeyError
        instead of raising its status, so a 410 Gone would look like a broken connection
        (a warning and a retry delay) instead of a plain relist.
        """
        resp = self._list_fn(watch=True, resource_version=rv, timeout_seconds=self._watch_timeout,
                             allow_watch_bookmarks=True, _preload_content=False,
                             _request_timeout=watch_timeouts(self._watch_timeout, self._read_margin), **self._kwargs)
        self._resp = resp
        try:
            for line in iter_resp_lines(resp):
                if self._stop.is_set():
                    break
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise client.ApiException(status=int(obj.get("code") or 500),
                                              reason=f"{obj.get('reason')}: {obj.get('message')}")
                new_rv = _rv(obj)
                if kind == "BOOKMARK":
                    rv = new_rv or rv
                    continue
                if kind not in ("ADDED", "MODIFIED", "DELETED"):
                    log.warning("informer %s: unexpected watch event %r", self.name, kind)
                    continue
                self._apply(kind, obj)
                rv = new_rv or rv
        finally:
            self._resp = None
            resp.close()
            resp.release_conn()
        return rv

    def _apply(self, kind: str, obj: dict[str, Any]) -> None:
        key = key_of(obj)
        with self._lock:
            old = self._cache.get(key)
            if kind == "DELETED":
                if old is None:
                    return  # a replayed deletion
                del self._cache[key]
                self._pending_added.discard(key)
            else:
                created_here = key in self._pending_added
                self._pending_added.discard(key)
                if old is not None and _rv(old) == _rv(obj) and not created_here:
                    return  # a replay: nothing changed
                self._cache[key] = obj
                if created_here:
                    old = None  # what we put in was our own create's answer: this is its ADDED event
                kind = "ADDED" if old is None else "MODIFIED"
            handlers = list(self._handlers)
        for handler in handlers:
            try:
                handler(kind, obj, old)
            except Exception:  # one broken handler must not stop the cache
                log.exception("informer %s: handler failed on %s %s/%s", self.name, kind, *key)

