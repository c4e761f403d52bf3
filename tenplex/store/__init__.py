"""The tensor store: shards of a job's state per node, versioned, read and written through one interface.

- :class:`TensorStore` (:mod:`tenplex.store.base`): what every consumer uses, whichever side of the wire
  the store is on; :func:`open_store` opens one by its address.
- :class:`~tenplex.store.local.LocalStore`: zarr shards on the node's disk (imports zarr).
- :class:`~tenplex.store.client.StoreClient`: the node's daemon over HTTP.
- :mod:`tenplex.store.server`: the daemon's routes (FastAPI on uvicorn); :mod:`tenplex.store.wire`: the
  headers, limits and bodies client and server share.

Importing this package loads neither zarr nor FastAPI: the worker library and the executor stand on it.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from tenplex.errors import InvalidInput
from tenplex.store.base import RegionRead, SnapshotBuffers, TensorStore
from tenplex.store.client import StoreClient
from tenplex.store.model import Manifest, ShardInfo, VersionInfo


def open_store(location: str | Path, token: str | None = None, *, memory_root: str | Path | None = None) -> TensorStore:
    """The store at ``location``: a daemon's ``http(s)://`` URL (a :class:`StoreClient` with ``token``,
    default ``$TENPLEX_TOKEN``), or a store root on this machine, as a path or a ``file://`` URL (a
    :class:`~tenplex.store.local.LocalStore`; ``token`` is not used). A local root uses the memory tier its
    daemon recorded there, at ``memory_root`` when given (the tier's directory as this process sees it).

    The one place that imports the local store lazily, and why: it loads zarr, which a process that reaches
    its node's store over HTTP (a worker without the store's directory mounted, a control plane) never needs,
    while a worker that has the directory writes its snapshots there directly. Both get their store here.
    """
    text = str(location)
    parts = urlsplit(text)
    if parts.scheme in ("http", "https"):
        return StoreClient(text, token=token)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise InvalidInput(f"store location {text!r}: a file:// URL must name a path on this machine")
        text = unquote(parts.path)
    elif parts.scheme and len(parts.scheme) > 1:  # (a one-letter scheme is a Windows drive)
        raise InvalidInput(f"store location {text!r} must be an http(s):// URL or a directory (path or file:// URL)")
    if not text:
        raise InvalidInput("store location is empty: give an http(s):// URL or a directory")
    from tenplex.store.local import LocalStore

    return LocalStore(text, memory_root=memory_root)


__all__ = ["Manifest", "RegionRead", "ShardInfo", "SnapshotBuffers", "StoreClient", "TensorStore", "VersionInfo", "open_store"]
