"""What the Helm chart tells the scheduler's Kubernetes backend, through its environment.

The chart's scheduler Deployment sets these variables (a test renders the
chart and parses them with :meth:`KubernetesSettings.from_env`, so the two
cannot drift apart). The backend reads them once at start-up; a bad value is
a clear error naming the variable, not a crash later.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

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

SCHEDULER_ENV = (
    ENV_TOKEN, ENV_POD_NAME, ENV_POD_NAMESPACE, ENV_WATCH_NAMESPACES, ENV_LEADER_ELECTION, ENV_LEASE_NAME,
    ENV_LEASE_DURATION, ENV_RENEW_DEADLINE, ENV_RETRY_PERIOD, ENV_STORE_PORT, ENV_STORE_ROOT, ENV_STORE_HOST_PATH, ENV_WORKER_IMAGE,
    ENV_STORE_MEMORY_ROOT, ENV_STORE_MEMORY_HOST_PATH, ENV_WORKER_SERVICE_ACCOUNT, ENV_AUTH_SECRET, ENV_AUTH_SECRET_KEY, ENV_ADVERTISE_URL,
    ENV_AUTH_KEYS, ENV_TLS_SECRET,
)
"""Every variable the chart sets on the scheduler container."""


@dataclass(frozen=True, slots=True)
class KubernetesSettings:
    """The scheduler's Kubernetes deployment settings; defaults match the chart's defaults."""

    namespace: str
    """The scheduler's own namespace: where its Lease lives."""
    identity: str
    """This replica's name in leader election (its pod name)."""
    watch_namespaces: tuple[str, ...] = ()
    """Namespaces whose ElasticJobs to manage; empty means all."""
    leader_election: bool = True
    lease_name: str = LEADER_LEASE
    lease_duration_seconds: int = 15
    renew_deadline_seconds: int = 10
    retry_period_seconds: int = 2
    store_port: int = STORE_PORT
    store_root: str = DEFAULT_STORE_ROOT
    store_host_path: str = ""
    """The node directory behind the store DaemonSet's volume. When set, worker pods mount it at
    ``store_root`` and snapshot into it directly (``TENPLEX_STORE_ROOT``), sharing it with the daemon;
    when empty they upload to the daemon over HTTP."""
    store_memory_root: str = "/var/lib/tenplex/memory"
    store_memory_host_path: str = ""
    """The node tmpfs directory of the store's memory tier (the chart's ``store.memory``). When set (with
    ``store_host_path``), worker pods mount it at ``store_memory_root``, where the daemon sees it too, and
    write their snapshots into that memory (``TENPLEX_STORE_MEMORY_ROOT``); empty: no memory tier."""
    worker_image: str = ""
    """Image for workers whose ElasticJob names none (the chart passes its own image)."""
    worker_service_account: str = ""
    auth_secret: str = ""
    """Secret (in the job's namespace) whose ``auth_secret_key`` worker pods read TENPLEX_TOKEN from."""
    auth_secret_key: str = "token"
    advertise_url: str = ""
    """The scheduler's URL as worker pods reach it (the chart's Service); must outlive a scheduler pod."""
    tls_secret: str = ""
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
        env = os.environ if environ is None else environ

        def integer(name: str, default: int) -> int:
            raw = env.get(name, "")
            if raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise InvalidConfig(f"{name} must be an integer, got {raw!r}") from None

        raw_le = env.get(ENV_LEADER_ELECTION, "true").strip().lower()
        if raw_le not in ("true", "false"):
            raise InvalidConfig(f"{ENV_LEADER_ELECTION} must be true or false, got {env.get(ENV_LEADER_ELECTION)!r}")
        watch = tuple(ns.strip() for ns in env.get(ENV_WATCH_NAMESPACES, "").split(",") if ns.strip())
        return cls(
            namespace=env.get(ENV_POD_NAMESPACE, ""),
            identity=env.get(ENV_POD_NAME, ""),
            watch_namespaces=watch,
            leader_election=raw_le == "true",
            lease_name=env.get(ENV_LEASE_NAME) or LEADER_LEASE,
            lease_duration_seconds=integer(ENV_LEASE_DURATION, 15),
            renew_deadline_seconds=integer(ENV_RENEW_DEADLINE, 10),
            retry_period_seconds=integer(ENV_RETRY_PERIOD, 2),
            store_port=integer(ENV_STORE_PORT, STORE_PORT),
            store_root=env.get(ENV_STORE_ROOT) or DEFAULT_STORE_ROOT,
            store_host_path=env.get(ENV_STORE_HOST_PATH, ""),
            store_memory_root=env.get(ENV_STORE_MEMORY_ROOT) or "/var/lib/tenplex/memory",
            store_memory_host_path=env.get(ENV_STORE_MEMORY_HOST_PATH, ""),
            worker_image=env.get(ENV_WORKER_IMAGE, ""),
            worker_service_account=env.get(ENV_WORKER_SERVICE_ACCOUNT, ""),
            auth_secret=env.get(ENV_AUTH_SECRET, ""),
            auth_secret_key=env.get(ENV_AUTH_SECRET_KEY) or "token",
            advertise_url=env.get(ENV_ADVERTISE_URL, "").rstrip("/"),
            tls_secret=env.get(ENV_TLS_SECRET, ""),
        )
