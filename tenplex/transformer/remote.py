"""Transforms on the nodes, seen from the control plane: the wire format and :class:`PlanRun`.

A reconfiguration's bytes are moved by the target hosts' store daemons
(:mod:`tenplex.node.transforms`); the scheduler sends each its sub-plan
(:class:`TransformRequest`), reads back their records
(:class:`TransformStatus`) and cancels what is left when one fails. This
module is that conversation, free of the daemon's own dependencies (no zarr,
no FastAPI): what a control plane imports.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import struct
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar
from urllib.parse import quote, urlsplit

from tenplex.core.version import Version
from tenplex.errors import InvalidInput, NotFound, StoreUnavailable, TenplexError, TransformFailed
from tenplex.store.client import StoreClient
from tenplex.store.locations import check_options, check_uri, is_persistent_uri
from tenplex.store.names import check_job, check_version
from tenplex.transformer import part as part_mod
from tenplex.transformer.execute import TransformReport
from tenplex.transformer.plan import CHECKPOINT, Plan

log = logging.getLogger(__name__)

QUEUED, RUNNING, COMMITTED, FAILED, CANCELLED, INTERRUPTED = (
    "queued", "running", "committed", "failed", "cancelled", "interrupted",
)
FINAL_STATES = frozenset({COMMITTED, FAILED, CANCELLED, INTERRUPTED})


REQUEST_MAGIC = b"TPLXTREQ"
REQUEST_VERSION = 1
_REQUEST_PREFIX = struct.Struct("<8sII")
REQUEST_CONTENT_TYPE = "application/vnd.tenplex.transform"


@dataclass(frozen=True)
class TransformRequest:
    """What the control plane sends a target host's daemon: its sub-plan and where the sources are.

    On the wire (:func:`encode_request`): ``REQUEST_MAGIC`` | format version (u32 LE) | header length (u32 LE) |
    header (JSON: host, sources, token, checkpoint options) | the host's part in its compact binary form
    (:mod:`tenplex.transformer.part`). A JSON body (``{"host", "plan", "sources", ...}`` with the plan as
    ``tenplex.plan/v1``) is read too, for people and scripts; the control plane sends the binary form.
    """

    host: str
    plan: Plan
    """Only ``host``'s part (:meth:`Plan.for_host`); a whole plan is cut down to it on receipt."""
    sources: Mapping[str, str]
    """Host name (and :data:`~tenplex.transformer.plan.CHECKPOINT`) -> store URL."""
    token: str | None = None
    """Bearer token of the source daemons; None: the daemon's own (one token per cluster)."""
    checkpoint_options: Mapping[str, Any] | None = None
    """Connection options of a persistent ``checkpoint`` location (endpoint, region; credentials, never
    recorded); None: the daemon's AWS environment alone."""
    encoded_part: bytes | None = field(default=None, compare=False, repr=False)
    """The part as received or sent (binary form); None: encoded from ``plan`` when needed."""

    @property
    def version(self) -> Version:
        return self.plan.new_version

    @functools.cached_property
    def part_bytes(self) -> bytes:
        return self.encoded_part if self.encoded_part is not None else part_mod.encode(self.plan, self.host)

    @property
    def digest(self) -> str:
        """Identifies the sub-plan: a resubmission with the same digest is the same transform. It hashes the
        part's binary form, which the planner builds the same way every time for the same inputs (a restarted
        scheduler resubmits the same bytes)."""
        head = f"{self.plan.job}|{self.plan.old_version}|{self.plan.new_version}|{self.plan.checkpoint}|" + (
            f"{self.plan.old_job}|" if self.plan.old_job is not None else "")
        return hashlib.sha256(head.encode() + self.part_bytes).hexdigest()[:20]

    @classmethod
    def from_body(cls, body: bytes) -> TransformRequest:
        """A request as a daemon receives it: the binary form, or JSON (see the class doc)."""
        if body[:1] in (b"{", b"[", b" ", b"\n", b"\t", b"\r"):
            return cls.from_json(_json(body, "the transform request"))
        if len(body) < _REQUEST_PREFIX.size or body[:8] != REQUEST_MAGIC:
            raise InvalidInput(f"a transform request is JSON or the binary form starting with {REQUEST_MAGIC!r}; "
                               f"this body starts with {bytes(body[:8])!r}")
        _, version, head_len = _REQUEST_PREFIX.unpack_from(body)
        if version != REQUEST_VERSION:
            raise InvalidInput(f"transform request format version {version}: this daemon reads version "
                               f"{REQUEST_VERSION} only (the scheduler and the node daemons must run matching releases)")
        start = _REQUEST_PREFIX.size
        if start + head_len > len(body):
            raise InvalidInput("malformed transform request: the header is truncated")
        header = _json(body[start:start + head_len], "the transform request's header")
        data = memoryview(body)[start + head_len:]
        plan = part_mod.decode(data)
        if not isinstance(header, dict):
            raise InvalidInput("malformed transform request: the header is not a JSON object")
        return cls._checked(header, plan, bytes(data))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"host": self.host, "plan": self.plan.to_json(), "sources": dict(self.sources)}
        if self.token is not None:
            out["token"] = self.token
        if self.checkpoint_options is not None:
            out["checkpoint_options"] = dict(self.checkpoint_options)
        return out

    @classmethod
    def from_json(cls, obj: Any) -> TransformRequest:
        if not isinstance(obj, dict):
            raise InvalidInput(f"a transform request is a JSON object, got {type(obj).__name__}")
        if "plan" not in obj:
            raise InvalidInput("the transform request needs 'plan': the host's part of a plan (tenplex.plan/v1)")
        return cls._checked(obj, Plan.from_json(obj["plan"]), None)

    @classmethod
    def _checked(cls, obj: Mapping[str, Any], plan: Plan, encoded: bytes | None) -> TransformRequest:
        unknown = sorted(set(obj) - {"host", "plan", "sources", "token", "checkpoint_options"})
        if unknown:
            raise InvalidInput(f"unknown fields in the transform request: {', '.join(unknown)}")
        host, sources, token = obj.get("host"), obj.get("sources", {}), obj.get("token")
        if not isinstance(host, str) or not host:
            raise InvalidInput("the transform request needs 'host': the target host whose part to run")
        if not isinstance(sources, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in sources.items()):
            raise InvalidInput("'sources' must map host names to store URLs")
        for name, url in sources.items():
            if name == CHECKPOINT and is_persistent_uri(url):
                check_uri(url)
                continue
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise InvalidInput(f"source {name!r}: store URL {url!r} must look like http://HOST:PORT")
        if token is not None and not isinstance(token, str):
            raise InvalidInput("'token' must be a string")
        if host not in plan.hosts:
            raise InvalidInput(f"the plan has no part for host {host!r}; it has {', '.join(plan.hosts) or 'none'}")
        if plan.checkpoint is not None and is_persistent_uri(plan.checkpoint):
            check_uri(plan.checkpoint)
        options = obj.get("checkpoint_options")
        return cls(host=host, plan=plan.for_host(host), sources=dict(sources), token=token,
                   checkpoint_options=check_options(options) if options is not None else None, encoded_part=encoded)


