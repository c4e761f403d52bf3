"""The CUDA path on one GPU (issue 28): snapshot copy-out, restore, NCCL start-up and loss continuity.

One command on one CUDA device; one table, and JSON with ``--json``:

    .venv/bin/python benchmarks/gpu_check.py --json gpu_check.json     # ~1.3B GPT, about 18 GB of state
    .venv/bin/python benchmarks/gpu_check.py --smoke                   # the same code, tiny, on CPU (seconds)

The model is the reference GPT (``examples/gpt``) at 1.3B parameters (dim 2048,
22 layers, vocab 50304, untied), with bf16 weights and AdamW on fp32 master
weights (:class:`MasterAdamW`: master, exp_avg and exp_avg_sq in fp32), the
mixed-precision layout of large-model training: 14 bytes of state per
parameter, all of it in the PTC. Sections, in one process unless said:

- **floors**: the state's bytes through plain ``tensor.copy_(non_blocking=True)``
  between the device and one torch pinned buffer, each direction, timed by CUDA
  events: what the bus gives to the same tensors in the same run.
- **copy-out**: training steps without snapshots, then a snapshot after every
  step into the node store's memory tier (a tmpfs directory, ``--memory-dir``),
  then after every step into the store on disk (``--disk-dir``, fsynced). Per
  snapshot: the time the loop waits inside :meth:`Snapshotter.snapshot` (the
  blocking part), the time it waits for the previous snapshot's background
  write first (``join``: whether the store keeps up at one snapshot per step),
  and the copy-out bandwidth (device bytes over the side stream's GPU-timed
  copies). Targets: copy-out >= 0.8x the D2H floor; blocking part <= 3% of a
  step. One version at a time (the state is large): the previous one is
  deleted once committed, before the next snapshot (outside the timings).
- **snapshot exact**: a snapshot whose next step's optimizer runs while its
  copies may still be in flight (the fence under test); its stored checksums
  must equal the crc32c of the live state taken just before it.
- **restore**: that version restored into the live model and optimizer; the
  bandwidth against the H2D floor (target >= 0.8x); the live state's crc32c
  must then equal the stored checksums (bit-exact).
- **start-up**: a fresh process (this file with ``--child``) as a restored
  worker: ``ElasticWorker.init_process_group`` (NCCL for CUDA tensors with
  ``device_id``, gloo for CPU ones; one rank), the model built on ``meta`` and
  materialized, the restore from the memory tier, and its first step; phases as
  ``benchmarks/downtime.py`` splits a reconfiguration's
  (:func:`tenplex.scheduler.state.phase_split`), and the time to its first step.
- **continuity**: that worker's first step after the restart has the loss the
  original process had for the same step, exactly; the state after it is
  compared too (a digest; CUDA backward kernels may reduce with atomics, so a
  difference there is reported, not judged).

``--smoke`` runs every section with a tiny model on CPU (no floors, no
targets; the checks are judged): what ``tests/worker/test_cuda_paths.py``
runs. Without CUDA and without ``--smoke`` it exits 2 with a message.

Exit status: 0 when every check passed and every target was met, 1 otherwise, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.gpt.model import GPT, GPTConfig, cross_entropy_loss  # noqa: E402
from tenplex.core.version import Version  # noqa: E402
from tenplex.ptc import PTC, Device, ParallelConfig, Region, build_tensor  # noqa: E402
from tenplex.store.buffers import crc_of  # noqa: E402
from tenplex.store.local import LocalStore  # noqa: E402
from tenplex.store.model import format_checksum  # noqa: E402
from tenplex.worker.restore import restore  # noqa: E402
from tenplex.worker.snapshot import SnapshotResult, Snapshotter  # noqa: E402
from tenplex.worker.state import LocalPiece, live_pieces, materialize  # noqa: E402

log = logging.getLogger("gpu_check")
JOB = "gpucheck"
EXTRA_PREFIX = "extra/"
TARGET_COPY_OUT = 0.8
TARGET_RESTORE = 0.8
TARGET_BLOCKING = 0.03


@dataclass(frozen=True)
class Size:
    cfg: GPTConfig
    batch: int
    baseline_steps: int
    memory_steps: int
    disk_steps: int


SIZES = {
    # 16 x 1024 tokens a step: about 55 GB of the H100's memory at the peak (state, activations, logits)
    "1.3b": Size(GPTConfig(vocab=50304, dim=2048, n_layers=22, n_heads=16, seq_len=1024), 16, 3, 4, 3),
    "smoke": Size(GPTConfig(vocab=256, dim=64, n_layers=2, n_heads=4, seq_len=32), 4, 1, 2, 2),
}


class MasterAdamW(torch.optim.Optimizer):
    """AdamW on fp32 master weights of bf16 parameters (Megatron's and DeepSpeed's mixed precision).

    Per parameter the state holds ``master``, ``exp_avg`` and ``exp_avg_sq`` (fp32, the parameter's shape)
    and ``step`` (a CPU scalar, as torch's AdamW keeps it): the PTC names them all, so a snapshot carries the
    fp32 state and a restore brings the same next update. The bf16 weights are the masters rounded.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, chunk: int = 32) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self._chunk = chunk

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                st = self.state[p]
                if "master" not in st:  # the first step of a fresh job (a restore brings them)
                    st["master"] = p.detach().float()
                    st["exp_avg"] = torch.zeros_like(st["master"])
                    st["exp_avg_sq"] = torch.zeros_like(st["master"])
                    st["step"] = torch.zeros((), dtype=torch.float32)
                st["step"] += 1
            if not params:
                continue
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for i in range(0, len(params), self._chunk):  # bounded temporaries (fp32 grads, denominators)
                ps = params[i:i + self._chunk]
                sts = [self.state[p] for p in ps]
                n = float(sts[0]["step"])
                masters, m, v = [s["master"] for s in sts], [s["exp_avg"] for s in sts], [s["exp_avg_sq"] for s in sts]
                grads = [p.grad.float() for p in ps]
                torch._foreach_lerp_(m, grads, 1 - beta1)
                torch._foreach_mul_(v, beta2)
                torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
                if wd:
                    torch._foreach_mul_(masters, 1 - lr * wd)
                denom = torch._foreach_sqrt(v)
                torch._foreach_div_(denom, math.sqrt(1 - beta2 ** n))
                torch._foreach_add_(denom, eps)
                torch._foreach_addcdiv_(masters, m, denom, value=-lr / (1 - beta1 ** n))
                torch._foreach_copy_(ps, masters)


def batch_tokens(size: Size, step: int) -> torch.Tensor:
    """The batch of ``step``: the same in every process."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, size.cfg.vocab, (size.batch, size.cfg.seq_len + 1), generator=gen)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, size: Size, step: int, device: torch.device) -> float:
    tokens = batch_tokens(size, step).to(device)
    loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.item())  # the loop's usual loss log: a synchronization at the step's end


def build(size: Size, device: torch.device, *, values: bool) -> tuple[GPT, MasterAdamW]:
    if values:
        model = GPT(size.cfg, seed=0, device=device).to(torch.bfloat16)
    else:  # a restored worker: on meta, allocated without values
        model = GPT(size.cfg, seed=0, device="meta").to(torch.bfloat16)
        materialize(model, device)
    return model, MasterAdamW(model.parameters())


def single_device_ptc(pieces: list[LocalPiece]) -> PTC:
    tensors = [build_tensor(p.name, p.global_shape, p.dtype, p.kind, [(Region.full(p.global_shape), (0,))]) for p in pieces]
    return PTC(config={"dp": 1}, devices=(Device(0, "node-0"),), tensors=tuple(tensors))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def live_checksums(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """crc32c of every live tensor's bytes, read to the host the plain way (independent of the snapshot path)."""
    out = {}
    for p in live_pieces(model, opt):
        host = p.local.detach().contiguous().cpu().reshape(-1)
        out[p.name] = format_checksum(crc_of(host.view(torch.uint8).numpy()))
    return out


def stored_checksums(store: LocalStore, version: Version) -> dict[str, str]:
    return {s.tensor: s.checksum for s in store.manifest(JOB, version).shards if not s.tensor.startswith(EXTRA_PREFIX)}


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[int]]:
    """Per tensor, two wrapping int64 sums of its raw words and their squares, computed where it lives."""
    out = {}
    for p in live_pieces(model, opt):
        flat = p.local.detach().reshape(-1)
        words = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]).long()
        out[p.name] = [int(words.sum()), int((words * words).sum())]
    return out


