"""Simulated node agents: thousands of node daemons that take sub-plans and report progress without moving data.

For measuring the control plane at 16,384 GPUs (``benchmarks/control_plane.py --nodes simulated``): 2,048 real
node daemons do not fit one machine, and the data path is measured elsewhere. Every agent listens on its own
loopback port, as a node's daemon does, so the scheduler reaches it through the same ``store_url`` of a hosts
file and the same :class:`~tenplex.store.client.StoreClient`; all of them are served by one asyncio loop
(:class:`SimNodes`). An agent answers every daemon request the scheduler makes during a reconfiguration and a
failure recovery:

- ``GET /healthz``: the local backend's health watch;
- ``GET /v1/jobs/{job}/versions`` (the committed versions: the scheduler's ``holders``), ``GET
  .../versions/{v}/committed`` and ``DELETE .../versions/{v}`` (the node retention);
- ``POST /v1/jobs/{job}/transforms``: the sub-plan, decoded for real (:meth:`TransformRequest.from_body`, which
  reads the binary part with :func:`tenplex.transformer.part.decode`): a request or part the agent cannot read
  is refused with a 400 and the decoder's error, as a daemon refuses it, and counted; one it can read is checked
  against the agent (its host, its job, a URL for every source it names besides itself) and then reported
  committed at once with the byte counts the part implies, as local or remote by its sources: no byte moves.
  With ``decoders`` the decoding runs in that many processes (:func:`read_request`), timed per version
  (:attr:`SimNodes.decoding`): on a cluster each node decodes its own part, here they share the machine. A resubmission
  with the same digest attaches, another sub-plan for the same version is a 409, as on a daemon;
- ``GET``/``DELETE /v1/jobs/{job}/transforms/{version}``: the record, and cancelling.

The workers' side of a node (the relay of heartbeats, the snapshot commits, the restore checks) is the
simulated-worker agent's (:mod:`tenplex.testing.simworkers`), which runs in the same process and calls
:meth:`SimNodes.commit` and :meth:`SimNodes.is_committed` instead of writing a store. :meth:`SimNodes.kill`
loses a host: its agent stops listening and drops its connections (a refused connection from then on), and the
simulated-worker agent ends the ranks on it.

The HTTP server is a small one on asyncio streams (keep-alive, ``Content-Length`` bodies), not uvicorn: 2,048
listeners in one process, each closable on its own, sharing two cores with the scheduler being measured.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from tenplex.core.version import Version
from tenplex.errors import Conflict, InvalidInput, NotFound, TenplexError
from tenplex.ptc import dtypes
from tenplex.store.names import check_job, check_version
from tenplex.store.wire import versions_path
from tenplex.transformer.plan import CHECKPOINT
from tenplex.transformer.remote import (
    CANCELLED,
    COMMITTED,
    FINAL_STATES,
    TransformRequest,
    TransformStatus,
)

log = logging.getLogger(__name__)

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 409: "Conflict",
            500: "Internal Server Error"}


@dataclass
class SimNode:
    """One simulated node's agent: what its store holds and the transforms it was sent."""

    name: str
    gpus: int
    port: int = 0
    alive: bool = True
    versions: dict[tuple[str, str], int] = field(default_factory=dict)
    """(job, version) -> shards committed (a version is listed once committed)."""
    transforms: dict[tuple[str, str], TransformStatus] = field(default_factory=dict)
    server: asyncio.AbstractServer | None = None
    writers: set[asyncio.StreamWriter] = field(default_factory=set)


