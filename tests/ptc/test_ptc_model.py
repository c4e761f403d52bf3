"""The PTC core: validation, queries, JSON round trip and malformed JSON."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tenplex.errors import InvalidPTC, NotFound, RegionOutOfBounds
from tenplex.ptc import PTC, DatasetState, Device, Region, Shard, Tensor, TensorKind, build_tensor


def small_ptc() -> PTC:
    """Two hosts of two devices; a row-split weight replicated across two dp ranks, a
    replicated bias, and a flat-partitioned optimizer tensor."""
    devices = tuple(
        Device(i, f"host-{i // 2}", {"dp": i // 2, "tp": i % 2, "pp": 0}) for i in range(4)
    )
    weight = build_tensor(
        "w", (4, 6), "bfloat16", "param",
        [(Region(((0, 2), (0, 6))), [0, 2]), (Region(((2, 4), (0, 6))), [1, 3])],
    )
    bias = build_tensor("b", (6,), "float32", TensorKind.PARAM, [(Region(((0, 6),)), [0, 1, 2, 3])])
    moment = build_tensor(
        "optim/w/exp_avg", (4, 6), "float32", "optimizer",
        [
            (Region(((0, 1), (0, 6))), [0]),
            (Region(((1, 2), (0, 3))), [0]),
            (Region(((1, 2), (3, 6))), [2]),
            (Region(((2, 4), (0, 6))), [1, 3]),
        ],
    )
    step = build_tensor("step", (), "int64", "extra", [(Region(()), [0, 1, 2, 3])])
    return PTC(
        config={"dp": 2, "tp": 2, "pp": 1},
        devices=devices,
        tensors=(weight, bias, moment, step),
        dataset=DatasetState(100, 1, 8, 16),
    )


def test_queries() -> None:
    ptc = small_ptc()
    assert ptc.hosts == ("host-0", "host-1")
    assert [d.id for d in ptc.devices_on_host("host-1")] == [2, 3]
    assert ptc.tensor("w").shape == (4, 6)
    assert ptc.has_tensor("b") and not ptc.has_tensor("nope")
    assert [(t.name, s.region.format()) for t, s in ptc.shards_of_device(2)] == [
        ("w", "0:2,0:6"), ("b", "0:6"), ("optim/w/exp_avg", "1:2,3:6"), ("step", ""),
    ]
    on_host = [(t.name, s.region.format()) for t, s in ptc.shards_on_host("host-0")]
    assert on_host == [
        ("w", "0:2,0:6"), ("w", "2:4,0:6"), ("b", "0:6"),
        ("optim/w/exp_avg", "0:1,0:6"), ("optim/w/exp_avg", "1:2,0:3"), ("optim/w/exp_avg", "2:4,0:6"), ("step", ""),
    ]
    owners = ptc.owners("optim/w/exp_avg", Region(((1, 3), (2, 4))))
    assert [(o.shard.devices, o.piece.format()) for o in owners] == [
        ((0,), "1:2,2:3"), ((2,), "1:2,3:4"), ((1, 3), "2:3,2:4"),
    ]
    # bytes: w is bf16 (2 B), b and the moment float32, step int64
    assert ptc.bytes_per_device() == {
        0: 12 * 2 + 6 * 4 + 9 * 4 + 8,
        1: 12 * 2 + 6 * 4 + 12 * 4 + 8,
        2: 12 * 2 + 6 * 4 + 3 * 4 + 8,
        3: 12 * 2 + 6 * 4 + 12 * 4 + 8,
    }
    # a host stores a shard once even when two of its devices hold it
    assert ptc.bytes_per_host() == {
        "host-0": 24 * 2 + 6 * 4 + 24 * 4 - 3 * 4 + 8,
        "host-1": 24 * 2 + 6 * 4 + 15 * 4 + 8,
    }
    assert ptc.total_bytes == 24 * 2 + 6 * 4 + 24 * 4 + 8


def test_query_errors_name_the_value() -> None:
    ptc = small_ptc()
    with pytest.raises(NotFound, match="tensor 'x' is not in the PTC"):
        ptc.tensor("x")
    with pytest.raises(NotFound, match="device 9 is not in the PTC"):
        ptc.shards_of_device(9)
    with pytest.raises(NotFound, match="host 'h' has no devices"):
        ptc.shards_on_host("h")
    with pytest.raises(RegionOutOfBounds, match="stop 7 > 6"):
        ptc.owners("w", Region(((0, 1), (0, 7))))


def test_json_round_trip(tmp_path: Path) -> None:
    ptc = small_ptc()
    text = ptc.dumps()
    again = PTC.loads(text)
    assert again.to_json() == ptc.to_json()
    assert again.tensors == ptc.tensors and again.dataset == ptc.dataset
    assert json.loads(text)["format"] == "tenplex.ptc/v1"
    path = tmp_path / "p.json"
    ptc.save(path)
    assert PTC.load(path).to_json() == ptc.to_json()
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temporary file left behind
    assert PTC.loads(ptc.dumps(indent=2)).to_json() == ptc.to_json()


# -- invalid collections ---------------------------------------------------------


def _with(tensor_json: dict[str, Any], **changes: Any) -> dict[str, Any]:
    obj = small_ptc().to_json()
    obj["tensors"][0] = {**obj["tensors"][0], **tensor_json, **changes}
    return obj


BAD_SHARDS = [
    (
        "overlap",
        [{"region": [[0, 3], [0, 6]], "devices": [0]}, {"region": [[2, 4], [0, 6]], "devices": [1]}],
        r"shards \[0:3, 0:6\] and \[2:4, 0:6\] overlap in \[2:3, 0:6\]",
    ),
    (
        "gap",
        [{"region": [[0, 2], [0, 6]], "devices": [0]}, {"region": [[2, 4], [0, 5]], "devices": [1]}],
        r"shards cover 22 of 24 elements; \[2:4, 5:6\] is not covered",
    ),
    (
        "out of bounds",
        [{"region": [[0, 2], [0, 6]], "devices": [0]}, {"region": [[2, 5], [0, 6]], "devices": [1]}],
        r"out of bounds in dimension 0 \(stop 5 > 4\)",
    ),
    ("unknown device", [{"region": [[0, 4], [0, 6]], "devices": [7]}], "names device 7, which does not exist"),
    ("no device", [{"region": [[0, 4], [0, 6]], "devices": []}], "is held by no device"),
    ("device twice", [{"region": [[0, 4], [0, 6]], "devices": [1, 1]}], r"lists a device twice: \[1, 1\]"),
    ("no shards", [], "has no shards"),
    ("wrong rank", [{"region": [[0, 24]], "devices": [0]}], "has rank 1, expected 2"),
    ("empty shard", [{"region": [[0, 4], [0, 6]], "devices": [0]}, {"region": [[4, 4], [0, 6]], "devices": [1]}], "is empty"),
]


@pytest.mark.parametrize(("label", "shards", "message"), BAD_SHARDS, ids=[b[0] for b in BAD_SHARDS])
def test_inconsistent_shards_are_rejected(label: str, shards: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(InvalidPTC, match=message) as info:
        PTC.from_json(_with({"shards": shards}))
    assert "tensor 'w' (shape [4, 6])" in str(info.value)


def _mutate(path: list[Any], value: Any) -> dict[str, Any]:
    obj = copy.deepcopy(small_ptc().to_json())
    target = obj
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return obj


_DELETE = object()

MALFORMED = [
    ("wrong format", ["format"], "tenplex.ptc/v0", r"unsupported format 'tenplex.ptc/v0'; expected 'tenplex.ptc/v1'"),
    ("no format", ["format"], _DELETE, "unsupported format None"),
    ("no devices", ["devices"], _DELETE, "PTC: missing 'devices'"),
    ("devices not a list", ["devices"], {"0": 1}, "'devices' must be a list"),
    ("device id string", ["devices", 0, "id"], "0", r"devices\[0\]: 'id' must be an integer, got str '0'"),
    ("device id bool", ["devices", 0, "id"], True, r"devices\[0\]: 'id' must be an integer, got True"),
    ("device id twice", ["devices", 1, "id"], 0, "device id 0 appears twice"),
    ("host missing", ["devices", 0, "host"], _DELETE, r"devices\[0\]: missing 'host'"),
    ("coords", ["devices", 0, "coords"], {"dp": "0"}, "coords must map names to integers"),
    ("tensor name", ["tensors", 0, "name"], 5, r"tensors\[0\]: 'name' must be a string, got int 5"),
    ("duplicate tensor", ["tensors", 1, "name"], "w", "tensor 'w' appears twice"),
    ("unknown dtype", ["tensors", 0, "dtype"], "bfloat8", "tensor 'w' .*unknown dtype 'bfloat8'; known: bfloat16"),
    ("unknown kind", ["tensors", 0, "kind"], "weights", "kind must be one of .* got 'weights'"),
    ("shape", ["tensors", 0, "shape"], [4, "6"], r"shape must be a list of integers, got \[4, '6'\]"),
    ("negative dim", ["tensors", 0, "shape"], [4, -6], "dimensions must be non-negative integers"),
    ("region pairs", ["tensors", 0, "shards", 0, "region"], [[0, 2, 3], [0, 6]], "not a .start, stop. pair"),
    ("region floats", ["tensors", 0, "shards", 0, "region"], [[0, 2.0], [0, 6]], "list of .start, stop. integer pairs"),
    ("region reversed", ["tensors", 0, "shards", 0, "region"], [[2, 0], [0, 6]], r"needs 0 <= start <= stop, got \[2, 0\)"),
    ("shard devices", ["tensors", 0, "shards", 0, "devices"], "0,2", r"shards\[0\]: .devices. must be a list, got str .0,2."),
    ("shard device type", ["tensors", 0, "shards", 0, "devices"], [0, "2"], "devices must be a list of integers"),
    ("shard missing region", ["tensors", 0, "shards", 0, "region"], _DELETE, r"shards\[0\]: missing 'region'"),
    ("dataset", ["dataset", "seed"], 1.5, "dataset seed must be an integer, got 1.5"),
    ("config", ["config"], [1], "'config' must be an object"),
]


@pytest.mark.parametrize(("label", "path", "value", "message"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_json_gives_a_clear_error(label: str, path: list[Any], value: Any, message: str) -> None:
    with pytest.raises(InvalidPTC, match=message):
        PTC.from_json(_mutate(path, value))


def test_not_json_or_not_an_object(tmp_path: Path) -> None:
    with pytest.raises(InvalidPTC, match="not JSON"):
        PTC.loads("{")
    with pytest.raises(InvalidPTC, match="must be a JSON object, got list"):
        PTC.loads("[]")
    with pytest.raises(InvalidPTC, match="cannot read PTC file"):
        PTC.load(tmp_path / "missing.json")


def test_direct_construction_is_validated() -> None:
    """An invalid PTC cannot be built silently, also without JSON."""
    good = small_ptc()
    bad = Tensor("x", (3,), "float32", TensorKind.PARAM, (Shard(Region(((0, 2),)), (0,)),))
    with pytest.raises(InvalidPTC, match=r"tensor 'x' \(shape \[3\]\): shards cover 2 of 3 elements; \[2:3\]"):
        PTC(config={}, devices=good.devices, tensors=(*good.tensors, bad))
    scalar = Tensor("s", (), "float32", TensorKind.EXTRA, (Shard(Region(()), (0,)), Shard(Region(()), (1,))))
    with pytest.raises(InvalidPTC, match="0-d tensor has 2 shards"):
        PTC(config={}, devices=good.devices, tensors=(scalar,))
    with pytest.raises(InvalidPTC, match="no host name"):
        PTC(config={}, devices=(Device(0, ""),), tensors=())


def test_build_tensor_merges_equal_regions() -> None:
    t = build_tensor("t", (4,), "float32", "buffer", [(Region(((0, 4),)), [0]), (Region(((0, 4),)), [3])])
    assert t.shards == (Shard(Region(((0, 4),)), (0, 3)),)
    assert t.kind is TensorKind.BUFFER and t.nbytes == 16
