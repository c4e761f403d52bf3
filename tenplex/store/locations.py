"""Persistent locations: their URIs and connection options, checked without loading zarr or obstore.

A job's persistent tier lives at a URI (issue 15):

- ``s3://bucket/prefix`` on any S3-compatible object store (AWS, MinIO, Ceph, moto, ...);
- ``file:///path`` on a shared file system or a mounted volume.

The control plane and the daemon's request parsers check them here (this
module imports neither zarr nor obstore); :class:`~tenplex.store.persistent.PersistentStore`
opens them. Connection options name the endpoint and region of an object
store, and may carry credentials; where none are given, the standard AWS
environment variables of the process that opens the store apply
(``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``: what the chart sets from
its Secret). Credentials are never written into a record or a log line:
:func:`public_options` is what may be shown.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

from tenplex.errors import InvalidInput

SCHEMES = ("s3", "file")
"""URI schemes of persistent locations."""

OPTION_KEYS: dict[str, type] = {
    "endpoint": str,  # e.g. http://minio.storage:9000 (path-style requests); default: $AWS_ENDPOINT_URL or AWS
    "region": str,  # default: $AWS_REGION / $AWS_DEFAULT_REGION, else us-east-1
    "allow_http": bool,  # plain-HTTP endpoints; implied by an http:// endpoint
    "virtual_hosted_style": bool,  # bucket.endpoint/key instead of endpoint/bucket/key
    "access_key_id": str,
    "secret_access_key": str,
    "session_token": str,
    "skip_signature": bool,  # anonymous requests (public buckets)
}
SECRET_KEYS = frozenset({"access_key_id", "secret_access_key", "session_token"})
"""Options that are credentials: kept out of records, logs and answers."""

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def is_persistent_uri(location: str) -> bool:
    """Whether ``location`` names a persistent location (by its scheme), valid or not."""
    return urlsplit(str(location)).scheme in SCHEMES


def check_uri(uri: str) -> str:
    """The URI in its normal form (no trailing slash), or :class:`~tenplex.errors.InvalidInput` saying why not.

    ``s3://bucket[/prefix]`` (an S3 bucket name; the prefix's segments must not be empty, ``.`` or ``..``)
    or ``file:///absolute/path`` (on this machine: no host but ``localhost``; percent-escapes allowed).
    """
    if not isinstance(uri, str) or not uri:
        raise InvalidInput("a persistent location is needed: s3://bucket/prefix or file:///path")
    parts = urlsplit(uri)
    if parts.query or parts.fragment:
        raise InvalidInput(f"persistent location {uri!r} must not have a query or a fragment")
    if parts.scheme == "s3":
        bucket = parts.netloc
        if not _BUCKET.match(bucket) or ".." in bucket:
            raise InvalidInput(f"persistent location {uri!r}: {bucket!r} is not an S3 bucket name (3-63 of a-z 0-9 . -)")
        prefix = parts.path.strip("/")
        if prefix and any(seg in ("", ".", "..") for seg in prefix.split("/")):
            raise InvalidInput(f"persistent location {uri!r}: the prefix has an empty, '.' or '..' segment")
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise InvalidInput(f"persistent location {uri!r}: a file:// URI must name a path on this machine (file:///path)")
        path = unquote(parts.path)
        if not path.startswith("/") or any(seg in (".", "..") for seg in path.split("/")):
            raise InvalidInput(f"persistent location {uri!r}: a file:// URI needs an absolute path without '.' or '..'")
        return "file://" + parts.path.rstrip("/") if parts.path.rstrip("/") else "file:///"
    raise InvalidInput(f"persistent location {uri!r} must be s3://bucket/prefix or file:///path")


def check_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Connection options, checked: known keys (:data:`OPTION_KEYS`) with values of their types."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise InvalidInput(f"persistent store options must be an object, got {type(options).__name__}")
    out: dict[str, Any] = {}
    for key, value in options.items():
        kind = OPTION_KEYS.get(key)
        if kind is None:
            raise InvalidInput(f"unknown persistent store option {key!r}; known: {', '.join(sorted(OPTION_KEYS))}")
        if not isinstance(value, kind) or (kind is str and not value):
            raise InvalidInput(f"persistent store option {key!r} must be a {'non-empty string' if kind is str else kind.__name__}")
        out[key] = value
    endpoint = out.get("endpoint")
    if endpoint is not None:
        ep = urlsplit(endpoint)
        if ep.scheme not in ("http", "https") or not ep.hostname:
            raise InvalidInput(f"persistent store option 'endpoint' {endpoint!r} must look like https://HOST[:PORT]")
    return out


def public_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The options without credentials: what a record, an answer or a log line may show."""
    return {k: v for k, v in (options or {}).items() if k not in SECRET_KEYS}


__all__ = ["OPTION_KEYS", "SCHEMES", "SECRET_KEYS", "check_options", "check_uri", "is_persistent_uri", "public_options"]
