"""One target host's part of a plan in a compact binary form: what the control plane sends each daemon.

At 16,384 GPUs a plan holds a million transfers; as JSON every host's part
together was 1.2 GiB and 16 s to build, three quarters of it the lists of
alternative sources repeated on every piece of a replicated parameter. The
part is built per host, when it is sent, straight from the planner's arrays
(:meth:`Plan.part_arrays`), and encoded as:

``MAGIC`` (8 bytes) | format version (u32 LE) | header length (u32 LE) | header (JSON) | arrays

The header is small and per host: the plan's scalars (job, versions, totals,
dataset, configurations), the host, the tensors its part names (name, dtype,
shape: each once), the hosts it names (each once), and each array's dtype and
shape. The arrays, each at an 8-byte aligned offset, little-endian, are:

- ``shard_tensor`` (S), ``shard_lo``/``shard_hi`` (S x ndim): the destination shards in order;
- ``source`` (T): index into the hosts, or -1 zero-fill, -2 the checkpoint; ``shard`` (T): the destination
  shard; ``lo``/``hi`` (T x ndim): the piece's global box; ``altset`` (T): index of its holder set, or -1;
- ``set_offsets`` (A + 1), ``set_members``: the holder sets, each stored once per part: a transfer's
  alternatives are its set's members other than its source, in the set's order.

Bounds past a tensor's rank are padding (``[0, 1)``). A transfer's byte count
follows from its box and dtype and its tensor is its destination shard's, so
neither is sent. A daemon that meets another format version refuses the part
with a clear error (:class:`~tenplex.errors.InvalidInput`) rather than
misreading it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from tenplex.errors import InvalidInput, TenplexError
from tenplex.ptc import dtypes
from tenplex.ptc.region import Region
from tenplex.transformer.plan import CHECKPOINT, DestShard, HostPlan, Plan, Transfer

MAGIC = b"TPLXPART"
VERSION = 1
_PREFIX = struct.Struct("<8sII")
_ZERO, _CKPT = -1, -2
_ARRAYS = ("shard_tensor", "shard_lo", "shard_hi", "source", "shard", "lo", "hi", "altset", "set_offsets",
           "set_members")


def _int_array(a: np.ndarray) -> np.ndarray:
    """int32 when every value fits (bounds of real tensors do), else int64; little-endian either way."""
    if a.size == 0 or (int(a.max()) < 2**31 and int(a.min()) >= -(2**31)):
        return np.ascontiguousarray(a, dtype="<i4")
    return np.ascontiguousarray(a, dtype="<i8")


def encode(plan: Plan, host: str) -> bytes:
    """``host``'s part of ``plan``, encoded (see the module doc). Built from the planner's arrays when the plan
    has them (a plan from :func:`make_plan`), else from the host's objects."""
    arrays = plan.part_arrays(host)  # (a clear error for a host without a part)
    if arrays is None:
        arrays = _arrays_of(plan.host(host))
    return _pack(plan.scalars_json(), arrays)


def _arrays_of(hp: HostPlan) -> dict[str, Any]:
    """The arrays of a host plan made of objects (loaded from JSON, or decoded)."""
    shards = hp.shards
    tensor_id: dict[str, int] = {}
    tensors: list[tuple[str, str, tuple[int, ...]]] = []
    for s in shards:
        if s.tensor not in tensor_id:
            tensor_id[s.tensor] = len(tensors)
            tensors.append((s.tensor, s.dtype, tuple(s.global_shape)))
    ndim = max([1, *(len(t[2]) for t in tensors)])
    host_id: dict[str, int] = {}
    set_id: dict[tuple[int, ...], int] = {}
    sets: list[tuple[int, ...]] = []

    def hid(name: str) -> int:
        return host_id.setdefault(name, len(host_id))

    def padded(r: Region) -> list[tuple[int, int]]:
        return list(r.bounds) + [(0, 1)] * (ndim - len(r.bounds))

    source, shard, altset, boxes = [], [], [], []
    for t in hp.transfers:
        if t.source is None:
            src = _ZERO
        elif t.source == CHECKPOINT:
            src = _CKPT
        else:
            src = hid(t.source)
        members = ((src,) if src >= 0 else ()) + tuple(hid(a) for a in t.alternatives)
        if t.alternatives:
            k = set_id.get(members)
            if k is None:
                k = set_id[members] = len(sets)
                sets.append(members)
        else:
            k = -1
        source.append(src)
        shard.append(t.shard)
        altset.append(k)
        boxes.append(padded(t.region))
    sbox = np.array([padded(s.region) for s in shards], dtype=np.int64).reshape(len(shards), ndim, 2)
    tbox = np.array(boxes, dtype=np.int64).reshape(len(boxes), ndim, 2)
    return dict(
        host=hp.host, tensors=tensors, hosts=list(host_id),
        shard_tensor=np.array([tensor_id[s.tensor] for s in shards], dtype=np.int64),
        shard_lo=sbox[:, :, 0], shard_hi=sbox[:, :, 1], source=np.array(source, dtype=np.int64),
        shard=np.array(shard, dtype=np.int64), lo=tbox[:, :, 0], hi=tbox[:, :, 1],
        altset=np.array(altset, dtype=np.int64), sets=sets)


