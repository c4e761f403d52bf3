"""A warm standby: a process that has imported a job's code and forks that job's workers on demand.

Starting a training process costs its interpreter and its imports (torch
alone takes seconds) before it can register; after a reconfiguration that is
most of the time training stands still. A standby pays that cost once per
host: it is started with the job's command, imports what the command runs
(``python -m MODULE ...`` imports MODULE; ``python SCRIPT ...`` imports what
the script imports at its top), writes ``ready`` on its standard output, and
then serves launch requests, one JSON line each on its standard input::

    {"env": {...the worker's environment...}, "log": "/path/of/the/worker's.log"}

For each it forks a child that starts a session of its own, takes that
environment (replacing the inherited one), writes to the worker's log, and
runs the command's module or script as ``__main__`` with the command's
arguments: from there on it is exactly the worker a fresh process would have
been, only without the seconds of imports, and sharing the imported code's
memory with its siblings. The standby answers each request with ``started
PID`` and reports each child's end with ``exited PID CODE`` (128 + N for a
signal, as a shell does). When its input closes (its scheduler went away, or
the job ended) it exits; running children are not affected.

A fork is safe here because nothing runs before it but imports: the standby
starts no thread, initialises no CUDA context and opens no process group;
each child does that itself. What a standby holds while it waits: one
process with the job's modules imported (a few hundred MB of host memory with
torch), no GPU, no port. ``tenplex worker standby -- COMMAND...`` is the
entry point; the local backend keeps one per host for a job with ``standby``.

**In a worker pod** (``--port PORT``; the Kubernetes backend's standby pods,
see :mod:`tenplex.k8s.backend`): a pod's GPUs are bound when it is created,
so a process forked elsewhere could not use them; the standby is instead the
pod's main process, and the pod outlives its generation. It forks the pod's
first assignment from its own environment at once (one worker, or one per
entry of ``TENPLEX_POD_RANKS``, as ``tenplex worker launch`` would), then
listens on ``$TENPLEX_NODE_IP:PORT`` (the pod uses the host network) for its
scheduler. The same JSON lines arrive over that connection, after a first
``{"hello": {"token": ...}}`` that must carry the job's token when the pod
has one (``TENPLEX_TOKEN``); a request with ``"inherit": true`` gives the
worker the pod's environment with the request's ``env`` over it (so what the
pod got from Kubernetes, its Secret's token included, never travels in a
request), and ``{"stop": PID, "grace": SECONDS}`` ends a worker (SIGTERM to
its process group, SIGKILL after the grace). Each hello is answered with
``ready`` and a replay of every worker the pod has run (``started PID
WORKER``, then ``exited PID CODE`` for those that ended), so a scheduler that
restarts or reconnects loses no exit. Workers log to the pod's output. The
connection closing ends nothing; SIGTERM (the pod's deletion) is passed to
the running workers, and the standby exits once they have, with the code of
the first of its latest assignment's workers that failed on its own (not by
a stop), else 0. If the standby itself is killed, its workers are killed with
it (``PR_SET_PDEATHSIG``), as a container's processes end with its main
process. Nothing of the tensors passes here: a request is a worker's
environment.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from tenplex.core.commands import (
    ENV_POD_RANKS,
    STANDBY_READY,
    PythonCommand,
    parse_pod_ranks,
    pod_rank_env,
    signal_group,
)
from tenplex.core.protocol import ENV_NODE_IP, ENV_STORE_ROOT, ENV_TOKEN, ENV_WORKER_ID
from tenplex.errors import InvalidInput

log = logging.getLogger(__name__)

EXIT_DONE = 0
_HELD_SIGNALS = (signal.SIGTERM, signal.SIGINT)
MAX_ENDED_KEPT = 256
"""Ended workers a pod's standby remembers for its replay (the oldest are forgotten first)."""


def _exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


