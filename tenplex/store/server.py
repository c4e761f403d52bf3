"""The node's store daemon: a :class:`LocalStore` over HTTP (FastAPI on uvicorn, uvloop + httptools).

Routes (all but ``/healthz`` need ``Authorization: Bearer <token>`` when a token is set)::

    GET    /healthz
    GET    /metrics                                          Prometheus text format
    GET    /v1/jobs
    GET    /v1/jobs/{job}/versions
    GET    /v1/jobs/{job}/versions/{version}                 manifest JSON
    GET    /v1/jobs/{job}/versions/{version}/tensors/{tensor}?region=a:b,c:d[&uncommitted=1]
    PUT    /v1/jobs/{job}/versions/{version}/tensors/{tensor}?region=a:b,c:d   raw body
    POST   /v1/jobs/{job}/versions/{version}/commit
    DELETE /v1/jobs/{job}/versions/{version}

Region reads answer raw C-order bytes with ``X-Tenplex-Dtype``,
``X-Tenplex-Shape`` (``a,b``; empty for 0-d) and ``X-Tenplex-Checksum``
(``crc32c:xxxxxxxx`` of the body). How the body is produced, by size:

- a region that is exactly a stored shard: the checksum recorded at write
  time is the header (no checksum pass; a corrupted disk shows up as a
  checksum mismatch at the client);
- up to ``single_pass_bytes`` (64 MiB): read into one buffer (checksummed
  unless it is a whole shard) and answered as a ``memoryview`` body (the
  fastest path uvicorn has);
- a larger whole shard: the body streams in 32 MiB pieces, the next piece
  read while the current one is sent;
- any other large region: a first pass computes the checksum through one
  bounded buffer, then the same pieces stream. Clients split big reads into
  requests of at most ``single_pass_bytes`` anyway (see
  :class:`~tenplex.store.client.StoreClient`), so this path is for others.

Uploads stream the request body into piece buffers that go to zarr as they
fill (two pieces of memory at most), the crc32c computed on the way; a body
of the wrong length stores nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable
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

from tenplex.errors import InvalidInput, TenplexError, Unauthorized
from tenplex.ptc.dtypes import check_dtype, itemsize, storage_dtype
from tenplex.ptc.region import Region
from tenplex.serving import (
    BackgroundServer,
    bind_socket,
    serve_forever,
    url_for,
    uvicorn_config,
    write_port_file,
)
from tenplex.store.buffers import byte_view, crc_of, slabs
from tenplex.store.local import LocalStore, ShardWriter, TensorReader
from tenplex.store.model import format_checksum
from tenplex.store.names import check_job, check_tensor, check_version

log = logging.getLogger(__name__)

SINGLE_PASS_BYTES = 64 << 20
PIECE_BYTES = 32 << 20
TOKEN_ENV = "TENPLEX_TOKEN"
_ROOT_ENV = "TENPLEX_STORE_ROOT"
_OPTIONS_ENV = "TENPLEX_STORE_OPTIONS"
_MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own switch to multiprocess mode


def format_shape(shape: tuple[int, ...] | list[int]) -> str:
    return ",".join(str(n) for n in shape)


def parse_shape(text: str, *, what: str) -> tuple[int, ...]:
    text = text.strip()
    if text == "":
        return ()
    try:
        shape = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise InvalidInput(f"{what} {text!r} is not a comma-separated list of integers") from None
    if any(n < 0 for n in shape):
        raise InvalidInput(f"{what} {text!r} has a negative dimension")
    return shape


class _Metrics:
    """The daemon's Prometheus metrics, in a registry of its own (several servers share a test process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
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


def _error_response(exc: TenplexError) -> JSONResponse:
    return JSONResponse(exc.to_json(), status_code=exc.http_status)