def _pack(plan_header: Mapping[str, Any], a: Mapping[str, Any]) -> bytes:
    """Encode a host's part given as arrays with global ids (:meth:`Plan.part_arrays`, :func:`_arrays_of`):
    ``tensors`` and ``hosts`` resolve them, ``sets`` are host-id tuples, the rest are the format's arrays."""
    sets = a["sets"]
    offsets = np.zeros(len(sets) + 1, dtype=np.int64)
    if sets:
        offsets[1:] = np.cumsum([len(s) for s in sets])
        members = np.fromiter((m for s in sets for m in s), dtype=np.int64, count=int(offsets[-1]))
    else:
        members = np.zeros(0, dtype=np.int64)
    values = {**a, "set_offsets": offsets, "set_members": members}
    encoded = {name: _int_array(values[name]) for name in _ARRAYS}
    header = {
        **plan_header, "host": a["host"], "tensors": [[n, d, list(s)] for n, d, s in a["tensors"]], "hosts": list(a["hosts"]),
        "arrays": [[name, encoded[name].dtype.str, list(encoded[name].shape)] for name in _ARRAYS],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(len(head) + _PREFIX.size) % 8)
    out = [_PREFIX.pack(MAGIC, VERSION, len(head)), head]
    for name in _ARRAYS:
        raw = encoded[name].tobytes()
        out.append(raw)
        if len(raw) % 8:
            out.append(b"\0" * (-len(raw) % 8))
    return b"".join(out)


def decode(data: bytes | memoryview) -> Plan:
    """The plan an encoded part is of, with only that host's part; InvalidInput naming what is wrong for a part
    this daemon cannot read (another format version, truncated, inconsistent)."""
    if len(data) < _PREFIX.size or bytes(data[:8]) != MAGIC:
        raise InvalidInput(f"not a tenplex plan part: it does not start with {MAGIC!r}")
    version = _PREFIX.unpack_from(data)[1]
    if version != VERSION:
        raise InvalidInput(f"plan part format version {version}: this daemon reads version {VERSION} only "
                           "(the scheduler and the node daemons must run matching releases)")
    try:
        return _decode(memoryview(data))
    except TenplexError as exc:
        raise InvalidInput(f"malformed plan part: {exc.detail}") from None
    except (KeyError, TypeError, ValueError, IndexError, struct.error) as exc:
        raise InvalidInput(f"malformed plan part: {type(exc).__name__}: {exc}") from None


def _decode(data: memoryview) -> Plan:
    _, _, head_len = _PREFIX.unpack_from(data)
    start = _PREFIX.size
    h = json.loads(bytes(data[start:start + head_len]))
    pos = start + head_len
    arrays: dict[str, np.ndarray] = {}
    for name, dtype, shape in h["arrays"]:
        if name not in _ARRAYS or dtype not in ("<i4", "<i8"):
            raise ValueError(f"array {name!r} of dtype {dtype!r} is not part of the format")
        count = int(np.prod(shape)) if shape else 1
        nbytes = count * np.dtype(dtype).itemsize
        if pos + nbytes > len(data):
            raise ValueError(f"the part is truncated in array {name!r}")
        arrays[name] = np.frombuffer(data, dtype=dtype, count=count, offset=pos).reshape(shape).astype(np.int64)
        pos += nbytes + (-nbytes % 8)
    missing = [n for n in _ARRAYS if n not in arrays]
    if missing:
        raise ValueError(f"arrays {missing} are missing")
    host = str(h["host"])
    tensors = [(str(n), dtypes.check_dtype(d), tuple(int(x) for x in s)) for n, d, s in h["tensors"]]
    hosts = [str(x) for x in h["hosts"]]
    s_tensor, s_lo, s_hi = arrays["shard_tensor"].tolist(), arrays["shard_lo"].tolist(), arrays["shard_hi"].tolist()
    shards = []
    for t, lo, hi in zip(s_tensor, s_lo, s_hi, strict=True):
        name, dtype, shape = tensors[t]
        n = len(shape)
        shards.append(DestShard(name, Region(tuple(zip(lo[:n], hi[:n], strict=True))), dtype, shape))
    offsets, members = arrays["set_offsets"].tolist(), arrays["set_members"].tolist()
    sets = [tuple(hosts[m] for m in members[offsets[i]:offsets[i + 1]]) for i in range(len(offsets) - 1)]
    transfers = []
    for i, (src, k, lo, hi, alt) in enumerate(zip(arrays["source"].tolist(), arrays["shard"].tolist(),
                                                  arrays["lo"].tolist(), arrays["hi"].tolist(),
                                                  arrays["altset"].tolist(), strict=True)):
        if not 0 <= k < len(shards):
            raise ValueError(f"transfer {i} names shard {k}, the part has {len(shards)}")
        dest = shards[k]
        n = len(dest.global_shape)
        region = Region(tuple(zip(lo[:n], hi[:n], strict=True)))
        if not dest.region.contains(region):
            raise ValueError(f"transfer {i} ({dest.tensor} {region}) does not lie in its destination shard "
                             f"({dest.region})")
        source = None if src == _ZERO else CHECKPOINT if src == _CKPT else hosts[src]
        alts = tuple(a for a in sets[alt] if a != source) if alt >= 0 else ()
        transfers.append(Transfer(source, dest.tensor, region, k, region.volume * dtypes.itemsize(dest.dtype), alts))
    return Plan.from_scalars(h, {host: HostPlan(host, shards, transfers)})


__all__ = ["MAGIC", "VERSION", "decode", "encode"]
