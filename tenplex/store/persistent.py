"""The persistent tier: a job's versions in an object store or on a shared file system, as zarr v3.

:class:`PersistentStore` is a :class:`~tenplex.store.base.TensorStore` at a URI
(:mod:`tenplex.store.locations`), written and read through zarr's own storage
backends: ``s3://bucket/prefix`` through :class:`zarr.storage.ObjectStore` on
an ``obstore`` :class:`~obstore.store.S3Store` (any S3-compatible store: the
endpoint, region and credentials come from the options or the standard AWS
environment variables), ``file:///path`` through :class:`zarr.storage.LocalStore`.
It is what the node daemons upload committed versions into
(:mod:`tenplex.node.uploads`) and what a transform reads the regions
no survivor holds from (the plan's ``checkpoint`` source).

Layout under the location, the node store's logical layout (job, version,
tensor, shard) as zarr v3 nodes::

    <job>/zarr.json                                  zarr group of the job
    <job>/<version>/zarr.json                        group of one version
    <job>/<version>/<tensor>/zarr.json               group per tensor ('/' encoded as %2F)
    <job>/<version>/<tensor>/r0-96_0-64/zarr.json    array per shard; attributes["tenplex"]: tensor, region,
                                                     dtype, global shape, crc32c of the C-order payload
    <job>/<version>/<tensor>/r0-96_0-64/c/0/1        its chunk objects: raw little-endian elements + crc32c
    <job>/.ptc/<version>.json                        the PTC it was saved in (with its dataset position), when
                                                     the commit brought one: what a job resumed from it reads
    <job>/.commits/<version>.json                    commit marker = the manifest, written last

Why this shape:

- A shard's ``zarr.json`` is written after all of its chunk objects, and
  carries the checksum: an object store has no rename, so a shard is
  complete exactly when its metadata exists, and a shard whose chunks are
  there without it is a torn or running upload (never read as a shard).
- A version is committed by writing its marker last, after checking that
  every shard it must hold is complete: all chunk objects present with the
  right sizes and the checksum the caller expects, from one listing and the
  shards' metadata, without downloading the data
  (:meth:`PersistentStore.commit`). A torn upload is never a committed version.
- Every chunk goes through zarr's ``crc32c`` codec, so any sub-region read
  (which fetches only the chunks it touches: every chunk is its own object,
  read with plain GETs) checks each chunk it uses; a read of a whole shard is
  also checked against the shard's recorded crc32c, as on the node. A missing
  chunk object is an error, never zeros.
- Chunks are near-square in the last two dimensions (power-of-two extents
  where they divide the dimension) of about 8 MiB: a recovery reads pieces of
  the old shards in the new layout, row or column slices alike, so neither
  kind should fetch whole rows of a wide shard; objects of several MiB keep
  the per-request cost of an object store small.
- Structure (job, version, tensor groups) is plain zarr v3, so a version can
  be opened with zarr itself (``zarr.open_group(store, path=f"{job}/{version}")``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import shutil
import stat
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote, urlsplit

import numpy as np
import zarr
import zarr.storage
from zarr.core.buffer import default_buffer_prototype
from zarr.core.buffer.cpu import Buffer, NDBuffer
from zarr.core.indexing import BasicIndexer
from zarr.core.sync import sync

from tenplex.core.files import atomic_write, syncfs
from tenplex.core.version import Version
from tenplex.errors import (
    ChecksumMismatch,
    Conflict,
    InvalidInput,
    InvalidRegion,
    NotFound,
    StateLost,
    StoreUnavailable,
    TenplexError,
    Unauthorized,
)
from tenplex.ptc.dtypes import storage_dtype
from tenplex.ptc.region import Region
from tenplex.store.base import RegionRead, TensorStore
from tenplex.store.buffers import ReceivedCrcs, crc_of, host_buffer, host_data, numpy_view, slabs
from tenplex.store.locations import check_options, check_uri
from tenplex.store.model import Manifest, ShardInfo, VersionInfo, cover, format_checksum
from tenplex.store.names import (
    check_job,
    check_shard_target,
    check_tensor,
    check_version,
    region_from_key,
    region_key,
    tensor_dirname,
    tensor_from_dirname,
)
from tenplex.store.rawchunks import ChunkLayout

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

T = TypeVar("T")

ATTR = "tenplex"
DEFAULT_CHUNK_BYTES = 8 << 20
"""Chunk objects of about this size (see the module doc)."""
_COMMITS = ".commits"
_PTCS = ".ptc"
"""``{job}/.ptc/{version}.json``: the PTC a committed version was saved in (small metadata: a job resumed
from the version plans its layout from it), written before the commit marker."""
_META = "zarr.json"
_CRC_BYTES = 4  # what zarr's crc32c codec appends to every chunk
_PIECE_BYTES = 64 << 20  # shards larger than this are written and verified piece by piece
_MAX_PIECE_BYTES = 256 << 20
_ZARR_CONFIG = {"write_empty_chunks": True}  # -0.0 and NaN payloads round-trip bit-exactly


class MissingChunk(Exception):
    """A chunk object a shard's metadata promises is not there (raised inside zarr's read path)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _StrictStore(zarr.storage.WrapperStore[Any]):
    """zarr's backend, except that a missing chunk object is an error: zarr itself would fill its part of
    the read with the fill value, silently. Shards are written with every chunk present."""

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Buffer | None:
        found = await self._store.get(key, prototype, byte_range)
        if found is None and not key.endswith(_META):
            raise MissingChunk(key)
        return found


