"""Simulated workers: a thousand ranks that speak the real worker protocol, without torch.

For measuring the control plane at scale (``benchmarks/control_plane.py``) on
one machine. An *agent* process (:func:`run_agent`) runs every rank of every
job it is given as asyncio tasks, the way a node agent (a kubelet) runs pods.
Each rank does, over real HTTP, what :class:`tenplex.worker.ElasticWorker`
does: registers (``RegisterRequest`` -> ``Assignment``), gets the PTC when it
is not inline (through its node daemon, which fetches ``ptc_url`` once per
host and generation, :class:`tenplex.node.relay.PtcCache`), checks that the
version it is to restore is committed in its host's store, heartbeats every ``heartbeat_interval_s`` with
its step (as the node daemons relay them: one batch per host and interval,
:data:`~tenplex.core.protocol.NODE_HEARTBEATS_PATH`), obeys the stop step
that a heartbeat reply or its assignment carries, snapshots that step into its host's store (the real store, on the
node daemon's root, the shards the PTC gives it: a shard held by several
devices of a host is written by the lowest of them; the last writer of a host
commits), reports the snapshot and its exit (as the node daemons relay them: the reports of a host's ranks that
come within :data:`tenplex.node.relay.REPORT_WINDOW_S` as one batch, :data:`~tenplex.core.protocol.NODE_REPORTS_PATH`;
a batch that fails is sent rank by rank, as workers then report directly). The ranks of a job generation
train in lockstep (one simulated step every ``step_seconds``), as SPMD
training does, and agree on the earliest stop step any of them heard of (the
all-reduce of :func:`tenplex.worker.control.agree_stop`). Shards hold zeros:
what a benchmark of the control plane needs is their number, not their bytes.

The scheduler side is :class:`SimulatedWorkersBackend`, a local backend (real
hosts: node daemons described by a hosts file) whose ``launch``/``stop``/
``exited`` go to the agent. :func:`simulated_scheduler` builds a scheduler on
it: ``tenplex scheduler serve --backend tenplex.testing.simworkers:simulated_scheduler
--hosts-file HOSTS.json`` with ``TENPLEX_SIM_AGENT`` set to the agent's URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import http.client
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from fastapi import FastAPI

from tenplex.core import protocol as P
from tenplex.core.version import Version
from tenplex.errors import InvalidConfig, TenplexError
from tenplex.node.relay import REPORT_WINDOW_S
from tenplex.ptc import PTC, Region, dtypes
from tenplex.scheduler.backend import LocalBackend, LocalCluster, WorkerLaunch
from tenplex.scheduler.controller import SchedulerSettings
from tenplex.scheduler.server import local_cluster
from tenplex.scheduler.service import Scheduler, SchedulerOptions
from tenplex.scheduler.state import StateDir
from tenplex.serving import BackgroundServer
from tenplex.store.local import LocalStore
from tenplex.testing.simnodes import SimNodes

log = logging.getLogger(__name__)

ENV_AGENT = "TENPLEX_SIM_AGENT"
COMMIT_WAIT_S = 600.0
"""How long a rank waits for its version to be committed on its host (the real worker's wait, shorter)."""
COMMIT_POLL_S = 0.05
"""The agent's URL, for :func:`simulated_scheduler`."""
EXIT_CANCELLED = -15
"""The exit code of a rank the backend stopped (as a process killed by SIGTERM reads)."""
EXIT_KILLED = -9
"""The exit code of a rank whose host was lost (:meth:`Agent.kill_host`; as a process killed by SIGKILL reads)."""


# -- the scheduler's side -------------------------------------------------------------------


class AgentClient:
    """JSON calls to a simulated-worker agent at ``url`` (``http://HOST:PORT``): the scheduler's backend here and
    the simulated kubelets (:mod:`tenplex.testing.k8s.simkubelet`) launch, stop and follow its ranks through it."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if not parts.hostname or not parts.port:
            raise InvalidConfig(f"the simulated-worker agent's URL must be http://HOST:PORT, got {url!r}")
        self.addr = (parts.hostname, parts.port)

    def call(self, method: str, path: str, body: Any = None, timeout: float = 60.0) -> Any:
        conn = http.client.HTTPConnection(*self.addr, timeout=timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
            resp = conn.getresponse()
            raw = resp.read()
            if resp.status != 200:
                raise TenplexError(f"simulated-worker agent: {method} {path}: HTTP {resp.status}: {raw[:300]!r}")
            return json.loads(raw)
        except OSError as exc:
            raise TenplexError(f"simulated-worker agent at {self.addr[0]}:{self.addr[1]} unreachable: {exc}") from exc
        finally:
            conn.close()


class SimulatedWorkersBackend(LocalBackend):
    """The local backend's hosts; its workers are ranks of a simulated-worker agent.

    Exits are pushed: a thread follows the agent's exit events, so ``exited``
    is a lookup, as polling local processes is for the local backend.
    """

    name = "simulated"

    def __init__(self, cluster: LocalCluster, agent_url: str, *, host_timeout: float | None = 10.0) -> None:
        super().__init__(cluster, host_timeout=host_timeout)
        self.agent = AgentClient(agent_url)
        self._launched: set[tuple[str, str]] = set()
        self._exits: dict[tuple[str, str], int] = {}
        self._seen = 0
        self._closing = threading.Event()
        self._follower = threading.Thread(target=self._follow, name="sim-agent-exits", daemon=True)
        self._follower.start()

    def _follow(self) -> None:
        while not self._closing.is_set():
            try:
                events = self.agent.call("GET", f"/exits?after={self._seen}&wait=1.0", timeout=10.0)
            except TenplexError as exc:
                log.warning("%s", exc)
                self._closing.wait(0.5)
                continue
            with self._lock:
                for job, wid, code in events["exits"]:
                    self._exits[(job, wid)] = code
                self._seen = events["next"]

    def launch(self, job: str, command: Sequence[str], workers: Sequence[WorkerLaunch],
               log_dir: Path) -> dict[str, int | None]:
        body = {"job": job, "workers": [
            {"worker_id": w.worker_id, "rank": w.rank, "host": w.host, "local_rank": w.local_rank, "env": dict(w.env),
             "store_root": str(self.cluster.store_root(w.host) or "")} for w in workers]}
        pid = self.agent.call("POST", "/launch", body)["pid"]
        with self._lock:
            for w in workers:
                self._launched.add((job, w.worker_id))
                self._exits.pop((job, w.worker_id), None)
        log.info("job %s: %d simulated workers launched in agent pid %d", job, len(workers), pid)
        return {w.worker_id: pid for w in workers}

    def adopt(self, job: str, pids: Mapping[str, int]) -> None:
        with self._lock:
            self._launched.update((job, wid) for wid in pids)

    def stop(self, job: str, worker_ids: Sequence[str], *, grace: float = 10.0) -> None:
        if not worker_ids:
            return
        self.agent.call("POST", "/stop", {"job": job, "worker_ids": list(worker_ids)})
        deadline = time.monotonic() + grace + 5
        while time.monotonic() < deadline:
            with self._lock:
                if all((job, w) in self._exits or (job, w) not in self._launched for w in worker_ids):
                    return
            time.sleep(0.02)

    def exited(self, job: str, worker_ids: Sequence[str]) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        with self._lock:
            for wid in worker_ids:
                key = (job, wid)
                if key in self._exits:
                    out[wid] = self._exits[key]
                elif key not in self._launched:
                    out[wid] = None
        return out

    def close(self) -> None:
        self._closing.set()
        super().close()


def simulated_scheduler(options: SchedulerOptions) -> Scheduler:
    """A scheduler whose workers are the simulated ranks of the agent at ``$TENPLEX_SIM_AGENT``, on the hosts of
    ``options.hosts_file`` (node daemons running elsewhere)."""
    agent = os.environ.get(ENV_AGENT)
    if not agent:
        raise InvalidConfig(f"the simulated backend needs {ENV_AGENT}: the URL of a simulated-worker agent")
    if options.hosts_file is None:
        raise InvalidConfig("the simulated backend takes its hosts from a hosts file (--hosts-file)")
    state_dir = Path(options.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    cluster = local_cluster(state_dir, options.hosts, options.gpus_per_host, options.token, options.hosts_file)
    backend = SimulatedWorkersBackend(cluster, agent, host_timeout=options.host_timeout)
    settings = SchedulerSettings(url=options.url, token=options.token, heartbeat_interval=options.heartbeat_interval)
    return Scheduler(backend, StateDir(state_dir), settings)


# -- the agent ------------------------------------------------------------------------------------


@dataclass
class _Rank:
    worker_id: str
    rank: int
    host: str
    env: Mapping[str, str]
    store_root: str
    assignment: P.Assignment | None = None
    task: asyncio.Task[int] | None = None
    killed: bool = False
    """Its host was lost: it ends as a process killed with its node does."""


@dataclass
class _Generation:
    """The ranks of one job generation that this agent runs, training in lockstep."""

    job: str
    generation: int
    ranks: dict[str, _Rank]
    world: int | None = None
    """Ranks of the generation (``WORLD_SIZE``; None: those of its one launch)."""
    step: int = 0
    stop_at: int | None = None
    abort: bool = False
    ptc: PTC | None = None
    parsing: asyncio.Lock = field(default_factory=asyncio.Lock)
    assigned: int = 0
    fetched: int = 0
    registered: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    snapshot: asyncio.Task[dict[str, bool]] | None = None
    finished: int = 0
    restore_checks: dict[str, asyncio.Future[Any]] = field(default_factory=dict)
    relays: dict[str, list[_Rank]] = field(default_factory=dict)
    """Host -> its registered ranks, whose heartbeats one task per host sends as the host's batch."""
    ptc_fetches: dict[str, asyncio.Future[tuple[bytes, str]]] = field(default_factory=dict)
    """Host -> its node daemon's fetch of the generation's PTC, which the host's ranks share."""
    report_batches: dict[str, tuple[list[P.NodeReport], asyncio.Future[dict[int, P.ErrorBody]]]] = field(
        default_factory=dict)
    """Host -> the reports its node daemon gathers for its next batch, and that batch's answer (its errors)."""
    report_sends: set[asyncio.Task[None]] = field(default_factory=set)
    """The batches being sent (held here: the event loop keeps only a weak reference to a task)."""
    timeline: dict[str, float] = field(default_factory=dict)
    """Wall-clock times of what the generation went through (launched, registered, stop_heard, ...)."""


class Agent:
    """Runs simulated ranks; see the module docstring. Counts what it sends, for the benchmark's report."""

    def __init__(self, *, step_seconds: float = 0.2, store_threads: int = 8, durable_writes: bool = False,
                 nodes: SimNodes | None = None) -> None:
        self.step_seconds = step_seconds
        self.nodes = nodes
        """Simulated node agents (:mod:`tenplex.testing.simnodes`) in this process: the ranks commit their
        snapshots there and check their restore there, instead of in a real store (None: real stores)."""
        self.durable_writes = durable_writes
        self.generations: dict[tuple[str, int], _Generation] = {}
        self.exits: list[tuple[str, str, int]] = []
        self._exit_cond = asyncio.Condition()
        self._stores: dict[str, LocalStore] = {}
        self._io = ThreadPoolExecutor(max_workers=store_threads, thread_name_prefix="sim-store")
        self._client: _Http | None = None
        self._replies: dict[bytes, P.NodeHeartbeatsReply] = {}
        self.counts: dict[str, int] = {"register": 0, "ptc": 0, "ptc_relayed": 0, "heartbeat": 0, "node_report": 0,
                                       "snapshot": 0, "exit": 0, "report_batch": 0, "shards_written": 0}

    def client(self, url: str) -> _Http:
        if self._client is None:
            self._client = _Http(url)
        return self._client

    def store(self, root: str) -> LocalStore:
        s = self._stores.get(root)
        if s is None:
            s = self._stores[root] = LocalStore(root, durable=self.durable_writes)
        return s

    # -- requests from the backend ------------------------------------------------------------

    def launch(self, job: str, workers: Sequence[Mapping[str, Any]]) -> None:
        by_generation: dict[int, list[_Rank]] = {}
        for w in workers:
            gen = int(w["env"][P.ENV_GENERATION])
            by_generation.setdefault(gen, []).append(
                _Rank(w["worker_id"], int(w["rank"]), w["host"], dict(w["env"]), w["store_root"]))
        for gen, ranks in by_generation.items():
            # A generation comes in one launch (the local backends) or pod by pod (a kubelet per node, see
            # tenplex.testing.k8s.simkubelet): its ranks train in lockstep once all of its world has registered.
            g = self.generations.get((job, gen))
            if g is None or g.done.is_set():
                g = _Generation(job, gen, {}, world=int(ranks[0].env.get(P.ENV_WORLD_SIZE, 0)) or None)
                g.timeline["launched"] = time.time()
                self.generations[(job, gen)] = g
                asyncio.get_running_loop().create_task(self._train(g))
            for r in ranks:
                g.ranks[r.worker_id] = r
                r.task = asyncio.get_running_loop().create_task(self._run_rank(g, r))

    def stop(self, job: str, worker_ids: Sequence[str]) -> None:
        wanted = set(worker_ids)
        for (j, _), g in self.generations.items():
            if j != job:
                continue
            for wid, r in g.ranks.items():
                if wid in wanted and r.task is not None and not r.task.done():
                    r.task.cancel()

    def kill_host(self, host: str) -> int:
        """Lose ``host``: its node agent stops answering and every rank on it ends as killed; how many ended."""
        if self.nodes is None:
            raise InvalidConfig("this agent runs no simulated nodes: there is no host to kill")
        self.nodes.kill(host)
        killed = 0
        for g in self.generations.values():
            for r in g.ranks.values():
                if r.host == host and r.task is not None and not r.task.done():
                    r.killed = True
                    r.task.cancel()
                    killed += 1
        return killed

    async def exits_after(self, after: int, wait: float) -> dict[str, Any]:
        async with self._exit_cond:
            if len(self.exits) <= after:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._exit_cond.wait(), timeout=wait)
            return {"exits": [list(e) for e in self.exits[after:]], "next": len(self.exits)}

    async def _exited(self, job: str, worker_id: str, code: int) -> None:
        async with self._exit_cond:
            self.exits.append((job, worker_id, code))
            self._exit_cond.notify_all()

    # -- one rank -----------------------------------------------------------------------------------

    async def _scheduler_post(self, env: Mapping[str, str], path: str, body: bytes, what: str, kind: str) -> bytes:
        """POST to the scheduler as ``env``'s worker would, retrying a refused connection or a 502-504 with
        back-off; the answer's body, counted under ``kind``."""
        client = self.client(env[P.ENV_SCHEDULER_URL])
        for attempt in range(20):
            try:
                status, raw, _ = await client.request("POST", path, body, env.get(P.ENV_TOKEN))
            except OSError as exc:
                log.warning("%s: %s (retrying)", what, exc)
                await asyncio.sleep(min(2.0, 0.1 * 2 ** attempt))
                continue
            if status in (502, 503, 504):
                await asyncio.sleep(min(2.0, 0.1 * 2 ** attempt))
                continue
            if status >= 400:
                raise TenplexError(f"{what}: HTTP {status}: {raw[:300]!r}")
            self.counts[kind] += 1
            return raw
        raise TenplexError(f"{what}: the scheduler did not answer")

    async def _post(self, r: _Rank, path: str, body: Any, kind: str) -> dict[str, Any]:
        raw = await self._scheduler_post(r.env, path.format(job=r.env[P.ENV_JOB], worker_id=r.worker_id),
                                         body.model_dump_json().encode(), f"{r.worker_id} {kind}", kind)
        return json.loads(raw)

    async def _run_rank(self, g: _Generation, r: _Rank) -> int:
        code = 0
        try:
            code = await self._rank(g, r)
        except asyncio.CancelledError:
            code = EXIT_KILLED if r.killed else EXIT_CANCELLED
        except Exception:
            log.exception("simulated rank %s failed", r.worker_id)
            code = P.EXIT_FAILED
        await self._exited(g.job, r.worker_id, code)
        return code

    async def _rank(self, g: _Generation, r: _Rank) -> int:
        reply = await self._post(r, P.REGISTER_PATH, P.RegisterRequest(
            worker_id=r.worker_id, host=r.host, pid=os.getpid(), rank=r.rank), "register")
        a = r.assignment = P.Assignment.model_validate(reply)
        g.assigned += 1
        if g.assigned == (g.world or len(g.ranks)):
            g.timeline["assigned"] = time.time()  # every rank has its assignment
        await self._fetch_ptc(g, r, a)
        g.fetched += 1
        if g.fetched == (g.world or len(g.ranks)):
            g.timeline["ptc_fetched"] = time.time()  # every rank has the PTC
        if a.restore_version is not None:
            await self._check_restorable(g, r, a.restore_version)
        g.step = max(g.step, Version.parse(a.restore_version).step if a.restore_version else 0)
        if a.stop_at_step is not None:
            g.stop_at = a.stop_at_step if g.stop_at is None else min(g.stop_at, a.stop_at_step)
        g.registered += 1
        if g.registered == (g.world or len(g.ranks)):
            g.timeline["registered"] = time.time()
            g.ready.set()
        relay = g.relays.get(r.host)
        beat = None
        if relay is None:
            relay = g.relays[r.host] = []
            beat = asyncio.get_running_loop().create_task(self._heartbeats(g, r.host, relay, a))
            beat.add_done_callback(_log_failure)
        relay.append(r)
        try:
            await g.done.wait()
        finally:
            if beat is not None:
                beat.cancel()
        status = "stopped" if g.stop_at is not None or g.abort else "completed"
        if g.snapshot is not None and not g.abort:
            committed = await g.snapshot
            version = f"s{g.step}-g{g.generation}"
            await self._report(g, r, P.NodeReport(worker_id=r.worker_id, snapshot=P.SnapshotReport(
                generation=g.generation, step=g.step, version=version, host=r.host,
                committed=committed.get(r.worker_id, False))))
        await self._report(g, r, P.NodeReport(worker_id=r.worker_id, exit=P.ExitReport(
            generation=g.generation, step=g.step, status=status, exit_code=0)))
        g.finished += 1
        if g.finished == (g.world or len(g.ranks)):
            g.timeline["reported"] = time.time()
        return 0

    async def _report(self, g: _Generation, r: _Rank, report: P.NodeReport) -> None:
        """A rank's snapshot or exit report as its node daemon relays it (:meth:`HeartbeatRelay.report`): in the
        batch of the host's reports that come within the window; sent by the rank itself when the batch failed."""
        pending = g.report_batches.get(r.host)
        if pending is None:
            pending = g.report_batches[r.host] = ([], asyncio.get_running_loop().create_future())
            send = asyncio.get_running_loop().create_task(self._send_reports(g, r, pending))
            g.report_sends.add(send)
            send.add_done_callback(g.report_sends.discard)
            send.add_done_callback(_log_failure)
        reports, answer = pending
        index = len(reports)
        reports.append(report)
        try:
            errors = await asyncio.shield(answer)
        except TenplexError as exc:
            log.warning("%s: the node's batch of reports failed (%s): reporting directly", r.worker_id, exc)
            kind = "exit" if report.exit is not None else "snapshot"
            await self._post(r, P.EXIT_PATH if report.exit is not None else P.SNAPSHOT_PATH,
                             report.exit or report.snapshot, kind)
            return
        if index in errors:
            raise TenplexError(f"{r.worker_id}: report refused: {errors[index].detail}")

    async def _send_reports(self, g: _Generation, r: _Rank,
                            pending: tuple[list[P.NodeReport], asyncio.Future[dict[int, P.ErrorBody]]]) -> None:
        reports, answer = pending
        await asyncio.sleep(REPORT_WINDOW_S)
        if g.report_batches.get(r.host) is pending:
            del g.report_batches[r.host]  # reports from now on go in the next batch
        try:
            raw = await self._scheduler_post(
                r.env, P.NODE_REPORTS_PATH.format(job=r.env[P.ENV_JOB], node=r.host),
                P.NodeReports(reports=reports).model_dump_json(exclude_none=True).encode(), f"{r.host} reports",
                "report_batch")
            errors = P.NodeReportsReply.model_validate_json(raw).errors
        except Exception as exc:
            answer.set_exception(exc if isinstance(exc, TenplexError) else TenplexError(str(exc)))
            return
        for report in reports:
            self.counts["exit" if report.exit is not None else "snapshot"] += 1
        answer.set_result(errors)

    async def _fetch_ptc(self, g: _Generation, r: _Rank, a: P.Assignment) -> None:
        """As real workers get it: through their node daemon (:class:`tenplex.node.relay.PtcCache`), which fetches
        it from the scheduler once per host and generation (gzipped) for the host's ranks; a failed fetch is not
        kept. The agent decompresses and parses once."""
        raw: bytes | None = None
        encoding = ""
        if a.ptc is None:
            assert a.ptc_url is not None
            fetch = g.ptc_fetches.get(r.host)
            if fetch is None or (fetch.done() and fetch.exception() is not None):
                fetch = g.ptc_fetches[r.host] = asyncio.ensure_future(self._scheduler_ptc(r, a.ptc_url))
            raw, encoding = await asyncio.shield(fetch)
            self.counts["ptc_relayed"] += 1
        async with g.parsing:
            if g.ptc is None:
                def parse() -> PTC:
                    if raw is None:
                        return PTC.from_json(a.ptc)
                    return PTC.loads(gzip.decompress(raw) if encoding == "gzip" else raw)

                g.ptc = await asyncio.get_running_loop().run_in_executor(self._io, parse)

    async def _scheduler_ptc(self, r: _Rank, ptc_url: str) -> tuple[bytes, str]:
        """The node daemon's GET of the PTC from the scheduler, with the rank's credential: (body, encoding)."""
        path = ptc_url
        if path.startswith("http"):
            path = "/" + path.split("://", 1)[1].split("/", 1)[1]
        status, raw, encoding = await self.client(r.env[P.ENV_SCHEDULER_URL]).request(
            "GET", path, None, r.env.get(P.ENV_TOKEN), accept_gzip=True)
        if status != 200:
            raise TenplexError(f"{r.host}: GET {path}: HTTP {status}: {raw[:300]!r}")
        self.counts["ptc"] += 1
        return raw, encoding

    async def _check_restorable(self, g: _Generation, r: _Rank, version: str) -> None:
        """Wait until the version to restore is committed in the rank's host store, as real workers do (they
        start while the daemons still build it); looked at by one poller per host."""
        key = r.host if self.nodes is not None else r.store_root
        check = g.restore_checks.get(key)
        if check is None:
            check = g.restore_checks[key] = asyncio.ensure_future(self._wait_committed(g.job, r, version))
        if not await check:
            raise TenplexError(f"{r.worker_id}: version {version} was not committed in {key} within "
                               f"{COMMIT_WAIT_S:.0f} s")

    async def _wait_committed(self, job: str, r: _Rank, version: str) -> bool:
        nodes = self.nodes
        store = self.store(r.store_root) if nodes is None else None
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + COMMIT_WAIT_S
        if nodes is not None:
            return await nodes.wait_committed(r.host, job, version, COMMIT_WAIT_S)
        while time.monotonic() < deadline:
            if await loop.run_in_executor(self._io, store.is_committed, job, version):  # type: ignore[union-attr]
                return True
            await asyncio.sleep(COMMIT_POLL_S)
        return False

    async def _heartbeats(self, g: _Generation, host: str, ranks: list[_Rank], a: P.Assignment) -> None:
        """The host's registered ranks' heartbeats as its node daemon relays them: one batch per interval."""
        interval = a.heartbeat_interval_s
        cached: tuple[int, str, str] | None = None
        # spread over the interval, as independent nodes are
        await asyncio.sleep(interval * (zlib.crc32(host.encode()) % 97) / 97)
        while not g.done.is_set():
            if self.nodes is not None and not self.nodes.node(host).alive:
                return  # the node is lost, and its relay with it
            if ranks:
                env = ranks[0].env
                n = len(ranks)
                if cached is None or cached[0] != n:
                    # the batch as NodeHeartbeats serializes it, the steps left to fill in: a pydantic model
                    # per node and second is most of this process's CPU at 2,048 nodes
                    ids = json.dumps([r.worker_id for r in ranks], separators=(",", ":"))
                    cached = (n, f'{{"workers":{ids},"generations":{json.dumps([g.generation] * n)},"steps":[',
                              f'],"ages":{json.dumps([0.0] * n)},"losses":{json.dumps([1.0] * n)}}}')
                body = f"{cached[1]}{','.join([str(g.step)] * n)}{cached[2]}".encode()
                reply = await self._node_report(env, host, body)
                self.counts["heartbeat"] += n
                if reply.errors:
                    raise TenplexError(f"{host}: heartbeats refused: {reply.errors}")
                assert reply.reply is not None
                if reply.reply.action == "stop":
                    g.abort = True
                    g.done.set()
                if reply.reply.stop_at_step is not None:
                    g.timeline.setdefault("stop_heard", time.time())
                    g.stop_at = reply.reply.stop_at_step if g.stop_at is None else min(g.stop_at, reply.reply.stop_at_step)
            await asyncio.sleep(interval)

    async def _node_report(self, env: Mapping[str, str], host: str, body: bytes) -> P.NodeHeartbeatsReply:
        """Post a node's batch (a :class:`~tenplex.core.protocol.NodeHeartbeats`); the scheduler's answer, parsed
        once per distinct answer (every node gets the job's same reply)."""
        path = P.NODE_HEARTBEATS_PATH.format(job=env[P.ENV_JOB], node=host)
        raw = await self._scheduler_post(env, path, body, f"{host} heartbeats", "node_report")
        reply = self._replies.get(raw)
        if reply is None:
            reply = P.NodeHeartbeatsReply.model_validate_json(raw)
            if len(self._replies) > 64:
                self._replies.clear()
            self._replies[raw] = reply
        return reply

    # -- lockstep training and the stop snapshot ---------------------------------------------------------

    async def _train(self, g: _Generation) -> None:
        await g.ready.wait()
        assert g.ptc is not None
        total = next(iter(g.ranks.values())).assignment.total_steps  # type: ignore[union-attr]
        while not g.done.is_set():
            await asyncio.sleep(self.step_seconds)
            if g.abort:
                break
            g.step += 1
            g.timeline.setdefault("first_step", time.time())
            if total is not None and g.step >= total:
                break
            if g.stop_at is not None and g.step >= g.stop_at:
                g.timeline["stop_step"] = time.time()
                g.snapshot = asyncio.get_running_loop().create_task(self._snapshot(g))
                await g.snapshot
                g.timeline["snapshot_written"] = time.time()
                break
        g.done.set()

    async def _snapshot(self, g: _Generation) -> dict[str, bool]:
        """Write every rank's shards of step ``g.step`` into its host's store; per host, the last writer commits."""
        assert g.ptc is not None
        version = Version(g.step, g.generation)
        ptc = g.ptc
        rank_of = {r.rank: r for r in g.ranks.values()}
        if self.nodes is not None:
            # Simulated nodes hold no bytes: every host of the generation commits the version, its highest rank
            # reporting the commit, as the last writer of a real host does. (Counting each host's shards is a
            # pass over every shard's devices: 2.7 million at 16,384 GPUs, over a minute of this process's CPU.)
            writer: dict[str, int] = {}
            for r in g.ranks.values():
                writer[r.host] = max(writer.get(r.host, -1), r.rank)
            for h in writer:
                self.nodes.commit(h, g.job, str(version), 0)
            return {rank_of[d].worker_id: True for d in writer.values()}
        host_of = {d.id: d.host for d in ptc.devices}

        def shards_of_hosts() -> tuple[dict[str, list[tuple[str, Region, str, tuple[int, ...]]]], dict[str, int]]:
            per_host: dict[str, list[tuple[str, Region, str, tuple[int, ...]]]] = {}
            writer_of_host: dict[str, int] = {}
            for t in ptc.tensors:
                for s in t.shards:
                    seen: dict[str, int] = {}
                    for d in s.devices:
                        h = host_of[d]
                        seen[h] = min(d, seen.get(h, d))
                    for h, d in seen.items():
                        if d in rank_of:
                            per_host.setdefault(h, []).append((t.name, s.region, t.dtype, t.shape))
                            writer_of_host[h] = max(writer_of_host.get(h, -1), d)
            return per_host, writer_of_host

        # a pass over every shard's devices (millions at 16,384 GPUs): off the event loop, which serves the nodes
        per_host, writer_of_host = await asyncio.get_running_loop().run_in_executor(self._io, shards_of_hosts)
        loop = asyncio.get_running_loop()

        def write_host(host: str) -> None:
            root = rank_of[writer_of_host[host]].store_root
            store = self.store(root)
            for name, region, dtype, shape in per_host[host]:
                store.write_shard(g.job, version, name, region, np.zeros(region.shape, dtype=dtypes.storage_dtype(dtype)),
                                  dtype=dtype, global_shape=shape)
            store.commit(g.job, version)

        await asyncio.gather(*(loop.run_in_executor(self._io, write_host, h) for h in per_host))
        self.counts["shards_written"] += sum(len(v) for v in per_host.values())
        committed = {rank_of[d].worker_id: True for d in writer_of_host.values()}
        return committed


