"""Export a committed version as a ``torch.distributed.checkpoint`` (DCP) checkpoint, and import one.

**Export** (:func:`export_dcp`): a version lives on several node stores, each
holding some shards, replicated shards on several. For every shard of every
tensor the key map uses, one holder is picked (balancing bytes across hosts);
then DCP's own ``dcp.save`` with its ``FileSystemWriter`` writes the checkpoint
through a :class:`~torch.distributed.checkpoint.SavePlanner` whose write items
are the shards themselves: each checkpoint entry is saved as chunks, one per
(stored shard x key-map piece), read straight from the holder's store into
the buffer DCP serializes when DCP asks for it (``resolve_data``), so no
tensor is ever assembled whole and each region is read once. ``bfloat16``
(stored as uint16) is read into ``torch.bfloat16`` buffers: bit-exact. A
small non-tensor entry ``tenplex`` (JSON text) records the job, version,
step, key map and the dataset state (sample order and consumed samples), so
that an import can recover them; a key map may add its library's own
entries (torchtitan: the optimizer's ``param_groups`` from the snapshot's
records, ``lr_scheduler``, ``train_state``).

The dataset state of a version is its snapshot's record when it has one (a
rank's ``extra/rank<r>/state``, written at snapshot time, the exact
position); otherwise the PTC's, which for a version written by a
reconfiguration is the position at that version's step (the scheduler sets
each generation's PTC from the version it starts from).

**Import** (:func:`import_dcp`): for every shard of a target PTC, the key map
says which regions of which checkpoint entries fill it; DCP's ``dcp.load``
with a :class:`~torch.distributed.checkpoint.LoadPlanner` over those regions
reads them straight into the shard buffers (DCP's resharding arithmetic
intersects them with the saved chunks, whatever layout saved them), in
batches of bounded memory. Each shard is written to the store of every host
whose devices hold it, and every host's copy is committed at the end. A
checkpoint that lacks an entry, or whose entry has another shape or dtype, is
refused before any byte is written; so is a version that already exists.
A failed import deletes what it wrote.

The resulting checkpoints load with plain ``dcp.load`` into any layout:
plain tensors in one process, or DTensors of any sharding on any group.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import shutil
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from tenplex.core.version import Version
from tenplex.errors import Conflict, InvalidInput, NotFound, StateLost, TenplexError
from tenplex.interop import keymap as km
from tenplex.ptc import PTC, DatasetState, Region, TensorKind
from tenplex.ptc.dtypes import itemsize, name_of_torch, torch_dtype
from tenplex.ptc.region import subtract
from tenplex.store import StoreClient, TensorStore, open_store
from tenplex.worker import trainer_state

log = logging.getLogger(__name__)

TENPLEX_KEY = "tenplex"
"""The non-tensor entry with Tenplex's own record (JSON text)."""
FORMAT = "tenplex.dcp/v1"
BATCH_BYTES = 256 << 20
"""Import reads this many bytes of shards per ``dcp.load`` (the memory it needs)."""

Progress = Callable[[int, int], None]
"""``progress(bytes_done, bytes_total)``."""


# -- results ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExportResult:
    directory: Path
    version: Version
    key_map: str
    entries: int
    chunks: int
    bytes: int
    bytes_per_host: dict[str, int]
    step: int
    dataset: DatasetState | None
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "directory": str(self.directory), "version": str(self.version),
                "seconds": round(self.seconds, 3)}


@dataclass(frozen=True, slots=True)
class ImportResult:
    version: Version
    key_map: str
    step: int | None
    """The step the checkpoint records (``tenplex`` entry or torchtitan's ``train_state.step``), if any."""
    dataset: DatasetState | None
    """The PTC's dataset state with the checkpoint's position applied (what the job should resume with)."""
    ptc: PTC
    """The target PTC with :attr:`dataset` in it."""
    shards: int
    bytes_read: int
    bytes_written: dict[str, int]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "version": str(self.version), "key_map": self.key_map, "step": self.step,
            "dataset": self.dataset.to_json() if self.dataset else None, "shards": self.shards,
            "bytes_read": self.bytes_read, "bytes_written": self.bytes_written, "seconds": round(self.seconds, 3),
        }


