"""Collective behaviour with real gloo processes: agreeing on the stop step, reporting a dead peer."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tenplex.sockets import free_port

from .test_control import TOKEN, FakeJob, scheduler  # noqa: F401  (fixture)


def _init(rank: int, world: int, port: int, timeout_s: float = 60) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def _agree(rank: int, world: int, port: int, stops: list[int | None], aborts: list[bool], out: Any) -> None:
    """Each rank heard of a different stop step (or none); all must stop after the same step."""
    import torch.distributed as dist

    from tenplex.worker.control import agree_stop

    _init(rank, world, port)
    decided = None
    aborted = None
    for step in range(1, 10):
        stop, abort = agree_stop(step, stops[rank], aborts[rank] and step >= 3)
        if abort and aborted is None:
            aborted = step
        if stop:
            decided = step
            break
    out.put((rank, decided, aborted))
    dist.destroy_process_group()


def run(target: Any, world: int, *args: Any) -> list[tuple]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    return sorted(results)


@pytest.mark.slow
def test_ranks_agree_on_the_earliest_stop_step_any_of_them_heard() -> None:
    got = run(_agree, 3, [None, 5, 4], [False, False, False])
    assert got == [(0, 4, None), (1, 4, None), (2, 4, None)]


def _dies_or_reports(rank: int, world: int, port: int, url: str, root: str, out: Any) -> None:
    """Rank 1 dies after step 2; rank 0's next collective fails and it reports a peer failure."""
    import torch
    import torch.distributed as dist

    from tenplex.ptc import PTC, Device, ParallelConfig
    from tenplex.worker.control import ControlClient
    from tenplex.worker.session import ElasticWorker, WorkerSetup

    _init(rank, world, port, timeout_s=20)
    ptc = PTC(config={"dp": 2}, devices=(Device(0, "h0"), Device(1, "h0")), tensors=())
    control = ControlClient(url, "demo", f"w-{rank}", token=TOKEN, backoff_s=0.01)
    setup = WorkerSetup(job="demo", generation=3, rank=rank, ptc=ptc, store=root, parallel=ParallelConfig(dp=2), heartbeat_interval_s=60)
    worker = ElasticWorker(setup, control)
    model = torch.nn.Linear(2, 2)
    for step in range(1, 6):
        if rank == 1 and step == 3:
            os._exit(0)  # a worker process vanishes (as on SIGKILL or a lost node)
        try:
            t = torch.ones(1)
            dist.all_reduce(t)
        except RuntimeError as exc:
            worker.peer_failure(exc)
            out.put((rank, step, worker.finish(detail=str(exc)[:200])))
            return
        worker.step_done(step, float(step), model, None)
    out.put((rank, None, worker.finish()))


@pytest.mark.slow
def test_a_dead_peer_is_reported_to_the_scheduler(tmp_path: Path, scheduler: tuple[str, FakeJob]) -> None:  # noqa: F811
    url, job = scheduler
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_dies_or_reports, args=(r, 2, port, url, str(tmp_path / "store"), out)) for r in range(2)]
    for p in procs:
        p.start()
    rank, step, code = out.get(timeout=120)
    for p in procs:
        p.join(30)
    assert (rank, step, code) == (0, 3, 1)
    deadline = time.monotonic() + 5
    while len(job.reports) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    kinds = [type(r).__name__ for r in job.reports]
    assert kinds == ["PeerFailureReport", "ExitReport"]
    assert job.reports[0].step == 3 and job.reports[0].generation == 3
    assert job.reports[1].status == "failed" and job.reports[1].exit_code == 1
