"""Upload throughput to the persistent tier through the node daemon, as a ratio against a plain obstore put.

The daemon (``tenplex store serve``, its own process) uploads a committed version of its store to an S3 API
(moto's server mode, its own process, on 127.0.0.1) through its upload route: read each shard from the local
zarr store, verify it against the node's checksum, write it as zarr v3 chunk objects with a crc32c codec and
its metadata, as the scheduler's housekeeping asks it to every ``interval_steps``. The baseline, in the same
run against the same server: this process puts the same bytes with obstore (the object-store client the
daemon's zarr backend uses) as objects of the daemon's chunk size, the same number in flight as the daemon's
upload concurrency, no zarr, no checksum, no local read. Rounds alternate baseline and daemon; the median of
the per-round ratios is reported (the machine is shared and its load drifts).

Daemon time: from the POST to the record saying ``uploaded`` (polled every 20 ms: the record's own
``seconds`` is reported too). Each round uploads to a fresh prefix, deleted after it.

Usage: .venv/bin/python benchmarks/persist_upload.py [--mib 256] [--shards 8] [--repeats 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tenplex.ptc.region import Region  # noqa: E402
from tenplex.store.client import StoreClient  # noqa: E402
from tenplex.store.local import LocalStore  # noqa: E402
from tenplex.store.persistent import DEFAULT_CHUNK_BYTES  # noqa: E402

MiB = 1 << 20
JOB, VERSION, BUCKET = "bench", "s100-g0", "tenplex-bench"
KEY, SECRET, REGION = "bench-key", "bench-secret", "us-east-1"
CONCURRENCY = 4  # the daemon's default --upload-concurrency


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{what} did not start")


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1",
                             "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    wait_port(port, proc, "moto server")
    return proc, f"http://127.0.0.1:{port}"


def start_daemon(root: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port_file = root.parent / "daemon.port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tenplex", "--log-level", "WARNING", "store", "serve", "--root", str(root),
         "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
         "--upload-concurrency", str(CONCURRENCY)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the daemon did not start")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port_file.read_text().strip()}"


def daemon_round(client: StoreClient, uri: str, shards: list[list[str]]) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    client.request_json("POST", f"/v1/jobs/{JOB}/uploads", {"version": VERSION, "uri": uri, "shards": shards})
    while True:
        rec = client.request_json("GET", f"/v1/jobs/{JOB}/uploads/{VERSION}")
        if rec["state"] not in ("queued", "running"):
            break
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    if rec["state"] != "uploaded":
        raise SystemExit(f"upload {rec['state']}: {rec.get('error')}")
    client.request_json("DELETE", f"/v1/jobs/{JOB}/uploads/{VERSION}")  # forget the record: the next round anew
    client.request_json("DELETE", f"/v1/jobs/{JOB}/persistent/{VERSION}?uri={uri}")
    return wall, float(rec["seconds"]), int(rec["bytes_done"])


def baseline_round(endpoint: str, prefix: str, payload: memoryview, chunk: int) -> float:
    from obstore.store import S3Store

    store = S3Store(BUCKET, prefix=prefix, config={"endpoint": endpoint, "region": REGION, "access_key_id": KEY,
                                                   "secret_access_key": SECRET}, client_options={"allow_http": True})
    pieces = [payload[i: i + chunk] for i in range(0, len(payload), chunk)]

    async def run() -> None:
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(i: int, data: memoryview) -> None:
            async with sem:
                await store.put_async(f"obj/{i}", data)

        await asyncio.gather(*(one(i, p) for i, p in enumerate(pieces)))

    t0 = time.perf_counter()
    asyncio.run(run())
    seconds = time.perf_counter() - t0

    async def clean() -> None:
        await asyncio.gather(*(store.delete_async(f"obj/{i}") for i in range(len(pieces))))

    asyncio.run(clean())
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes of the version, in MiB")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tenplex-persist-bench-"))
    procs: list[subprocess.Popen] = []
    try:
        moto, endpoint = start_moto()
        procs.append(moto)
        import boto3

        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                     region_name=REGION).create_bucket(Bucket=BUCKET)
        # the version on the node: float32 shards, rows of one tensor
        rows = args.mib * MiB // 4 // 1024
        per = rows // args.shards
        rng = np.random.default_rng(0)
        data = rng.standard_normal((per * args.shards, 1024), dtype=np.float32)
        store = LocalStore(tmp / "node", durable=False)
        shards = []
        for i in range(args.shards):
            r = Region(((i * per, (i + 1) * per), (0, 1024)))
            store.write_shard(JOB, VERSION, "w", r, data[i * per: (i + 1) * per], dtype="float32",
                              global_shape=data.shape)
            shards.append(["w", r.format()])
        store.commit(JOB, VERSION)
        store.close()
        nbytes = data.nbytes
        payload = memoryview(data.reshape(-1).view(np.uint8))
        env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
               "AWS_REGION": REGION, "TENPLEX_TOKEN": "bench"}
        daemon, url = start_daemon(tmp / "node", env)
        procs.append(daemon)
        rounds = []
        with StoreClient(url, "bench", timeout=600) as client:
            for i in range(args.repeats):
                base = baseline_round(endpoint, f"base-{i}", payload, DEFAULT_CHUNK_BYTES)
                wall, rec_s, done = daemon_round(client, f"s3://{BUCKET}/round-{i}", shards)
                assert done == nbytes, (done, nbytes)
                rounds.append({"baseline_s": base, "daemon_s": wall, "daemon_record_s": rec_s,
                               "ratio": (nbytes / wall) / (nbytes / base)})
                print(f"round {i}: obstore put {nbytes / base / MiB:7.1f} MiB/s   daemon upload "
                      f"{nbytes / wall / MiB:7.1f} MiB/s   ratio {rounds[-1]['ratio']:.2f}", flush=True)
        ratio = statistics.median(r["ratio"] for r in rounds)
        base_rate = statistics.median(nbytes / r["baseline_s"] for r in rounds) / MiB
        daemon_rate = statistics.median(nbytes / r["daemon_s"] for r in rounds) / MiB
        print(f"\n{args.mib} MiB in {args.shards} shards, chunk objects of {DEFAULT_CHUNK_BYTES // MiB} MiB, "
              f"{CONCURRENCY} in flight: obstore put {base_rate:.1f} MiB/s, daemon upload {daemon_rate:.1f} MiB/s, "
              f"median ratio {ratio:.2f}")
        if args.json is not None:
            args.json.write_text(json.dumps({"mib": args.mib, "shards": args.shards, "chunk_bytes": DEFAULT_CHUNK_BYTES,
                                             "concurrency": CONCURRENCY, "rounds": rounds, "median_ratio": ratio,
                                             "baseline_mib_s": base_rate, "daemon_mib_s": daemon_rate}, indent=2))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
