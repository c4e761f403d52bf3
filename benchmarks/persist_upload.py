"""Uploads to the persistent tier through the node daemon: bandwidth, fixed costs, and the issue's job.

Cases (``--cases``, default all but ``job``):

- ``bandwidth``: throughput as a ratio against a plain obstore put (below).
- ``small``: versions of many small tensors (4-64 KiB float32, sizes cycling 4, 8, 16, 32, 64 KiB;
  ``--tensors``, default 250 and 1000), each uploaded by the daemon and committed, to ``file://`` and to the
  S3 server; the time split per stage (the daemon's record: ``check`` what is there, ``read`` the node's
  copy, ``write`` to the destination, summed over its threads; then the client's ``upload`` wall time from
  the POST to the record saying ``uploaded``, and ``commit``, the commit request). The fixed cost per tensor
  and per version come from the two sizes: per tensor = (T(N2) - T(N1)) / (N2 - N1), per version =
  T(N1) - N1 * per tensor (T: upload + commit, the median of the repeats, as wall time and as the daemon's
  CPU time, which a loaded machine disturbs less; one round before them per target is
  not timed: a daemon's first upload imports zarr and the object-store client).
- With ``--baseline-code DIR`` (a checkout of other code, e.g. the commit before), the ``small`` and ``gpt``
  cases also run a daemon of that code on a copy of the node store, its rounds alternating with this code's,
  so both see the same load on a shared machine.
- ``gpt``: the GPT layouts of ``benchmarks/cluster_reshard.py``: the reference GPT of the job below (4 layers,
  dim 64, vocab 128; dp1 x tp1 x pp2 on 2 hosts) and cluster_reshard's default spec (8 layers, hidden 1024,
  vocab 8192, fp32 with Adam moments; tp2 x pp2 x dp2 on 4 hosts of 2 GPUs): host-0's part of each (the shards
  the scheduler assigns it, ``assign_uploads``), same stages and targets as ``small``.
- ``job``: the issue's scenario measured from outside: a dp1 job of the reference GPT (real workers, the
  local backend, 2 emulated hosts) with ``"checkpoint": {"uri": "file://...", "interval_steps": 4}`` and
  snapshots every 2 steps; for every version persisted, ``persist.started_at -> finished_at`` of the job's
  status (polled every 50 ms), and which versions were persisted or skipped.

Bandwidth case:

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

Usage: .venv/bin/python benchmarks/persist_upload.py [--cases bandwidth small gpt job] [--targets file s3]
       [--tensors 250 1000] [--mib 256] [--shards 8] [--repeats 5] [--job-steps 40] [--json OUT]
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
from urllib.parse import quote

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
    port_file = root.parent / f"{root.name}.port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tenplex", "--log-level", "WARNING", "store", "serve", "--root", str(root),
         "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
         "--upload-concurrency", str(CONCURRENCY)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        cwd=env.get("PYTHONPATH", str(ROOT)),  # `-m` puts the working directory first on the path
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


def bandwidth_case(args: argparse.Namespace, tmp: Path, endpoint: str, env: dict[str, str],
                   procs: list[subprocess.Popen]) -> dict:
    # the version on the node: float32 shards, rows of one tensor
    rows = args.mib * MiB // 4 // 1024
    per = rows // args.shards
    rng = np.random.default_rng(0)
    data = rng.standard_normal((per * args.shards, 1024), dtype=np.float32)
    store = LocalStore(tmp / "node-bw", durable=False)
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
    daemon, url = start_daemon(tmp / "node-bw", env)
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
          f"median ratio {ratio:.2f}", flush=True)
    return {"mib": args.mib, "shards": args.shards, "chunk_bytes": DEFAULT_CHUNK_BYTES, "concurrency": CONCURRENCY,
            "rounds": rounds, "median_ratio": ratio, "baseline_mib_s": base_rate, "daemon_mib_s": daemon_rate}


# -- versions of many small tensors, and GPT layouts: the fixed costs ------------------------------------


def small_version(n: int) -> list[tuple[str, Region, tuple[int, ...]]]:
    """``n`` float32 tensors of 4-64 KiB (4, 8, 16, 32, 64 KiB in turn), one shard each."""
    out = []
    for i in range(n):
        kib = 4 << (i % 5)
        shape = (kib * 1024 // 4 // 64, 64)
        out.append((f"layers.{i // 10}.t{i % 10}.weight", Region(((0, shape[0]), (0, 64))), shape))
    return out


def gpt_version(name: str) -> list[tuple[str, Region, tuple[int, ...]]]:
    """host-0's part (what the scheduler assigns it) of a GPT layout of benchmarks/cluster_reshard.py."""
    from tenplex.ptc import ParallelConfig
    from tenplex.ptc.megatron import GPTSpec, megatron_gpt_ptc
    from tenplex.scheduler.persist import assign_uploads

    if name == "ref-dp1-pp2":  # the job of the issue (and of the job case)
        ptc = megatron_gpt_ptc(GPTSpec(num_layers=4, hidden=64, heads=4, vocab=128, seq_len=32),
                               ParallelConfig(dp=1, tp=1, pp=2), gpus_per_node=1, hosts=["host-0", "host-1"],
                               precision="fp32")
    else:  # cluster_reshard's default spec, its "loss"/"redeploy" layout at 4 hosts
        ptc = megatron_gpt_ptc(GPTSpec(num_layers=8, hidden=1024, heads=16, vocab=8192, seq_len=2048),
                               ParallelConfig(dp=2, tp=2, pp=2), gpus_per_node=2,
                               hosts=[f"host-{i}" for i in range(4)], precision="fp32")
    mine = set(map(tuple, assign_uploads(ptc, ptc.hosts)["host-0"]))
    return [(t.name, s.region, t.shape) for t in ptc.tensors for s in t.shards if (t.name, s.region.format()) in mine]


