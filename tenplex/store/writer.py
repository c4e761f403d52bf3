"""A shard of a :class:`~tenplex.store.local.LocalStore` being written: its bytes into staging, then installed.

Apart from the store because a writer needs nothing of it but the directory it
was given and one call to install the result: the daemon's upload route feeds
one from a request body (:mod:`tenplex.node.store_routes`), the store's own
:meth:`~tenplex.store.local.LocalStore.write_shard` from an array.
"""

from __future__ import annotations

import json
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import zarr
import zarr.storage

from tenplex.core.version import Version
from tenplex.errors import Conflict, InvalidInput
from tenplex.ptc.dtypes import itemsize
from tenplex.ptc.region import Region
from tenplex.store.buffers import crc32c_combine, crc_of
from tenplex.store.layout import ATTR, CHUNK_CRCS, write_json_atomic, write_small
from tenplex.store.model import ShardInfo, format_checksum
from tenplex.store.rawchunks import ChunkLayout, RawChunkWriter


class Install(Protocol):
    """Move a complete shard from ``staging`` into its version (``staged_in_memory``: staged in the memory tier)."""

    def __call__(self, job: str, version: Version, info: ShardInfo, staging: Path, staged_in_memory: bool) -> None: ...


_ZARR_CONFIG = {"write_empty_chunks": True}  # -0.0 and NaN payloads round-trip bit-exactly


@dataclass
class ShardWriter:
    """A shard being written, piece by piece, in payload order; invisible until :meth:`finish`.

    The server feeds it from the request body stream (so a 2 GiB upload needs
    only two pieces of memory); :meth:`LocalStore.write_shard` feeds it one
    array. Pieces must come in the order of :attr:`pieces`. ``install`` moves the finished shard from
    ``staging`` into its version (:meth:`LocalStore.open_writer` gives its own, which checks the version
    under the job's lock): the writer knows bytes and files, the store where they go.
    """

    install: Install
    job: str
    version: Version
    tensor: str
    region: Region
    dtype: str
    global_shape: tuple[int, ...]
    staging: Path
    layout: ChunkLayout
    pieces: list[Region]
    raw: RawChunkWriter | None = None
    in_memory: bool = False
    """Whether ``staging`` is in the memory tier (where the version was placed when the writer opened)."""
    _zarr: zarr.Array | None = None
    _next: int = 0
    _crc: int = 0
    _done: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def nbytes(self) -> int:
        return self.region.volume * itemsize(self.dtype)

    def write_piece(self, index: int, data: np.ndarray) -> None:
        """Store piece ``index`` (a contiguous array of the piece's shape in the storage dtype)."""
        with self._lock:
            if self._done:
                raise Conflict(f"shard {self.tensor!r} {self.region.format()!r} is already finished or aborted")
            if index != self._next:
                raise InvalidInput(f"shard pieces must be written in order: expected piece {self._next}, got {index}")
            piece = self.pieces[index]
            if data.shape != piece.shape:
                raise InvalidInput(f"piece {index} has shape {list(data.shape)}, expected {list(piece.shape)}")
            crc = None
            if piece.volume:
                if self.raw is not None and self.raw.covers_whole_chunks(piece):
                    crc = self.raw.write(piece, data)  # from the chunk files' own checksums, when they give it
                else:
                    self._zarr_array().set_basic_selection(piece.slices(), data)
            if crc is None:
                self._crc = crc_of(data, self._crc)
            else:
                self._crc = crc32c_combine(self._crc, crc, data.nbytes)
            self._next += 1

    def _zarr_array(self) -> zarr.Array:
        """zarr's view of the staged array, for pieces the direct writer does not handle (made on first use)."""
        if self._zarr is None:
            write_json_atomic(self.staging / "zarr.json", self.layout.metadata({}), durable=False)
            self._zarr = zarr.open_array(store=zarr.storage.LocalStore(self.staging), mode="r+", config=_ZARR_CONFIG)
        return self._zarr

    def finish(self) -> ShardInfo:
        """Record the checksum and move the shard into its version (replacing an earlier copy)."""
        with self._lock:
            if self._done:
                raise Conflict(f"shard {self.tensor!r} {self.region.format()!r} is already finished or aborted")
            if self._next != len(self.pieces):
                raise InvalidInput(
                    f"shard {self.tensor!r} {self.region.format()!r}: only {self._next} of {len(self.pieces)} pieces were written"
                )
            self._done = True
        info = ShardInfo(self.tensor, self.region, self.dtype, self.global_shape, format_checksum(self._crc), self.nbytes)
        try:
            # a plain write: the staging directory is this writer's alone and is renamed into place after
            attributes: dict[str, Any] = {ATTR: info.to_json()}
            chunk_crcs = self.raw.chunk_checksums() if self.raw is not None and self._zarr is None else None
            if chunk_crcs is not None:
                attributes[CHUNK_CRCS] = chunk_crcs
            write_small(self.staging / "zarr.json", json.dumps(self.layout.metadata(attributes), separators=(",", ":")).encode())
            self.install(self.job, self.version, info, self.staging, self.in_memory)
        except BaseException:
            shutil.rmtree(self.staging, ignore_errors=True)
            raise
        return info

    def abort(self) -> None:
        """Throw the partial shard away (nothing of it was ever visible)."""
        with self._lock:
            self._done = True
        shutil.rmtree(self.staging, ignore_errors=True)
