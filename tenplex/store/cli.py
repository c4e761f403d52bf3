"""``tenplex store ...``: list what a daemon holds, fetch a region, check and collect locally (``serve``, the node
daemon, is :mod:`tenplex.node.cli`, which makes the group).

The local store (zarr) is imported by the commands that use it:
every ``cli`` module is imported to build ``tenplex --help``, which should not load them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from tenplex.core.units import human_bytes
from tenplex.errors import InvalidInput, NotFound
from tenplex.ptc.dtypes import storage_dtype
from tenplex.ptc.region import Region
from tenplex.store.client import StoreClient

log = logging.getLogger(__name__)


def register(cmds: argparse._SubParsersAction) -> None:
    """The store's own tools in the ``tenplex store`` command group (which :mod:`tenplex.node.cli` makes, beside
    ``serve``, the node daemon): list what a daemon holds, fetch a region, check and collect a local store."""
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
