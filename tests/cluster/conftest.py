"""Fixtures for tests in the multi-host emulation (:mod:`tenplex.testing.netcluster`).

A test that needs network namespaces asks for ``make_cluster`` (or only for
``netns_available``); where namespaces cannot be built (not root, no iproute2,
a kernel without veth/bridge/HTB) it is skipped with the probe's reason, and
every other test still runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tenplex.testing.netcluster import NetCluster, netns_unavailable_reason


@pytest.fixture
def netns_available() -> None:
    """Skip the test, with the reason, where emulated clusters cannot be built."""
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")


@pytest.fixture
def make_cluster(netns_available: None, tmp_path: Path) -> Iterator[Callable[..., NetCluster]]:
    """``make_cluster(hosts, **NetCluster kwargs)``: a started cluster, closed after the test.

    The nodes' directories go under the test's ``tmp_path`` unless ``root_dir`` is given.
    """
    made: list[NetCluster] = []

    def make(hosts: int = 2, **kwargs: Any) -> NetCluster:
        kwargs.setdefault("root_dir", tmp_path / f"cluster{len(made)}")
        cluster = NetCluster(hosts, **kwargs)
        made.append(cluster)
        return cluster.start()

    yield make
    for cluster in made:
        cluster.close()
