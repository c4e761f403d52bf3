"""The worker's side of the scheduler protocol: register, heartbeat, reports, stop requests.

The bodies are the pydantic models of :mod:`tenplex.core.protocol`, so the
client and the scheduler cannot disagree about them. Transport is urllib3 with
the retry policy and error decoding of :mod:`tenplex.core.http`.

Heartbeats go through the worker's node daemon when it relays for this
worker's scheduler (:mod:`tenplex.node.relay`: one report per node and
interval reaches the scheduler, not one per worker); the worker asks its
daemon once, and heartbeats the scheduler itself when the daemon relays for
none or another scheduler, or cannot be reached. Snapshot and exit reports
go the same way (falling back to the scheduler when the daemon fails them). The generation's PTC comes
through the same daemon (fetched from the scheduler once per node, not once
per worker), on the same condition.

Stopping has to be collective: every rank of a job must finish the same step,
snapshot it, and exit, or the ranks that go on would hang in their next
collective. Each rank learns ``stop_at_step`` on its own (from its assignment
and its heartbeats), so :func:`agree_stop` takes the minimum over all ranks
with one tiny all-reduce per step; all ranks then stop after the same step.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import urllib3
from pydantic import BaseModel, ValidationError
from urllib3.exceptions import MaxRetryError

from tenplex.core import protocol as p
from tenplex.core.http import GATEWAY_STATUSES, error_from, pool, retry_policy
from tenplex.core.tls import client_context
from tenplex.errors import InvalidInput, SchedulerUnavailable, TenplexError
from tenplex.ptc import PTC

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class ControlClient:
    """REST client of one worker: ``ControlClient(url, job, worker_id, token)`` or :meth:`from_env`.

    Calls retry connection failures and 502/503/504 answers with exponential
    back-off (a scheduler restart must not kill the job); any other error
    answer is raised as the :class:`~tenplex.errors.TenplexError` subclass
    whose ``code`` the scheduler sent.
    """

    base_url: str
    job: str
    worker_id: str
    token: str | None = None
    timeout_s: float = 10.0
    retries: int = 5
    backoff_s: float = 0.2

    def __post_init__(self) -> None:
        parsed = urllib.parse.urlsplit(self.base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise InvalidInput(f"scheduler URL must be http(s)://host[:port], got {self.base_url!r}")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))
        # Validate the names here, not at the first request, so a bad launch fails at once.
        try:
            p.RegisterRequest(worker_id=self.worker_id)
        except ValidationError as exc:
            raise InvalidInput(f"worker id {self.worker_id!r} is invalid: {_first_error(exc)}") from None
        if not _matches(p.JOB_NAME_PATTERN, self.job):
            raise InvalidInput(f"job name {self.job!r} is not a DNS-1123 label (lower case, digits, '-')")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ControlClient:
        """The client for a worker the scheduler launched (``TENPLEX_*`` variables)."""
        env = os.environ if environ is None else environ
        missing = [k for k in (p.ENV_SCHEDULER_URL, p.ENV_JOB, p.ENV_WORKER_ID) if not env.get(k)]
        if missing:
            raise InvalidInput(f"not launched by a Tenplex scheduler: {', '.join(missing)} not set")
        return cls(
            base_url=env[p.ENV_SCHEDULER_URL],
            job=env[p.ENV_JOB],
            worker_id=env[p.ENV_WORKER_ID],
            token=env.get(p.ENV_TOKEN) or None,
        )

    # -- calls -----------------------------------------------------------------------

    def register(self, host: str | None = None, rank: int | None = None) -> p.Assignment:
        body = p.RegisterRequest(worker_id=self.worker_id, host=host, pid=os.getpid(), rank=rank)
        return self._call("POST", p.REGISTER_PATH, body, p.Assignment)

    def assignment(self) -> p.Assignment:
        return self._call("GET", p.ASSIGNMENT_PATH, None, p.Assignment)

    def heartbeat(self, generation: int, step: int, loss: float | None = None,
                  marks: dict[str, float] | None = None, *, relay: tuple[str, str] | None = None) -> p.HeartbeatReply:
        """One heartbeat, to the scheduler or, with ``relay`` (the node daemon's URL, this worker's host), through
        the node daemon, which answers what the scheduler answered for this worker."""
        if loss is not None and not math.isfinite(loss):
            loss = None  # JSON has no NaN; the scheduler learns of it from the worker's exit instead
        if relay is not None:
            node_url, host = relay
            relayed = p.RelayedHeartbeat(generation=generation, step=step, loss=loss, marks=marks or None,
                                         scheduler_url=self.base_url, host=host)
            return self._call("POST", p.RELAY_HEARTBEAT_PATH, relayed, p.HeartbeatReply, base=node_url.rstrip("/"),
                              retries=1)
        body = p.HeartbeatRequest(generation=generation, step=step, loss=loss, marks=marks or None)
        return self._call("POST", p.HEARTBEAT_PATH, body, p.HeartbeatReply)

    def relays_for_me(self, node_url: str) -> bool:
        """Whether the node daemon at ``node_url`` relays heartbeats to this worker's scheduler (False also when it
        cannot be reached or predates relays: heartbeat the scheduler then)."""
        try:
            info = self._call("GET", p.RELAY_PATH, None, p.RelayInfo, base=node_url.rstrip("/"), retries=2)
        except TenplexError as exc:
            log.info("node daemon at %s does not relay heartbeats (%s): heartbeating the scheduler", node_url, exc.detail)
            return False
        if info.scheduler_url is None or info.scheduler_url.rstrip("/") != self.base_url:
            log.info("node daemon at %s relays heartbeats to %s, not to %s: heartbeating the scheduler",
                     node_url, info.scheduler_url, self.base_url)
            return False
        return True

    def report_snapshot(self, report: p.SnapshotReport, *, relay: tuple[str, str] | None = None) -> None:
        """Report a snapshot written, through the node daemon with ``relay`` (as :meth:`report_exit`)."""
        self._report(p.SNAPSHOT_PATH, report, p.NodeReport(worker_id=self.worker_id, snapshot=report), relay, None)

    def report_peer_failure(self, generation: int, detail: str, step: int | None = None) -> None:
        body = p.PeerFailureReport(generation=generation, step=step, detail=detail[:4000] or "unknown")
        self._call("POST", p.PEER_FAILURE_PATH, body, p.Ack, retries=1)

    def report_exit(
        self, generation: int, step: int, status: str, exit_code: int, detail: str | None = None,
        marks: dict[str, float] | None = None, *, relay: tuple[str, str] | None = None,
    ) -> None:
        """Report the exit: to the scheduler or, with ``relay`` (the node daemon's URL, this worker's host),
        through the daemon, which sends its node's reports in one batch; a report the daemon did not deliver (it
        answered a failure, or none) goes to the scheduler itself, so it is never lost."""
        body = p.ExitReport(
            generation=generation,
            step=step,
            status=status,  # type: ignore[arg-type]
            exit_code=exit_code,
            detail=None if detail is None else detail[:4000],
            marks=marks or None,
        )
        self._report(p.EXIT_PATH, body, p.NodeReport(worker_id=self.worker_id, exit=body), relay, 1)

    def _report(self, path: str, body: BaseModel, report: p.NodeReport, relay: tuple[str, str] | None,
                retries: int | None) -> None:
        if relay is not None:
            node_url, host = relay
            relayed = p.RelayedReport(**dict(report), scheduler_url=self.base_url, host=host)
            try:
                self._call("POST", p.RELAY_REPORT_PATH, relayed, p.Ack, base=node_url.rstrip("/"), retries=1)
                return
            except TenplexError as exc:
                # Another error of the report's own comes back from the scheduler itself just the same.
                log.warning("report through the node daemon failed (%s): sending it to the scheduler", exc.detail)
        self._call("POST", path, body, p.Ack, retries=retries)

    def fetch_ptc(self, assignment: p.Assignment, node_url: str | None = None) -> PTC:
        """The PTC of an assignment: inline, or fetched from ``ptc_url``.

        With ``node_url`` (the node daemon's) it comes through the daemon when the daemon relays for this worker's
        scheduler (:data:`~tenplex.core.protocol.RELAY_PTC_PATH`: the daemon fetches it once for the node's
        workers), else, or when that fails, from ``ptc_url`` itself, which answers an error of the worker's own
        (an unknown generation, a refused credential) as it is."""
        if assignment.ptc is not None:
            return PTC.from_json(assignment.ptc)
        assert assignment.ptc_url is not None  # the model guarantees one of them
        if node_url is not None and self.relays_for_me(node_url):
            digest = urllib.parse.parse_qs(urllib.parse.urlsplit(assignment.ptc_url).query).get("digest")
            query = urllib.parse.urlencode({"generation": assignment.generation, "scheduler_url": self.base_url,
                                            **({"digest": digest[0]} if digest else {})})
            path = p.RELAY_PTC_PATH.format(job=urllib.parse.quote(self.job, safe=""))
            try:
                return PTC.loads(self._request("GET", f"{node_url.rstrip('/')}{path}?{query}", None, 1,
                                               accept_gzip=True))
            except TenplexError as exc:
                log.warning("fetching the PTC through the node daemon failed (%s): fetching it from the scheduler",
                            exc.detail)
        url = urllib.parse.urljoin(self.base_url + "/", assignment.ptc_url)
        raw = self._request("GET", url, None, self.retries, accept_gzip=True)
        return PTC.loads(raw)

    # -- transport -----------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path_template: str,
        body: BaseModel | None,
        reply: type[M],
        retries: int | None = None,
        base: str | None = None,
    ) -> M:
        path = path_template.format(
            job=urllib.parse.quote(self.job, safe=""),
            worker_id=urllib.parse.quote(self.worker_id, safe=""),
        )
        data = None if body is None else body.model_dump_json().encode()
        raw = self._request(method, (base or self.base_url) + path, data, self.retries if retries is None else retries)
        try:
            return reply.model_validate_json(raw)
        except ValidationError as exc:
            raise SchedulerUnavailable(
                f"{method} {path}: the scheduler's reply is not a valid {reply.__name__}: {_first_error(exc)}"
            ) from None

    def _request(self, method: str, url: str, data: bytes | None, retries: int, *, accept_gzip: bool = False) -> bytes:
        """The body of a 2xx answer, tried again on 502-504 and connection errors (:mod:`tenplex.core.http`'s
        policy); ``accept_gzip``: the answer may be gzipped (the PTC is: it is large and every worker fetches
        it), and is returned decompressed."""
        headers = {"Accept": "application/json"}
        if accept_gzip:
            headers["Accept-Encoding"] = "gzip"
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            resp = pool(client_context()).request(method, url, body=data, headers=headers, timeout=self.timeout_s,
                                                   retries=retry_policy(retries, self.backoff_s))
        except MaxRetryError as exc:
            raise SchedulerUnavailable(f"{method} {url} failed after {retries + 1} attempts: {exc.reason}") from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise SchedulerUnavailable(f"{method} {url} failed: {exc}") from None
        if resp.status in GATEWAY_STATUSES:  # still, after the last try
            raise SchedulerUnavailable(f"{method} {url} failed after {retries + 1} attempts: HTTP {resp.status}")
        if resp.status >= 400:
            raise error_from(resp.status, resp.data, f"{method} {url}: HTTP {resp.status}", SchedulerUnavailable)
        return resp.data


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(x) for x in err.get("loc", ())) or "body"
    return f"{where}: {err.get('msg')}"


def _matches(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text) is not None


# -- heartbeats and stop requests -------------------------------------------------------------


RELAYED_CLOSE_WAIT_S = 0.1
"""How long closing the heartbeats waits for a beat in flight through the node daemon."""


class Heartbeat:
    """Background heartbeats: the loop calls :meth:`update` after each step, never blocks.

    The thread sends the latest step every ``interval_s`` and records what the
    scheduler answers: :attr:`stop_at_step` (finish that step, snapshot, exit)
    and :attr:`abort` (``action="stop"``: exit at once). A scheduler that is
    briefly unreachable is logged, not fatal: training goes on.

    With ``node`` (the node daemon's URL and this worker's host) the beats go
    through the daemon when it relays for this worker's scheduler (asked at
    the first beat, and again after a relayed beat failed, which is sent to
    the scheduler itself), else straight to the scheduler.
    """

    def __init__(
        self, client: ControlClient, generation: int, interval_s: float, stop_at_step: int | None = None,
        node: tuple[str, str] | None = None,
    ) -> None:
        self._client = client
        self._node = node
        self._relay: tuple[str, str] | None = None
        self._asked = node is None
        self._generation = generation
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._step = 0
        self._loss: float | None = None
        self._stop_at: int | None = stop_at_step
        self._abort = False
        self._marks: dict[str, float] = {}
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tenplex-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def update(self, step: int, loss: float | None = None) -> None:
        with self._lock:
            self._step, self._loss = step, loss

    def mark(self, name: str, when: float | None = None) -> None:
        """Milestone ``name`` (:data:`~tenplex.core.protocol.WORKER_MARKS`) reached now (or at ``when``);
        it goes with the next heartbeat."""
        with self._lock:
            self._marks[name] = time.time() if when is None else when

    def take_marks(self) -> dict[str, float]:
        """The milestones not yet sent (for the exit report, once the heartbeats have stopped)."""
        with self._lock:
            marks, self._marks = self._marks, {}
            return marks

    @property
    def relayed(self) -> bool:
        """Whether the beats go through the node daemon (known after the first beat)."""
        return self._relay is not None

    @property
    def relay(self) -> tuple[str, str] | None:
        """The node daemon's URL and this worker's host when the beats go through it (the reports do too)."""
        return self._relay

    @property
    def stop_at_step(self) -> int | None:
        with self._lock:
            return self._stop_at

    @property
    def abort(self) -> bool:
        with self._lock:
            return self._abort

    def beat_now(self) -> None:
        """Send one heartbeat from the caller's thread (used at start and in tests)."""
        self._beat()

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        if self._thread.is_alive():
            # A beat through the node daemon waits for the daemon's next batch (up to its interval), which the
            # daemon sends whether or not this worker still waits: an exiting worker does not wait for it.
            self._thread.join(timeout=RELAYED_CLOSE_WAIT_S if self._relay is not None else self._client.timeout_s + 1)

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self._interval_s)
            if self._closed.is_set():
                return
            try:
                self._beat()
            except TenplexError as exc:
                log.warning("heartbeat failed: %s", exc.detail)

    def _beat(self) -> None:
        with self._lock:
            step, loss = self._step, self._loss
        marks = self.take_marks()
        if not self._asked:
            assert self._node is not None
            self._relay = self._node if self._client.relays_for_me(self._node[0]) else None
            self._asked = True
        try:
            try:
                reply = self._client.heartbeat(self._generation, step, loss, marks, relay=self._relay)
            except TenplexError as exc:
                if self._relay is None:
                    raise
                # The daemon may be gone, restarted for another scheduler, or cut off from this one: this beat
                # goes to the scheduler itself (which also answers an error of the worker's own as it is),
                # and the next one asks the daemon again.
                log.warning("heartbeat through the node daemon failed (%s): sending it to the scheduler", exc.detail)
                self._relay, self._asked = None, False
                reply = self._client.heartbeat(self._generation, step, loss, marks)
        except BaseException:
            with self._lock:  # sent with the next one
                self._marks = {**marks, **self._marks}
            raise
        with self._lock:
            if reply.generation != self._generation:
                log.warning(
                    "scheduler is at generation %d, this worker at %d: stopping", reply.generation, self._generation
                )
                self._abort = True
            if reply.action == "stop":
                self._abort = True
            if reply.stop_at_step is not None and (self._stop_at is None or reply.stop_at_step < self._stop_at):
                log.info("scheduler asks to stop after step %d", reply.stop_at_step)
                self._stop_at = reply.stop_at_step


_NO_STOP = 2**62


def agree_stop(step: int, local_stop_at: int | None, local_abort: bool = False, group: Any = None) -> tuple[bool, bool]:
    """Collectively decide, after completing ``step``, whether to stop: ``(stop, abort)``.

    One all-reduce (MIN) of two int64s over ``group`` (default: the world)
    makes the earliest stop request any rank has heard of binding for all, so
    every rank snapshots the same step. ``stop`` is true when that request is
    at or before ``step``; ``abort`` when any rank was told to exit at once.
    Without an initialized process group the local values decide.
    """
    import torch
    import torch.distributed as dist

    stop_at = _NO_STOP if local_stop_at is None else local_stop_at
    values = torch.tensor([stop_at, 0 if local_abort else 1], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
    agreed_stop, not_abort = (int(v) for v in values.tolist())
    return agreed_stop <= step, not_abort == 0
