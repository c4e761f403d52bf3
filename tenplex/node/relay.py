"""The node daemon's heartbeat relay: its workers' liveness goes to the scheduler as one report per node.

Without it every worker heartbeats the scheduler itself, every second or so:
at 16,384 workers that is 16,384 requests a second at one process, several
cores for nothing but liveness. The node daemon already runs on every node
and its workers already talk to it, so each worker posts its heartbeat here
(:data:`~tenplex.core.protocol.RELAY_HEARTBEAT_PATH`) and the daemon sends
the scheduler, once per ``interval_s``, one
:class:`~tenplex.core.protocol.NodeHeartbeats` per job and node with the
heartbeats that came in since its last batch; the scheduler handles one
request per node per interval. Each beat carries how long the daemon held it
(``age_s``, on the daemon's monotonic clock), and the scheduler dates it back
by that, so a worker's silence is measured from its own last beat: a worker
that dies is declared failed at the first scheduler tick after its last
beat + the job's heartbeat timeout, the bound of a direct heartbeat. A
daemon that dies stops the reports of its workers; the scheduler keeps their
last beats and the same bound holds (and its host is lost sooner).

A worker's request waits for the batch that carries it and is answered with
that worker's part of the scheduler's answer: the stop step, a newer
generation, or the error its own heartbeat would have got (unknown worker,
another generation), so what the scheduler says reaches each worker as it
does directly, at most one interval later. The batch is sent with the
worker's own credential (the daemon checked that it may write its job), so
the scheduler authorizes each job's batch as it would the worker.

A daemon relays only to the scheduler it was started for (``--scheduler-url``
or ``$TENPLEX_SCHEDULER_URL``); a worker asks it which (``GET``
:data:`~tenplex.core.protocol.RELAY_PATH`) once, and heartbeats the scheduler
itself when its daemon relays for another one or for none (see
:class:`tenplex.worker.control.Heartbeat`). With several worker processes
(``tenplex store serve --workers N``) each process relays the beats it
received: up to N batches per node and interval.

Snapshot and exit reports go the same way (:data:`~tenplex.core.protocol.RELAY_REPORT_PATH`): at a planned
change every worker sends both within a second or so, 32,768 requests at 16,384 workers. The daemon sends the
reports of a job's workers that came in within ``report_window_s`` (:data:`REPORT_WINDOW_S`, at most the
heartbeat interval) as one :class:`~tenplex.core.protocol.NodeReports`, and answers each worker with its
report's part of the answer: its Ack, or the error the report sent directly would have got. A report the daemon
could not deliver is answered with the failure, and the worker sends it to the scheduler itself, so an exit
report is never lost (the scheduler's handling of a report is idempotent: one sent twice counts once).

The same daemon hands its workers their generation's PTC
(:data:`~tenplex.core.protocol.RELAY_PTC_PATH`, :class:`PtcCache`): every
worker of a generation needs the whole PTC when it starts (0.97 MB gzipped
for a 405B layout), and 15,360 workers fetching it from the scheduler at once
is 15 GB of its egress and 15,360 requests at the moment a reconfiguration
waits for them. The daemon fetches it once per job, generation, PTC digest
and credential, keeps the gzipped bytes, and serves its node's workers from
them (a daemon of N processes: up to N fetches); a worker whose daemon relays
for another scheduler or none fetches it itself.

Lives with the store because it is a route of the same daemon and stands on
the worker protocol only (no control-plane code).
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

import urllib3
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from tenplex import errors
from tenplex.core import protocol as P
from tenplex.core.http import error_from, pool, retry_policy
from tenplex.core.tls import client_context
from tenplex.errors import Conflict, InvalidConfig, InvalidInput, SchedulerUnavailable, TenplexError

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0
"""How often a daemon sends its batch, by default: the scheduler's default heartbeat interval."""
REPORT_WINDOW_S = 0.05
"""How long a daemon gathers its workers' snapshot and exit reports before it sends them (the reports of a
node's workers come within milliseconds of each other at a stop; a small job's stop gets this much slower)."""
PTC_CACHE_ENTRIES = 8
"""The most PTCs a daemon keeps (one per job, generation and credential: its jobs' current generations and the
ones before, which a worker being replaced may still ask for)."""
PTC_CACHE_BYTES = 256 << 20
"""The most bytes of (gzipped) PTCs a daemon keeps; the newest is kept even when it alone is larger."""


