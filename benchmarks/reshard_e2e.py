"""Resharding a ~1 GB GPT state: Tenplex (node-local stores + transformer) vs PyTorch DCP save + load.

State: a Megatron-style GPT in fp32 with Adam moments (param, optim/exp_avg, optim/exp_avg_sq),
laid out (dp2, tp2) on hosts h0, h1 (2 GPUs each). Two reconfigurations to (dp1, tp2, pp2):
  move:    onto h2, h3 (every byte crosses the network);
  failure: h1 fails; onto h0 (survivor) and h2.

Tenplex: four `tenplex store serve` daemons (one per emulated host, 127.0.0.2..5); the old state
is written into h0/h1's stores as the workers' snapshot would (timed separately); then timed end to
end: plan + every target host's transform, each in its own already started process like a node's
(pull, verify, write the new version, commit; a shard a survivor keeps is verified and linked).
The store writes past the page cache, so the old state is read cold: before every run its files
are evicted from the page cache (earlier runs read them in). DCP's load reads what its save just
wrote through the page cache, as it does in its own save-then-load flow.
DCP: 4 gloo processes hold the old layout as DTensors and call torch.distributed.checkpoint.save;
4 fresh gloo processes hold empty DTensors of the new layout and call dcp.load, which reshards.
Timed: save (between barriers) + load (between barriers).
Also timed, per scenario: the disk alone moving the same bytes a transform moves (cold reads
with sendfile, O_DIRECT writes; see disk_floor): all four emulated hosts share this machine's one
disk, so that is the floor under Tenplex's time here (DCP's load reads from the page cache). Bytes read by DCP are the stored chunk
bytes its FileSystemReader reads (it reads whole saved chunks); Tenplex's are the piece bytes read
from the stores (local + remote; a linked shard counts as read: its checksum is verified). Both results are checked element by element against the data.

Run: .venv/bin/python benchmarks/reshard_e2e.py [--layers 8 --hidden 896 --heads 14 --vocab 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tenplex.ptc import PTC, ParallelConfig, Region
from tenplex.ptc.megatron import GPTSpec, megatron_gpt_ptc
from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore
from tenplex.transformer.execute import execute_host_plan
from tenplex.transformer.plan import make_plan

ADDRESSES = {"h0": "127.0.0.2", "h1": "127.0.0.3", "h2": "127.0.0.4", "h3": "127.0.0.5"}
OLD_V = "s100-g0"


# -- data: each old shard's values come from a generator seeded by (tensor, region) -------------


def shard_data(name: str, region: Region) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(f"{name}@{region.format()}".encode()))
    return rng.random(region.shape, dtype=np.float32)


def expected(old: PTC, name: str, region: Region) -> np.ndarray:
    """A region's values, assembled from the old shards that overlap it."""
    out = np.empty(region.shape, np.float32)
    for owner in old.owners(name, region):
        out[owner.piece.relative_to(region).slices()] = shard_data(name, owner.shard.region)[
            owner.piece.relative_to(owner.shard.region).slices()
        ]
    return out


# -- Tenplex ------------------------------------------------------------------------------------


def start_stores(root: Path) -> tuple[dict[str, subprocess.Popen], dict[str, str]]:
    procs, urls = {}, {}
    for host, addr in ADDRESSES.items():
        port_file = root / f"{host}.port"
        procs[host] = subprocess.Popen(
            [sys.executable, "-m", "tenplex", "--log-level", "WARNING", "store", "serve", "--root", str(root / host),
             "--host", addr, "--port", "0", "--port-file", str(port_file)],
            stdout=subprocess.DEVNULL,
        )
    deadline = time.monotonic() + 60
    for host, addr in ADDRESSES.items():
        port_file = root / f"{host}.port"
        while not port_file.exists():
            if time.monotonic() > deadline or procs[host].poll() is not None:
                raise RuntimeError(f"store daemon of {host} did not start")
            time.sleep(0.05)
        urls[host] = f"http://{addr}:{int(port_file.read_text())}"
    return procs, urls


def snapshot(old: PTC, clients: dict[str, StoreClient], job: str) -> float:
    """Write each old host's shards into its store and commit (what the workers' snapshot does)."""
    start = time.perf_counter()

    def one(host: str) -> None:
        def put(entry) -> None:  # type: ignore[no-untyped-def]
            t, s = entry
            clients[host].write_shard(job, OLD_V, t.name, s.region, shard_data(t.name, s.region),
                                      dtype=t.dtype, global_shape=t.shape)

        with ThreadPoolExecutor(4) as pool:  # overlaps the per-shard file creation and fsync waits
            list(pool.map(put, old.shards_on_host(host)))
        clients[host].commit(job, OLD_V)

    threads = [threading.Thread(target=one, args=(h,)) for h in old.hosts]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - start


