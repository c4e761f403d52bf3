"""A job's versions kept beyond its nodes: persistent checkpoints, and the retention of both tiers.

Recovering from the surviving replicas is the fast path; when no replica of
some region survives (every dp=1 job that loses a host), the job falls back
to its persistent location: an S3-compatible object store or a shared
filesystem (:class:`CheckpointSpec`). Every ``interval_steps`` a version that
is committed on all of the job's hosts is copied there by the node daemons
themselves, each distinct region once, from the node that holds it (spread so
that no node uploads much more than another), then committed (the marker
written last: a torn upload is never used) and older persistent versions
beyond ``keep_last`` are deleted. All of it runs in a background thread of
the job (:class:`Housekeeper`): training never waits, and a failing upload is
retried with backoff, reported in the job's status and metrics, and never
fails the job. The same thread keeps the node stores from filling up: it
deletes a job's versions older than its newest ``node_keep`` complete ones
there, never one being persisted.

The scheduler only decides and asks: the bytes go from the node stores to
the persistent tier (``POST /v1/jobs/{job}/uploads`` on each daemon), and its
credentials live with the daemons, never in a plan or a record.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

from tenplex.core.version import Version
from tenplex.errors import NotFound, TenplexError
from tenplex.ptc import PTC
from tenplex.scheduler.context import JobContext

log = logging.getLogger(__name__)

NODE_KEEP = 2
"""Complete versions of a job each node store keeps (the newest; older ones are deleted)."""
UPLOAD_POLL_S = 2.0
"""The longest wait of one long poll of an upload's record (it answers as soon as the upload ends)."""
RETRY_BACKOFF_S = (5.0, 15.0, 60.0, 300.0)
"""Waits between failed attempts to persist a version (the last one repeats)."""


def assign_uploads(ptc: PTC, holders: Sequence[str]) -> dict[str, list[tuple[str, str]]]:
    """Each distinct (tensor, region) of ``ptc`` to one of the ``holders`` that holds it: host -> its shards.

    Largest shards first, each to the holder with the fewest bytes so far, so that the nodes upload about
    equal shares in parallel. Raises NotFound naming a region no holder has.
    """
    alive = set(holders)
    load = dict.fromkeys(holders, 0)
    out: dict[str, list[tuple[str, str]]] = {h: [] for h in holders}
    shards = []
    for t in ptc.tensors:
        for s in t.shards:
            hosts = sorted({ptc.device(d).host for d in s.devices} & alive)
            if not hosts:
                raise NotFound(f"no holder of {t.name} {s.region.format()} among {sorted(alive)}")
            shards.append((s.region.volume * t.itemsize, t.name, s.region.format(), hosts))
    for nbytes, name, region, hosts in sorted(shards, key=lambda x: -x[0]):
        host = min(hosts, key=lambda h: (load[h], h))
        load[host] += nbytes
        out[host].append((name, region))
    return {h: v for h, v in out.items() if v}


def version_ptc(ctx: JobContext, ptc: PTC, version: str) -> PTC:
    """``ptc`` (the layout ``version`` was saved in) with the dataset position after ``version``'s step: the
    small metadata kept with a persistent version, from which a job resumed from it plans and continues."""
    at = ctx.consumed_at(Version.parse(version))
    return dataclasses.replace(ptc, dataset=dataclasses.replace(ctx.spec.dataset, consumed_samples=at))


def _uploads_path(job: str, version: str | None = None, *, suffix: str = "") -> str:
    path = f"/v1/jobs/{quote(job, safe='')}/uploads"
    return path if version is None else f"{path}/{version}{suffix}"


