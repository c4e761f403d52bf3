"""The one command-line entry point, ``tenplex``, with a subcommand per area.

Each package contributes its subcommands through a ``register(subparsers)``
function in its own ``cli`` module; the handler it sets as ``func`` returns the
exit code. A :class:`~tenplex.errors.TenplexError` reaching here is printed as
one clear line and exits 1 (2 for bad arguments, as argparse does).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from tenplex import __version__
from tenplex.errors import InvalidInput, TenplexError

# Modules with a ``register(subparsers)`` function, in the order shown by --help.
COMMAND_MODULES: tuple[str, ...] = ("tenplex.ptc.cli", "tenplex.node.cli", "tenplex.transformer.cli", "tenplex.interop.cli", "tenplex.scheduler.cli", "tenplex.k8s.cli", "tenplex.core.cli", "tenplex.launcher", "tenplex.demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tenplex",
        description="Elastic multi-dimensional-parallel training: PTC layouts, tensor store, state transformer, scheduler.",
    )
    parser.add_argument("--version", action="version", version=f"tenplex {__version__}")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging verbosity (default INFO)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except InvalidInput as exc:
        print(f"tenplex: error: {exc.detail}", file=sys.stderr)
        return 1
    except TenplexError as exc:
        print(f"tenplex: {exc.code}: {exc.detail}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tenplex: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
