"""The store daemon's wire format: what its client and its server must agree on, written once.

Routes (``/v1``; all but ``/healthz`` behind ``Authorization: Bearer <token>`` when the daemon has one)::

    GET    /v1/jobs/{job}/versions/{version}/tensors/{tensor}?region=a:b,c:d[&uncommitted=1]   raw bytes
    POST   /v1/jobs/{job}/versions/{version}/regions     RegionsRequest -> the regions' bytes, one body
    PUT    /v1/jobs/{job}/versions/{version}/tensors/{tensor}?region=a:b,c:d   raw body -> {"stored": shard}
    POST   /v1/jobs/{job}/versions/{version}/links       LinkRequest -> {"linked": shard}

(and the JSON routes for jobs, versions, manifests, commit and delete, see
:mod:`tenplex.node.store_routes`). Bulk bytes are raw C-order element bytes; what
describes them travels in headers:

- ``X-Tenplex-Dtype``: the tensor's dtype name (``bfloat16``, ``float32``, ...);
- ``X-Tenplex-Shape``: the body's shape, :func:`format_shape` (``a,b``; empty for 0-d);
- ``X-Tenplex-Global-Shape``: the tensor's whole shape, same format;
- ``X-Tenplex-Checksum``: ``crc32c:xxxxxxxx`` of the body (a whole stored shard's is the one recorded
  when it was written: a damaged disk shows up as a mismatch at the client);
- ``X-Tenplex-Parts``: a batch read's parts, :func:`format_parts`: a JSON list of
  ``[dtype, shape, checksum]`` per region, in the order asked for.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from tenplex.core.protocol import ENV_TOKEN
from tenplex.core.version import Version
from tenplex.errors import InvalidInput
from tenplex.ptc.region import Region
from tenplex.store.names import check_job, check_tensor, check_version

TOKEN_ENV = ENV_TOKEN
"""The bearer token of the store daemons when none is given (one token per cluster, the scheduler's too)."""

DTYPE_HEADER = "X-Tenplex-Dtype"
SHAPE_HEADER = "X-Tenplex-Shape"
GLOBAL_SHAPE_HEADER = "X-Tenplex-Global-Shape"
CHECKSUM_HEADER = "X-Tenplex-Checksum"
PARTS_HEADER = "X-Tenplex-Parts"

MAX_BATCH_REGIONS = 256
"""Regions per batch read: keeps ``X-Tenplex-Parts`` well under a client's 64 KiB header line. The daemon
refuses more; the client and the executor cut their batches at it."""
MAX_COMMIT_WAIT_S = 30.0
"""The longest the daemon holds a ``GET .../committed?wait=`` long poll."""


def format_shape(shape: Sequence[int]) -> str:
    """``(4, 8)`` -> ``'4,8'``; ``()`` -> ``''``."""
    return ",".join(str(int(n)) for n in shape)


def parse_shape(text: str, *, what: str) -> tuple[int, ...]:
    """The inverse of :func:`format_shape`; :class:`~tenplex.errors.InvalidInput` naming ``what`` otherwise."""
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


def format_parts(parts: Iterable[tuple[str, Sequence[int], str]]) -> str:
    """The ``X-Tenplex-Parts`` value of a batch read: ``(dtype, shape, checksum)`` per region."""
    return json.dumps([[dtype, format_shape(shape), checksum] for dtype, shape, checksum in parts], separators=(",", ":"))


def parse_parts(text: str, count: int) -> list[tuple[str, str, str]]:
    """``(dtype, shape text, checksum)`` per region of an ``X-Tenplex-Parts`` value that must describe
    ``count`` regions; :class:`~tenplex.errors.InvalidInput` for anything else."""
    try:
        parts = json.loads(text)
    except ValueError:
        parts = None
    if (
        not isinstance(parts, list) or len(parts) != count
        or not all(isinstance(x, list) and len(x) == 3 and all(isinstance(y, str) for y in x) for x in parts)
    ):
        raise InvalidInput(f"{PARTS_HEADER} does not describe the {count} regions asked for: {text[:200]!r}")
    return [(d, s, c) for d, s, c in parts]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegionRef(_Body):
    """One region of a batch read."""

    tensor: str
    region: str = Field(description="a:b,c:d in the tensor's global coordinates")


class RegionsRequest(_Body):
    """Body of ``POST .../regions``: at most :data:`MAX_BATCH_REGIONS` regions of one committed version."""

    regions: list[RegionRef] = Field(max_length=MAX_BATCH_REGIONS)

    @classmethod
    def of(cls, regions: Iterable[tuple[str, Region]]) -> RegionsRequest:
        return cls(regions=[RegionRef(tensor=t, region=r.format()) for t, r in regions])


class LinkRequest(_Body):
    """Body of ``POST .../versions/{to_version}/links``: put a shard of an older committed version into
    this one on the daemon's disk (hard links), without its bytes crossing the wire."""

    from_version: str = Field(description="the committed version holding the shard, s<step>-g<generation>")
    tensor: str
    region: str = Field(description="a:b,c:d: exactly the stored shard's region")
    verify: bool = Field(True, description="check the old shard against its recorded checksum first")


class ReservationRequest(_Body):
    """Body of ``POST .../versions/{version}/reservation``: room for ``nbytes`` more of an uncommitted version
    in the node's memory tier, asked by a writer that writes into it through the store's files."""

    nbytes: int = Field(ge=0, description="bytes the caller is about to write into the version")


def versions_path(job: str, version: Version | str | None = None, tensor: str | None = None) -> str:
    """``/v1/jobs/{job}/versions[/{version}[/tensors/{tensor}]]``, every name checked and quoted."""
    path = f"/v1/jobs/{urllib.parse.quote(check_job(job), safe='')}/versions"
    if version is not None:
        path += f"/{check_version(version)}"
    if tensor is not None:
        path += f"/tensors/{urllib.parse.quote(check_tensor(tensor), safe='/')}"
    return path