# -- export -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Chunk:
    """One write item: ``source`` of PTC tensor ``tensor``, read from ``host``, saved as ``target`` of entry ``fqn``."""

    fqn: str
    target: Region
    tensor: str
    source: Region
    host: str
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.source.volume * itemsize(self.dtype)


class _ExportPlanner(DefaultSavePlanner):
    """DCP's default planner for the small non-tensor entries, plus one SHARD write item per chunk."""

    def __init__(self, entries: Sequence[km.Entry], chunks: Sequence[_Chunk], read: Callable[[_Chunk], torch.Tensor]) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)
        self._entries = {e.fqn: e for e in entries}
        self._chunks = {(c.fqn, c.target.start): c for c in chunks}
        self._read = read

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        mappings = dict(plan.planner_data or {})
        for e in self._entries.values():
            if e.fqn in mappings:
                raise InvalidInput(f"checkpoint entry {e.fqn!r} is both a tensor and a non-tensor entry")
            mappings[e.fqn] = e.path
        for c in self._chunks.values():
            e = self._entries[c.fqn]
            offsets = torch.Size(c.target.start)
            items.append(WriteItem(
                index=MetadataIndex(c.fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(c.target.shape)),
                    properties=TensorProperties(dtype=torch_dtype(e.dtype)),
                    size=torch.Size(e.shape),
                ),
            ))
        self.plan = dataclasses.replace(plan, items=items, planner_data=mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        offset = tuple(write_item.index.offset or ())
        return self._read(self._chunks[(write_item.index.fqn, offset)])


def export_dcp(
    job: str,
    version: Version | str,
    ptc: PTC,
    stores: Mapping[str, TensorStore],
    directory: str | Path,
    *,
    key_map: str = "identity",
    options: Mapping[str, str] | None = None,
    threads: int = 1,
    progress: Progress | None = None,
) -> ExportResult:
    """Write committed ``version`` of ``job`` (laid out by ``ptc``) from ``stores`` (host -> store) as a DCP checkpoint.

    ``directory`` must be empty or not exist. ``threads`` is DCP's writer
    thread count (each writes its own file). Raises :class:`StateLost` naming
    the regions no given store holds in a committed copy.
    """
    t0 = time.perf_counter()
    v = version if isinstance(version, Version) else Version.parse(version)
    if threads < 1:
        raise InvalidInput(f"threads must be >= 1, got {threads}")
    kmap = km.build(key_map, ptc, options)
    lost = kmap.uncovered(ptc)
    if lost:
        log.warning("key map %s does not export %d regions of the PTC, e.g. %s %s", kmap.name, len(lost), lost[0][0], lost[0][1])
    if TENPLEX_KEY in kmap.by_fqn():
        raise InvalidInput(f"key map {kmap.name!r} uses the key {TENPLEX_KEY!r}, which the export keeps for its own record")
    out = _empty_directory(Path(directory))
    held = _committed_holdings(job, v, stores)
    holder = _pick_holders(ptc, kmap, held)
    chunks = _chunks(ptc, kmap, holder)
    records = _records(job, v, stores, held)
    step, dataset = _position(v, ptc, records)
    total = sum(c.nbytes for c in chunks)
    done = 0
    per_host: dict[str, int] = defaultdict(int)
    lock = threading.Lock()

    def read(c: _Chunk) -> torch.Tensor:
        nonlocal done
        buf = torch.empty(c.source.shape, dtype=torch_dtype(c.dtype))
        if c.source.volume == 0:
            return buf
        stores[c.host].read_into(job, v, c.tensor, c.source, buf, verify=True)
        with lock:
            done += c.nbytes
            per_host[c.host] += c.nbytes
            if progress is not None:
                progress(done, total)
        return buf

    record = {
        "format": FORMAT, "job": job, "version": str(v), "step": step, "key_map": kmap.name,
        "dataset": dataset.to_json() if dataset is not None else None, "ptc_config": dict(ptc.config),
    }
    extras: dict[tuple[str, ...], Any] = {(TENPLEX_KEY,): json.dumps(record)}
    if kmap.extras is not None:
        groups = tuple(g for r in records for g in (r.get("param_groups") or ()))
        for path, value in kmap.extras(km.ExportContext(step, dataset, groups)).items():
            if path in extras or ".".join(path) in kmap.by_fqn():
                raise InvalidInput(f"key map {kmap.name!r} adds the entry {'.'.join(path)!r} twice")
            extras[path] = value
    planner = _ExportPlanner(kmap.entries, chunks, read)
    writer = FileSystemWriter(out, thread_count=threads, sync_files=True, overwrite=False)
    if progress is not None:
        progress(0, total)
    try:
        dcp.save(_nest(extras), storage_writer=writer, planner=planner, no_dist=True)
    except CheckpointException as exc:
        _clear(out)
        raise _unwrap(exc, f"exporting {job} {v} to {out}") from None
    except BaseException:
        _clear(out)
        raise
    result = ExportResult(out, v, kmap.name, len(kmap.entries), len(chunks), total, dict(per_host), step, dataset,
                          time.perf_counter() - t0)
    log.info("exported %s %s to %s: %d entries, %d chunks, %d bytes in %.2fs", job, v, out, result.entries,
             result.chunks, total, result.seconds)
    return result


def _empty_directory(path: Path) -> Path:
    if path.exists():
        if not path.is_dir():
            raise InvalidInput(f"{path} exists and is not a directory")
        if any(path.iterdir()):
            raise Conflict(f"{path} is not empty; export into a new or empty directory")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _clear(path: Path) -> None:
    """Remove what a failed export wrote (the directory was empty before)."""
    for entry in path.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _committed_holdings(job: str, v: Version, stores: Mapping[str, TensorStore]) -> dict[str, dict[str, list[Region]]]:
    """host -> tensor -> stored regions, for every store that holds ``v`` committed."""
    held: dict[str, dict[str, list[Region]]] = {}
    for host, store in stores.items():
        try:
            manifest = store.manifest(job, v)
        except NotFound:
            log.info("store of %s has no version %s of job %s", host, v, job)
            continue
        if not manifest.committed:
            log.warning("store of %s holds version %s of job %s uncommitted: not used", host, v, job)
            continue
        regions: dict[str, list[Region]] = defaultdict(list)
        for s in manifest.shards:
            regions[s.tensor].append(s.region)
        held[host] = dict(regions)
    if not held:
        raise NotFound(f"no given store holds a committed version {v} of job {job!r} (stores: {', '.join(stores) or 'none'})")
    return held


def _covers(regions: Sequence[Region], box: Region) -> bool:
    missing = [box]
    for r in regions:
        missing = [m for b in missing for m in subtract(b, r)]
        if not missing:
            return True
    return not missing


def _pick_holders(ptc: PTC, kmap: km.KeyMap, held: Mapping[str, Mapping[str, list[Region]]]) -> dict[tuple[str, Region], str]:
    """One store per needed shard, the least loaded (in bytes) of those holding it; holders named by the PTC first."""
    needed = sorted({p.tensor for e in kmap.entries for p in e.pieces})
    host_of = {d.id: d.host for d in ptc.devices}
    load: dict[str, int] = dict.fromkeys(held, 0)
    shards = [(t, s) for name in needed for t in (ptc.tensor(name),) for s in t.shards]
    shards.sort(key=lambda ts: -ts[1].region.volume * ts[0].itemsize)
    out: dict[tuple[str, Region], str] = {}
    lost: list[str] = []
    for t, s in shards:
        named = list(dict.fromkeys(host_of[d] for d in s.devices))
        candidates = [h for h in [*named, *sorted(set(held) - set(named))]
                      if h in held and _covers(held[h].get(t.name, ()), s.region)]
        if not candidates:
            lost.append(f"{t.name} {s.region} (PTC holders: {', '.join(named)})")
            continue
        best = min(candidates, key=lambda h: load[h])
        load[best] += s.region.volume * t.itemsize
        out[(t.name, s.region)] = best
    if lost:
        raise StateLost(
            f"{len(lost)} shards are in no given store's committed copy: " + "; ".join(lost[:5])
            + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
        )
    return out


def _chunks(ptc: PTC, kmap: km.KeyMap, holder: Mapping[tuple[str, Region], str]) -> list[_Chunk]:
    out = []
    for e in kmap.entries:
        for p in e.pieces:
            t = ptc.tensor(p.tensor)
            delta = [b - a for a, b in zip(p.source.start, p.target.start, strict=True)]
            if math.prod(e.shape) == 0:  # an empty entry: one empty chunk, so that it is in the metadata
                out.append(_Chunk(e.fqn, Region.full(e.shape), t.name, p.source, "", e.dtype))
                break
            for s in t.shards:
                common = s.region.intersect(p.source)
                if common is None:
                    continue
                target = Region(tuple((a + d, b + d) for (a, b), d in zip(common.bounds, delta, strict=True)))
                out.append(_Chunk(e.fqn, target, t.name, common, holder[(t.name, s.region)], e.dtype))
    return out


def _records(job: str, v: Version, stores: Mapping[str, TensorStore], held: Mapping[str, Mapping[str, list[Region]]]) -> list[dict]:
    """The snapshot's trainer-state records (one per rank that wrote one; none in a reconfiguration's version)."""
    found: dict[str, str] = {}
    for host, tensors in held.items():
        for name in tensors:
            if name.startswith(trainer_state.RECORD_PREFIX):
                found.setdefault(name, host)
    out = []
    for name in sorted(found, key=lambda n: (len(n), n)):
        host = found[name]
        region = held[host][name][0]
        buf = torch.empty(region.shape, dtype=torch.uint8)
        stores[host].read_into(job, v, name, region, buf, verify=True)
        record = trainer_state.load(buf.numpy().tobytes())
        if record.get("step") != v.step:
            raise InvalidInput(f"the trainer-state record {name!r} of version {v} is of step {record.get('step')}")
        out.append(record)
    return out


def _position(v: Version, ptc: PTC, records: Sequence[dict]) -> tuple[int, DatasetState | None]:
    """The version's step and dataset state: a snapshot record's when there is one, else the PTC's."""
    for record in records:
        if record.get("dataset") is not None:
            return v.step, DatasetState.from_json(record["dataset"])
    return v.step, ptc.dataset


def _nest(flat: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise InvalidInput(f"checkpoint entry {'.'.join(path)!r} is nested under a non-dict entry")
        node[path[-1]] = value
    return out


def _unwrap(exc: CheckpointException, what: str) -> BaseException:
    """The Tenplex error behind DCP's wrapper (e.g. a store that failed a read), or a TenplexError saying what failed."""
    for inner, _trace in exc.failures.values():
        if isinstance(inner, TenplexError):
            return inner
    first = next(iter(exc.failures.values()), (exc, None))[0]
    return TenplexError(f"{what} failed: {type(first).__name__}: {first}")


# -- import -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Read:
    """Entry ``fqn``'s box ``target`` goes to box ``dest`` (shard coordinates) of the shard buffer ``key``."""

    fqn: str
    target: Region
    key: tuple[str, Region]
    dest: Region


@dataclass(frozen=True, slots=True)
class _ShardJob:
    tensor: str
    region: Region
    dtype: str
    shape: tuple[int, ...]
    hosts: tuple[str, ...]
    reads: tuple[_Read, ...]

    @property
    def nbytes(self) -> int:
        return self.region.volume * itemsize(self.dtype)


class _RegionLoadPlanner(LoadPlanner):
    """Reads given boxes of checkpoint entries into given views, and given non-tensor entries as values.

    The read items come from DCP's own resharding helper
    (``create_read_items_for_chunk_list``), which intersects each requested
    box with the chunks the checkpoint holds; every requested box is checked
    to be covered exactly, so a damaged checkpoint cannot leave a buffer
    partly unwritten.
    """

    def __init__(self, reads: Sequence[tuple[str, Region, torch.Tensor]], values: Sequence[str] = ()) -> None:
        self._reads = reads
        self._dest: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self._value_keys = list(values)
        self.values: dict[str, Any] = {}

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        if metadata is None:
            raise InvalidInput("the checkpoint has no metadata")
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for fqn, box, view in self._reads:
            md = self.metadata.state_dict_metadata[fqn]
            assert isinstance(md, TensorStorageMetadata)
            key = (fqn, box.start)
            if key in self._dest:
                raise InvalidInput(f"checkpoint entry {fqn!r} box {box} is requested twice")
            self._dest[key] = view
            chunk = ChunkStorageMetadata(offsets=torch.Size(box.start), sizes=torch.Size(box.shape))
            found = create_read_items_for_chunk_list(fqn, md, [chunk])
            got = sum(math.prod(it.lengths) for it in found)
            if got != box.volume:
                raise InvalidInput(
                    f"checkpoint entry {fqn!r}: its saved chunks cover {got} of the {box.volume} elements of {box}"
                )
            items += found
        for fqn in self._value_keys:
            index = MetadataIndex(fqn)
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size((0,)),
                                  storage_index=index, storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # weights_only: a checkpoint's non-tensor entries are data, never code to run
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self._dest[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset or ()))]
        return narrow_tensor_by_index(view, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def read_metadata(directory: str | Path) -> Metadata:
    """The checkpoint's metadata, or :class:`InvalidInput` saying why ``directory`` is not a DCP checkpoint."""
    path = Path(directory)
    if not path.is_dir():
        raise NotFound(f"checkpoint directory {path} does not exist")
    if not (path / ".metadata").is_file():
        raise InvalidInput(f"{path} is not a DCP checkpoint (no .metadata file)")
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as exc:  # unpickling a damaged file raises many types
        raise InvalidInput(f"{path}/.metadata is not readable: {type(exc).__name__}: {exc}") from None


def read_values(directory: str | Path, keys: Sequence[str]) -> dict[str, Any]:
    """Non-tensor entries of a checkpoint (those of ``keys`` it has), loaded with ``weights_only=True``."""
    md = read_metadata(directory)
    present = [k for k in keys if isinstance(md.state_dict_metadata.get(k), BytesStorageMetadata)]
    if not present:
        return {}
    planner = _RegionLoadPlanner([], present)
    _load(directory, planner)
    return planner.values


def _load(directory: str | Path, planner: _RegionLoadPlanner) -> None:
    try:
        dcp.load({}, storage_reader=FileSystemReader(directory), planner=planner, no_dist=True)
    except CheckpointException as exc:
        raise _unwrap(exc, f"reading the checkpoint {directory}") from None


def _plan_import(ptc: PTC, kmap: km.KeyMap, md: Metadata) -> list[_ShardJob]:
    """What fills each shard, after checking the checkpoint has every entry needed, with its shape and dtype."""
    host_of = {d.id: d.host for d in ptc.devices}
    problems: list[str] = []
    checked: set[str] = set()
    jobs = []
    for t in ptc.tensors:
        if t.kind == TensorKind.EXTRA:
            continue
        candidates = kmap.pieces_of(t.name)
        for s in t.shards:
            reads = []
            missing = [s.region] if s.region.volume else []
            for e, p in candidates:
                if not missing:
                    break
                delta = [b - a for a, b in zip(p.source.start, p.target.start, strict=True)]
                for box in list(missing):
                    common = box.intersect(p.source)
                    if common is None:
                        continue
                    if e.fqn not in checked:
                        checked.add(e.fqn)
                        problem = _entry_problem(e, md)
                        if problem:
                            problems.append(problem)
                    target = Region(tuple((a + d, b + d) for (a, b), d in zip(common.bounds, delta, strict=True)))
                    dest = common.relative_to(s.region)
                    reads.append(_Read(e.fqn, target, (t.name, s.region), dest))
                    missing = [m for b in missing for m in subtract(b, common)]
            if missing:
                raise InvalidInput(
                    f"key map {kmap.name!r} gives no checkpoint entry for {t.name!r} {missing[0]} (part of shard {s.region})"
                )
            hosts = tuple(dict.fromkeys(host_of[d] for d in s.devices))
            jobs.append(_ShardJob(t.name, s.region, t.dtype, tuple(t.shape), hosts, tuple(reads)))
    if problems:
        raise InvalidInput(
            f"the checkpoint does not fit the PTC with key map {kmap.name!r}: {len(problems)} problems: "
            + "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        )
    return jobs


def _entry_problem(e: km.Entry, md: Metadata) -> str | None:
    found = md.state_dict_metadata.get(e.fqn)
    if found is None:
        return f"no entry {e.fqn!r}"
    if not isinstance(found, TensorStorageMetadata):
        return f"entry {e.fqn!r} is not a tensor"
    want = torch_dtype(e.dtype)
    if tuple(found.size) != tuple(e.shape):
        return f"entry {e.fqn!r} has shape {list(found.size)}, the PTC needs {list(e.shape)}"
    if found.properties.dtype != want:
        return f"entry {e.fqn!r} is {name_of_torch(found.properties.dtype)}, the PTC needs {e.dtype}"
    return None


def import_dcp(
    directory: str | Path,
    ptc: PTC,
    job: str,
    version: Version | str | None,
    stores: Mapping[str, TensorStore],
    *,
    key_map: str = "identity",
    options: Mapping[str, str] | None = None,
    batch_bytes: int = BATCH_BYTES,
    progress: Progress | None = None,
) -> ImportResult:
    """Write the DCP checkpoint in ``directory`` into ``stores`` as ``version`` of ``job`` laid out by ``ptc``.

    ``stores`` needs every host of the PTC. ``version`` None means
    ``s<step>-g0`` with the step the checkpoint records (0 when it records
    none). Raises :class:`Conflict` when the version exists in any of the
    stores (committed or being written), :class:`InvalidInput` when the
    checkpoint lacks an entry or has a wrong shape or dtype.
    """
    t0 = time.perf_counter()
    if batch_bytes < 1:
        raise InvalidInput(f"batch_bytes must be positive, got {batch_bytes}")
    md = read_metadata(directory)
    kmap = km.build(key_map, ptc, options)
    missing_hosts = [h for h in ptc.hosts if h not in stores]
    if missing_hosts:
        raise InvalidInput(f"no store given for host(s) {', '.join(missing_hosts)} of the PTC")
    values = read_values(directory, [TENPLEX_KEY, "train_state.step"])
    step, recorded = _checkpoint_position(values)
    v = Version(step or 0, 0) if version is None else version if isinstance(version, Version) else Version.parse(version)
    if step is not None and step != v.step:
        log.warning("the checkpoint is of step %d, it is imported as version %s", step, v)
    dataset = _imported_dataset(ptc.dataset, recorded)
    jobs = _plan_import(ptc, kmap, md)
    for host in ptc.hosts:
        _check_absent(stores[host], host, job, v)
    total = sum(j.nbytes for j in jobs)
    written: dict[str, int] = dict.fromkeys(ptc.hosts, 0)
    done = 0
    if progress is not None:
        progress(0, total)
    try:
        for batch in _batches(jobs, batch_bytes):
            buffers = {(j.tensor, j.region): torch.empty(j.region.shape, dtype=torch_dtype(j.dtype)) for j in batch}
            reads = [(r.fqn, r.target, buffers[r.key][r.dest.slices()]) for j in batch for r in j.reads]
            if reads:
                _load(directory, _RegionLoadPlanner(reads))
            for j in batch:
                for host in j.hosts:
                    stores[host].write_shard(job, v, j.tensor, j.region, buffers[(j.tensor, j.region)], dtype=j.dtype,
                                             global_shape=j.shape)
                    written[host] += j.nbytes
                done += j.nbytes
                if progress is not None:
                    progress(done, total)
            del buffers, reads
        for host in ptc.hosts:
            stores[host].commit(job, v)
    except BaseException:
        _discard(stores, ptc.hosts, job, v)
        raise
    out_ptc = dataclasses.replace(ptc, dataset=dataset) if dataset is not None else ptc
    result = ImportResult(v, kmap.name, step, dataset, out_ptc, len(jobs), total, written, time.perf_counter() - t0)
    log.info("imported %s into %s %s: %d shards, %d bytes in %.2fs", directory, job, v, len(jobs), total, result.seconds)
    return result


def _checkpoint_position(values: Mapping[str, Any]) -> tuple[int | None, DatasetState | None]:
    text = values.get(TENPLEX_KEY)
    if text is not None:
        try:
            record = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"the checkpoint's {TENPLEX_KEY!r} entry is not JSON: {exc}") from None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise InvalidInput(f"the checkpoint's {TENPLEX_KEY!r} entry has an unknown format")
        ds = record.get("dataset")
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidInput(f"the checkpoint's {TENPLEX_KEY!r} entry has no valid step: {step!r}")
        return step, DatasetState.from_json(ds) if ds is not None else None
    step = values.get("train_state.step")
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        return step, None
    return None, None


def _imported_dataset(target: DatasetState | None, recorded: DatasetState | None) -> DatasetState | None:
    """The target PTC's sample order at the checkpoint's position (the checkpoint's own state when the PTC has none)."""
    if recorded is None:
        if target is not None:
            log.info("the checkpoint records no dataset position; the PTC's (%d consumed samples) stays", target.consumed_samples)
        return target
    if target is None:
        return recorded
    if (target.num_samples, target.seed) != (recorded.num_samples, recorded.seed):
        log.warning(
            "the checkpoint's sample order (num_samples %d, seed %d) differs from the PTC's (%d, %d): only the position "
            "(%d consumed samples) is carried over", recorded.num_samples, recorded.seed, target.num_samples, target.seed,
            recorded.consumed_samples,
        )
    return dataclasses.replace(target, consumed_samples=recorded.consumed_samples)


def _check_absent(store: TensorStore, host: str, job: str, v: Version) -> None:
    try:
        manifest = store.manifest(job, v)
    except NotFound:
        return
    state = "committed" if manifest.committed else "being written (uncommitted)"
    raise Conflict(f"version {v} of job {job!r} already exists in the store of {host} ({state}); import into a new version")


def _discard(stores: Mapping[str, TensorStore], hosts: Sequence[str], job: str, v: Version) -> None:
    """Delete a failed import's partial version everywhere it reached (it was absent before)."""
    for host in hosts:
        try:
            stores[host].delete(job, v)
        except NotFound:
            pass
        except Exception as exc:  # keep the original failure; report this one
            log.warning("deleting the partial version %s of job %s in the store of %s failed: %s", v, job, host, exc)


def _batches(jobs: Sequence[_ShardJob], limit: int) -> list[list[_ShardJob]]:
    out: list[list[_ShardJob]] = []
    size = 0
    for j in jobs:
        if not out or (size + j.nbytes > limit and out[-1]):
            out.append([])
            size = 0
        out[-1].append(j)
        size += j.nbytes
    return out


# -- sources ----------------------------------------------------------------------


@contextmanager
def host_stores(urls: Mapping[str, str], roots: Mapping[str, str], *, token: str | None = None,
                must_exist: bool = True) -> Iterator[dict[str, TensorStore]]:
    """The stores of a job's hosts, opened from ``HOST=URL`` and ``HOST=DIR`` lists; closed at the end."""
    both = sorted(set(urls) & set(roots))
    if both:
        raise InvalidInput(f"host(s) {', '.join(both)} given both a store URL and a store root")
    with ExitStack() as stack:
        stores: dict[str, TensorStore] = {h: stack.enter_context(StoreClient(u, token)) for h, u in urls.items()}
        for host, root in roots.items():
            if must_exist and not Path(root).is_dir():
                raise NotFound(f"store root {root} of {host} does not exist")
            stores[host] = stack.enter_context(open_store(Path(root)))
        yield stores