def _fit(extent: int, fit: int) -> int:
    """How many indices of ``extent`` a chunk takes, at most ``fit``: a power of two that divides the
    extent when there is one at least half of ``fit`` (tensor- and pipeline-parallel cuts of power-of-two
    dimensions then fall on chunk boundaries), else an even share (no padded edge chunk)."""
    if extent <= fit:
        return extent
    p = 1 << (max(1, fit).bit_length() - 1)
    if extent % p == 0 and 2 * p > fit:
        return p
    count = -(-extent // fit)
    return -(-extent // count)


def chunk_shape(shape: Sequence[int], item: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[int, ...]:
    """Chunks of about ``chunk_bytes``, near-square in the last two dimensions (see the module doc)."""
    n = len(shape)
    if n == 0:
        return ()
    budget = max(1, chunk_bytes // item)
    dims = [max(int(s), 1) for s in shape]
    if n == 1:
        return (_fit(dims[0], budget),)
    last = _fit(dims[-1], max(1, math.isqrt(budget)))
    rows = _fit(dims[-2], max(1, budget // last))
    if rows == dims[-2] and last < dims[-1]:  # few rows: let the chunks be wider
        last = _fit(dims[-1], max(1, budget // rows))
    out = [1] * (n - 2) + [rows, last]
    used = rows * last
    for d in range(n - 3, -1, -1):
        out[d] = _fit(dims[d], max(1, budget // used))
        used *= out[d]
    return tuple(out)


def _array_doc(shape: Sequence[int], chunks: Sequence[int], st: np.dtype, attributes: dict[str, Any]) -> dict[str, Any]:
    """A shard's ``zarr.json``: regular grid, ``bytes`` then ``crc32c`` codecs, no compression (weights
    barely compress; a codec would halve read speed)."""
    return ChunkLayout(tuple(shape), tuple(chunks), st, "/").metadata(attributes, checksum=True)


def _group_doc(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": {ATTR: dict(attributes)}}


def _chunk_objects(meta: Mapping[str, Any]) -> dict[str, int]:
    """Every chunk object a shard's metadata promises (key relative to the shard) and its size in bytes."""
    shape = [int(n) for n in meta["shape"]]
    chunks = [int(c) for c in meta["chunk_grid"]["configuration"]["chunk_shape"]]
    size = math.prod(chunks) * np.dtype(meta["data_type"]).itemsize + _CRC_BYTES
    if not shape:
        return {"c": size}
    if any(n == 0 for n in shape):
        return {}
    grid = [range(-(-n // c)) for n, c in zip(shape, chunks, strict=True)]
    return {"c/" + "/".join(map(str, coords)): size for coords in itertools.product(*grid)}


def _sort_key(info: ShardInfo) -> tuple[str, str]:
    """The node store's manifest order: tensor directory, then shard directory, as names."""
    return tensor_dirname(info.tensor), region_key(info.region)


@dataclass(frozen=True, slots=True)
class SmallShard:
    """A shard for :meth:`PersistentStore.write_shards`: its target, its bytes (a C-contiguous array of the
    region's shape in the storage dtype) and the checksum its source recorded (None: not checked)."""

    tensor: str
    region: Region
    dtype: str
    global_shape: tuple[int, ...]
    data: np.ndarray
    expected: str | None = None
    replace: bool = False
    """An older copy of the shard may be complete there (another checksum): its metadata goes first."""


@dataclass(frozen=True, slots=True)
class _Shard:
    """A complete shard: its record and its zarr metadata document."""

    info: ShardInfo
    meta: dict[str, Any]


class PersistentStore(TensorStore):
    """A job's versions at a persistent location (``s3://`` or ``file://``), through zarr's backends.

    Thread-safe: every call runs its requests on zarr's event loop (several
    calls from several threads overlap there). ``options`` are connection
    options (:data:`~tenplex.store.locations.OPTION_KEYS`; the AWS environment
    variables fill in the rest). ``chunk_bytes`` sizes the chunk objects of
    shards written here. ``timeout_s`` bounds one request, ``retries`` are
    the object-store client's own quick retries of a failed request (a
    caller that must outlast an outage retries the operation, as the daemon's
    uploads do). ``max_requests`` bounds the shard reads in flight of one call.
    """

    def __init__(
        self,
        uri: str,
        *,
        options: Mapping[str, Any] | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = 60.0,
        retries: int = 2,
        max_requests: int = 32,
        cache_size: int = 64,
    ) -> None:
        self.url = check_uri(uri)
        self.options = check_options(options)
        if chunk_bytes < 64:
            raise InvalidInput(f"chunk_bytes must be at least 64, got {chunk_bytes}")
        if timeout_s <= 0 or retries < 0 or max_requests < 1:
            raise InvalidInput(f"timeout_s {timeout_s} (> 0), retries {retries} (>= 0), max_requests {max_requests} (>= 1)")
        self.chunk_bytes = chunk_bytes
        self.max_requests = max_requests
        self.root: Path | None = None
        """The directory of a ``file://`` location (None for an object store)."""
        self._backend = self._open_backend(timeout_s, retries)
        self._strict = _StrictStore(self._backend)
        self._lock = threading.Lock()
        self._manifests: OrderedDict[tuple[str, Version], Manifest] = OrderedDict()
        self._arrays: OrderedDict[tuple[str, Version, str, Region], zarr.AsyncArray[Any]] = OrderedDict()
        self._cache_size = cache_size
        self._groups: set[str] = set()  # group documents this instance has written

    def __repr__(self) -> str:
        return f"PersistentStore({self.url!r})"

    # -- the backend -------------------------------------------------------------------

    def _open_backend(self, timeout_s: float, retries: int) -> zarr.abc.store.Store:
        parts = urlsplit(self.url)
        if parts.scheme == "file":
            self.root = Path(unquote(parts.path))
            return zarr.storage.LocalStore(self.root)
        from obstore.store import S3Store

        opts = dict(self.options)
        config: dict[str, Any] = {}
        endpoint = opts.pop("endpoint", None) or next(
            (os.environ[k] for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT") if os.environ.get(k)), None
        )
        if endpoint:
            config["endpoint"] = endpoint
        config["region"] = opts.pop("region", None) or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        if "virtual_hosted_style" in opts:
            config["virtual_hosted_style_request"] = opts.pop("virtual_hosted_style")
        allow_http = opts.pop("allow_http", bool(endpoint and endpoint.startswith("http://")))
        config.update(opts)  # credentials, skip_signature
        client = {"allow_http": allow_http, "timeout": timedelta(seconds=timeout_s),
                  "connect_timeout": timedelta(seconds=min(timeout_s, 10.0))}
        retry = {"max_retries": retries, "retry_timeout": timedelta(seconds=max(timeout_s, 5.0)),
                 "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2), "base": 2}}
        s3 = S3Store(parts.netloc, prefix=parts.path.strip("/") or None, config=config,  # type: ignore[arg-type]
                     client_options=client, retry_config=retry)  # type: ignore[arg-type]
        return zarr.storage.ObjectStore(s3)

    def _run(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        """Run ``coro`` on zarr's event loop; errors of the backend become :mod:`tenplex.errors`."""
        try:
            return sync(coro)
        except TenplexError:
            raise
        except Exception as exc:
            mapped = self._map_error(exc, what)
            if mapped is None:
                raise
            raise mapped from exc

    def _map_error(self, exc: BaseException, what: str) -> TenplexError | None:
        text = str(exc).strip().replace("\n", " ")[:400]
        if isinstance(exc, MissingChunk):
            return ChecksumMismatch(f"{what}: chunk object {exc.key} is missing at {self.url}: the shard is damaged or "
                                    "its version was deleted")
        if isinstance(exc, ValueError) and "checksum" in text.lower():
            return ChecksumMismatch(f"{what}: a chunk failed its crc32c check at {self.url}: it is damaged in the "
                                    f"persistent store ({text})")
        try:
            from obstore import exceptions as obx
        except ImportError:  # pragma: no cover  (obstore is a dependency)
            obx = None
        if obx is not None and isinstance(exc, obx.BaseError):
            if isinstance(exc, obx.PermissionDeniedError | obx.UnauthenticatedError):
                return Unauthorized(f"{what}: {self.url} refused the request (credentials?): {text}")
            if isinstance(exc, obx.NotFoundError):
                return NotFound(f"{what}: not found at {self.url}: {text}")
            return StoreUnavailable(f"{what}: the persistent store {self.url} is unavailable: {text}")
        if isinstance(exc, PermissionError):
            return Unauthorized(f"{what}: {self.url}: permission denied: {text}")
        if isinstance(exc, OSError | TimeoutError | ConnectionError):
            return StoreUnavailable(f"{what}: the persistent store {self.url} is unavailable: {type(exc).__name__}: {text}")
        return None

    async def _get_json(self, key: str) -> dict[str, Any] | None:
        buf = await self._backend.get(key, prototype=default_buffer_prototype())
        if buf is None:
            return None
        return self._parse_json(buf.to_bytes(), key)

    def _parse_json(self, data: bytes, key: str) -> dict[str, Any]:
        try:
            return json.loads(data)
        except ValueError:
            raise InvalidInput(f"{self.url}/{key} is not JSON: not written by a tenplex persistent store") from None

    async def _put_json(self, key: str, obj: Any) -> None:
        await self._backend.set(key, Buffer.from_bytes(_json_bytes(obj)))

    async def _list_dir(self, prefix: str) -> list[str]:
        try:
            return sorted({name async for name in self._backend.list_dir(prefix)})
        except FileNotFoundError:
            return []

    async def _object_sizes(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix/`` and its size: one listing (paginated) on an object store."""
        if self.root is not None:
            return await asyncio.to_thread(_file_sizes, self.root, prefix)
        import obstore

        metas = await obstore.list(self._backend.store, prefix.rstrip("/") + "/").collect_async()  # type: ignore[attr-defined]
        return {str(m["path"]): int(m["size"]) for m in metas}

    async def _bounded(self, coros: Iterable[Awaitable[T]]) -> list[T]:
        """Await ``coros`` with at most :attr:`max_requests` in flight, in order."""
        sem = asyncio.Semaphore(self.max_requests)

        async def one(c: Awaitable[T]) -> T:
            async with sem:
                return await c

        return list(await asyncio.gather(*(one(c) for c in coros)))

    # -- keys --------------------------------------------------------------------------

    @staticmethod
    def _vkey(job: str, version: Version) -> str:
        return f"{job}/{version}"

    @staticmethod
    def _tkey(job: str, version: Version, tensor: str) -> str:
        return f"{job}/{version}/{tensor_dirname(tensor)}"

    @staticmethod
    def _skey(job: str, version: Version, tensor: str, region: Region) -> str:
        return f"{job}/{version}/{tensor_dirname(tensor)}/{region_key(region)}"

    @staticmethod
    def _marker(job: str, version: Version) -> str:
        return f"{job}/{_COMMITS}/{version}.json"

    @staticmethod
    def _ptc_key(job: str, version: Version) -> str:
        return f"{job}/{_PTCS}/{version}.json"

    # -- metadata ----------------------------------------------------------------------

    async def _read_shards(self, job: str, version: Version, which: Sequence[tuple[str, Region]]) -> list[_Shard | None]:
        """:meth:`_read_shard` of each; on a file system all in one thread of zarr's pool (a round trip through
        the event loop per small file costs more than reading it)."""
        if self.root is None or len(which) < 2:
            return await self._bounded(self._read_shard(job, version, t, r) for t, r in which)
        root = str(self.root)

        def read_all() -> list[dict[str, Any] | None]:
            out: list[dict[str, Any] | None] = []
            for t, r in which:
                try:
                    with open(f"{root}/{self._skey(job, version, t, r)}/{_META}", "rb") as f:
                        out.append(self._parse_json(f.read(), f"{self._skey(job, version, t, r)}/{_META}"))
                except (FileNotFoundError, NotADirectoryError):
                    out.append(None)
            return out

        metas = await asyncio.to_thread(read_all)
        return [self._shard_of(job, version, t, r, m) for (t, r), m in zip(which, metas, strict=True)]

    async def _read_shard(self, job: str, version: Version, tensor: str, region: Region) -> _Shard | None:
        """A complete shard (its metadata is there), or None."""
        return self._shard_of(job, version, tensor, region,
                              await self._get_json(f"{self._skey(job, version, tensor, region)}/{_META}"))

    def _shard_of(self, job: str, version: Version, tensor: str, region: Region, meta: dict[str, Any] | None) -> _Shard | None:
        if meta is None:
            return None
        rec = meta.get("attributes", {}).get(ATTR)
        if not isinstance(rec, dict):
            raise InvalidInput(f"{self.url}: {self._skey(job, version, tensor, region)} is not a shard written by tenplex")
        info = ShardInfo.from_json(rec)
        if info.tensor != tensor or info.region != region:
            raise InvalidInput(f"{self.url}: {self._skey(job, version, tensor, region)} records tensor {info.tensor!r} "
                               f"region {info.region}; the store is corrupt")
        return _Shard(info, meta)

    async def _scan_tensor(self, job: str, version: Version, tensor: str) -> tuple[list[_Shard], list[Region]]:
        """The complete shards of a tensor in a version, and the regions whose upload is unfinished."""
        names = await self._list_dir(self._tkey(job, version, tensor))
        regions = [r for r in (region_from_key(n) for n in names) if r is not None]
        found = await self._read_shards(job, version, [(tensor, r) for r in regions])
        return [s for s in found if s is not None], [r for r, s in zip(regions, found, strict=True) if s is None]

    async def _scan_version(self, job: str, version: Version) -> tuple[list[_Shard], list[tuple[str, Region]]]:
        names = await self._list_dir(self._vkey(job, version))
        tensors = [tensor_from_dirname(n) for n in names if n != _META]
        scans = await self._bounded(self._scan_tensor(job, version, t) for t in tensors)
        shards = sorted((s for found, _ in scans for s in found), key=lambda s: _sort_key(s.info))
        torn = [(t, r) for t, (_, regions) in zip(tensors, scans, strict=True) for r in regions]
        return shards, torn

    async def _committed_manifest(self, job: str, version: Version) -> Manifest | None:
        with self._lock:
            cached = self._manifests.get((job, version))
        if cached is not None:
            return cached
        obj = await self._get_json(self._marker(job, version))
        if obj is None:
            return None
        manifest = Manifest.from_json(obj)
        with self._lock:
            self._manifests[(job, version)] = manifest
            while len(self._manifests) > self._cache_size:
                self._manifests.popitem(last=False)
        return manifest

    async def _absent(self, job: str, version: Version) -> NotFound:
        """The right :class:`NotFound` for a version with no commit marker."""
        if await self._list_dir(self._vkey(job, version)):
            return NotFound(f"version {version} of job {job!r} at {self.url} is not committed (it is being "
                            "uploaded or its upload was torn)")
        if not await self._list_dir(job):
            return NotFound(f"job {job!r} is not at {self.url}")
        return NotFound(f"version {version} of job {job!r} is not at {self.url}")

    async def _tensor_shards(self, job: str, version: Version, tensor: str, uncommitted: bool) -> tuple[list[ShardInfo], bool]:
        manifest = await self._committed_manifest(job, version)
        if manifest is not None:
            shards = manifest.shards_of(tensor)
            if not shards:
                raise NotFound(f"tensor {tensor!r} is not in version {version} of job {job!r} at {self.url}")
            return shards, True
        if not uncommitted:
            raise await self._absent(job, version)
        found, _torn = await self._scan_tensor(job, version, tensor)
        if not found:
            if not await self._list_dir(self._vkey(job, version)):
                raise await self._absent(job, version)
            raise NotFound(f"tensor {tensor!r} is not in version {version} of job {job!r} at {self.url}")
        return [s.info for s in found], False

    async def _array(self, job: str, version: Version, info: ShardInfo, committed: bool) -> zarr.AsyncArray[Any]:
        key = (job, version, info.tensor, info.region)
        if committed:
            with self._lock:
                cached = self._arrays.get(key)
                if cached is not None:
                    self._arrays.move_to_end(key)
                    return cached
        shard = await self._read_shard(job, version, info.tensor, info.region)
        if shard is None:
            raise ChecksumMismatch(f"shard {info.tensor!r} {info.region.format()!r} of version {version} of job {job!r} "
                                   f"has no metadata at {self.url}: it is damaged or its version was deleted")
        if committed and shard.info.checksum != info.checksum:
            raise ChecksumMismatch(f"shard {info.tensor!r} {info.region.format()!r} of version {version} of job {job!r} at "
                                   f"{self.url} records {shard.info.checksum}, its commit marker {info.checksum}")
        arr = zarr.AsyncArray(metadata=shard.meta, store_path=zarr.storage.StorePath(self._strict, self._skey(
            job, version, info.tensor, info.region)), config=_ZARR_CONFIG)
        if committed:
            with self._lock:
                self._arrays[key] = arr
                while len(self._arrays) > 64 * self._cache_size:
                    self._arrays.popitem(last=False)
        return arr

    # -- reads -------------------------------------------------------------------------

    @staticmethod
    def _cover(tensor: str, shards: Sequence[ShardInfo], region: Region, where: str) -> list[tuple[ShardInfo, Region]]:
        """Which shard serves which part of ``region`` (the first of overlapping shards wins)."""
        region.check_within(shards[0].global_shape)
        if region.empty:
            return []
        parts, missing = cover(shards, lambda s: s.region, region)
        if missing:
            raise StateLost(f"tensor {tensor!r} (shape {list(shards[0].global_shape)}) in {where}: region "
                            f"{region.format()!r} is not covered by the stored shards; missing {missing}")
        return parts

    async def _read_parts(self, job: str, version: Version, tensor: str, region: Region, view: np.ndarray,
                          shards: Sequence[ShardInfo], committed: bool) -> ShardInfo | None:
        """Fill ``view`` with the region from ``shards``; the shard it is exactly, if any (for the caller's checksum)."""
        if view.shape != region.shape:
            raise InvalidRegion(f"output buffer has shape {list(view.shape)}, region {region.format()!r} has {list(region.shape)}")
        parts = self._cover(tensor, shards, region, f"version {version} of job {job!r} at {self.url}")

        async def part(info: ShardInfo, common: Region) -> None:
            arr = await self._array(job, version, info, committed)
            src = common.relative_to(info.region)
            dst = view[common.relative_to(region).slices()] if region.ndim else view
            indexer = BasicIndexer(src.slices() if src.ndim else (), arr.shape, arr.metadata.chunk_grid)
            await arr._get_selection(indexer, prototype=default_buffer_prototype(), out=NDBuffer.from_numpy_array(dst))

        await self._bounded(part(info, common) for info, common in parts)
        return next((s for s in shards if s.region == region), None)

    def _check_read(self, job: str, version: Version, tensor: str, region: Region, view: np.ndarray,
                    shard: ShardInfo | None) -> None:
        if shard is not None and format_checksum(crc_of(view)) != shard.checksum:
            raise ChecksumMismatch(
                f"tensor {tensor!r} region {region.format()!r} of version {version} of job {job!r} at {self.url} read "
                f"back with crc32c {format_checksum(crc_of(view))}, recorded {shard.checksum}: it is damaged in the "
                "persistent store"
            )

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
        """Fill ``out`` with ``region`` of ``tensor``, fetching only the chunk objects it touches.

        Every chunk used is checked by zarr's crc32c codec whatever ``verify`` says (the codec is part of
        the stored format); ``verify`` adds the check of a region that is exactly a stored shard against
        the shard's recorded checksum, as on the node.
        """
        v = check_version(version)
        check_job(job)
        check_tensor(tensor)
        what = f"reading {tensor!r} {region} of {v}"
        shards, committed = self._run(self._tensor_shards(job, v, tensor, uncommitted), what)
        if not isinstance(region, Region):
            raise InvalidInput(f"region must be a Region, got {type(region).__name__}")
        with host_buffer(out, shards[0].dtype, what=f"output buffer for {tensor!r}") as view:
            shard = self._run(self._read_parts(job, v, tensor, region, view, shards, committed), what)
            if verify:
                self._check_read(job, v, tensor, region, view, shard)

    def read_regions(self, job: str, version: Version | str, reads: Sequence[RegionRead], *, verify: bool = True) -> None:
        """Fill every read's buffer from one committed version, all of their chunk requests overlapping."""
        v = check_version(version)
        check_job(job)
        if not reads:
            return
        for r in reads:
            check_tensor(r.tensor)
            if not isinstance(r.region, Region):
                raise InvalidInput(f"region must be a Region, got {type(r.region).__name__}")
        tensors = sorted({r.tensor for r in reads})

        async def resolve() -> list[tuple[list[ShardInfo], bool]]:
            return list(await asyncio.gather(*(self._tensor_shards(job, v, t, False) for t in tensors)))

        found = dict(zip(tensors, self._run(resolve(), f"batch read of {len(reads)} regions of {v}"), strict=True))
        batch: list[tuple[RegionRead, np.ndarray]] = []
        for r in reads:
            device = getattr(r.out, "device", None)
            if getattr(device, "type", "cpu") != "cpu":  # an accelerator's tensor: through a host buffer, alone
                self.read_into(job, v, r.tensor, r.region, r.out, verify=verify)
                continue
            batch.append((r, numpy_view(r.out, found[r.tensor][0][0].dtype, what=f"output buffer for {r.tensor!r}")))

        async def all_reads() -> list[ShardInfo | None]:
            return list(await asyncio.gather(*(
                self._read_parts(job, v, r.tensor, r.region, view, *found[r.tensor]) for r, view in batch)))

        shards = self._run(all_reads(), f"batch read of {len(reads)} regions of {v}")
        if verify:
            for (r, view), shard in zip(batch, shards, strict=True):
                self._check_read(job, v, r.tensor, r.region, view, shard)

    def shard(self, job: str, version: Version | str, tensor: str, region: Region) -> ShardInfo | None:
        """The record of a complete stored shard (exactly this region), committed or not, or None."""
        v = check_version(version)
        check_job(job)
        check_tensor(tensor)
        found = self._run(self._read_shard(job, v, tensor, region), f"looking up {tensor!r} {region} of {v}")
        return found.info if found is not None else None

    # -- writes ------------------------------------------------------------------------

    def open_writer(
        self,
        job: str,
        version: Version | str,
        tensor: str,
        region: Region,
        *,
        dtype: str,
        global_shape: Sequence[int],
        piece_bytes: int = _PIECE_BYTES,
        check: bool = True,
    ) -> PersistentShardWriter:
        """Start writing a shard in pieces (bounded memory for any shard size); see :class:`PersistentShardWriter`.

        ``check`` looks for a commit marker and for other shards of the tensor with another dtype or
        global shape first (a few requests); an uploader that has checked the version once and writes
        the shards of one committed node version leaves it off.
        """
        v, gshape = check_shard_target(job, version, tensor, dtype, global_shape, region)
        if check:
            self._run(self._check_writable(job, v, tensor, dtype, gshape), f"writing {tensor!r} into {v}")
        return PersistentShardWriter(self, job, v, tensor, region, dtype, gshape, piece_bytes)

    async def _check_writable(self, job: str, version: Version, tensor: str, dtype: str, gshape: tuple[int, ...]) -> None:
        if await self._committed_manifest(job, version) is not None:
            raise Conflict(f"version {version} of job {job!r} at {self.url} is committed; committed versions are immutable")
        names = await self._list_dir(self._tkey(job, version, tensor))
        for name in names:
            region = region_from_key(name)
            shard = await self._read_shard(job, version, tensor, region) if region is not None else None
            if shard is None:
                continue
            if shard.info.dtype != dtype or shard.info.global_shape != gshape:
                raise Conflict(f"tensor {tensor!r} in version {version} of job {job!r} is already stored as "
                               f"{shard.info.dtype} {list(shard.info.global_shape)}; got {dtype} {list(gshape)}")
            break

    def _group_docs(self, job: str, version: Version, tensors: Sequence[str]) -> dict[str, bytes]:
        """The group documents of the job, the version and these tensors that this instance has not written."""
        docs = {
            f"{job}/{_META}": _group_doc({"job": job}),
            f"{self._vkey(job, version)}/{_META}": _group_doc({"job": job, "version": str(version)}),
        }
        docs.update({f"{self._tkey(job, version, t)}/{_META}": _group_doc({"tensor": t}) for t in tensors})
        with self._lock:
            return {k: _json_bytes(d) for k, d in docs.items() if k not in self._groups}

    async def _ensure_groups(self, job: str, version: Version, tensors: Sequence[str]) -> None:
        """The group documents of the job, the version and these tensors, each written once by this instance."""
        await self._put_groups(self._group_docs(job, version, tensors))

    async def _put_groups(self, docs: Mapping[str, bytes]) -> None:
        if docs:
            await self._bounded(self._backend.set(k, Buffer.from_bytes(d)) for k, d in docs.items())
            with self._lock:
                self._groups.update(docs)

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
        """Store ``data`` as the shard ``region`` of ``tensor`` in an uncommitted version (the same region again
        replaces it): its chunk objects first, then its metadata with the checksum. (``received`` is not used:
        the chunk objects' crc32c codec checksums them as they are encoded.)"""
        arr = host_data(data, dtype, tensor, region)
        writer = self.open_writer(job, version, tensor, region, dtype=dtype, global_shape=global_shape)
        try:
            for i, piece in enumerate(writer.pieces):
                writer.write_piece(i, arr[piece.slices()] if piece.ndim else arr)
            return writer.finish()
        except BaseException:
            writer.abort()
            raise

    def small(self, region: Region, dtype: str, limit: int) -> bool:
        """Whether a shard can go through :meth:`write_shards`: at most ``limit`` bytes, one chunk object."""
        st = storage_dtype(dtype)
        return region.volume * st.itemsize <= limit and self._one_chunk(region, st)

    def _one_chunk(self, region: Region, st: np.dtype) -> bool:
        return chunk_shape(region.shape, st.itemsize, self.chunk_bytes) == tuple(max(1, n) for n in region.shape)

    def write_shards(self, job: str, version: Version | str, shards: Sequence[SmallShard]) -> list[ShardInfo]:
        """Store many small shards of an uncommitted version at once; their records, in order.

        What one shard at a time costs is its requests' latency, not its bytes: here every checksum is
        checked first (a shard whose bytes do not have the crc32c its source recorded fails the call with
        :class:`~tenplex.errors.ChecksumMismatch` before anything is written), then the groups of all their
        tensors, every chunk object, and last every shard's metadata are written, each step as concurrent
        requests (at most :attr:`max_requests` in flight) on zarr's event loop. The format is the one
        :meth:`write_shard` writes: each shard is one chunk (see :meth:`small`), and its chunk object is
        what zarr's ``bytes`` then ``crc32c`` codecs make of it (the little-endian elements, then the crc32c
        of those bytes: the shard's own checksum, computed once). A shard's metadata still comes after its
        chunk, so an interrupted call leaves shards that are complete or invisible. ``replace`` shards
        (:attr:`SmallShard.replace`) lose their old metadata before their chunk is rewritten. A committed
        version is refused (:class:`~tenplex.errors.Conflict`); unlike :meth:`open_writer` the call does not
        compare the shards with other shards of their tensors already there: its caller, the daemon's upload,
        sends the shards of one node version, whose dtypes and shapes agree.
        """
        v = check_version(version)
        check_job(job)
        if not shards:
            return []
        prepared: list[tuple[str, str | None, Buffer | None, dict[str, Any], bool]] = []
        infos: list[ShardInfo] = []
        tensors: set[str] = set()
        for s in shards:
            gshape = check_shard_target(job, v, s.tensor, s.dtype, s.global_shape, s.region)[1]
            st = storage_dtype(s.dtype)
            data = s.data
            if not isinstance(data, np.ndarray) or data.dtype != st or data.shape != s.region.shape:
                raise InvalidInput(f"shard {s.tensor!r} {s.region.format()!r}: data must be a {st} array of shape "
                                   f"{list(s.region.shape)}")
            if not self._one_chunk(s.region, st):
                raise InvalidInput(f"shard {s.tensor!r} {s.region.format()!r} spans several chunk objects: write it "
                                   "with open_writer")
            crc = crc_of(np.ascontiguousarray(data))
            checksum = format_checksum(crc)
            if s.expected is not None and checksum != s.expected:
                raise ChecksumMismatch(f"shard {s.tensor!r} {s.region.format()!r} of {v}: the bytes read have crc32c "
                                       f"{checksum}, their source recorded {s.expected}; not uploaded")
            info = ShardInfo(s.tensor, s.region, s.dtype, gshape, checksum, s.region.volume * st.itemsize)
            doc = _array_doc(s.region.shape, [max(1, n) for n in s.region.shape], st, {ATTR: info.to_json()})
            key = self._skey(job, v, s.tensor, s.region)
            chunk: Buffer | None = None
            chunk_key: str | None = None
            objects = _chunk_objects(doc)
            if objects:
                [name] = objects
                chunk_key = f"{key}/{name}"
                raw = np.empty(info.nbytes + _CRC_BYTES, np.uint8)
                raw[: info.nbytes] = np.ascontiguousarray(data, dtype=st.newbyteorder("<")).reshape(-1).view(np.uint8)
                raw[info.nbytes:] = np.frombuffer((crc & 0xFFFFFFFF).to_bytes(_CRC_BYTES, "little"), np.uint8)
                chunk = Buffer.from_array_like(raw)
            prepared.append((key, chunk_key, chunk, doc, s.replace))
            infos.append(info)
            tensors.add(s.tensor)

        what = f"uploading {len(shards)} shards of {v}"
        if self._run(self._committed_manifest(job, v), what) is not None:
            raise Conflict(f"version {v} of job {job!r} at {self.url} is committed; committed versions are immutable")
        groups = self._group_docs(job, v, sorted(tensors))
        stale = [f"{key}/{_META}" for key, _, _, _, replace in prepared if replace]
        chunks = [(ck, chunk) for _, ck, chunk, _, _ in prepared if ck is not None and chunk is not None]
        metas = [(f"{key}/{_META}", _json_bytes(doc)) for key, _, _, doc, _ in prepared]
        if self.root is not None:
            # A file system: this thread writes the files itself, in the same order and the same way zarr's
            # LocalStore does (each to a temporary name, then renamed). Hundreds of small files cost their
            # system calls, and sending each through the event loop (and a thread of its pool) and back
            # added a scheduling round trip per file: on a busy node that was most of the time.
            root = str(self.root)
            try:
                # every directory once, parents first (a mkdir per missing level of each file costs more)
                dirs: set[str] = set()
                for key in [*groups, *(k for k, _ in chunks), *(k for k, _ in metas)]:
                    d = key.rpartition("/")[0]
                    while d and d not in dirs:
                        dirs.add(d)
                        d = d.rpartition("/")[0]
                for d in sorted(dirs, key=lambda d: d.count("/")):
                    if "/" not in d:
                        os.makedirs(f"{root}/{d}", exist_ok=True)
                    else:
                        with contextlib.suppress(FileExistsError):
                            os.mkdir(f"{root}/{d}")
                for key, data in groups.items():
                    atomic_write(f"{root}/{key}", data)
                for key in stale:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f"{root}/{key}")
                for key, chunk in chunks:
                    atomic_write(f"{root}/{key}", chunk.as_buffer_like())
                for key, data in metas:
                    atomic_write(f"{root}/{key}", data)
            except OSError as exc:
                raise self._map_error(exc, what) or exc from exc
            with self._lock:
                self._groups.update(groups)
            return infos

        async def run() -> None:
            await self._put_groups(groups)
            await self._bounded(self._backend.delete(k) for k in stale)
            await self._bounded(self._backend.set(k, chunk) for k, chunk in chunks)
            await self._bounded(self._backend.set(k, Buffer.from_bytes(data)) for k, data in metas)

        self._run(run(), what)
        return infos

    def uploaded(self, job: str, version: Version | str) -> dict[tuple[str, Region], ShardInfo]:
        """The complete shards of a version here (committed or not), from one listing and the metadata of
        the shards it shows: what an upload that is resumed or repeated need not send again."""
        v = check_version(version)
        check_job(job)

        async def run() -> dict[tuple[str, Region], ShardInfo]:
            manifest = await self._committed_manifest(job, v)
            if manifest is not None:
                return {(s.tensor, s.region): s for s in manifest.shards}
            vkey = self._vkey(job, v)
            metas = []
            for key in await self._object_sizes(vkey):
                parts = key[len(vkey) + 1:].split("/")
                if len(parts) == 3 and parts[2] == _META:
                    region = region_from_key(parts[1])
                    if region is not None:
                        metas.append((tensor_from_dirname(parts[0]), region))
            found = await self._read_shards(job, v, metas)
            return {(s.info.tensor, s.info.region): s.info for s in found if s is not None}

        return self._run(run(), f"listing the shards of {v} of job {job!r}")

    def link_shard(
        self, job: str, from_version: Version | str, tensor: str, region: Region, to_version: Version | str,
        *, verify: bool = True,
    ) -> ShardInfo:
        """Put a shard of committed ``from_version`` into ``to_version`` without its bytes passing through this
        process: server-side copies of its objects on an object store, hard links on a file system.

        ``verify`` first reads the old shard back (a download, on an object store) and checks it.
        """
        old, new = check_version(from_version), check_version(to_version)
        check_job(job)
        check_tensor(tensor)
        what = f"linking {tensor!r} {region} from {old} into {new}"
        shards, _ = self._run(self._tensor_shards(job, old, tensor, False), what)
        info = next((s for s in shards if s.region == region), None)
        if info is None:
            raise NotFound(f"version {old} of job {job!r} at {self.url} has no shard of {tensor!r} with exactly region "
                           f"{region.format()!r}")
        self._run(self._check_writable(job, new, tensor, info.dtype, info.global_shape), what)
        if verify:
            crc = self._checksum(job, old, info)
            if format_checksum(crc) != info.checksum:
                raise ChecksumMismatch(f"shard {tensor!r} {region.format()!r} of version {old} of job {job!r} at {self.url}: "
                                       f"crc32c {format_checksum(crc)}, recorded {info.checksum}: it is damaged")
        self._run(self._copy_shard(job, old, new, info), what)
        return info

    def _checksum(self, job: str, version: Version, info: ShardInfo) -> int:
        """crc32c of a committed shard's payload, read in bounded pieces."""
        st = storage_dtype(info.dtype)
        crc = 0
        pieces = list(slabs(info.region.shape, st.itemsize, _PIECE_BYTES))
        buf = np.empty(max(p.volume for p in pieces), st)
        for piece in pieces:
            view = buf[: piece.volume].reshape(piece.shape)
            self.read_into(job, version, info.tensor, piece.shift(info.region.start), view, verify=False)
            crc = crc_of(view, crc)
        return crc

    async def _copy_shard(self, job: str, old: Version, new: Version, info: ShardInfo) -> None:
        src, dst = self._skey(job, old, info.tensor, info.region), self._skey(job, new, info.tensor, info.region)
        shard = await self._read_shard(job, old, info.tensor, info.region)
        if shard is None:
            raise NotFound(f"shard {info.tensor!r} {info.region.format()!r} of {old} disappeared while being linked")
        await self._backend.delete(f"{dst}/{_META}")  # a shard replaced is incomplete until its metadata is back
        chunks = list(_chunk_objects(shard.meta))
        if self.root is not None:
            root = self.root
            await asyncio.to_thread(_link_files, [(root / src / k, root / dst / k) for k in chunks])
        else:
            import obstore

            await self._bounded(obstore.copy_async(self._backend.store, f"{src}/{k}", f"{dst}/{k}")  # type: ignore[attr-defined]
                                for k in chunks)
        await self._ensure_groups(job, new, [info.tensor])
        await self._put_json(f"{dst}/{_META}", shard.meta)

    # -- versions ----------------------------------------------------------------------

    def manifest(self, job: str, version: Version | str) -> Manifest:
        v = check_version(version)
        check_job(job)

        async def get() -> Manifest:
            committed = await self._committed_manifest(job, v)
            if committed is not None:
                return committed
            shards, torn = await self._scan_version(job, v)
            if not shards and not torn and not await self._list_dir(self._vkey(job, v)):
                raise await self._absent(job, v)
            return Manifest(job, v, False, [s.info for s in shards])

        return self._run(get(), f"manifest of {v} of job {job!r}")

    def ptc_document(self, job: str, version: Version | str) -> dict[str, Any]:
        """The PTC JSON a committed version was saved with (see :meth:`commit`). NotFound when the version is
        not committed here, or was committed without one (by a Tenplex that did not keep it)."""
        v = check_version(version)
        check_job(job)

        async def get() -> dict[str, Any]:
            if await self._committed_manifest(job, v) is None:
                raise await self._absent(job, v)
            doc = await self._get_json(self._ptc_key(job, v))
            if doc is None:
                raise NotFound(f"version {v} of job {job!r} at {self.url} is committed without its PTC (it was "
                               "persisted by an older Tenplex): its layout is unknown")
            return doc

        return self._run(get(), f"PTC of {v} of job {job!r}")

    def jobs(self) -> list[str]:
        out = []
        for name in self._run(self._list_dir(""), "listing jobs"):
            if name.startswith(".") or name == _META:
                continue
            try:
                out.append(check_job(name))
            except InvalidInput:
                log.warning("ignoring %s/%s: not a job of a tenplex persistent store", self.url, name)
        return out

    def versions(self, job: str) -> list[VersionInfo]:
        """All versions of a job here, committed or not (the sizes of uncommitted ones from their complete
        shards), ordered by (step, generation)."""
        check_job(job)

        async def get() -> list[VersionInfo]:
            names = await self._list_dir(job)
            if not names:
                raise NotFound(f"job {job!r} is not at {self.url}")
            found = []
            for name in names:
                try:
                    found.append(Version.parse(name))
                except InvalidInput:
                    continue  # zarr.json, .commits
            committed = {n[: -len(".json")] for n in await self._list_dir(f"{job}/{_COMMITS}") if n.endswith(".json")}

            async def one(v: Version) -> VersionInfo | None:
                if str(v) in committed:
                    m = await self._committed_manifest(job, v)
                    if m is not None:
                        return VersionInfo(v, True, m.nbytes)
                shards, _ = await self._scan_version(job, v)
                return VersionInfo(v, False, sum(s.info.nbytes for s in shards))

            infos = await self._bounded(one(v) for v in sorted(found))
            return [i for i in infos if i is not None]

        return self._run(get(), f"listing the versions of job {job!r}")

    async def _verify(self, job: str, version: Version,
                      expect: Sequence[tuple[str, Region, str | None]] | None) -> tuple[list[ShardInfo], list[str]]:
        """Check a version without downloading its data; its intact shards and the problems found.

        With ``expect`` (tensor, region, crc32c or None), exactly those shards are checked and each must be
        there; without it, every shard stored, and shards whose upload is unfinished are problems. A shard is
        intact when its metadata (written after its data) is there, records the expected checksum and every
        chunk object it promises exists with the right size (one listing of the version).
        """
        # An object store: one listing of the version, alongside the metadata reads. A file system: a stat of
        # each chunk file the metadata promises, after them (a walk of the version's directories costs more).
        sizes_task = asyncio.ensure_future(self._object_sizes(self._vkey(job, version))) if self.root is None else None
        problems: list[str] = []
        checked: list[tuple[_Shard, str | None]] = []
        if expect is None:
            shards, torn = await self._scan_version(job, version)
            problems += [f"{t} {r.format()}: incomplete (chunk objects without metadata: an upload is running or was "
                         "torn)" for t, r in torn]
            checked = [(s, None) for s in shards]
        else:
            for tensor, _region, _crc in expect:
                check_tensor(tensor)
            found = await self._read_shards(job, version, [(t, r) for t, r, _ in expect])
            for (tensor, region, crc), shard in zip(expect, found, strict=True):
                if shard is None:
                    problems.append(f"{tensor} {region.format()}: missing")
                elif crc is not None and shard.info.checksum != crc:
                    problems.append(f"{tensor} {region.format()}: checksum {shard.info.checksum} recorded, {crc} expected")
                else:
                    checked.append((shard, crc))
        promised = [(shard, self._skey(job, version, shard.info.tensor, shard.info.region), _chunk_objects(shard.meta))
                    for shard, _ in checked]
        if sizes_task is not None:
            sizes = await sizes_task
        else:
            keys = [f"{base}/{k}" for _, base, objects in promised for k in objects]
            sizes = await asyncio.to_thread(_stat_sizes, str(self.root), keys)
        intact = []
        for shard, base, objects in promised:
            bad = []
            for key, size in objects.items():
                got = sizes.get(f"{base}/{key}")
                if got != size:
                    bad.append(f"chunk {key} {'missing' if got is None else f'has {got} bytes, expected {size}'}")
            if bad:
                problems.append(f"{shard.info.tensor} {shard.info.region.format()}: " + "; ".join(bad[:4])
                                + (f" and {len(bad) - 4} more" if len(bad) > 4 else ""))
            else:
                intact.append(shard.info)
        return sorted(intact, key=_sort_key), problems

    def commit(self, job: str, version: Version | str,
               expect: Sequence[tuple[str, Region, str | None]] | None = None,
               ptc: Mapping[str, Any] | None = None) -> Manifest:
        """Check the version (:meth:`_verify`) and write its commit marker, last; its manifest.

        Refused with :class:`~tenplex.errors.Conflict` naming every shard that is missing, incomplete or
        damaged (nothing is written then). Committing a committed version changes nothing; with ``expect``
        its shards must then be the expected ones. ``ptc`` (the PTC's JSON, dataset position at the version
        included) is kept with the version, written before the marker (:meth:`ptc_document` reads it).
        """
        v = check_version(version)
        check_job(job)
        if ptc is not None and not isinstance(ptc, Mapping):
            raise InvalidInput(f"the PTC of version {v} must be a JSON object, got {type(ptc).__name__}")

        async def run() -> Manifest:
            existing = await self._committed_manifest(job, v)
            if existing is not None:
                if expect is not None:
                    have = {(s.tensor, s.region): s.checksum for s in existing.shards}
                    want = {(t, r): c for t, r, c in expect}
                    if set(have) != set(want) or any(c is not None and have[k] != c for k, c in want.items()):
                        raise Conflict(f"version {v} of job {job!r} at {self.url} is committed with other shards "
                                       f"({len(have)}) than expected ({len(want)})")
                if ptc is not None and await self._get_json(self._ptc_key(job, v)) is None:
                    await self._put_json(self._ptc_key(job, v), dict(ptc))
                return existing
            if expect is None and not await self._list_dir(self._vkey(job, v)):
                raise await self._absent(job, v)
            intact, problems = await self._verify(job, v, expect)
            if problems:
                raise Conflict(f"version {v} of job {job!r} at {self.url} cannot be committed: {len(problems)} shard"
                               f"{'s are' if len(problems) > 1 else ' is'} not intact: " + "; ".join(problems[:20])
                               + (f"; and {len(problems) - 20} more" if len(problems) > 20 else ""))
            if not intact:
                raise await self._absent(job, v)
            manifest = Manifest(job, v, True, intact)
            if ptc is not None:
                await self._put_json(self._ptc_key(job, v), dict(ptc))
            if self.root is not None:  # the data durable before the marker that promises it
                await asyncio.to_thread(_sync_file_system, self.root)
            await self._put_json(self._marker(job, v), manifest.to_json())
            return manifest

        manifest = self._run(run(), f"committing {v} of job {job!r}")
        log.info("committed version %s of job %s at %s: %d shards, %d bytes", v, job, self.url, len(manifest.shards),
                 manifest.nbytes)
        return manifest

    def delete(self, job: str, version: Version | str) -> None:
        """Remove a version: its commit marker first, then its objects (it never looks committed and partial)."""
        v = check_version(version)
        check_job(job)

        async def run() -> None:
            marker = await self._backend.exists(self._marker(job, v))
            if not marker and not await self._list_dir(self._vkey(job, v)):
                raise NotFound(f"version {v} of job {job!r} is not at {self.url}")
            await self._backend.delete(self._marker(job, v))
            self._forget(job, v)
            with contextlib.suppress(FileNotFoundError):
                await self._backend.delete(self._ptc_key(job, v))
            await self._backend.delete_dir(self._vkey(job, v))

        self._run(run(), f"deleting {v} of job {job!r}")
        self._forget(job, v)
        log.info("deleted version %s of job %s at %s", v, job, self.url)

    def _forget(self, job: str, version: Version) -> None:
        with self._lock:
            self._manifests.pop((job, version), None)
            for key in [k for k in self._arrays if k[0] == job and k[1] == version]:
                del self._arrays[key]
            self._groups = {g for g in self._groups if not g.startswith(f"{self._vkey(job, version)}/")}


class PersistentShardWriter:
    """A shard being written to a :class:`PersistentStore`, piece by piece in payload order.

    Each piece is whole bands of chunks (so no chunk is written twice or read
    back) and goes to the store as its chunk objects at once; :meth:`finish`
    writes the shard's metadata with the checksum of all pieces, which makes
    it visible. ``finish(expected=...)`` refuses a payload whose checksum is
    not the one its source recorded (a damaged local copy is not uploaded).
    """

    def __init__(self, store: PersistentStore, job: str, version: Version, tensor: str, region: Region, dtype: str,
                 global_shape: tuple[int, ...], piece_bytes: int) -> None:
        self.store = store
        self.job, self.version, self.tensor, self.region = job, version, tensor, region
        self.dtype = dtype
        self.global_shape = global_shape
        st = storage_dtype(dtype)
        self._st = st
        self.chunks = chunk_shape(region.shape, st.itemsize, store.chunk_bytes)
        band = (self.chunks[0] * math.prod(region.shape[1:]) * st.itemsize) if self.chunks else st.itemsize
        self.pieces: list[Region] = list(slabs(region.shape, st.itemsize, max(piece_bytes, min(band, _MAX_PIECE_BYTES)),
                                               align=self.chunks))
        self.key = store._skey(job, version, tensor, region)
        shape = region.shape
        self._doc = _array_doc(shape, [max(1, c) for c in self.chunks], st, {})
        self._array = zarr.AsyncArray(metadata=self._doc, store_path=zarr.storage.StorePath(store._backend, self.key),
                                      config=_ZARR_CONFIG)
        self._next = 0
        self._crc = 0
        self._started = False
        self._done = False

    @property
    def nbytes(self) -> int:
        return self.region.volume * self._st.itemsize

    def write_piece(self, index: int, data: np.ndarray) -> None:
        """Store piece ``index`` (a C-contiguous array of the piece's shape in the storage dtype)."""
        if self._done:
            raise Conflict(f"shard {self.tensor!r} {self.region.format()!r} is already finished or aborted")
        if index != self._next:
            raise InvalidInput(f"shard pieces must be written in order: expected piece {self._next}, got {index}")
        piece = self.pieces[index]
        if data.shape != piece.shape:
            raise InvalidInput(f"piece {index} has shape {list(data.shape)}, expected {list(piece.shape)}")
        if data.dtype != self._st:
            raise InvalidInput(f"piece {index} is {data.dtype}, the shard is stored as {self._st}")
        what = f"uploading {self.tensor!r} {self.region} of {self.version}"

        async def run() -> None:
            if not self._started:  # a shard being replaced is incomplete from now until finish()
                await self.store._backend.delete(f"{self.key}/{_META}")
                self._started = True
            if piece.volume:
                await self._array.setitem(piece.slices() if piece.ndim else (), data)

        self.store._run(run(), what)
        self._crc = crc_of(np.ascontiguousarray(data), self._crc)
        self._next += 1

    def finish(self, expected: str | None = None) -> ShardInfo:
        """Write the shard's metadata (its checksum included), after all of its data; its record."""
        if self._done:
            raise Conflict(f"shard {self.tensor!r} {self.region.format()!r} is already finished or aborted")
        if self._next != len(self.pieces):
            raise InvalidInput(f"shard {self.tensor!r} {self.region.format()!r}: only {self._next} of "
                               f"{len(self.pieces)} pieces were written")
        checksum = format_checksum(self._crc)
        if expected is not None and checksum != expected:
            self._done = True
            raise ChecksumMismatch(f"shard {self.tensor!r} {self.region.format()!r} of {self.version}: the bytes read "
                                   f"have crc32c {checksum}, their source recorded {expected}; not uploaded")
        info = ShardInfo(self.tensor, self.region, self.dtype, self.global_shape, checksum, self.nbytes)
        doc = {**self._doc, "attributes": {ATTR: info.to_json()}}

        async def run() -> None:
            await self.store._ensure_groups(self.job, self.version, [self.tensor])
            await self.store._put_json(f"{self.key}/{_META}", doc)

        self.store._run(run(), f"uploading the metadata of {self.tensor!r} {self.region} of {self.version}")
        self._done = True
        return info

    def abort(self) -> None:
        """Give the shard up; its chunk objects stay until the version is deleted (they are never read)."""
        self._done = True


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _sync_file_system(root: Path) -> None:
    """What a ``file://`` location wrote made durable: :func:`~tenplex.core.files.syncfs`, else ``sync(2)``."""
    if not syncfs(root):
        os.sync()


def _stat_sizes(root: str, keys: Sequence[str]) -> dict[str, int]:
    """The sizes of those of ``keys`` that are files under ``root``."""
    out: dict[str, int] = {}
    for key in keys:
        try:
            st = os.stat(f"{root}/{key}")
        except (FileNotFoundError, NotADirectoryError):
            continue
        if stat.S_ISREG(st.st_mode):
            out[key] = st.st_size
    return out


def _file_sizes(root: Path, prefix: str) -> dict[str, int]:
    out: dict[str, int] = {}
    base = root / prefix
    for dirpath, _dirs, files in os.walk(base):
        for name in files:
            path = Path(dirpath) / name
            try:
                out[path.relative_to(root).as_posix()] = path.stat().st_size
            except FileNotFoundError:
                continue
    return out


def _link_files(pairs: Sequence[tuple[Path, Path]]) -> None:
    for src, dst in pairs:
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.unlink(missing_ok=True)
        try:
            os.link(src, dst)
        except FileNotFoundError:
            raise
        except OSError:  # no hard links on this file system: copy
            shutil.copyfile(src, dst)


__all__ = ["DEFAULT_CHUNK_BYTES", "PersistentShardWriter", "PersistentStore", "SmallShard", "chunk_shape"]
