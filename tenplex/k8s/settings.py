"""What the Helm chart tells the scheduler's Kubernetes backend, through its environment.

The chart's scheduler Deployment sets these variables (a test renders the
chart and parses them with :meth:`KubernetesSettings.from_env`, so the two
cannot drift apart). The backend reads them once at start-up; a bad value is
a clear error naming the variable, not a crash later.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from tenplex.core.auth import ENV_AUTH_KEYS
from tenplex.errors import InvalidConfig
from tenplex.k8s.crd import DEFAULT_STORE_ROOT, ENV_TOKEN, LEADER_LEASE, STORE_PORT

ENV_POD_NAME = "POD_NAME"
ENV_POD_NAMESPACE = "POD_NAMESPACE"
ENV_WATCH_NAMESPACES = "TENPLEX_WATCH_NAMESPACES"
ENV_LEADER_ELECTION = "TENPLEX_LEADER_ELECTION"
ENV_LEASE_NAME = "TENPLEX_LEASE_NAME"
ENV_LEASE_DURATION = "TENPLEX_LEASE_DURATION_SECONDS"
ENV_RENEW_DEADLINE = "TENPLEX_RENEW_DEADLINE_SECONDS"
ENV_RETRY_PERIOD = "TENPLEX_RETRY_PERIOD_SECONDS"
ENV_STORE_PORT = "TENPLEX_STORE_PORT"
ENV_STORE_ROOT = "TENPLEX_STORE_ROOT"
ENV_STORE_HOST_PATH = "TENPLEX_STORE_HOST_PATH"
ENV_STORE_MEMORY_ROOT = "TENPLEX_STORE_MEMORY_ROOT"
ENV_STORE_MEMORY_HOST_PATH = "TENPLEX_STORE_MEMORY_HOST_PATH"
ENV_WORKER_IMAGE = "TENPLEX_WORKER_IMAGE"
ENV_WORKER_SERVICE_ACCOUNT = "TENPLEX_WORKER_SERVICE_ACCOUNT"
ENV_AUTH_SECRET = "TENPLEX_AUTH_SECRET"
ENV_AUTH_SECRET_KEY = "TENPLEX_AUTH_SECRET_KEY"
ENV_ADVERTISE_URL = "TENPLEX_ADVERTISE_URL"
ENV_TLS_SECRET = "TENPLEX_TLS_SECRET"


@dataclass(frozen=True, slots=True)
class KubernetesSettings:
    """The scheduler's Kubernetes deployment settings; defaults match the chart's defaults."""

    namespace: str = field(metadata={"env": ENV_POD_NAMESPACE})
    """The scheduler's own namespace: where its Lease lives."""
    identity: str = field(metadata={"env": ENV_POD_NAME})
    """This replica's name in leader election (its pod name)."""
    watch_namespaces: tuple[str, ...] = field(default=(), metadata={"env": ENV_WATCH_NAMESPACES})
    """Namespaces whose ElasticJobs to manage; empty means all."""
    leader_election: bool = field(default=True, metadata={"env": ENV_LEADER_ELECTION})
    lease_name: str = field(default=LEADER_LEASE, metadata={"env": ENV_LEASE_NAME})
    lease_duration_seconds: int = field(default=15, metadata={"env": ENV_LEASE_DURATION})
    renew_deadline_seconds: int = field(default=10, metadata={"env": ENV_RENEW_DEADLINE})
    retry_period_seconds: int = field(default=2, metadata={"env": ENV_RETRY_PERIOD})
    store_port: int = field(default=STORE_PORT, metadata={"env": ENV_STORE_PORT})
    store_root: str = field(default=DEFAULT_STORE_ROOT, metadata={"env": ENV_STORE_ROOT})
    store_host_path: str = field(default="", metadata={"env": ENV_STORE_HOST_PATH})
    """The node directory behind the store DaemonSet's volume. When set, worker pods mount it at
    ``store_root`` and snapshot into it directly (``TENPLEX_STORE_ROOT``), sharing it with the daemon;
    when empty they upload to the daemon over HTTP."""
    store_memory_root: str = field(default="/var/lib/tenplex/memory", metadata={"env": ENV_STORE_MEMORY_ROOT})
    store_memory_host_path: str = field(default="", metadata={"env": ENV_STORE_MEMORY_HOST_PATH})
    """The node tmpfs directory of the store's memory tier (the chart's ``store.memory``). When set (with
    ``store_host_path``), worker pods mount it at ``store_memory_root``, where the daemon sees it too, and
    write their snapshots into that memory (``TENPLEX_STORE_MEMORY_ROOT``); empty: no memory tier."""
    worker_image: str = field(default="", metadata={"env": ENV_WORKER_IMAGE})
    """Image for workers whose ElasticJob names none (the chart passes its own image)."""
    worker_service_account: str = field(default="", metadata={"env": ENV_WORKER_SERVICE_ACCOUNT})
    auth_secret: str = field(default="", metadata={"env": ENV_AUTH_SECRET})
    """Secret (in the job's namespace) whose ``auth_secret_key`` worker pods read TENPLEX_TOKEN from."""
    auth_secret_key: str = field(default="token", metadata={"env": ENV_AUTH_SECRET_KEY})
    advertise_url: str = field(default="", metadata={"env": ENV_ADVERTISE_URL})
    """The scheduler's URL as worker pods reach it (the chart's Service); must outlive a scheduler pod."""
    tls_secret: str = field(default="", metadata={"env": ENV_TLS_SECRET})
    """The chart's TLS Secret (``tls.secretName``): the stores serve HTTPS (their URLs are ``https://``) and worker
    pods mount its ``ca.crt`` (from the Secret of that name in their namespace) to verify them and the scheduler;
    empty: plain HTTP."""

    def __post_init__(self) -> None:
        if not self.namespace:
            raise InvalidConfig(f"{ENV_POD_NAMESPACE} is empty: the scheduler needs its namespace for the Lease")
        if not self.identity:
            raise InvalidConfig(f"{ENV_POD_NAME} is empty: the scheduler needs an identity for leader election")
        if not 0 < self.store_port < 65536:
            raise InvalidConfig(f"{ENV_STORE_PORT} must be a port in 1..65535, got {self.store_port}")
        if self.advertise_url and not self.advertise_url.startswith(("http://", "https://")):
            raise InvalidConfig(f"{ENV_ADVERTISE_URL} must be an http(s) URL, got {self.advertise_url!r}")
        if not self.store_root.startswith("/"):
            raise InvalidConfig(f"{ENV_STORE_ROOT} must be an absolute path, got {self.store_root!r}")
        if self.store_host_path and not self.store_host_path.startswith("/"):
            raise InvalidConfig(f"{ENV_STORE_HOST_PATH} must be an absolute path, got {self.store_host_path!r}")
        if self.store_memory_host_path and not self.store_memory_host_path.startswith("/"):
            raise InvalidConfig(f"{ENV_STORE_MEMORY_HOST_PATH} must be an absolute path, got {self.store_memory_host_path!r}")
        if self.store_memory_host_path and not self.store_memory_root.startswith("/"):
            raise InvalidConfig(f"{ENV_STORE_MEMORY_ROOT} must be an absolute path, got {self.store_memory_root!r}")
        if self.store_memory_host_path and not self.store_host_path:
            raise InvalidConfig(f"{ENV_STORE_MEMORY_HOST_PATH} needs {ENV_STORE_HOST_PATH}: workers write into the "
                                "memory tier only where they mount the store's directory")
        if self.leader_election and not (
            self.lease_duration_seconds > self.renew_deadline_seconds > 1.2 * self.retry_period_seconds >= 1.2
        ):
            raise InvalidConfig(
                f"leader election needs lease duration > renew deadline > 1.2 x retry period >= 1.2 s, got "
                f"{self.lease_duration_seconds} s, {self.renew_deadline_seconds} s, {self.retry_period_seconds} s"
            )

    def manages(self, namespace: str) -> bool:
        return not self.watch_namespaces or namespace in self.watch_namespaces

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KubernetesSettings:
        """The settings the variables in ``environ`` (default ``os.environ``) give; an unset or empty one leaves
        its field's default (the chart's)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {"namespace": "", "identity": ""}
        for f in fields(cls):
            name, raw = f.metadata["env"], env.get(f.metadata["env"], "")
            if raw == "":
                continue
            if f.type == "int":
                try:
                    values[f.name] = int(raw)
                except ValueError:
                    raise InvalidConfig(f"{name} must be an integer, got {raw!r}") from None
            elif f.type == "bool":
                if raw.strip().lower() not in ("true", "false"):
                    raise InvalidConfig(f"{name} must be true or false, got {raw!r}")
                values[f.name] = raw.strip().lower() == "true"
            elif f.name == "watch_namespaces":
                values[f.name] = tuple(ns.strip() for ns in raw.split(",") if ns.strip())
            else:
                values[f.name] = raw.rstrip("/") if f.name == "advertise_url" else raw
        return cls(**values)


SCHEDULER_ENV = (*(f.metadata["env"] for f in fields(KubernetesSettings)), ENV_TOKEN, ENV_AUTH_KEYS)
"""Every variable the chart sets on the scheduler container: the settings', the admin token and the key set."""