def floors(pieces: list[LocalPiece]) -> tuple[float, float]:
    """GB/s of plain non-blocking copies of these device tensors to one pinned buffer and back (into a device
    scratch buffer, not the live tensors), timed on a stream by CUDA events."""
    largest = max(nbytes(p.local) for p in pieces)
    pinned = torch.empty(largest, dtype=torch.uint8, pin_memory=True)
    scratch = torch.empty(largest, dtype=torch.uint8, device=pieces[0].local.device)
    stream = torch.cuda.Stream()
    total = sum(nbytes(p.local) for p in pieces)
    result = []
    for direction in ("d2h", "h2d"):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            for p in pieces:
                src = p.local.detach()
                host = pinned[:nbytes(src)].view(src.dtype).view(src.shape)
                if direction == "d2h":
                    host.copy_(src, non_blocking=True)
                else:
                    scratch[:nbytes(src)].view(src.dtype).view(src.shape).copy_(host, non_blocking=True)
            end.record(stream)
        end.synchronize()
        result.append(total / (start.elapsed_time(end) / 1e3) / 1e9)
    return result[0], result[1]


def free_gb(path: Path) -> float:
    return shutil.disk_usage(path).free / 1e9


class Check:
    """Everything measured and judged, for the table and the JSON."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {"sections": {}, "checks": {}, "targets": {}, "errors": {}}

    def section(self, name: str) -> dict[str, Any]:
        return self.data["sections"].setdefault(name, {})

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.data["checks"][name] = {"ok": bool(ok), "detail": detail}

    def target(self, name: str, value: float | None, bound: float, *, at_least: bool) -> None:
        met = None if value is None else (value >= bound if at_least else value <= bound)
        self.data["targets"][name] = {"value": value, "target": (">= " if at_least else "<= ") + f"{bound:g}", "met": met}

    def run(self, name: str, fn: Callable[[], None]) -> None:
        """One section; a failure is recorded and the next section still runs (a lent GPU's minutes are few)."""
        log.info("--- %s", name)
        try:
            fn()
        except Exception as exc:
            log.error("section %s failed: %s", name, exc)
            self.data["errors"][name] = "".join(traceback.format_exception(exc))[-4000:]

    @property
    def passed(self) -> bool:
        d = self.data
        return (not d["errors"] and all(c["ok"] for c in d["checks"].values())
                and all(t["met"] is not False for t in d["targets"].values()))


def snapshot_phase(store: LocalStore, ptc: PTC, model: GPT, opt: MasterAdamW, size: Size, device: torch.device,
                   first_step: int, steps: int) -> tuple[dict[str, Any], int]:
    """Snapshot after each of ``steps`` steps into ``store``; the measurements and the last step taken."""
    results: list[SnapshotResult] = []
    snap = Snapshotter(store, JOB, ptc, 0, on_done=results.append)
    step_s, blocking, join = [], [], []
    kept: list[Version] = []
    step = first_step
    try:
        for _ in range(steps):
            step += 1
            t0 = time.perf_counter()
            train_step(model, opt, size, step, device)
            t1 = time.perf_counter()
            snap.wait()  # the previous snapshot's background write (Snapshotter.snapshot would join it itself)
            t2 = time.perf_counter()
            while kept:  # one version at a time (the state is large): the previous goes once committed
                store.delete(JOB, kept.pop(0))
            t3 = time.perf_counter()
            kept.append(snap.snapshot(step, 0, model, opt))
            t4 = time.perf_counter()
            step_s.append(t1 - t0)
            join.append(t2 - t1)
            blocking.append(t4 - t3)
            log.info("step %d: %.3f s, snapshot blocked %.4f s, joined the previous write %.3f s", step, t1 - t0,
                     t4 - t3, t2 - t1)
        snap.wait()
    finally:
        snap.close()
        for v in kept:
            store.delete(JOB, v)
    copies = [r for r in results if r.device_copy_seconds]
    return {
        "steps": len(step_s),
        "step_seconds_median": statistics.median(step_s),
        "blocking_seconds": blocking,
        # the first snapshot also makes the page-locked arena (once per process): judged on the others
        "blocking_seconds_median": statistics.median(blocking[1:] or blocking),
        "join_seconds_median": statistics.median(join),
        "write_seconds_median": statistics.median(r.write_seconds for r in results),
        "readable_seconds_median": statistics.median([r.readable_seconds for r in results if r.readable_seconds] or [0.0]),
        "device_bytes": results[-1].device_bytes if results else 0,
        "copy_out_gbps_median": statistics.median(r.device_bytes / r.device_copy_seconds / 1e9 for r in copies)
        if copies else None,
    }, step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU (or --device): the same code in seconds")
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="model size (default 1.3b; smoke with --smoke)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: CUDA when present (--smoke: CPU unless cuda is asked for)")
    ap.add_argument("--memory-dir", type=Path, default=Path("/dev/shm"), help="tmpfs for the memory tier")
    ap.add_argument("--disk-dir", type=Path, default=Path(tempfile.gettempdir()), help="the store's disk root")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default: the size's)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    if args.child is not None:
        return child(args.child)

    size_name = args.size or ("smoke" if args.smoke else "1.3b")
    size = SIZES[size_name]
    if args.batch is not None:
        if args.batch < 1:
            ap.error(f"--batch must be >= 1, got {args.batch}")
        size = dataclasses.replace(size, batch=args.batch)
    want_cuda = args.device == "cuda" or (args.device == "auto" and not args.smoke)
    if want_cuda and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): this check needs one GPU. "
              "Run it on a GPU machine, or with --smoke for the same code path, tiny, on CPU.", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if want_cuda else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    c = Check()
    c.data.update(size=size_name, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, cfg=dataclasses.asdict(size.cfg), batch=size.batch)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tenplex-gpucheck-", dir=args.disk_dir) as tmp, \
            tempfile.TemporaryDirectory(prefix="tenplex-gpucheck-", dir=args.memory_dir) as mem:
        run_parent(c, size, device, Path(tmp), Path(mem))
    c.data["seconds"] = time.perf_counter() - started
    c.data["load_average"] = os.getloadavg()[0]
    print_table(c)
    if args.json is not None:
        args.json.write_text(json.dumps(c.data, indent=1, default=str))
    return 0 if c.passed else 1


