"""DCP export and import round trips, bit for bit, through real stores (local roots and a store daemon)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tenplex.errors import Conflict, InvalidInput, NotFound, StateLost
from tenplex.interop.dcp import TENPLEX_KEY, export_dcp, import_dcp, read_metadata
from tenplex.ptc import PTC, Region
from tenplex.ptc.dtypes import torch_dtype
from tenplex.store.local import LocalStore

from .conftest import (
    JOB,
    RECORDED,
    VERSION,
    Cluster,
    assert_bits_equal,
    random_state,
    source_ptc,
    target_ptc,
    write_version,
)


def _exported(cluster: Cluster, tmp_path: Path, *, record: bool = True) -> tuple[PTC, dict[str, torch.Tensor], Path, object]:
    ptc = source_ptc()
    state = random_state(ptc, seed=1)
    write_version(ptc, cluster.stores(), state, JOB, VERSION, record_dataset=RECORDED if record else None)
    out = tmp_path / "ckpt"
    seen: list[tuple[int, int]] = []
    result = export_dcp(JOB, VERSION, ptc, cluster.stores(), out, threads=2, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1][0] == seen[-1][1] == result.bytes
    return ptc, state, out, result


def test_export_loads_into_plain_tensors_bit_exactly(cluster: Cluster, tmp_path: Path) -> None:
    ptc, state, out, result = _exported(cluster, tmp_path)
    # every region once: the bytes read are one copy of the state, spread over the holders
    assert result.bytes == ptc.total_bytes
    assert set(result.bytes_per_host) == {"h0", "h1", "h2"}
    assert result.chunks == sum(len(t.shards) for t in ptc.tensors)
    md = read_metadata(out)
    assert len(md.state_dict_metadata["layers.0.w"].chunks) == 2  # saved as the stored shards, not gathered
    sd = {name: torch.zeros(t.shape, dtype=t.dtype) for name, t in state.items()}
    sd[TENPLEX_KEY] = ""
    dcp.load(sd, checkpoint_id=out, no_dist=True)
    for name, want in state.items():
        assert_bits_equal(sd[name], want, name)
    record = json.loads(sd[TENPLEX_KEY])
    assert record["step"] == 7 and record["version"] == VERSION and record["job"] == JOB
    assert record["dataset"] == RECORDED.to_json()  # the snapshot's own record, not the PTC's older position


def test_export_without_record_uses_the_ptc_dataset(cluster: Cluster, tmp_path: Path) -> None:
    ptc, _state, _out, result = _exported(cluster, tmp_path, record=False)
    assert result.dataset == ptc.dataset


def test_import_into_another_layout_and_read_back(cluster: Cluster, tmp_path: Path) -> None:
    _ptc, state, out, _ = _exported(cluster, tmp_path)
    new = target_ptc()
    roots = {h: tmp_path / "new" / h for h in new.hosts}
    stores = {h: LocalStore(r) for h, r in roots.items()}
    result = import_dcp(out, new, "job-b", None, stores, batch_bytes=200)  # small batches: several dcp.load calls
    assert str(result.version) == "s7-g0" and result.step == 7
    assert result.dataset is not None and result.dataset.consumed_samples == RECORDED.consumed_samples
    assert result.dataset.global_batch_size == 32  # the target's batch size, the checkpoint's position
    assert result.ptc.dataset == result.dataset
    for host in new.hosts:
        local = LocalStore(roots[host])
        assert local.manifest("job-b", "s7-g0").committed
        for t, s in new.shards_on_host(host):
            buf = torch.empty(s.region.shape, dtype=torch_dtype(t.dtype))
            local.read_into("job-b", "s7-g0", t.name, s.region, buf)
            assert_bits_equal(buf, state[t.name][s.region.slices()], f"{host} {t.name} {s.region}")


def test_import_refuses_a_committed_version_and_bad_checkpoints(cluster: Cluster, tmp_path: Path) -> None:
    ptc, _state, out, _ = _exported(cluster, tmp_path)
    # the version exists already (the source stores hold it)
    with pytest.raises(Conflict, match="already exists"):
        import_dcp(out, ptc, JOB, VERSION, cluster.stores())
    new = target_ptc()
    stores = {h: LocalStore(tmp_path / "new" / h) for h in new.hosts}
    # a tensor the checkpoint lacks
    bigger = PTC(new.config, new.devices, (*new.tensors, _extra_tensor("extra.bias", (3,), "float32")), new.dataset)
    with pytest.raises(InvalidInput, match="no entry 'extra.bias'"):
        import_dcp(out, bigger, "job-b", "s0-g0", stores)
    # a wrong shape and a wrong dtype
    for name, shape, dtype, match in (("norm.weight", (7,), "bfloat16", r"has shape \[6\], the PTC needs \[7\]"),
                                      ("norm.weight", (6,), "float32", "is bfloat16, the PTC needs float32")):
        tensors = tuple(_extra_tensor(name, shape, dtype) if t.name == name else t for t in new.tensors)
        with pytest.raises(InvalidInput, match=match):
            import_dcp(out, PTC(new.config, new.devices, tensors, new.dataset), "job-b", "s0-g0", stores)
    # nothing was written by the refused imports
    for h in new.hosts:
        with pytest.raises(NotFound):
            stores[h].manifest("job-b", "s0-g0")
    # a store missing for a host, and a directory that is no checkpoint
    with pytest.raises(InvalidInput, match="no store given for host"):
        import_dcp(out, new, "job-b", "s0-g0", {"n0": stores["n0"]})
    with pytest.raises(InvalidInput, match="not a DCP checkpoint"):
        import_dcp(tmp_path, new, "job-b", "s0-g0", stores)


def test_failed_import_leaves_no_partial_version(cluster: Cluster, tmp_path: Path) -> None:
    _ptc, _state, out, _ = _exported(cluster, tmp_path)
    new = target_ptc()
    stores = {h: LocalStore(tmp_path / "new" / h) for h in new.hosts}
    broken = out / next(p.name for p in out.iterdir() if p.suffix == ".distcp")
    broken.write_bytes(broken.read_bytes()[:50])  # a truncated data file
    with pytest.raises(Exception):  # noqa: B017 - torch's unpickling error, whatever its type
        import_dcp(out, new, "job-b", "s0-g0", stores, batch_bytes=64)
    for h in new.hosts:
        with pytest.raises(NotFound):
            stores[h].manifest("job-b", "s0-g0")


def test_export_refusals(cluster: Cluster, tmp_path: Path) -> None:
    ptc = source_ptc()
    state = random_state(ptc, seed=2)
    write_version(ptc, cluster.stores(), state, JOB, VERSION)
    nonempty = tmp_path / "full"
    nonempty.mkdir()
    (nonempty / "x").write_text("keep me")
    with pytest.raises(Conflict, match="not empty"):
        export_dcp(JOB, VERSION, ptc, cluster.stores(), nonempty)
    assert (nonempty / "x").read_text() == "keep me"
    with pytest.raises(NotFound, match="no given store holds a committed version s8-g2"):
        export_dcp(JOB, "s8-g2", ptc, cluster.stores(), tmp_path / "a")
    # h0 alone lacks the shard of emb.weight held on h1 and h2 only
    with pytest.raises(StateLost, match=r"emb.weight \[0:10, 3:4\]"):
        export_dcp(JOB, VERSION, ptc, {"h0": cluster.stores()["h0"]}, tmp_path / "b")
    assert not any((tmp_path / "b").iterdir())
    # without h1, every region still has a holder (h0 or h2)
    result = export_dcp(JOB, VERSION, ptc, {h: s for h, s in cluster.stores().items() if h != "h1"}, tmp_path / "c")
    assert set(result.bytes_per_host) == {"h0", "h2"}


def _extra_tensor(name: str, shape: tuple[int, ...], dtype: str):
    from tenplex.ptc import TensorKind, build_tensor

    return build_tensor(name, shape, dtype, TensorKind.PARAM, [(Region.full(shape), (0, 1, 2, 3))])