def create_app(
    store: LocalStore,
    *,
    token: str | None,
    single_pass_bytes: int = SINGLE_PASS_BYTES,
    piece_bytes: int = PIECE_BYTES,
) -> FastAPI:
    """The FastAPI application serving ``store``; ``token`` (if not None) is required on everything but /healthz.

    ``single_pass_bytes`` and ``piece_bytes`` bound the server memory per request (see the module doc).
    """
    if single_pass_bytes < 1 or piece_bytes < 1:
        raise InvalidInput(f"single_pass_bytes and piece_bytes must be positive, got {single_pass_bytes}, {piece_bytes}")
    metrics = _Metrics()
    app = FastAPI(title="tenplex store", version="1", docs_url=None, redoc_url=None)
    app.state.store = store
    app.state.metrics = metrics
    expected = f"Bearer {token}".encode() if token else None

    async def require_token(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, expected):
            raise Unauthorized("missing or wrong bearer token (Authorization: Bearer <token>)")

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
        if os.environ.get(_MULTIPROC_ENV):  # several worker processes: sum their metric files
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/jobs")
    async def list_jobs() -> dict[str, Any]:
        return {"jobs": await to_thread.run_sync(store.jobs)}

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

    @api.post("/v1/jobs/{job}/versions/{version}/commit")
    async def commit(job: str, version: str) -> dict[str, Any]:
        check_job(job)
        v = check_version(version)
        manifest = await to_thread.run_sync(store.commit, job, v)
        return {"job": job, "version": str(v), "committed": True, "shards": len(manifest.shards), "nbytes": manifest.nbytes}

    @api.delete("/v1/jobs/{job}/versions/{version}")
    async def delete(job: str, version: str) -> dict[str, Any]:
        check_job(job)
        v = check_version(version)
        await to_thread.run_sync(store.delete, job, v)
        return {"job": job, "version": str(v), "deleted": True}

    @api.get("/v1/jobs/{job}/versions/{version}/tensors/{tensor:path}")
    async def get_region(job: str, version: str, tensor: str, region: str | None = None, uncommitted: bool = False) -> Response:
        check_job(job)
        v = check_version(version)
        check_tensor(tensor)
        reader: TensorReader = await to_thread.run_sync(
            lambda: store.open_tensor(job, v, tensor, committed_only=not uncommitted)
        )
        box = reader.parse_region(region) if region is not None else Region.full(reader.global_shape)
        reader.plan(box)  # fail with 404/416/409 before any header is sent
        nbytes = box.volume * reader.itemsize
        headers = {
            "X-Tenplex-Dtype": reader.dtype,
            "X-Tenplex-Shape": format_shape(box.shape),
            "X-Tenplex-Global-Shape": format_shape(reader.global_shape),
        }
        st = storage_dtype(reader.dtype)
        # a whole stored shard carries the checksum recorded when it was written: no checksum pass,
        # and damage on this disk shows up as a mismatch at the client
        exact = reader.exact_shard(box)
        if nbytes <= single_pass_bytes:
            buf = np.empty(box.shape, st)

            def read_and_checksum() -> str:  # both off the event loop, which keeps sending other bodies
                reader.read(box, buf)
                return exact.checksum if exact is not None else format_checksum(crc_of(buf))

            headers["X-Tenplex-Checksum"] = await to_thread.run_sync(read_and_checksum)
            metrics.bytes_out.inc(nbytes)
            return Response(content=byte_view(buf), media_type="application/octet-stream", headers=headers)
        if exact is not None:
            headers["X-Tenplex-Checksum"] = exact.checksum
        else:
            crc = await to_thread.run_sync(reader.checksum, box, piece_bytes)
            headers["X-Tenplex-Checksum"] = format_checksum(crc)
        headers["Content-Length"] = str(nbytes)
        return StreamingResponse(
            _stream_region(reader, box, st, metrics, piece_bytes), media_type="application/octet-stream", headers=headers
        )

    @api.put("/v1/jobs/{job}/versions/{version}/tensors/{tensor:path}")
    async def put_shard(job: str, version: str, tensor: str, request: Request, region: str | None = None) -> dict[str, Any]:
        check_job(job)
        v = check_version(version)
        check_tensor(tensor)
        dtype = check_dtype(_required_header(request, "x-tenplex-dtype"))
        gshape = parse_shape(_required_header(request, "x-tenplex-global-shape"), what="X-Tenplex-Global-Shape")
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
    # outermost, so it sees the final status of everything, errors included
    app.add_middleware(_MetricsMiddleware, metrics=metrics)
    return app


def _required_header(request: Request, name: str) -> str:
    value = request.headers.get(name)
    if value is None:
        raise InvalidInput(f"header {name} is required")
    return value


async def _stream_region(
    reader: TensorReader, box: Region, st: np.dtype, metrics: _Metrics, piece_bytes: int
) -> AsyncIterator[memoryview]:
    """Yield the region's bytes piece by piece, reading the next piece while the current one is sent.

    A fresh buffer per piece: the transport may still hold a reference to the
    previous one's memory while it drains it.
    """
    pieces = list(slabs(box.shape, st.itemsize, piece_bytes))

    def read(piece: Region) -> np.ndarray:
        buf = np.empty(piece.shape, st)
        reader.read(piece.shift(box.start), buf)
        return buf

    pending: asyncio.Future[np.ndarray] | None = asyncio.ensure_future(to_thread.run_sync(read, pieces[0]))
    try:
        for i in range(len(pieces)):
            assert pending is not None
            buf = await pending
            pending = asyncio.ensure_future(to_thread.run_sync(read, pieces[i + 1])) if i + 1 < len(pieces) else None
            yield byte_view(buf)
            metrics.bytes_out.inc(buf.nbytes)
            del buf
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


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


