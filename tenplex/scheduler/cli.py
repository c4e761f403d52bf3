"""``tenplex scheduler serve`` and ``tenplex job ...`` (a REST client of the scheduler)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import urllib3
import yaml
from rich.console import Console
from rich.table import Table

from tenplex import registry
from tenplex.core.http import error_from, pool, retry_policy
from tenplex.core.tls import client_context
from tenplex.core.units import human_bytes, parse_bytes
from tenplex.errors import InvalidInput, StoreUnavailable, TenplexError
from tenplex.scheduler.state import DATA_PHASES

DEFAULT_URL = "http://127.0.0.1:8470"


def register(sub: argparse._SubParsersAction) -> None:
    sched = sub.add_parser("scheduler", help="run the scheduler (control plane)")
    cmds = sched.add_subparsers(dest="scheduler_command", metavar="SUBCOMMAND", required=True)
    serve = cmds.add_parser("serve", help="serve the scheduler's REST API and drive the jobs")
    serve.add_argument("--backend", default="local", metavar="NAME",
                       help="cluster backend, registered (entry points 'tenplex.backends'; installed: "
                            f"{', '.join(registry.registered(registry.BACKENDS)) or 'none'}) or module:function: "
                            "local (emulated hosts, or a hosts file), kubernetes (ElasticJobs, in-cluster or "
                            "$KUBECONFIG; settings from the chart's environment) (default local)")
    serve.add_argument("--state-dir", type=Path, default=Path(".tenplex"), help="where job state survives restarts")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8470, help="port to bind; 0 picks a free one (default 8470)")
    serve.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    serve.add_argument("--token", help="the admin bearer token, the operator's and the scheduler's own (default: "
                       "$TENPLEX_TOKEN; neither it nor --auth-keys: auth off)")
    serve.add_argument("--auth-keys", type=Path, default=None, metavar="FILE",
                       help="key set that signs each job's own credentials (default: $TENPLEX_AUTH_KEYS; local "
                            "backend with a token: made in --state-dir)")
    serve.add_argument("--tls-cert", default=None, metavar="PEM", help="serve HTTPS (default: $TENPLEX_TLS_CERT)")
    serve.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's key (default: $TENPLEX_TLS_KEY)")
    serve.add_argument("--hosts", type=int, default=3, help="local backend: emulated hosts to start (default 3)")
    serve.add_argument("--gpus-per-host", type=int, default=2, help="local backend: GPUs per emulated host (default 2)")
    serve.add_argument("--hosts-file", type=Path,
                       help="local backend: hosts whose store daemons already run, instead of starting --hosts: a JSON "
                            "list of {name, address, store_url, gpus[, store_root, launch_prefix, env]} (README)")
    serve.add_argument("--host-timeout", type=float, default=10.0,
                       help="local backend: a host whose daemon is not heard for this many seconds is lost (default 10)")
    serve.add_argument("--memory-bytes", type=_size, default=None, metavar="SIZE",
                       help="local backend: give each started host's store a memory tier of this budget, e.g. 4Gi "
                            "(snapshots are written there, read by peers from there and spilled to disk)")
    serve.add_argument("--memory-root", type=Path, default=None, metavar="DIR",
                       help="local backend: where the hosts' memory tiers live, one directory per host "
                            "(default: a new directory on /dev/shm)")
    serve.set_defaults(func=_serve)

    job = sub.add_parser("job", help="create, inspect, scale and delete jobs through the scheduler's REST API")
    job.add_argument("--url", default=os.environ.get("TENPLEX_SCHEDULER_URL", DEFAULT_URL),
                     help=f"scheduler URL (default $TENPLEX_SCHEDULER_URL or {DEFAULT_URL})")
    job.add_argument("--token", default=os.environ.get("TENPLEX_TOKEN"), help="bearer token (default $TENPLEX_TOKEN)")
    jcmds = job.add_subparsers(dest="job_command", metavar="SUBCOMMAND", required=True)
    create = jcmds.add_parser("create", help="create a job from a JSON or YAML spec file")
    create.add_argument("spec", type=Path)
    create.set_defaults(func=_create)
    ls = jcmds.add_parser("ls", help="list jobs")
    ls.set_defaults(func=_ls)
    get = jcmds.add_parser("get", help="a job's status and reconfiguration history")
    get.add_argument("name")
    get.add_argument("--json", action="store_true", help="print the raw JSON")
    get.set_defaults(func=_get)
    scale = jcmds.add_parser("scale", help="change a job's GPU count (0 suspends it, keeping its state)")
    scale.add_argument("name")
    scale.add_argument("--gpus", type=int, required=True)
    scale.add_argument("--parallel", metavar="dp=D,tp=T,pp=P",
                       help="run in this configuration (dp*tp*pp = --gpus) instead of the policy's choice")
    scale.set_defaults(func=_scale)
    plan = jcmds.add_parser("plan", help="the current or last reconfiguration plan, explained")
    plan.add_argument("name")
    plan.set_defaults(func=_plan)
    delete = jcmds.add_parser("delete", help="stop a job's workers and forget the job")
    delete.add_argument("name")
    delete.set_defaults(func=_delete)


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _serve(args: argparse.Namespace) -> int:
    from tenplex.core.tls import ServerTLS
    from tenplex.scheduler.server import auth_keys_from, serve, token_from

    serve(args.backend, args.state_dir, args.host, args.port, token_from(args.token), hosts=args.hosts,
          gpus_per_host=args.gpus_per_host, port_file=args.port_file, hosts_file=args.hosts_file,
          host_timeout=args.host_timeout, memory_bytes=args.memory_bytes, memory_root=args.memory_root,
          auth_keys=auth_keys_from(args.auth_keys), tls=ServerTLS.from_options(args.tls_cert, args.tls_key))
    return 0


class SchedulerClient:
    """A small JSON client of the scheduler's REST API; errors come back as TenplexError subclasses."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            resp = pool(client_context()).request(method, self.url + path, body=data, headers=headers,
                                                  timeout=self.timeout, retries=retry_policy(0, 0.0))
        except (urllib3.exceptions.HTTPError, OSError) as exc:  # MaxRetryError's reason is the connection's error
            raise StoreUnavailable(f"scheduler at {self.url} is unreachable: {getattr(exc, 'reason', None) or exc}") from None
        if resp.status >= 400:
            raise error_from(resp.status, resp.data, f"{method} {path}", TenplexError)
        return json.loads(resp.data or b"null")

    def create(self, spec: dict[str, Any]) -> Any:
        return self.request("POST", "/v1/jobs", spec)

    def job(self, name: str) -> Any:
        return self.request("GET", f"/v1/jobs/{name}")

    def jobs(self) -> Any:
        return self.request("GET", "/v1/jobs")["jobs"]

    def scale(self, name: str, gpus: int, parallel: dict[str, int] | None = None) -> Any:
        body: dict[str, Any] = {"gpus": gpus}
        if parallel is not None:
            body["parallel"] = parallel
        return self.request("POST", f"/v1/jobs/{name}/scale", body)

    def event(self, name: str, kind: str, host: str | None = None, detail: str = "") -> Any:
        return self.request("POST", f"/v1/jobs/{name}/events", {"kind": kind, "host": host, "detail": detail})

    def plan(self, name: str) -> Any:
        return self.request("GET", f"/v1/jobs/{name}/plan")

    def delete(self, name: str) -> Any:
        return self.request("DELETE", f"/v1/jobs/{name}")


