"""How a worker reaches its node-local store: over HTTP, or directly on the node's disk.

A worker normally talks to the store daemon of its node over HTTP
(``tenplex.store.client.StoreClient``). When the worker runs on the same
machine as the store's root directory, it can also open the
:class:`~tenplex.store.LocalStore` directly (:class:`DirectStore`): the same
versions, the same atomic commit (the local store is safe to share between
processes on one root), without the HTTP round trips. :func:`open_store`
chooses by the address: ``http(s)://...`` or a path / ``file://`` URL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import numpy as np

from tenplex.errors import ChecksumMismatch
from tenplex.ptc import Region
from tenplex.ptc.dtypes import storage_dtype
from tenplex.store import LocalStore, Manifest, Version
from tenplex.store.buffers import crc_of, host_buffer
from tenplex.store.model import parse_checksum


class ShardStore(Protocol):
    """What the worker needs of a store (``StoreClient`` and :class:`DirectStore` have it)."""

    def write_shard(
        self, job: str, version: Version | str, tensor: str, region: Region, data: Any, *, dtype: str, global_shape: Any
    ) -> Any: ...

    def read_into(
        self, job: str, version: Version | str, tensor: str, region: Region, out: Any, verify: bool = True
    ) -> Any: ...

    def manifest(self, job: str, version: Version | str) -> Manifest: ...

    def commit(self, job: str, version: Version | str) -> Any: ...


class DirectStore:
    """A :class:`~tenplex.store.LocalStore` on this machine with the client's read interface."""

    def __init__(self, store: LocalStore | str | Path) -> None:
        self.local = store if isinstance(store, LocalStore) else LocalStore(store)

    def __repr__(self) -> str:
        return f"DirectStore({str(self.local.root)!r})"

    def write_shard(
        self, job: str, version: Version | str, tensor: str, region: Region, data: Any, *, dtype: str, global_shape: Any
    ) -> Any:
        return self.local.write_shard(job, version, tensor, region, data, dtype=dtype, global_shape=global_shape)

    def read_into(
        self, job: str, version: Version | str, tensor: str, region: Region, out: Any, verify: bool = True
    ) -> None:
        """Fill ``out`` with ``region`` of a committed version; verify the checksum when it is a whole stored shard."""
        reader = self.local.open_tensor(job, version, tensor)
        with host_buffer(out, reader.dtype, what=f"output buffer for {tensor!r}") as view:
            reader.read(region, view)
            shard = reader.exact_shard(region) if verify else None
            if shard is not None:
                got = crc_of(np.asarray(view, dtype=storage_dtype(reader.dtype)))
                if got != parse_checksum(shard.checksum):
                    raise ChecksumMismatch(
                        f"tensor {tensor!r} region {region.format()!r} of version {version} read back with crc32c "
                        f"{got:08x}, stored {shard.checksum}"
                    )

    def manifest(self, job: str, version: Version | str) -> Manifest:
        return self.local.manifest(job, version)

    def commit(self, job: str, version: Version | str) -> Manifest:
        return self.local.commit(job, version)


def open_store(location: str, token: str | None = None) -> ShardStore:
    """The store at ``location``: an ``http(s)://`` URL (the node's store daemon) or a local root directory."""
    scheme = urlsplit(location).scheme
    if scheme in ("http", "https"):
        from tenplex.store.client import StoreClient

        return StoreClient(location, token=token)
    if scheme == "file":
        location = urlsplit(location).path
    return DirectStore(location)