def _log_failure(task: asyncio.Task[Any]) -> None:
    """A background task's failure is logged when it ends (not when the task is collected, if ever)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("simulated task %s failed: %r", task.get_name(), task.exception())


class _Http:
    """A pool of keep-alive HTTP/1.1 connections to one server, for a thousand simulated ranks in one process.

    A general client (httpx) spends more CPU per request than the scheduler
    does answering it; the agent shares two cores with the scheduler it
    measures, so it sends requests with plain asyncio streams: requests with
    a body and Content-Length, answers with Content-Length (uvicorn's).
    """

    def __init__(self, url: str, connections: int = 32) -> None:
        parts = urlsplit(url)
        if not parts.hostname or not parts.port:
            raise InvalidConfig(f"the scheduler URL must be http://HOST:PORT, got {url!r}")
        self.host, self.port = parts.hostname, parts.port
        self._idle: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter] | None] = asyncio.Queue()
        for _ in range(connections):
            self._idle.put_nowait(None)

    async def request(self, method: str, path: str, body: bytes | None, token: str | None, *,
                      accept_gzip: bool = False) -> tuple[int, bytes, str]:
        """(status, body, its Content-Encoding): a gzipped body is returned as it came."""
        conn = await self._idle.get()
        try:
            if conn is None:
                conn = await asyncio.open_connection(self.host, self.port)
            reader, writer = conn
            head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
            if token:
                head.append(f"Authorization: Bearer {token}")
            if accept_gzip:
                head.append("Accept-Encoding: gzip")
            if body is not None:
                head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
            status_line = await reader.readline()
            if not status_line:
                raise ConnectionResetError("the server closed the connection")
            status = int(status_line.split()[1])
            length, close, encoding = 0, False, ""
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "connection" and value.strip().lower() == "close":
                    close = True
                elif name == "content-encoding":
                    encoding = value.strip().lower()
            data = await reader.readexactly(length) if length else b""
            if close:
                writer.close()
                conn = None
            return status, data, encoding
        except BaseException:
            if conn is not None:
                conn[1].close()
            conn = None
            raise
        finally:
            self._idle.put_nowait(conn)


def agent_app(agent: Agent) -> FastAPI:
    app = FastAPI(title="Tenplex simulated-worker agent")

    @app.post("/launch")
    async def launch(body: dict[str, Any]) -> dict[str, Any]:
        agent.launch(body["job"], body["workers"])
        return {"pid": os.getpid()}

    @app.post("/stop")
    async def stop(body: dict[str, Any]) -> dict[str, Any]:
        agent.stop(body["job"], body["worker_ids"])
        return {"ok": True}

    @app.get("/exits")
    async def exits(after: int = 0, wait: float = 0.0) -> dict[str, Any]:
        return await agent.exits_after(after, min(wait, 5.0))

    @app.get("/counts")
    async def counts() -> dict[str, int]:
        return dict(agent.counts)

    @app.post("/nodes/start")
    async def nodes_start() -> list[dict[str, Any]]:
        """Start the simulated node agents on this loop; the hosts file that describes them."""
        if agent.nodes is None:
            raise InvalidConfig("this agent runs no simulated nodes")
        await agent.nodes.start()
        return agent.nodes.hosts_file()

    @app.post("/nodes/kill")
    async def nodes_kill(body: dict[str, Any]) -> dict[str, Any]:
        return {"host": body["host"], "ranks_killed": agent.kill_host(str(body["host"]))}

    @app.get("/nodes/counts")
    async def nodes_counts() -> dict[str, Any]:
        if agent.nodes is None:
            raise InvalidConfig("this agent runs no simulated nodes")
        return {"counts": dict(agent.nodes.counts), "refused": agent.nodes.refused, "decoding": agent.nodes.decoding}

    @app.get("/timeline")
    async def timeline() -> dict[str, dict[str, float]]:
        return {f"{job}/g{gen}": dict(g.timeline) for (job, gen), g in agent.generations.items()}

    return app


def run_agent(host: str = "127.0.0.1", port: int = 0, *, step_seconds: float = 0.2,
              nodes: SimNodes | None = None) -> BackgroundServer:
    """Start an agent serving on ``host:port`` in a background thread (its event loop runs the ranks); with
    ``nodes``, simulated node agents too (started by ``POST /nodes/start``, on the same loop)."""
    return BackgroundServer(agent_app(Agent(step_seconds=step_seconds, nodes=nodes)), host, port).start()
