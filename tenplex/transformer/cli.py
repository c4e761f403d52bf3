"""``tenplex plan`` and ``tenplex transform``: plan a layout change, and execute one host's part of it."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from prometheus_client import start_http_server

from tenplex.core.units import human_bytes
from tenplex.core.version import Version
from tenplex.errors import InvalidInput
from tenplex.ptc.model import PTC
from tenplex.store import TensorStore, open_store
from tenplex.store.client import StoreClient
from tenplex.transformer.execute import TransformMetrics, TransformReport, execute_host_plan
from tenplex.transformer.plan import CHECKPOINT, Plan, make_plan, plan_summary
from tenplex.transformer.remote import PlanRun


def register(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="plan the minimum data movement from one PTC to another",
        description="Plan the transformation of the state laid out by OLD.json into the layout NEW.json.",
    )
    plan.add_argument("--from", dest="old", required=True, metavar="OLD.json", help="PTC of the current state")
    plan.add_argument("--to", dest="new", required=True, metavar="NEW.json", help="PTC of the new layout")
    plan.add_argument("--alive", metavar="HOST,...", help="old hosts still alive (default: all)")
    plan.add_argument(
        "--holder", action="append", default=[], metavar="HOST=VERSION",
        help="newest committed version a host holds (repeatable; default: every old host holds --old-version)",
    )
    plan.add_argument("--job", default="job", help="job name (default 'job')")
    plan.add_argument("--old-version", default="s0-g0", help="version holding the old state (default s0-g0)")
    plan.add_argument("--new-version", help="version to write (default: the old one's next generation)")
    plan.add_argument("--checkpoint", metavar="URL", help="store URL of a persistent checkpoint for regions no survivor holds")
    plan.add_argument("--explain", action="store_true", help="show per-host and per-tensor tables")
    plan.add_argument("--json", dest="json_out", metavar="OUT", help="write the plan as JSON to OUT")
    plan.set_defaults(func=_plan)

    tr = sub.add_parser(
        "transform",
        help="execute one host's part of a plan against the store daemons",
        description="Pull the host's pieces, write its shards into the new version of its store and commit.",
    )
    tr.add_argument("--plan", required=True, metavar="PLAN.json", help="plan written by 'tenplex plan --json'")
    tr.add_argument("--host", required=True, help="the target host whose part to run")
    where = tr.add_mutually_exclusive_group(required=True)
    where.add_argument("--store", metavar="URL", help="the target host's store daemon: it runs the part itself, pulling from the sources")
    where.add_argument(
        "--store-root", metavar="DIR",
        help="the target host's store directory, used in-process (run on the node itself; saves the loopback copies)",
    )
    tr.add_argument("--source", action="append", default=[], metavar="HOST=URL", help="store daemon of a source host (repeatable)")
    tr.add_argument("--token", help="bearer token of the store daemons (default: $TENPLEX_TOKEN)")
    tr.add_argument("--concurrency", type=int, default=8,
                    help="parallel piece reads with --store-root (default 8; a daemon uses its own setting)")
    tr.add_argument("--metrics-port", type=int,
                    help="with --store-root: serve Prometheus metrics of the transform on this port (a daemon has /metrics)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.set_defaults(func=_transform)


def parse_pairs(items: Iterable[str], what: str, form: str = "NAME=VALUE") -> dict[str, str]:
    """A repeatable ``NAME=VALUE`` option's values as a dict (this command's and ``tenplex export``/``import``'s)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise InvalidInput(f"{what} must look like {form}, got {item!r}")
        if key in out:
            raise InvalidInput(f"{what} names {key!r} twice")
        out[key] = value
    return out