def run_parent(c: Check, size: Size, device: torch.device, tmp: Path, mem: Path) -> None:
    state: dict[str, Any] = {"step": 0}
    model, opt = build(size, device, values=True)
    live: dict[str, Any] = {"model": model, "opt": opt}  # let go before the restart (the sections read them here)
    for _ in range(2):  # the first creates the optimizer state; the second is a warm-up
        state["step"] += 1
        train_step(model, opt, size, state["step"], device)
    pieces = live_pieces(model, opt)
    ptc = single_device_ptc(pieces)
    ptc_path = tmp / "ptc.json"
    ptc.save(ptc_path)
    state_bytes = sum(nbytes(p.local) for p in pieces)
    on_device = [p for p in pieces if p.local.device.type == "cuda"]
    c.data.update(params=sum(p.numel() for p in model.parameters()), state_bytes=state_bytes,
                  tensors=len(pieces), device_tensors=len(on_device))
    log.info("model: %.2fB parameters, %.2f GB of state in %d tensors", c.data["params"] / 1e9, state_bytes / 1e9,
             len(pieces))
    budget = int(1.5 * state_bytes) + (64 << 20)  # one version at a time (see snapshot_phase)
    memory_store = LocalStore(tmp / "m", memory_root=mem / "tier", memory_bytes=budget)
    disk_store = LocalStore(tmp / "d")  # fsynced, as a node's disk root
    # the restore and the restart read the memory tier where it has room for a version, else the disk
    tier = free_gb(mem) >= 1.1 * state_bytes / 1e9
    main_store = memory_store if tier else disk_store
    c.data["restore_from"] = "memory tier" if tier else "disk"

    def do_floors() -> None:
        s = c.section("floors")
        if not on_device:
            s["skipped"] = "no device tensors"
            return
        s["d2h_gbps"], s["h2d_gbps"] = floors(on_device)

    def do_baseline() -> None:
        times = []
        for _ in range(size.baseline_steps):
            state["step"] += 1
            t0 = time.perf_counter()
            train_step(live["model"], live["opt"], size, state["step"], device)
            times.append(time.perf_counter() - t0)
        c.section("baseline")["step_seconds_median"] = statistics.median(times)

    def do_copy_out(name: str, store_of: Callable[[], LocalStore], steps: int, need_gb: float, where: Path) -> None:
        if free_gb(where) < need_gb:
            c.section(name)["skipped"] = f"{free_gb(where):.1f} GB free in {where}, {need_gb:.1f} GB needed"
            return
        s, state["step"] = snapshot_phase(store_of(), ptc, live["model"], live["opt"], size, device, state["step"], steps)
        c.section(name).update(s)
        base = c.section("baseline").get("step_seconds_median")
        floor = c.section("floors").get("d2h_gbps")
        if name == "copy_out_memory":
            c.target("copy-out / D2H floor",
                     s["copy_out_gbps_median"] / floor if floor and s["copy_out_gbps_median"] else None,
                     TARGET_COPY_OUT, at_least=True)
            c.target("blocking part / step", s["blocking_seconds_median"] / base if base and floor else None,
                     TARGET_BLOCKING, at_least=False)
        elif floor:
            c.data["sections"][name]["copy_out_vs_floor"] = (s["copy_out_gbps_median"] or 0) / floor

    def do_exact() -> None:
        """A snapshot whose copies the next optimizer step must wait for; then restore it into the live model."""
        s = c.section("exact")
        snap = Snapshotter(main_store, JOB, ptc, 0)
        try:
            state["step"] += 1
            train_step(live["model"], live["opt"], size, state["step"], device)
            before = live_checksums(live["model"], live["opt"])
            version = snap.snapshot(state["step"], 0, live["model"], live["opt"])
            state["step"] += 1
            s["next_loss"] = train_step(live["model"], live["opt"], size, state["step"], device)  # overlaps the copy-out
            s["digest_after_next"] = digest(live["model"], live["opt"])
            snap.wait()
        finally:
            snap.close()
        state["version"] = version
        stored = stored_checksums(main_store, version)
        bad = sorted(k for k in before if stored.get(k) != before[k])
        c.check("snapshot exact (copies fenced from the next step)", not bad,
                f"{len(bad)} of {len(before)} tensors differ: {bad[:3]}" if bad else f"{len(before)} tensors")
        result = restore(main_store, JOB, version, ptc, 0, live["model"], live["opt"])  # returns once copied
        s["restore_seconds"] = result.seconds
        s["restore_bytes"] = result.bytes_read
        s["restore_gbps"] = result.bytes_read / result.seconds / 1e9
        after = live_checksums(live["model"], live["opt"])
        bad = sorted(k for k in stored if after.get(k) != stored[k])
        c.check("restore bit-exact", not bad,
                f"{len(bad)} tensors differ: {bad[:3]}" if bad else f"{len(stored)} tensors")
        c.check("trainer state exact", result.exact, "")
        floor = c.section("floors").get("h2d_gbps")
        c.target("restore / H2D floor", s["restore_gbps"] / floor if floor else None, TARGET_RESTORE,
                 at_least=True)

    c.run("floors", do_floors)
    c.run("baseline", do_baseline)
    c.run("copy-out into the memory tier",
          lambda: do_copy_out("copy_out_memory", lambda: memory_store, size.memory_steps, 1.1 * state_bytes / 1e9, mem))
    c.run("copy-out onto disk",
          lambda: do_copy_out("copy_out_disk", lambda: disk_store, size.disk_steps, 1.1 * state_bytes / 1e9, tmp))
    c.run("snapshot and restore, bit-exact", do_exact)
    # The GPU to the restarted worker: what it holds now is let go.
    live.clear()
    del model, opt, pieces
    on_device.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if "version" in state:
        c.run("restart: start-up and continuity",
              lambda: do_restart(c, size, device, main_store, ptc_path, state["version"], tmp))
    memory_store.close()
    disk_store.close()


