"""The simulated kubelet of ``benchmarks/control_plane_k8s.py`` runs exactly the ranks, with exactly the environment,
that the Kubernetes backend put into a worker pod (no cluster needed: the pod is the backend's own manifest)."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from tenplex.errors import InvalidInput
from tenplex.k8s import crd
from tenplex.k8s.backend import KubernetesBackend
from tenplex.k8s.settings import KubernetesSettings
from tenplex.scheduler.backend import WorkerLaunch
from tenplex.testing.k8s.simkubelet import pod_ranks, signal_exit

from .cluster import elasticjob


def _pod(gpus_per_pod: int) -> tuple[client.V1Pod, list[WorkerLaunch]]:
    api_client = client.ApiClient()
    backend = KubernetesBackend(api_client, KubernetesSettings(namespace="default", identity="t", leader_election=False),
                                lambda name: {})
    obj = elasticjob("gpt", 4, gpus_per_pod=gpus_per_pod)
    obj["metadata"]["uid"] = "u-1"
    launches = [WorkerLaunch(f"gpt-g3-r{r}", r, "gpu-a", r, {"TENPLEX_JOB": "gpt", "TENPLEX_GENERATION": "3",
                                                               "RANK": str(r), "TENPLEX_WORKER_ID": f"gpt-g3-r{r}",
                                                               "WORLD_SIZE": "4", "TENPLEX_TOKEN": "tok",
                                                               "TENPLEX_STORE_URL": "http://10.0.0.1:7070"})
                for r in range(gpus_per_pod)]
    manifest = backend.pod_manifest(obj, ["python", "train.py"], launches)
    # as the official client reads the pod from the API server's answer
    return api_client.deserialize(json.dumps(manifest), "V1Pod", "application/json"), launches


@pytest.mark.parametrize("per_pod", [1, 2])
def test_pod_ranks_are_the_launched_workers(per_pod: int) -> None:
    pod, launches = _pod(per_pod)
    ranks = pod_ranks(pod, "10.0.0.1")
    assert [(r["worker_id"], r["rank"], r["host"], r["local_rank"]) for r in ranks] == \
        [(w.worker_id, w.rank, "gpu-a", w.rank) for w in launches]
    for r, w in zip(ranks, launches, strict=True):
        assert {k: r["env"][k] for k in w.env} == dict(w.env)  # every variable the scheduler gave the rank
        assert r["env"][crd.ENV_NODE_IP] == "10.0.0.1"  # the downward API, resolved


def test_an_unresolvable_env_source_and_signal_codes() -> None:
    pod, _ = _pod(1)
    pod.spec.containers[0].env.append(client.V1EnvVar(name="X", value_from=client.V1EnvVarSource(
        secret_key_ref=client.V1SecretKeySelector(name="s", key="k"))))
    with pytest.raises(InvalidInput, match="does not resolve"):
        pod_ranks(pod, "10.0.0.1")
    assert (signal_exit(-9), signal_exit(-15), signal_exit(0), signal_exit(1)) == (137, 143, 0, 1)