def _client(args: argparse.Namespace) -> SchedulerClient:
    return SchedulerClient(args.url, args.token)


def _create(args: argparse.Namespace) -> int:
    try:
        text = args.spec.read_text()
    except OSError as exc:
        raise InvalidInput(f"cannot read {args.spec}: {exc.strerror}") from None
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidInput(f"{args.spec} is neither JSON nor YAML: {exc}") from None
    view = _client(args).create(spec)
    print(f"created job {view['spec']['name']} ({view['status']['phase']})")
    return 0


def _ls(args: argparse.Namespace) -> int:
    table = Table(title="jobs")
    for col in ("name", "phase", "gpus", "config", "step", "version", "message"):
        table.add_column(col)
    for view in _client(args).jobs():
        st = view["status"]
        cfg = st.get("parallel") or {}
        table.add_row(view["spec"]["name"], st["phase"] + (f"/{st['stage']}" if st.get("stage") else ""),
                      str(st["gpus"]), f"dp{cfg.get('dp', '-')} tp{cfg.get('tp', '-')} pp{cfg.get('pp', '-')}",
                      str(st["step"]), str(st.get("version") or "-"), st.get("message", "")[:60])
    Console().print(table)
    return 0


def history_table(history: list[dict[str, Any]]) -> Table:
    table = Table(title="reconfigurations")
    for col in ("event", "from", "to", "downtime s", "local", "remote", "lower bound", "steps lost"):
        table.add_column(col, justify="left" if col in ("event", "from", "to") else "right")
    for h in history:
        table.add_row(
            h["reason"], f"{h.get('from_config') or '-'} ({h.get('from_gpus')})", f"{h.get('to_config') or '-'} ({h.get('to_gpus')})",
            f"{h['downtime_seconds']:.1f}" if h.get("downtime_seconds") is not None else "-",
            human_bytes(h.get("bytes_local", 0)), human_bytes(h.get("bytes_remote", 0)),
            human_bytes(h.get("lower_bound_bytes", 0)), str(h.get("steps_lost", 0)),
        )
    return table