def do_restart(c: Check, size: Size, device: torch.device, store: LocalStore, ptc_path: Path, version: Version,
               tmp: Path) -> None:
    tier = store.memory
    spec = {"size": {"cfg": dataclasses.asdict(size.cfg), "batch": size.batch}, "root": str(store.root),
            "memory_root": str(tier.root) if tier is not None else None,
            "memory_bytes": tier.budget if tier is not None else None, "ptc": str(ptc_path), "version": str(version),
            "device": device.type, "out": str(tmp / "child.json")}
    spec_path = tmp / "child-spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    launch_started = time.time()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)], env=env)
    launched = time.time()
    code = proc.wait(timeout=600)
    if code != 0:
        raise RuntimeError(f"the restarted worker exited with code {code}")
    out = json.loads(Path(spec["out"]).read_text())
    from tenplex.scheduler.state import phase_split

    marks = {"launch_started": launch_started, "launched": launched, **out["marks"]}
    s = c.section("startup")
    s["backend"] = out["backend"]
    s["device_id_bound"] = out["device_id_bound"]
    s["phases"] = phase_split(marks)
    s["time_to_first_step"] = marks["first_step"] - launch_started
    s["restore_gbps"] = out["restore_bytes"] / out["restore_seconds"] / 1e9
    exact = c.section("exact")
    c.check("same loss after the restart", out["loss"] == exact["next_loss"],
            f"{out['loss']!r} vs {exact['next_loss']!r}")
    differ = sorted(k for k, v in out["digest"].items() if exact["digest_after_next"].get(k) != v)
    s["state_after_first_step_equal"] = not differ
    s["state_after_first_step_differs_in"] = differ[:10]
    if device.type == "cuda":
        c.check("NCCL bound to its device", bool(out["device_id_bound"]), out["backend"])