def _host_worker(host: str, root: str, urls: dict[str, str], alive: set[str] | None, tasks, results) -> None:  # type: ignore[no-untyped-def]
    """One target node's transformer, started before the clock like DCP's processes; runs the plan it is sent.

    It works on its node's store directly (a LocalStore target: local pieces and the new version on its own
    disk, as a node-side executor does) and pulls remote pieces from the other daemons over HTTP.
    """
    target = LocalStore(root)
    while True:
        plan = tasks.get()
        if plan is None:
            break
        # Fresh clients per run: idle keep-alive connections are closed by the daemons after 30 s.
        sources = {h: StoreClient(u, max_connections=8) for h, u in urls.items() if h != host and (alive is None or h in alive)}
        try:
            report = execute_host_plan(plan, host, target=target, sources=sources, concurrency=4)
            results.put((host, report.to_json(), None))
        except Exception as exc:  # sent to the parent, which raises it
            results.put((host, None, repr(exc)))
        finally:
            for c in sources.values():
                c.close()


class Nodes:
    """A transformer process per emulated node (spawned once, reused for every run)."""

    def __init__(self, hosts: list[str], work: Path, urls: dict[str, str], alive: set[str] | None) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = {h: ctx.Queue() for h in hosts}
        self.procs = [
            ctx.Process(target=_host_worker, args=(h, str(work / h), urls, alive, self.tasks[h], self.results), daemon=True)
            for h in hosts
        ]
        for p in self.procs:
            p.start()

    def run(self, plan) -> dict[str, dict]:  # type: ignore[no-untyped-def]
        for h in plan.hosts:
            self.tasks[h].put(plan)
        out, errors = {}, []
        for _ in plan.hosts:
            host, report, error = self.results.get(timeout=600)
            if error is not None:
                errors.append(f"{host}: {error}")
            out[host] = report
        if errors:
            raise RuntimeError("; ".join(errors))
        return out

    def close(self) -> None:
        for q in self.tasks.values():
            q.put(None)
        for p in self.procs:
            p.join(10)


def evict_old_version(work: Path, old: PTC, job: str) -> int:
    """Drop the old version's files from the page cache; the bytes dropped.

    The store writes chunk files past the page cache (O_DIRECT), so after a
    snapshot its state is on disk, not in memory: a transform reads it cold.
    Earlier runs of the same scenario read it into the cache; evicting it
    before every run keeps each run as cold as the first.
    """
    dropped = 0
    for host in old.hosts:
        for dirpath, _dirs, files in os.walk(work / host / job / OLD_V):
            for name in files:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    dropped += os.fstat(fd).st_size
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return dropped


def tenplex_run(old: PTC, new: PTC, nodes: Nodes, urls: dict[str, str], job: str,
                alive: set[str] | None, new_version: str, work: Path, *, warm: bool = False) -> dict:
    if not warm:
        evict_old_version(work, old, job)
    start = time.perf_counter()
    plan = make_plan(old, new, job=job, old_version=OLD_V, new_version=new_version, alive=alive)
    plan_s = time.perf_counter() - start
    reports = nodes.run(plan)
    total = time.perf_counter() - start
    # Check every new shard against the data.
    for host in new.hosts:
        with StoreClient(urls[host]) as client:
            for t, s in new.shards_on_host(host):
                got = client.read(job, new_version, t.name, s.region, t.dtype)
                if not np.array_equal(got, expected(old, t.name, s.region)):
                    raise AssertionError(f"tenplex: {host} {t.name} {s.region} differs")
    return {
        "seconds": total,
        "plan_seconds": plan_s,
        "bytes_read": sum(r["bytes_local"] + r["bytes_remote"] for r in reports.values()),
        "bytes_linked": sum(r["bytes_linked"] for r in reports.values()),
        "bytes_stored": sum(d.nbytes for h in plan.hosts for d in plan.host(h).shards),
        "network_bytes": plan.network_bytes,
        "lower_bound_bytes": plan.lower_bound_bytes,
        "local_bytes": plan.local_bytes,
    }


# -- the disk's own floor ------------------------------------------------------------------------


