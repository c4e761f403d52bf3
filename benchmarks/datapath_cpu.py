"""CPU cost of the data path: core-seconds per GiB moved through a pair of store daemons, split by stage.

Issue 26, item 1. Two node daemons (``tenplex store serve``, separate
processes) on this machine's loopback: the source holds a committed version of
a Megatron GPT state (fp32 with Adam moments), the target is sent a sub-plan
that pulls all of it (a layout change onto a new host: every byte crosses the
socket, is checksummed, written and committed; nothing is linked). What is
measured is CPU time, not wall-clock: ``utime + stime`` of each daemon process
(``/proc/<pid>/stat``, all its threads) and of this process (the control
plane polling the target), per GiB the plan moved. Run once per tier:

- ``disk``:   the daemons' roots on the disk (chunk files written with O_DIRECT where the file system allows);
- ``memory``: both daemons with a memory tier in ``/dev/shm`` (new versions written and served from tmpfs);
  each measurement starts once the daemons have spilled every committed version to disk (the background
  spill is not part of the data path measured).

With ``--profile DIR`` each daemon is sampled by ``py-spy`` (``record --format raw``: collapsed stacks of
the threads that were running, at 250 Hz) while the transform runs; the samples are sorted into stages by the
innermost frame that names one (see :data:`STAGES`) and each process's CPU time is split in those
proportions. The collapsed profiles are kept in DIR (``<tier>-<role>.txt``) next to the numbers.

The floor, in the same run and on the same number of bytes:

- ``socket``: a bare TCP transfer over loopback between two fresh processes (the sender ``sendfile(2)``\\ s
  from a file in the page cache, the receiver ``recv_into``\\ s a page-aligned buffer), both processes' CPU;
- ``memcpy+crc32c``: one ``np.copyto`` into a page-aligned buffer and one hardware crc32c pass
  (:mod:`crc32c`, SSE4.2) over the bytes, this thread's CPU.

Run:
  .venv/bin/python benchmarks/datapath_cpu.py [--tiers disk memory] [--profile benchmarks/profiles] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import crc32c
import numpy as np

from tenplex.core.buffers import aligned_empty
from tenplex.ptc import ParallelConfig, Region
from tenplex.ptc.megatron import GPTSpec, megatron_gpt_ptc
from tenplex.sockets import free_port
from tenplex.store.client import StoreClient
from tenplex.testing.processes import stop_processes
from tenplex.transformer.plan import make_plan
from tenplex.transformer.remote import PlanRun

log = logging.getLogger("datapath_cpu")
REPO = Path(os.environ.get("DATAPATH_CODE") or Path(__file__).resolve().parent.parent)
"""The checkout whose ``tenplex`` the daemons run (``--code``: compare two versions of the data path)."""
TOKEN = "datapath-bench"
DAEMON_ARGS: list[str] = []
"""Extra ``tenplex store serve`` options for both daemons (``--daemon-args``)."""
OLD_V, NEW_V, NEW_V2 = "s1-g0", "s1-g1", "s1-g2"
GIB = 1 << 30
TICK = os.sysconf("SC_CLK_TCK")

STAGES: list[tuple[str, tuple[str, ...]]] = [
    # (stage, substrings of a frame "function (file)"), first match from the innermost frame outwards
    ("checksum", ("crc32c", "crc_of", "damage (", "checksum_runs", "recorded_checksum")),
    ("socket receive", ("readinto", "recv_into", "_readinto", "_receive")),
    ("socket send", ("sendfile", "_send_runs", "sendall", "SendfileProtocol", "_sendfile")),
    ("write or link", ("_write_direct", "_write_file", "os.write", "writev", "link_shard", "link_tree",
                       "write_piece", "pwrite")),
    ("copy", ("copyto", "_copy", "memmove", "tobytes", "read (tenplex/store/reader.py)", "map_runs")),
    ("commit", ("commit", "_fsync", "syncfs", "sync_tree", "_install")),
]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


# -- the state and the daemons ------------------------------------------------------------------------------


def gpt(args: argparse.Namespace, host: str) -> Any:
    spec = GPTSpec(num_layers=args.layers, hidden=args.hidden, heads=16, vocab=args.vocab, seq_len=2048)
    return megatron_gpt_ptc(spec, ParallelConfig(tp=2), gpus_per_node=2, hosts=[host], precision="fp32")


def shard_data(name: str, region: Region) -> np.ndarray:
    seed = sum(name.encode()) % 997
    return (np.arange(region.volume, dtype=np.float32) + seed).reshape(region.shape)


@contextmanager
def daemon(root: Path, tier: str, work: Path, name: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    cmd = [sys.executable, "-m", "tenplex", "--log-level", "WARNING", "store", "serve", "--root", str(root),
           "--port", str(port), "--token", TOKEN, *DAEMON_ARGS]
    if tier == "memory":
        mem = Path("/dev/shm") / f"tenplex-bench-{os.getpid()}-{name}"
        mem.mkdir(parents=True, exist_ok=True)
        cmd += ["--memory-root", str(mem), "--memory-bytes", "6Gi"]
    logf = open(work / f"{name}.log", "ab")  # noqa: SIM115 - the child's
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    logf.close()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        with StoreClient(url, TOKEN, timeout=2) as c:
            while not c.health():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"daemon {name} did not start: {(work / f'{name}.log').read_text()[-2000:]}")
                time.sleep(0.1)
        yield proc, url
    finally:
        stop_processes([proc])
        if tier == "memory":
            subprocess.run(["rm", "-rf", str(mem)], check=False)


@contextmanager
def profiled(pid: int, out: Path | None, rate: int, perf: bool = False, gil: bool = False) -> Iterator[None]:
    """py-spy (and with ``perf``, ``perf record -g``: kernel stacks too) on ``pid`` while the block runs.

    ``gil``: py-spy samples only the thread holding the GIL (Python's own CPU; without it a thread blocked
    in a system call, e.g. an ``O_DIRECT`` write waiting for the disk, is sampled as busy)."""
    if out is None:
        yield
        return
    procs = [subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--rate",
                               str(rate), "--format", "raw", "--output", str(out), "--nonblocking", *(["--gil"] if gil else [])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    if perf:
        procs.append(subprocess.Popen(["perf", "record", "-g", "-F", "499", "-p", str(pid), "-o", str(out.with_suffix(".perf"))],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # attached
    try:
        yield
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
            p.wait(60)
        compact_profile(out)
        if perf:
            data = out.with_suffix(".perf")
            with open(out.with_suffix(".perf.txt"), "w") as f:
                subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "sym",
                                "--percent-limit", "0.7", "-g", "none"], stdout=f, stderr=subprocess.DEVNULL, check=False)
            script = subprocess.run(["perf", "script", "-i", str(data), "-F", "period,ip,sym"], capture_output=True,
                                    text=True, check=False).stdout
            out.with_suffix(".stages.json").write_text(json.dumps(perf_stages(script), indent=1))
            data.unlink(missing_ok=True)


def compact_profile(path: Path, keep: float = 0.0005) -> None:
    """Shrink a py-spy raw profile to keep next to the numbers: frames without line numbers, equal stacks
    merged, stacks under ``keep`` of the samples dropped (their count on a last line)."""
    if not path.exists():
        return
    counts: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack:
            frames = [f.split(":")[0] + (")" if "(" in f and ":" in f else "") for f in stack.split(";")]
            counts[";".join(frames)] += int(n)
    total = sum(counts.values())
    kept = [(st, n) for st, n in counts.most_common() if n >= keep * total]
    dropped = total - sum(n for _st, n in kept)
    path.write_text("".join(f"{st} {n}\n" for st, n in kept) + (f"(stacks under {keep:.2%} of the samples) {dropped}\n"
                                                                   if dropped else ""))


PERF_STAGES: list[tuple[str, tuple[str, ...]]] = [
    # (stage, kernel or native symbols), first match from the innermost frame outwards
    ("checksum", ("crc32c",)),
    ("page zeroing (fresh memory)", ("clear_page", "folio_zero_user")),
    ("socket receive", ("tcp_recvmsg", "sock_recvmsg", "__sys_recvfrom")),
    ("socket send", ("tcp_sendmsg", "do_sendfile", "tcp_write_xmit", "splice", "sock_sendmsg", "__sys_sendto")),
    ("write or link", ("iomap_dio", "ext4_file_write_iter", "shmem_file_write_iter", "generic_perform_write",
                       "vfs_write", "do_writev", "ksys_write", "do_linkat", "ext4_da_write", "copy_folio_from_iter")),
    ("commit", ("fsync", "syncfs", "sync_fs", "do_renameat", "file_write_and_wait")),
    ("file metadata (open, mkdir, stat, unlink)", ("do_sys_open", "do_filp_open", "do_mkdirat", "vfs_statx",
                                                   "do_unlinkat", "path_lookupat", "__x64_sys_close", "do_sys_openat")),
    ("page-cache reads", ("filemap_read", "do_mmap", "filemap_fault", "page_cache_ra")),
    ("copy", ("__memmove", "memcpy", "_copy_to_user")),
    ("scheduling, futex (thread hand-offs)", ("futex", "schedule", "finish_task_switch")),
    ("python and other user space", ("_PyEval", "python", "Py", "[unknown]")),
]


def perf_stages(script: str) -> dict[str, float]:
    """Share of CPU samples per stage, from ``perf script`` output with call chains (kernel and native frames).

    Why perf and not the py-spy samples for the split: py-spy sees Python frames only and takes a thread
    blocked in a disk write (state D) or runnable but waiting for a core as busy; perf samples what ran.
    """
    counts: collections.Counter[str] = collections.Counter()
    frames: list[str] = []

    def flush() -> None:
        if not frames:
            return
        stage = "other kernel"
        for frame in frames:  # innermost first
            hit = next((s for s, keys in PERF_STAGES if any(k in frame for k in keys)), None)
            if hit is not None:
                stage = hit
                break
        counts[stage] += 1
        frames.clear()

    for line in script.splitlines():
        if not line.strip():
            flush()
        elif line.startswith((" ", "\t")):
            frames.append(line.strip())
        else:
            flush()
    flush()
    total = sum(counts.values()) or 1
    return {s: round(n / total, 4) for s, n in counts.most_common()}


def stages_of(profile: Path) -> dict[str, float]:
    """Share of the samples per stage, from a py-spy raw (collapsed) profile."""
    counts: collections.Counter[str] = collections.Counter()
    if not profile.exists():
        return {}
    for line in profile.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        stage = "bookkeeping"
        for frame in reversed(frames):
            hit = next((s for s, keys in STAGES if any(k in frame for k in keys)), None)
            if hit is not None:
                stage = hit
                break
        counts[stage] += int(n)
    total = sum(counts.values()) or 1
    return {s: counts[s] / total for s in [*(s for s, _ in STAGES), "bookkeeping"] if counts[s]}


def run_tier(args: argparse.Namespace, tier: str, work: Path) -> dict[str, Any]:
    old, new = gpt(args, "src"), gpt(args, "dst")
    job = "bench"
    moved = make_plan(old, new, job=job, old_version=OLD_V, new_version=NEW_V, alive={"src", "dst"}).network_bytes
    base = Path(tempfile.mkdtemp(prefix=f"datapath-{tier}-", dir=args.dir))
    with daemon(base / "src", tier, work, f"{tier}-src") as (src, src_url), \
            daemon(base / "dst", tier, work, f"{tier}-dst") as (dst, dst_url):
        with StoreClient(src_url, TOKEN) as c:  # the old version, as a snapshot leaves it
            for tensor, shard in old.shards_on_host("src"):
                c.write_shard(job, OLD_V, tensor.name, shard.region, shard_data(tensor.name, shard.region),
                              dtype=tensor.dtype, global_shape=tensor.shape)
            c.commit(job, OLD_V)
        time.sleep(1.0)  # the daemons settle (preloads, spill polls)

        def spilled() -> None:
            """Until every committed version on both daemons is on disk (the memory tier's spill has run)."""
            deadline = time.monotonic() + 300
            for url in (src_url, dst_url):
                with StoreClient(url, TOKEN) as c:
                    while job in c.jobs() and not all(v.durable for v in c.versions(job) if v.committed):
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{url} did not spill its versions in 300 s")
                        time.sleep(0.2)

        prof = Path(args.profile) if args.profile else None
        runs = []
        fresh: list[int] = []  # bytes of the target's buffers that were fresh memory, per transform
        # cold (the daemon's first transform: fresh buffers, but for the resident ones of --transform-resident),
        # then warm (the daemon's pool)
        for i, version in enumerate((NEW_V, NEW_V2)):
            plan = make_plan(old, new, job=job, old_version=OLD_V, new_version=version, alive={"src", "dst"})
            clients: dict[str, StoreClient] = {}

            def client_for(url: str, clients: dict[str, StoreClient] = clients) -> StoreClient:
                if url not in clients:
                    clients[url] = StoreClient(url, TOKEN, timeout=120)
                return clients[url]

            spilled()
            spy = prof if prof is not None and i == (0 if args.profile_cold else 1) else None
            with profiled(src.pid, spy / f"{tier}-src.txt" if spy else None, args.rate, args.perf, args.gil), \
                    profiled(dst.pid, spy / f"{tier}-dst.txt" if spy else None, args.rate, args.perf, args.gil):
                c0 = (cpu_seconds(src.pid), cpu_seconds(dst.pid), self_cpu())
                start = time.perf_counter()
                reports = PlanRun(plan, {"src": src_url, "dst": dst_url}, token=TOKEN, client_for=client_for).wait(
                    poll_interval=0.05, timeout=600)
                wall = time.perf_counter() - start
                c1 = (cpu_seconds(src.pid), cpu_seconds(dst.pid), self_cpu())
            for c in clients.values():
                c.close()
            runs.append((wall, *(c1[k] - c0[k] for k in range(3))))
            fresh.append(reports["dst"].fresh_buffer_bytes)
            # a sample of the new shards, bit for bit
            with StoreClient(dst_url, TOKEN) as c:
                for tensor, shard in list(new.shards_on_host("dst"))[::7]:
                    got = np.empty(shard.region.shape, np.float32)
                    c.read_into(job, version, tensor.name, shard.region, got)
                    assert np.array_equal(got, shard_data(tensor.name, shard.region)), f"{tensor.name} {shard.region}"
    subprocess.run(["rm", "-rf", str(base)], check=False)
    gib = moved / GIB
    out: dict[str, Any] = {"tier": tier, "moved_bytes": moved}
    for label, (wall, send, recv, ctl), fresh_bytes in zip(("cold", "warm"), runs, fresh, strict=True):
        out[label] = {
            "wall_s": round(wall, 3), "fresh_buffer_mib": fresh_bytes >> 20, "send_core_s_per_gib": round(send / gib, 3),
            "recv_core_s_per_gib": round(recv / gib, 3), "control_core_s_per_gib": round(ctl / gib, 3),
            "end_to_end_core_s_per_gib": round((send + recv + ctl) / gib, 3),
        }
    if prof:
        label = "cold" if args.profile_cold else "warm"
        _wall, send, recv, _ctl = runs[0 if args.profile_cold else 1]
        for role, cpu in (("src", send), ("dst", recv)):
            perf = prof / f"{tier}-{role}.stages.json"
            shares = json.loads(perf.read_text()) if perf.exists() else stages_of(prof / f"{tier}-{role}.txt")
            out[label][f"{role}_stages_core_s_per_gib"] = {s: round(cpu * f / gib, 3) for s, f in shares.items()}
    return out


# -- the floor ------------------------------------------------------------------------------------------------

_RECEIVER = """
import socket, sys, mmap
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); buf = memoryview(mmap.mmap(-1, 64 << 20)); total = int(sys.argv[2]); got = 0
while got < total:
    n = c.recv_into(buf[: min(len(buf), total - got)])
    if not n: raise SystemExit("short")
    got += n
"""

_SENDER = """
import os, socket, sys
from tenplex.sockets import set_unpaced
c = socket.socket(); set_unpaced(c); c.connect(("127.0.0.1", int(sys.argv[1]))); fd = os.open(sys.argv[2], os.O_RDONLY)
size = os.fstat(fd).st_size; total = int(sys.argv[3]); sent = 0
while sent < total:
    off = sent % size
    sent += os.sendfile(c.fileno(), fd, off, min(size - off, total - sent))
"""


def _run_child(code: str, *argv: str) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    return p, p.pid


def _wait_cpu(p: subprocess.Popen[str]) -> float:
    _pid, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise RuntimeError(f"floor child failed with {p.returncode}")
    return ru.ru_utime + ru.ru_stime


def socket_floor(total: int, work: Path) -> dict[str, float]:
    src = work / "floor.bin"
    with open(src, "wb") as f:
        f.write(np.random.default_rng(0).bytes(256 << 20))
    with open(src, "rb") as f:  # in the page cache, as the source daemon's chunk files
        while f.read(64 << 20):
            pass
    port = free_port()
    recv, _ = _run_child(_RECEIVER, str(port), str(total))
    assert recv.stdout is not None and recv.stdout.readline().strip() == "ready"
    send, _ = _run_child(_SENDER, str(port), str(src), str(total))
    s, r = _wait_cpu(send), _wait_cpu(recv)
    src.unlink()
    gib = total / GIB
    return {"socket_send_core_s_per_gib": round(s / gib, 3), "socket_recv_core_s_per_gib": round(r / gib, 3)}


def memcpy_crc_floor(total: int) -> dict[str, float]:
    block = min(64 << 20, total)
    a = np.frombuffer(np.random.default_rng(1).bytes(block), np.uint8)
    b = aligned_empty((block,), np.uint8)
    b[...] = 0  # faulted in
    t0 = time.thread_time()
    passes = max(1, total // block)
    for _ in range(passes):
        np.copyto(b, a)
    t1 = time.thread_time()
    crc = 0
    for _ in range(passes):
        crc = crc32c.crc32c(b, crc)
    t2 = time.thread_time()
    gib = passes * block / GIB
    return {"memcpy_core_s_per_gib": round((t1 - t0) / gib, 3), "crc32c_core_s_per_gib": round((t2 - t1) / gib, 3)}


def fresh_memory_cost(nbytes: int = 256 << 20) -> dict[str, Any]:
    """What memory the process has not touched before costs here, next to the same work on memory it has.

    Not part of the floor's sum: it is the platform's price of a page's first touch. A transform whose
    destination buffers are fresh (a daemon's first, ``cold``), and a memory-tier write into new tmpfs
    pages, pay it per byte. On a VM whose balloon device reports freed guest pages to the host
    (``virtio_balloon`` feature bit 5, ``VIRTIO_BALLOON_F_REPORTING``; ``page_reporting_order`` sets the
    block size), a freed and reused guest page is backed anew by the host at its first touch, which the
    guest sees as time in whatever instruction touched it (``_copy_to_iter`` of a socket receive,
    ``clear_page_erms``). Measured on the 2-core VM (which reports free pages): huge-page buffers as the
    executor's took 0.12-0.18 s/GiB to fault in and 0.3-2.2 s/GiB to copy into (varying from run to run
    with what the host has to back anew), against 0.10-0.11 s/GiB to copy into memory touched before;
    4 KiB pages took 0.4-1 s/GiB to fault in.
    """
    src = np.frombuffer(np.random.default_rng(2).bytes(nbytes), np.uint8)
    gib = nbytes / GIB
    t0 = time.thread_time()
    a = aligned_empty((nbytes,), np.uint8)
    a[::4096] = 1  # one write per page: the fault (and the kernel's zeroing) of each
    t1 = time.thread_time()
    b = aligned_empty((nbytes,), np.uint8)
    np.copyto(b, src)  # the copy faults the pages in as it goes, as a socket receive into a fresh buffer does
    t2 = time.thread_time()
    np.copyto(b, src)  # the same copy into the same, now touched, memory
    t3 = time.thread_time()
    del a, b
    reporting = None
    for dev in Path("/sys/bus/virtio/devices").glob("*"):
        try:
            if (dev / "device").read_text().strip() == "0x0005":  # a balloon device
                features = (dev / "features").read_text().strip()
                reporting = len(features) > 5 and features[5] == "1"
        except OSError:
            continue
    return {"fault_in_core_s_per_gib": round((t1 - t0) / gib, 3), "copy_into_fresh_core_s_per_gib": round((t2 - t1) / gib, 3),
            "copy_into_touched_core_s_per_gib": round((t3 - t2) / gib, 3), "vm_free_page_reporting": reporting}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiers", nargs="+", default=["disk", "memory"], choices=["disk", "memory"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dir", default=None, help="where the disk-tier roots go (default: the system's temp dir)")
    ap.add_argument("--profile", default=None, metavar="DIR", help="py-spy profiles of both daemons into DIR")
    ap.add_argument("--perf", action="store_true", help="with --profile: perf record -g too (kernel symbols), "
                    "summarised into <tier>-<role>.perf.txt")
    ap.add_argument("--gil", action="store_true", help="with --profile: py-spy samples only the thread holding "
                    "the GIL (where the Python CPU goes)")
    ap.add_argument("--profile-cold", action="store_true", help="with --profile: profile the cold transform (the "
                    "daemons' first, as in cluster_reshard) instead of the warm one")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--code", default=None, metavar="DIR",
                    help="run the daemons from this checkout (default: this one), e.g. the main branch for a baseline")
    ap.add_argument("--daemon-args", default="", metavar="ARGS",
                    help="extra 'tenplex store serve' options for both daemons, e.g. '--transform-concurrency 4'")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.code:
        global REPO
        REPO = Path(args.code).resolve()
    DAEMON_ARGS[:] = args.daemon_args.split()
    logging.basicConfig(level=logging.WARNING)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="datapath-bench-") as tmp:
        work = Path(tmp)
        tiers = [run_tier(args, tier, work) for tier in args.tiers]
        moved = tiers[0]["moved_bytes"]
        floor = {**socket_floor(moved, work), **memcpy_crc_floor(moved)}
    floor["end_to_end_core_s_per_gib"] = round(sum(floor.values()), 3)
    results.update(tiers=tiers, floor=floor, fresh_memory=fresh_memory_cost(), load_after=os.getloadavg())
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
