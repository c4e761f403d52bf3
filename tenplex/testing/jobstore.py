"""What every :class:`~tenplex.scheduler.state.JobStore` does, as one suite run against each implementation.

zarr-python's ``StoreTests`` pattern (``zarr.testing.store``): :class:`JobStoreTests`
holds the behaviours; a test module subclasses it once per implementation
(``TestStateDir`` in ``tests/scheduler/test_jobstore.py``, ``TestKubeJobStore`` in
``tests/k8s/test_jobstore_k8s.py``)
and provides the ``store`` fixture, a store in which the jobs :data:`JOBS` may be
saved (on Kubernetes their ElasticJobs exist).
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from tenplex.errors import InvalidConfig, NotFound
from tenplex.ptc import PTC, DatasetState, ParallelConfig
from tenplex.ptc.megatron import GPTSpec, megatron_gpt_ptc
from tenplex.scheduler.layouts import LayoutSpec
from tenplex.scheduler.plans import PlanInputs
from tenplex.scheduler.state import (
    JobSpec,
    JobStatus,
    JobStore,
    Phase,
    Reconfiguration,
    Stage,
    WorkerRecord,
)

JOBS = ("alpha", "beta")
MODEL = {"num_layers": 2, "hidden": 16, "heads": 2, "vocab": 64, "seq_len": 8, "make_vocab_size_divisible_by": 8}


def job_spec(name: str, gpus: int = 2) -> JobSpec:
    return JobSpec(name=name, layout=LayoutSpec("megatron-gpt", dict(MODEL)), dataset=DatasetState(256, 1, 8),
                   command=("python", "-m", "train"), gpus=gpus, max_gpus=8)


def job_ptc(dp: int) -> PTC:
    return megatron_gpt_ptc(GPTSpec(**MODEL), ParallelConfig(dp=dp), gpus_per_node=2, precision="fp32")


def busy_status(step: int) -> JobStatus:
    return JobStatus(phase=Phase.RECONFIGURING, stage=Stage.TRANSFERRING, generation=1, gpus=2,
                     parallel=ParallelConfig(dp=2).to_json(), hosts=["h0"], step=step, version=f"s{step}-g1",
                     committed={f"s{step}-g1": ["h0"]}, version_generation={f"s{step}-g1": 1},
                     workers=[WorkerRecord("alpha-g1-r0", 0, "h0", 0, 1, pid=7)],
                     history=[Reconfiguration(reason="scale", started_at=1.0, from_config="dp1 x tp1 x pp1")],
                     last_plan={"inputs": PlanInputs.of(job="alpha", old_version="s1-g0", new_version=f"s{step}-g1",
                                                        old_generation=0, alive=["h0", "h1"], holders=["h0"]).to_json(),
                                "parallel": {"dp": 2}, "hosts": ["h0"], "gpus_per_node": 2})


class JobStoreTests:
    """The behaviours; subclasses provide the ``store`` fixture."""

    def test_root_is_an_existing_directory(self, store: JobStore) -> None:
        assert store.root.is_dir()

    def test_the_status_json_has_every_field(self, store: JobStore) -> None:
        assert set(busy_status(1).to_json()) == {f.name for f in dataclasses.fields(JobStatus)}
        assert "last_plan" not in busy_status(1).to_json(plan=False)

    def test_a_saved_job_loads_back_as_saved(self, store: JobStore) -> None:
        spec, status = job_spec("alpha"), busy_status(17)
        before = time.time()
        store.save(spec, status)
        assert status.updated_at >= before
        [(spec2, status2)] = store.load_all()
        assert spec2.to_json() == spec.to_json()
        assert status2.to_json() == status.to_json()

    def test_the_newest_record_of_each_job_wins(self, store: JobStore) -> None:
        store.save(job_spec("alpha"), busy_status(3))
        store.save(job_spec("beta", gpus=4), JobStatus())
        newest = busy_status(9)
        newest.last_plan = {**(newest.last_plan or {}), "hosts": ["h9"]}
        store.save(job_spec("alpha"), newest)
        loaded = {spec.name: (spec, status) for spec, status in store.load_all()}
        assert sorted(loaded) == ["alpha", "beta"]
        assert loaded["alpha"][1].step == 9 and loaded["alpha"][1].version == "s9-g1"
        assert loaded["alpha"][1].last_plan == newest.last_plan and loaded["beta"][1].last_plan is None
        assert loaded["beta"][0].gpus == 4 and loaded["beta"][1].phase == Phase.PENDING

    def test_ptcs_are_kept_per_generation(self, store: JobStore) -> None:
        store.save(job_spec("alpha"), busy_status(1))
        one, two = job_ptc(1), job_ptc(2)
        store.save_ptc("alpha", 0, one)
        store.save_ptc("alpha", 1, two)
        assert store.load_ptc("alpha", 0).to_json() == one.to_json()
        assert store.load_ptc("alpha", 1).to_json() == two.to_json()
        with pytest.raises(NotFound, match="generation 5"):
            store.load_ptc("alpha", 5)

    def test_delete_forgets_the_job_and_its_ptcs(self, store: JobStore) -> None:
        store.save(job_spec("alpha"), busy_status(1))
        store.save(job_spec("beta"), JobStatus())
        store.save_ptc("alpha", 1, job_ptc(1))
        store.delete("alpha")
        assert [spec.name for spec, _ in store.load_all()] == ["beta"]
        with pytest.raises(NotFound):
            store.load_ptc("alpha", 1)
        store.delete("alpha")  # again: nothing is recorded, nothing happens

    def test_a_malformed_job_name_is_refused(self, store: JobStore) -> None:
        with pytest.raises(InvalidConfig, match="DNS-1123"):
            store.save_ptc("Not_A_Name", 0, job_ptc(1))
        with pytest.raises(InvalidConfig, match="DNS-1123"):
            store.load_ptc("../escape", 0)
