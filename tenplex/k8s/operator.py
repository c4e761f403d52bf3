"""The ElasticJob operator: the scheduler driven by the Kubernetes API.

:class:`KubernetesScheduler` is the scheduler service of
:mod:`tenplex.scheduler.service` on the Kubernetes backend with its state in
the API server (:mod:`tenplex.k8s.jobstore`). Its :class:`ElasticJobOperator`

* holds the Lease ``tenplex-scheduler`` (coordination.k8s.io/v1) through the
  official client's leader election: a replica that does not hold it does
  nothing but wait for it, so two replicas never act on one job; a leader
  that fails to renew stops acting at once (``serve`` exits with status 1,
  so that Kubernetes restarts it as a follower);
* once leading, resumes every job from the API server (status ConfigMaps),
  then watches ElasticJobs: a new one is created as a job, a change of
  ``spec.gpus`` (``kubectl scale elasticjob/NAME --replicas=N`` goes through the
  scale subresource) becomes a scale request, any other change of the spec
  (``kubectl apply``) replaces the job's spec: what only the scheduler reads
  at once, what the workers start with by a redeploy at the next step boundary
  (with the scale, if one came along, as one reconfiguration); the API server
  refuses a change of what the state is (the CRD's transition rules), and the
  scheduler what they cannot see. A deleted one is deleted.
  ``metadata.generation`` against the ``status.observedGeneration`` it
  recorded makes the handling idempotent: replays, relists after 410 Gone and
  restarts do not repeat a scale request;
* turns what the pod and node watches see into prompt action: a failed or
  deleted worker pod or a NotReady node wakes the job's controller (which
  fails over from the survivors' newest version); a cordoned node asks the
  jobs on it for a planned redeployment off it (stop at a step boundary,
  snapshot, then move), so its state is pulled before its pods go. A
  PodDisruptionBudget (``maxUnavailable: 0``) on each job's worker pods makes
  ``kubectl drain`` wait for that instead of evicting the workers first.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import urllib3
from kubernetes import client
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

from tenplex.core.auth import ENV_AUTH_KEYS, Issuer, KeySet
from tenplex.errors import InvalidConfig, NotFound, NotLeader, StoreUnavailable, TenplexError
from tenplex.k8s import crd
from tenplex.k8s.apiclient import CONNECT_TIMEOUT_S, timeouts_of, with_timeouts
from tenplex.k8s.backend import STOP_MARGIN_SECONDS, ClusterEvent, KubernetesBackend
from tenplex.k8s.jobstore import SPEC_CONDITION, ElasticJobIndex, KubeJobStore
from tenplex.k8s.settings import ENV_ADVERTISE_URL, KubernetesSettings
from tenplex.scheduler.controller import JobController, SchedulerSettings
from tenplex.scheduler.jobspec import MAX_GPUS
from tenplex.scheduler.service import Scheduler, SchedulerOptions
from tenplex.scheduler.state import JobSpec, Phase

log = logging.getLogger(__name__)

STATUS_SYNC_SECONDS = 2.0
"""How often a running job's step is published to its ElasticJob status between state changes."""
RESYNC_SECONDS = 30.0
"""Every ElasticJob is reconciled this often besides its watch events (a safety net, as in client-go)."""


def budget_name(job: str) -> str:
    """The PodDisruptionBudget of a job's worker pods."""
    return f"{job}-tenplex-workers"


def job_spec_from_elasticjob(obj: Mapping[str, Any]) -> JobSpec:
    """The scheduler's JobSpec for an ElasticJob (validated against the CRD schema first)."""
    return crd.parse_spec(obj).to_job_spec(obj["metadata"]["name"])


def advertise_url(settings: KubernetesSettings, port: int, fallback: str) -> str:
    """The scheduler URL that worker pods use; it must survive a scheduler restart (a Service, not a pod IP).

    ``$TENPLEX_ADVERTISE_URL`` (``settings.advertise_url``: the chart sets it to its Service) when set; else a
    Service named like the scheduler's Deployment: ``http://<deployment>.<namespace>.svc:<port>``,
    the Deployment being the pod name without its ReplicaSet hash and suffix.
    """
    if settings.advertise_url:
        return settings.advertise_url
    m = re.fullmatch(r"(.+)-[a-z0-9]{5,10}-[a-z0-9]{5}", settings.identity)
    if m:
        return f"http://{m.group(1)}.{settings.namespace}.svc:{port}"
    log.warning("cannot derive the scheduler Service from pod name %r; workers will use %s (set %s)",
                settings.identity, fallback, ENV_ADVERTISE_URL)
    return fallback