def child(spec_path: Path) -> int:
    """A restored worker in a fresh process: register (imports done), rendezvous, build, restore, one step."""
    imported = time.time()
    import torch.distributed as dist

    from tenplex.sockets import free_port
    from tenplex.worker.session import ElasticWorker, WorkerSetup, process_start_time

    spec = json.loads(spec_path.read_text())
    size = Size(GPTConfig(**spec["size"]["cfg"]), spec["size"]["batch"], 0, 0, 0)
    device = torch.device("cuda", 0) if spec["device"] == "cuda" else torch.device("cpu")
    store = LocalStore(spec["root"], memory_root=spec["memory_root"], memory_bytes=spec["memory_bytes"])
    setup = WorkerSetup(job=JOB, generation=1, rank=0, ptc=PTC.load(spec["ptc"]), store=spec["root"],
                        parallel=ParallelConfig(dp=1), master_port=free_port(),
                        restore_version=Version.parse(spec["version"]))
    worker = ElasticWorker(setup, store=store)
    started = process_start_time()
    if started is not None:
        worker.mark("process_started", started)
    worker.mark("registered", imported)
    worker.init_process_group()
    backend = str(dist.get_backend())
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    model, opt = build(size, device, values=False)
    worker.prepare(model, opt)
    step = worker.restore(model, opt) + 1
    loss = train_step(model, opt, size, step, device)
    worker.step_done(step, loss, model, opt)  # the first step (and the stop agreement: a CPU collective)
    result = {"marks": worker.marks, "loss": loss, "digest": digest(model, opt), "backend": backend,
              "device_id_bound": str(bound) if bound is not None else None,
              "restore_bytes": worker.restored.bytes_read, "restore_seconds": worker.restored.seconds}
    worker.finish()
    dist.destroy_process_group()
    store.close()
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