class SimNodes:
    """``count`` simulated node agents ``{prefix}{i}`` of ``gpus`` GPUs each on ``address`` (see the module doc).

    ``counts`` say what the scheduler asked: requests per route, parts decoded and refused."""

    def __init__(self, count: int, gpus: int, *, address: str = "127.0.0.1", prefix: str = "node-",
                 token: str | None = None, decoders: int = 0) -> None:
        """``decoders``: processes that decode the sub-plans (0: on the event loop; at 2,048 nodes the decoding
        would hold the loop, and with it every node's answers, for minutes)."""
        if count < 1 or gpus < 1:
            raise InvalidInput(f"simulated nodes: count {count} and gpus {gpus} must be >= 1")
        self.address = address
        self.token = token
        self.nodes = {f"{prefix}{i}": SimNode(f"{prefix}{i}", gpus) for i in range(count)}
        self.counts: Counter[str] = Counter()
        self.refused: list[str] = []
        self._committed: dict[tuple[str, str, str], asyncio.Event] = {}
        self.decoding: dict[str, dict[str, float]] = {}
        """Per target version: when the first sub-plan came in and the last was decoded (wall clock), how many,
        and the decoders' CPU seconds (all together, and the largest one part took)."""
        self._decoders = ProcessPoolExecutor(decoders, mp_context=multiprocessing.get_context("spawn")) \
            if decoders > 0 else None
        """The errors of the requests refused with a 4xx (the first 100)."""

    async def start(self) -> SimNodes:
        for node in self.nodes.values():
            node.server = await asyncio.start_server(lambda r, w, n=node: self._serve(n, r, w), self.address, 0,
                                                     backlog=64)
            node.port = node.server.sockets[0].getsockname()[1]
        return self

    def hosts_file(self) -> list[dict[str, Any]]:
        """The hosts as a hosts file lists them (:meth:`tenplex.scheduler.backend.LocalCluster.attach`)."""
        return [{"name": n.name, "address": self.address, "store_url": f"http://{self.address}:{n.port}",
                 "gpus": n.gpus} for n in self.nodes.values()]

    async def stop(self) -> None:
        for node in self.nodes.values():
            self._close(node)
        if self._decoders is not None:
            self._decoders.shutdown(wait=False, cancel_futures=True)

    def _close(self, node: SimNode) -> None:
        if node.server is not None:
            node.server.close()
            node.server = None
        for w in list(node.writers):
            w.close()
        node.writers.clear()

    def kill(self, name: str) -> None:
        """Host ``name`` is lost: its agent stops answering (connections refused and cut)."""
        node = self.node(name)
        node.alive = False
        self._close(node)
        log.warning("simulated node %s killed", name)

    def node(self, name: str) -> SimNode:
        node = self.nodes.get(name)
        if node is None:
            raise NotFound(f"no simulated node {name!r}")
        return node

    # -- the workers' side ------------------------------------------------------------------------------

    def commit(self, host: str, job: str, version: str, shards: int) -> None:
        """The ranks on ``host`` wrote and committed their snapshot ``version`` of ``job`` (``shards`` shards)."""
        node = self.node(host)
        if node.alive:
            node.versions[(job, version)] = shards
            self._committed_now(host, job, version)

    def is_committed(self, host: str, job: str, version: str) -> bool:
        node = self.node(host)
        return node.alive and (job, version) in node.versions

    async def wait_committed(self, host: str, job: str, version: str, timeout: float) -> bool:
        """Whether ``version`` of ``job`` is committed on ``host`` within ``timeout`` seconds (woken by the
        commit: 2,048 hosts' workers polling would cost this process more than the nodes do)."""
        key = (host, job, version)
        while not self.is_committed(host, job, version):
            event = self._committed.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except TimeoutError:
                return self.is_committed(host, job, version)
        return True

    def _committed_now(self, host: str, job: str, version: str) -> None:
        event = self._committed.pop((host, job, version), None)
        if event is not None:
            event.set()

    # -- the daemon's side ------------------------------------------------------------------------------

    async def _serve(self, node: SimNode, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        node.writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    name, sep, value = line.partition(":")
                    if sep:
                        headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length", "0"))
                body = await reader.readexactly(length) if length else b""
                if not node.alive:
                    return
                status, answer = await self._route(node, method, target, headers, body)
                payload = json.dumps(answer, separators=(",", ":")).encode()
                writer.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            node.writers.discard(writer)
            writer.close()

    async def _route(self, node: SimNode, method: str, target: str, headers: dict[str, str],
                     body: bytes) -> tuple[int, Any]:
        url = urlsplit(target)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        key = f"{method} {'/'.join('*' if i in (2, 4) else p for i, p in enumerate(parts))}"
        self.counts[key] += 1
        try:
            if parts == ["healthz"] and method == "GET":
                return 200, {"ok": True}
            if self.token is not None and headers.get("authorization") != f"Bearer {self.token}":
                return 401, {"error": "unauthorized", "detail": "a bearer token is required"}
            if len(parts) < 4 or parts[:2] != ["v1", "jobs"]:
                raise NotFound(f"no route {method} {url.path} on a simulated node")
            job = check_job(parts[2])
            if parts[3] == "versions":
                return 200, self._versions(node, method, job, parts[4:])
            if parts[3] == "transforms":
                return 200, await self._transforms(node, method, job, parts[4:], query, body)
            raise NotFound(f"no route {method} {url.path} on a simulated node")
        except TenplexError as exc:
            if len(self.refused) < 100:
                self.refused.append(f"{node.name}: {method} {url.path}: {exc.detail}")
            return exc.http_status, {"error": exc.code, "detail": exc.detail}

    def _versions(self, node: SimNode, method: str, job: str, rest: list[str]) -> Any:
        if not rest and method == "GET":
            held = sorted(Version.parse(v) for (j, v) in node.versions if j == job)
            return {"versions": [{"version": str(v), "committed": True, "nbytes": 0, "durable": True,
                                  "in_memory": False} for v in held]}
        version = str(check_version(rest[0])) if rest else ""
        if rest[1:] == ["committed"] and method == "GET":
            return {"committed": (job, version) in node.versions}
        if len(rest) == 1 and method == "DELETE":
            if node.versions.pop((job, version), None) is None:
                raise NotFound(f"{node.name} holds no version {version} of job {job}")
            return {"deleted": version}
        raise NotFound(f"no route {method} {versions_path(job)}/{'/'.join(rest)} on a simulated node")

    async def _transforms(self, node: SimNode, method: str, job: str, rest: list[str], query: dict[str, str],
                          body: bytes) -> Any:
        if not rest and method == "POST":
            return (await self._submit(node, job, body)).to_json()
        if not rest and method == "GET":
            return {"transforms": [s.to_json() for (j, _), s in node.transforms.items() if j == job]}
        version = str(check_version(rest[0]))
        record = node.transforms.get((job, version))
        if record is None:
            raise NotFound(f"no transform of job {job} to {version} on {node.name}")
        if method == "GET":
            return record.to_json()
        if method == "DELETE":
            if record.state not in FINAL_STATES:
                record = node.transforms[(job, version)] = TransformStatus(**{
                    **{k: getattr(record, k) for k in record.__dataclass_fields__}, "state": CANCELLED,
                    "finished_at": time.time()})
            return record.to_json()
        raise NotFound(f"no route {method} transforms/{version} on a simulated node")

    async def _submit(self, node: SimNode, job: str, body: bytes) -> TransformStatus:
        """Decode the sub-plan as a daemon does, check it is this node's, and report it done: nothing moves."""
        self.counts["parts received"] += 1
        received = time.time()
        if self._decoders is not None:
            read = await asyncio.get_running_loop().run_in_executor(self._decoders, read_request, body, node.name, job)
        else:
            read = read_request(body, node.name, job)
        if "refused" in read:
            self.counts["parts refused"] += 1
            raise InvalidInput(read["refused"])
        self.counts["parts decoded"] += 1
        version, digest = read["version"], read["digest"]
        span = self.decoding.setdefault(version, {"first_received": received, "last_decoded": 0.0, "parts": 0,
                                                  "cpu_s": 0.0, "max_cpu_s": 0.0})
        span["last_decoded"] = time.time()
        span["parts"] += 1
        span["cpu_s"] += read["cpu_s"]
        span["max_cpu_s"] = max(span["max_cpu_s"], read["cpu_s"])
        known = node.transforms.get((job, version))
        if known is not None:
            if known.digest != digest:
                raise Conflict(f"{node.name} already runs another sub-plan for {job} {version}")
            return known
        now = time.time()
        record = TransformStatus(
            job=job, version=version, host=node.name, old_version=read["old_version"], digest=digest,
            state=COMMITTED, bytes_total=read["total"], bytes_done=read["total"], submitted_at=now, started_at=now,
            finished_at=now, report={"host": node.name, "bytes_local": read["local"], "bytes_remote": read["remote"],
                                     "bytes_zero": read["zero"], "seconds": 0.0, "requests": 0, "replanned_pieces": 0,
                                     "shards": read["shards"], "transfers": read["transfers"]})
        node.transforms[(job, version)] = record
        node.versions[(job, version)] = read["shards"]
        self._committed_now(node.name, job, version)
        return record


def read_request(body: bytes, node: str, job: str) -> dict[str, Any]:
    """What a node agent reads from a transform request: its sub-plan decoded for real
    (:meth:`TransformRequest.from_body`, the daemon's own decoder) and checked to be ``node``'s, of ``job``, with
    a URL for every source it names; summarized (version, digest, bytes local/remote/zero, shards, transfers), or
    ``{"refused": why}``. A plain function of bytes, so that a pool of processes can run it."""
    cpu = time.process_time()
    try:
        req = TransformRequest.from_body(body)
        plan = req.plan
        if req.host != node:
            raise InvalidInput(f"the transform request is for host {req.host!r}; this is {node!r}")
        if plan.job != job:
            raise InvalidInput(f"the transform request is of job {plan.job!r}, sent to job {job!r}'s route")
        hp = plan.host(node)
        local = remote = zero = 0
        for t in hp.transfers:
            if t.source is None:
                zero += t.nbytes
            elif t.source == node:
                local += t.nbytes
            else:
                if t.source != CHECKPOINT and t.source not in req.sources:
                    raise InvalidInput(f"transfer of {t.tensor} {t.region} names source {t.source!r}, which the "
                                       "request gives no URL for")
                remote += t.nbytes
        total = sum(s.region.volume * dtypes.itemsize(s.dtype) for s in hp.shards)
        return {"version": str(plan.new_version), "old_version": str(plan.old_version), "digest": req.digest,
                "local": local, "remote": remote, "zero": zero, "total": total, "shards": len(hp.shards),
                "transfers": len(hp.transfers), "cpu_s": time.process_time() - cpu}
    except InvalidInput as exc:
        return {"refused": exc.detail}
