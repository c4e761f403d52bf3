"""Object sizes as the real API server sees them: what the scheduler stores must fit its limits.

kube-apiserver refuses a ConfigMap whose values add up to more than 1 MiB (1,048,576 bytes; the keys do not
count). The job record and the PTC chunks the scheduler writes are sized for this limit; here the limit itself
is checked on the test cluster, so that a chunk size that stops fitting is a test failure, not a production
surprise.
"""

from __future__ import annotations

import pytest
from kubernetes.client import ApiException

from tenplex.testing.k8s.cluster import TestCluster

MIB = 1 << 20


def configmap(name: str, size: int) -> dict[str, object]:
    return {"metadata": {"name": name}, "data": {"chunk": "x" * size}}


def test_a_configmap_up_to_1_mib_is_stored_and_one_byte_more_is_refused(api: TestCluster) -> None:
    api.create("configmaps", configmap("fits", MIB))
    assert len(api.get("configmaps", "fits")["data"]["chunk"]) == MIB
    with pytest.raises(ApiException) as refused:
        api.create("configmaps", configmap("too-big", MIB + 1))
    assert refused.value.status == 422 and "may not be more than 1048576 bytes" in refused.value.body