def print_table(c: Check) -> None:
    d, s = c.data, c.data["sections"]

    def f(v: Any, fmt: str = "{:.3f}") -> str:
        return "-" if v is None else fmt.format(v)

    rows: list[tuple[str, str]] = [
        ("device", f"{d['device']} (torch {d['torch']}), size {d['size']}"),
        ("state", f"{d.get('params', 0) / 1e6:.1f}M params, {d.get('state_bytes', 0) / 1e9:.3f} GB in {d.get('tensors')} tensors"),
        ("floor D2H / H2D (GB/s)", f"{f(s.get('floors', {}).get('d2h_gbps'), '{:.1f}')} / {f(s.get('floors', {}).get('h2d_gbps'), '{:.1f}')}"),
        ("step, no snapshot (s)", f(s.get("baseline", {}).get("step_seconds_median"))),
    ]
    for key, label in (("copy_out_memory", "memory tier"), ("copy_out_disk", "disk")):
        x = s.get(key, {})
        if "skipped" in x:
            rows.append((f"snapshot every step, {label}", f"skipped: {x['skipped']}"))
            continue
        rows.append((f"snapshot every step, {label}",
                     f"step {f(x.get('step_seconds_median'))} s, blocking {f(x.get('blocking_seconds_median'), '{:.4f}')} s, "
                     f"join {f(x.get('join_seconds_median'))} s, write {f(x.get('write_seconds_median'))} s, "
                     f"copy-out {f(x.get('copy_out_gbps_median'), '{:.1f}')} GB/s"))
    e = s.get("exact", {})
    rows.append(("restore into the live model", f"{f(e.get('restore_gbps'), '{:.1f}')} GB/s ({f(e.get('restore_seconds'))} s)"))
    st = s.get("startup", {})
    if st:
        rows.append(("restarted worker", f"backend {st['backend']}, first step after {st['time_to_first_step']:.2f} s; "
                     + ", ".join(f"{k} {v:.2f}" for k, v in st["phases"].items())))
        rows.append(("state after its first step", "equal" if st["state_after_first_step_equal"]
                     else f"differs in {len(st['state_after_first_step_differs_in'])}+ tensors (reported, not judged)"))
    for name, t in d["targets"].items():
        rows.append((f"target: {name}", f"{f(t['value'])} {t['target']}: " + {True: "met", False: "NOT MET", None: "n/a"}[t["met"]]))
    for name, ck in d["checks"].items():
        rows.append((f"check: {name}", ("ok" if ck["ok"] else "FAILED") + (f" ({ck['detail']})" if ck["detail"] else "")))
    for name, err in d["errors"].items():
        rows.append((f"error in {name}", err.strip().splitlines()[-1]))
    rows.append(("total", f"{d.get('seconds', 0):.1f} s, load average {d.get('load_average', 0):.1f}: "
                 + ("PASS" if c.passed else "FAIL")))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))


if __name__ == "__main__":
    sys.exit(main())