def _json(body: bytes, what: str) -> Any:
    try:
        return json.loads(body)
    except ValueError as exc:
        raise InvalidInput(f"{what} is not JSON: {exc}") from None


def encode_request(host: str, part: bytes, sources: Mapping[str, str], token: str | None) -> bytes:
    """A transform request's binary form (see :class:`TransformRequest`), around an encoded part."""
    header: dict[str, Any] = {"host": host, "sources": dict(sources)}
    if token is not None:
        header["token"] = token
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((_REQUEST_PREFIX.pack(REQUEST_MAGIC, REQUEST_VERSION, len(head)), head, part))


class TaskProgress:
    """What a daemon task's record says of its progress (transforms and uploads alike): done, how long it has
    run, and its rate in bytes per second since it started (an upload's backoff waits included)."""

    final_states: ClassVar[frozenset[str]]
    state: str
    bytes_done: int
    started_at: float | None
    finished_at: float | None

    @property
    def finished(self) -> bool:
        return self.state in self.final_states

    @property
    def seconds(self) -> float:
        if self.started_at is None:
            return 0.0
        return max(0.0, (self.finished_at or time.time()) - self.started_at)

    @property
    def rate(self) -> float:
        s = self.seconds
        return self.bytes_done / s if s > 0 else 0.0


