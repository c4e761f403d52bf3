"""``tenplex store ...``: run the node daemon, list what a daemon holds, fetch a region, check and collect locally.

The daemon (FastAPI, uvicorn) and the local store (zarr) are imported by the commands that use them:
every ``cli`` module is imported to build ``tenplex --help``, which should not load them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from tenplex.core.units import human_bytes, parse_bytes
from tenplex.errors import InvalidInput, NotFound
from tenplex.ptc.dtypes import storage_dtype
from tenplex.ptc.region import Region
from tenplex.store.buffers import DEFAULT_CHUNK_BYTES
from tenplex.store.client import StoreClient
from tenplex.store.locations import check_options

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
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

    ls = cmds.add_parser("ls", help="list the jobs of a store daemon, or the versions of one job")
    ls.add_argument("url", help="store URL, e.g. http://10.0.0.5:7070")
    ls.add_argument("job", nargs="?", help="list this job's versions")
    ls.add_argument("--token", default=None, help="bearer token (default: $TENPLEX_TOKEN)")
    ls.set_defaults(func=_ls)

    get = cmds.add_parser("get", help="fetch a region of a stored tensor into a .npy file")
    get.add_argument("url", help="store URL")
    get.add_argument("job")
    get.add_argument("version", help="e.g. s120-g0")
    get.add_argument("tensor", help="tensor name, e.g. layers.0.mlp.fc1.weight")
    get.add_argument("--region", default=None, help="a:b,c:d (':' = whole dimension; default the whole tensor)")
    get.add_argument("-o", "--output", required=True, help="output .npy file (bfloat16 is written as uint16)")
    get.add_argument("--uncommitted", action="store_true", help="also read from a version that is not committed")
    get.add_argument("--token", default=None, help="bearer token (default: $TENPLEX_TOKEN)")
    get.set_defaults(func=_get)

    verify = cmds.add_parser("verify", help="re-checksum every shard of a local version; exit 1 if any is damaged")
    verify.add_argument("--root", required=True)
    verify.add_argument("job")
    verify.add_argument("version")
    verify.set_defaults(func=_verify)

    gc = cmds.add_parser("gc", help="delete all but the newest N committed versions of a job in a local store")
    gc.add_argument("--root", required=True)
    gc.add_argument("job")
    gc.add_argument("--keep", type=int, default=2, help="committed versions to keep (default 2, at least 1)")
    gc.set_defaults(func=_gc)


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _serve(args: argparse.Namespace) -> int:
    from tenplex.core.tls import ServerTLS
    from tenplex.node import serve
    from tenplex.transformer.service import TransformSettings
    from tenplex.transformer.uploads import UploadSettings

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
        max_running=args.transform_max_running,
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


def _ls(args: argparse.Namespace) -> int:
    console = Console()
    with StoreClient(args.url, args.token) as client:
        if args.job is None:
            table = Table(title=f"jobs in {args.url}")
            for col in ("job", "versions", "committed", "latest committed", "bytes"):
                table.add_column(col, justify="left" if col in ("job", "latest committed") else "right")
            for job in client.jobs():
                try:
                    infos = client.versions(job)
                except NotFound:
                    continue  # deleted meanwhile
                committed = [vi for vi in infos if vi.committed]
                table.add_row(
                    job,
                    str(len(infos)),
                    str(len(committed)),
                    str(committed[-1].version) if committed else "-",
                    human_bytes(sum(vi.nbytes for vi in infos)),
                )
            console.print(table)
            return 0
        table = Table(title=f"versions of {args.job} in {args.url}")
        for col in ("version", "step", "generation", "committed", "durable", "in memory", "bytes"):
            table.add_column(col, justify="left" if col == "version" else "right")
        for vi in client.versions(args.job):
            table.add_row(str(vi.version), str(vi.version.step), str(vi.version.generation), "yes" if vi.committed else "no",
                          "yes" if vi.durable else "no", "yes" if vi.in_memory else "no", human_bytes(vi.nbytes))
        console.print(table)
    return 0


def _get(args: argparse.Namespace) -> int:
    out_path = Path(args.output)
    if out_path.suffix != ".npy":
        raise InvalidInput(f"output file {args.output!r} must end in .npy")
    with StoreClient(args.url, args.token) as client:
        manifest = client.manifest(args.job, args.version)
        shards = manifest.shards_of(args.tensor)
        if not shards:
            raise NotFound(f"tensor {args.tensor!r} is not in version {args.version} of job {args.job!r} at {args.url}")
        dtype, gshape = shards[0].dtype, shards[0].global_shape
        region = Region.parse(args.region, gshape) if args.region is not None else Region.full(gshape)
        # written straight into the memory-mapped file: no second copy of a large region in memory
        out = np.lib.format.open_memmap(out_path, mode="w+", dtype=storage_dtype(dtype), shape=region.shape)
        try:
            client.read_into(args.job, args.version, args.tensor, region, out, uncommitted=args.uncommitted)
            out.flush()
        except BaseException:
            del out
            out_path.unlink(missing_ok=True)
            raise
    note = " (bfloat16 stored as uint16: torch.from_numpy(a).view(torch.bfloat16))" if dtype == "bfloat16" else ""
    print(f"{out_path}: {args.tensor} [{region.format()}] {dtype} shape {list(region.shape)}{note}", file=sys.stderr)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from tenplex.store.local import LocalStore

    problems = LocalStore(args.root).verify(args.job, args.version)
    for p in problems:
        print(p)
    if problems:
        print(f"{args.job} {args.version}: {len(problems)} damaged shard(s)", file=sys.stderr)
        return 1
    print(f"{args.job} {args.version}: all shards intact")
    return 0


def _gc(args: argparse.Namespace) -> int:
    from tenplex.store.local import LocalStore

    deleted = LocalStore(args.root).gc(args.job, args.keep)
    print(f"{args.job}: deleted {', '.join(map(str, deleted)) if deleted else 'nothing'}")
    return 0
