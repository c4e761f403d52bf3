"""The job-store conformance suite on the Kubernetes store (ElasticJob status and owned ConfigMaps)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenplex.errors import InvalidConfig
from tenplex.k8s.jobstore import (
    CONFIGMAP_LIMIT,
    ElasticJobIndex,
    KubeJobStore,
    ptc_configmap,
    state_configmap,
)
from tenplex.k8s.settings import KubernetesSettings
from tenplex.scheduler.state import JobStatus
from tenplex.testing.jobstore import JOBS, JobStoreTests, busy_status, job_ptc, job_spec
from tenplex.testing.k8s.cluster import TestCluster
from tenplex.testing.scale import changes, transferring_record

from .cluster import NS, elasticjob, eventually


class TestKubeJobStore(JobStoreTests):
    @pytest.fixture
    def store(self, api: TestCluster, tmp_path: Path) -> Iterator[KubeJobStore]:
        for name in JOBS:
            api.create("elasticjobs", elasticjob(name, 2), NS)
        settings = KubernetesSettings(namespace=NS, identity="test", leader_election=False)
        with api.api_client() as api_client:
            index = ElasticJobIndex(api_client, settings, watch_timeout=5)
            index.start()
            try:
                assert index.wait_synced(10)
                eventually(lambda: all(index.find(n) for n in JOBS), "the ElasticJobs in the index")
                yield KubeJobStore(api_client, index, tmp_path / "root")
            finally:
                index.stop()

    def test_the_record_lives_in_configmaps_owned_by_the_elasticjob(self, api: TestCluster,
                                                                     store: KubeJobStore) -> None:
        store.save(job_spec("alpha"), busy_status(6))
        cm = api.get("configmaps", state_configmap("alpha"), NS)
        [owner] = cm["metadata"]["ownerReferences"]
        assert owner["kind"] == "ElasticJob" and owner["name"] == "alpha"
        assert api.get("elasticjobs", "alpha", NS)["status"]["step"] == 6  # the readable view follows

    def test_a_ptc_of_any_size_is_stored_in_chunks_below_the_object_limit(self, store: KubeJobStore,
                                                                           tmp_path: Path) -> None:
        # A small chunk size makes this test's PTC take several ConfigMaps, as a 405B one takes two at the default.
        small = KubeJobStore(store.core.api_client, store.jobs, tmp_path / "small", ptc_chunk_bytes=256)
        store.save(job_spec("alpha"), busy_status(1))
        ptcs = {0: job_ptc(1), 1: job_ptc(2), 2: job_ptc(4)}
        for gen, ptc in ptcs.items():
            small.save_ptc("alpha", gen, ptc)

        def stored() -> dict[str, int]:
            cms = store.core.list_namespaced_config_map(NS, label_selector="tenplex.io/state=true").items
            return {cm.metadata.name: len(json.dumps(store.core.api_client.sanitize_for_serialization(cm)))
                    for cm in cms if cm.metadata.name.startswith("alpha-tenplex-ptc-")}

        sizes = stored()
        assert ptc_configmap("alpha", 2, 2) in sizes  # several chunks
        assert max(sizes.values()) < CONFIGMAP_LIMIT
        # Read back by a restarted scheduler (a new store object, nothing cached).
        again = KubeJobStore(store.core.api_client, store.jobs, tmp_path / "again")
        for gen, ptc in ptcs.items():
            assert again.load_ptc("alpha", gen).to_json() == ptc.to_json()
        # Generation 0 is referenced no more once the job is in generation 2: every chunk of it goes.
        status = busy_status(3)
        status.generation, status.version, status.version_generation = 2, "s3-g2", {"s3-g2": 2}
        again.save(job_spec("alpha"), status)
        left = stored()
        assert not [n for n in left if n.startswith(ptc_configmap("alpha", 0))]
        assert ptc_configmap("alpha", 2, 2) in left
        # A chunk lost: a clear error naming it, not a garbled PTC.
        store.core.delete_namespaced_config_map(ptc_configmap("alpha", 2, 1), NS)
        with pytest.raises(InvalidConfig, match=f"incomplete: its ConfigMap {ptc_configmap('alpha', 2, 1)} is missing"):
            again.load_ptc("alpha", 2)

    def test_a_chunk_size_that_cannot_fit_is_refused(self, store: KubeJobStore, tmp_path: Path) -> None:
        with pytest.raises(InvalidConfig, match="ptc_chunk_bytes"):
            KubeJobStore(store.core.api_client, store.jobs, tmp_path / "x", ptc_chunk_bytes=1 << 20)


def test_a_real_sized_jobs_record_and_ptcs_are_accepted_by_the_api_server(api: TestCluster, tmp_path: Path) -> None:
    """Every object the job store writes for GPT-3 175B (tp8 x pp16 x dp8, 1,024 GPUs) while it scales down to
    768: the record with its 768 workers, the PTCs of both generations, accepted by the real kube-apiserver and
    etcd, under the 1 MiB limit as stored, and read back equal. (The 405B job's, whose PTC takes two ConfigMaps,
    is written the same way by ``benchmarks/record_scale.py --apiserver``: 40 s here; the chunking itself is
    tested above with a small chunk size.)"""
    [change] = changes("175b", kinds=("scale-down",))
    spec, status = transferring_record("big", change)
    api.create("elasticjobs", elasticjob("big", 2), NS)
    settings = KubernetesSettings(namespace=NS, identity="test", leader_election=False)
    with api.api_client() as api_client:
        index = ElasticJobIndex(api_client, settings, watch_timeout=5)
        index.start()
        try:
            eventually(lambda: index.find("big"), "the ElasticJob in the index")
            store = KubeJobStore(api_client, index, tmp_path / "root")
            store.save_ptc("big", 0, change.old)
            store.save_ptc("big", 1, change.new)
            store.save(spec, status)
            stored = [cm for cm in store.core.list_namespaced_config_map(NS).items
                      if cm.metadata.name.startswith("big-tenplex-")]
            sizes = {cm.metadata.name: len(json.dumps(api_client.sanitize_for_serialization(cm)))
                     for cm in stored}
            assert state_configmap("big") in sizes and max(sizes.values()) < CONFIGMAP_LIMIT
            again = KubeJobStore(api_client, index, tmp_path / "again")  # a restarted scheduler: nothing cached
            assert again.load_ptc("big", 1).to_json() == change.new.to_json()
            loaded = again.load("big")
            assert loaded is not None
            # What was saved, as any reader decodes it (heartbeats are kept in whole seconds, rounded up).
            assert loaded[1].to_record() == JobStatus.from_json(status.to_record()).to_record()
            assert len(loaded[1].workers) == len(change.new.devices)
        finally:
            index.stop()