_PHASE_HEADS = {"stop_agreement": "stop", "final_snapshot": "snapshot", "planning": "plan", "transfer": "transfer",
                "launch": "launch", "imports": "imports", "rendezvous": "rendezvous", "model_build": "model",
                "wait_for_state": "wait", "restore": "restore", "first_step": "1st step"}


def phases_table(history: list[dict[str, Any]]) -> Table:
    """Each reconfiguration's downtime split into its phases (seconds), and how much of it was moving data."""
    table = Table(title="downtime by phase (s)")
    table.add_column("event")
    for head in _PHASE_HEADS.values():
        table.add_column(head, justify="right")
    for col in ("downtime", "data", "fixed"):
        table.add_column(col, justify="right")
    for h in history:
        phases = h.get("phases") or {}
        downtime = h.get("downtime_seconds")
        data = sum(phases.get(k, 0.0) for k in DATA_PHASES)
        table.add_row(
            h["reason"], *(f"{phases[k]:.2f}" if k in phases else "-" for k in _PHASE_HEADS),
            f"{downtime:.2f}" if downtime is not None else "-", f"{data:.2f}",
            f"{downtime - data:.2f}" if downtime is not None else "-",
        )
    return table


def _get(args: argparse.Namespace) -> int:
    view = _client(args).job(args.name)
    if args.json:
        json.dump(view, sys.stdout, indent=1)
        print()
        return 0
    st = view["status"]
    console = Console()
    console.print(f"[bold]{args.name}[/bold]: {st['phase']}{'/' + st['stage'] if st.get('stage') else ''} - {st.get('message', '')}")
    console.print(f"gpus {st['gpus']}, config {st.get('parallel')}, hosts {st.get('hosts')}, step {st['step']}, version {st.get('version')}")
    if st.get("history"):
        console.print(history_table(st["history"]))
        console.print(phases_table(st["history"]))
    return 0


def _scale(args: argparse.Namespace) -> int:
    parallel = None
    if args.parallel:
        try:
            parallel = {k.strip(): int(v) for k, v in (item.split("=", 1) for item in args.parallel.split(","))}
        except ValueError:
            raise InvalidInput(f"--parallel must look like dp=2,tp=2,pp=1, got {args.parallel!r}") from None
    _client(args).scale(args.name, args.gpus, parallel)
    print(f"job {args.name}: asked for {args.gpus} GPUs" + (f" in {args.parallel}" if parallel else ""))
    return 0


def _plan(args: argparse.Namespace) -> int:
    print(_client(args).plan(args.name)["explain"])
    return 0


def _delete(args: argparse.Namespace) -> int:
    _client(args).delete(args.name)
    print(f"deleted job {args.name}")
    return 0
