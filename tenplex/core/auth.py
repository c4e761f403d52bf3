"""Who may do what: the admin token, job-scoped signed credentials, and the key set that signs them.

Why: one service serves many teams' jobs, so one shared bearer token would let
any worker of any job read, overwrite or delete every other job's state. The
scheduler therefore gives each job's workers their own credential, a JSON Web
Token (PyJWT, HMAC-SHA256) naming the job, the role and an expiry, and every
daemon and the scheduler check it on each request:

- ``admin``: the scheduler's own identity and the operator's; everything. The
  static bearer token (``--token``/``$TENPLEX_TOKEN`` of the scheduler and the
  daemons) is this role; a signed credential may carry it too.
- ``worker`` with a job: read and write that job's versions on any daemon;
  that job's routes of the scheduler (its status, plan, PTC, the worker
  protocol); nothing else.
- ``reader`` with a job: read that job's versions. The scheduler puts one in
  each transform it submits (the *grant*); the target daemon pulls from the
  source daemons with it, so a source daemon serves a peer exactly the job the
  scheduler asked to move, and a transform request needs ``admin`` itself.

The keys come from a key-set file (``--auth-keys``/``$TENPLEX_AUTH_KEYS``; in
the chart a Secret mounted as a file)::

    {"active": "k2", "keys": {"k1": "<secret>", "k2": "<secret>"}}

New credentials are signed with the ``active`` key and carry its id (the
token's ``kid`` header); every key listed verifies. The file is re-read when it
changes (checked at most once a second), so keys rotate without restarting
anything: add a key, make it active, and remove the old one once the
credentials it signed have expired. Secrets are at least 32 bytes.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import jwt

from tenplex.core.files import atomic_write
from tenplex.errors import Forbidden, InvalidConfig, Unauthorized

log = logging.getLogger(__name__)

ENV_AUTH_KEYS = "TENPLEX_AUTH_KEYS"
"""Path of the key-set file that signs and verifies credentials (absent: static token only)."""

ROLE_ADMIN = "admin"
ROLE_WORKER = "worker"
ROLE_READER = "reader"
ROLES = (ROLE_ADMIN, ROLE_WORKER, ROLE_READER)

ISSUER = "tenplex-scheduler"
AUDIENCE = "tenplex"
ALGORITHM = "HS256"
MIN_SECRET_BYTES = 32
RELOAD_CHECK_S = 1.0
"""How often at most the key-set file is looked at for a change."""
LEEWAY_S = 30
"""Clock skew tolerated between the scheduler and a daemon (``exp``, ``iat``)."""
_CACHE_ENTRIES = 4096


@dataclass(frozen=True)
class Principal:
    """The caller of one request: its role, its job (None for ``admin``) and a name for logs."""

    role: str
    job: str | None = None
    subject: str = ""

    @property
    def is_admin(self) -> bool:
        return self.role == ROLE_ADMIN

    def can_read(self, job: str) -> bool:
        return self.is_admin or (self.role in (ROLE_WORKER, ROLE_READER) and self.job == job)

    def can_write(self, job: str) -> bool:
        return self.is_admin or (self.role == ROLE_WORKER and self.job == job)

    def describe(self) -> str:
        return f"{self.role} credential of job {self.job!r}" if self.job is not None else f"{self.role} credential"


ANONYMOUS_ADMIN = Principal(ROLE_ADMIN, None, "auth off")
"""Everybody, when a server has neither a token nor a key set (loopback development only)."""


def require_read(principal: Principal, job: str) -> None:
    if not principal.can_read(job):
        raise Forbidden(f"a {principal.describe()} may not read job {job!r}")


def require_write(principal: Principal, job: str) -> None:
    if not principal.can_write(job):
        raise Forbidden(f"a {principal.describe()} may not write job {job!r}")


def require_admin(principal: Principal, what: str) -> None:
    if not principal.is_admin:
        raise Forbidden(f"{what} needs the scheduler's or the operator's credential, not a {principal.describe()}")


class KeySet:
    """The signing keys, from a JSON file that is re-read when it changes (see the module doc)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._checked = 0.0
        self._active = ""
        self._keys: dict[str, bytes] = {}
        self.generation = 0
        """Bumped at every reload: verified credentials cached before it are checked again."""
        self._load(strict=True)

    @staticmethod
    def generate(path: str | Path) -> KeySet:
        """Write a new key set with one random key (mode 0600) unless the file exists; open it."""
        path = Path(path)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            kid = f"k{time.strftime('%Y%m%d')}-{secrets.token_hex(3)}"
            atomic_write(path, json.dumps({"active": kid, "keys": {kid: secrets.token_urlsafe(48)}}), mode=0o600)
        return KeySet(path)

    def _load(self, *, strict: bool) -> None:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return
            active, keys = parse_key_set(self.path.read_text())
        except (OSError, ValueError, InvalidConfig) as exc:
            if strict:
                raise InvalidConfig(f"auth key set {self.path}: {exc}") from None
            log.error("auth key set %s could not be re-read (%s); the keys read before stay in use", self.path, exc)
            return
        self._stamp, self._active, self._keys = stamp, active, keys
        self.generation += 1
        log.info("auth key set %s: %d key(s), active %s", self.path, len(keys), active)

    def _fresh(self) -> None:
        now = time.monotonic()
        if now - self._checked >= RELOAD_CHECK_S:
            with self._lock:
                if now - self._checked >= RELOAD_CHECK_S:
                    self._checked = now
                    self._load(strict=False)

    def key(self, kid: str) -> bytes | None:
        self._fresh()
        return self._keys.get(kid)

    def active(self) -> tuple[str, bytes]:
        self._fresh()
        return self._active, self._keys[self._active]