def disk_floor(work: Path, read_bytes: int, write_bytes: int, file_bytes: int = 4 << 20) -> dict[str, float]:
    """Seconds this machine's disk takes for a transform's raw I/O, with no store, HTTP or Python around it.

    Every emulated host shares the one disk here, so a transform that reads
    the old state cold and writes the new one durably can go no faster than
    the disk moves those bytes: ``read_bytes`` read cold with ``sendfile``
    (as the daemons send) and ``write_bytes`` written with ``O_DIRECT`` (as
    the store writes chunk files), in files of ``file_bytes``, four threads
    each; alone and both at once (as in a transform).
    """
    import mmap

    root = work / "disk-floor"
    root.mkdir(exist_ok=True)
    block = mmap.mmap(-1, file_bytes)  # page-aligned, as O_DIRECT needs
    block.write(np.random.default_rng(0).bytes(file_bytes))
    sources = [root / f"src-{i}" for i in range(-(-read_bytes // file_bytes))]
    for path in sources:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(fd, block, 0)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    sink = os.open(os.devnull, os.O_WRONLY)
    direct = getattr(os, "O_DIRECT", 0)

    def read_one(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        offset = 0
        while offset < file_bytes:
            offset += os.sendfile(sink, fd, offset, file_bytes - offset)
        os.close(fd)

    def write_one(i: int) -> None:
        fd = os.open(root / f"dst-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
        os.pwrite(fd, block, 0)
        os.close(fd)

    def timed(read: bool, write: bool) -> float:
        for path in sources:  # cold again
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        os.sync()
        start = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            jobs = [pool.submit(read_one, p) for p in sources] if read else []
            jobs += [pool.submit(write_one, i) for i in range(-(-write_bytes // file_bytes))] if write else []
            for j in jobs:
                j.result()
        if write:
            os.sync()  # O_DIRECT data is on disk; this flushes the new files' metadata, as a commit does
        return time.perf_counter() - start

    try:
        return {"read": timed(True, False), "write": timed(False, True), "both": timed(True, True)}
    finally:
        os.close(sink)
        shutil.rmtree(root, ignore_errors=True)


# -- DCP ----------------------------------------------------------------------------------------


def _dcp_worker(rank: int, world: int, mode: str, ptc_file: str, old_file: str, ckpt: str, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    ptc = PTC.load(ptc_file)
    cfg = ptc.config
    pp, dp, tp = int(cfg["pp"]), int(cfg["dp"]), int(cfg["tp"])
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    sub = mesh["dp", "tp"]
    state = {}
    for t, s in ptc.shards_of_device(rank):
        split = [d for d, ((a, b), n) in enumerate(zip(s.region.bounds, t.shape, strict=True)) if b - a != n]
        placements = (Replicate(), Shard(split[0]) if split else Replicate())
        local = torch.from_numpy(shard_data(t.name, s.region)) if mode == "save" else torch.empty(s.region.shape)
        stride = tuple(int(np.prod(t.shape[d + 1 :])) for d in range(len(t.shape)))
        state[t.name] = DTensor.from_local(local, sub, placements, run_check=False, shape=t.shape, stride=stride)

    read_bytes = [0]

    class CountingReader(FileSystemReader):
        def read_data(self, plan, planner):  # type: ignore[no-untyped-def]
            read_bytes[0] += sum(self.storage_data[item.storage_index].length for item in plan.items)
            return super().read_data(plan, planner)

    dist.barrier()
    start = time.perf_counter()
    if mode == "save":
        dcp.save(state, checkpoint_id=ckpt)
    else:
        dcp.load(state, storage_reader=CountingReader(ckpt))
    dist.barrier()
    seconds = time.perf_counter() - start
    if mode == "load":
        old = PTC.load(old_file)
        for t, s in ptc.shards_of_device(rank):
            if not np.array_equal(state[t.name].to_local().numpy(), expected(old, t.name, s.region)):
                raise AssertionError(f"dcp: rank {rank} {t.name} {s.region} differs")
    Path(out, f"{mode}-{rank}.json").write_text(json.dumps({"seconds": seconds, "read_bytes": read_bytes[0]}))
    dist.destroy_process_group()


def dcp_run(old_file: Path, new_file: Path, work: Path) -> dict:
    import torch.multiprocessing as mp

    ckpt = work / "dcp"
    shutil.rmtree(ckpt, ignore_errors=True)
    results = {}
    for mode, ptc_file in (("save", old_file), ("load", new_file)):
        world = len(PTC.load(ptc_file).devices)
        init = f"file://{work / f'dcp-init-{mode}-{time.monotonic_ns()}'}"
        mp.spawn(_dcp_worker, args=(world, mode, str(ptc_file), str(old_file), str(ckpt), init, str(work)), nprocs=world)
        rows = [json.loads(Path(work, f"{mode}-{r}.json").read_text()) for r in range(world)]
        results[mode] = {"seconds": max(r["seconds"] for r in rows), "read_bytes": sum(r["read_bytes"] for r in rows)}
    stored = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    return {
        "seconds": results["save"]["seconds"] + results["load"]["seconds"],
        "save_seconds": results["save"]["seconds"],
        "load_seconds": results["load"]["seconds"],
        "bytes_read": results["load"]["read_bytes"],
        "checkpoint_bytes": stored,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--workdir", help="scratch directory (default: a new temporary one)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per scenario, Tenplex and DCP interleaved")
    parser.add_argument("--best", action="store_true", help="report the best run instead of the median")
    parser.add_argument("--warm", action="store_true",
                        help="leave the old state in the page cache between runs (by default it is evicted before each)")
    args = parser.parse_args()

    spec = GPTSpec(num_layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq_len=1024)
    old = megatron_gpt_ptc(spec, ParallelConfig(dp=2, tp=2), gpus_per_node=2, hosts=["h0", "h1"], precision="fp32")
    scenarios = {
        "move (dp2,tp2)@h0,h1 -> (dp1,tp2,pp2)@h2,h3": (["h2", "h3"], None),
        "failure of h1: (dp2,tp2)@h0,h1 -> (dp1,tp2,pp2)@h0,h2": (["h0", "h2"], {"h0", "h2", "h3"}),
    }
    own_work = not args.workdir
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tenplex-reshard-"))
    work.mkdir(parents=True, exist_ok=True)
    old_file = work / "old.json"
    old.save(old_file)
    print(f"machine: nproc={os.cpu_count()}; state {old.total_bytes / 1e9:.2f} GB in {len(old.tensors)} tensors "
          f"(fp32 params + Adam exp_avg/exp_avg_sq); workdir {work}", flush=True)
    procs, urls = start_stores(work)
    try:
        for i, (name, (hosts, alive)) in enumerate(scenarios.items()):
            new = megatron_gpt_ptc(spec, ParallelConfig(tp=2, pp=2), gpus_per_node=2, hosts=hosts, precision="fp32")
            new_file = work / f"new-{i}.json"
            new.save(new_file)
            job = f"gpt-{i}"
            clients = {h: StoreClient(u, max_connections=8) for h, u in urls.items()}
            snap = snapshot(old, clients, job)
            for c in clients.values():
                c.close()
            if alive is not None:
                procs["h1"].terminate()  # the failure: h1's daemon is gone
                procs["h1"].wait()
            nodes = Nodes(hosts, work, urls, alive)
            tens, dcps = [], []
            for r in range(args.repeat):  # interleaved, so that load from other users hits both alike
                tens.append(tenplex_run(old, new, nodes, urls, job, alive, f"s100-g{r + 1}", work, warm=args.warm))
                dcps.append(dcp_run(old_file, new_file, work))
                print(f"  [{name} run {r + 1}] tenplex {tens[-1]['seconds']:.2f} s, dcp {dcps[-1]['seconds']:.2f} s", flush=True)
            nodes.close()
            # what a transform moves through the disk: the pieces read (a linked shard is checked, i.e. read,
            # but not written again) and the new shards written
            floor = disk_floor(work, tens[0]["bytes_read"], tens[0]["bytes_stored"] - tens[0]["bytes_linked"])
            ten = min(tens, key=lambda x: x["seconds"]) if args.best else sorted(tens, key=lambda x: x["seconds"])[len(tens) // 2]
            dcp = min(dcps, key=lambda x: x["seconds"]) if args.best else sorted(dcps, key=lambda x: x["seconds"])[len(dcps) // 2]
            stat = "best" if args.best else "median"
            print(
                f"{name} ({stat} of {args.repeat}):\n"
                f"  tenplex: {ten['seconds']:.2f} s end to end (plan {ten['plan_seconds'] * 1e3:.0f} ms); "
                f"read {ten['bytes_read'] / 1e9:.3f} GB (network {ten['network_bytes'] / 1e9:.3f} GB = lower bound "
                f"{ten['lower_bound_bytes'] / 1e9:.3f} GB, local {ten['local_bytes'] / 1e9:.3f} GB of which "
                f"{ten['bytes_linked'] / 1e9:.3f} GB kept in place by linking); "
                f"snapshot into the stores beforehand {snap:.2f} s; all runs "
                + ", ".join(f"{x['seconds']:.2f}" for x in tens) + "\n"
                f"  dcp:     {dcp['seconds']:.2f} s (save {dcp['save_seconds']:.2f} + load {dcp['load_seconds']:.2f}); "
                f"read {dcp['bytes_read'] / 1e9:.3f} GB; checkpoint {dcp['checkpoint_bytes'] / 1e9:.3f} GB; all runs "
                + ", ".join(f"{x['seconds']:.2f}" for x in dcps) + "\n"
                f"  speed-up {dcp['seconds'] / ten['seconds']:.2f}x; bytes read tenplex/dcp "
                f"{ten['bytes_read'] / dcp['bytes_read']:.3f}\n"
                f"  the disk alone, same bytes (cold sendfile read / O_DIRECT write / both at once): "
                f"{floor['read']:.2f} / {floor['write']:.2f} / {floor['both']:.2f} s",
                flush=True,
            )
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                p.wait()
        if own_work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