@dataclass
class _Waiting:
    """A worker's heartbeat waiting for its batch, and the request that waits for the answer."""

    beat: P.RelayedHeartbeat
    received: float
    answer: asyncio.Future[tuple[int, bytes]]


@dataclass
class _Group:
    """The beats of one job's workers on one node, sent with one credential: one batch."""

    waiting: dict[str, _Waiting] = field(default_factory=dict)


@dataclass
class _Report:
    """A worker's snapshot or exit report waiting for its batch, and the request that waits for the answer."""

    report: P.NodeReport
    answer: asyncio.Future[tuple[int, bytes]]


class HeartbeatRelay:
    """Collects the node's workers' heartbeats and sends them to the scheduler as one batch per job and node.

    :meth:`beat` is called by the route on the daemon's event loop; the batches are sent every ``interval_s``
    by :meth:`flush` (a task of that loop, started with the first beat; tests call it directly). ``clock`` is
    the monotonic clock the beats' ages are measured on.
    """

    def __init__(self, scheduler_url: str, *, interval_s: float = DEFAULT_INTERVAL_S, timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        parts = urllib.parse.urlsplit(scheduler_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidConfig(f"the scheduler URL must be http(s)://host[:port], got {scheduler_url!r}")
        if not interval_s > 0:
            raise InvalidConfig(f"the relay interval must be positive, got {interval_s}")
        self.scheduler_url = scheduler_url.rstrip("/")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._groups: dict[tuple[str, str, str | None], _Group] = {}
        self._task: asyncio.Task[None] | None = None
        self.report_window_s = min(REPORT_WINDOW_S, interval_s)
        self._reports: dict[tuple[str, str, str | None], dict[tuple[str, bool], _Report]] = {}
        self._report_task: asyncio.Task[None] | None = None
        self.report_batches = 0
        """Batches of snapshot and exit reports sent (``tenplex_relay_report_batches``)."""
        self.reports = 0
        """Reports relayed in them (``tenplex_relay_reports``)."""
        self.batches = 0
        """Batches sent (the daemon's ``tenplex_relay_batches``)."""
        self.heartbeats = 0
        """Heartbeats relayed in them (``tenplex_relay_heartbeats``)."""
        self.failures = 0
        """Batches the scheduler did not answer (``tenplex_relay_failures``)."""

        self.ptc = PtcCache(self.scheduler_url, timeout_s=max(timeout_s, 60.0))
        """The generations' PTCs this daemon hands its workers (fetched from the same scheduler)."""

    def info(self) -> P.RelayInfo:
        return P.RelayInfo(scheduler_url=self.scheduler_url, interval_s=self.interval_s)

    async def beat(self, job: str, worker_id: str, authorization: str | None, beat: P.RelayedHeartbeat) -> tuple[int, bytes]:
        """Queue ``beat`` for its node's next batch and wait for its answer: ``(HTTP status, body)``."""
        if beat.scheduler_url.rstrip("/") != self.scheduler_url:
            raise Conflict(f"this node daemon relays heartbeats to {self.scheduler_url}, not to {beat.scheduler_url}")
        loop = asyncio.get_running_loop()
        group = self._groups.setdefault((job, beat.host, authorization), _Group())
        previous = group.waiting.get(worker_id)
        answer = previous.answer if previous is not None else loop.create_future()  # a retry joins the first's wait
        group.waiting[worker_id] = _Waiting(beat, self._clock(), answer)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name="tenplex-heartbeat-relay")
        return await asyncio.shield(answer)

    async def report(self, job: str, authorization: str | None, relayed: P.RelayedReport) -> tuple[int, bytes]:
        """Queue a worker's snapshot or exit report for its node's next batch of reports (sent ``report_window_s``
        after the first report of a quiet spell) and wait for its answer: ``(HTTP status, body)``."""
        if relayed.scheduler_url.rstrip("/") != self.scheduler_url:
            raise Conflict(f"this node daemon relays reports to {self.scheduler_url}, not to {relayed.scheduler_url}")
        loop = asyncio.get_running_loop()
        report = P.NodeReport(worker_id=relayed.worker_id, snapshot=relayed.snapshot, exit=relayed.exit)
        group = self._reports.setdefault((job, relayed.host, authorization), {})
        key = (relayed.worker_id, relayed.exit is not None)
        previous = group.get(key)
        answer = previous.answer if previous is not None else loop.create_future()  # a retry joins the first's wait
        group[key] = _Report(report, answer)
        if self._report_task is None or self._report_task.done():
            self._report_task = loop.create_task(self._run_reports(), name="tenplex-report-relay")
        return await asyncio.shield(answer)

    async def _run_reports(self) -> None:
        while self._reports:
            await asyncio.sleep(self.report_window_s)
            await self.flush_reports()

    async def flush_reports(self) -> int:
        """Send every waiting report now, one batch per job and node (of at most
        :data:`~tenplex.core.protocol.MAX_NODE_HEARTBEATS`), and answer each waiting worker; the batches sent."""
        groups, self._reports = self._reports, {}
        sent = 0
        for (job, host, authorization), group in groups.items():
            waiting = list(group.values())
            for i in range(0, len(waiting), P.MAX_NODE_HEARTBEATS):
                await self._send_reports(job, host, authorization, waiting[i:i + P.MAX_NODE_HEARTBEATS])
                sent += 1
        return sent

    async def _send_reports(self, job: str, host: str, authorization: str | None, waiting: list[_Report]) -> None:
        """One batch of reports to the scheduler; each worker answered with its report's part of the answer (every
        one of them with the failure when there is none: the workers then report directly)."""
        status, raw = await self._post_batch(
            P.NODE_REPORTS_PATH, job, host, authorization, "report", len(waiting),
            lambda: P.NodeReports(reports=[w.report for w in waiting]))
        self.report_batches += 1
        self.reports += len(waiting)
        answers = _report_answers(raw, len(waiting)) if status == 200 else None
        for i, w in enumerate(waiting):
            if not w.answer.done():
                w.answer.set_result(answers[i] if answers is not None else (status, raw))

    async def _run(self) -> None:
        while self._groups:
            await asyncio.sleep(self.interval_s)
            await self.flush()

    async def flush(self) -> int:
        """Send every waiting beat now, one batch per job and node (of at most
        :data:`~tenplex.core.protocol.MAX_NODE_HEARTBEATS`), and answer each waiting worker; the number of
        batches sent."""
        groups, self._groups = self._groups, {}
        sent = 0
        for (job, host, authorization), group in groups.items():
            waiting = list(group.waiting.items())
            for i in range(0, len(waiting), P.MAX_NODE_HEARTBEATS):
                await self._send(job, host, authorization, waiting[i:i + P.MAX_NODE_HEARTBEATS])
                sent += 1
        return sent

    async def _send(self, job: str, host: str, authorization: str | None, waiting: list[tuple[str, _Waiting]]) -> None:
        """One batch to the scheduler; each of its workers answered with its part of the answer (every one of them
        with the error when there is none)."""
        def batch() -> P.NodeHeartbeats:
            now = self._clock()
            beats = [w.beat for _, w in waiting]
            return P.NodeHeartbeats(
                workers=[wid for wid, _ in waiting], generations=[b.generation for b in beats],
                steps=[b.step for b in beats], ages=[max(0.0, now - w.received) for _, w in waiting],
                losses=[b.loss for b in beats] if any(b.loss is not None for b in beats) else None,
                marks={wid: w.beat.marks for wid, w in waiting if w.beat.marks} or None,
            )

        status, raw = await self._post_batch(P.NODE_HEARTBEATS_PATH, job, host, authorization, "heartbeat",
                                             len(waiting), batch)
        self.batches += 1
        self.heartbeats += len(waiting)
        answers = _answers(raw) if status == 200 else {}
        for wid, w in waiting:
            if not w.answer.done():
                w.answer.set_result((answers.get(wid) or answers.get("") or _missing(wid)) if status == 200
                                    else (status, raw))

    async def _post_batch(self, path: str, job: str, host: str, authorization: str | None, what: str, count: int,
                          batch: Callable[[], BaseModel]) -> tuple[int, bytes]:
        """POST one batch of a node's ``what``s (``path``: its route's template, ``batch()``: its body, made here so
        that a batch that cannot be made fails like one that cannot be sent) to the scheduler: the answer's status
        and body, or a failure's as an error answer, which every worker of the batch then gets."""
        try:
            url_path = path.format(job=urllib.parse.quote(job, safe=""), node=urllib.parse.quote(host, safe=""))
            body = batch().model_dump_json(exclude_none=True).encode()
            return await asyncio.to_thread(self._post, url_path, body, authorization)
        except TenplexError as exc:
            log.warning("relaying %d %ss of job %s: %s", count, what, job, exc.detail)
            self.failures += 1
            return exc.http_status, _error_json(exc)
        except Exception as exc:  # a batch that cannot be made or sent must not leave its workers waiting
            log.exception("relaying %d %ss of job %s failed", count, what, job)
            self.failures += 1
            unexpected = SchedulerUnavailable(f"the node daemon could not relay the {what}: {exc}")
            return unexpected.http_status, _error_json(unexpected)

    def _post(self, path: str, body: bytes, authorization: str | None) -> tuple[int, bytes]:
        """POST one batch on a kept-alive connection to the scheduler (tried once more on a connection error: one
        that the scheduler closed while it sat idle)."""
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if authorization:
            headers["Authorization"] = authorization
        try:
            resp = pool(client_context()).request("POST", self.scheduler_url + path, body=body, headers=headers,
                                                  timeout=self.timeout_s, retries=retry_policy(1, 0.0, ()))
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise SchedulerUnavailable(f"POST {self.scheduler_url}{path} failed: {reason}") from None
        return resp.status, resp.data


@dataclass(frozen=True)
class CachedPtc:
    """A generation's PTC as the scheduler sent it: its JSON, gzipped or not (``gzipped``)."""

    body: bytes
    gzipped: bool

    def json_bytes(self) -> bytes:
        return gzip.decompress(self.body) if self.gzipped else self.body


class PtcCache:
    """The generations' PTCs the node's workers ask for, each fetched from the scheduler once.

    Keyed by job, generation, PTC digest and the worker's credential (the scheduler issues one per generation,
    shared by its workers): a credential gets only what the scheduler gave that same credential, so the scheduler still decides
    who may read a job's PTC, as when each worker fetched it. The daemon's own check (a read of the job) comes
    first, in its authentication. Workers asking at once wait for one fetch; a failed fetch is not kept (each
    waiting worker gets the scheduler's error, and the next ask fetches again). At most ``entries`` PTCs and
    ``max_bytes`` are kept, the least recently asked for dropped first.
    """

    def __init__(self, scheduler_url: str, *, timeout_s: float = 60.0, entries: int = PTC_CACHE_ENTRIES,
                 max_bytes: int = PTC_CACHE_BYTES) -> None:
        if entries < 1 or max_bytes < 1:
            raise InvalidConfig(f"the PTC cache needs room for one PTC, got {entries} entries and {max_bytes} bytes")
        self.scheduler_url = scheduler_url.rstrip("/")
        self.timeout_s = timeout_s
        self.entries = entries
        self.max_bytes = max_bytes
        self._kept: OrderedDict[tuple[str, int, str | None, str | None], CachedPtc] = OrderedDict()
        self._fetching: dict[tuple[str, int, str | None, str | None], asyncio.Task[CachedPtc]] = {}
        self.fetches = 0
        """PTCs fetched from the scheduler (``tenplex_relay_ptc_fetches``)."""
        self.served = 0
        """PTCs handed to workers (``tenplex_relay_ptc_served``)."""

    def __len__(self) -> int:
        return len(self._kept)

    async def get(self, job: str, generation: int, authorization: str | None, digest: str | None) -> CachedPtc:
        """The PTC of ``job``'s ``generation`` for a worker with ``authorization``: kept, or fetched now (raises
        the scheduler's error as its :class:`~tenplex.errors.TenplexError`). ``digest`` (from the worker's
        ``ptc_url``, :func:`tenplex.scheduler.launcher.ptc_digest`) tells this job's PTC from that of a job of the
        same name created again; the scheduler refuses a digest that is not its PTC's. Without one (a scheduler
        that sends none) the PTC is fetched for the workers asking at once, and not kept."""
        key = (job, generation, digest, authorization)
        kept = self._kept.get(key)
        if kept is None:
            task = self._fetching.get(key)
            if task is None:
                task = self._fetching[key] = asyncio.get_running_loop().create_task(self._fetch(key))
            kept = await asyncio.shield(task)
        else:
            self._kept.move_to_end(key)
        self.served += 1
        return kept

    async def _fetch(self, key: tuple[str, int, str | None, str | None]) -> CachedPtc:
        job, generation, digest, authorization = key
        try:
            ptc = await asyncio.to_thread(self._get, job, generation, digest, authorization)
        finally:
            del self._fetching[key]
        self.fetches += 1
        if digest is None:
            return ptc
        self._kept[key] = ptc
        size = sum(len(p.body) for p in self._kept.values())
        while len(self._kept) > 1 and (len(self._kept) > self.entries or size > self.max_bytes):
            _, dropped = self._kept.popitem(last=False)
            size -= len(dropped.body)
        log.info("fetched the PTC of job %s generation %d from the scheduler (%d bytes%s)", job, generation,
                 len(ptc.body), ", gzipped" if ptc.gzipped else "")
        return ptc

    def _get(self, job: str, generation: int, digest: str | None, authorization: str | None) -> CachedPtc:
        """GET the PTC from the scheduler, gzipped as it is sent (kept that way: workers accept gzip)."""
        query = urllib.parse.urlencode({"generation": generation, **({"digest": digest} if digest else {})})
        url = f"{self.scheduler_url}/v1/jobs/{urllib.parse.quote(job, safe='')}/ptc?{query}"
        headers = {"Accept": "application/json", "Accept-Encoding": "gzip"}
        if authorization:
            headers["Authorization"] = authorization
        try:
            resp = pool(client_context()).request("GET", url, headers=headers, timeout=self.timeout_s,
                                                  retries=retry_policy(2, 0.2), decode_content=False)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise SchedulerUnavailable(f"the node daemon could not fetch the PTC: GET {url} failed: {reason}") from None
        gzipped = resp.headers.get("content-encoding", "") == "gzip"
        if resp.status != 200:
            raise error_from(resp.status, gzip.decompress(resp.data) if gzipped else resp.data,
                             f"GET {url} (through the node daemon)", SchedulerUnavailable)
        return CachedPtc(resp.data, gzipped)


def _error_json(exc: TenplexError) -> bytes:
    return P.ErrorBody(error=exc.code, detail=exc.detail[:4000]).model_dump_json().encode()


def _answers(raw: bytes) -> dict[str, tuple[int, bytes]]:
    """Each worker's part of the scheduler's answer to a batch, as its own heartbeat's answer would read:
    worker id -> (HTTP status, body) for the workers with an error, ``""`` -> the others' (none: no reply)."""
    try:
        reply = P.NodeHeartbeatsReply.model_validate_json(raw)
    except ValidationError:
        log.warning("the scheduler's answer to a node's heartbeats is not a NodeHeartbeatsReply: %r", raw[:200])
        return {}
    parts: dict[str, tuple[int, bytes]] = {}
    if reply.reply is not None:
        parts[""] = 200, reply.reply.model_dump_json().encode()
    for worker_id, error in reply.errors.items():
        cls = errors.error_class(error.error) or TenplexError
        parts[worker_id] = cls.http_status, error.model_dump_json().encode()
    return parts


_ACK = P.Ack().model_dump_json().encode()


def _report_answers(raw: bytes, n: int) -> list[tuple[int, bytes]]:
    """Each report's part of the scheduler's answer to a batch of ``n``, as the report sent directly would read:
    its error, else an Ack (each a 503 when the answer cannot be read: the workers then report directly)."""
    try:
        reply = P.NodeReportsReply.model_validate_json(raw)
    except ValidationError:
        log.warning("the scheduler's answer to a node's reports is not a NodeReportsReply: %r", raw[:200])
        unreadable = SchedulerUnavailable("the scheduler's answer to its node's reports could not be read")
        return [(unreadable.http_status, _error_json(unreadable))] * n
    answers: list[tuple[int, bytes]] = [(200, _ACK)] * n
    for i, error in reply.errors.items():
        if 0 <= i < n:
            cls = errors.error_class(error.error) or TenplexError
            answers[i] = cls.http_status, error.model_dump_json().encode()
    return answers


def _missing(worker_id: str) -> tuple[int, bytes]:
    exc = SchedulerUnavailable(f"the scheduler's answer to its node's heartbeats has none for worker {worker_id}")
    return exc.http_status, _error_json(exc)


def relay_router(relay: HeartbeatRelay | None, interval_s: float = DEFAULT_INTERVAL_S) -> APIRouter:
    """The relay's routes: ``GET`` :data:`~tenplex.core.protocol.RELAY_PATH` (which scheduler, if any) and, with a
    relay, ``POST`` :data:`~tenplex.core.protocol.RELAY_HEARTBEAT_PATH` (a worker's heartbeat), ``POST``
    :data:`~tenplex.core.protocol.RELAY_REPORT_PATH` (a worker's snapshot or exit report) and ``GET``
    :data:`~tenplex.core.protocol.RELAY_PTC_PATH` (a generation's PTC)."""
    router = APIRouter()

    @router.get(P.RELAY_PATH)
    async def relay_info() -> P.RelayInfo:
        return relay.info() if relay is not None else P.RelayInfo(scheduler_url=None, interval_s=interval_s)

    if relay is not None:
        @router.post(P.RELAY_HEARTBEAT_PATH)
        async def relay_heartbeat(job: P.JobName, worker_id: P.WorkerId, request: Request) -> Response:
            try:
                beat = P.RelayedHeartbeat.model_validate_json(await request.body())
            except ValidationError as exc:
                raise InvalidInput(f"bad heartbeat: {exc.errors()[0].get('msg')}") from None
            status, body = await relay.beat(job, worker_id, request.headers.get("authorization"), beat)
            return Response(body, status_code=status, media_type="application/json")

        @router.post(P.RELAY_REPORT_PATH)
        async def relay_report(job: P.JobName, worker_id: P.WorkerId, request: Request) -> Response:
            try:
                relayed = P.RelayedReport.model_validate_json(await request.body())
            except ValidationError as exc:
                raise InvalidInput(f"bad report: {exc.errors()[0].get('msg')}") from None
            if relayed.worker_id != worker_id:
                raise InvalidInput(f"the report of worker {relayed.worker_id} was posted for worker {worker_id}")
            status, body = await relay.report(job, request.headers.get("authorization"), relayed)
            return Response(body, status_code=status, media_type="application/json")

        @router.get(P.RELAY_PTC_PATH)
        async def relay_ptc(job: P.JobName, request: Request, generation: Annotated[int, Query(ge=0, le=1 << 30)],
                            scheduler_url: Annotated[str, Query(min_length=1, max_length=2048)],
                            digest: Annotated[str | None, Query(min_length=1, max_length=64)] = None) -> Response:
            if scheduler_url.rstrip("/") != relay.scheduler_url:
                raise Conflict(f"this node daemon relays for {relay.scheduler_url}, not for {scheduler_url}")
            ptc = await relay.ptc.get(job, generation, request.headers.get("authorization"), digest)
            if ptc.gzipped and "gzip" in request.headers.get("accept-encoding", ""):
                return Response(ptc.body, media_type="application/json", headers={"Content-Encoding": "gzip"})
            return Response(await asyncio.to_thread(ptc.json_bytes), media_type="application/json")

    return router
