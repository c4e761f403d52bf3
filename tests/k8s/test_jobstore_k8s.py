"""The job-store conformance suite on the Kubernetes store (ElasticJob status and owned ConfigMaps)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tenplex.k8s.jobstore import ElasticJobIndex, KubeJobStore, state_configmap
from tenplex.k8s.settings import KubernetesSettings
from tenplex.testing.jobstore import JOBS, JobStoreTests, busy_status, job_spec
from tenplex.testing.k8s.emulator import ApiServerEmulator

from .cluster import NS, elasticjob, eventually


class TestKubeJobStore(JobStoreTests):
    @pytest.fixture
    def store(self, api: ApiServerEmulator, tmp_path: Path) -> Iterator[KubeJobStore]:
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

    def test_the_record_lives_in_configmaps_owned_by_the_elasticjob(self, api: ApiServerEmulator,
                                                                     store: KubeJobStore) -> None:
        store.save(job_spec("alpha"), busy_status(6))
        cm = api.get("configmaps", state_configmap("alpha"), NS)
        [owner] = cm["metadata"]["ownerReferences"]
        assert owner["kind"] == "ElasticJob" and owner["name"] == "alpha"
        assert api.get("elasticjobs", "alpha", NS)["status"]["step"] == 6  # the readable view follows
