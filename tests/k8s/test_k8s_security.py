"""The Kubernetes backend's side of job-scoped credentials and TLS: what a worker pod holds, how stores are reached.

Against the API server emulator over real HTTP (the chart's RBAC), with a key set signing real credentials.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tenplex.core.auth import Authenticator, Issuer, KeySet, Principal
from tenplex.k8s.backend import KubernetesBackend, _pod_token
from tenplex.k8s.settings import KubernetesSettings
from tenplex.scheduler.backend import WorkerLaunch
from tenplex.testing.k8s.cluster import TestCluster

from .cluster import (
    NS,
    NodeAgents,
    add_gpu_node,
    assert_rbac_clean,
    elasticjob,
    eventually,
    scheduler_client,
    worker_pods,
)

ADMIN = "admin-s3cret"


@pytest.fixture
def keys(tmp_path: Path) -> KeySet:
    return KeySet.generate(tmp_path / "keys.json")


@contextmanager
def _backend(api: TestCluster, settings: KubernetesSettings, **kwargs) -> Iterator[KubernetesBackend]:
    with scheduler_client(api) as api_client:
        be = KubernetesBackend(api_client, settings, lambda name: api.get("elasticjobs", name, NS), watch_timeout=5,
                               stop_margin=2.0, token=ADMIN, **kwargs).start()
        try:
            yield be
        finally:
            be.close()


def _launches(credential: str) -> list[WorkerLaunch]:
    return [WorkerLaunch(f"gpt-g0-r{rank}", rank, host, 0, {"RANK": str(rank), "MASTER_ADDR": "127.0.0.2",
                                                           "MASTER_PORT": "29500", "TENPLEX_TOKEN": credential,
                                                           "TENPLEX_GENERATION": "0"})
            for rank, host in enumerate(["gpu-a", "gpu-b"])]


def test_worker_pods_hold_their_jobs_own_credential_never_the_admin_token(api: TestCluster, agents: NodeAgents,
                                                                         keys: KeySet, tmp_path: Path) -> None:
    add_gpu_node(api, "gpu-a", "127.0.0.2", agents=agents)
    add_gpu_node(api, "gpu-b", "127.0.0.3", agents=agents)
    api.create("elasticjobs", elasticjob("gpt", 2), NS)
    settings = KubernetesSettings(namespace=NS, identity="test", leader_election=False, auth_secret="tenplex-auth")
    credential = Issuer(keys).worker("gpt")
    with _backend(api, settings, job_credentials=True) as backend:
        backend.launch("gpt", ["python", "-m", "examples.gpt.train"], _launches(credential), tmp_path)
        pods = eventually(lambda: worker_pods(api, "gpt") if len(worker_pods(api, "gpt")) == 2 else None, "two pods")
        for pod in pods:
            env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
            assert env["TENPLEX_TOKEN"] == {"name": "TENPLEX_TOKEN", "value": credential}  # not the Secret's token
            assert _pod_token(pod) == credential  # what the pod's standby expects in the hello
            assert Authenticator(ADMIN, keys).authenticate(f"Bearer {credential}") == Principal(
                "worker", "gpt", "gpt/workers")
            assert "TENPLEX_TLS_CA" not in env and "volumes" not in pod["spec"]  # no TLS: nothing mounted
        backend.stop("gpt", ["gpt-g0-r0", "gpt-g0-r1"], grace=1)
    assert_rbac_clean(api)


def test_with_tls_stores_are_reached_over_https_and_worker_pods_trust_the_ca(api: TestCluster,
                                                                             agents: NodeAgents, tmp_path: Path) -> None:
    add_gpu_node(api, "gpu-a", "127.0.0.2", agents=agents)
    add_gpu_node(api, "gpu-b", "127.0.0.3", agents=agents)
    api.create("elasticjobs", elasticjob("gpt", 2), NS)
    settings = KubernetesSettings(namespace=NS, identity="test", leader_election=False, tls_secret="tenplex-tls")
    with _backend(api, settings) as backend:
        hosts = eventually(lambda: backend.hosts() if len(backend.hosts()) == 2 else None, "two hosts")
        assert all(h.store_url.startswith("https://") for h in hosts), hosts
        pod = backend.pod_manifest(api.get("elasticjobs", "gpt", NS), ["python"], _launches("c")[:1])
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["TENPLEX_TLS_CA"]["value"] == "/etc/tenplex/tls-ca/ca.crt"
        assert {"name": "tenplex-tls-ca", "mountPath": "/etc/tenplex/tls-ca", "readOnly": True} in pod["spec"][
            "containers"][0]["volumeMounts"]
        assert {"name": "tenplex-tls-ca", "secret": {"secretName": "tenplex-tls", "items": [
            {"key": "ca.crt", "path": "ca.crt"}]}} in pod["spec"]["volumes"]
