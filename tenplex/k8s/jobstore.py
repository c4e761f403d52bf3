"""Job state on Kubernetes: the ElasticJob's status, plus ConfigMaps the job owns.

:class:`KubeJobStore` is a :class:`tenplex.scheduler.state.JobStore`, as the state
directory of the local backend is, so the job controllers run unchanged on
Kubernetes and a restarted (or newly elected) scheduler resumes every job from
the API server alone:

* ``status`` of the ElasticJob (the status subresource) is what people and
  tools read: phase, GPUs, parallel configuration, step, version, the worker
  selector (for the scale subresource), conditions, the last reconfiguration
  and ``observedGeneration`` (the spec generation the scheduler has acted on).
  The CRD's status schema is strict and small on purpose, so it is a view.
* The full internal :class:`~tenplex.scheduler.state.JobStatus` and the
  :class:`~tenplex.scheduler.state.JobSpec` the job was created with live,
  gzip-compressed, in the ConfigMap ``<job>-tenplex-state`` (``binaryData``
  ``status.json.gz`` and ``spec.json.gz``).
* The PTC of each generation still needed is gzip-compressed JSON cut into
  chunks of at most ``ptc_chunk_bytes`` (512 KiB: 683 KiB in base64, below the
  API server's 1 MiB object limit with room for the metadata), one ConfigMap
  each: ``<job>-tenplex-ptc-g<N>`` holds the first chunk and says how many
  there are and the whole's SHA-256; ``<job>-tenplex-ptc-g<N>-<i>`` the others.
  The other chunks are written first, the head last, so a head is never read
  whose chunks are missing; and the PTC before the record that refers to it. A
  PTC is written once per generation and read back only after a restart. Sizes:
  a 405B GPT with ZeRO-1 on 16,384 GPUs (149,708 shards) is 14.5 MB of JSON,
  770 KB gzipped: two ConfigMaps. Generations no longer referenced by the
  status are deleted (head first, so a half-deleted one is never read).
* The plan of a reconfiguration is not stored: the record keeps what it is
  computed from (:mod:`tenplex.scheduler.plans`), and the workers as one
  compact table. The record of a 405B job on 16,384 GPUs is about 40 KB stored.

Every ConfigMap carries an ownerReference to the ElasticJob, so deleting the
job removes them with its pods. The internal status is written before the
ElasticJob's status, so the view never runs ahead of the truth.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client

from tenplex.core.units import human_bytes
from tenplex.core.version import Version
from tenplex.errors import InvalidConfig, NotFound
from tenplex.k8s import crd
from tenplex.k8s.informer import Handler, Informer
from tenplex.k8s.settings import KubernetesSettings
from tenplex.ptc import PTC
from tenplex.scheduler.jobspec import CRD_FIELD_NAMES
from tenplex.scheduler.state import JobSpec, JobStatus, JobStore, Phase, check_job_name

log = logging.getLogger(__name__)

STATE_SUFFIX = "-tenplex-state"
PTC_SUFFIX = "-tenplex-ptc-g"
LABEL_STATE = "tenplex.io/state"
CONFIGMAP_LIMIT = 1 << 20
"""The API server's limit on one object (etcd request size): keep every ConfigMap below it."""
PTC_CHUNK_BYTES = 512 << 10
"""Compressed PTC bytes per ConfigMap (base64 makes 683 KiB of them)."""
PTC_KEY = "ptc.json.gz"
_PTC_NAME = re.compile(r"^(?P<job>.+)-tenplex-ptc-g(?P<gen>\d+)(?:-(?P<chunk>\d+))?$")

Condition = crd.Condition


def state_configmap(job: str) -> str:
    return f"{job}{STATE_SUFFIX}"


def ptc_configmap(job: str, generation: int, chunk: int = 0) -> str:
    """The ConfigMap of one chunk of a generation's PTC (chunk 0: the head, which names the others)."""
    return f"{job}{PTC_SUFFIX}{generation}" + (f"-{chunk}" if chunk else "")


def _pack(obj: Any) -> str:
    return base64.b64encode(gzip.compress(json.dumps(obj, separators=(",", ":")).encode(), 6)).decode()