def _die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent (the pod's standby) ends, as a container's processes
    end with its main process: a worker of a pod whose standby was killed must not train on outside it."""
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it ended before the request took effect
        os._exit(128 + signal.SIGKILL)


def _become_worker(message: Mapping[str, object], command: PythonCommand, close: Sequence[int] = (),
                   mask: set[signal.Signals] | None = None, parent: int | None = None) -> int:
    """In the forked child: the worker's session, environment and log, then its code; its exit code.

    ``close``: the standby's own descriptors (its listening socket and connection), which the worker must
    not hold: a port or a connection kept open by a worker would outlive the standby."""
    os.setsid()  # its own process group: the backend stops a worker and what it starts, nothing else
    if parent is not None:
        _die_with(parent)
    for fd in close:
        with contextlib.suppress(OSError):
            os.close(fd)
    env = message.get("env")
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    log_path = message.get("log")
    sys.stdout.flush()
    sys.stderr.flush()
    if isinstance(log_path, str) and log_path:  # else the standby's own output (a pod's log)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the standby's requests are not the worker's input
    os.close(null)
    for sig in (signal.SIGCHLD, *_HELD_SIGNALS):
        signal.signal(sig, signal.SIG_DFL)
    if mask is not None:  # a stop that came while this child was being set up is taken now, by the default
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    root = logging.getLogger()
    for handler in list(root.handlers):  # the standby's logging setup is not the worker's: it makes its own
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    try:
        command.run()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        logging.getLogger(__name__).exception("the worker failed")
        return 1
    return 0


def _fork_worker(message: Mapping[str, object], command: PythonCommand, close: Sequence[int] = (),
                 die_with_parent: bool = False) -> int:
    """Fork a child that becomes the worker of ``message``; its pid (in the parent). ``die_with_parent``: the
    worker is killed when this process ends (a pod's standby; the local backend's workers outlive theirs).

    SIGTERM and SIGINT are held across the fork: until the child has put back their default handling, the
    standby's own handlers (inherited) would swallow a stop sent to a worker that had just started."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    parent = os.getpid() if die_with_parent else None
    pid = os.fork()
    if pid == 0:  # the child: becomes the worker, never returns here
        code = 1
        try:
            code = _become_worker(message, command, close, mask, parent)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return pid


def _parse(line: str) -> dict[str, object]:
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise InvalidInput(f"a launch request is a JSON line: {exc}") from None
    if not isinstance(message, dict):
        raise InvalidInput(f"a request is a JSON object, got {line[:100]!r}")
    if "stop" in message or "hello" in message:
        return message
    env = message.get("env")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise InvalidInput("a launch request needs 'env': an object of strings")
    if not isinstance(message.get("inherit", False), bool):
        raise InvalidInput("a launch request's 'inherit' is true or false")
    return message


def _worker_id(message: Mapping[str, object]) -> str:
    env = message.get("env")
    wid = env.get(ENV_WORKER_ID) if isinstance(env, dict) else None
    return wid if isinstance(wid, str) and wid and " " not in wid else "-"


def _preload(cmd: PythonCommand) -> None:
    started = time.monotonic()
    loaded = cmd.preload()
    if os.environ.get(ENV_STORE_ROOT):
        # Its workers open their node's store from this directory (tenplex.worker.session.node_store): the local
        # store's module loads zarr, which the job's own imports do not; measured at 0.1 s alone and up to 2 s in
        # each forked worker while a reconfiguration loads the machine. Once here instead.
        importlib.import_module("tenplex.store.local")
        loaded.append("tenplex.store.local")
    log.info("standby: %s imported in %.2f s; ready", ", ".join(loaded) or "nothing", time.monotonic() - started)


def serve(command: Sequence[str], requests: IO[str] | None = None, replies: IO[str] | None = None) -> int:
    """Preload ``command``'s code, then fork a worker per request until the requests end."""
    cmd = PythonCommand.parse(command)
    requests = requests if requests is not None else sys.stdin
    replies = replies if replies is not None else sys.stdout
    _preload(cmd)

    def say(text: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # no one listening is no reason to stop serving
            replies.write(text + "\n")
            replies.flush()

    say(STANDBY_READY)
    children: set[int] = set()
    fd = requests.fileno()
    buffered = ""
    while True:
        for pid in list(children):  # report the ends of our workers
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    children.discard(pid)
                    say(f"exited {pid} {_exit_code(status)}")
        readable, _, _ = select.select([fd], [], [], 0.2)
        if not readable:
            continue
        chunk = os.read(fd, 1 << 16).decode()
        if not chunk:
            log.info("standby: no more requests; %d worker%s still running", len(children),
                     "" if len(children) == 1 else "s")
            return EXIT_DONE
        buffered += chunk
        while "\n" in buffered:
            line, buffered = buffered.split("\n", 1)
            if not line.strip():
                continue
            try:
                message = _parse(line)
                if "stop" in message or "hello" in message or message.get("inherit"):
                    raise InvalidInput("stop, hello and inherit are for a pod's standby (--port)")
            except InvalidInput as exc:
                log.error("standby: %s", exc.detail)
                say(f"refused {exc.detail}")
                continue
            pid = _fork_worker(message, cmd)
            children.add(pid)
            say(f"started {pid} {_worker_id(message)}")


@dataclass
class _PodWorker:
    worker_id: str
    code: int | None = None
    kill_at: float | None = None
    stopped: bool = False
    """Ended by a stop (a request, or the pod's SIGTERM passed on): its code is no failure of its own."""


@dataclass
class PodStandby:
    """A worker pod's standby (``--port``, see the module docstring): one thread, one ``select`` loop."""

    command: PythonCommand
    address: tuple[str, int]
    environ: Mapping[str, str]
    _workers: dict[int, _PodWorker] = field(default_factory=dict)
    _latest: list[int] = field(default_factory=list)
    """The pids of the latest assignment (the exit code on SIGTERM is theirs)."""
    _conn: socket.socket | None = None
    _greeted: bool = False
    _buffer: bytes = b""
    _terminating: bool = False

    def first_assignment(self) -> list[dict[str, object]]:
        """The launch requests the pod's own environment describes (one per rank of ``TENPLEX_POD_RANKS``)."""
        if ENV_POD_RANKS not in self.environ:
            return [{"env": dict(self.environ)}]
        ranks = parse_pod_ranks(self.environ[ENV_POD_RANKS])
        return [{"env": pod_rank_env(self.environ, rank, len(ranks))} for rank in ranks]

    def run(self) -> int:
        listener = socket.create_server(self.address, reuse_port=False)
        listener.setblocking(False)
        previous = signal.signal(signal.SIGTERM, self._on_term)
        try:
            self._latest = [self._fork(message, listener) for message in self.first_assignment()]
            log.info("standby: listening on %s:%d", *self.address)
            return self._loop(listener)
        finally:
            signal.signal(signal.SIGTERM, previous)
            listener.close()
            if self._conn is not None:
                self._conn.close()

    def _on_term(self, signum: int, frame: object) -> None:
        self._terminating = True

    def _fork(self, message: Mapping[str, object], listener: socket.socket) -> int:
        close = [listener.fileno()] + ([self._conn.fileno()] if self._conn is not None else [])
        pid = _fork_worker(message, self.command, close, die_with_parent=True)
        self._workers[pid] = _PodWorker(_worker_id(message))
        log.info("standby: started worker %s as pid %d", self._workers[pid].worker_id, pid)
        return pid

    def _say(self, text: str) -> None:
        if self._conn is None or not self._greeted:
            return
        try:
            self._conn.settimeout(5.0)  # a scheduler that reads nothing must not stall the pod's workers' reaping
            self._conn.sendall((text + "\n").encode())
        except OSError as exc:
            log.warning("standby: lost the scheduler's connection (%s)", exc)
            self._drop()
        finally:
            if self._conn is not None:
                self._conn.setblocking(False)

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
        self._conn, self._greeted, self._buffer = None, False, b""

    def _running(self) -> list[int]:
        return [pid for pid, w in self._workers.items() if w.code is None]

    def _reap(self) -> None:
        now = time.monotonic()
        for pid in self._running():
            w = self._workers[pid]
            done, status = 0, 0
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                w.code = _exit_code(status)
                log.info("standby: worker %s (pid %d) exited with %d", w.worker_id, pid, w.code)
                self._say(f"exited {pid} {w.code}")
            elif w.kill_at is not None and now >= w.kill_at:
                log.warning("standby: worker %s (pid %d) still running after its stop's grace: SIGKILL", w.worker_id, pid)
                signal_group(pid, signal.SIGKILL)
                w.kill_at = None
        ended = [pid for pid, w in self._workers.items() if w.code is not None]
        for pid in ended[:max(0, len(ended) - MAX_ENDED_KEPT)]:
            del self._workers[pid]

    def _loop(self, listener: socket.socket) -> int:
        forwarded = False
        while True:
            self._reap()
            if self._terminating:
                if not forwarded:
                    log.info("standby: SIGTERM: passed on to workers %s", self._running())
                    for pid in self._running():
                        self._workers[pid].stopped = True
                        signal_group(pid, signal.SIGTERM)
                    forwarded = True
                if not self._running():
                    latest = [self._workers[pid] for pid in self._latest if pid in self._workers]
                    return next((w.code for w in latest if w.code and not w.stopped), 0)
            watch = [listener] + ([self._conn] if self._conn is not None else [])
            readable, _, _ = select.select(watch, [], [], 0.1)
            if listener in readable:
                with contextlib.suppress(BlockingIOError):
                    conn, peer = listener.accept()
                    self._drop()  # the newest connection is the scheduler's (an older one is a dead leader's)
                    conn.setblocking(False)
                    self._conn = conn
                    log.info("standby: connection from %s:%d", *peer[:2])
            if self._conn is not None and self._conn in readable:
                self._read(listener)

    def _read(self, listener: socket.socket) -> None:
        try:
            chunk = self._conn.recv(1 << 16) if self._conn is not None else b""
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop()
            return
        self._buffer += chunk
        while b"\n" in self._buffer and self._conn is not None:
            line, self._buffer = self._buffer.split(b"\n", 1)
            if line.strip():
                self._handle(line.decode(errors="replace"), listener)

    def _handle(self, line: str, listener: socket.socket) -> None:
        try:
            message = _parse(line)
        except InvalidInput as exc:
            log.error("standby: %s", exc.detail)
            self._say(f"refused {exc.detail}")
            return
        if not self._greeted:
            hello = message.get("hello")
            token = self.environ.get(ENV_TOKEN)
            if not isinstance(hello, dict) or (token and hello.get("token") != token):
                log.warning("standby: a connection without the job's hello and token was closed")
                if self._conn is not None:
                    with contextlib.suppress(OSError):
                        self._conn.sendall(b"refused the first request must be a hello with the job's token\n")
                self._drop()
                return
            self._greeted = True
            self._say(STANDBY_READY)
            for pid, w in list(self._workers.items()):  # the replay: nothing that happened unseen is lost
                self._say(f"started {pid} {w.worker_id}")
                if w.code is not None:
                    self._say(f"exited {pid} {w.code}")
            return
        if "stop" in message:
            pid, grace = message.get("stop"), message.get("grace", 10)
            if not isinstance(pid, int) or not isinstance(grace, int | float) or grace < 0:
                self._say(f"refused a stop needs a pid and a grace >= 0 seconds, got {line[:100]}")
            elif pid in self._workers and self._workers[pid].code is None:
                signal_group(pid, signal.SIGTERM)
                self._workers[pid].stopped = True
                self._workers[pid].kill_at = time.monotonic() + float(grace)
            return
        if "hello" in message:
            return
        if self._terminating:
            self._say("refused the pod is being deleted")
            return
        if message.get("inherit"):  # the pod's environment, less its first assignment's ranks, under the request's
            base = {k: v for k, v in self.environ.items() if k != ENV_POD_RANKS}
            message = {**message, "env": {**base, **message["env"]}, "inherit": False}  # type: ignore[dict-item]
        pid = self._fork(message, listener)
        self._latest = [p for p in self._latest if self._workers.get(p) and self._workers[p].code is None] + [pid]
        self._say(f"started {pid} {self._workers[pid].worker_id}")


def serve_pod(command: Sequence[str], port: int, environ: Mapping[str, str] | None = None) -> int:
    """A worker pod's standby: preload, fork the pod's first assignment, then serve its scheduler on ``port``."""
    cmd = PythonCommand.parse(command)
    env = dict(os.environ if environ is None else environ)
    if not 0 < port < 65536:
        raise InvalidInput(f"a standby's port is 1..65535, got {port}")
    _preload(cmd)
    return PodStandby(cmd, (env.get(ENV_NODE_IP) or "0.0.0.0", port), env).run()


def register(cmds: argparse._SubParsersAction) -> None:
    """``tenplex worker standby -- COMMAND...`` (under ``tenplex worker``, next to ``launch``)."""
    sb = cmds.add_parser(
        "standby", help="preload a Python worker command and fork its workers on request (a warm standby)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sb.add_argument("--port", type=int, default=None,
                    help="a worker pod's standby: fork the pod's own assignment, then take requests on this port "
                         f"of ${ENV_NODE_IP} (without: requests on standard input)")
    sb.add_argument("command", nargs=argparse.REMAINDER, help="the worker command, after '--'")
    sb.set_defaults(func=_standby)


def _standby(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.port is not None:
        try:
            return serve_pod(command, args.port)
        except InvalidInput as exc:
            print(f"tenplex worker standby: error: {exc.detail}", file=sys.stderr)
            return 2
    return serve(command)