def fill_store(root: Path, version: list[tuple[str, Region, tuple[int, ...]]]) -> int:
    store = LocalStore(root, durable=False)
    rng = np.random.default_rng(1)
    nbytes = 0
    for name, region, shape in version:
        data = rng.standard_normal(region.shape, dtype=np.float32)
        store.write_shard(JOB, VERSION, name, region, data, dtype="float32", global_shape=shape)
        nbytes += data.nbytes
    store.commit(JOB, VERSION)
    store.close()
    return nbytes


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (``/proc``): what a round costs the daemon, whatever the load."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def staged_round(client: StoreClient, uri: str, shards: list[list[str]], pid: int) -> dict:
    """One upload and its commit through the daemon, timed per stage."""
    cpu0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    client.request_json("POST", f"/v1/jobs/{JOB}/uploads", {"version": VERSION, "uri": uri, "shards": shards})
    while True:
        rec = client.request_json("GET", f"/v1/jobs/{JOB}/uploads/{VERSION}?wait=5")
        if rec["state"] not in ("queued", "running"):
            break
    t1 = time.perf_counter()
    if rec["state"] != "uploaded":
        raise SystemExit(f"upload {rec['state']}: {rec.get('error')}")
    client.request_json("POST", f"/v1/jobs/{JOB}/uploads/{VERSION}/commit", {"uri": uri, "shards": shards})
    t2 = time.perf_counter()
    cpu = cpu_seconds(pid) - cpu0
    client.request_json("DELETE", f"/v1/jobs/{JOB}/uploads/{VERSION}")  # forget the record: the next round anew
    client.request_json("DELETE", f"/v1/jobs/{JOB}/persistent/{VERSION}?uri={quote(uri, safe='')}")
    return {"upload_s": t1 - t0, "commit_s": t2 - t1, "total_s": t2 - t0, "daemon_cpu_s": cpu,
            "record_s": float(rec["seconds"]),
            "stages": rec.get("stages"), "bytes": int(rec["bytes_done"])}


