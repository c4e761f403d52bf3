"""The node's store daemon: a :class:`LocalStore` over HTTP (FastAPI on uvicorn, uvloop + httptools).

Routes (all but ``/healthz`` need ``Authorization: Bearer <credential>`` when auth is on; who may call
which is :func:`create_app`'s table)::

    GET    /healthz
    GET    /metrics                                          Prometheus text format
    GET    /v1/jobs
    GET    /v1/jobs/{job}/versions
    GET    /v1/jobs/{job}/versions/{version}                 manifest JSON
    GET    /v1/jobs/{job}/versions/{version}/tensors/{tensor}?region=a:b,c:d[&uncommitted=1]
    POST   /v1/jobs/{job}/versions/{version}/regions         JSON list of regions -> their bytes, one body
    PUT    /v1/jobs/{job}/versions/{version}/tensors/{tensor}?region=a:b,c:d   raw body
    POST   /v1/jobs/{job}/versions/{version}/links           LinkRequest: a kept shard, hard-linked here
    GET    /v1/jobs/{job}/versions/{version}/committed?wait=S  {"committed": bool}, once committed or after S s
    POST   /v1/jobs/{job}/versions/{version}/commit          -> counts and the committed manifest
    POST   /v1/jobs/{job}/versions/{version}/reservation     {"nbytes": n} -> {"in_memory": bool}: the tier places it
    DELETE /v1/jobs/{job}/versions/{version}

The headers, limits and request bodies are :mod:`tenplex.store.wire`, shared
with the client. Region reads answer raw C-order bytes with ``X-Tenplex-Dtype``,
``X-Tenplex-Shape`` (``a,b``; empty for 0-d) and ``X-Tenplex-Checksum``
(``crc32c:xxxxxxxx`` of the body). A region that is exactly a stored shard
carries the checksum recorded at write time (no checksum pass; a corrupted
disk shows up as a checksum mismatch at the client); any other region's
checksum is computed from the bytes that are sent. How the body is produced:

- a region inside one shard whose payload is long runs of chunk files (any
  band of rows of the store's whole-row chunks, whole chunks, whole shards;
  runs averaging at least ``min_run_bytes``, 64 KiB): never copied in this
  process. Bodies over 1 MiB of a committed version go out with
  ``sendfile(2)`` (:data:`~tenplex.serving.SENDFILE_EXTENSION`; see
  :class:`_SendfileResponse`); otherwise they are sent from read-only maps of
  the chunk files' page-cache pages: up to ``single_pass_bytes`` (64 MiB)
  the maps made for the checksum are the ones sent; a larger region is
  checksummed batch by batch and then sent in ``piece_bytes`` (32 MiB)
  batches, the next one mapped while one is on the wire (see
  :func:`_runs_response`);
- any other region up to ``single_pass_bytes``: read into one buffer
  (checksummed unless it is a whole shard) and answered as a ``memoryview``
  body;
- any other larger region: a first pass computes the checksum through one
  bounded buffer (a whole shard needs none), then the body streams in
  ``piece_bytes`` pieces, the next piece read while the current one is sent.

Clients split big reads into requests of at most 32 MiB anyway (see
:class:`~tenplex.store.client.StoreClient`), so the streamed paths are for
others.

A batch read (``POST .../regions``, body ``{"regions": [{"tensor": ..., "region":
"a:b,c:d"}, ...]}``, at most :data:`~tenplex.store.wire.MAX_BATCH_REGIONS` of a committed version)
answers the regions' bytes one after the other in one body, with
``X-Tenplex-Parts``: a JSON list of ``[dtype, shape, checksum]`` per region, in
order. Why: a transform pulls hundreds of small shards (biases, norms) from each
source, and every request costs both ends about a millisecond of Python; one
request for a batch costs that once. Each region is produced as above: runs of
chunk files go out with ``sendfile(2)`` (consecutive ones in one hand-off),
others are read into memory first (at most ``single_pass_bytes`` of those per
request).

Uploads stream the request body into piece buffers that go to zarr as they
fill (two pieces of memory at most), the crc32c computed on the way; a body
of the wrong length stores nothing. A link (:meth:`LocalStore.link_shard`)
puts a shard of an older committed version into a newer one as hard links to
its files, so a caller elsewhere keeps a shard in a new version without its
bytes crossing the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from anyio import to_thread
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tenplex.core.auth import Authenticator, Principal, require_admin, require_read, require_write
from tenplex.core.buffers import byte_view
from tenplex.core.protocol import (
    RELAY_HEARTBEAT_PATH,
    RELAY_PATH,
    RELAY_PTC_PATH,
    RELAY_REPORT_PATH,
)
from tenplex.core.version import Version
from tenplex.errors import InvalidInput, TenplexError
from tenplex.ptc.dtypes import check_dtype, itemsize, storage_dtype
from tenplex.ptc.region import Region
from tenplex.serving import (
    SENDFILE_EXTENSION,
    SENDFILE_MESSAGE,
    BackgroundServer,
)
from tenplex.store.buffers import crc_of, slabs
from tenplex.store.local import LocalStore
from tenplex.store.model import ShardInfo, format_checksum
from tenplex.store.names import check_job, check_tensor, check_version
from tenplex.store.rawchunks import (
    MAX_MAPS,
    ChunkRun,
    checksum_runs,
    chunks_of,
    crc_of_views,
    map_runs,
    mapped_batches,
    open_runs,
    run_batches,
)
from tenplex.store.reader import MIN_RUN_BYTES, TensorReader
from tenplex.store.wire import (
    CHECKSUM_HEADER,
    DTYPE_HEADER,
    GLOBAL_SHAPE_HEADER,
    MAX_COMMIT_WAIT_S,
    PARTS_HEADER,
    SHAPE_HEADER,
    LinkRequest,
    RegionsRequest,
    ReservationRequest,
    format_parts,
    format_shape,
    parse_shape,
)
from tenplex.store.writer import ShardWriter

log = logging.getLogger(__name__)

SINGLE_PASS_BYTES = 64 << 20
INLINE_BYTES = 1 << 20  # bodies up to this are mapped and checksummed on the event loop itself
SENDFILE_MIN_BYTES = INLINE_BYTES + 1  # smaller bodies: a map on the loop beats a hand-off to a sendfile thread
PIECE_BYTES = 32 << 20
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own switch to multiprocess mode




class _Metrics:
    """The daemon's Prometheus metrics, in a registry of its own (several servers share a test process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.bytes_out = Counter("tenplex_store_bytes_out", "Tensor bytes served", registry=self.registry)
        self.bytes_in = Counter("tenplex_store_bytes_in", "Tensor bytes stored from uploads", registry=self.registry)
        self.latency = Histogram(
            "tenplex_store_request_seconds",
            "Request latency until the last body byte was handed to the server",
            ["method", "route"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.errors = Counter(
            "tenplex_store_errors", "Requests answered with a 4xx or 5xx", ["route", "status"], registry=self.registry
        )
        self.reservations = Counter(
            "tenplex_store_reservations", "Versions' room asked for by writers sharing the root, by the tier given",
            ["tier"], registry=self.registry,
        )


class _MetricsMiddleware:
    """Pure ASGI (Starlette's BaseHTTPMiddleware would buffer streamed bodies); times and counts every request."""

    def __init__(self, app: ASGIApp, metrics: _Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route_obj = scope.get("route")
            route = getattr(route_obj, "path", "unmatched")
            self.metrics.latency.labels(scope["method"], route).observe(time.perf_counter() - start)
            if status >= 400:
                self.metrics.errors.labels(route, str(status)).inc()


_VERSIONS = "/v1/jobs/{job}/versions"
_READ_ROUTES = frozenset({
    ("GET", _VERSIONS), ("GET", _VERSIONS + "/{version}"), ("GET", _VERSIONS + "/{version}/tensors/{tensor:path}"),
    ("POST", _VERSIONS + "/{version}/regions"), ("GET", _VERSIONS + "/{version}/committed"),
    ("GET", RELAY_PTC_PATH),
})
"""Routes a job's ``worker`` or ``reader`` credential may call for its own job (a generation's PTC: the scheduler
decides too, :class:`tenplex.node.relay.PtcCache`)."""
_WRITE_ROUTES = frozenset({
    ("PUT", _VERSIONS + "/{version}/tensors/{tensor:path}"), ("POST", _VERSIONS + "/{version}/links"),
    ("POST", _VERSIONS + "/{version}/commit"), ("POST", _VERSIONS + "/{version}/reservation"),
    ("POST", RELAY_HEARTBEAT_PATH), ("POST", RELAY_REPORT_PATH),
})
"""Routes a job's ``worker`` credential may call for its own job (a snapshot: reserve, write, link, commit; a heartbeat, snapshot or exit report the
node daemon relays, :mod:`tenplex.node.relay`)."""
_ANY_ROUTES = frozenset({("GET", "/v1/jobs"), ("GET", RELAY_PATH)})
"""Routes any valid credential may call (the handler narrows the answer to the caller's job)."""


def _error_response(exc: TenplexError) -> JSONResponse:
    return JSONResponse(exc.to_json(), status_code=exc.http_status)


def create_app(
    store: LocalStore,
    *,
    token: str | None,
    auth: Authenticator | None = None,
    single_pass_bytes: int = SINGLE_PASS_BYTES,
    piece_bytes: int = PIECE_BYTES,
    min_run_bytes: int = MIN_RUN_BYTES,
    sendfile_min_bytes: int = SENDFILE_MIN_BYTES,
    routers: Sequence[APIRouter] = (),
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """The FastAPI application serving ``store``; every route but /healthz needs a credential when ``auth`` (default:
    the admin ``token`` alone) has any.

    Who reaches what (:mod:`tenplex.core.auth`, checked by one dependency before any handler runs): a job's
    ``worker`` credential reads and writes that job's versions, a ``reader`` grant reads them, ``/v1/jobs``
    lists only the caller's job, and everything else (``/metrics``, deletes, and every route in ``routers``)
    is ``admin`` only. ``routers`` are more routes of the same daemon (the node daemon adds its transforms,
    uploads and relay, :mod:`tenplex.node.daemon`); ``registry`` is the Prometheus registry ``/metrics`` shows,
    shared with them (a new one by default).

    ``single_pass_bytes`` and ``piece_bytes`` bound the server memory per request (see the module doc);
    bodies whose chunk-file runs average at least ``min_run_bytes`` are sent from the page cache, those
    of at least ``sendfile_min_bytes`` with ``sendfile(2)`` where the server offers it.
    """
    if single_pass_bytes < 1 or piece_bytes < 1 or min_run_bytes < 1 or sendfile_min_bytes < 1:
        raise InvalidInput(
            "single_pass_bytes, piece_bytes, min_run_bytes and sendfile_min_bytes must be positive, got "
            f"{single_pass_bytes}, {piece_bytes}, {min_run_bytes}, {sendfile_min_bytes}"
        )
    metrics = _Metrics(registry)
    preloading: set[tuple[str, Version]] = set()  # versions whose readers were opened ahead (see LocalStore.preload)
    app = FastAPI(title="tenplex store", version="1", docs_url=None, redoc_url=None)
    app.state.store = store
    app.state.metrics = metrics
    authn = auth if auth is not None else Authenticator(token)

    async def require_token(request: Request) -> None:
        """Authenticate, then authorize by the matched route and its ``{job}`` (default: admin only)."""
        principal = authn.authenticate(request.headers.get("authorization"))
        request.state.principal = principal
        if principal.is_admin:
            return
        route = request.scope.get("route")
        key = (request.method, getattr(route, "path", ""))
        job = request.path_params.get("job")
        if key in _READ_ROUTES and isinstance(job, str):
            require_read(principal, job)
        elif key in _WRITE_ROUTES and isinstance(job, str):
            require_write(principal, job)
        elif key not in _ANY_ROUTES:
            require_admin(principal, f"{request.method} {key[1] or request.url.path}")

    @app.exception_handler(TenplexError)
    async def _tenplex_error(_request: Request, exc: TenplexError) -> JSONResponse:
        if exc.http_status >= 500:
            log.error("request failed: %s: %s", exc.code, exc.detail)
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors())
        return _error_response(InvalidInput(f"bad request: {problems}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse({"error": code, "detail": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while serving a request")
        return JSONResponse({"error": "internal_error", "detail": f"{type(exc).__name__}: {exc}"}, status_code=500)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    api = APIRouter(dependencies=[Depends(require_token)])

    @api.get("/metrics")
    async def prometheus() -> Response:
        if os.environ.get(MULTIPROC_ENV):  # several worker processes: sum their metric files
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/jobs")
    async def list_jobs(request: Request) -> dict[str, Any]:
        principal: Principal = request.state.principal
        jobs = await to_thread.run_sync(store.jobs)
        return {"jobs": jobs if principal.is_admin else [j for j in jobs if j == principal.job]}

    @api.get("/v1/jobs/{job}/versions")
    async def list_versions(job: str) -> dict[str, Any]:
        check_job(job)
        infos = await to_thread.run_sync(store.versions, job)
        return {"job": job, "versions": [vi.to_json() for vi in infos]}

    @api.get("/v1/jobs/{job}/versions/{version}")
    async def get_manifest(job: str, version: str) -> dict[str, Any]:
        check_job(job)
        v = check_version(version)
        manifest = await to_thread.run_sync(store.manifest, job, v)
        return manifest.to_json()

    @api.get("/v1/jobs/{job}/versions/{version}/committed",
             description=f"``?wait=S`` (at most {MAX_COMMIT_WAIT_S:g}): answer once the version is committed here, "
                         "or after S seconds (a long poll: a new worker learns of its version's commit at once).")
    async def committed(job: str, version: str, wait: float = 0.0) -> dict[str, Any]:
        check_job(job)
        v = check_version(version)
        if not 0.0 <= wait <= MAX_COMMIT_WAIT_S:
            raise InvalidInput(f"wait must be between 0 and {MAX_COMMIT_WAIT_S:g} seconds, got {wait}")
        done = await to_thread.run_sync(store.wait_committed, job, v, wait)
        return {"job": job, "version": str(v), "committed": done}

    @api.post("/v1/jobs/{job}/versions/{version}/commit")
    async def commit(job: str, version: str) -> dict[str, Any]:
        check_job(job)
        v = check_version(version)
        manifest = await to_thread.run_sync(store.commit, job, v)
        return {"job": job, "version": str(v), "committed": True, "shards": len(manifest.shards), "nbytes": manifest.nbytes,
                "manifest": manifest.to_json()}

    @api.post("/v1/jobs/{job}/versions/{version}/links")
    async def link(job: str, version: str, body: LinkRequest) -> dict[str, Any]:
        check_job(job)
        v = check_version(version)
        old = check_version(body.from_version)
        tensor = check_tensor(body.tensor)

        def link_here() -> ShardInfo:
            reader = store.open_tensor(job, old, tensor)
            return store.link_shard(job, old, tensor, reader.parse_region(body.region), v, verify=body.verify)

        info = await to_thread.run_sync(link_here)
        return {"linked": info.to_json()}

    @api.post("/v1/jobs/{job}/versions/{version}/reservation")
    async def reserve(job: str, version: str, body: ReservationRequest) -> dict[str, Any]:
        """A writer sharing this daemon's root (a worker's snapshot) asks where the version goes and claims its
        bytes there: the daemon's tier places it (budget lock, eviction, demotion are this process's alone)."""
        check_job(job)
        v = check_version(version)
        tier = store.memory
        in_memory = False if tier is None else await to_thread.run_sync(tier.place, job, v, body.nbytes)
        metrics.reservations.labels("memory" if in_memory else "disk").inc()
        return {"job": job, "version": str(v), "in_memory": in_memory}

    @api.delete("/v1/jobs/{job}/versions/{version}")
    async def delete(job: str, version: str) -> dict[str, Any]:
        check_job(job)
        v = check_version(version)
        await to_thread.run_sync(store.delete, job, v)
        return {"job": job, "version": str(v), "deleted": True}

    def start_preload(job: str, v: Version) -> None:
        """On the first read of a committed version, open its other tensors ahead (a transform asks for all)."""
        if (job, v) in preloading:
            return
        if len(preloading) > 4096:
            preloading.clear()
        preloading.add((job, v))
        threading.Thread(target=_preload, args=(store, job, v), name="tenplex-store-preload", daemon=True).start()

    @api.post("/v1/jobs/{job}/versions/{version}/regions")
    async def get_regions(request: Request, job: str, version: str, body: RegionsRequest) -> Response:
        check_job(job)
        v = check_version(version)
        sendfile = SENDFILE_EXTENSION in request.scope.get("extensions", {})
        first_read = [False]

        def prepare() -> list[_Part]:
            parts: list[_Part] = []
            in_memory = 0
            for i, ref in enumerate(body.regions):
                check_tensor(ref.tensor)
                reader = store.cached_tensor(job, v, ref.tensor)
                if reader is None:
                    reader = store.open_tensor(job, v, ref.tensor)
                    first_read[0] = True
                box = reader.parse_region(ref.region)
                part = _Part.of(reader, box, sendfile=sendfile, min_run_bytes=min_run_bytes, piece_bytes=piece_bytes)
                if part.runs is None:
                    in_memory += part.nbytes
                    if in_memory > single_pass_bytes:
                        raise InvalidInput(
                            f"regions 0..{i} of this batch read need {in_memory} bytes read into memory, more than "
                            f"the {single_pass_bytes} one request may; ask for fewer regions per request"
                        )
                    part.read(reader, box)
                parts.append(part)
            return parts

        parts = await to_thread.run_sync(prepare)
        if first_read[0]:
            start_preload(job, v)
        headers = {PARTS_HEADER: format_parts((p.dtype, p.shape, p.checksum) for p in parts)}
        return _PartsResponse(parts, headers, metrics, piece_bytes)

    @api.get("/v1/jobs/{job}/versions/{version}/tensors/{tensor:path}")
    async def get_region(
        request: Request, job: str, version: str, tensor: str, region: str | None = None, uncommitted: bool = False
    ) -> Response:
        check_job(job)
        v = check_version(version)
        check_tensor(tensor)
        reader = store.cached_tensor(job, v, tensor)  # committed, and read before: no thread hop
        if reader is None:
            reader = await to_thread.run_sync(lambda: store.open_tensor(job, v, tensor, committed_only=not uncommitted))
            if reader.committed:
                start_preload(job, v)
        box = reader.parse_region(region) if region is not None else Region.full(reader.global_shape)
        reader.plan(box)  # fail with 404/416/409 before any header is sent
        nbytes = box.volume * reader.itemsize
        headers = {
            DTYPE_HEADER: reader.dtype,
            SHAPE_HEADER: format_shape(box.shape),
            GLOBAL_SHAPE_HEADER: format_shape(reader.global_shape),
        }
        st = storage_dtype(reader.dtype)
        # a whole stored shard carries the checksum recorded when it was written: no checksum pass,
        # and damage on this disk shows up as a mismatch at the client
        exact = reader.exact_shard(box)
        runs = reader.runs(box, min_run_bytes)
        if runs is not None:  # the body is runs of chunk files: sent from the page cache, never copied here
            # whole chunk files: their checksums recorded at write time, combined (no pass over the bytes)
            recorded = reader.recorded_checksum(runs) if exact is None else None
            known = exact.checksum if exact is not None else (format_checksum(recorded) if recorded is not None else None)
            # sendfile: chunk files of a committed version are never written again, so what the checksum
            # covered is what the files hold when they are sent
            sendfile = not uncommitted and nbytes >= sendfile_min_bytes and SENDFILE_EXTENSION in request.scope.get("extensions", {})
            return await _runs_response(runs, known, nbytes, headers, metrics, sendfile=sendfile,
                                        single_pass_bytes=single_pass_bytes, piece_bytes=piece_bytes)
        if nbytes <= single_pass_bytes:
            buf = np.empty(box.shape, st)

            def read_and_checksum() -> str:  # both off the event loop, which keeps sending other bodies
                reader.read(box, buf)
                return exact.checksum if exact is not None else format_checksum(crc_of(buf))

            headers[CHECKSUM_HEADER] = await to_thread.run_sync(read_and_checksum)
            metrics.bytes_out.inc(nbytes)
            return Response(content=byte_view(buf), media_type="application/octet-stream", headers=headers)
        if exact is not None:
            headers[CHECKSUM_HEADER] = exact.checksum
        else:
            crc = await to_thread.run_sync(reader.checksum, box, piece_bytes)
            headers[CHECKSUM_HEADER] = format_checksum(crc)
        headers["Content-Length"] = str(nbytes)
        pieces = _read_pieces(reader, box, st, piece_bytes)
        first = await to_thread.run_sync(next, pieces)  # a read that fails here is answered with its error
        return StreamingResponse(_send_views(first, pieces, metrics), media_type="application/octet-stream", headers=headers)

    @api.put("/v1/jobs/{job}/versions/{version}/tensors/{tensor:path}")
    async def put_shard(job: str, version: str, tensor: str, request: Request, region: str | None = None) -> dict[str, Any]:
        check_job(job)
        v = check_version(version)
        check_tensor(tensor)
        dtype = check_dtype(_required_header(request, DTYPE_HEADER))
        gshape = parse_shape(_required_header(request, GLOBAL_SHAPE_HEADER), what=GLOBAL_SHAPE_HEADER)
        if region is None:
            raise InvalidInput("the query parameter region=a:b,c:d (the shard's region) is required for an upload")
        box = Region.parse(region, gshape)
        expected = box.volume * itemsize(dtype)
        declared = request.headers.get("content-length")
        if declared is not None and declared.strip() != str(expected):
            raise InvalidInput(
                f"body is {declared.strip()} bytes, but region {box.format()!r} of {dtype} needs {expected} bytes"
            )
        writer: ShardWriter = await to_thread.run_sync(
            lambda: store.open_writer(job, v, tensor, box, dtype=dtype, global_shape=gshape, piece_bytes=piece_bytes)
        )
        try:
            await _receive_shard(request, writer, expected)
            info = await to_thread.run_sync(writer.finish)
        except BaseException:
            writer.abort()
            raise
        metrics.bytes_in.inc(expected)
        return {"stored": info.to_json()}

    app.include_router(api)
    for router in routers:
        app.include_router(router, dependencies=[Depends(require_token)])
    # outermost, so it sees the final status of everything, errors included
    app.add_middleware(_MetricsMiddleware, metrics=metrics)
    return app


def _preload(store: LocalStore, job: str, version: Version) -> None:
    try:
        n = store.preload(job, version)
        log.debug("preloaded %d tensors of %s %s", n, job, version)
    except Exception as exc:  # a version deleted meanwhile, a damaged manifest: requests report it themselves
        log.debug("preload of %s %s failed: %s", job, version, exc)


def _required_header(request: Request, name: str) -> str:
    value = request.headers.get(name)
    if value is None:
        raise InvalidInput(f"header {name} is required")
    return value


async def _runs_response(
    runs: list[ChunkRun],
    checksum: str | None,
    nbytes: int,
    headers: dict[str, str],
    metrics: _Metrics,
    *,
    sendfile: bool,
    single_pass_bytes: int,
    piece_bytes: int,
) -> Response:
    """A body that is runs of chunk files, sent from the page cache without being copied in this process.

    With ``sendfile`` (the server offers :data:`~tenplex.serving.SENDFILE_EXTENSION`)
    the chunk files' ranges go to the socket with ``sendfile(2)``: the kernel
    hands their page-cache pages to the socket, no copy at all on this side
    (see :class:`_SendfileResponse`); a checksum that is not known from the
    recorded ones is computed through maps first. Otherwise the body is sent
    from read-only maps of the pages: the socket write copies them straight
    from the page cache, as a server of bytes already in memory would. ``checksum`` (a whole shard's recorded one) or else the crc32c of
    the very bytes that are sent goes into the header, so the header must be
    known before the first byte: up to ``single_pass_bytes`` the runs are
    mapped once, checksummed and sent from the same maps; a larger body is
    checksummed batch by batch (maps dropped after each) and then sent in
    batches of ``piece_bytes``, the next batch mapped while one is sent.
    Chunk files are never written in place (committed versions are
    immutable, every write makes new files), so what was checksummed is what
    is sent; a damaged disk still shows up as a mismatch at the client.
    """
    if sendfile:
        if checksum is None:
            checksum = format_checksum(await to_thread.run_sync(checksum_runs, runs, piece_bytes))
        headers[CHECKSUM_HEADER] = checksum
        return _SendfileResponse(runs, nbytes, headers, metrics, piece_bytes)
    if nbytes <= single_pass_bytes and chunks_of(runs) <= MAX_MAPS:

        def map_and_checksum() -> tuple[list[memoryview], str]:
            if checksum is not None:
                return map_runs(runs), checksum
            views = map_runs(runs, fault_in=False)  # the checksum pass maps (and reads) every page
            return views, format_checksum(crc_of_views(views))

        if nbytes <= INLINE_BYTES:  # cheaper than the two thread switches of a hop to a worker thread
            views, headers[CHECKSUM_HEADER] = map_and_checksum()
        else:
            views, headers[CHECKSUM_HEADER] = await to_thread.run_sync(map_and_checksum)
        return _ViewsResponse(views, headers, metrics)
    if checksum is None:
        checksum = format_checksum(await to_thread.run_sync(checksum_runs, runs, piece_bytes))
    headers[CHECKSUM_HEADER] = checksum
    headers["Content-Length"] = str(nbytes)
    batches = mapped_batches(runs, piece_bytes)
    first = await to_thread.run_sync(next, batches, [])  # a missing chunk file fails here, before the headers
    return StreamingResponse(_send_views(first, batches, metrics), media_type="application/octet-stream", headers=headers)


class _Part:
    """One region of a batch read: its header entry and where its bytes come from (chunk-file runs or memory)."""

    __slots__ = ("checksum", "data", "dtype", "exact", "nbytes", "runs", "shape")

    def __init__(self, dtype: str, shape: tuple[int, ...], nbytes: int, runs: list[ChunkRun] | None, exact: ShardInfo | None) -> None:
        self.dtype = dtype
        self.shape = shape
        self.nbytes = nbytes
        self.runs = runs
        self.exact = exact
        self.checksum = exact.checksum if exact is not None else ""
        self.data: memoryview | None = None

    @classmethod
    def of(cls, reader: TensorReader, box: Region, *, sendfile: bool, min_run_bytes: int, piece_bytes: int) -> _Part:
        """Plan one region (raising for a region the shards do not cover); runs only where ``sendfile`` can send them.

        A small region that is one run (a whole bias in its single chunk
        file) is sent as a run too: in a batch it costs no hand-off of its own.
        """
        reader.plan(box)
        nbytes = box.volume * reader.itemsize
        runs = reader.runs(box, max(1, min(min_run_bytes, nbytes))) if sendfile else None
        part = cls(reader.dtype, box.shape, nbytes, runs, reader.exact_shard(box))
        if runs is not None and part.exact is None:
            recorded = reader.recorded_checksum(runs)
            part.checksum = format_checksum(recorded if recorded is not None else checksum_runs(runs, piece_bytes))
        return part

    def read(self, reader: TensorReader, box: Region) -> None:
        buf = np.empty(box.shape, storage_dtype(reader.dtype))
        reader.read(box, buf)
        if self.exact is None:
            self.checksum = format_checksum(crc_of(buf))
        self.data = byte_view(buf)


class _PartsResponse(Response):
    """The body of a batch read: its parts in order, consecutive runs of chunk files sent by one ``sendfile`` hand-off.

    Chunk files are opened batch by batch (at most ``MAX_MAPS`` at once, see
    :func:`~tenplex.store.rawchunks.run_batches`) right before they are sent;
    one missing on disk (a damaged store) ends the body early and closes the
    connection, which the client reports as a failed read of this store.
    """

    media_type = "application/octet-stream"

    def __init__(self, parts: list[_Part], headers: dict[str, str], metrics: _Metrics, batch_bytes: int) -> None:
        super().__init__(content=b"", headers=headers)
        self.headers["content-length"] = str(sum(p.nbytes for p in parts))
        # consecutive parts of one kind merged: a list of runs (to sendfile) or one memoryview
        self._segments: list[list[ChunkRun] | memoryview] = []
        for p in parts:
            if p.runs is not None:
                if self._segments and isinstance(self._segments[-1], list):
                    self._segments[-1].extend(p.runs)
                else:
                    self._segments.append(list(p.runs))
            elif p.nbytes:
                assert p.data is not None
                self._segments.append(p.data)
        self._metrics = metrics
        self._batch_bytes = batch_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        segments, self._segments = self._segments, []
        if not segments:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        fds: dict[tuple[int, tuple[int, ...]], int] = {}
        try:
            for i, segment in enumerate(segments):
                last_segment = i == len(segments) - 1
                if isinstance(segment, memoryview):
                    await send({"type": "http.response.body", "body": segment, "more_body": not last_segment})
                    self._metrics.bytes_out.inc(segment.nbytes)
                    continue
                batches = list(run_batches(segment, self._batch_bytes))
                for j, batch in enumerate(batches):
                    ranges = open_runs(batch, fds)
                    more = not (last_segment and j == len(batches) - 1)
                    await send({"type": SENDFILE_MESSAGE, "files": ranges, "more_body": more})
                    self._metrics.bytes_out.inc(sum(n for _fd, _offset, n in ranges))
                    for fd in fds.values():
                        os.close(fd)
                    fds.clear()
        finally:
            for fd in fds.values():
                os.close(fd)


class _ViewsResponse(Response):
    """A bounded body of memoryviews, sent one after the other.

    Unlike :class:`StreamingResponse` it needs no task listening for a client
    disconnect (uvicorn drops what is sent to a closed connection, and the
    body is bounded): one task less per request.
    """

    media_type = "application/octet-stream"

    def __init__(self, views: list[memoryview], headers: dict[str, str], metrics: _Metrics) -> None:
        super().__init__(content=b"", headers=headers)
        self.headers["content-length"] = str(sum(v.nbytes for v in views))
        self._views = views
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        views, self._views = self._views, []
        if not views:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        views.reverse()  # popped from the end: each view (and its map) is dropped once handed over
        while views:
            view = views.pop()
            await send({"type": "http.response.body", "body": view, "more_body": bool(views)})
            self._metrics.bytes_out.inc(view.nbytes)
            del view


class _SendfileResponse(Response):
    """A body of chunk-file ranges sent with ``sendfile(2)`` by the server (:data:`SENDFILE_MESSAGE`).

    The ranges go in batches of at most ``batch_bytes`` in at most
    ``MAX_MAPS`` chunk files, each batch's files opened just before it is sent
    and closed after; the first batch is opened here, so that a missing or
    damaged chunk file fails the request before any header is sent.
    """

    media_type = "application/octet-stream"

    def __init__(self, runs: list[ChunkRun], nbytes: int, headers: dict[str, str], metrics: _Metrics, batch_bytes: int) -> None:
        super().__init__(content=b"", headers=headers)
        self.headers["content-length"] = str(nbytes)
        self._batches = run_batches(runs, batch_bytes)
        self._metrics = metrics
        self._fds: dict[tuple[int, tuple[int, ...]], int] = {}
        self._first: list[tuple[int, int, int]] | None = None
        first = next(self._batches, None)
        if first is not None:
            try:
                self._first = open_runs(first, self._fds)
            except BaseException:
                self._close()
                raise

    def _close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            ranges = self._first
            if ranges is None:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            while ranges is not None:
                batch = next(self._batches, None)
                await send({"type": SENDFILE_MESSAGE, "files": ranges, "more_body": batch is not None})
                self._metrics.bytes_out.inc(sum(n for _fd, _offset, n in ranges))
                self._close()
                ranges = open_runs(batch, self._fds) if batch is not None else None
        finally:
            self._close()

    def __del__(self) -> None:  # a response built but never sent (the request failed before it)
        if getattr(self, "_fds", None):
            self._close()


async def _send_views(
    first: list[memoryview], more: Iterator[list[memoryview]] | None, metrics: _Metrics
) -> AsyncIterator[memoryview]:
    """Yield the views of ``first`` and then of ``more``'s batches, mapping (or reading) the next while one is sent.

    Each view is let go of as soon as it is handed to the transport, so a
    chunk file's map is unmapped once the transport has sent it: the maps
    held are those of the batch being sent and of the one being prepared.
    """
    pending: asyncio.Future[list[memoryview] | None] | None = None
    batch: list[memoryview] | None = first
    try:
        while batch is not None:
            if more is not None:
                pending = asyncio.ensure_future(to_thread.run_sync(next, more, None))
            batch.reverse()  # popped from the end: each view is dropped once sent
            while batch:
                view = batch.pop()
                yield view
                metrics.bytes_out.inc(view.nbytes)
                del view
            batch = await pending if pending is not None else None
            pending = None
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


def _read_pieces(reader: TensorReader, box: Region, st: np.dtype, piece_bytes: int) -> Iterator[list[memoryview]]:
    """The region's bytes piece by piece (what :func:`_send_views` sends, reading the next one meanwhile), each in
    a fresh buffer: the transport may still hold a reference to the previous one's memory while it drains it."""
    for piece in slabs(box.shape, st.itemsize, piece_bytes):
        buf = np.empty(piece.shape, st)
        reader.read(piece.shift(box.start), buf)
        yield [byte_view(buf)]


async def _receive_shard(request: Request, writer: ShardWriter, expected: int) -> None:
    """Copy the body into piece buffers; each full piece goes to zarr in a thread while the next one fills."""
    st = storage_dtype(writer.dtype)
    pieces = writer.pieces
    index = 0
    buf = np.empty(pieces[0].shape, st)
    view = byte_view(buf)
    filled = 0
    received = 0
    pending: Awaitable[None] | None = None

    async def flush(i: int, data: np.ndarray) -> None:
        await to_thread.run_sync(writer.write_piece, i, data)

    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > expected:
                raise InvalidInput(f"body is longer than the {expected} bytes region {writer.region.format()!r} of {writer.dtype} needs")
            pos = 0
            data = memoryview(chunk)  # slices of it are views, not copies
            while pos < len(chunk):
                take = min(len(chunk) - pos, len(view) - filled)
                view[filled : filled + take] = data[pos : pos + take]
                filled += take
                pos += take
                if filled == len(view) and index < len(pieces):
                    if pending is not None:
                        await pending
                    pending = asyncio.ensure_future(flush(index, buf))
                    index += 1
                    if index < len(pieces):
                        buf = np.empty(pieces[index].shape, st)
                        view = byte_view(buf)
                        filled = 0
    except BaseException:
        if pending is not None:  # let the piece being written finish before the caller aborts the shard
            with contextlib.suppress(BaseException):
                await pending
        raise
    if pending is not None:
        await pending
    if received != expected:
        raise InvalidInput(
            f"body is {received} bytes, but region {writer.region.format()!r} of {writer.dtype} needs {expected} bytes"
        )
    while index < len(pieces):  # zero-byte pieces (empty regions)
        await flush(index, np.empty(pieces[index].shape, st))
        index += 1


class StoreServer(BackgroundServer):
    """A store daemon in a background thread, for tests and embedding: ``with StoreServer(root) as s: s.url``."""

    def __init__(
        self,
        root: str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        *,
        store: LocalStore | None = None,
        log_level: str = "warning",
        single_pass_bytes: int = SINGLE_PASS_BYTES,
        piece_bytes: int = PIECE_BYTES,
        min_run_bytes: int = MIN_RUN_BYTES,
        sendfile_min_bytes: int = SENDFILE_MIN_BYTES,
    ) -> None:
        self.store = store if store is not None else LocalStore(root)
        self.token = token
        app = create_app(
            self.store, token=token, single_pass_bytes=single_pass_bytes, piece_bytes=piece_bytes,
            min_run_bytes=min_run_bytes, sendfile_min_bytes=sendfile_min_bytes,
        )
        super().__init__(app, host, port, log_level=log_level)

    def start(self, timeout: float = 30.0) -> StoreServer:
        super().start(timeout)
        return self
