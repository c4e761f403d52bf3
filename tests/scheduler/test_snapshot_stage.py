"""The snapshot stage of a planned change: the workers' commit reports, and the stores when a report is missing.

Real node daemons (a local cluster of two hosts) and a real state directory; the orchestrator is driven
stage by stage, without worker processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tenplex.ptc import DatasetState, ParallelConfig, Placement, Region
from tenplex.scheduler.backend import LocalBackend, LocalCluster
from tenplex.scheduler.context import JobContext, SchedulerSettings
from tenplex.scheduler.launcher import WorkerLauncher
from tenplex.scheduler.layouts import LayoutSpec
from tenplex.scheduler.reconfigure import Orchestrator
from tenplex.scheduler.state import JobSpec, JobStatus, Phase, Stage, StateDir
from tenplex.store.client import StoreClient
from tenplex.testing.layouts import MLP, mlp_layout

TOKEN = "snapshot-stage"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cluster = LocalCluster(root=tmp_path / "cluster", token=TOKEN)
    try:
        cluster.start_host("host-0", "127.0.0.2")
        cluster.start_host("host-1", "127.0.0.3")
        yield cluster
    finally:
        cluster.stop()


def stopping_job(tmp_path: Path, cluster: LocalCluster) -> tuple[JobContext, Orchestrator]:
    """A dp2 job on the two hosts whose workers stopped after step 3 (the snapshot stage)."""
    parallel = ParallelConfig(dp=2)
    spec = JobSpec(name="snap", layout=LayoutSpec.from_json({"provider": "tenplex.testing.layouts:mlp_layout",
                                                             "model": {"layers": 1, "dim": 4}}),
                   dataset=DatasetState(num_samples=64, seed=0, global_batch_size=4), command=("python", "-c", "pass"),
                   gpus=2)
    status = JobStatus(phase=Phase.RECONFIGURING, stage=Stage.SNAPSHOT, gpus=2, parallel=parallel.to_json(),
                       hosts=["host-0", "host-1"], step=3, stop_at_step=3)
    backend = LocalBackend(cluster, host_timeout=None)
    clients: dict[str, StoreClient] = {}
    ctx = JobContext(spec, status, backend, StateDir(tmp_path / "state"),
                     SchedulerSettings(url="http://127.0.0.1:1", token=TOKEN, stop_timeout=60.0),
                     lambda url: clients.setdefault(url, StoreClient(url, TOKEN)))
    ctx.set_ptc(0, mlp_layout(MLP(1, 4), parallel, Placement(1, ("host-0", "host-1")), None, "fp32"))
    return ctx, Orchestrator(ctx, WorkerLauncher(ctx))


def commit_on(cluster: LocalCluster, host: str, version: str) -> None:
    url = next(h.store_url for h in cluster.hosts() if h.name == host)
    with StoreClient(url, TOKEN) as store:
        store.write_shard("snap", version, "layers.0.weight", Region.full((4, 4)), np.ones((4, 4), np.float32),
                          dtype="float32", global_shape=(4, 4))
        store.commit("snap", version)


def test_reports_that_cover_every_host_are_enough(tmp_path: Path, cluster: LocalCluster) -> None:
    """Each committing worker reported its host's commit: the stage needs no store (none holds anything here)."""
    ctx, orch = stopping_job(tmp_path, cluster)
    ctx.status.committed = {"s3-g0": ["host-0", "host-1"], "s2-g0": ["host-0"]}
    orch.await_snapshot()
    assert (ctx.status.phase, ctx.status.stage, ctx.status.version) == (Phase.RECONFIGURING, Stage.PLANNING, "s3-g0")


def test_a_missing_report_is_made_up_by_the_stores(tmp_path: Path, cluster: LocalCluster) -> None:
    """host-1's worker died before it reported: its store, the ground truth, says the version is there."""
    ctx, orch = stopping_job(tmp_path, cluster)
    ctx.status.committed = {"s3-g0": ["host-0"]}
    orch.await_snapshot()
    assert ctx.status.stage == Stage.SNAPSHOT and ctx.status.version is None  # host-1's store has nothing yet
    commit_on(cluster, "host-0", "s3-g0")
    commit_on(cluster, "host-1", "s3-g0")
    orch.await_snapshot()
    assert (ctx.status.stage, ctx.status.version) == (Stage.PLANNING, "s3-g0")
    assert sorted(ctx.status.committed["s3-g0"]) == ["host-0", "host-1"]


def test_reports_of_another_generation_or_an_earlier_step_do_not_count(tmp_path: Path, cluster: LocalCluster) -> None:
    ctx, orch = stopping_job(tmp_path, cluster)
    ctx.status.committed = {"s3-g1": ["host-0", "host-1"], "s2-g0": ["host-0", "host-1"]}
    orch.await_snapshot()
    assert ctx.status.stage == Stage.SNAPSHOT and ctx.status.version is None