def staged_case(label: str, version: list[tuple[str, Region, tuple[int, ...]]], args: argparse.Namespace, tmp: Path,
                env: dict[str, str], procs: list[subprocess.Popen]) -> dict:
    """The version uploaded ``--repeats`` times per target; with ``--baseline-code``, a second daemon running that
    code (on a copy of the node store) uploads it too, its rounds alternating with this code's (the same load)."""
    shards = [[name, region.format()] for name, region, _ in version]
    codes = {"this": ROOT, **({"baseline": args.baseline_code} if args.baseline_code else {})}
    daemons = {}
    nbytes = 0
    for code, path in codes.items():
        root = tmp / f"node-{label}-{code}"
        nbytes = fill_store(root, version)
        daemon, url = start_daemon(root, {**env, "PYTHONPATH": str(path)})
        procs.append(daemon)
        daemons[code] = (daemon, StoreClient(url, "bench", timeout=600), root)
    out: dict = {"tensors": len(version), "bytes": nbytes, "targets": {}}
    try:
        for target in args.targets:
            rounds: dict[str, list[dict]] = {code: [] for code in codes}
            for code, (daemon, client, _root) in daemons.items():
                warm = (tmp / f"persistent-{label}-{code}-warm").as_uri() if target == "file" else \
                    f"s3://{BUCKET}/{label}-{code}-warm"
                staged_round(client, warm, shards, daemon.pid)  # not timed: a daemon's first upload imports, connects
            for i in range(args.repeats):
                for code, (daemon, client, _root) in daemons.items():
                    uri = (f"s3://{BUCKET}/{label}-{code}-{i}" if target == "s3"
                           else (tmp / f"persistent-{label}-{code}-{i}").as_uri())
                    rounds[code].append(staged_round(client, uri, shards, daemon.pid))
            out["targets"][target] = {}
            for code in codes:
                rs = rounds[code]
                med = {k: statistics.median(r[k] for r in rs) for k in ("upload_s", "commit_s", "total_s", "daemon_cpu_s")}
                stages = {k: statistics.median((r["stages"] or {}).get(k, 0.0) for r in rs)
                          for k in ("check", "read", "write")} if any(r["stages"] for r in rs) else None
                entry = {"rounds": rs, "median": med, "median_stages": stages}
                if code == "this":
                    out["targets"][target].update(entry)
                else:
                    out["targets"][target]["baseline"] = entry
                print(f"{label:>19} {target:>4} {code:>8}: {len(version):5d} tensors {nbytes / MiB:7.2f} MiB  upload "
                      f"{med['upload_s']:6.3f} s  commit {med['commit_s']:6.3f} s  total {med['total_s']:6.3f} s  "
                      f"daemon CPU {med['daemon_cpu_s']:6.3f} s  stages (summed over threads) {stages}", flush=True)
    finally:
        for daemon, client, root in daemons.values():
            client.close()
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait(10)
            shutil.rmtree(root, ignore_errors=True)
    return out


def fixed_costs(results: dict, sizes: list[int], targets: list[str]) -> dict:
    """Per tensor and per version, from the two smallest sizes of the small case (see the module doc)."""
    if len(sizes) < 2:
        return {}
    n1, n2 = sorted(sizes)[:2]
    out = {}
    for target in targets:
        for code in ("this", "baseline"):
            r1, r2 = results[f"small-{n1}"]["targets"][target], results[f"small-{n2}"]["targets"][target]
            if code == "baseline":
                if "baseline" not in r1:
                    continue
                r1, r2 = r1["baseline"], r2["baseline"]
            out.setdefault(target, {})[code] = {}
            for key, what in (("total_s", "wall"), ("daemon_cpu_s", "daemon CPU")):
                t1, t2 = r1["median"][key], r2["median"][key]
                per_tensor = (t2 - t1) / (n2 - n1)
                out[target][code][what] = {"per_tensor_ms": per_tensor * 1e3, "per_version_ms": (t1 - n1 * per_tensor) * 1e3}
                print(f"fixed cost {target:>4} {code:>8} ({what}): {per_tensor * 1e3:.3f} ms per tensor, "
                      f"{(t1 - n1 * per_tensor) * 1e3:.1f} ms per version", flush=True)
    return out


# -- the job, from outside ---------------------------------------------------------------------