class Housekeeper:
    """One job's background threads: persistent checkpoints, and retention (see the module doc).

    Which versions are persisted: the first complete version at or past each multiple of the checkpoint's
    ``interval_steps`` is *due* (with snapshots at every multiple, exactly those). One upload runs at a time
    and runs to its end; a version that becomes due meanwhile waits (a queue of one) and starts as soon as it
    ends. A newer due version supersedes the one waiting, which is then recorded as skipped (the status's
    ``persist.skipped`` says which and why): superseding the waiting one rather than queueing both keeps the
    recovery point the newest due version, one upload behind at worst, however slow the uploads are, while
    queueing every due version would let the uploads fall further behind with each interval. The upload in
    flight is not cancelled for a newer one: when an upload takes longer than an interval, cancelling would
    never let any version commit. A version whose upload keeps failing gives way to a newer due one.
    """

    SKIPPED_KEPT = 20
    """Entries of ``persist.skipped`` kept in the status (the newest)."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self._queued: str | None = None
        """The due version waiting for the upload in flight to end (guarded by the job's lock)."""
        self._inflight: str | None = None
        self._last_due: Version | None = None
        self._wake = threading.Event()
        self._upload_wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        if not self._threads:
            name = self.ctx.name
            self._threads = [threading.Thread(target=self._run, name=f"job-{name}-housekeeping", daemon=True),
                             threading.Thread(target=self._uploads, name=f"job-{name}-persist", daemon=True)]
            for t in self._threads:
                t.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._upload_wake.set()
        for t in self._threads:
            t.join(timeout=30)

    def committed(self, version: str) -> None:
        """``version`` is committed on every host of its generation (called under the job's lock)."""
        self._wake.set()
        v = Version.parse(version)
        if not self._is_due(v):
            return
        self._last_due = v
        old = self._queued
        self._queued = version
        if old is not None and old != version:
            self._skip(old, f"superseded by {version} (due too) while {self._inflight} was uploading; only the "
                            "newest due version waits for the upload in flight")
        self._set(queued=version)
        self._upload_wake.set()

    def _is_due(self, v: Version) -> bool:
        """Whether ``v`` is the first version at or past a multiple of ``interval_steps`` (after the versions
        persisted or made due before it: a job rolled back to an earlier step makes those steps due again)."""
        cp = self.ctx.spec.checkpoint
        if cp is None:
            return False
        refs = [Version.parse(p).step for p in self.ctx.status.persisted]
        if self._last_due is not None:
            refs.append(self._last_due.step)
        ref = max((s for s in refs if s <= v.step), default=0)
        return v.step // cp.interval_steps > ref // cp.interval_steps

    def _skip(self, version: str, reason: str) -> None:
        """Record that due ``version`` is not persisted, and why (under the job's lock)."""
        log.info("job %s: %s is not persisted: %s", self.ctx.name, version, reason)
        skipped = [*(self.ctx.status.persist or {}).get("skipped", []), {"version": version, "reason": reason}]
        self._set(skipped=skipped[-self.SKIPPED_KEPT:])

    # -- the threads -----------------------------------------------------------------------------

    def _run(self) -> None:
        """Retention of the node stores, at every new version (and every few seconds)."""
        while not self._stop.is_set():
            self._wake.wait(5.0)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._node_retention()
            except Exception:  # housekeeping must outlive anything one round meets
                log.exception("job %s: housekeeping failed", self.ctx.name)

    def _uploads(self) -> None:
        """Persist the due versions, one at a time (its own thread: node retention, whose deletes can take
        seconds on a busy node, never delays an upload)."""
        while not self._stop.is_set():
            self._upload_wake.wait(5.0)
            self._upload_wake.clear()
            while not self._stop.is_set():
                version = self._take()
                if version is None:
                    break
                try:
                    self._persist(version)
                except Exception:  # must outlive anything one upload meets
                    log.exception("job %s: persisting %s failed", self.ctx.name, version)
                finally:
                    with self.ctx.lock:
                        self._inflight = None

    def _take(self) -> str | None:
        """The waiting due version, now the one in flight (None: none waits)."""
        with self.ctx.lock:  # one change of the status: a version is never seen neither waiting nor in flight
            version, self._queued = self._queued, None
            self._inflight = version
            if version is not None:
                self._set(queued=None, version=version, state="uploading", attempts=0, error=None,
                          started_at=time.time(), finished_at=None, bytes_uploaded=0,
                          started_step=self.ctx.status.step, finished_step=None)
            return version

    def _set(self, **changes: Any) -> None:
        with self.ctx.lock:
            st = self.ctx.status
            st.persist = {**(st.persist or {}), **changes}
            self.ctx.touch()

    def _persist(self, version: str) -> None:
        """Copy ``version`` to the persistent tier through the daemons that hold it, commit, apply retention.
        Failures are retried with backoff until a newer due version is waiting; the job is never failed."""
        ctx = self.ctx
        cp = ctx.spec.checkpoint
        assert cp is not None
        attempt = 0
        while not self._stop.is_set():
            attempt += 1
            with ctx.lock:
                st = ctx.status
                holders = sorted(st.committed.get(version, []))
                gen = st.version_generation.get(version, Version.parse(version).generation)
                self._set(version=version, state="uploading", attempts=attempt, error=None, started_at=time.time(),
                          finished_at=None, bytes_uploaded=0, started_step=st.step, finished_step=None)
            try:
                ptc = ctx.ptc(gen)
                hosts = {h.name: h for h in ctx.backend.hosts() if h.ready}
                alive = [h for h in holders if h in hosts]
                parts = assign_uploads(ptc, alive)
                for host, shards in parts.items():
                    body = {"version": version, "uri": cp.uri, "shards": [list(s) for s in shards]}
                    ctx.client_for(hosts[host].store_url).request_json("POST", _uploads_path(ctx.name), body)
                self._wait_uploads(version, parts, hosts)
                if self._stop.is_set():
                    return
                expected = [[t.name, s.region.format()] for t in ptc.tensors for s in t.shards]
                committer = sorted(parts)[0]
                ctx.client_for(hosts[committer].store_url).request_json(
                    "POST", _uploads_path(ctx.name, version, suffix="/commit"),
                    {"uri": cp.uri, "shards": expected, "ptc": version_ptc(ctx, ptc, version).to_json()})
            except TenplexError as exc:
                log.warning("job %s: persisting %s failed (attempt %d): %s", ctx.name, version, attempt, exc.detail)
                self._set(state="retrying", error=exc.detail)
                if ctx.metrics is not None:
                    ctx.metrics.persist.labels(ctx.name, "failed").inc()
                wait = RETRY_BACKOFF_S[min(attempt - 1, len(RETRY_BACKOFF_S) - 1)]
                deadline = time.monotonic() + wait
                while not self._stop.is_set() and time.monotonic() < deadline:
                    with ctx.lock:
                        newer = self._queued
                        if newer is not None:  # a newer due version is waiting: it takes over
                            self._skip(version, f"its upload failed ({exc.detail}); {newer} became due meanwhile and "
                                                "took over")
                            self._set(state="abandoned")
                            return
                    self._upload_wake.wait(max(0.0, min(1.0, deadline - time.monotonic())))
                    self._upload_wake.clear()
                continue
            with ctx.lock:
                st = ctx.status
                st.persisted = sorted({*st.persisted, version}, key=Version.parse)
                self._set(state="committed", finished_at=time.time(), finished_step=st.step, error=None)
            if ctx.metrics is not None:
                ctx.metrics.persist.labels(ctx.name, "committed").inc()
            log.info("job %s: %s persisted to %s (attempt %d)", ctx.name, version, cp.uri, attempt)
            self._persistent_retention(hosts)
            return

    def _wait_uploads(self, version: str, parts: Mapping[str, Any], hosts: Mapping[str, Any]) -> None:
        """Until every node's part is uploaded: long polls (``?wait=``) that answer as soon as the upload ends,
        so the commit follows the last part at once, not at the next poll."""
        ctx = self.ctx
        pending = set(parts)
        total: dict[str, int] = {}
        while pending and not self._stop.is_set():
            for host in sorted(pending):
                rec = ctx.client_for(hosts[host].store_url).request_json(
                    "GET", _uploads_path(ctx.name, version) + f"?wait={UPLOAD_POLL_S}")
                total[host] = int(rec.get("bytes_done", 0))
                if rec.get("state") == "uploaded":
                    pending.discard(host)
                elif rec.get("state") in ("failed", "cancelled", "interrupted"):
                    raise TenplexError(f"upload of {version} from {host} {rec.get('state')}: {rec.get('error')}")
            self._set(bytes_uploaded=sum(total.values()))

    def _persistent_retention(self, hosts: Mapping[str, Any]) -> None:
        ctx = self.ctx
        cp = ctx.spec.checkpoint
        assert cp is not None
        with ctx.lock:
            keep = ctx.status.persisted[-cp.keep_last:]
            drop = [v for v in ctx.status.persisted if v not in keep]
        if not drop or not hosts:
            return
        client = ctx.client_for(next(iter(hosts.values())).store_url)
        for version in drop:
            try:
                client.request_json("DELETE", f"/v1/jobs/{quote(ctx.name, safe='')}/persistent/{version}"
                                              f"?uri={quote(cp.uri, safe='')}")
            except TenplexError as exc:
                log.warning("job %s: could not delete persistent %s: %s", ctx.name, version, exc.detail)
                continue
            with ctx.lock:
                ctx.status.persisted = [v for v in ctx.status.persisted if v != version]
                ctx.touch()

    def _node_retention(self) -> None:
        """Each node store keeps the job's newest :data:`NODE_KEEP` complete versions (and the one being
        persisted, and any newer incomplete one: a snapshot in progress)."""
        ctx = self.ctx
        with ctx.lock:
            st = ctx.status
            complete = sorted((v for v, hs in st.committed.items() if _complete(ctx, v, hs)), key=Version.parse)
            keep = set(complete[-NODE_KEEP:]) | {v for v in (self._inflight, self._queued) if v is not None}
            if st.persist and st.persist.get("version") and st.persist.get("state") not in ("committed", "abandoned"):
                keep.add(st.persist["version"])
            if st.restore_version:
                keep.add(st.restore_version)
            newest = Version.parse(complete[-1]) if complete else None
            drop = {v: list(hs) for v, hs in st.committed.items() if v not in keep and newest is not None
                    and Version.parse(v) < newest}
        for version, hosts in drop.items():
            for h in ctx.backend.hosts():
                if h.name in hosts and h.ready:
                    try:
                        ctx.client_for(h.store_url).delete(ctx.name, version)
                    except NotFound:
                        pass
                    except TenplexError as exc:
                        log.warning("job %s: could not delete %s on %s: %s", ctx.name, version, h.name, exc.detail)
                        continue
            with ctx.lock:
                ctx.status.committed.pop(version, None)
                ctx.touch()


def _complete(ctx: JobContext, version: str, hosts: Sequence[str]) -> bool:
    gen = ctx.status.version_generation.get(version, Version.parse(version).generation)
    try:
        need = set(ctx.ptc(gen).hosts)
    except NotFound:
        return False
    return need <= set(hosts)