def _unpack(text: str) -> Any:
    return json.loads(gzip.decompress(base64.b64decode(text)))


def ptc_chunks(job: str, generation: int, ptc: PTC,
               chunk_bytes: int = PTC_CHUNK_BYTES) -> list[tuple[str, dict[str, str], dict[str, str] | None]]:
    """The ConfigMaps (name, binaryData, data) that hold a generation's PTC, the head first (see the module
    doc)."""
    blob = gzip.compress(ptc.dumps().encode(), 6)
    chunks = [blob[i:i + chunk_bytes] for i in range(0, len(blob), chunk_bytes)] or [b""]
    head = {"chunks": str(len(chunks)), "sha256": hashlib.sha256(blob).hexdigest()}
    return [(ptc_configmap(job, generation, i), {PTC_KEY: base64.b64encode(c).decode()}, head if i == 0 else None)
            for i, c in enumerate(chunks)]


def state_data(spec: JobSpec, status: JobStatus) -> dict[str, str]:
    """The binaryData of the ``<job>-tenplex-state`` ConfigMap: the record, gzip-compressed."""
    return {"status.json.gz": _pack(status.to_record()), "spec.json.gz": _pack(spec.to_json())}


def owned_configmap(job_obj: Mapping[str, Any], name: str, data: Mapping[str, str],
                    text: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A ConfigMap owned by the ElasticJob ``job_obj``; InvalidConfig when it would pass the object limit."""
    size = sum(len(v) for v in data.values()) + sum(len(v) for v in (text or {}).values())
    if size >= CONFIGMAP_LIMIT - 4096:
        raise InvalidConfig(f"ConfigMap {name} would hold {size} bytes, over the API server's 1 MiB object limit")
    meta = job_obj["metadata"]
    body: dict[str, Any] = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": meta["namespace"],
                     "labels": {crd.LABEL_JOB: meta["name"], LABEL_STATE: "true"},
                     "ownerReferences": [crd.owner_reference(job_obj)]},
        "binaryData": dict(data),
    }
    if text:
        body["data"] = dict(text)
    return body


class ElasticJobIndex:
    """The ElasticJobs this scheduler manages, watched; jobs are looked up by name.

    Job names are cluster-unique for the scheduler (its REST API, worker ids and
    store keys use the bare name); an ElasticJob whose name is already taken in
    another namespace is refused by the operator.
    """

    def __init__(self, api_client: client.ApiClient, settings: KubernetesSettings, *, watch_timeout: int = 60) -> None:
        self.custom = client.CustomObjectsApi(api_client)
        self.settings = settings
        if settings.watch_namespaces:
            # One watch per namespace: with a Role in each (the chart's namespaced mode) a cluster-wide list is forbidden.
            self.informers = [
                Informer(f"elasticjobs-{ns}", functools.partial(self.custom.list_namespaced_custom_object, crd.GROUP,
                                                                 crd.VERSION, ns, crd.PLURAL), watch_timeout=watch_timeout)
                for ns in sorted(set(settings.watch_namespaces))]
        else:
            self.informers = [Informer("elasticjobs", functools.partial(
                self.custom.list_cluster_custom_object, crd.GROUP, crd.VERSION, crd.PLURAL), watch_timeout=watch_timeout)]

    def start(self) -> None:
        for inf in self.informers:
            inf.start()

    def stop(self) -> None:
        for inf in self.informers:
            inf.stop()

    def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(inf.wait_synced(max(0.0, deadline - time.monotonic())) for inf in self.informers)

    def add_handler(self, handler: Handler) -> None:
        for inf in self.informers:
            inf.add_handler(handler)

    @property
    def relists(self) -> int:
        """Lists made by the ElasticJob watches (one each at the start, one more per watch that could not resume)."""
        return sum(inf.relists for inf in self.informers)

    def all(self) -> list[dict[str, Any]]:
        """Managed ElasticJobs, oldest first (the first of two with one name keeps it)."""
        items = [o for inf in self.informers for o in inf.items()
                 if self.settings.manages(o["metadata"].get("namespace", ""))]
        return sorted(items, key=lambda o: (o["metadata"].get("creationTimestamp") or "", o["metadata"]["namespace"]))

    def find(self, name: str) -> dict[str, Any] | None:
        for obj in self.all():
            if obj["metadata"]["name"] == name:
                return obj
        return None

    def get(self, name: str) -> dict[str, Any]:
        obj = self.find(name)
        if obj is None:
            raise NotFound(f"no ElasticJob named {name!r} in the namespaces this scheduler manages")
        return obj


class KubeJobStore(JobStore):
    """The job store in the API server (see the module docstring)."""

    def __init__(self, api_client: client.ApiClient, jobs: ElasticJobIndex, root: str | Path, *,
                 ptc_chunk_bytes: int = PTC_CHUNK_BYTES) -> None:
        if not 0 < ptc_chunk_bytes <= (CONFIGMAP_LIMIT - (64 << 10)) * 3 // 4:
            raise InvalidConfig(f"ptc_chunk_bytes must be between 1 and {(CONFIGMAP_LIMIT - (64 << 10)) * 3 // 4} "
                                f"(base64 of it must fit a ConfigMap), got {ptc_chunk_bytes}")
        self.ptc_chunk_bytes = ptc_chunk_bytes
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.jobs = jobs
        self.root = Path(root)
        """A local directory (the interface's): worker logs are not kept here on Kubernetes (``kubectl logs``)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._observed: dict[str, int] = {}
        self._extra_conditions: dict[str, dict[str, Condition]] = {}
        self._ptc_generations: dict[str, set[int]] = {}
        self._seen: dict[str, tuple[str, int]] = {}
        """Job -> (phase, finished reconfigurations) at its last save: what the Events report changes of."""

    # -- what the operator adds to the status -------------------------------------------

    def set_observed_generation(self, name: str, generation: int) -> None:
        with self._lock:
            self._observed[name] = generation

    def observed_generation(self, name: str) -> int | None:
        with self._lock:
            return self._observed.get(name)

    def set_condition(self, name: str, condition: Condition) -> None:
        """A condition besides those that follow from the phase (e.g. a refused scale request)."""
        with self._lock:
            self._extra_conditions.setdefault(name, {})[condition.type] = condition

    def clear_condition(self, name: str, condition_type: str) -> None:
        """Stop overriding ``condition_type`` (:meth:`set_condition`): the status shows it as derived again."""
        with self._lock:
            self._extra_conditions.get(name, {}).pop(condition_type, None)

    def has_job(self, name: str) -> bool:
        return self.jobs.find(name) is not None

    # -- the JobStore interface ----------------------------------------------------------------

    def _job(self, name: str) -> dict[str, Any]:
        check_job_name(name)
        return self.jobs.get(name)

    def _put(self, job_obj: Mapping[str, Any], name: str, data: Mapping[str, str],
             text: Mapping[str, str] | None = None) -> None:
        """Create the ConfigMap or replace the given keys of the existing one."""
        ns = job_obj["metadata"]["namespace"]
        body = owned_configmap(job_obj, name, data, text)
        try:
            self.core.create_namespaced_config_map(ns, body)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
            patch: dict[str, Any] = {"binaryData": dict(data)}
            if text:
                patch["data"] = dict(text)
            self.core.patch_namespaced_config_map(name, ns, patch, _content_type="application/merge-patch+json")

    def save(self, spec: JobSpec, status: JobStatus) -> None:
        status.updated_at = time.time()
        job_obj = self.jobs.find(check_job_name(spec.name))
        if job_obj is None:
            # The ElasticJob was deleted (its ConfigMaps go with it); the operator is closing this job's
            # controller. Nothing is left to write to.
            log.info("job %s: its ElasticJob is gone; state not saved", spec.name)
            return
        self._put(job_obj, state_configmap(spec.name), state_data(spec, status))
        self._write_status(job_obj, spec, status)
        self._prune_ptcs(job_obj, status)
        self._record_events(job_obj, status)

    def _record_events(self, job_obj: Mapping[str, Any], status: JobStatus) -> None:
        """Kubernetes Events on the ElasticJob (``kubectl describe ej``) for phase changes and finished
        reconfigurations. Only changes seen by this process: a restarted scheduler does not repeat old news."""
        name = job_obj["metadata"]["name"]
        finished = [h for h in status.history if h.finished_at is not None]
        with self._lock:
            previous = self._seen.get(name)
            self._seen[name] = (status.phase.value, len(finished))
        if previous is None:
            return
        phase, done = previous
        for h in finished[done:]:
            if h.error is not None and status.phase == Phase.FAILED:
                continue  # the Failed event says it
            if h.error is not None and h.reason != "failure":  # a planned change a failure cut short
                self._event(job_obj, "Warning", "ReconfigurationInterrupted", f"{h.reason}: {h.error}")
                continue
            self._event(job_obj, "Normal", "Reconfigured",
                        f"{h.reason}: {h.from_config or '-'} ({h.from_gpus} GPUs) -> {h.to_config or '-'} "
                        f"({h.to_gpus} GPUs); downtime {h.downtime_seconds or 0:.1f} s; "
                        f"{human_bytes(h.bytes_remote)} over the network (lower bound "
                        f"{human_bytes(h.lower_bound_bytes)}), {human_bytes(h.bytes_local)} local; "
                        f"{h.steps_lost} steps lost")
        if status.phase.value != phase:
            self._event(job_obj, "Warning" if status.phase == Phase.FAILED else "Normal", status.phase.value,
                        status.message)

    def _event(self, job_obj: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        meta = job_obj["metadata"]
        now = crd.now_rfc3339()
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid")},
            "type": kind, "reason": reason, "message": message[:1024],
            "source": {"component": "tenplex-scheduler"}, "reportingComponent": "tenplex.io/scheduler",
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], body)
        except client.ApiException as exc:  # events are for people; never fail a job over one
            log.warning("job %s: event %s not recorded: %s %s", meta["name"], reason, exc.status, exc.reason)

    def publish(self, spec: JobSpec, status: JobStatus) -> None:
        """Write only the ElasticJob's status (progress between state changes; the record is saved by ``save``)."""
        job_obj = self.jobs.find(check_job_name(spec.name))
        if job_obj is not None:
            self._write_status(job_obj, spec, status)

    def _write_status(self, job_obj: Mapping[str, Any], spec: JobSpec, status: JobStatus) -> None:
        meta = job_obj["metadata"]
        view = self.status_view(spec.name, status, previous=job_obj.get("status") or {})
        body = {"status": {**{k: None for k in _STATUS_KEYS}, **view.to_dict()}}
        try:
            self.custom.patch_namespaced_custom_object_status(
                crd.GROUP, crd.VERSION, meta["namespace"], crd.PLURAL, meta["name"], body)
        except client.ApiException as exc:
            if exc.status == 404:
                log.info("job %s: the ElasticJob is gone; status not written", spec.name)
                return
            raise

    def status_view(self, name: str, status: JobStatus, previous: Mapping[str, Any]) -> crd.ElasticJobStatus:
        """The ElasticJob status that shows ``status`` (conditions keep their transition times)."""
        phase, message, par = status.phase, status.message[:1000], status.parallel or None
        reconfiguring, failed = phase == Phase.RECONFIGURING, phase == Phase.FAILED
        with self._lock:
            extra = list(self._extra_conditions.get(name, {}).values())
            observed = self._observed.get(name)
        conditions: list[dict[str, Any]] = list(previous.get("conditions") or [])
        for cond in (
            Condition("Ready", str(phase == Phase.RUNNING), reason=phase.value, message=message),
            Condition("Reconfiguring", str(reconfiguring),
                      reason=status.stage.value.capitalize() if reconfiguring and status.stage else "Idle",
                      message=message if reconfiguring else ""),
            Condition("Failed", str(failed), reason="StateLost" if failed else "Healthy",
                      message=message if failed else ""),
            *([spec_condition(status.spec_update, observed)] if status.spec_update is not None else []),
            *extra,
        ):
            conditions = crd.set_condition(conditions, cond)
        last = next((h for h in reversed(status.history) if h.finished_at is not None), None)
        reconf = None
        if last is not None:
            reconf = crd.Reconfiguration(
                reason=last.reason, from_=crd.Side.of(last.from_gpus, _parse_config(last.from_config)),
                to=crd.Side.of(last.to_gpus, _parse_config(last.to_config)),
                downtime_seconds=max(0.0, float(last.downtime_seconds or 0.0)),
                bytes_local=last.bytes_local, bytes_remote=last.bytes_remote, steps_lost=last.steps_lost,
                finished_at=datetime.fromtimestamp(last.finished_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            )
        return crd.ElasticJobStatus(
            phase=phase,
            gpus=status.gpus if phase in (Phase.RUNNING, Phase.RECONFIGURING) else 0,
            parallel=crd.Parallel(par["dp"], par["tp"], par["pp"]) if par else None,
            step=status.step,
            version=status.version,
            selector=crd.worker_selector(name),
            conditions=tuple(conditions),
            last_reconfiguration=reconf,
            observed_generation=observed,
        )

    def save_ptc(self, name: str, generation: int, ptc: PTC) -> None:
        """The PTC as gzip-compressed JSON in chunks, one ConfigMap each (see the module doc): the other chunks
        first, the head (chunk count, SHA-256 of the whole) last."""
        job_obj = self._job(name)
        chunks = ptc_chunks(name, generation, ptc, self.ptc_chunk_bytes)
        for cm_name, data, text in reversed(chunks):  # the head last
            self._put(job_obj, cm_name, data, text)
        log.info("job %s: PTC of generation %d stored in %d ConfigMap%s", name, generation, len(chunks),
                 "s" if len(chunks) > 1 else "")
        with self._lock:
            self._ptc_generations.setdefault(name, set()).add(generation)

    def load_ptc(self, name: str, generation: int) -> PTC:
        job_obj = self._job(name)
        ns = job_obj["metadata"]["namespace"]

        def read(chunk: int) -> Any:
            try:
                return self.core.read_namespaced_config_map(ptc_configmap(name, generation, chunk), ns)
            except client.ApiException as exc:
                if exc.status == 404:
                    if chunk == 0:
                        raise NotFound(f"job {name!r} has no PTC for generation {generation}") from None
                    raise InvalidConfig(f"the PTC of job {name!r} generation {generation} is incomplete: its "
                                        f"ConfigMap {ptc_configmap(name, generation, chunk)} is missing") from None
                raise

        head = read(0)
        text = head.data or {}
        parts = [base64.b64decode((head.binary_data or {})[PTC_KEY])]
        count = int(text.get("chunks", "1"))
        parts.extend(base64.b64decode((read(i).binary_data or {}).get(PTC_KEY, "")) for i in range(1, count))
        blob = b"".join(parts)
        digest = text.get("sha256")
        if digest is not None and hashlib.sha256(blob).hexdigest() != digest:
            raise InvalidConfig(f"the PTC of job {name!r} generation {generation} does not match its checksum "
                                f"(its {count} ConfigMaps are of different writes)")
        return PTC.from_json(json.loads(gzip.decompress(blob)))

    def _prune_ptcs(self, job_obj: Mapping[str, Any], status: JobStatus) -> None:
        """Delete PTCs of generations nothing refers to any more: not the current or next generation, nor
        the generation of the newest committed version or of the version being restored."""
        name = job_obj["metadata"]["name"]
        keep = {status.generation, status.generation + 1}
        for v in (status.version, status.restore_version):
            if v:
                keep.add(status.version_generation.get(v, Version.parse(v).generation))
        with self._lock:
            known = self._ptc_generations.get(name)
        ns = job_obj["metadata"]["namespace"]
        chunks: dict[int, set[int]] = {}
        if known is None or any(g not in keep and g < status.generation for g in known):
            # Which generations and chunks exist (after a restart, or before deleting some).
            cms = self.core.list_namespaced_config_map(ns, label_selector=f"{crd.LABEL_JOB}={name},{LABEL_STATE}=true")
            for cm in cms.items:
                m = _PTC_NAME.match(cm.metadata.name)
                if m is not None and m.group("job") == name:
                    chunks.setdefault(int(m.group("gen")), set()).add(int(m.group("chunk") or 0))
            known = set(chunks)
        drop = {g for g in known if g not in keep and g < status.generation}
        for g in sorted(drop):
            try:
                for chunk in sorted(chunks.get(g, {0})):  # the head first: a half-deleted PTC is never read
                    self._delete_configmap(ptc_configmap(name, g, chunk), ns)
            except client.ApiException as exc:
                log.warning("job %s: could not delete the PTC of generation %d: %s", name, g, exc.reason)
                drop.discard(g)  # looked for again at the next save
                continue
            log.info("job %s: deleted the PTC of generation %d (no longer referenced)", name, g)
        with self._lock:
            self._ptc_generations[name] = known - drop

    def _delete_configmap(self, name: str, ns: str) -> None:
        try:
            self.core.delete_namespaced_config_map(name, ns)
        except client.ApiException as exc:
            if exc.status != 404:
                raise

    def load(self, name: str) -> tuple[JobSpec, JobStatus] | None:
        """The saved spec and status of one job, or None when it was never saved."""
        job_obj = self._job(name)
        try:
            cm = self.core.read_namespaced_config_map(state_configmap(name), job_obj["metadata"]["namespace"])
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        data = cm.binary_data or {}
        if "status.json.gz" not in data or "spec.json.gz" not in data:
            return None
        spec = JobSpec.from_json(_unpack(data["spec.json.gz"]))
        status = JobStatus.from_json(_unpack(data["status.json.gz"]))
        observed = (job_obj.get("status") or {}).get("observedGeneration")
        if observed is not None:
            self.set_observed_generation(name, int(observed))
        return spec, status

    def load_all(self) -> list[tuple[JobSpec, JobStatus]]:
        out = []
        seen: set[str] = set()
        for obj in self.jobs.all():
            name = obj["metadata"]["name"]
            if name in seen:
                continue
            seen.add(name)
            loaded = self.load(name)
            if loaded is not None:
                out.append(loaded)
        return out

    def delete(self, name: str) -> None:
        """Forget the job's state (its ConfigMaps); the ElasticJob itself belongs to the user."""
        obj = self.jobs.find(name)
        if obj is None:
            return  # deleted with its ElasticJob: the garbage collector removes the owned ConfigMaps
        ns = obj["metadata"]["namespace"]
        cms = self.core.list_namespaced_config_map(ns, label_selector=f"{crd.LABEL_JOB}={name},{LABEL_STATE}=true")
        for cm in cms.items:
            self._delete_configmap(cm.metadata.name, ns)
        with self._lock:
            self._ptc_generations.pop(name, None)
            self._observed.pop(name, None)
            self._extra_conditions.pop(name, None)
            self._seen.pop(name, None)


SPEC_CONDITION = "SpecUpdated"
"""The ElasticJob condition about the last change of a live job's spec (see :func:`spec_condition`)."""


def spec_condition(update: Mapping[str, Any], observed: int | None = None) -> Condition:
    """What ``SpecUpdated`` says of a spec change (the record's ``spec_update``): False/RedeployPending until a
    generation runs the new spec, then True/Redeployed, or True/Applied when nothing needed a redeploy (the
    operator says False/Refused of a change it did not take)."""
    fields = ", ".join(CRD_FIELD_NAMES.get(f, f) for f in update.get("fields", ()))
    if update.get("pending"):
        return Condition(SPEC_CONDITION, "False", reason="RedeployPending", observed_generation=observed,
                         message=f"changed {fields}: the workers are redeployed with it at the next step boundary")
    if update.get("redeploy"):
        return Condition(SPEC_CONDITION, "True", reason="Redeployed", observed_generation=observed,
                         message=f"changed {fields}: redeployed, generation {update.get('generation')} runs it")
    return Condition(SPEC_CONDITION, "True", reason="Applied", observed_generation=observed,
                     message=f"changed {fields}: applied without a redeploy")


_STATUS_KEYS = ("phase", "gpus", "parallel", "step", "version", "selector", "conditions", "lastReconfiguration",
                "observedGeneration")


def _parse_config(text: str | None) -> crd.Parallel | None:
    """``dp2 x tp1 x pp2[, ...]`` (ParallelConfig.describe) -> Parallel."""
    if not text:
        return None
    m = re.match(r"dp(\d+) x tp(\d+) x pp(\d+)", text)
    return crd.Parallel(int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None
