"""Fixtures for the Kubernetes tests: a real control plane (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler v1.37.2 from ``make k8s-testbed``) on 127.0.0.1, one per test session (the tests that use it
run on one xdist worker), reset after each test, and the official clients bound to it.

Without the binaries: where Go is missing (they cannot be built) the tests that need the cluster skip and say
so; where Go is there they fail, naming ``make k8s-testbed``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from kubernetes import client

from tenplex.testing.k8s.cluster import TestCluster, running_cluster
from tenplex.testing.k8s.controlplane import binaries_dir, missing_binaries

from .cluster import REPO, TOOLS_BIN, NodeAgents, tool

__all__ = ["REPO", "TOOLS_BIN", "Clients", "tool"]


@dataclass
class Clients:
    core: client.CoreV1Api
    custom: client.CustomObjectsApi
    coordination: client.CoordinationV1Api
    api_client: client.ApiClient


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test on the control plane runs on one xdist worker: one cluster for the session instead of one per
    worker (its start-up, and its idle loops, which take a few percent of a core for the whole run)."""
    for item in items:
        if "control_plane" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("k8s-control-plane"))


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    """This worker's cluster: started at its first use, stopped at the end of the session."""
    bin_dir = binaries_dir(REPO)
    missing = missing_binaries(bin_dir)
    if missing:
        if shutil.which("go") is None:
            pytest.skip(f"no Kubernetes control plane: {', '.join(missing)} not built in {bin_dir} and Go is not "
                        "installed to build them (install Go 1.26+, then `make k8s-testbed`)")
        pytest.fail(f"{', '.join(missing)} missing from {bin_dir}: run `make k8s-testbed`")
    with running_cluster(tmp_path_factory.mktemp("k8s-control-plane"), bin_dir) as cluster:
        yield cluster


@pytest.fixture
def api(control_plane: TestCluster) -> Iterator[TestCluster]:
    """The cluster as its admin; everything the test made is removed afterwards."""
    control_plane.plane.clear_accesses()
    try:
        yield control_plane
    finally:
        control_plane.reset()


@pytest.fixture
def k8s(api: TestCluster) -> Iterator[Clients]:
    """The official clients as the cluster admin (system:masters)."""
    with api.api_client() as api_client:
        yield Clients(client.CoreV1Api(api_client), client.CustomObjectsApi(api_client),
                      client.CoordinationV1Api(api_client), api_client)


@pytest.fixture
def agents(api: TestCluster) -> Iterator[NodeAgents]:
    """Kubelets without containers for the nodes a test adds (``agents.start(node)``)."""
    nodes = NodeAgents(api)
    try:
        yield nodes
    finally:
        nodes.close()
