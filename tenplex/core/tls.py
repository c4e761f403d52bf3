"""TLS for the scheduler's API and the store daemons, and the clients' verification of them.

Servers serve HTTPS when given a certificate and its key
(``$TENPLEX_TLS_CERT``/``$TENPLEX_TLS_KEY``, or ``--tls-cert``/``--tls-key``;
the chart mounts them from a Secret, e.g. one cert-manager issues). Clients
of ``https://`` URLs verify the server against ``$TENPLEX_TLS_CA`` (a PEM
bundle; absent: the system's trust store) and its host name, so a server
whose certificate the configured CA did not sign fails the handshake.

What it costs: with TLS on, a daemon cannot hand chunk files to the socket
with ``sendfile(2)`` (the bytes must pass through OpenSSL to be encrypted);
Python 3.11's ``ssl`` module has no kernel-TLS switch (``OP_ENABLE_KTLS`` came
in 3.12) and uvloop's TLS transport encrypts in user space through a memory
BIO anyway, so each byte is encrypted and copied once in the daemon and
decrypted once in the client (``benchmarks/tls_cost.py`` measures it).
"""

from __future__ import annotations

import functools
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenplex.errors import InvalidConfig

ENV_TLS_CERT = "TENPLEX_TLS_CERT"
"""Server: PEM certificate (chain) file; with :data:`ENV_TLS_KEY` the server speaks HTTPS."""
ENV_TLS_KEY = "TENPLEX_TLS_KEY"
"""Server: PEM private key file of :data:`ENV_TLS_CERT`."""
ENV_TLS_CA = "TENPLEX_TLS_CA"
"""Clients: PEM bundle of the CA(s) that ``https://`` servers must be signed by (absent: the system's)."""


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate and key files (read when the server starts)."""

    certfile: str
    keyfile: str

    def __post_init__(self) -> None:
        for what, path in (("certificate", self.certfile), ("key", self.keyfile)):
            if not Path(path).is_file():
                raise InvalidConfig(f"TLS {what} file {path!r} does not exist")

    @classmethod
    def from_options(cls, cert: str | None, key: str | None, env: Mapping[str, str] | None = None) -> ServerTLS | None:
        """``cert``/``key``, else ``$TENPLEX_TLS_CERT``/``$TENPLEX_TLS_KEY``; None when neither is set."""
        env = os.environ if env is None else env
        cert = cert or env.get(ENV_TLS_CERT) or None
        key = key or env.get(ENV_TLS_KEY) or None
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            raise InvalidConfig(f"TLS needs both a certificate and its key ({ENV_TLS_CERT}, {ENV_TLS_KEY}); got one")
        return cls(cert, key)

    def uvicorn_options(self) -> dict[str, Any]:
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile}


@functools.lru_cache(maxsize=8)
def _context(cafile: str | None) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidConfig(f"cannot load the CA bundle {cafile!r} ({ENV_TLS_CA}): {exc}") from None


def client_context(cafile: str | None = None) -> ssl.SSLContext:
    """The context ``https://`` clients verify servers with: ``cafile``, else ``$TENPLEX_TLS_CA``, else the
    system's trust store; host names checked. One shared context per bundle (it holds the parsed CAs)."""
    return _context(cafile or os.environ.get(ENV_TLS_CA) or None)


def handshake_failure(exc: BaseException) -> bool:
    """True for an error that is a failed TLS verification, which retrying cannot fix."""
    return isinstance(exc, ssl.SSLCertVerificationError) or (
        isinstance(exc, ssl.SSLError) and "CERTIFICATE_VERIFY_FAILED" in str(exc))