def serve(
    root: str | Path,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    *,
    port_file: str | Path | None = None,
    chunk_bytes: int | None = None,
    log_level: str = "info",
    tune_malloc: bool = True,
    map_chunks: bool = True,
    workers: int = 1,
) -> None:
    """Run the node daemon until interrupted (blocking). ``port=0`` picks a free port.

    The bound URL is logged, and with ``port_file`` the port is written there
    (atomically) once the socket listens, so a parent process can find it.
    ``token`` defaults to the ``TENPLEX_TOKEN`` environment variable.
    """
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    if workers < 1:
        raise InvalidInput(f"workers must be >= 1, got {workers}")
    options: dict[str, Any] = {"map_chunks": map_chunks}
    if chunk_bytes is not None:
        options["chunk_bytes"] = chunk_bytes
    store = LocalStore(root, **options)
    sock = bind_socket(host, port)
    bound = sock.getsockname()[1]
    if port_file is not None:
        write_port_file(port_file, bound)
    log.info(
        "tenplex store serving %s at %s (auth %s, %d worker process%s)",
        store.root, url_for(host, bound), "on" if token else "off", workers, "" if workers == 1 else "es",
    )
    if workers > 1:
        _serve_workers(sock, store, token, workers, log_level, tune_malloc=tune_malloc)
        log.info("tenplex store at %s stopped", url_for(host, bound))
        return
    if tune_malloc:
        _keep_freed_memory()
    try:
        serve_forever(create_app(store, token=token), sock, log_level=log_level)
    finally:
        store.close()
    log.info("tenplex store at %s stopped", url_for(host, bound))


def _serve_workers(sock: socket.socket, store: LocalStore, token: str | None, workers: int, log_level: str, *, tune_malloc: bool) -> None:
    """Several uvicorn worker processes on one listening socket (uvicorn's supervisor restarts dead ones).

    One event loop sends every response body from one thread, so on a node
    with several cores one process cannot keep several parallel transfers
    busy. Workers share the root safely (the store's structural changes take
    a file lock); their Prometheus metrics are summed through a shared
    multiprocess directory.
    """
    from uvicorn.supervisors import Multiprocess

    metrics_dir = tempfile.mkdtemp(prefix="tenplex-store-metrics-")
    env = {
        _ROOT_ENV: str(store.root),
        _OPTIONS_ENV: json.dumps({"chunk_bytes": store.chunk_bytes, "map_chunks": store.map_chunks, "tune_malloc": tune_malloc}),
        _MULTIPROC_ENV: metrics_dir,
        TOKEN_ENV: token or "",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the spawned workers read their configuration from the environment
    try:
        config = uvicorn_config("tenplex.store.server:app_from_env", log_level, factory=True, workers=workers)
        with contextlib.suppress(KeyboardInterrupt):
            Multiprocess(config, sockets=[sock]).run()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(metrics_dir, ignore_errors=True)


def app_from_env() -> FastAPI:
    """The app of one worker process of :func:`serve` with ``workers > 1`` (configured by the parent's environment)."""
    root = os.environ.get(_ROOT_ENV)
    if not root:
        raise InvalidInput(f"{_ROOT_ENV} is not set: app_from_env is only for worker processes started by serve()")
    options = json.loads(os.environ.get(_OPTIONS_ENV, "{}"))
    if options.pop("tune_malloc", False):
        _keep_freed_memory()
    return create_app(LocalStore(root, **options), token=os.environ.get(TOKEN_ENV) or None)


def _keep_freed_memory() -> None:
    """Make glibc reuse freed region buffers instead of returning them to the kernel.

    Every region read allocates a buffer of up to ``single_pass_bytes``; by
    default glibc serves such sizes with a fresh ``mmap`` and unmaps them on
    free, so every request pays page faults on all of its bytes (measured: a
    fresh 64 MiB buffer fills 3-10x slower than a reused one on a loaded VM).
    With ``mmap`` off and a high trim threshold the daemon's heap keeps the
    freed buffers (bounded by the peak of concurrent requests) and reuses them.
    Only the daemon process does this; embedding processes keep their settings.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        log.debug("not glibc: malloc left as it is")
        return
    m_trim_threshold, m_mmap_max = -1, -4
    ok = libc.mallopt(m_mmap_max, 0) == 1 and libc.mallopt(m_trim_threshold, 1 << 30) == 1
    log.debug("malloc tuned for buffer reuse: %s", ok)


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
    ) -> None:
        self.store = store if store is not None else LocalStore(root)
        self.token = token
        app = create_app(self.store, token=token, single_pass_bytes=single_pass_bytes, piece_bytes=piece_bytes)
        super().__init__(app, host, port, log_level=log_level)

    def start(self, timeout: float = 30.0) -> StoreServer:
        super().start(timeout)
        return self
