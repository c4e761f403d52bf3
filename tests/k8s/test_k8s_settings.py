"""The chart's scheduler environment parses into KubernetesSettings; bad values name the variable."""

from __future__ import annotations

import pytest

from tenplex.errors import InvalidConfig
from tenplex.k8s import crd
from tenplex.k8s.settings import SCHEDULER_ENV, KubernetesSettings

from .test_k8s_chart import one, render


def scheduler_env(*values: str) -> dict[str, str]:
    """The scheduler container's environment as its kubelet would resolve it (pod name/namespace filled in)."""
    container = one(render(*values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    fields = {"metadata.name": "rel-tenplex-scheduler-abc12", "metadata.namespace": "tenplex"}
    env = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[var["name"]] = "from-secret"
    return env


def test_chart_sets_exactly_the_documented_variables() -> None:
    assert sorted(scheduler_env()) == sorted(SCHEDULER_ENV)


def test_chart_defaults_parse_to_the_settings_defaults() -> None:
    settings = KubernetesSettings.from_env(scheduler_env())
    defaults = KubernetesSettings(namespace="tenplex", identity="rel-tenplex-scheduler-abc12",
                                  worker_image="tenplex:0.1.0", auth_secret="rel-tenplex-auth",
                                  advertise_url="http://rel-tenplex-scheduler.tenplex.svc:8080",
                                  store_host_path="/var/lib/tenplex/store")  # workers.mountStore is on by default
    assert settings == defaults
    assert settings.manages("anything")


def test_chart_values_reach_the_settings() -> None:
    settings = KubernetesSettings.from_env(scheduler_env(
        "--set", "scheduler.watchNamespaces={ml,research}", "--set", "store.port=7171", "--set", "store.root=/data/tenplex",
        "--set", "scheduler.leaderElection.leaseName=other", "--set", "auth.existingSecret=team", "--set",
        "auth.existingSecretKey=bearer", "--set", "workers.serviceAccountName=trainer", "--set", "image.tag=1.2.3"))
    assert settings.watch_namespaces == ("ml", "research") and settings.manages("ml") and not settings.manages("default")
    assert (settings.store_port, settings.store_root, settings.lease_name) == (7171, "/data/tenplex", "other")
    assert (settings.auth_secret, settings.auth_secret_key) == ("team", "bearer")
    assert (settings.worker_service_account, settings.worker_image) == ("trainer", "tenplex:1.2.3")
    off = KubernetesSettings.from_env(scheduler_env("--set", "workers.mountStore=false"))
    assert off.store_host_path == ""  # worker pods upload their snapshots to the daemon instead
    moved = KubernetesSettings.from_env(scheduler_env("--set", "store.hostPath=/mnt/nvme0/tenplex"))
    assert moved.store_host_path == "/mnt/nvme0/tenplex"
    assert moved.store_memory_host_path == ""  # no memory tier by default
    memory = KubernetesSettings.from_env(scheduler_env("--set", "store.memory.enabled=true", "--set",
                                                       "store.memory.hostPath=/run/tenplex", "--set", "store.memory.root=/mem"))
    assert (memory.store_memory_host_path, memory.store_memory_root) == ("/run/tenplex", "/mem")
    # workers that do not mount the store's directory upload to the daemon: they do not mount its memory either
    unmounted = KubernetesSettings.from_env(scheduler_env("--set", "store.memory.enabled=true", "--set",
                                                          "workers.mountStore=false"))
    assert unmounted.store_memory_host_path == ""


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"TENPLEX_STORE_PORT": "seventy"}, "TENPLEX_STORE_PORT must be an integer, got 'seventy'"),
        ({"TENPLEX_STORE_PORT": "70000"}, "70000"),
        ({"TENPLEX_LEADER_ELECTION": "maybe"}, "'maybe'"),
        ({"TENPLEX_RENEW_DEADLINE_SECONDS": "20"}, "15 s, 20 s, 2 s"),
        ({"POD_NAMESPACE": ""}, "POD_NAMESPACE is empty"),
        ({"TENPLEX_STORE_ROOT": "relative"}, "'relative'"),
        ({"TENPLEX_STORE_MEMORY_HOST_PATH": "shm/x"}, "TENPLEX_STORE_MEMORY_HOST_PATH must be an absolute path"),
        ({"TENPLEX_STORE_MEMORY_HOST_PATH": "/dev/shm/t", "TENPLEX_STORE_HOST_PATH": ""}, "needs TENPLEX_STORE_HOST_PATH"),
    ],
)
def test_bad_values_name_the_variable(override: dict[str, str], message: str) -> None:
    env = {**scheduler_env(), **override}
    with pytest.raises(InvalidConfig) as err:
        KubernetesSettings.from_env(env)
    assert message in err.value.detail


def test_store_port_default_matches_the_contract() -> None:
    assert KubernetesSettings(namespace="n", identity="i").store_port == crd.STORE_PORT
