"""``tenplex export`` and ``tenplex import``: a committed version to a DCP checkpoint, and back.

DCP and the export itself (:mod:`tenplex.interop.dcp`, which loads torch) are imported by the two
commands: every ``cli`` module is imported to build ``tenplex --help``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from tenplex.core.version import Version
from tenplex.errors import InvalidInput
from tenplex.interop.keymap import KEY_MAPS
from tenplex.ptc.model import PTC
from tenplex.scheduler.cli import SchedulerClient
from tenplex.transformer.cli import parse_pairs, progress_bar

_KEY_MAP_HELP = (
    f"how PTC tensors become checkpoint keys: {', '.join(KEY_MAPS)} or module:function (default identity; "
    "see tenplex/interop/keymap.py)"
)


def register(sub: argparse._SubParsersAction) -> None:
    ex = sub.add_parser(
        "export",
        help="write a committed version as a standard checkpoint (PyTorch DCP)",
        description=(
            "Write committed version VERSION of JOB from the node stores as a torch.distributed.checkpoint "
            "checkpoint in DIR, loadable with dcp.load into any layout. The PTC comes from --ptc or the scheduler "
            "(--scheduler, which also names the stores); each shard is read once, from one of its holders."
        ),
    )
    ex.add_argument("job")
    ex.add_argument("version", help="e.g. s120-g3 (step 120, layout generation 3)")
    ex.add_argument("directory", metavar="DIR", type=Path, help="new or empty output directory")
    ex.add_argument("--format", choices=["dcp"], default="dcp", help="checkpoint format (default dcp)")
    _sources(ex, "the version's")
    ex.add_argument("--key-map", default="identity", help=_KEY_MAP_HELP)
    ex.add_argument("--key-map-option", action="append", default=[], metavar="KEY=VALUE",
                    help="option of the key map, repeatable (torchtitan: n_heads, head_dim, seq_len)")
    ex.add_argument("--threads", type=int, default=2, help="writer threads, one file each (default 2)")
    ex.add_argument("--no-progress", action="store_true", help="no progress bar")
    ex.set_defaults(func=_export)

    im = sub.add_parser(
        "import",
        help="create a version for a PTC from a standard checkpoint (PyTorch DCP)",
        description=(
            "Write the DCP checkpoint in DIR into the node stores as a committed version of JOB laid out by the PTC: "
            "each host's store gets the shards its devices hold. Refuses a checkpoint that lacks a tensor or has a "
            "wrong shape or dtype, and a version that already exists."
        ),
    )
    im.add_argument("directory", metavar="DIR", type=Path, help="DCP checkpoint directory (with .metadata)")
    im.add_argument("--job", required=True)
    im.add_argument("--version", help="version to create, e.g. s0-g0 (default: s<step>-g0, the checkpoint's step)")
    _sources(im, "the target hosts'")
    im.add_argument("--key-map", default="identity", help=_KEY_MAP_HELP)
    im.add_argument("--key-map-option", action="append", default=[], metavar="KEY=VALUE", help="option of the key map, repeatable")
    im.add_argument("--ptc-out", type=Path, help="write the PTC with the checkpoint's dataset position here")
    im.add_argument("--batch-mb", type=int, default=256, help="memory for shards in flight, MiB (default 256)")
    im.add_argument("--no-progress", action="store_true", help="no progress bar")
    im.set_defaults(func=_import)


def _sources(p: argparse.ArgumentParser, whose: str) -> None:
    p.add_argument("--ptc", type=Path, metavar="PTC.json", help="the layout of the version (default: from --scheduler)")
    p.add_argument("--scheduler", metavar="URL", help="scheduler whose REST API gives the PTC and the store URLs")
    p.add_argument("--store", action="append", default=[], metavar="HOST=URL", help=f"{whose} store daemon (repeatable)")
    p.add_argument("--store-root", action="append", default=[], metavar="HOST=DIR",
                   help=f"{whose} store directory, used in-process (repeatable)")
    p.add_argument("--token", default=os.environ.get("TENPLEX_TOKEN"), help="bearer token (default $TENPLEX_TOKEN)")


def _layout(args: argparse.Namespace, generation: int | None, job: str) -> tuple[PTC, dict[str, str], dict[str, str]]:
    """The PTC (file or scheduler), the store URLs (the scheduler's, then --store) and the store roots
    (--store-root; a root given for a host the scheduler also names wins)."""
    urls: dict[str, str] = {}
    client = None
    if args.scheduler:
        client = SchedulerClient(args.scheduler, args.token)
        urls = {h["name"]: h["store_url"] for h in client.request("GET", "/v1/hosts")["hosts"]}
    if args.ptc is not None:
        ptc = PTC.load(args.ptc)
    elif client is None:
        raise InvalidInput("give the layout: --ptc PTC.json or --scheduler URL")
    else:
        query = f"?generation={generation}" if generation is not None else ""
        ptc = PTC.from_json(client.request("GET", f"/v1/jobs/{job}/ptc{query}"))
    urls.update(parse_pairs(args.store, "--store", "HOST=VALUE"))
    roots = parse_pairs(args.store_root, "--store-root", "HOST=VALUE")
    for host in roots:
        urls.pop(host, None)
    return ptc, urls, roots


def _print(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")


def _export(args: argparse.Namespace) -> int:
    from tenplex.interop.dcp import export_dcp, host_stores

    version = Version.parse(args.version)
    if args.threads < 1:
        raise InvalidInput(f"--threads must be >= 1, got {args.threads}")
    ptc, urls, roots = _layout(args, version.generation, args.job)
    if not urls and not roots:
        raise InvalidInput("give the stores: --store HOST=URL, --store-root HOST=DIR or --scheduler URL")
    options = parse_pairs(args.key_map_option, "--key-map-option", "KEY=VALUE")
    with host_stores(urls, roots, token=args.token) as stores, progress_bar(not args.no_progress, f"export {args.job} {version}") as bar:
        result = export_dcp(args.job, version, ptc, stores, args.directory, key_map=args.key_map, options=options,
                            threads=args.threads, progress=bar)
    _print(result.to_json())
    return 0


def _import(args: argparse.Namespace) -> int:
    from tenplex.interop.dcp import host_stores, import_dcp

    version = Version.parse(args.version) if args.version else None
    if args.batch_mb < 1:
        raise InvalidInput(f"--batch-mb must be >= 1, got {args.batch_mb}")
    ptc, urls, roots = _layout(args, version.generation if version else None, args.job)
    options = parse_pairs(args.key_map_option, "--key-map-option", "KEY=VALUE")
    with host_stores(urls, roots, token=args.token, must_exist=False) as stores, \
            progress_bar(not args.no_progress, f"import {args.directory.name} -> {args.job}") as bar:
        result = import_dcp(args.directory, ptc, args.job, version, stores, key_map=args.key_map, options=options,
                            batch_bytes=args.batch_mb << 20, progress=bar)
    if args.ptc_out is not None:
        result.ptc.save(args.ptc_out)
    _print(result.to_json())
    return 0
