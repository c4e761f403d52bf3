"""The worker's CUDA paths: the GPU check's dry run on CPU, the page-locked arena, and (on a GPU) the paths
themselves: the fenced copy-out, the slotted restore, NCCL bound to its device, the CUDA RNG state.

The CUDA tests skip where there is no CUDA device; ``benchmarks/gpu_check.py`` runs the same paths at scale on
one GPU (issue 28).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tenplex.core.buffers import PAGE_BYTES
from tenplex.errors import InvalidConfig, InvalidInput
from tenplex.ptc import PTC, Device, Region, build_tensor
from tenplex.store.local import LocalStore
from tenplex.worker.pinned import HostArena
from tenplex.worker.restore import restore
from tenplex.worker.session import default_backend, rank_device
from tenplex.worker.snapshot import Snapshotter
from tenplex.worker.state import live_pieces

REPO = Path(__file__).resolve().parents[2]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.slow
def test_the_gpu_check_runs_every_section_tiny_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--smoke", "--device", "cpu",
                           "--json", str(out), "--memory-dir", str(tmp_path), "--disk-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=280, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["errors"] == {} and data["device"] == "cpu" and data["size"] == "smoke"
    assert set(data["sections"]) == {"floors", "baseline", "copy_out_memory", "copy_out_disk", "exact", "startup"}
    assert data["checks"] == {
        "snapshot exact (copies fenced from the next step)": {"ok": True, "detail": f"{data['tensors']} tensors"},
        "restore bit-exact": {"ok": True, "detail": f"{data['tensors']} tensors"},
        "trainer state exact": {"ok": True, "detail": ""},
        "same loss after the restart": data["checks"]["same loss after the restart"],
    }
    assert data["checks"]["same loss after the restart"]["ok"]
    # On CPU there is no bus to compare with: the targets are not judged, and say so.
    assert {name: t["met"] for name, t in data["targets"].items()} == {
        "copy-out / D2H floor": None, "blocking part / step": None, "restore / H2D floor": None}
    for phase in ("copy_out_memory", "copy_out_disk"):
        s = data["sections"][phase]
        assert s["steps"] == 2 and len(s["blocking_seconds"]) == 2 and s["copy_out_gbps_median"] is None, s
    startup = data["sections"]["startup"]
    assert startup["backend"] == "gloo" and startup["state_after_first_step_equal"]
    assert set(startup["phases"]) == {"launch", "imports", "rendezvous", "model_build", "restore", "first_step"}
    assert startup["time_to_first_step"] >= sum(startup["phases"].values()) - 0.01
    table = done.stdout
    for line in ("check: restore bit-exact", "check: same loss after the restart", "target: copy-out / D2H floor",
                 "restarted worker", "snapshot every step, memory tier"):
        assert line in table, table
    assert table.rstrip().endswith("PASS"), table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_the_gpu_check_says_it_needs_a_gpu() -> None:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 2 and "no CUDA device here" in done.stderr and "--smoke" in done.stderr, done.stderr


def test_a_host_arena_cuts_page_aligned_slices_of_exact_sizes() -> None:
    arena = HostArena([10, 0, PAGE_BYTES + 1, 4], pin=False)
    assert arena.nbytes == 4 * PAGE_BYTES and arena.offsets == [0, PAGE_BYTES, PAGE_BYTES, 3 * PAGE_BYTES]
    a = arena.slice(0, (5,), torch.int16)
    c = arena.slice(2, (PAGE_BYTES + 1,), torch.uint8)
    d = arena.slice(3, (), torch.float32)
    assert a.data_ptr() % PAGE_BYTES == 0 and c.data_ptr() % PAGE_BYTES == 0 and d.data_ptr() % PAGE_BYTES == 0
    a.fill_(7)
    c.fill_(1)
    d.fill_(2.5)
    assert a.tolist() == [7] * 5 and int(c.sum()) == PAGE_BYTES + 1 and float(d) == 2.5  # disjoint
    assert arena.slice(1, (0, 3), torch.float32).shape == (0, 3)
    with pytest.raises(InvalidInput, match="holds 10 bytes, not 12"):
        arena.slice(0, (3,), torch.float32)
    assert not arena.pinned
    arena.close()


def test_without_cuda_the_process_group_is_gloo() -> None:
    assert default_backend() == ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")


def test_a_rank_device_named_by_local_rank_must_exist() -> None:
    with pytest.raises(InvalidConfig, match="LOCAL_RANK must be a non-negative integer, got 'x'"):
        rank_device({"LOCAL_RANK": "x"})
    count = torch.cuda.device_count()
    with pytest.raises(InvalidConfig, match=f"LOCAL_RANK={count}, but this process sees {count} CUDA device"):
        rank_device({"LOCAL_RANK": str(count)})


def test_a_snapshot_reuses_its_view_of_the_state_until_a_tensor_is_replaced(tmp_path: Path) -> None:
    """The live pieces are named once while the state is updated in place; a state tensor replaced by a new
    one (a reset optimizer, a reassigned parameter) is seen at the next snapshot."""
    device = torch.device("cpu")
    model, opt = _model(device)
    store = LocalStore(tmp_path / "store")
    snap = Snapshotter(store, "j", _ptc(model, opt), 0)
    snap.snapshot(1, 0, model, opt)
    first = snap._pieces_of
    _step(model, opt, device)
    snap.snapshot(2, 0, model, opt)
    assert snap._pieces_of is first  # in place: the same pieces
    weight = model[0].weight
    opt.state[weight]["exp_avg"] = torch.full_like(weight, 3.0)  # a new tensor object
    version = snap.snapshot(3, 0, model, opt)
    snap.close()
    assert snap._pieces_of is not first
    out = torch.empty_like(weight)
    store.read_into("j", version, "optim/0.weight/exp_avg", Region.full(tuple(weight.shape)), out)
    assert torch.equal(out, torch.full_like(weight, 3.0))


# --------------------------------------------------------------------------- on a GPU


def _model(device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, device)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> None:
    x = torch.randn(32, 64, device=device)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _ptc(model: torch.nn.Module, opt: torch.optim.Optimizer) -> PTC:
    tensors = [build_tensor(p.name, p.global_shape, p.dtype, p.kind, [(Region.full(p.global_shape), (0,))])
               for p in live_pieces(model, opt)]
    return PTC(config={"dp": 1}, devices=(Device(0, "node-0"),), tensors=tuple(tensors))


def _host_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {p.name: p.local.detach().cpu().clone() for p in live_pieces(model, opt)}


@CUDA
def test_a_snapshot_holds_its_step_while_the_next_optimizer_step_runs_and_reuses_its_pinned_arena(tmp_path: Path) -> None:
    device = torch.device("cuda", 0)
    model, opt = _model(device)
    store = LocalStore(tmp_path / "store")
    snap = Snapshotter(store, "j", _ptc(model, opt), 0)
    arenas = []
    for step in (1, 2, 3):
        expected = _host_state(model, opt)
        torch.cuda._sleep(50_000_000)  # the copies queue behind a long kernel: the next step's optimizer must wait
        version = snap.snapshot(step, 0, model, opt)
        _step(model, opt, device)  # overwrites parameters and moments in place
        result = snap.wait()
        assert result is not None and result.committed and result.device_bytes > 0 and result.device_copy_seconds
        arenas.append(snap._arena)
        got = {p.name: p for p in live_pieces(model, opt)}
        for name, value in expected.items():
            out = torch.empty_like(value)
            store.read_into("j", version, name, got[name].region, out)
            assert torch.equal(out, value), (step, name)
    assert arenas[0] is arenas[1] is arenas[2] and arenas[0].pinned  # made once
    snap.close()
    assert not arenas[0].pinned


@CUDA
def test_a_restore_through_few_slots_is_bit_exact(tmp_path: Path) -> None:
    device = torch.device("cuda", 0)
    model, opt = _model(device)
    ptc = _ptc(model, opt)
    store = LocalStore(tmp_path / "store")
    snap = Snapshotter(store, "j", ptc, 0)
    version = snap.snapshot(1, 0, model, opt)
    snap.close()
    expected = _host_state(model, opt)
    _step(model, opt, device)
    result = restore(store, "j", version, ptc, 0, model, opt, read_concurrency=3, staging_bytes=1)  # 2 slots, reused
    assert result.exact
    for name, value in _host_state(model, opt).items():
        assert torch.equal(value, expected[name]), name


@CUDA
def test_a_cuda_rank_gets_nccl_bound_to_its_device_and_gloo_for_the_stop_agreement(tmp_path: Path) -> None:
    code = (
        "import os, torch, torch.distributed as dist\n"
        "from tenplex.ptc import PTC, Device, ParallelConfig\n"
        "from tenplex.sockets import free_port\n"
        "from tenplex.worker.control import agree_stop\n"
        "from tenplex.worker.session import ElasticWorker, WorkerSetup\n"
        "os.environ['LOCAL_RANK'] = '0'\n"
        "ptc = PTC(config={'dp': 1}, devices=(Device(0, 'node-0'),), tensors=())\n"
        f"setup = WorkerSetup(job='j', generation=0, rank=0, ptc=ptc, store={str(tmp_path)!r}, "
        "parallel=ParallelConfig(dp=1), master_port=free_port())\n"
        "ElasticWorker(setup).init_process_group()\n"
        "assert dist.distributed_c10d._get_default_group().bound_device_id == torch.device('cuda', 0)\n"
        "assert agree_stop(3, 3) == (True, False)\n"
        "t = torch.ones(4, device='cuda'); dist.all_reduce(t); assert t.tolist() == [1.0] * 4\n"
        "dist.destroy_process_group(); print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@CUDA
def test_the_cuda_rng_state_of_the_ranks_device_is_captured_and_put_back() -> None:
    from tenplex.worker import trainer_state

    torch.cuda.init()
    torch.cuda.manual_seed(5)
    record = trainer_state.load(trainer_state.capture(step=1, rank=0, parallel={"dp": 1}, optimizer=None,
                                                      lr_scheduler=None, dataset=None, extra=None))
    expected = torch.rand(8, device="cuda")
    torch.cuda.manual_seed(6)
    trainer_state.apply(record, step=1, rank=0, parallel={"dp": 1}, optimizer=None, lr_scheduler=None, dataset=None,
                        seed=0)
    assert torch.equal(torch.rand(8, device="cuda"), expected)
