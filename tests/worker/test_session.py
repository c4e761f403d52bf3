"""ElasticWorker: a training loop obeying the scheduler (fixture server of test_control), one process."""

from __future__ import annotations

from pathlib import Path

import torch

from tenplex.core import protocol as p
from tenplex.core.version import Version
from tenplex.ptc import DatasetState, Device, ParallelConfig
from tenplex.store.local import LocalStore
from tenplex.worker.session import ElasticWorker, WorkerSetup
from tenplex.worker.state import materialize

from .test_control import TOKEN, FakeJob, scheduler  # noqa: F401  (fixture)
from .test_snapshot_restore import Tiny, make, replicated_ptc


def run_loop(worker: ElasticWorker, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object) -> list[tuple[int, list[int]]]:
    seen = []
    for step, ids in worker.batches(dp_rank=0):
        x = torch.stack([torch.full((6,), float(i)) for i in ids]) / 100
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()  # type: ignore[attr-defined]
        seen.append((step, ids.tolist()))
        if worker.step_done(step, loss.item(), model, opt, sched):
            break
    return seen


def setup_for(tmp_path: Path, **kw: object) -> tuple[WorkerSetup, object]:
    model, opt, sched = make()
    ptc = replicated_ptc(model, [Device(0, "h0")])
    ptc = type(ptc)(config=ptc.config, devices=ptc.devices, tensors=ptc.tensors,
                    dataset=DatasetState(num_samples=50, seed=1, global_batch_size=4))
    setup = WorkerSetup(job="demo", generation=3, rank=0, ptc=ptc, store=str(tmp_path / "store"),
                        parallel=ParallelConfig(), **kw)  # type: ignore[arg-type]
    return setup, (model, opt, sched)


def test_stop_request_snapshots_that_step_and_reports(tmp_path: Path, scheduler: tuple[str, FakeJob]) -> None:  # noqa: F811
    url, job = scheduler
    from tenplex.worker.control import ControlClient

    control = ControlClient(url, "demo", "w-1", token=TOKEN, backoff_s=0.01)
    setup, (model, opt, sched) = setup_for(tmp_path, heartbeat_interval_s=0.05, total_steps=100)
    job.stop_at_step = 4
    worker = ElasticWorker(setup, control)
    assert worker.heartbeat is not None
    worker.heartbeat.beat_now()
    seen = run_loop(worker, model, opt, sched)
    assert [s for s, _ in seen] == [1, 2, 3, 4]
    assert worker.finish() == p.EXIT_STOPPED
    reports = {type(r).__name__: r for r in job.reports}
    assert reports["SnapshotReport"].version == "s4-g3" and reports["SnapshotReport"].committed
    assert reports["ExitReport"].status == "stopped" and reports["ExitReport"].step == 4
    assert LocalStore(tmp_path / "store").manifest("demo", Version(4, 3)).committed
    # the data consumed is the order from the start
    order = DatasetState(num_samples=50, seed=1, global_batch_size=4).samples(0, 16).tolist()
    assert sum((ids for _, ids in seen), []) == order


def test_standalone_periodic_snapshots_and_resume(tmp_path: Path) -> None:
    setup, (model, opt, sched) = setup_for(tmp_path, total_steps=5)
    worker = ElasticWorker(setup, snapshot_every=2)
    seen = run_loop(worker, model, opt, sched)
    assert [s for s, _ in seen] == [1, 2, 3, 4, 5] and worker.finish() == 0
    assert worker.snapshots == [Version(2, 3), Version(4, 3)]

    # a second process resumes from s4-g3 and runs step 5 exactly like the first did
    setup2, (model2, opt2, sched2) = setup_for(tmp_path, total_steps=5, restore_version=Version(4, 3))
    model2.load_state_dict({k: v + 1 for k, v in model2.state_dict().items()})  # anything: restore overwrites
    worker2 = ElasticWorker(setup2)
    assert worker2.restore(model2, opt2, sched2) == 4
    seen2 = run_loop(worker2, model2, opt2, sched2)
    assert seen2 == [seen[-1]]
    assert worker2.finish() == 0
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_resuming_worker_builds_on_meta_and_restores_into_storage_without_values(tmp_path: Path) -> None:
    setup, (model, opt, sched) = setup_for(tmp_path, total_steps=5)
    worker = ElasticWorker(setup, snapshot_every=2)
    assert worker.needs_initial_values  # a fresh job: its seeded values are its start
    seen = run_loop(worker, model, opt, sched)
    assert worker.finish() == 0

    setup2, _ = setup_for(tmp_path, total_steps=5, restore_version=Version(4, 3))
    worker2 = ElasticWorker(setup2)
    assert not worker2.needs_initial_values  # every value comes from s4-g3
    with torch.device("meta"):
        model2 = Tiny(seed=7)
    assert materialize(model2, "cpu") == 5 and all(p.device.type == "cpu" for p in model2.parameters())
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.1)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (1 + s))
    worker2.prepare(model2, opt2)
    assert worker2.restore(model2, opt2, sched2) == 4
    assert run_loop(worker2, model2, opt2, sched2) == [seen[-1]]
    assert worker2.finish() == 0
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_rank_waits_for_its_rendezvous_store_to_listen_and_gives_up_after_its_timeout() -> None:
    import socket
    import threading

    from tenplex.worker.session import wait_for_listener

    with socket.socket() as probe:  # a port nothing listens on (yet)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert wait_for_listener("127.0.0.1", port, timeout_s=0.05) >= 0.05  # nothing there: returns after the timeout

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    opened = threading.Timer(0.1, server.listen)  # rank 0 arrives a little later
    opened.start()
    try:
        assert wait_for_listener("127.0.0.1", port, timeout_s=30) >= 0.1
        socket.create_connection(("127.0.0.1", port), timeout=1).close()  # it listens now
    finally:
        opened.join()
        server.close()
