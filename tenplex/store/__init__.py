"""The tensor store: zarr-backed shard storage per node, served over HTTP.

``LocalStore`` keeps shards on the node's disk, versioned per job;
``create_app``/``serve``/``StoreServer`` (in :mod:`tenplex.store.server`) serve
it; ``StoreClient`` (in :mod:`tenplex.store.client`) is what the transformer and
the workers use to read and write remote stores. The server and client are
imported from their modules so that importing the data model stays light.
"""

from tenplex.store.local import LocalStore, ShardWriter, TensorReader
from tenplex.store.model import Manifest, ShardInfo, VersionInfo
from tenplex.store.version import Version

__all__ = ["LocalStore", "Manifest", "ShardInfo", "ShardWriter", "TensorReader", "Version", "VersionInfo"]
