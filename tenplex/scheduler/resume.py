"""A new job that starts from a persistent version instead of step 0 (its spec's ``resume_from``).

A resume after a cluster outage, or a copy of a job elsewhere: the version
was saved by a job (this one, or another named in ``resume_from.job``) to its
persistent location, with the PTC it was saved in (its layout, and the dataset
position after its step; :func:`~tenplex.scheduler.persist.version_ptc`).
This module only reads that small metadata, through one store daemon's routes
(``GET /v1/jobs/{job}/persistent[/{version}[/ptc]]?uri=``), and checks that the
new job's model is the saved one; the orchestrator then plans the new layout
with every region's only source the checkpoint, and the node daemons move the
bytes (:meth:`~tenplex.scheduler.reconfigure.Orchestrator.start_resumed`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from tenplex.core.version import Version
from tenplex.errors import InvalidConfig, NotFound, StoreUnavailable, TenplexError
from tenplex.ptc import PTC, ParallelConfig
from tenplex.scheduler.state import LATEST, ResumeSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SavedVersion:
    """A committed persistent version and the PTC it was saved in."""

    uri: str
    job: str
    version: Version
    ptc: PTC

    @property
    def consumed_samples(self) -> int:
        assert self.ptc.dataset is not None
        return self.ptc.dataset.consumed_samples

    def describe(self) -> str:
        """Its configuration for people (``dp2 tp1 pp1``), from the PTC's config."""
        cfg = self.ptc.config
        try:
            return ParallelConfig.from_json({k: cfg[k] for k in ("dp", "tp", "pp", "zero") if k in cfg}).describe()
        except TenplexError:
            return f"{len(self.ptc.devices)} devices"


def _path(job: str, uri: str, version: str | None = None, suffix: str = "") -> str:
    path = f"/v1/jobs/{quote(job, safe='')}/persistent"
    if version is not None:
        path += f"/{quote(version, safe='')}{suffix}"
    return path + "?" + urlencode({"uri": uri})


def find_saved(clients: Sequence[Callable[[str, str], Any]], spec: ResumeSpec, own_name: str) -> SavedVersion:
    """Resolve ``spec`` to a committed persistent version and read its PTC, asking the daemons in turn
    (``clients``: each a ``request_json(method, path)``) until one answers; raises :class:`NotFound` or
    :class:`InvalidConfig` naming what is wrong, or :class:`StoreUnavailable` when no daemon answered."""
    job = spec.source_job(own_name)
    where = f"job {job!r} at {spec.uri}"
    last: TenplexError | None = None
    for request in clients:
        try:
            listing = request("GET", _path(job, spec.uri))
            committed = sorted(Version.parse(v["version"]) for v in listing.get("versions", []) if v.get("committed"))
            if spec.version == LATEST:
                if not committed:
                    raise NotFound(f"{where} has no committed version (of "
                                   f"{len(listing.get('versions', []))} there, none is committed)")
                version = committed[-1]
            else:
                version = Version.parse(spec.version)
                if version not in committed:
                    there = [v["version"] for v in listing.get("versions", [])]
                    state = "is there but not committed (its upload is torn or still running)" \
                        if str(version) in there else "is not there"
                    raise NotFound(f"version {version} of {where} {state}; committed versions: "
                                   f"{', '.join(map(str, committed)) or 'none'}")
            doc = request("GET", _path(job, spec.uri, str(version), "/ptc"))
            try:
                ptc = PTC.from_json(doc)
            except TenplexError as exc:
                raise InvalidConfig(f"the PTC saved with version {version} of {where} is unreadable: {exc.detail}") from None
            if ptc.dataset is None:
                raise InvalidConfig(f"the PTC saved with version {version} of {where} has no dataset position")
            return SavedVersion(spec.uri, job, version, ptc)
        except StoreUnavailable as exc:
            last = exc
            log.warning("resume from %s: a store daemon did not answer: %s", where, exc.detail)
            continue
    raise last if last is not None else StoreUnavailable("no store daemon to read the persistent version from")


def model_mismatch(saved: PTC, new: PTC) -> list[str]:
    """How the new layout's tensors differ from the saved ones (names, shapes, dtypes); empty when they match."""
    problems = []
    for t in new.tensors:
        if not saved.has_tensor(t.name):
            problems.append(f"{t.name!r} is not in the saved state")
            continue
        o = saved.tensor(t.name)
        if tuple(o.shape) != tuple(t.shape):
            problems.append(f"{t.name!r} has shape {list(t.shape)}, saved {list(o.shape)}")
        if o.dtype != t.dtype:
            problems.append(f"{t.name!r} has dtype {t.dtype}, saved {o.dtype}")
    extra = [t.name for t in saved.tensors if not new.has_tensor(t.name)]
    problems += [f"the saved {name!r} is not in the new layout" for name in extra]
    return problems


def check_dataset(saved: SavedVersion, num_samples: int, seed: int) -> None:
    """The data position means the same samples only in the same sample order (dataset size and seed)."""
    d = saved.ptc.dataset
    assert d is not None
    if (d.num_samples, d.seed) != (num_samples, seed):
        raise InvalidConfig(f"the job's dataset (num_samples {num_samples}, seed {seed}) is not the one version "
                            f"{saved.version} of job {saved.job!r} was trained on (num_samples {d.num_samples}, "
                            f"seed {d.seed}): its data position would name other samples")