def _plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    old = PTC.load(args.old)
    new = PTC.load(args.new)
    old_version = Version.parse(args.old_version)
    new_version = Version.parse(args.new_version) if args.new_version else old_version.next_generation()
    alive = None
    if args.alive is not None:
        alive = {h.strip() for h in args.alive.split(",") if h.strip()}
        unknown = sorted(alive - set(old.hosts) - set(new.hosts))
        if unknown:
            raise InvalidInput(f"--alive names hosts in neither layout: {', '.join(unknown)}")
    holders = None
    if args.holder:
        holders = {h: Version.parse(v) for h, v in parse_pairs(args.holder, "--holder").items()}
        for h in old.hosts:
            holders.setdefault(h, old_version)
    plan = make_plan(
        old, new, job=args.job, old_version=old_version, new_version=new_version,
        holders=holders, alive=alive, checkpoint=args.checkpoint,
    )
    console = Console()
    if args.explain:
        sys.stdout.write(plan.explain(width=max(console.width, 100)))
    else:
        s = plan_summary(plan)
        ratio = s["network_bytes"] / s["lower_bound_bytes"] if s["lower_bound_bytes"] else 1.0
        console.print(
            f"{len(plan.hosts)} hosts, {s['transfers']} transfers: network {human_bytes(s['network_bytes'])} "
            f"(lower bound {human_bytes(s['lower_bound_bytes'])}, ratio {ratio:.3f}), local {human_bytes(s['local_bytes'])}, "
            f"zero-filled {human_bytes(s['zero_fill_bytes'])}; largest send {human_bytes(s['max_send_bytes'])}, "
            f"largest receive {human_bytes(s['max_receive_bytes'])}",
            markup=False, highlight=False,
        )
    if args.json_out:
        plan.save(args.json_out)
        console.print(f"plan written to {args.json_out}", markup=False, highlight=False)
    return 0


@contextmanager
def progress_bar(enabled: bool, label: str) -> Iterator[Callable[[int, int], None]]:
    """A byte progress bar on stderr (stdout carries the command's JSON result); it yields ``update(done, total)``,
    which does nothing when not ``enabled``."""
    if not enabled:
        yield lambda _done, _total: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=False, console=Console(stderr=True)) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _transform(args: argparse.Namespace) -> int:
    if args.concurrency < 1:
        raise InvalidInput(f"--concurrency must be >= 1, got {args.concurrency}")
    plan = Plan.load(args.plan)
    hp = plan.host(args.host)
    urls = parse_pairs(args.source, "--source")
    needed = sorted(({t.source for t in hp.transfers} | {a for t in hp.transfers for a in t.alternatives})
                    - {None, args.host, CHECKPOINT})
    missing = [h for h in needed if h not in urls]
    if missing:
        # Not fatal: those pieces move to other holders (or fail with a clear message if none is left).
        print(f"tenplex: warning: no --source URL for {', '.join(missing)}; their pieces count as unavailable", file=sys.stderr)
    with progress_bar(not args.no_progress, f"{args.host} -> {plan.new_version}") as bar:
        run = _transform_on_daemon if args.store is not None else _transform_here
        report = run(args, plan, urls, lambda done: bar(done, hp.bytes_total))
    print(json.dumps(report.to_json()))
    return 0


def _transform_on_daemon(args: argparse.Namespace, plan: Plan, urls: dict[str, str], progress: Callable[[int], None]) -> TransformReport:
    """``--store URL``: the host's daemon runs its part (pulling from the sources itself); this follows it."""
    clients: dict[str, StoreClient] = {}

    def client_for(url: str) -> StoreClient:
        if url not in clients:
            clients[url] = StoreClient(url, args.token, timeout=30.0)
        return clients[url]

    run = PlanRun(plan.for_host(args.host), {**urls, args.host: args.store}, token=args.token, client_for=client_for)
    try:
        reports = run.wait(progress=lambda statuses: progress(statuses[args.host].bytes_done))
    finally:
        for c in clients.values():
            c.close()
    return reports[args.host]


def _transform_here(args: argparse.Namespace, plan: Plan, urls: dict[str, str], progress: Callable[[int], None]) -> TransformReport:
    """``--store-root DIR``: run the host's part in this process, on the node's store directory."""
    if plan.checkpoint is not None:
        urls.setdefault(CHECKPOINT, plan.checkpoint)
    metrics = TransformMetrics()
    if args.metrics_port is not None:
        start_http_server(args.metrics_port, registry=metrics.registry)
    with ExitStack() as stack:
        sources: dict[str, TensorStore] = {
            h: stack.enter_context(StoreClient(u, args.token, max_connections=max(8, args.concurrency)))
            for h, u in urls.items() if h != CHECKPOINT
        }
        if CHECKPOINT in urls:  # the persistent tier (s3:// or file://), or a daemon holding the old version
            sources[CHECKPOINT] = stack.enter_context(open_store(urls[CHECKPOINT], args.token))
        target = stack.enter_context(open_store(Path(args.store_root)))
        return execute_host_plan(
            plan, args.host, target=target, sources=sources,
            concurrency=args.concurrency, metrics=metrics, progress=lambda done, _total: progress(done),
        )
