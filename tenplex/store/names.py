"""Validation of the names that become paths under a store's root.

Job, version and tensor names come from HTTP requests and CLI arguments and
are turned into directory names, so each is checked against a strict pattern
before it touches the file system: nothing may escape the root (``..``,
absolute paths, NUL, backslashes, empty segments) or collide with the store's
own bookkeeping entries, which all start with a dot.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tenplex.core.version import Version
from tenplex.errors import InvalidInput
from tenplex.ptc.dtypes import check_dtype
from tenplex.ptc.region import Region

# Kubernetes-like: starts alphanumeric, then alphanumerics, '.', '_', '-'.
_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# One segment of a tensor name (the name is '/'-separated, e.g. optim/layers.0.w/exp_avg).
_SEGMENT = re.compile(r"^[A-Za-z0-9_+=@:\-][A-Za-z0-9_.+=@:\-]*$")
_MAX_TENSOR = 240  # the encoded name is one directory entry (255 bytes on Linux)
_REGION_KEY = re.compile(r"^r((?:0|[1-9][0-9]*)-(?:0|[1-9][0-9]*)(?:_(?:0|[1-9][0-9]*)-(?:0|[1-9][0-9]*))*)?$")


def check_job(job: str) -> str:
    if not isinstance(job, str) or not _JOB.match(job):
        raise InvalidInput(
            f"job name {job!r} is invalid: use 1-128 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )
    return job


def check_version(version: Version | str) -> Version:
    if isinstance(version, Version):
        return version
    if not isinstance(version, str):
        raise InvalidInput(f"version {version!r} must be a Version or a string like 's120-g0'")
    return Version.parse(version)


def check_tensor(name: str) -> str:
    """Accept a tensor name such as ``layers.0.attn.qkv.weight`` or ``optim/emb.weight/exp_avg``."""
    if not isinstance(name, str) or name == "":
        raise InvalidInput(f"tensor name {name!r} is empty or not a string")
    if len(name) > _MAX_TENSOR:
        raise InvalidInput(f"tensor name {name[:60]!r}... is {len(name)} characters long; at most {_MAX_TENSOR} are allowed")
    for segment in name.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidInput(f"tensor name {name!r} has an empty, '.' or '..' path segment")
        if not _SEGMENT.match(segment):
            raise InvalidInput(
                f"tensor name {name!r}: segment {segment!r} may only use A-Z a-z 0-9 . _ - + = @ : "
                "and must not start with '.'"
            )
    return name



def check_shard_target(job: str, version: Version | str, tensor: str, dtype: str, global_shape: Sequence[int],
                       region: Region) -> tuple[Version, tuple[int, ...]]:
    """Check a shard a store is asked to write (names, dtype, a non-negative global shape, a region inside
    it) before any byte arrives; the version and the global shape as the store keeps them."""
    check_job(job)
    v = check_version(version)
    check_tensor(tensor)
    check_dtype(dtype)
    try:
        gshape = tuple(int(n) for n in global_shape)
    except (TypeError, ValueError):
        raise InvalidInput(f"global shape {global_shape!r} is not a list of integers") from None
    if any(n < 0 for n in gshape):
        raise InvalidInput(f"global shape {list(gshape)} has a negative dimension")
    if not isinstance(region, Region):
        raise InvalidInput(f"region must be a Region, got {type(region).__name__}")
    region.check_within(gshape)
    return v, gshape

def tensor_dirname(name: str) -> str:
    """The one directory entry that holds a tensor's shards ('/' is encoded; '%' never occurs in names)."""
    return check_tensor(name).replace("/", "%2F")


def tensor_from_dirname(dirname: str) -> str:
    return check_tensor(dirname.replace("%2F", "/"))


def region_key(region: Region) -> str:
    """Directory name of a shard: ``r0-96_0-64`` (``r`` for a 0-d tensor)."""
    return "r" + "_".join(f"{a}-{b}" for a, b in region.bounds)


def region_from_key(key: str) -> Region | None:
    """The inverse of :func:`region_key`; ``None`` for entries that are not shards."""
    if not _REGION_KEY.match(key):
        return None
    body = key[1:]
    if body == "":
        return Region(())
    try:
        return Region(tuple((int(a), int(b)) for a, b in (part.split("-") for part in body.split("_"))))
    except InvalidInput:  # e.g. start > stop: not a key this store wrote
        return None
