"""What a Python worker command runs, so that a process already running Python can run it in place.

The warm standby workers (:mod:`tenplex.standby`) import a job's code
ahead of time and then run it as ``__main__``; the backends check a job's
command with :meth:`PythonCommand.parse` before they keep standbys for it.
"""

from __future__ import annotations

import ast
import importlib
import logging
import runpy
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tenplex.errors import InvalidInput

log = logging.getLogger(__name__)

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