def job_case(args: argparse.Namespace, tmp: Path) -> dict:
    from tenplex.scheduler.cli import SchedulerClient
    from tenplex.scheduler.server import LocalScheduler

    model = {"vocab": 128, "dim": 64, "n_layers": 4, "n_heads": 4, "seq_len": 32}
    worker = [sys.executable, "-m", "examples.gpt.train", "--layers", "4", "--dim", "64", "--heads", "4",
              "--vocab", "128", "--seq-len", "32", "--samples", "4096", "--global-batch", "8"]
    uri = (tmp / "persistent-job").as_uri()
    spec = {"name": "ref", "layout": {"provider": "example-gpt", "model": model},
            "dataset": {"num_samples": 4096, "seed": 0, "global_batch_size": 8}, "command": worker, "gpus": 2,
            "max_gpus": 2, "steps": args.job_steps, "snapshot_every": 2, "heartbeat_timeout": 120,
            "env": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
            "policy": {"table": {"2": {"dp": 1, "tp": 1, "pp": 2}}},
            "checkpoint": {"uri": uri, "interval_steps": 4, "keep_last": 1000}}
    seen: dict[tuple[str, float], dict] = {}
    with LocalScheduler(tmp / "sched", hosts=2, gpus_per_host=1, heartbeat_interval=0.3) as sched:
        client = SchedulerClient(sched.url, timeout=300)  # a loaded shared machine answers slowly
        client.create(spec)
        done_at = None
        while True:
            st = client.job("ref")["status"]
            p = st.get("persist") or {}
            if p.get("version") and p.get("started_at"):
                seen[(p["version"], p["started_at"])] = p
            if st["phase"] in ("Succeeded", "Failed"):
                done_at = done_at or time.monotonic()
                if not p.get("queued") and p.get("state") in ("committed", "abandoned", None) or \
                        time.monotonic() - done_at > 30:
                    break
            time.sleep(0.05)
    uploads = [{"version": v, "seconds": p["finished_at"] - p["started_at"], "started_step": p.get("started_step"),
                "finished_step": p.get("finished_step")}
               for (v, _), p in sorted(seen.items(), key=lambda kv: kv[0][1])
               if p.get("state") == "committed" and p.get("finished_at")]
    secs = [u["seconds"] for u in uploads]
    out = {"phase": st["phase"], "steps": args.job_steps, "persisted": st["persisted"], "uploads": uploads,
           "skipped": (st.get("persist") or {}).get("skipped"),
           "median_s": statistics.median(secs) if secs else None, "max_s": max(secs) if secs else None}
    print(f"job: {st['phase']} after {args.job_steps} steps; {len(uploads)} versions persisted "
          f"({', '.join(u['version'] for u in uploads)}), persist.started_at -> finished_at median "
          f"{out['median_s'] or 0:.3f} s, max {out['max_s'] or 0:.3f} s; skipped: {out['skipped']}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["bandwidth", "small", "gpt"],
                    choices=["bandwidth", "small", "gpt", "job"])
    ap.add_argument("--targets", nargs="+", default=["file", "s3"], choices=["file", "s3"])
    ap.add_argument("--tensors", type=int, nargs="+", default=[250, 1000], help="sizes of the small case")
    ap.add_argument("--gpt", nargs="+", default=["ref-dp1-pp2", "gpt8x1024-tp2pp2dp2"],
                    choices=["ref-dp1-pp2", "gpt8x1024-tp2pp2dp2"])
    ap.add_argument("--mib", type=int, default=256, help="bandwidth case: bytes of the version, in MiB")
    ap.add_argument("--shards", type=int, default=8, help="bandwidth case: shards")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--job-steps", type=int, default=40)
    ap.add_argument("--baseline-code", type=Path, default=None,
                    help="small and gpt cases: a checkout of other code (e.g. the previous commit, exported) whose "
                         "daemon uploads the same versions, rounds alternating")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tenplex-persist-bench-"))
    procs: list[subprocess.Popen] = []
    results: dict = {"load_before": os.getloadavg()}
    try:
        env = {**os.environ, "TENPLEX_TOKEN": "bench", "PYTHONPATH": str(ROOT)}
        endpoint = None
        if "bandwidth" in args.cases or ("s3" in args.targets and {"small", "gpt"} & set(args.cases)):
            moto, endpoint = start_moto()
            procs.append(moto)
            import boto3

            boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                         region_name=REGION).create_bucket(Bucket=BUCKET)
            env.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                        "AWS_REGION": REGION})
        if "bandwidth" in args.cases:
            assert endpoint is not None
            results["bandwidth"] = bandwidth_case(args, tmp, endpoint, env, procs)
        if "small" in args.cases:
            for n in args.tensors:
                results[f"small-{n}"] = staged_case(f"small-{n}", small_version(n), args, tmp, env, procs)
            results["fixed_costs"] = fixed_costs(results, args.tensors, args.targets)
        if "gpt" in args.cases:
            for name in args.gpt:
                results[name] = staged_case(name, gpt_version(name), args, tmp, env, procs)
        if "job" in args.cases:
            results["job"] = job_case(args, tmp)
        results["load_after"] = os.getloadavg()
        print(f"load average before {results['load_before']}, after {results['load_after']}", flush=True)
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=2))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
