"""Tensor store throughput on a 1 GiB float32 tensor, as ratios against baselines measured in the same run.

1. Local region read into a preallocated buffer (``LocalStore.read_into``)
   vs ``numpy.copyto`` of the same number of bytes into a preallocated buffer;
   a row slice and a column slice (targets >= 0.5 and >= 0.3).
2. HTTP region read into a client buffer (``StoreClient.read_into``, checksum
   verified) from the real daemon (``tenplex store serve``, its own process)
   vs a stdlib ``http.server`` process serving the same bytes from memory,
   read with ``http.client`` ``readinto`` (the same transport the store client
   uses, minus its checksum); 1 request and 4 in parallel (target >= 0.8).
Each comparison alternates baseline and store runs and reports the median of
the per-round ratios (the machine is shared and its load drifts).

3. Extra resident memory of the daemon (all its processes) while it serves a
   1 GiB region in one request (target <= 256 MiB): the exact shard (stored checksum, one pass)
   and a region that is not a shard (checksum pass, then the body); and while it
   receives a 1 GiB upload.

Usage: .venv/bin/python benchmarks/store_throughput.py [--dir DIR] [--repeats 9] [--json OUT]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tenplex.ptc.region import Region  # noqa: E402
from tenplex.store.client import ReadRequest, StoreClient  # noqa: E402
from tenplex.store.local import LocalStore  # noqa: E402
from tenplex.testing.processes import stop_processes  # noqa: E402

N = 16384  # 16384 x 16384 float32 = 1 GiB
MiB = 1 << 20

BASELINE_SERVER = textwrap.dedent(
    """
    import sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import parse_qs, urlsplit
    import numpy as np

    data = np.random.default_rng(0).random((int(sys.argv[1]), int(sys.argv[1])), dtype=np.float32)
    flat = memoryview(data.reshape(-1).view(np.uint8))

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            q = parse_qs(urlsplit(self.path).query)
            off, n = int(q["off"][0]), int(q["len"][0])
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(n))
            self.end_headers()
            self.wfile.write(flat[off : off + n])

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()
    """
)


def paired(baseline: Callable[[], object], candidate: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """Alternate baseline and candidate runs; medians of each time and of the per-round ratio.

    Other processes load the machine unevenly; timing both back to back in each
    round and taking the median ratio cancels most of that drift.
    """
    baseline()
    candidate()
    tb, tc, ratios = [], [], []
    for _ in range(repeats):
        t = time.perf_counter()
        baseline()
        tb.append(time.perf_counter() - t)
        t = time.perf_counter()
        candidate()
        tc.append(time.perf_counter() - t)
        ratios.append(tb[-1] / tc[-1])
    return statistics.median(tb), statistics.median(tc), statistics.median(ratios)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def readinto_raw(conn: http.client.HTTPConnection, path: str, target: memoryview) -> None:
    conn.request("GET", path)
    resp = conn.getresponse()
    assert resp.status == 200, resp.status
    got = 0
    while got < len(target):
        n = resp.readinto(target[got:])
        assert n, "short body"
        got += n


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the daemon's supervisor and its worker processes)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def tree_rss(pids: list[int]) -> int:
    return sum(rss_bytes(p) for p in pids)


def peak_extra_rss(pids: list[int], action: Callable[[], object]) -> tuple[int, float]:
    """Run ``action`` while sampling the processes' resident memory; (peak - start, seconds)."""
    before = tree_rss(pids)
    peak = before
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_rss(pids))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t = time.perf_counter()
    try:
        action()
    finally:
        elapsed = time.perf_counter() - t
        done.set()
        sampler.join()
    return peak - before, elapsed


def start_daemon(root: Path, workdir: Path, workers: int) -> tuple[subprocess.Popen[bytes], str]:
    port_file = workdir / "daemon.port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "tenplex", "--log-level", "WARNING", "store", "serve",
            "--root", str(root), "--port-file", str(port_file), "--workers", str(workers),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TENPLEX_TOKEN": ""},
    )
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("store daemon did not start")
        time.sleep(0.05)
    url = f"http://127.0.0.1:{int(port_file.read_text())}"
    with StoreClient(url) as c:
        while not c.health():
            time.sleep(0.05)
    return proc, url


