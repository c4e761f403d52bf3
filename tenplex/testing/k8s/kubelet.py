"""A test kubelet: runs the pods bound to one node as local processes.

End-to-end tests of the Kubernetes backend need pods that really run: the
workers of an ElasticJob train, the store daemon of a node serves. This
kubelet watches, through the official client over HTTP (so against the API
emulator or any API server), the pods whose ``spec.nodeName`` is its node,
and for each one starts the first container's ``command + args`` as a local
process, with the container's environment resolved as a kubelet does:
plain values, the downward API (``fieldRef`` to ``status.hostIP``,
``status.podIP``, ``metadata.name``, ``metadata.namespace``, ``spec.nodeName``,
labels and annotations), ``secretKeyRef``/``configMapKeyRef``, and ``$(VAR)``
references to earlier entries. It reports the pod Running, then Succeeded or
Failed with the exit code when the process ends, and terminates the process
(SIGTERM, then SIGKILL after the grace period) when the pod is deleted.
As a container ends with its main process, whatever that process started and
left behind (in its process group) is killed when it exits: the ranks of a
multi-GPU worker pod do not outlive their killed launcher.

The image is not pulled: the process runs with this machine's Python, and a
container without ``command`` runs the local stand-in given for its image's
ENTRYPOINT. Resources are ignored: a node is emulated by an address such as 127.0.0.2, where the
test also runs that node's store daemon. Watch expiry (410 Gone) and dropped
watches are handled by listing again, the pattern every controller needs.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, watch

LOG = logging.getLogger(__name__)
STATUS_RETRY_SECONDS = 60.0

_VAR_RE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined variables are replaced, undefined ones kept, ``$$`` escapes."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR_RE.sub(sub, value)


@dataclass
class _Running:
    uid: str
    namespace: str
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    grace_seconds: float
    deleted: bool = False


class LocalKubelet:
    """Runs the pods bound to ``node`` as processes on this machine (see the module docstring)."""

    def __init__(self, api_client: client.ApiClient, node: str, host_ip: str, workdir: Path,
                 base_env: Mapping[str, str] | None = None, cwd: Path | None = None,
                 entrypoints: Mapping[str, Sequence[str]] | None = None) -> None:
        """``entrypoints`` maps an image to the local command standing in for its ENTRYPOINT,
        used when a container gives only ``args`` (e.g. ``{"tenplex:0.1.0": [".venv/bin/tenplex"]}``)."""
        self._core = client.CoreV1Api(api_client)
        self.node = node
        self.host_ip = host_ip
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._base_env = dict(base_env if base_env is not None else os.environ)
        self._cwd = cwd
        self._entrypoints = {image: list(cmd) for image, cmd in (entrypoints or {}).items()}
        self._pods: dict[str, _Running] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> LocalKubelet:
        self._thread = threading.Thread(target=self._loop, name=f"kubelet-{self.node}", daemon=True)
        self._thread.start()
        return self

    def stop(self, kill_pods: bool = True) -> None:
        """Stop watching and, by default, kill the pods' processes (as a lost node loses them)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if kill_pods:
            with self._lock:
                running = list(self._pods.values())
            for pod in running:
                if pod.process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pod.process.pid, signal.SIGKILL)
                    pod.process.wait(timeout=10)

    def __enter__(self) -> LocalKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what tests look at ---------------------------------------------------------

    def pid(self, name: str, namespace: str = "default") -> int | None:
        with self._lock:
            for pod in self._pods.values():
                if (pod.namespace, pod.name) == (namespace, name) and pod.process.poll() is None:
                    return pod.process.pid
        return None

    def kill(self, name: str, namespace: str = "default", sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a pod's process (a crash: the kubelet then reports the pod Failed)."""
        pid = self.pid(name, namespace)
        if pid is None:
            raise KeyError(f"no running process for pod {namespace}/{name} on node {self.node}")
        os.kill(pid, sig)

    def log_path(self, name: str, namespace: str = "default") -> Path:
        return self.workdir / f"{namespace}_{name}.log"

    # -- the watch loop ---------------------------------------------------------------

    def _loop(self) -> None:
        selector = f"spec.nodeName={self.node}"
        while not self._stop.is_set():
            try:
                listed = self._core.list_pod_for_all_namespaces(field_selector=selector)
                for pod in listed.items:
                    self._sync(pod, deleted=False)
                self._watch = watch.Watch()
                for event in self._watch.stream(self._core.list_pod_for_all_namespaces, field_selector=selector,
                                                resource_version=listed.metadata.resource_version, timeout_seconds=30):
                    if self._stop.is_set():
                        break
                    self._sync(event["object"], deleted=event["type"] == "DELETED")
            except client.ApiException as exc:
                if exc.status != 410:
                    LOG.warning("kubelet %s: API error %s, listing again: %s", self.node, exc.status, exc.reason)
                    self._stop.wait(0.5)
            except Exception as exc:  # the API server may be gone at shutdown; keep trying until stopped
                if not self._stop.is_set():
                    LOG.warning("kubelet %s: watch failed (%s), listing again", self.node, exc)
                    self._stop.wait(0.5)

    def _sync(self, pod: client.V1Pod, deleted: bool) -> None:
        uid = pod.metadata.uid
        with self._lock:
            running = self._pods.get(uid)
        if deleted or pod.metadata.deletion_timestamp is not None:
            if running is not None and not running.deleted:
                running.deleted = True
                threading.Thread(target=self._terminate, args=(running,), daemon=True).start()
            return
        if running is None and pod.status is not None and pod.status.phase == "Pending":
            self._launch(pod)

    # -- running a pod ----------------------------------------------------------------

    def _launch(self, pod: client.V1Pod) -> None:
        meta, spec = pod.metadata, pod.spec
        container = spec.containers[0]
        try:
            env = self._environment(pod, container)
            command = list(container.command or [])
            if not command:
                if container.image not in self._entrypoints:
                    raise ValueError(f"container {container.name} has no command and image {container.image!r} has no "
                                     f"local entry point (known: {sorted(self._entrypoints)})")
                command = self._entrypoints[container.image]
            argv = [expand(a, env) for a in [*command, *(container.args or [])]]
        except (ValueError, KeyError, client.ApiException) as exc:
            LOG.error("kubelet %s: cannot start pod %s/%s: %s", self.node, meta.namespace, meta.name, exc)
            self._report_failed_start(pod, str(exc))
            return
        log_path = self.log_path(meta.name, meta.namespace)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(argv, env={**self._base_env, **env}, stdout=log, stderr=subprocess.STDOUT,
                                       cwd=self._cwd, start_new_session=True)
        grace = float(spec.termination_grace_period_seconds if spec.termination_grace_period_seconds is not None else 30)
        running = _Running(meta.uid, meta.namespace, meta.name, process, log_path, grace)
        with self._lock:
            self._pods[meta.uid] = running
        LOG.info("kubelet %s: pod %s/%s started as pid %d: %s", self.node, meta.namespace, meta.name, process.pid, argv)
        self._patch_status(running, {
            "phase": "Running", "hostIP": self.host_ip, "podIP": self.host_ip, "startTime": _now(),
            "conditions": [{"type": t, "status": "True", "lastTransitionTime": _now()}
                           for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
            "containerStatuses": [{"name": container.name, "image": container.image or "", "imageID": "", "ready": True,
                                   "restartCount": 0, "started": True, "state": {"running": {"startedAt": _now()}}}],
        })
        threading.Thread(target=self._reap, args=(running, container), daemon=True).start()

    def _reap(self, running: _Running, container: client.V1Container) -> None:
        code = running.process.wait()
        _kill_leftovers(running.process.pid)
        if running.deleted:
            return
        phase = "Succeeded" if code == 0 else "Failed"
        reason = "Completed" if code == 0 else ("Error" if code > 0 else f"Signal{-code}")
        LOG.info("kubelet %s: pod %s/%s exited with %d -> %s", self.node, running.namespace, running.name, code, phase)
        exit_code = code if code >= 0 else 128 - code
        self._patch_status(running, {
            "phase": phase, "reason": reason,
            "conditions": [{"type": t, "status": "False" if t in ("Ready", "ContainersReady") else "True",
                            "lastTransitionTime": _now()} for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
            "containerStatuses": [{"name": container.name, "image": container.image or "", "imageID": "", "ready": False,
                                   "restartCount": 0, "started": False,
                                   "state": {"terminated": {"exitCode": exit_code, "reason": reason, "finishedAt": _now()}}}],
        })

    def _terminate(self, running: _Running) -> None:
        process = running.process
        if process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=running.grace_seconds)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        LOG.info("kubelet %s: pod %s/%s deleted, process %d ended", self.node, running.namespace, running.name, process.pid)

    def _patch_status(self, running: _Running, status: dict[str, Any]) -> None:
        """Report a pod's status; a dropped connection or a 5xx is retried (as a kubelet does) for a minute.

        A lost report would leave a dead worker's pod Running for the
        scheduler, so giving up after one failed request is not an option;
        the retries end when the kubelet stops (the API server may be gone).
        """
        delay, deadline = 0.1, time.monotonic() + STATUS_RETRY_SECONDS
        while True:
            try:
                self._core.patch_namespaced_pod_status(running.name, running.namespace, {"status": status})
                return
            except client.ApiException as exc:
                if exc.status == 404:  # a pod deleted meanwhile has no status to report
                    return
                if exc.status < 500:
                    LOG.warning("kubelet %s: status of %s/%s not reported: %s", self.node, running.namespace,
                                running.name, exc.reason)
                    return
                problem = f"API error {exc.status} {exc.reason}"
            except urllib3.exceptions.HTTPError as exc:  # connection refused or reset
                problem = str(exc)
            if self._stop.is_set() or time.monotonic() > deadline:
                LOG.warning("kubelet %s: status of %s/%s not reported: %s", self.node, running.namespace,
                            running.name, problem)
                return
            LOG.warning("kubelet %s: status of %s/%s not reported yet (%s), retrying", self.node, running.namespace,
                        running.name, problem)
            self._stop.wait(delay)
            delay = min(2.0, delay * 2)

    def _report_failed_start(self, pod: client.V1Pod, message: str) -> None:
        try:
            self._core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {
                "status": {"phase": "Failed", "reason": "CreateContainerConfigError", "message": message}})
        except client.ApiException as exc:
            LOG.warning("kubelet %s: could not report the failed start of %s: %s", self.node, pod.metadata.name, exc.reason)

    # -- environment ----------------------------------------------------------------------

    def _environment(self, pod: client.V1Pod, container: client.V1Container) -> dict[str, str]:
        env: dict[str, str] = {}
        for var in container.env or []:
            if var.value is not None:
                env[var.name] = expand(var.value, env)
            elif var.value_from is not None:
                env[var.name] = self._value_from(pod, var.name, var.value_from)
            else:
                env[var.name] = ""
        return env

    def _value_from(self, pod: client.V1Pod, name: str, source: client.V1EnvVarSource) -> str:
        if source.field_ref is not None:
            path = source.field_ref.field_path
            fields = {"status.hostIP": self.host_ip, "status.podIP": self.host_ip, "metadata.name": pod.metadata.name,
                      "metadata.namespace": pod.metadata.namespace, "spec.nodeName": self.node,
                      "metadata.uid": pod.metadata.uid, "spec.serviceAccountName": pod.spec.service_account_name or ""}
            if path in fields:
                return str(fields[path])
            m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
            if m:
                return str((getattr(pod.metadata, m.group(1)) or {}).get(m.group(2), ""))
            raise ValueError(f"env {name}: fieldRef {path!r} is not supported by the test kubelet")
        if source.secret_key_ref is not None:
            ref = source.secret_key_ref
            secret = self._core.read_namespaced_secret(ref.name, pod.metadata.namespace)
            if ref.key in (secret.data or {}):
                return base64.b64decode(secret.data[ref.key]).decode()
            if ref.key in (secret.string_data or {}):
                return str(secret.string_data[ref.key])
            raise KeyError(f"env {name}: secret {ref.name} has no key {ref.key!r}")
        if source.config_map_key_ref is not None:
            ref = source.config_map_key_ref
            data = self._core.read_namespaced_config_map(ref.name, pod.metadata.namespace).data or {}
            if ref.key not in data:
                raise KeyError(f"env {name}: configmap {ref.name} has no key {ref.key!r}")
            return str(data[ref.key])
        raise ValueError(f"env {name}: this kind of valueFrom is not supported by the test kubelet")


def _kill_leftovers(pgid: int) -> None:
    """SIGKILL what remains of a pod's process group once its main process is gone (a container's end)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.02, what: str = "condition") -> Any:
    """Poll ``predicate()`` until it returns something truthy; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
