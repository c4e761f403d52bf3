"""Client of the store daemon: the :class:`~tenplex.store.base.TensorStore` of a node reached over HTTP.

Used by the transformer's executor (the sources of a transform), by workers
without their node's store directory, and by the CLI; the headers, limits and
request bodies it speaks are :mod:`tenplex.store.wire`, shared with the server.

Bulk bytes go straight from the socket into the caller's buffer
(``http.client`` ``readinto`` a memoryview of it, 2-3x faster than requests or
httpx for large bodies), and uploads are sent from the caller's buffer.
Connections are kept alive in a bounded pool. A read is split into
consecutive C-order pieces, each its own request landing in its slice of the
buffer: enough pieces for the requests in flight to keep the server's workers
busy (a single request cannot overlap the server's work with the transfer,
several can), none smaller than ``MIN_SPLIT_BYTES`` or larger than
``max_request_bytes`` (64 MiB): every request costs both ends a fixed amount
of CPU, so a read of many regions is not cut further than its concurrency
needs. :meth:`StoreClient.read_many` spreads the pieces over its threads.
:meth:`StoreClient.read_regions` reads many regions of one version in one
request per batch (the daemon's ``POST .../regions``): for the hundreds of
small shards of a transform, the per-request cost of both ends is paid once
per batch. Connection errors and 5xx answers are retried with exponential
backoff; every payload is checked against its crc32c header.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import crc32c
import numpy as np

from tenplex.core.buffers import byte_view
from tenplex.core.http import SERVER_ERRORS, error_from, next_try, retry_policy
from tenplex.core.tls import ENV_TLS_CA, client_context, handshake_failure
from tenplex.core.version import Version
from tenplex.errors import (
    ChecksumMismatch,
    InvalidInput,
    StoreUnavailable,
    TenplexError,
)
from tenplex.ptc.dtypes import itemsize, name_of_torch
from tenplex.ptc.region import Region
from tenplex.sockets import create_connection
from tenplex.store.base import RegionRead, TensorStore
from tenplex.store.buffers import ReceivedCrcs, host_buffer, host_data, payload_offset, slabs
from tenplex.store.model import Manifest, ShardInfo, VersionInfo, format_checksum
from tenplex.store.names import check_job, check_tensor, check_version
from tenplex.store.wire import (
    CHECKSUM_HEADER,
    DTYPE_HEADER,
    GLOBAL_SHAPE_HEADER,
    MAX_BATCH_REGIONS,
    MAX_COMMIT_WAIT_S,
    PARTS_HEADER,
    SHAPE_HEADER,
    TOKEN_ENV,
    LinkRequest,
    RegionsRequest,
    ReservationRequest,
    format_shape,
    parse_parts,
    versions_path,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

IDLE_REUSE_S = 15.0
"""Idle connections older than this are not reused: the daemon closes kept-alive connections after 30 s."""

_PEER_CLOSED = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)

MAX_REQUEST_BYTES = 64 << 20
MIN_SPLIT_BYTES = 16 << 20  # a read is not split into requests smaller than this (callers with many reads in flight need no more)
VERIFY_BLOCK_BYTES = 1 << 20
"""Bodies are received and checksummed in blocks of this size (about a core's L2 cache)."""
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """One region to fetch into ``out`` (C-contiguous, shape ``region.shape``)."""

    job: str
    version: Version | str
    tensor: str
    region: Region
    out: Any  # np.ndarray | torch.Tensor


@dataclass(slots=True)
class _Piece:
    """A sub-request of a read: a region and the bytes of the destination it fills."""

    job: str
    version: Version
    tensor: str
    region: Region
    target: memoryview
    item: int
    verify: bool
    uncommitted: bool


class StoreClient(TensorStore):
    """HTTP client of one store daemon (``url`` like ``http://10.0.0.5:7070``); thread-safe.

    ``token`` defaults to ``$TENPLEX_TOKEN``. One :meth:`read_into` is split
    into up to ``read_concurrency`` requests in flight (more where a piece
    would exceed ``max_request_bytes``); at most ``max_connections`` are open.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.2,
        max_connections: int = 8,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        read_concurrency: int = 2,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidInput(f"store URL {url!r} must look like http://HOST:PORT")
        if retries < 0 or max_connections < 1 or timeout <= 0 or max_request_bytes < 1 or read_concurrency < 1:
            raise InvalidInput(
                f"bad client settings: retries={retries} (>= 0), max_connections={max_connections} (>= 1), "
                f"timeout={timeout} (> 0), max_request_bytes={max_request_bytes} (>= 1), "
                f"read_concurrency={read_concurrency} (>= 1)"
            )
        self.url = url.rstrip("/")
        self._https = parts.scheme == "https"
        self._hostname = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self._retry = retry_policy(retries, backoff, SERVER_ERRORS)
        self.max_request_bytes = max_request_bytes
        self.read_concurrency = read_concurrency
        self._slots = threading.BoundedSemaphore(max_connections)
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []  # (connection, when it went idle)
        self._busy: set[http.client.HTTPConnection] = set()  # connections a request is using now
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"StoreClient({self.url!r})"

    # -- connections --------------------------------------------------------

    def _new_connection(self, timeout: float) -> http.client.HTTPConnection:
        """A new connection; ``https`` verifies the daemon against ``$TENPLEX_TLS_CA`` (:mod:`tenplex.core.tls`)."""
        if self._https:
            return http.client.HTTPSConnection(self._hostname, self._port, timeout=timeout, context=client_context())
        return http.client.HTTPConnection(self._hostname, self._port, timeout=timeout)

    @contextmanager
    def _connection(self) -> Iterator[tuple[http.client.HTTPConnection, bool]]:
        """A connection from the idle pool (and True) or a new one (and False), returned to the pool after use."""
        if self._closed:
            raise InvalidInput(f"the client of {self.url} is closed")
        with self._slots:
            conn = None
            now = time.monotonic()
            with self._lock:
                while self._idle and conn is None:
                    candidate, since = self._idle.pop()
                    if now - since < IDLE_REUSE_S:
                        conn = candidate
                    else:  # the server has probably closed it (keep-alive timeout): do not find out the hard way
                        candidate.close()
            if conn is None:
                conn = self._new_connection(self.timeout)
                conn._create_connection = create_connection  # type: ignore[attr-defined]  # unpaced to this node
                reused = False
            else:
                reused = True
            with self._lock:
                self._busy.add(conn)
            ok = False
            try:
                yield conn, reused
                ok = True
            finally:
                with self._lock:
                    self._busy.discard(conn)
                if ok and conn.sock is not None and not self._closed:
                    with self._lock:
                        self._idle.append((conn, time.monotonic()))
                else:
                    conn.close()

    def _call(
        self,
        method: str,
        path: str,
        handle: Callable[[http.client.HTTPResponse], T],
        *,
        body: memoryview | bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> T:
        """One request, tried again on a connection error or a 5xx answer (:mod:`tenplex.core.http`'s policy);
        ``handle`` reads a 2xx response completely and returns the result."""
        hdrs = {**self._auth, **(headers or {})}
        retry = self._retry
        stale_retry = True
        while True:
            reused = False
            try:
                with self._connection() as (conn, reused):
                    conn.request(method, self._prefix + path, body=body, headers=hdrs)
                    resp = conn.getresponse()
                    if resp.status < 400:
                        result = handle(resp)
                        if resp.will_close:
                            conn.close()
                        return result
                    payload = resp.read()
                    if resp.will_close:
                        conn.close()
                error = error_from(resp.status, payload, f"store {self.url}", StoreUnavailable, where_last=True)
                if not retry.is_retry(method, resp.status) or isinstance(error, ChecksumMismatch):
                    raise error  # a 5xx of corrupted data: another read meets the same bytes
                log.warning("store %s answered %s %s with %d", self.url, method, path, resp.status)
                if (after := next_try(retry, method, path)) is None:
                    raise error
                retry = after
            except (OSError, http.client.HTTPException) as exc:
                if handshake_failure(exc):  # another try meets the same certificate
                    raise StoreUnavailable(f"TLS handshake with store {self.url} failed: {exc} (is its certificate "
                                           f"signed by the CA in ${ENV_TLS_CA}?)") from None
                if reused and stale_retry and isinstance(exc, _PEER_CLOSED):
                    # A kept-alive connection the server closed while it sat idle: not a failure of the
                    # server. Retry at once on a new connection, once, without using up a try.
                    stale_retry = False
                    log.debug("store %s: reused connection was closed by the server; reconnecting", self.url)
                    continue
                tries = len(retry.history) + 1
                log.warning("store %s: %s %s failed (attempt %d of %d): %s", self.url, method, path, tries,
                            self.retries + 1, exc)
                if (after := next_try(retry, method, path, exc)) is None:
                    raise StoreUnavailable(f"store {self.url} failed {method} {path} after {tries} attempts: "
                                           f"{exc}") from None
                retry = after

    def _json(self, method: str, path: str, body: bytes | None = None, content_type: str = "application/json") -> Any:
        """A request answered with JSON; ``body`` (if any) is sent as ``content_type``."""
        headers = {"Content-Type": content_type} if body is not None else None
        return self._call(method, path, lambda resp: json.loads(resp.read()), body=body, headers=headers)

    def request_json(self, method: str, path: str, body: Any = None, *, content_type: str | None = None) -> Any:
        """A request to another route of the daemon (``path`` from ``/v1/...``) answered with JSON, with the
        client's auth, retries and error mapping; ``body`` (if not None) is sent as JSON, or as it is when it
        is ``bytes`` (a control message in a binary form, e.g. a transform request, sent as ``content_type``).
        For control messages only: bulk bytes never go through JSON."""
        if isinstance(body, bytes):
            return self._json(method, path, body, content_type or "application/octet-stream")
        return self._json(method, path, None if body is None else json.dumps(body, separators=(",", ":")).encode())

    # -- reads --------------------------------------------------------------

    def _piece_bytes(self, nbytes: int, concurrency: int) -> int:
        """Request size for reading ``nbytes`` with ``concurrency`` requests in flight (see the module doc)."""
        return min(self.max_request_bytes, max(MIN_SPLIT_BYTES, -(-nbytes // concurrency)))

    def _pieces(
        self, job: str, version: Version | str, tensor: str, region: Region, host: np.ndarray, *,
        verify: bool, uncommitted: bool, piece_bytes: int,
    ) -> list[_Piece]:
        if not isinstance(region, Region):
            raise InvalidInput(f"region must be a Region, got {type(region).__name__}")
        if host.shape != region.shape:
            raise InvalidInput(f"output buffer has shape {list(host.shape)}, region {region.format()!r} has {list(region.shape)}")
        v = check_version(version)
        check_job(job)
        check_tensor(tensor)
        raw = byte_view(host)
        item = host.dtype.itemsize
        out = []
        for piece in slabs(region.shape, item, piece_bytes):
            start = payload_offset(region.shape, item, piece)
            out.append(
                _Piece(job, v, tensor, piece.shift(region.start), raw[start : start + piece.volume * item], item, verify, uncommitted)
            )
        return out

    def _fetch(self, p: _Piece) -> None:
        query = urllib.parse.urlencode({"region": p.region.format(), **({"uncommitted": "1"} if p.uncommitted else {})})
        path = f"{versions_path(p.job, p.version, p.tensor)}?{query}"

        def handle(resp: http.client.HTTPResponse) -> None:
            what = f"{p.tensor!r} {p.region.format()!r}"
            self._check_part(resp, what, resp.getheader(DTYPE_HEADER, ""), resp.getheader(SHAPE_HEADER, ""), p.region, p.item)
            length = resp.getheader("Content-Length")
            if length is None or int(length) != len(p.target):
                resp.read()
                raise InvalidInput(f"store {self.url} sent {length} bytes for {what}, expected {len(p.target)}")
            self._receive(resp, p.target, resp.getheader(CHECKSUM_HEADER, "") if p.verify else None, what, p.version)

        self._call("GET", path, handle)

    def _check_part(self, resp: http.client.HTTPResponse, what: str, dtype: str, shape: str, region: Region, item: int) -> None:
        """Refuse (reading the rest of the response) a payload whose shape or element size is not the buffer's."""
        expected_shape = format_shape(region.shape)
        try:
            size = itemsize(dtype)
        except TenplexError:
            size = -1
        if shape != expected_shape or size != item:
            resp.read()
            raise InvalidInput(
                f"store {self.url} sent {dtype} [{shape}] for {what}; "
                f"the buffer holds {item}-byte elements of shape [{expected_shape}]"
            )

    def _receive(self, resp: http.client.HTTPResponse, target: memoryview, checksum: str | None, what: str, version: Version,
                 received: ReceivedCrcs | None = None) -> None:
        """Read ``len(target)`` body bytes into ``target``; with a ``checksum`` (the store's), verify them against it.

        The checksum follows the body block by block while each block is still
        in the CPU cache (a second pass over a large buffer would read it back
        from memory). ``received`` (describing ``target``) gets the running
        crc32c at each of its block boundaries, for the store that writes the
        buffer next (:class:`~tenplex.store.buffers.ReceivedCrcs`).
        """
        total = len(target)
        got = crc = 0
        step = received.block if received is not None and checksum is not None else total
        mark = step
        while got < total:
            n = resp.readinto(target[got : min(total, got + VERIFY_BLOCK_BYTES)])
            if not n:
                raise http.client.IncompleteRead(bytes(0), total - got)
            if checksum is not None:
                end = got + n
                while got < end:
                    cut = min(end, mark)
                    crc = crc32c.crc32c(target[got:cut], crc)
                    got = cut
                    if got in (mark, total):
                        if received is not None:
                            received.prefix.append(crc)
                        mark += step
            else:
                got += n
        if checksum is not None and format_checksum(crc) != checksum:
            raise ChecksumMismatch(
                f"{what} of version {version} from {self.url}: "
                f"payload crc32c {format_checksum(crc)}, the store says {checksum or 'nothing'}"
            )

    def _fetch_batch(
        self, job: str, version: Version,
        batch: Sequence[tuple[str, Region, np.ndarray, ReceivedCrcs | None, Callable[[], None] | None]], verify: bool,
    ) -> None:
        """One ``POST .../regions`` filling every buffer of ``batch`` (and recording the receive pass's crc32c
        prefixes where a :class:`~tenplex.store.buffers.ReceivedCrcs` is given).

        Each region's ``done`` is called once its part of the body is in and verified. A retried request
        reads the parts already done into a scratch buffer and checks them again, never into their buffers
        (which the caller may be storing meanwhile).
        """
        body = RegionsRequest.of((t, r) for t, r, _out, _rc, _done in batch).model_dump_json().encode()
        total = sum(out.nbytes for _t, _r, out, _rc, _done in batch)
        delivered = 0  # parts in and verified (and their done called), kept across attempts

        def handle(resp: http.client.HTTPResponse) -> None:
            try:
                parts = parse_parts(resp.getheader(PARTS_HEADER, ""), len(batch))
            except InvalidInput as exc:
                resp.read()
                raise InvalidInput(f"store {self.url} answered a batch read of {len(batch)} regions: {exc.detail}") from None
            nonlocal delivered
            for (tensor, region, out, _rc, _done), (dtype, shape, _checksum) in zip(batch, parts, strict=True):
                self._check_part(resp, f"{tensor!r} {region.format()!r}", dtype, shape, region, out.dtype.itemsize)
            length = resp.getheader("Content-Length")
            if length is None or int(length) != total:
                resp.read()
                raise InvalidInput(f"store {self.url} sent {length} bytes for a batch read of {total} bytes")
            scratch: memoryview | None = None
            for k, ((tensor, region, out, received, done), (_dtype, _shape, checksum)) in enumerate(zip(batch, parts, strict=True)):
                what = f"{tensor!r} {region.format()!r}"
                if k < delivered:  # a retry: this part is the caller's already; read past it (checked, not kept)
                    scratch = self._drain(resp, out.nbytes, checksum if verify else None, what, version, scratch)
                    continue
                if received is not None:
                    received.prefix.clear()  # a retried request records them anew
                self._receive(resp, byte_view(out), checksum if verify else None, what, version, received)
                delivered = k + 1
                if done is not None:
                    done()

        self._call("POST", f"{versions_path(job, version)}/regions", handle, body=body, headers={"Content-Type": "application/json"})

    def _drain(self, resp: http.client.HTTPResponse, nbytes: int, checksum: str | None, what: str, version: Version,
               scratch: memoryview | None) -> memoryview:
        """Read (and verify) ``nbytes`` of the body into a reused scratch buffer; the scratch buffer."""
        if scratch is None:
            scratch = memoryview(bytearray(min(nbytes, VERIFY_BLOCK_BYTES) or 1))
        crc, left = 0, nbytes
        while left:
            n = resp.readinto(scratch[: min(left, len(scratch))])
            if not n:
                raise http.client.IncompleteRead(bytes(0), left)
            if checksum is not None:
                crc = crc32c.crc32c(scratch[:n], crc)
            left -= n
        if checksum is not None and format_checksum(crc) != checksum:
            raise ChecksumMismatch(f"{what} of version {version} from {self.url}: payload crc32c {format_checksum(crc)}, "
                                   f"the store says {checksum}")
        return scratch

    @contextmanager
    def _host(self, out: np.ndarray | torch.Tensor) -> Iterator[np.ndarray]:
        """A host numpy view of ``out`` (a GPU tensor gets a host staging buffer copied in at the end)."""
        if isinstance(out, np.ndarray):
            if not out.flags.c_contiguous:
                raise InvalidInput(f"output buffer of shape {out.shape} is not C-contiguous")
            yield out
            return
        with host_buffer(out, name_of_torch(out.dtype), what="output buffer") as host:
            yield host

    def read_into(
        self,
        job: str,
        version: Version | str,
        tensor: str,
        region: Region,
        out: np.ndarray | torch.Tensor,
        *,
        verify: bool = True,
        uncommitted: bool = False,
    ) -> None:
        """Fill ``out`` (C-contiguous, shape ``region.shape``, element size of the tensor) with the region."""
        with self._host(out) as host:
            piece_bytes = self._piece_bytes(host.nbytes, self.read_concurrency)
            pieces = self._pieces(job, version, tensor, region, host, verify=verify, uncommitted=uncommitted, piece_bytes=piece_bytes)
            if len(pieces) == 1:
                self._fetch(pieces[0])
            else:  # the server reads piece k+1 while piece k is on the wire
                self._run(pieces, self.read_concurrency)

    def read_regions(self, job: str, version: Version | str, reads: Sequence[RegionRead], *, verify: bool = True) -> None:
        """Fill every ``out`` with its region of one committed version, in as few requests as the limits allow.

        Consecutive reads go together, one request per batch of at most
        ``MAX_BATCH_REGIONS`` regions and ``max_request_bytes`` bytes; a region
        larger than that is read by :meth:`read_into`. One request at a time:
        callers with many batches run several calls in parallel.
        """
        v = check_version(version)
        check_job(job)
        with ExitStack() as stack:
            hosts = []
            for r in reads:  # every read checked before the first request
                host = stack.enter_context(self._host(r.out))
                check_tensor(r.tensor)
                if not isinstance(r.region, Region):
                    raise InvalidInput(f"region must be a Region, got {type(r.region).__name__}")
                if host.shape != r.region.shape:
                    raise InvalidInput(
                        f"output buffer for {r.tensor!r} has shape {list(host.shape)}, region {r.region.format()!r} has {list(r.region.shape)}"
                    )
                # no early done for a GPU tensor: its bytes reach it from the staging buffer as the call ends
                hosts.append((r.tensor, r.region, host, r.received, r.done if host is r.out else None))
            batch: list[tuple[str, Region, np.ndarray, ReceivedCrcs | None, Callable[[], None] | None]] = []
            size = 0
            for tensor, region, host, received, done in hosts:
                if host.nbytes > self.max_request_bytes:
                    self.read_into(job, v, tensor, region, host, verify=verify)
                    continue
                if batch and (len(batch) >= MAX_BATCH_REGIONS or size + host.nbytes > self.max_request_bytes):
                    self._fetch_batch(job, v, batch, verify)
                    batch, size = [], 0
                batch.append((tensor, region, host, received, done))
                size += host.nbytes
            if batch:
                self._fetch_batch(job, v, batch, verify)

    def read_many(self, requests: Iterable[ReadRequest], *, concurrency: int = 4, verify: bool = True) -> None:
        """Fetch many regions with at most ``concurrency`` requests in flight; raises the first failure."""
        if concurrency < 1:
            raise InvalidInput(f"concurrency must be >= 1, got {concurrency}")
        with ExitStack() as stack:
            hosts = [(r, stack.enter_context(self._host(r.out))) for r in requests]
            piece_bytes = self._piece_bytes(sum(h.nbytes for _r, h in hosts), concurrency)
            pieces: list[_Piece] = []
            for r, host in hosts:
                pieces += self._pieces(r.job, r.version, r.tensor, r.region, host, verify=verify, uncommitted=False,
                                       piece_bytes=piece_bytes)
            self._run(pieces, concurrency)

    def _run(self, pieces: list[_Piece], concurrency: int) -> None:
        """Fetch pieces with at most ``concurrency`` in flight; on a failure, wait for the rest, then raise."""
        if not pieces:
            return
        pool = self._executor(concurrency)
        running: set[Future[None]] = set()
        failed: BaseException | None = None
        for p in pieces:
            if failed is not None:
                break
            running.add(pool.submit(self._fetch, p))
            if len(running) >= concurrency:
                done, running = wait(running, return_when=FIRST_EXCEPTION)
                failed = next((f.exception() for f in done if f.exception() is not None), None)
        done, _ = wait(running)  # never return while a thread may still write into a buffer
        failed = failed or next((f.exception() for f in done if f.exception() is not None), None)
        if failed is not None:
            raise failed

    def _executor(self, concurrency: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pool_size < concurrency:
                old = self._pool
                self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="tenplex-store-client")
                self._pool_size = concurrency
                if old is not None:
                    old.shutdown(wait=False)
            return self._pool

    # -- writes and metadata -----------------------------------------------

    def write_shard(
        self,
        job: str,
        version: Version | str,
        tensor: str,
        region: Region,
        data: np.ndarray | torch.Tensor,
        *,
        dtype: str,
        global_shape: Sequence[int],
        received: ReceivedCrcs | None = None,
    ) -> ShardInfo:
        """Upload a shard (PUT, sent straight from the buffer); replaces the same region of an uncommitted version.
        (``received`` is not used: the daemon checksums the bytes it receives.)"""
        arr = host_data(data, dtype, tensor, region)
        query = urllib.parse.urlencode({"region": region.format()})
        headers = {
            DTYPE_HEADER: dtype,
            GLOBAL_SHAPE_HEADER: format_shape(global_shape),
            "Content-Type": "application/octet-stream",
        }
        result = self._call("PUT", f"{versions_path(job, version, tensor)}?{query}", lambda resp: json.loads(resp.read()),
                            body=byte_view(arr), headers=headers)
        return ShardInfo.from_json(result["stored"])

    def manifest(self, job: str, version: Version | str) -> Manifest:
        return Manifest.from_json(self._json("GET", versions_path(job, version)))

    def versions(self, job: str) -> list[VersionInfo]:
        return [VersionInfo.from_json(v) for v in self._json("GET", versions_path(job))["versions"]]

    def is_committed(self, job: str, version: Version | str) -> bool:
        return self.wait_committed(job, version, 0.0)

    def wait_committed(self, job: str, version: Version | str, timeout_s: float) -> bool:
        """Long polls of the daemon (``GET .../committed?wait=``), each held at most :data:`MAX_COMMIT_WAIT_S`
        and well inside this client's read timeout: the daemon answers when its store commits the version."""
        v = check_version(version)
        check_job(job)
        deadline = time.monotonic() + timeout_s
        while True:
            wait = max(0.0, min(MAX_COMMIT_WAIT_S, self.timeout / 2, deadline - time.monotonic()))
            path = f"{versions_path(job, v)}/committed?wait={wait:.3f}"
            if self._json("GET", path)["committed"]:
                return True
            if time.monotonic() >= deadline:
                return False

    def jobs(self) -> list[str]:
        return [str(j) for j in self._json("GET", "/v1/jobs")["jobs"]]

    def link_shard(
        self,
        job: str,
        from_version: Version | str,
        tensor: str,
        region: Region,
        to_version: Version | str,
        *,
        verify: bool = True,
    ) -> ShardInfo:
        """The daemon links the shard on its own disk (``POST .../links``): no byte of it crosses the wire."""
        if not isinstance(region, Region):
            raise InvalidInput(f"region must be a Region, got {type(region).__name__}")
        body = LinkRequest(from_version=str(check_version(from_version)), tensor=check_tensor(tensor),
                           region=region.format(), verify=verify)
        result = self._json("POST", f"{versions_path(job, to_version)}/links", body.model_dump_json().encode())
        return ShardInfo.from_json(result["linked"])

    def commit(self, job: str, version: Version | str) -> Manifest:
        return Manifest.from_json(self._json("POST", f"{versions_path(job, version)}/commit")["manifest"])

    def place(self, job: str, version: Version | str, nbytes: int) -> bool:
        """Ask the daemon for room for ``nbytes`` more of an uncommitted version in its memory tier
        (``POST .../reservation``): True when the version is in memory (the room is claimed there), False
        on disk. For a writer sharing the daemon's root (the
        :class:`~tenplex.store.memory.Placement` of its :class:`~tenplex.store.local.LocalStore`): the
        daemon alone takes the tier's budget lock, evicts and moves versions."""
        body = ReservationRequest(nbytes=nbytes).model_dump_json().encode()
        return bool(self._json("POST", f"{versions_path(job, version)}/reservation", body)["in_memory"])

    def delete(self, job: str, version: Version | str) -> None:
        self._json("DELETE", versions_path(job, version))

    def metrics(self) -> str:
        return self._call("GET", "/metrics", lambda resp: resp.read().decode())

    def health(self) -> bool:
        """True when the daemon answers /healthz (one attempt, short timeout)."""
        conn = self._new_connection(min(self.timeout, 5.0))
        try:
            conn.request("GET", self._prefix + "/healthz")
            resp = conn.getresponse()
            resp.read()
            return resp.status == 200
        except (TimeoutError, OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def abort(self) -> None:
        """Close the client and cut the connections requests are using: a request waiting on a source that
        does not answer fails at once (with :class:`StoreUnavailable` or ``InvalidInput`` 'closed') instead of
        at its timeout. For a caller that gives up (a cancelled transform)."""
        self._closed = True
        with self._lock:
            busy = list(self._busy)
        for conn in busy:
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        self.close()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            idle, self._idle = self._idle, []
            pool, self._pool = self._pool, None
        for conn, _since in idle:
            conn.close()
        if pool is not None:
            pool.shutdown(wait=True)