def stop(proc: subprocess.Popen[bytes]) -> None:
    stop_processes([proc])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a new temp dir, removed at the end)")
    parser.add_argument("--repeats", type=int, default=9, help="rounds of (baseline, store) per comparison")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="daemon worker processes (default: nproc)")
    args = parser.parse_args()

    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tenplex-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    root = workdir / "store"
    shutil.rmtree(root, ignore_errors=True)
    results: dict[str, float] = {}
    print(f"nproc {os.cpu_count()}, load average {os.getloadavg()}, scratch {workdir}")

    data = np.random.default_rng(0).random((N, N), dtype=np.float32)
    store = LocalStore(root, durable=False)
    raw_file = workdir / "raw.bin"
    t = time.perf_counter()
    with open(raw_file, "wb") as f:  # baseline: the same bytes as one plain file write
        f.write(memoryview(data.reshape(-1).view(np.uint8)))
    t_raw = time.perf_counter() - t
    raw_file.unlink()
    t = time.perf_counter()
    store.write_shard("bench", "s1-g0", "w", Region.full((N, N)), data, dtype="float32", global_shape=(N, N))
    t_write = time.perf_counter() - t
    results.update(write_raw_gbps=gbps(data.nbytes, t_raw), write_1gib_gbps=gbps(data.nbytes, t_write), write_ratio=t_raw / t_write)
    store.commit("bench", "s1-g0")
    print(
        f"write 1 GiB shard (no fsync): {results['write_1gib_gbps']:.2f} GB/s vs one plain file write "
        f"{results['write_raw_gbps']:.2f} GB/s (ratio {results['write_ratio']:.2f}; single runs)"
    )

    # -- 1. local ------------------------------------------------------------
    q = N // 4
    row, col = Region(((0, q), (0, N))), Region(((0, N), (0, q)))
    out_row = np.empty(row.shape, np.float32)
    out_col = np.empty(col.shape, np.float32)
    copy_src = data[:q]  # 256 MiB, contiguous
    copy_dst = np.empty_like(copy_src)
    copy = lambda: np.copyto(copy_dst, copy_src)  # noqa: E731
    t_copy, t_row, row_ratio = paired(copy, lambda: store.read_into("bench", "s1-g0", "w", row, out_row), args.repeats)
    _, t_col, col_ratio = paired(copy, lambda: store.read_into("bench", "s1-g0", "w", col, out_col), args.repeats)
    assert np.array_equal(out_row, data[:q]) and np.array_equal(out_col, data[:, :q])
    nb = out_row.nbytes
    results.update(
        local_copyto_gbps=gbps(nb, t_copy),
        local_row_gbps=gbps(nb, t_row),
        local_col_gbps=gbps(nb, t_col),
        local_row_ratio=row_ratio,
        local_col_ratio=col_ratio,
    )
    print(
        f"local 256 MiB: copyto {results['local_copyto_gbps']:.2f} GB/s, row {results['local_row_gbps']:.2f} GB/s "
        f"(ratio {results['local_row_ratio']:.2f}, target 0.5), column {results['local_col_gbps']:.2f} GB/s "
        f"(ratio {results['local_col_ratio']:.2f}, target 0.3)"
    )
    store.close()

    # -- 2. HTTP -------------------------------------------------------------
    daemon, url = start_daemon(root, workdir, args.workers)
    print(f"daemon: tenplex store serve --workers {args.workers}")
    base = subprocess.Popen([sys.executable, "-c", BASELINE_SERVER, str(N)], stdout=subprocess.PIPE)
    try:
        assert base.stdout is not None
        base_port = int(base.stdout.readline())
        row_bytes = N * 4
        client = StoreClient(url)

        def http_cases(rows: int) -> tuple[float, float]:
            region = Region(((0, rows), (0, N)))
            out = np.empty(region.shape, np.float32)
            target = memoryview(out.reshape(-1).view(np.uint8))
            conn = http.client.HTTPConnection("127.0.0.1", base_port)
            t_base, t_store, ratio = paired(
                lambda: readinto_raw(conn, f"/b?off=0&len={rows * row_bytes}", target),
                lambda: client.read_into("bench", "s1-g0", "w", region, out),
                args.repeats,
            )
            conn.close()
            assert np.array_equal(out, data[:rows])
            return t_base, t_store, ratio

        for label, rows in (("64mib", 1024), ("256mib", 4096)):
            t_base, t_store, ratio = http_cases(rows)
            nb = rows * row_bytes
            results[f"http1_{label}_baseline_mbps"] = nb / t_base / 1e6
            results[f"http1_{label}_store_mbps"] = nb / t_store / 1e6
            results[f"http1_{label}_ratio"] = ratio
            print(
                f"HTTP 1 read of {label}: baseline {nb / t_base / 1e6:.0f} MB/s, store {nb / t_store / 1e6:.0f} MB/s, "
                f"ratio {ratio:.2f} (target 0.8)"
            )

        # 4 in parallel: four different 64 MiB row blocks
        outs = [np.empty((1024, N), np.float32) for _ in range(4)]
        targets = [memoryview(o.reshape(-1).view(np.uint8)) for o in outs]
        conns = [http.client.HTTPConnection("127.0.0.1", base_port) for _ in range(4)]

        def base_parallel() -> None:
            threads = [
                threading.Thread(target=readinto_raw, args=(conns[i], f"/b?off={i * 1024 * row_bytes}&len={1024 * row_bytes}", targets[i]))
                for i in range(4)
            ]
            for th in threads:
                th.start()
            for th in threads:
                th.join()

        requests = [ReadRequest("bench", "s1-g0", "w", Region(((1024 * i, 1024 * (i + 1)), (0, N))), outs[i]) for i in range(4)]
        t_base, t_store, ratio = paired(base_parallel, lambda: client.read_many(requests, concurrency=4), args.repeats)
        for i in range(4):
            assert np.array_equal(outs[i], data[1024 * i : 1024 * (i + 1)])
        nb = 4 * 1024 * row_bytes
        results.update(http4_baseline_mbps=nb / t_base / 1e6, http4_store_mbps=nb / t_store / 1e6, http4_ratio=ratio)
        print(
            f"HTTP 4 parallel x 64 MiB: baseline {nb / t_base / 1e6:.0f} MB/s, store {nb / t_store / 1e6:.0f} MB/s, "
            f"ratio {ratio:.2f} (target 0.8)"
        )
        for c in conns:
            c.close()
        client.close()

        # -- 3. server memory while serving 1 GiB in one request --------------
        big = np.zeros((N, N), np.float32)
        big.fill(1.0)  # touch every page: measure the server, not the client's first-touch page faults
        big_target = memoryview(big.reshape(-1).view(np.uint8))
        port = int(url.rsplit(":", 1)[1])
        for label, region in (("exact_shard", Region.full((N, N))), ("sub_region", Region(((1, N), (0, N))))):
            conn = http.client.HTTPConnection("127.0.0.1", port)
            readinto_raw(conn, "/v1/jobs/bench/versions/s1-g0/tensors/w?region=0:1,0:16", big_target[:64])  # warm
            nbytes = region.volume * 4
            path = f"/v1/jobs/bench/versions/s1-g0/tensors/w?region={region.format()}"
            extra_bytes, elapsed = peak_extra_rss(process_tree(daemon.pid), lambda: readinto_raw(conn, path, big_target[:nbytes]))  # noqa: B023
            conn.close()
            assert big.reshape(-1)[: region.volume].tobytes() == data[region.slices()].tobytes()
            extra = extra_bytes / MiB
            results[f"server_extra_mib_{label}"] = extra
            results[f"server_1gib_{label}_mbps"] = nbytes / elapsed / 1e6
            print(f"serve 1 GiB {label} in one request: {nbytes / elapsed / 1e6:.0f} MB/s, extra server RSS {extra:.0f} MiB (target 256)")

        # -- and while receiving a 1 GiB upload (streamed into zarr piece by piece) --------
        with StoreClient(url, timeout=300) as up:
            extra_bytes, elapsed = peak_extra_rss(
                process_tree(daemon.pid),
                lambda: up.write_shard("bench", "s2-g0", "w", Region.full((N, N)), data, dtype="float32", global_shape=(N, N)),
            )
        results["server_extra_mib_upload"] = extra_bytes / MiB
        results["server_1gib_upload_mbps"] = data.nbytes / elapsed / 1e6
        print(f"receive a 1 GiB upload: {data.nbytes / elapsed / 1e6:.0f} MB/s, extra server RSS {extra_bytes / MiB:.0f} MiB (target 256)")
    finally:
        stop(daemon)
        base.kill()
        base.wait()
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)

    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
