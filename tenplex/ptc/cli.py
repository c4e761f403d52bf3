"""``tenplex ptc ...``: build, show and validate PTC files."""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict

from rich.console import Console
from rich.table import Table

from tenplex.ptc.model import PTC


def register(sub: argparse._SubParsersAction) -> None:
    ptc = sub.add_parser("ptc", help="build, show and validate parallelizable tensor collections")
    cmds = ptc.add_subparsers(dest="ptc_command", metavar="SUBCOMMAND", required=True)

    show = cmds.add_parser("show", help="print a readable summary of a PTC file")
    show.add_argument("file", help="PTC JSON file")
    show.add_argument("--tensors", type=int, default=40, help="how many tensors to list (default 40; 0 for all)")
    show.set_defaults(func=_show)

    validate = cmds.add_parser("validate", help="check a PTC file; exit 0 if valid, 1 with the reason if not")
    validate.add_argument("file", help="PTC JSON file")
    validate.set_defaults(func=_validate)


def _validate(args: argparse.Namespace) -> int:
    ptc = PTC.load(args.file)
    shards = sum(len(t.shards) for t in ptc.tensors)
    print(f"{args.file}: valid ({len(ptc.tensors)} tensors, {shards} shards, {len(ptc.devices)} devices on {len(ptc.hosts)} hosts)")
    return 0


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _show(args: argparse.Namespace) -> int:
    ptc = PTC.load(args.file)
    console = Console()
    config = ", ".join(f"{k}={v}" for k, v in ptc.config.items() if not isinstance(v, dict | list))
    console.print(f"[bold]{args.file}[/bold]  {config}")
    console.print(
        f"{len(ptc.tensors)} tensors, {sum(len(t.shards) for t in ptc.tensors)} shards, "
        f"{len(ptc.devices)} devices on {len(ptc.hosts)} hosts; logical state {human_bytes(ptc.total_bytes)}"
    )
    if ptc.dataset is not None:
        d = ptc.dataset
        console.print(
            f"dataset: {d.num_samples} samples, seed {d.seed}, global batch {d.global_batch_size}, consumed {d.consumed_samples}"
        )

    kinds: dict[str, int] = defaultdict(int)
    for t in ptc.tensors:
        kinds[t.kind.value] += t.nbytes
    console.print("by kind: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(kinds.items())))

    table = Table(title="tensors", show_lines=False)
    for col in ("name", "shape", "dtype", "kind", "shards", "replication", "bytes"):
        table.add_column(col, justify="right" if col in ("shards", "replication", "bytes") else "left")
    limit = len(ptc.tensors) if args.tensors == 0 else args.tensors
    for t in ptc.tensors[:limit]:
        reps = Counter(len(s.devices) for s in t.shards)
        rep = ",".join(f"{r}" for r in sorted(reps))
        table.add_row(t.name, "x".join(map(str, t.shape)) or "()", t.dtype, t.kind.value, str(len(t.shards)), rep, human_bytes(t.nbytes))
    console.print(table)
    if limit < len(ptc.tensors):
        console.print(f"... {len(ptc.tensors) - limit} more tensors (--tensors 0 lists all)")

    per_host = ptc.bytes_per_host()
    per_device = ptc.bytes_per_device()
    hosts = Table(title="hosts")
    for col in ("host", "devices", "device bytes (min / max)", "host store bytes"):
        hosts.add_column(col, justify="left" if col == "host" else "right")
    for h in ptc.hosts:
        devs = ptc.devices_on_host(h)
        sizes = [per_device[d.id] for d in devs]
        hosts.add_row(h, str(len(devs)), f"{human_bytes(min(sizes))} / {human_bytes(max(sizes))}", human_bytes(per_host[h]))
    console.print(hosts)
    return 0
