"""What a Python worker command runs, so that a process already running Python can run it in place; and the
ranks a worker pod runs (``TENPLEX_POD_RANKS``), which its launcher and its standby both start.

The warm standby workers (:mod:`tenplex.standby`) import a job's code
ahead of time and then run it as ``__main__``; the backends check a job's
command with :meth:`PythonCommand.parse` before they keep standbys for it.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import logging
import os
import runpy
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tenplex.errors import InvalidInput

log = logging.getLogger(__name__)

ENV_POD_RANKS = "TENPLEX_POD_RANKS"
"""JSON list, one object of environment overrides per local rank of the pod."""
ENV_RANK = "RANK"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
STANDBY_READY = "ready"
"""What a standby worker writes on its standard output once its imports are done (backends count them)."""


@dataclass(frozen=True)
class PythonCommand:
    """A worker command that runs Python code this process can run in place."""

    module: str | None
    """``python -m MODULE``: the module run as ``__main__``."""
    script: str | None
    """``python SCRIPT``: the script run as ``__main__``."""
    argv: tuple[str, ...]
    """``sys.argv`` of the worker (``argv[0]`` is the module's file or the script)."""

    @classmethod
    def parse(cls, command: Sequence[str]) -> PythonCommand:
        """The Python code a worker command runs; refuses one a standby cannot become (with why)."""
        if not command:
            raise InvalidInput("a standby needs the worker command")
        exe = Path(command[0]).name
        if not exe.startswith("python"):
            raise InvalidInput(f"a standby runs Python worker commands (python -m MODULE / python SCRIPT); "
                               f"{command[0]!r} is not a Python interpreter")
        rest = list(command[1:])
        while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
            if rest[0] in ("-X", "-W"):  # options with a value: fine for a worker, not repeated here
                rest = rest[2:]
            else:
                rest = rest[1:]
        if rest[:1] == ["-m"] and len(rest) >= 2:
            return cls(module=rest[1], script=None, argv=(rest[1], *rest[2:]))
        if rest and not rest[0].startswith("-"):
            return cls(module=None, script=rest[0], argv=tuple(rest))
        raise InvalidInput(f"a standby cannot run {list(command)!r}: it needs `python -m MODULE ...` or "
                           "`python SCRIPT ...`")

    def preload(self) -> list[str]:
        """Import what the command will run (without running it); the modules imported."""
        if self.module is not None:
            importlib.import_module(self.module)
            return [self.module]
        return _preload_script_imports(Path(self.script or ""))

    def run(self) -> None:
        """Run the command's code as ``__main__`` (the worker's own ``if __name__ == "__main__"`` included)."""
        sys.argv = list(self.argv)
        if self.module is not None:
            runpy.run_module(self.module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(self.script), run_name="__main__")


def _preload_script_imports(script: Path) -> list[str]:
    """The top-level imports of ``script``, imported (a failing one is left to the worker to report)."""
    try:
        tree = ast.parse(script.read_text(), filename=str(script))
    except (OSError, SyntaxError) as exc:
        raise InvalidInput(f"cannot read the worker script {str(script)!r}: {exc}") from None
    if str(script.parent) not in sys.path:
        sys.path.insert(0, str(script.parent))
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    loaded = []
    for name in names:
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception as exc:  # the worker will import it again and fail where its user can see it
            log.warning("standby: preloading %s failed (%s); the worker will import it itself", name, exc)
    return loaded


@dataclass(frozen=True)
class LocalRank:
    """One rank the pod runs: its global and local rank and the environment it differs in."""

    rank: int
    local_rank: int
    env: Mapping[str, str]


def parse_pod_ranks(text: str | None) -> tuple[LocalRank, ...]:
    """The local ranks described by ``$TENPLEX_POD_RANKS`` (see the module docstring), in local-rank order."""
    if text is None or not text.strip():
        raise InvalidInput(f"{ENV_POD_RANKS} is not set: it must hold a JSON list with one object of environment "
                           f"overrides per local rank, e.g. [{{\"RANK\":\"0\",\"LOCAL_RANK\":\"0\"}}]")
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise InvalidInput(f"{ENV_POD_RANKS} is not valid JSON ({exc}): {text[:200]!r}") from None
    if not isinstance(raw, list) or not raw:
        raise InvalidInput(f"{ENV_POD_RANKS} must be a non-empty JSON list of objects, got {text[:200]!r}")
    ranks: list[LocalRank] = []
    for index, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise InvalidInput(f"{ENV_POD_RANKS}[{index}] must be an object of environment variables, got {entry!r}")
        bad = {k: v for k, v in entry.items() if not k or "=" in k or not isinstance(v, str) or "\0" in v}
        if bad:
            raise InvalidInput(f"{ENV_POD_RANKS}[{index}]: environment variables need a name without '=' and a "
                               f"string value, got {bad!r}")
        numbers: dict[str, int] = {}
        for key in (ENV_RANK, ENV_LOCAL_RANK):
            value = entry.get(key)
            if value is None or not value.isdigit():
                raise InvalidInput(f"{ENV_POD_RANKS}[{index}]: {key} must be a non-negative integer, got {value!r}")
            numbers[key] = int(value)
        ranks.append(LocalRank(numbers[ENV_RANK], numbers[ENV_LOCAL_RANK], dict(entry)))
    for key, values in ((ENV_RANK, [r.rank for r in ranks]), (ENV_LOCAL_RANK, [r.local_rank for r in ranks])):
        if len(set(values)) != len(values):
            raise InvalidInput(f"{ENV_POD_RANKS}: every local rank needs its own {key}, got {values}")
    return tuple(sorted(ranks, key=lambda r: r.local_rank))


def signal_group(pid: int, sig: int) -> None:
    """Signal a worker's process group (the worker and anything it started); the process alone when it has no
    group of its own (yet: a worker just forked makes its session first thing)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def pod_rank_env(base: Mapping[str, str], rank: LocalRank, count: int) -> dict[str, str]:
    """One rank's environment in a pod of ``count`` ranks: the pod's (less ``TENPLEX_POD_RANKS``), then its own."""
    env = {k: v for k, v in base.items() if k != ENV_POD_RANKS}
    env.setdefault(ENV_LOCAL_WORLD_SIZE, str(count))
    env.update(rank.env)
    return env
