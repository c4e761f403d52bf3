"""Fixtures for the Kubernetes tests: a real HTTP API server emulator and official clients bound to it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from kubernetes import client

from tenplex.testing.k8s.emulator import ApiServerEmulator

from .cluster import REPO, TOOLS_BIN, NodeAgents, tool

__all__ = ["REPO", "TOOLS_BIN", "Clients", "tool"]


@dataclass
class Clients:
    core: client.CoreV1Api
    custom: client.CustomObjectsApi
    coordination: client.CoordinationV1Api
    api_client: client.ApiClient


@pytest.fixture
def api() -> Iterator[ApiServerEmulator]:
    with ApiServerEmulator() as emulator:
        yield emulator


@pytest.fixture
def k8s(api: ApiServerEmulator) -> Iterator[Clients]:
    """The official clients as the cluster admin (system:masters)."""
    with api.api_client() as api_client:
        yield Clients(client.CoreV1Api(api_client), client.CustomObjectsApi(api_client),
                      client.CoordinationV1Api(api_client), api_client)


@pytest.fixture
def agents(api: ApiServerEmulator) -> Iterator[NodeAgents]:
    """Kubelets without containers for the nodes a test adds (``agents.start(node)``)."""
    nodes = NodeAgents(api)
    try:
        yield nodes
    finally:
        nodes.close()
