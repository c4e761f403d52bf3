"""``tenplex store serve``: run this node's daemon; the rest of the ``tenplex store`` group is :mod:`tenplex.store.cli`.

The command keeps its place under ``tenplex store`` (the chart's DaemonSet, the local backend and people run
``tenplex store serve``); the group is made here so that the store's own commands need nothing of the
daemon. The daemon (FastAPI, uvicorn) and the local store (zarr) are imported when the command runs: every
``cli`` module is imported to build ``tenplex --help``, which should not load them.
"""

from __future__ import annotations

import argparse
import logging
import os

from tenplex.core.units import parse_bytes
from tenplex.store import cli as store_cli
from tenplex.store.buffers import DEFAULT_CHUNK_BYTES
from tenplex.store.locations import check_options


def register(sub: argparse._SubParsersAction) -> None:
    """``tenplex store``: ``serve`` (this node's daemon) first, then the store's own tools (:mod:`tenplex.store.cli`)."""
    store = sub.add_parser("store", help="the node-local tensor store: serve, list, fetch, verify, collect")
    cmds = store.add_subparsers(dest="store_command", metavar="SUBCOMMAND", required=True)

    serve = cmds.add_parser("serve", help="run the store daemon of this node (blocks until interrupted)")
    serve.add_argument("--root", required=True, help="directory that holds the shards")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=0, help="port (default 0: any free port, logged and written to --port-file)")
    serve.add_argument("--token", default=None, help="admin bearer token (the scheduler's and the operator's) "
                       "(default: $TENPLEX_TOKEN)")
    serve.add_argument("--auth-keys", default=None, metavar="FILE",
                       help="key set verifying the scheduler's job-scoped credentials, re-read when it changes "
                            "(default: $TENPLEX_AUTH_KEYS)")
    serve.add_argument("--tls-cert", default=None, metavar="PEM", help="serve HTTPS with this certificate "
                       "(default: $TENPLEX_TLS_CERT)")
    serve.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's key (default: $TENPLEX_TLS_KEY)")
    serve.add_argument("--port-file", default=None, help="write the bound port to this file once listening")
    serve.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="target zarr chunk size (default 4 MiB)")
    serve.add_argument(
        "--workers", type=int, default=1, help="server processes sharing the port (default 1; about one per core for parallel pulls)"
    )
    serve.add_argument("--transform-concurrency", type=int, default=8, metavar="N",
                       help="piece reads in flight per transform this node runs (default 8)")
    serve.add_argument("--transform-memory", type=_size, default=1 << 30, metavar="SIZE",
                       help="destination buffers of all running transforms together, e.g. 2Gi (default 1Gi)")
    serve.add_argument("--transform-resident", type=_size, default=None, metavar="SIZE",
                       help="part of --transform-memory faulted in at start-up (in the background) and held for the "
                            "daemon's life, so that its first transform zeroes no fresh pages (default: one "
                            "transform's share, --transform-memory / --transform-max-running; 0 for memory-tight "
                            "nodes: buffers are faulted in by each burst of transforms and let go 60 s after the last)")
    serve.add_argument("--transform-max-running", type=int, default=2, metavar="N",
                       help="transforms running at once; more wait in state queued (default 2)")
    serve.add_argument("--upload-concurrency", type=int, default=4, metavar="N",
                       help="shards in flight per upload to the persistent tier (default 4)")
    serve.add_argument("--upload-memory", type=_size, default=512 << 20, metavar="SIZE",
                       help="read buffers of all running uploads together, e.g. 1Gi (default 512Mi)")
    serve.add_argument("--upload-max-running", type=int, default=2, metavar="N",
                       help="uploads running at once; more wait in state queued (default 2)")
    serve.add_argument("--upload-retry-for", type=float, default=900.0, metavar="SECONDS",
                       help="how long an upload keeps retrying after its first error, with exponential backoff (default 900)")
    serve.add_argument("--s3-endpoint", metavar="URL", default=None,
                       help="endpoint of the S3-compatible store of persistent checkpoints (MinIO, Ceph, ...), e.g. "
                            "http://minio.storage:9000; default $AWS_ENDPOINT_URL, else AWS. Credentials come from the "
                            "environment only (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN)")
    serve.add_argument("--s3-region", metavar="REGION", default=None,
                       help="region of that store (default $AWS_REGION, else us-east-1)")
    serve.add_argument("--memory-root", default=None, metavar="DIR",
                       help="memory tier: a tmpfs directory (e.g. /dev/shm/tenplex) where new versions are written, "
                            "served from and spilled to --root in the background (needs --memory-bytes)")
    serve.add_argument("--memory-bytes", type=_size, default=None, metavar="SIZE",
                       help="memory tier budget, e.g. 16Gi: versions beyond it evict the oldest spilled ones or go to disk")
    serve.add_argument("--evict-grace", type=float, default=None, metavar="SECONDS",
                       help="memory tier: how long an evicted version's memory files stay for reads in flight (default 2)")
    serve.add_argument("--spill-interval", type=float, default=0.0, metavar="SECONDS",
                       help="memory tier: spill each job's newest version to disk at most this often; the versions in "
                            "between stay in memory only (default 0: every version, as soon as it is committed)")
    serve.add_argument("--scheduler-url", default=os.environ.get("TENPLEX_SCHEDULER_URL") or None, metavar="URL",
                       help="relay this node's workers' heartbeats to this scheduler, one report per node and "
                            "interval (default $TENPLEX_SCHEDULER_URL; none: workers heartbeat the scheduler "
                            "themselves)")
    serve.add_argument("--relay-interval", type=float, default=1.0, metavar="SECONDS",
                       help="how often the relayed heartbeats are sent (default 1)")
    serve.set_defaults(func=_serve)

    store_cli.register(cmds)


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _serve(args: argparse.Namespace) -> int:
    from tenplex.core.tls import ServerTLS
    from tenplex.node.daemon import serve
    from tenplex.node.transforms import TransformSettings
    from tenplex.node.uploads import UploadSettings

    # The persistent tier is opened by uploads and by transforms reading a checkpoint, in this process and in
    # its uvicorn workers: the flags become the standard AWS environment they all read.
    if args.s3_endpoint is not None:
        check_options({"endpoint": args.s3_endpoint})
        os.environ["AWS_ENDPOINT_URL"] = args.s3_endpoint
    if args.s3_region is not None:
        check_options({"region": args.s3_region})
        os.environ["AWS_REGION"] = args.s3_region
    transforms = TransformSettings(
        concurrency=args.transform_concurrency, memory_bytes=args.transform_memory,
        max_running=args.transform_max_running, resident_bytes=(  # more than --transform-memory: TransformSettings says so
            args.transform_memory // max(1, args.transform_max_running) if args.transform_resident is None
            else args.transform_resident
        ),
    )
    uploads = UploadSettings(
        concurrency=args.upload_concurrency, memory_bytes=args.upload_memory, max_running=args.upload_max_running,
        retry_for_s=args.upload_retry_for,
    )
    serve(
        args.root,
        host=args.host,
        port=args.port,
        token=args.token,
        port_file=args.port_file,
        chunk_bytes=args.chunk_bytes,
        workers=args.workers,
        transforms=transforms,
        uploads=uploads,
        log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        memory_root=args.memory_root,
        memory_bytes=args.memory_bytes,
        evict_grace_s=args.evict_grace,
        spill_interval_s=args.spill_interval,
        auth_keys=args.auth_keys,
        tls=ServerTLS.from_options(args.tls_cert, args.tls_key),
        scheduler_url=args.scheduler_url,
        relay_interval_s=args.relay_interval,
    )
    return 0