def parse_key_set(text: str) -> tuple[str, dict[str, bytes]]:
    """The active key id and every key of a key-set file's text; :class:`InvalidConfig` (or ``ValueError`` for
    text that is not JSON) saying what is wrong."""
    obj = json.loads(text)
    if not isinstance(obj, dict) or not isinstance(obj.get("keys"), dict) or not obj["keys"]:
        raise InvalidConfig('expected {"active": KID, "keys": {KID: SECRET, ...}} with at least one key')
    keys: dict[str, bytes] = {}
    for kid, secret in obj["keys"].items():
        if not isinstance(secret, str) or len(secret.encode()) < MIN_SECRET_BYTES:
            raise InvalidConfig(f"key {kid!r} must be a string of at least {MIN_SECRET_BYTES} bytes")
        keys[str(kid)] = secret.encode()
    active = obj.get("active")
    if active not in keys:
        raise InvalidConfig(f"'active' must name one of the keys {sorted(keys)}, got {active!r}")
    return str(active), keys


class Issuer:
    """Signs credentials with the key set's active key (the scheduler's, and ``tenplex auth token``'s)."""

    def __init__(self, keys: KeySet, *, worker_ttl_s: float = 30 * 86400.0, grant_ttl_s: float = 86400.0) -> None:
        if worker_ttl_s <= 0 or grant_ttl_s <= 0:
            raise InvalidConfig(f"credential lifetimes must be positive, got {worker_ttl_s} and {grant_ttl_s}")
        self.keys = keys
        self.worker_ttl_s = worker_ttl_s
        self.grant_ttl_s = grant_ttl_s

    def mint(self, role: str, job: str | None = None, *, ttl_s: float, subject: str = "") -> str:
        if role not in ROLES:
            raise InvalidConfig(f"unknown role {role!r} (one of {', '.join(ROLES)})")
        if (role == ROLE_ADMIN) != (job is None):
            raise InvalidConfig(f"a {role} credential {'names no' if role == ROLE_ADMIN else 'needs a'} job")
        kid, key = self.keys.active()
        now = int(time.time())
        claims: dict[str, object] = {"iss": ISSUER, "aud": AUDIENCE, "sub": subject or (job or role),
                                     "iat": now, "exp": now + int(ttl_s), "role": role}
        if job is not None:
            claims["job"] = job
        return jwt.encode(claims, key, algorithm=ALGORITHM, headers={"kid": kid})

    def worker(self, job: str) -> str:
        """The credential a job's workers hold: its versions, its scheduler routes."""
        return self.mint(ROLE_WORKER, job, ttl_s=self.worker_ttl_s, subject=f"{job}/workers")

    def grant(self, job: str) -> str:
        """The read grant a transform carries to the source daemons of ``job``'s versions."""
        return self.mint(ROLE_READER, job, ttl_s=self.grant_ttl_s, subject=f"{job}/transform")