class KubernetesScheduler(Scheduler):
    """The scheduler service on Kubernetes: jobs come from ElasticJobs, state lives in the API server."""

    def __init__(self, api_client: client.ApiClient, settings: KubernetesSettings,
                 scheduler_settings: SchedulerSettings, state_root: Path, *,
                 master_ports: tuple[int, int] = (29500, 29999), watch_timeout: int = 60,
                 exit_on_lost_leadership: bool = False, store_client: Callable[[str], Any] | None = None,
                 stop_margin: float = STOP_MARGIN_SECONDS) -> None:
        if timeouts_of(api_client) is None:  # no call may hang on a dead connection (see tenplex.k8s.apiclient)
            with_timeouts(api_client)
        self.k8s_settings = settings
        self.index = ElasticJobIndex(api_client, settings, watch_timeout=watch_timeout)
        backend = KubernetesBackend(api_client, settings, self.index.get, master_ports=master_ports,
                                    watch_timeout=watch_timeout, stop_margin=stop_margin, token=scheduler_settings.token,
                                    job_credentials=scheduler_settings.credentials is not None)
        self.jobstore = KubeJobStore(api_client, self.index, state_root)
        super().__init__(backend, self.jobstore, scheduler_settings, store_client=store_client)
        self.kube_backend = backend
        self.operator = ElasticJobOperator(self, api_client, settings, exit_on_lost_leadership=exit_on_lost_leadership)

    def recover(self) -> list[str]:
        """Start the operator: it recovers the jobs once it holds the Lease (the names are logged then)."""
        self.operator.start()
        return []

    def resume_jobs(self) -> list[str]:
        return super().recover()

    def find(self, name: str) -> JobController | None:
        """The job's controller, or None (never raises: for the operator's own bookkeeping)."""
        with self._lock:
            return self._jobs.get(name)

    def get(self, name: str) -> JobController:
        ctl = self.find(name)
        if ctl is not None:
            return ctl
        if not self.operator.leading.is_set():
            raise NotLeader(f"scheduler replica {self.k8s_settings.identity} does not lead (Lease "
                            f"{self.k8s_settings.namespace}/{self.k8s_settings.lease_name}) or is still resuming "
                            f"its jobs; job {name!r} is not here yet")
        return super().get(name)

    def create(self, spec: JobSpec) -> JobController:
        if not self.jobstore.has_job(spec.name):
            raise InvalidConfig(f"job {spec.name!r}: on Kubernetes a job is an ElasticJob; submit one with kubectl "
                                "apply (the scheduler's REST API cannot create it)")
        return super().create(spec)

    def update(self, name: str, spec: JobSpec) -> JobController:
        raise InvalidConfig(f"job {name!r}: on Kubernetes a job's spec is its ElasticJob's; change it with kubectl "
                            "apply (the scheduler's REST API cannot)")

    def close(self) -> None:
        self.operator.stop()
        super().close()


class _StoppableElection(leaderelection.LeaderElection):
    """The official leader election, with a stop flag checked while following and while renewing."""

    def __init__(self, config: electionconfig.Config, stop: threading.Event) -> None:
        super().__init__(config)
        self._halt = stop

    def acquire(self) -> bool:
        while not self._halt.is_set():
            try:
                if self.try_acquire_or_renew():
                    return True
            except Exception as exc:  # the API server is briefly unreachable: keep following
                log.warning("leader election: %s", exc)
            self._halt.wait(self.election_config.retry_period)
        return False

    def renew_loop(self, leading_failed: threading.Event | None = None) -> None:
        retry = self.election_config.retry_period
        deadline_s = self.election_config.renew_deadline
        while not self._halt.is_set():
            if leading_failed is not None and leading_failed.is_set():
                return
            deadline = time.monotonic() + deadline_s
            renewed = False
            while time.monotonic() < deadline and not self._halt.is_set():
                try:
                    renewed = self.try_acquire_or_renew()
                except Exception as exc:
                    log.warning("leader election: renewing failed: %s", exc)
                    renewed = False
                if renewed:
                    break
                self._halt.wait(retry)
            if not renewed:
                return
            self._halt.wait(retry)


