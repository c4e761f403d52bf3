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
import sys
import time
from collections.abc import Sequence
from typing import IO

from tenplex.core.commands import STANDBY_READY, PythonCommand
from tenplex.core.protocol import ENV_STORE_ROOT
from tenplex.errors import InvalidInput

log = logging.getLogger(__name__)

EXIT_DONE = 0


def _exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


def _become_worker(message: dict[str, object], command: PythonCommand) -> int:
    """In the forked child: the worker's session, environment and log, then its code; its exit code."""
    os.setsid()  # its own process group: the backend stops a worker and what it starts, nothing else
    env = message.get("env")
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    log_path = message.get("log")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if isinstance(log_path, str) and log_path \
        else os.open(os.devnull, os.O_WRONLY)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the standby's requests are not the worker's input
    os.close(null)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
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


def _parse(line: str) -> dict[str, object]:
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise InvalidInput(f"a launch request is a JSON line: {exc}") from None
    env = message.get("env") if isinstance(message, dict) else None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise InvalidInput("a launch request needs 'env': an object of strings")
    return message


def serve(command: Sequence[str], requests: IO[str] | None = None, replies: IO[str] | None = None) -> int:
    """Preload ``command``'s code, then fork a worker per request until the requests end."""
    cmd = PythonCommand.parse(command)
    requests = requests if requests is not None else sys.stdin
    replies = replies if replies is not None else sys.stdout
    started = time.monotonic()
    loaded = cmd.preload()
    if os.environ.get(ENV_STORE_ROOT):
        # Its workers open their node's store from this directory (tenplex.worker.session.node_store): the local
        # store's module loads zarr, which the job's own imports do not; measured at 0.1 s alone and up to 2 s in
        # each forked worker while a reconfiguration loads the machine. Once here instead.
        importlib.import_module("tenplex.store.local")
        loaded.append("tenplex.store.local")
    log.info("standby: %s imported in %.2f s; ready", ", ".join(loaded) or "nothing", time.monotonic() - started)

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
            except InvalidInput as exc:
                log.error("standby: %s", exc.detail)
                say(f"refused {exc.detail}")
                continue
            pid = os.fork()
            if pid == 0:  # the child: becomes the worker, never returns here
                code = 1
                try:
                    code = _become_worker(message, cmd)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            children.add(pid)
            say(f"started {pid}")


def register(cmds: argparse._SubParsersAction) -> None:
    """``tenplex worker standby -- COMMAND...`` (under ``tenplex worker``, next to ``launch``)."""
    sb = cmds.add_parser(
        "standby", help="preload a Python worker command and fork its workers on request (a warm standby)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sb.add_argument("command", nargs=argparse.REMAINDER, help="the worker command, after '--'")
    sb.set_defaults(func=_standby)


def _standby(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    return serve(command)
