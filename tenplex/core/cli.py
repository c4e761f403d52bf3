"""``tenplex auth``: key sets of job-scoped credentials (new, rotate, retire) and credentials signed with them.

An operator rotates the keys the scheduler signs with (``rotate`` adds a key and makes it active, ``retire``
drops an old one once what it signed has expired) and hands out credentials by hand, e.g. a ``reader``
credential with which a team exports its own job's versions (``tenplex export``, ``tenplex store get``)
without the admin token. See :mod:`tenplex.core.auth`.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import time
from pathlib import Path

from tenplex.core.auth import ROLE_ADMIN, ROLES, Issuer, KeySet, parse_key_set
from tenplex.core.files import atomic_write
from tenplex.errors import InvalidInput


def register(sub: argparse._SubParsersAction) -> None:
    auth = sub.add_parser("auth", help="job-scoped credentials: key sets (new, rotate, retire) and credentials")
    cmds = auth.add_subparsers(dest="auth_command", metavar="SUBCOMMAND", required=True)
    new = cmds.add_parser("new-keys", help="write a new key set with one random key (mode 0600)")
    new.add_argument("file", type=Path)
    new.set_defaults(func=_new)
    rotate = cmds.add_parser("rotate", help="add a random key to a key set and make it the active one")
    rotate.add_argument("file", type=Path)
    rotate.set_defaults(func=_rotate)
    retire = cmds.add_parser("retire", help="drop a key (not the active one): what it signed is refused from then on")
    retire.add_argument("file", type=Path)
    retire.add_argument("kid", help="the key's id")
    retire.set_defaults(func=_retire)
    token = cmds.add_parser("token", help="print a credential signed with a key set's active key")
    token.add_argument("--keys", type=Path, default=os.environ.get("TENPLEX_AUTH_KEYS"), required=False,
                       help="the key set (default $TENPLEX_AUTH_KEYS)")
    token.add_argument("--role", choices=ROLES, required=True,
                       help="reader: read one job's versions; worker: a job's workers' rights; admin: everything")
    token.add_argument("--job", default=None, help="the job (reader and worker)")
    token.add_argument("--ttl", default="1h", help="lifetime, e.g. 30m, 12h, 7d (default 1h)")
    token.set_defaults(func=_token)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90``, ``30m``, ``12h``, ``7d`` -> seconds (positive)."""
    unit = text[-1:] if text[-1:] in _UNITS else "s"
    number = text[:-1] if text[-1:] in _UNITS else text
    try:
        seconds = float(number) * _UNITS[unit]
    except ValueError:
        raise InvalidInput(f"bad duration {text!r}: a number with s, m, h or d, e.g. 12h") from None
    if not seconds > 0:
        raise InvalidInput(f"a duration must be positive, got {text!r}")
    return seconds


def _read(path: Path) -> dict[str, object]:
    try:
        text = path.read_text()
        parse_key_set(text)
    except OSError as exc:
        raise InvalidInput(f"cannot read the key set {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise InvalidInput(f"{path} is not a key set: {exc}") from None
    return json.loads(text)


def _write(path: Path, obj: dict[str, object]) -> None:
    """Atomically, mode 0600: the daemons and the scheduler re-read it whenever it changes."""
    atomic_write(path, json.dumps(obj, indent=1), mode=0o600)


def _new(args: argparse.Namespace) -> int:
    if args.file.exists():
        raise InvalidInput(f"{args.file} exists; 'tenplex auth rotate' adds a key to it")
    keys = KeySet.generate(args.file)
    print(f"wrote {args.file}: active key {keys.active()[0]}")
    return 0


def _rotate(args: argparse.Namespace) -> int:
    obj = _read(args.file)
    kid = f"k{time.strftime('%Y%m%d')}-{secrets.token_hex(3)}"
    obj["keys"] = {**dict(obj["keys"]), kid: secrets.token_urlsafe(48)}  # type: ignore[arg-type]
    obj["active"] = kid
    _write(args.file, obj)
    print(f"{args.file}: new active key {kid}; keys {', '.join(obj['keys'])}")  # type: ignore[arg-type]
    return 0


def _retire(args: argparse.Namespace) -> int:
    obj = _read(args.file)
    keys = dict(obj["keys"])  # type: ignore[arg-type]
    if args.kid not in keys:
        raise InvalidInput(f"{args.file} has no key {args.kid!r} (it has {', '.join(keys)})")
    if args.kid == obj["active"]:
        raise InvalidInput(f"{args.kid!r} is the active key: rotate first")
    del keys[args.kid]
    obj["keys"] = keys
    _write(args.file, obj)
    print(f"{args.file}: retired {args.kid}; keys {', '.join(keys)}")
    return 0


def _token(args: argparse.Namespace) -> int:
    if args.keys is None:
        raise InvalidInput("no key set: --keys FILE or $TENPLEX_AUTH_KEYS")
    if (args.role == ROLE_ADMIN) != (args.job is None):
        raise InvalidInput("--job is for reader and worker credentials, and they need it")
    issuer = Issuer(KeySet(args.keys))
    print(issuer.mint(args.role, args.job, ttl_s=parse_duration(args.ttl), subject="tenplex auth token"))
    return 0