class ElasticJobOperator:
    """Leader election, ElasticJob reconciliation and the watch-driven wake-ups (see the module docstring)."""

    def __init__(self, scheduler: KubernetesScheduler, api_client: client.ApiClient, settings: KubernetesSettings, *,
                 exit_on_lost_leadership: bool = False) -> None:
        self.scheduler = scheduler
        self.settings = settings
        self.custom = client.CustomObjectsApi(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self.policy = client.PolicyV1Api(api_client)
        self._exit_on_lost = exit_on_lost_leadership
        self.leading = threading.Event()
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._acting = threading.Event()
        self._lock = threading.RLock()
        self._threads: list[threading.Thread] = []
        self._published_step: dict[str, int] = {}
        self._lease_client: client.ApiClient | None = None
        """The leader election's own client (its calls time out within the renew deadline), while electing."""
        self._events: queue.Queue[tuple[str, Any, Any] | None] = queue.Queue()
        """Watch events, handled on the operator's own thread: an informer must never wait for a
        job controller's lock (a controller that deletes pods waits for the informer to see them go)."""

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if not self.settings.leader_election:
            self._lead()
            return
        lock = LeaseLock(self.settings.lease_name, self.settings.namespace, self.settings.identity)
        # This client's configuration, not the process-wide default one; a call that takes longer than the renew
        # deadline is given up (a renewal stuck on a dead connection must not outlast the Lease it renews).
        deadline = float(self.settings.renew_deadline_seconds)
        self._lease_client = with_timeouts(client.ApiClient(self.coordination.api_client.configuration),
                                           connect=min(CONNECT_TIMEOUT_S, deadline), read=deadline)
        lock.api_instance = client.CoordinationV1Api(self._lease_client)
        config = electionconfig.Config(lock, lease_duration=self.settings.lease_duration_seconds,
                                       renew_deadline=self.settings.renew_deadline_seconds,
                                       retry_period=self.settings.retry_period_seconds,
                                       onstarted_leading=self._lead, onstopped_leading=self._stopped_leading)
        election = _StoppableElection(config, self._stop)
        log.info("%s: following; waiting for Lease %s/%s", self.settings.identity, self.settings.namespace,
                 self.settings.lease_name)
        self._spawn(election.run, "leader-election")

    def stop(self) -> None:
        self._stop.set()
        self._stop_acting()
        for t in self._threads:
            t.join(timeout=5)
        if self._lease_client is not None:
            self._lease_client.close()

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _lead(self) -> None:
        """Became leader: watch, resume the jobs, reconcile the ElasticJobs, then follow the watches."""
        if self._stop.is_set():
            return
        log.info("%s: leading", self.settings.identity)
        sched = self.scheduler
        sched.index.start()
        try:
            if not sched.index.wait_synced(30):
                raise StoreUnavailable("the Kubernetes API did not answer the first list of ElasticJobs within 30s")
            if not self._stop.is_set():
                sched.kube_backend.start()
        except BaseException:
            self._release_watches()
            raise
        with self._lock:
            stopped = self._stop.is_set()
            if not stopped:
                self._acting.set()
        if stopped:  # closed while syncing: the watches started here must not outlive the operator
            self._release_watches()
            return
        names = sched.resume_jobs()
        if names:
            log.info("resumed jobs: %s", ", ".join(names))
        sched.kube_backend.add_listener(lambda ev: self._events.put(("cluster", ev, None)))
        sched.index.add_handler(lambda kind, obj, old: self._events.put(("elasticjob", kind, obj)))
        self.reconcile_all()
        self._spawn(self._dispatch, "operator-events")
        self._spawn(self._housekeeping, "operator-housekeeping")
        self.leading.set()

    def _stopped_leading(self) -> None:
        if self._stop.is_set():
            return
        log.error("%s: lost the Lease %s; stopping all job controllers", self.settings.identity,
                  self.settings.lease_name)
        if self._exit_on_lost:
            # At once, not after a graceful shutdown: a controller in the middle of a transfer would otherwise
            # go on while the next leader (after the lease duration) resumes the same job. Every stage of a
            # job is idempotent and resumable, so dying here loses nothing; Kubernetes restarts us as a follower.
            logging.shutdown()
            os._exit(1)
        self._stop_acting()
        self.lost.set()

    def _release_watches(self) -> None:
        """Stop the watches a leader started (idempotent)."""
        self.scheduler.kube_backend.stop_watches()
        self.scheduler.index.stop()

    def _stop_acting(self) -> None:
        with self._lock:
            acting = self._acting.is_set()
            self._acting.clear()
        if not acting:
            if self._stop.is_set():  # closed while ``_lead`` syncs: end its watches now, not at its timeout
                self._release_watches()
            return
        self.leading.clear()
        self._events.put(None)
        for ctl in self.scheduler.list():
            ctl.close()
        self.scheduler.kube_backend.close()
        self.scheduler.index.stop()

    # -- ElasticJobs ----------------------------------------------------------------------------

    def _dispatch(self) -> None:
        while True:
            item = self._events.get()
            if item is None or not self._acting.is_set():
                return
            what, a, b = item
            try:
                if what == "cluster":
                    self._on_cluster_event(a)
                else:
                    self._on_elasticjob(a, b)
            except Exception:  # keep handling events whatever one of them did
                log.exception("operator: handling %s %s failed", what, a)

    def _on_elasticjob(self, kind: str, obj: dict[str, Any]) -> None:
        if kind == "DELETED":
            self._deleted(obj)
        else:
            self.reconcile(obj)

    def reconcile_all(self) -> None:
        sched = self.scheduler
        present = set()
        for obj in sched.index.all():
            present.add(obj["metadata"]["name"])
            self.reconcile(obj)
        for ctl in sched.list():
            if ctl.spec.name not in present:
                self._delete_job(ctl.spec.name, "its ElasticJob no longer exists")

    def reconcile(self, obj: Mapping[str, Any]) -> None:
        """Make the scheduler follow one ElasticJob (idempotent)."""
        meta = obj["metadata"]
        name, ns = meta["name"], meta.get("namespace", "")
        if not self.settings.manages(ns):
            return
        if meta.get("deletionTimestamp"):
            # Being deleted (finalizers, or a foreground deletion waiting for its pods): the job ends now; it is
            # never started again, nor are new pods made that its deletion would have to wait for.
            self._deleted(obj)
            return
        sched = self.scheduler
        generation = int(meta.get("generation") or 1)
        status = obj.get("status") or {}
        # Refused before (a bad spec, a taken name): only a spec change (a new generation) is looked at again.
        refused = status.get("phase") == Phase.FAILED.value and status.get("observedGeneration") == generation
        with self._lock:
            owner = sched.index.find(name)
            if owner is not None and owner["metadata"].get("uid") != meta.get("uid"):
                if not refused:
                    self._refuse(obj, f"the job name {name!r} is already used by the ElasticJob in namespace "
                                      f"{owner['metadata']['namespace']}")
                return
            ctl = sched.find(name)
            if ctl is None:
                if refused:
                    return
                try:
                    spec = job_spec_from_elasticjob(obj)
                except TenplexError as exc:
                    self._refuse(obj, exc.detail)
                    return
                sched.jobstore.set_observed_generation(name, generation)
                self._ensure_budget(obj)
                sched.create(spec)
                log.info("job %s: created from ElasticJob %s/%s (generation %d, %d GPUs)", name, ns, name, generation,
                         spec.gpus)
                return
            observed = sched.jobstore.observed_generation(name)
            if observed is not None and generation <= observed:
                return
            self._follow_spec(ctl, obj, generation)

    def _follow_spec(self, ctl: JobController, obj: Mapping[str, Any], generation: int) -> None:
        """A new generation of a live job's ElasticJob: its changed spec (:meth:`JobController.request_spec`:
        applied in place, or redeployed at the next step boundary; a change of an immutable part is refused with
        condition ``SpecUpdated`` False, reason Refused) and its GPU count (a scale) in one reconfiguration."""
        name = ctl.spec.name
        desired = int(obj["spec"]["gpus"])
        store = self.scheduler.jobstore
        try:
            update = ctl.request_spec(self._live_job_spec(ctl, obj))
            store.clear_condition(name, SPEC_CONDITION)
            if update is not None:
                log.info("job %s: spec of ElasticJob generation %d taken (%s)", name, generation,
                         ", ".join(update["fields"]))
        except TenplexError as exc:
            log.warning("job %s: spec change of generation %d refused: %s", name, generation, exc.detail)
            store.set_condition(name, crd.Condition(SPEC_CONDITION, "False", reason="Refused",
                                                    message=f"the spec of generation {generation} is not applied: "
                                                            f"{exc.detail}"[:1000], observed_generation=generation))
        current = ctl.desired_gpus()  # 0 when suspended
        try:
            if desired != current:
                ctl.request_scale(desired)
                log.info("job %s: scale to %d GPUs requested through the ElasticJob (generation %d)", name, desired,
                         generation)
            store.set_condition(name, crd.Condition("ScaleRejected", "False", reason="Accepted",
                                                    message=f"spec.gpus {desired}", observed_generation=generation))
        except TenplexError as exc:
            log.warning("job %s: scale to %d refused: %s", name, desired, exc.detail)
            store.set_condition(name, crd.Condition("ScaleRejected", "True", reason="Refused", message=exc.detail[:1000],
                                                    observed_generation=generation))
        store.set_observed_generation(name, generation)
        with ctl.lock:
            store.save(ctl.spec, ctl.status)

    @staticmethod
    def _live_job_spec(ctl: JobController, obj: Mapping[str, Any]) -> JobSpec:
        """The scheduler's JobSpec for a live job's ElasticJob (validated against the CRD schema first); a
        suspended one (``gpus: 0``, which no JobSpec holds) keeps the GPU count of the record."""
        spec = crd.parse_spec(obj)
        if spec.gpus == 0:
            low, high = spec.min_gpus or 1, spec.max_gpus or MAX_GPUS
            spec = spec.model_copy(update={"gpus": ctl.spec.gpus if low <= ctl.spec.gpus <= high else low})
        return spec.to_job_spec(obj["metadata"]["name"])

    def _ensure_budget(self, obj: Mapping[str, Any]) -> None:
        """A PodDisruptionBudget that lets no worker pod be evicted (``kubectl drain``, autoscaler scale-down).

        Evictions wait instead, while the scheduler, which sees the node cordoned,
        stops the workers at a step boundary, snapshots, moves the state and the
        workers off the node, and deletes the old pods itself (a deletion is not an
        eviction); then the drain goes through. Owned by the ElasticJob.
        """
        meta = obj["metadata"]
        body = {
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": budget_name(meta["name"]), "namespace": meta["namespace"],
                         "labels": crd.job_labels(meta["name"]), "ownerReferences": [crd.owner_reference(obj)]},
            "spec": {"maxUnavailable": 0, "selector": {"matchLabels": crd.job_labels(meta["name"])}},
        }
        try:
            self.policy.create_namespaced_pod_disruption_budget(meta["namespace"], body)
        except client.ApiException as exc:
            if exc.status != 409:  # 409: there already (a restart); anything else: drains will not wait for us
                log.warning("job %s: no PodDisruptionBudget (%s %s): a drain will evict its workers before their "
                            "state is moved", meta["name"], exc.status, exc.reason)

    def _refuse(self, obj: Mapping[str, Any], reason: str) -> None:
        """An ElasticJob the scheduler cannot run: say why in its status (Failed, condition InvalidSpec)."""
        meta = obj["metadata"]
        log.warning("ElasticJob %s/%s refused: %s", meta.get("namespace"), meta["name"], reason)
        previous = (obj.get("status") or {}).get("conditions") or []
        cond = crd.Condition("Failed", "True", reason="InvalidSpec", message=reason[:1000],
                             observed_generation=int(meta.get("generation") or 1))
        status = crd.ElasticJobStatus(phase=Phase.FAILED, selector=crd.worker_selector(meta["name"]),
                                      conditions=tuple(crd.set_condition(previous, cond)),
                                      observed_generation=int(meta.get("generation") or 1))
        try:
            self.custom.patch_namespaced_custom_object_status(crd.GROUP, crd.VERSION, meta["namespace"], crd.PLURAL,
                                                              meta["name"], {"status": status.to_dict()})
        except client.ApiException as exc:
            log.warning("ElasticJob %s/%s: status not written: %s", meta["namespace"], meta["name"], exc.reason)

    def _deleted(self, obj: Mapping[str, Any]) -> None:
        name = obj["metadata"]["name"]
        with self._lock:
            still = self.scheduler.index.find(name)
            if still is not None and still["metadata"].get("uid") != obj["metadata"].get("uid"):
                return  # another namespace's job of that name, which was refused: not ours
            self._delete_job(name, "its ElasticJob was deleted")

    def _delete_job(self, name: str, why: str) -> None:
        ctl = self.scheduler.find(name)
        if ctl is None:
            return
        # Its controller first: a tick already waiting for the job's lock could otherwise still recover from a
        # "failure" (the pods the deletion removes) and make new pods after the job is gone.
        ctl.close()
        try:
            self.scheduler.delete(name)
        except NotFound:
            return
        self._published_step.pop(name, None)
        log.info("job %s: deleted (%s)", name, why)

    # -- cluster events -----------------------------------------------------------------------------

    def _on_cluster_event(self, ev: ClusterEvent) -> None:
        if not self._acting.is_set():
            return
        for ctl in self.scheduler.list():
            with ctl.lock:
                hosts = set(ctl.status.hosts)
                active = ctl.status.phase in (Phase.RUNNING, Phase.RECONFIGURING, Phase.PENDING)
            if not active:
                continue
            if ev.job is not None and ev.job != ctl.spec.name:
                continue
            if ev.kind == "node-unschedulable" and ev.node in hosts:
                log.info("job %s: %s; redeploying off it", ctl.spec.name, ev.detail)
                ctl.request_redeploy("node-drain")
            elif ev.node is None or ev.node in hosts or ev.kind in ("store-changed", "node-changed"):
                if ev.kind in ("node-lost", "store-lost", "worker-exited", "worker-deleted"):
                    log.info("job %s: %s", ctl.spec.name, ev.detail)
                ctl.wake()

    # -- housekeeping ----------------------------------------------------------------------------

    def _housekeeping(self) -> None:
        """Publish training progress to the ElasticJob status, and reconcile everything now and then."""
        last_resync = time.monotonic()
        while self._acting.is_set() and not self._stop.wait(STATUS_SYNC_SECONDS):
            if not self._acting.is_set():
                break
            for ctl in self.scheduler.list():
                with ctl.lock:
                    step = ctl.status.step
                    if self._published_step.get(ctl.spec.name) == step:
                        continue
                    try:
                        self.scheduler.jobstore.publish(ctl.spec, ctl.status)
                        self._published_step[ctl.spec.name] = step
                    except (TenplexError, client.ApiException, urllib3.exceptions.HTTPError) as exc:
                        # an API server that is restarting (connection refused or reset) must not end this
                        # thread: the step is published again on the next round
                        log.warning("job %s: publishing the status failed: %s", ctl.spec.name, exc)
            if time.monotonic() - last_resync > RESYNC_SECONDS:
                last_resync = time.monotonic()
                try:
                    self.reconcile_all()
                except Exception:
                    log.exception("periodic reconcile failed")