class Authenticator:
    """Checks an ``Authorization`` header against the admin token and the key set; None of both: auth off."""

    def __init__(self, token: str | None = None, keys: KeySet | None = None) -> None:
        self._token = token.encode() if token else None
        self.keys = keys
        self._cache: dict[str, tuple[Principal, float, int]] = {}

    @classmethod
    def from_env(cls, token: str | None, keys_path: str | Path | None = None) -> Authenticator:
        """``keys_path`` (default ``$TENPLEX_AUTH_KEYS``) names the key set; empty: none."""
        path = keys_path if keys_path is not None else os.environ.get(ENV_AUTH_KEYS) or None
        return cls(token, KeySet(path) if path else None)

    @property
    def enabled(self) -> bool:
        return self._token is not None or self.keys is not None

    def authenticate(self, header: str | bytes | None) -> Principal:
        """The caller of a request with this ``Authorization`` header; :class:`Unauthorized` when unknown."""
        if not self.enabled:
            return ANONYMOUS_ADMIN
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        scheme, _, given = (header or "").partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            raise Unauthorized("missing bearer credential (Authorization: Bearer <token>)")
        if self._token is not None and hmac.compare_digest(given.encode("latin-1", "replace"), self._token):
            return Principal(ROLE_ADMIN, None, "admin token")
        if self.keys is None or given.count(".") != 2:
            raise Unauthorized("wrong bearer credential")
        cached = self._cache.get(given)
        if cached is not None and cached[1] > time.time() and cached[2] == self.keys.generation:
            return cached[0]
        principal, exp = self._verify(given)
        if len(self._cache) >= _CACHE_ENTRIES:
            self._cache.clear()
        self._cache[given] = (principal, exp, self.keys.generation)
        return principal

    def _verify(self, token: str) -> tuple[Principal, float]:
        assert self.keys is not None
        try:
            kid = jwt.get_unverified_header(token).get("kid")
            key = self.keys.key(kid) if isinstance(kid, str) else None
            if key is None:
                raise Unauthorized(f"credential signed with an unknown key id {kid!r} (forged, or its key was retired)")
            claims = jwt.decode(token, key, algorithms=[ALGORITHM], audience=AUDIENCE, issuer=ISSUER, leeway=LEEWAY_S,
                                options={"require": ["exp", "iat", "iss", "aud", "role"]})
        except jwt.ExpiredSignatureError:
            raise Unauthorized("credential expired") from None
        except jwt.InvalidSignatureError:
            raise Unauthorized("credential signature does not verify (forged or altered)") from None
        except jwt.InvalidTokenError as exc:
            raise Unauthorized(f"bad credential: {exc}") from None
        role, job = claims.get("role"), claims.get("job")
        if role not in ROLES or (role == ROLE_ADMIN) != (job is None) or (job is not None and not isinstance(job, str)):
            raise Unauthorized(f"bad credential: role {role!r} with job {job!r}")
        return Principal(role, job, str(claims.get("sub", ""))), float(claims["exp"]) + LEEWAY_S