@dataclass(frozen=True)
class TransformStatus(TaskProgress):
    """The record of one transform on one node, as stored and as answered."""

    job: str
    version: str
    host: str
    old_version: str
    digest: str
    state: str
    bytes_total: int
    bytes_done: int = 0
    submitted_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    error_code: str | None = None
    report: Mapping[str, Any] | None = None
    """The executor's :class:`TransformReport` once committed: bytes local/remote/linked/zero, requests."""

    final_states: ClassVar[frozenset[str]] = FINAL_STATES

    def transform_report(self) -> TransformReport:
        if self.report is None:
            raise NotFound(f"transform of {self.host} to {self.version} has no report ({self.state})")
        return TransformReport.from_json(self.report)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": round(self.seconds, 6), "rate_bytes_per_s": round(self.rate, 1)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TransformStatus:
        try:
            return cls(
                job=str(obj["job"]), version=str(obj["version"]), host=str(obj["host"]),
                old_version=str(obj["old_version"]), digest=str(obj["digest"]), state=str(obj["state"]),
                bytes_total=int(obj["bytes_total"]), bytes_done=int(obj.get("bytes_done", 0)),
                submitted_at=float(obj.get("submitted_at", 0.0)), started_at=obj.get("started_at"),
                finished_at=obj.get("finished_at"), error=obj.get("error"), error_code=obj.get("error_code"),
                report=obj.get("report"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"malformed transform record: {type(exc).__name__}: {exc}") from None


def transforms_path(job: str, version: Version | str | None = None, *, wait: float = 0.0) -> str:
    path = f"/v1/jobs/{quote(check_job(job), safe='')}/transforms"
    if version is not None:
        path += f"/{check_version(version)}"
        if wait > 0:
            path += f"?wait={wait:g}"
    return path


class PlanRun:
    """A plan carried out by its target hosts' daemons, as the control plane follows it.

    Holds no tensor byte: :meth:`submit` sends every target host its sub-plan
    (all at once), :meth:`poll` reads their records, :meth:`cancel` stops what
    still runs. ``stores`` maps the hosts that are alive to their daemons' URLs
    (sources a sub-plan names but ``stores`` lacks count as failed at the
    node, which moves to other holders); ``client_for`` gives a
    :class:`~tenplex.store.client.StoreClient` for a URL (the caller's pool).
    """

    def __init__(self, plan: Plan, stores: Mapping[str, str], *, token: str | None,
                 client_for: Callable[[str], StoreClient]) -> None:
        missing = sorted(h for h in plan.hosts if h not in stores)
        if missing:
            raise StoreUnavailable(f"no alive store daemon for target hosts {missing} of {plan.new_version}")
        self.plan = plan
        self.stores = dict(stores)
        self.token = token
        self._client_for = client_for
        self.statuses: dict[str, TransformStatus] = {}

    def body(self, host: str) -> bytes:
        """``host``'s request in its binary form, built from the planner's arrays (no per-piece objects)."""
        sources = {h: self.stores[h] for h in sorted(self.plan.sources_of(host)) if h in self.stores}
        return encode_request(host, part_mod.encode(self.plan, host), sources, self.token)

    def _each(self, fn: Callable[[str], TransformStatus]) -> dict[str, TransformStatus]:
        hosts = list(self.plan.hosts)
        with ThreadPoolExecutor(max_workers=min(32, max(1, len(hosts))), thread_name_prefix="tenplex-planrun") as pool:
            results = dict(zip(hosts, pool.map(fn, hosts), strict=True))
        self.statuses.update(results)
        return results

    def submit(self) -> dict[str, TransformStatus]:
        """Send every target its sub-plan (idempotent: after a restart this attaches to what runs)."""
        job = self.plan.job

        def one(host: str) -> TransformStatus:
            body = self.body(host)
            return TransformStatus.from_json(
                self._client_for(self.stores[host]).request_json("POST", transforms_path(job), body,
                                                                 content_type=REQUEST_CONTENT_TYPE)
            )

        return self._each(one)

    def poll(self, wait: float = 0.0) -> dict[str, TransformStatus]:
        """Every target's record; with ``wait``, each daemon answers as soon as its transform has finished
        (or after ``wait`` seconds), so a commit is learnt of at once, not at the next poll."""
        job, version = self.plan.job, self.plan.new_version

        def one(host: str) -> TransformStatus:
            known = self.statuses.get(host)
            if known is not None and known.finished:
                return known
            return TransformStatus.from_json(
                self._client_for(self.stores[host]).request_json("GET", transforms_path(job, version, wait=wait))
            )

        return self._each(one)

    def cancel(self, hosts: list[str] | None = None) -> None:
        """Cancel the transforms still running, all at once (best effort: a daemon that does not answer is
        skipped; nothing of a cancelled transform is committed)."""
        job, version = self.plan.job, self.plan.new_version
        todo = [h for h in (hosts if hosts is not None else list(self.plan.hosts))
                if not ((known := self.statuses.get(h)) is not None and known.finished)]

        def one(host: str) -> None:
            try:
                self._client_for(self.stores[host]).request_json("DELETE", transforms_path(job, version))
            except TenplexError as exc:
                log.warning("could not cancel the transform of %s to %s: %s", host, version, exc.detail)

        if todo:
            with ThreadPoolExecutor(max_workers=min(32, len(todo)), thread_name_prefix="tenplex-planrun") as pool:
                list(pool.map(one, todo))

    @staticmethod
    def failure(statuses: Mapping[str, TransformStatus]) -> TransformStatus | None:
        """The first target whose transform ended without committing, if any."""
        return next((s for s in statuses.values() if s.finished and s.state != COMMITTED), None)

    def wait(self, *, poll_interval: float = 0.2, timeout: float | None = None,
             progress: Callable[[Mapping[str, TransformStatus]], None] | None = None) -> dict[str, TransformReport]:
        """Submit, follow to the end and answer each host's report; a failure cancels the others and raises
        :class:`TransformFailed` naming every host that did not commit."""
        statuses = self.submit()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(s.finished for s in statuses.values()):
            if self.failure(statuses) is not None:
                break
            if deadline is not None and time.monotonic() > deadline:
                self.cancel()
                raise TransformFailed(f"the transform to {self.plan.new_version} did not finish within {timeout} s")
            if progress is not None:
                progress(statuses)
            statuses = self.poll(wait=poll_interval)
        if progress is not None:
            progress(statuses)
        bad = {h: s for h, s in statuses.items() if s.finished and s.state != COMMITTED}
        if bad:
            self.cancel()
            detail = "; ".join(f"{h}: {s.state}: {s.error}" for h, s in bad.items())
            raise TransformFailed(f"{len(bad)} of {len(statuses)} hosts did not commit {self.plan.new_version}: {detail}")
        return {h: s.transform_report() for h, s in statuses.items()}