def kubernetes_scheduler(options: SchedulerOptions) -> KubernetesScheduler:
    """The ``kubernetes`` backend (registered in Tenplex's entry points) of ``tenplex scheduler serve``: jobs are
    ElasticJobs, state lives in the API server (in-cluster, or ``$KUBECONFIG``); with a key set
    (``options.auth_keys``, default ``$TENPLEX_AUTH_KEYS``: the chart mounts it) each job's pods get their own
    credential."""
    from kubernetes import config as kube_config

    settings = KubernetesSettings.from_env()
    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:
        try:
            kube_config.load_kube_config()
        except (kube_config.ConfigException, OSError) as exc:
            raise InvalidConfig(f"no Kubernetes API access: not in a cluster and no usable kubeconfig ({exc})") from None
    keys_path = options.auth_keys or os.environ.get(ENV_AUTH_KEYS)
    sched_settings = SchedulerSettings(url=advertise_url(settings, urlsplit(options.url).port or 0, options.url),
                                       token=options.token, heartbeat_interval=options.heartbeat_interval,
                                       credentials=Issuer(KeySet(keys_path)) if keys_path else None)
    state_dir = Path(options.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    return KubernetesScheduler(client.ApiClient(), settings, sched_settings, state_dir, exit_on_lost_leadership=True)
