"""A minimal bulk HTTP source and sink, to measure what an emulated link carries.

``serve`` answers ``GET /bytes/<n>`` with ``n`` bytes (from one preallocated
buffer, so the server costs little CPU); ``fetch`` reads such a body into a
preallocated buffer with ``http.client`` (the fast path the store client uses)
and prints one JSON line: bytes, seconds, Mbit/s and the CPU seconds the
transfer cost the client process (user + system, start-up excluded). Both are plain stdlib, so
they run in any namespace with the venv's python::

    python -m tenplex.testing.bulkhttp serve --host 198.18.0.11 --port 8900
    python -m tenplex.testing.bulkhttp fetch http://198.18.0.11:8900/bytes/20000000

``serve`` prints ``ready`` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import sys
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_BLOCK = memoryview(bytes(range(256)) * 4096)  # 1 MiB
_PATH = re.compile(r"^/bytes/(\d{1,15})$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        m = _PATH.match(self.path)
        if not m:
            self.send_error(404, "expected /bytes/<n>")
            return
        n = int(m.group(1))
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(n))
        self.end_headers()
        left = n
        while left:
            k = min(left, len(_BLOCK))
            self.wfile.write(_BLOCK[:k])
            left -= k

    def log_message(self, format: str, *args: object) -> None:  # quiet: the caller measures
        return


def serve(host: str, port: int) -> None:
    server = ThreadingHTTPServer((host, port), _Handler)
    server.daemon_threads = True
    print("ready", flush=True)
    server.serve_forever()


def fetch(url: str, timeout: float) -> dict[str, float]:
    """GET ``url`` into a reused buffer; bytes, seconds, Mbit/s of the body (connection set-up included), CPU seconds."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise SystemExit(f"fetch: expected an http:// URL, got {url!r}")
    start = time.perf_counter()
    cpu = time.process_time()
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    conn.request("GET", parts.path or "/")
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"fetch: {url}: HTTP {resp.status} {resp.reason}")
    buf = memoryview(bytearray(1 << 20))
    total = 0
    while True:
        k = resp.readinto(buf)
        if not k:
            break
        total += k
    conn.close()
    seconds = time.perf_counter() - start
    return {"bytes": total, "seconds": seconds, "mbit_s": total * 8 / seconds / 1e6, "cpu_s": time.process_time() - cpu}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tenplex.testing.bulkhttp", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="answer GET /bytes/<n> with n bytes")
    s.add_argument("--host", required=True)
    s.add_argument("--port", type=int, required=True)
    f = sub.add_parser("fetch", help="GET a URL and print bytes, seconds, Mbit/s, CPU seconds as JSON")
    f.add_argument("url")
    f.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        serve(args.host, args.port)
    else:
        print(json.dumps(fetch(args.url, args.timeout)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
