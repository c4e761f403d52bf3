"""The tensor store: shards of a job's state per node, versioned, read and written through one interface.

- :class:`TensorStore` (:mod:`tenplex.store.base`): what every consumer uses, whichever side of the wire
  the store is on; :func:`open_store` opens one by its address.
- :class:`~tenplex.store.local.LocalStore`: zarr shards on the node's disk (imports zarr).
- :class:`~tenplex.store.client.StoreClient`: the node's daemon over HTTP.
- :class:`~tenplex.store.persistent.PersistentStore`: a job's persistent tier (``s3://`` or ``file://``, zarr v3
  through zarr's own storage backends; imports zarr and obstore).
- :mod:`tenplex.store.wire`: the headers, limits and bodies of the store's HTTP API, shared by the client and
  the node daemon that serves it (:mod:`tenplex.node.store_routes`).

Importing this package loads neither zarr nor FastAPI: the worker library and the executor stand on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from tenplex.errors import InvalidInput
from tenplex.store.base import RegionRead, SnapshotBuffers, TensorStore
from tenplex.store.client import StoreClient
from tenplex.store.locations import SCHEMES
from tenplex.store.model import Manifest, ShardInfo, VersionInfo

if TYPE_CHECKING:
    from tenplex.store.memory import Placement


def open_store(location: str | Path, token: str | None = None, *, options: Mapping[str, Any] | None = None,
               memory_root: str | Path | None = None, placement: Placement | None = None) -> TensorStore:
    """The store at ``location``, by its address:

    - a daemon's ``http(s)://`` URL: a :class:`StoreClient` with ``token`` (default ``$TENPLEX_TOKEN``);
    - a persistent location, ``s3://bucket/prefix`` or ``file:///path``: a
      :class:`~tenplex.store.persistent.PersistentStore` with connection ``options`` (endpoint, region,
      credentials; the AWS environment variables fill in the rest);
    - a directory on this machine, as a path: the node store there, a :class:`~tenplex.store.local.LocalStore`
      (what a ``LocalStore``'s ``url`` is); it uses the memory tier its daemon recorded there, at
      ``memory_root`` when given (the tier's directory as this process sees it), its versions placed there by
      ``placement`` (a worker: its daemon's :class:`StoreClient`) or else by this process.

    ``token`` serves only daemons and ``options`` only persistent locations. Each implementation is imported
    here when it is asked for, and why: the local and persistent stores load zarr (and obstore), which a
    process that reaches its node's store over HTTP (a worker without the store's directory mounted, a control
    plane) never needs, while a worker that has the directory writes its snapshots there directly.
    """
    text = str(location)
    parts = urlsplit(text)
    if parts.scheme in ("http", "https"):
        return StoreClient(text, token=token)
    if parts.scheme in SCHEMES:
        from tenplex.store.persistent import PersistentStore

        return PersistentStore(text, options=options)
    if parts.scheme and len(parts.scheme) > 1:  # (a one-letter scheme is a Windows drive)
        raise InvalidInput(
            f"store location {text!r} must be an http(s):// URL, s3://bucket/prefix, file:///path or a directory"
        )
    if not text:
        raise InvalidInput("store location is empty: give an http(s):// URL, a persistent location or a directory")
    from tenplex.store.local import LocalStore

    return LocalStore(text, memory_root=memory_root, placement=placement)


__all__ = ["Manifest", "RegionRead", "ShardInfo", "SnapshotBuffers", "StoreClient", "TensorStore", "VersionInfo", "open_store"]
