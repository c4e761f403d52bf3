"""A tiny worker for the standby tests: says who it is, counts how often its module was executed, exits.

Importing it records the import in ``$STANDBY_IMPORTS`` (a file), so a test can tell a preload (one import
in the standby) from a fresh process per worker.
"""

from __future__ import annotations

import os
import sys
import time

if os.environ.get("STANDBY_IMPORTS"):
    with open(os.environ["STANDBY_IMPORTS"], "a") as f:
        f.write(f"{os.getpid()} {__name__}\n")


def main() -> int:
    print(f"worker {os.environ.get('WHO', '?')} pid {os.getpid()} pgid {os.getpgid(0)} argv {sys.argv[1:]}", flush=True)
    print(f"local store imported before the worker ran: {'tenplex.store.local' in sys.modules}", flush=True)
    time.sleep(float(os.environ.get("SLEEP", "0")))
    return int(os.environ.get("CODE", "0"))


if __name__ == "__main__":
    raise SystemExit(main())
