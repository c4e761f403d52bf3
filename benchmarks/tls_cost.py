"""What TLS costs the data path: core-seconds per GiB moved through a pair of node daemons, TLS off vs on.

Issue 30, item 2. Two pairs of node daemons (``tenplex store serve``, each in its own process, on 127.0.0.1): one
pair plain HTTP, one pair HTTPS (a throwaway CA, :mod:`tenplex.testing.tls`; the target daemon verifies the
source against it). Each source holds a committed version of ``--mib`` MiB of float32 tensors (64 MiB each); a
transform makes the target daemon pull all of it from the source (range reads, crc32c verified, written to its
disk, committed), as a reconfiguration does. The cost is the CPU time (user + system, all threads) both daemon
processes spend from the submission until the commit, per GiB moved; the benchmark process only submits and
polls. Rounds alternate plain and TLS (the machine is shared and its load drifts); the median of each is
reported, with their ratio and the extra core-seconds per GiB TLS adds.

Why TLS costs what it does here: a plain daemon hands chunk files to the socket with ``sendfile(2)`` (no copy
through the process); under TLS the bytes must be encrypted in the process, so ``sendfile`` is off
(:func:`tenplex.serving.uvicorn_config`) and each byte is read, encrypted (AES-GCM, AES-NI) and copied by the
source, and decrypted and copied by the target. Python 3.11's ``ssl`` module cannot switch on kernel TLS
(``ssl.OP_ENABLE_KTLS`` arrived in 3.12; this run prints whether the interpreter has it) and uvloop's TLS
transport encrypts through a memory BIO in user space anyway, so ``sendfile`` under kTLS is out of reach here.

Usage: .venv/bin/python benchmarks/tls_cost.py [--mib 512] [--repeats 3] [--dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tenplex.ptc import PTC, DatasetState, Device, Region, Shard, Tensor  # noqa: E402
from tenplex.ptc.model import TensorKind  # noqa: E402
from tenplex.store.client import StoreClient  # noqa: E402
from tenplex.store.local import LocalStore  # noqa: E402
from tenplex.testing.tls import make_certificates  # noqa: E402
from tenplex.transformer.plan import make_plan  # noqa: E402
from tenplex.transformer.remote import PlanRun  # noqa: E402

TOKEN = "tls-bench"
JOB = "bench"
OLD_V = "s1-g0"
ROWS = COLS = 4096  # float32: 64 MiB a tensor
GiB = 1 << 30


def layout(host: str, tensors: int) -> PTC:
    shape = (ROWS, COLS)
    return PTC({"bench": True}, (Device(0, host),),
               tuple(Tensor(f"w{i}", shape, "float32", TensorKind.PARAM, (Shard(Region.full(shape), (0,)),))
                     for i in range(tensors)),
               DatasetState(num_samples=8, seed=0, global_batch_size=8))


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all its threads (``/proc/PID/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Daemon:
    def __init__(self, root: Path, env: dict[str, str], tls_args: list[str]) -> None:
        port_file = root.parent / f"{root.name}.port"
        port_file.unlink(missing_ok=True)
        self.log = open(root.parent / f"{root.name}.log", "ab")  # noqa: SIM115 - the child's log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tenplex", "store", "serve", "--root", str(root), "--host", "127.0.0.1",
             "--port", "0", "--port-file", str(port_file), "--token", TOKEN, *tls_args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"daemon {root} did not start; see {self.log.name}")
            time.sleep(0.05)
        scheme = "https" if tls_args else "http"
        self.url = f"{scheme}://127.0.0.1:{int(port_file.read_text())}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def start_pair(base: Path, name: str, tensors: int, data: np.ndarray, tls: dict[str, str] | None) -> dict[str, Daemon]:
    src_root = base / f"{name}-src"
    store = LocalStore(src_root)
    old = layout("src", tensors)
    for t in old.tensors:
        store.write_shard(JOB, OLD_V, t.name, Region.full(t.shape), data, dtype="float32", global_shape=t.shape)
    store.commit(JOB, OLD_V)
    store.close()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TENPLEX_TOKEN": ""}
    tls_args: list[str] = []
    if tls is not None:
        env["TENPLEX_TLS_CA"] = tls["ca"]
        tls_args = ["--tls-cert", tls["cert"], "--tls-key", tls["key"]]
    return {"src": Daemon(src_root, env, tls_args), "dst": Daemon(base / f"{name}-dst", env, tls_args)}


def run_round(pair: dict[str, Daemon], tensors: int, generation: int) -> tuple[float, float]:
    """One transform of everything from src to dst: (core-seconds of both daemons, wall seconds)."""
    plan = make_plan(layout("src", tensors), layout("dst", tensors), job=JOB, old_version=OLD_V,
                     new_version=f"s1-g{generation}")
    stores = {h: d.url for h, d in pair.items()}
    clients: dict[str, StoreClient] = {}

    def client_for(url: str) -> StoreClient:
        return clients.setdefault(url, StoreClient(url, TOKEN, timeout=120))

    pids = [d.proc.pid for d in pair.values()]
    before, start = sum(cpu_seconds(p) for p in pids), time.perf_counter()
    reports = PlanRun(plan, stores, token=TOKEN, client_for=client_for).wait(poll_interval=0.02, timeout=900)
    wall, cpu = time.perf_counter() - start, sum(cpu_seconds(p) for p in pids) - before
    assert reports["dst"].bytes_remote == plan.network_bytes, reports
    client_for(pair["dst"].url).delete(JOB, f"s1-g{generation}")
    for c in clients.values():
        c.close()
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="MiB moved per transform, a multiple of 64 (default 512)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of each mode (default 3)")
    ap.add_argument("--dir", type=Path, default=None, help="where the stores live (default: a temporary directory)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()
    if args.mib < 64 or args.mib % 64:
        raise SystemExit("--mib must be a positive multiple of 64")
    tensors = args.mib // 64
    os.environ.pop("TENPLEX_TLS_CA", None)
    base = Path(tempfile.mkdtemp(prefix="tenplex-tls-cost-", dir=args.dir))
    data = np.random.default_rng(0).random((ROWS, COLS), dtype=np.float32)
    certs = make_certificates(base / "certs")
    os.environ["TENPLEX_TLS_CA"] = str(certs.ca)  # the benchmark's own (control) clients of the TLS pair
    pairs = {"plain": start_pair(base, "plain", tensors, data, None),
             "tls": start_pair(base, "tls", tensors, data, {"ca": str(certs.ca), "cert": str(certs.cert),
                                                            "key": str(certs.key)})}
    load_before = os.getloadavg()
    rows: list[dict[str, object]] = []
    try:
        for r in range(args.repeats):
            for mode in ("plain", "tls"):
                cpu, wall = run_round(pairs[mode], tensors, generation=r + 1)
                gib = args.mib / 1024
                rows.append({"round": r, "mode": mode, "core_s_per_gib": cpu / gib, "wall_s": wall,
                             "gib_per_s": gib / wall})
                print(f"round {r} {mode:5s}: {cpu / gib:6.2f} core-s/GiB, {gib / wall:5.2f} GiB/s", flush=True)
    finally:
        for pair in pairs.values():
            for d in pair.values():
                d.stop()
        shutil.rmtree(base, ignore_errors=True)
    med = {m: statistics.median(float(x["core_s_per_gib"]) for x in rows if x["mode"] == m) for m in ("plain", "tls")}
    rate = {m: statistics.median(float(x["gib_per_s"]) for x in rows if x["mode"] == m) for m in ("plain", "tls")}
    summary = {
        "mib": args.mib, "repeats": args.repeats, "rounds": rows,
        "median_core_s_per_gib": med, "median_gib_per_s": rate,
        "tls_over_plain": med["tls"] / med["plain"], "tls_extra_core_s_per_gib": med["tls"] - med["plain"],
        "ktls_in_ssl_module": hasattr(ssl, "OP_ENABLE_KTLS"), "openssl": ssl.OPENSSL_VERSION,
        "python": sys.version.split()[0], "load_before": load_before, "load_after": os.getloadavg(),
    }
    print(f"median: plain {med['plain']:.2f}, TLS {med['tls']:.2f} core-s/GiB (x{summary['tls_over_plain']:.2f}, "
          f"+{summary['tls_extra_core_s_per_gib']:.2f}); {rate['plain']:.2f} vs {rate['tls']:.2f} GiB/s; "
          f"ssl.OP_ENABLE_KTLS: {summary['ktls_in_ssl_module']}; load {load_before} -> {summary['load_after']}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
