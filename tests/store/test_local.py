"""LocalStore on a real tmp dir: round trips, assembly across shards, versions, commit, gc, verify, bad input."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenplex.core.version import Version
from tenplex.errors import (
    ChecksumMismatch,
    InvalidInput,
    NotFound,
    RegionOutOfBounds,
    StateLost,
)
from tenplex.ptc.dtypes import storage_dtype
from tenplex.ptc.region import Region
from tenplex.store import local as local_module
from tenplex.store.local import LocalStore

from .conftest import square_chunks


def random_array(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    """Random bytes viewed as the storage dtype: every bit pattern (NaNs, -0.0, subnormals) included."""
    st_ = storage_dtype(dtype)
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    if st_ == np.bool_:
        return rng.integers(0, 2, size=n).astype(np.bool_).reshape(shape)
    raw = rng.integers(0, 256, size=n * st_.itemsize, dtype=np.uint8)
    return raw.view(st_).reshape(shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def test_negative_zero_and_nan_payloads_survive(store: LocalStore) -> None:
    # chunks equal to the fill value (0.0) must still be written, or -0.0 comes back as +0.0
    data = np.full((64, 64), -0.0, np.float32)
    data[0, 0] = np.frombuffer(np.uint32(0x7FC01234).tobytes(), np.float32)[0]  # NaN with a payload
    store.write_shard("j", "s1-g0", "w", Region.full(data.shape), data, dtype="float32", global_shape=data.shape)
    out = np.empty_like(data)
    store.read_into("j", "s1-g0", "w", Region.full(data.shape), out, uncommitted=True)
    assert same_bits(out, data)


SHAPE = (50, 40)
FULL = np.arange(50 * 40, dtype=np.float32).reshape(SHAPE)


@pytest.fixture(scope="module")
def tiled(tmp_path_factory: pytest.TempPathFactory) -> LocalStore:
    """A 50x40 tensor stored as a 2x3 grid of uneven shards (a TP x PP-like tiling), committed."""
    s = LocalStore(tmp_path_factory.mktemp("tiled"), chunk_bytes=1024)
    for r0, r1 in ((0, 17), (17, 50)):
        for c0, c1 in ((0, 10), (10, 31), (31, 40)):
            box = Region(((r0, r1), (c0, c1)))
            s.write_shard("j", "s5-g0", "layers.0/w", box, np.ascontiguousarray(FULL[box.slices()]), dtype="float32", global_shape=SHAPE)
    s.commit("j", "s5-g0")
    return s


@st.composite
def regions(draw: st.DrawFn, shape: tuple[int, ...]) -> Region:
    bounds = []
    for n in shape:
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, n))
        bounds.append((a, b))
    return Region(tuple(bounds))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(region=regions(SHAPE))
def test_any_region_is_assembled_across_shards(tiled: LocalStore, region: Region) -> None:
    out = np.full(region.shape, -1, np.float32)
    tiled.read_into("j", "s5-g0", "layers.0/w", region, out)
    assert np.array_equal(out, FULL[region.slices()])


def test_read_touches_only_the_chunks_of_the_region(tmp_path: Path) -> None:
    s = LocalStore(tmp_path, chunk_bytes=400)  # 10x10 float32 chunks
    data = random_array((40, 40), "float32")
    s.write_shard("j", "s1-g0", "w", Region.full((40, 40)), data, dtype="float32", global_shape=(40, 40))
    s.commit("j", "s1-g0")
    shard_dir = tmp_path / "j" / "s1-g0" / "w" / "r0-40_0-40"
    # truncate every chunk outside rows 10..20 x cols 20..30: decoding one would raise
    for i in range(4):
        for k in range(4):
            if (i, k) != (1, 2):
                (shard_dir / f"c.{i}.{k}").write_bytes(b"bad")
    out = np.empty((7, 5), np.float32)
    s.read_into("j", "s1-g0", "w", Region(((12, 19), (21, 26))), out)
    assert np.array_equal(out, data[12:19, 21:26])
    with pytest.raises(StateLost, match="has 3 bytes"):
        s.read_into("j", "s1-g0", "w", Region(((0, 1), (0, 1))), np.empty((1, 1), np.float32))
    (shard_dir / "c.0.0").unlink()  # zarr would read a missing chunk as zeros; the store says it is damaged
    with pytest.raises(StateLost, match="missing"):
        s.read_into("j", "s1-g0", "w", Region(((0, 1), (0, 1))), np.empty((1, 1), np.float32))


def test_write_errors_store_nothing(store: LocalStore) -> None:
    box = Region.full((4, 4))
    ok = np.zeros((4, 4), np.float32)
    with pytest.raises(InvalidInput, match="float64"):
        store.write_shard("j", "s1-g0", "w", box, ok.astype(np.float64), dtype="float32", global_shape=(4, 4))
    with pytest.raises(InvalidInput, match="shape"):
        store.write_shard("j", "s1-g0", "w", box, np.zeros((4, 3), np.float32), dtype="float32", global_shape=(4, 4))
    with pytest.raises(RegionOutOfBounds):
        store.write_shard("j", "s1-g0", "w", Region.full((5, 4)), np.zeros((5, 4), np.float32), dtype="float32", global_shape=(4, 4))
    with pytest.raises(InvalidInput, match="unknown dtype"):
        store.write_shard("j", "s1-g0", "w", box, ok, dtype="float8", global_shape=(4, 4))
    with pytest.raises(InvalidInput, match="torch.float32"):
        store.write_shard("j", "s1-g0", "w", box, torch.zeros(4, 4), dtype="bfloat16", global_shape=(4, 4))
    for bad_job in ("", "../x", ".hidden", "a/b", "x\x00"):
        with pytest.raises(InvalidInput, match="job name"):
            store.write_shard(bad_job, "s1-g0", "w", box, ok, dtype="float32", global_shape=(4, 4))
    for bad_tensor in ("../w", "/abs", "a//b", "a/./b", "a\\b", "w\x00", ".w", ""):
        with pytest.raises(InvalidInput, match="tensor name"):
            store.write_shard("j", "s1-g0", bad_tensor, box, ok, dtype="float32", global_shape=(4, 4))
    with pytest.raises(InvalidInput, match="s<step>-g<generation>"):
        store.write_shard("j", "../s1", "w", box, ok, dtype="float32", global_shape=(4, 4))
    assert store.jobs() == []
    assert not any(p.is_file() for p in store.root.rglob("*"))


def test_delete_and_gc_keep_the_newest_committed(store: LocalStore) -> None:
    def put(v: str) -> None:
        store.write_shard("j", v, "w", Region.full((2,)), np.zeros(2, np.int8), dtype="int8", global_shape=(2,))

    for step in (1, 2, 3, 4):
        put(f"s{step}-g0")
        store.commit("j", f"s{step}-g0")
    put("s3-g1")  # torn: older than the newest committed
    put("s9-g0")  # maybe still being written: newer than every committed one
    deleted = store.gc("j", keep_last=2)
    assert sorted(map(str, deleted)) == ["s1-g0", "s2-g0", "s3-g1"]
    assert [str(vi.version) for vi in store.versions("j")] == ["s3-g0", "s4-g0", "s9-g0"]
    store.delete("j", "s9-g0")
    with pytest.raises(NotFound):
        store.delete("j", "s9-g0")
    with pytest.raises(InvalidInput, match="keep_last"):
        store.gc("j", keep_last=0)
    assert [str(vi.version) for vi in store.versions("j")] == ["s3-g0", "s4-g0"]
    assert not any((store.root / ".staging" / "j").iterdir())


def test_another_process_store_never_serves_a_deleted_version_from_its_cache(store: LocalStore) -> None:
    """Two stores on one root (the daemon and a worker, or `tenplex store gc`): what one deletes, and writes
    again under the same name, the other reads anew, not from the reader it cached."""
    other = LocalStore(store.root, chunk_bytes=4096)

    def put(value: int) -> None:
        store.write_shard("j", "s1-g0", "w", Region.full((4,)), np.full(4, value, np.int32), dtype="int32",
                          global_shape=(4,))
        store.commit("j", "s1-g0")

    def read() -> list[int]:
        out = np.empty(4, np.int32)
        other.read_into("j", "s1-g0", "w", Region.full((4,)), out)
        return out.tolist()

    put(1)
    assert read() == [1] * 4 and other.cached_tensor("j", Version.parse("s1-g0"), "w") is not None
    store.delete("j", "s1-g0")
    with pytest.raises(NotFound):
        read()
    put(2)
    assert read() == [2] * 4


def test_verify_reports_corruption(store: LocalStore) -> None:
    data = random_array((64, 64), "float32")
    store.write_shard("j", "s1-g0", "w", Region.full((64, 64)), data, dtype="float32", global_shape=(64, 64))
    store.write_shard("j", "s1-g0", "b", Region.full((64,)), data[0].copy(), dtype="float32", global_shape=(64,))
    store.commit("j", "s1-g0")
    assert store.verify("j", "s1-g0") == []
    chunk = next(p for p in (store.root / "j" / "s1-g0" / "w" / "r0-64_0-64").iterdir() if p.name.startswith("c"))
    raw = bytearray(chunk.read_bytes())
    raw[5] ^= 0x01
    chunk.write_bytes(bytes(raw))
    problems = store.verify("j", "s1-g0")
    assert len(problems) == 1 and problems[0].startswith("w 0:64,0:64: checksum")


def test_leftover_staging_of_a_dead_writer_is_invisible(store: LocalStore) -> None:
    store.write_shard("j", "s1-g0", "w", Region.full((4,)), np.zeros(4, np.int16), dtype="int16", global_shape=(4,))
    store.commit("j", "s1-g0")
    writer = store.open_writer("j", "s2-g0", "w", Region.full((4,)), dtype="int16", global_shape=(4,))
    writer.write_piece(0, np.ones(4, np.int16))  # never finished: as if the process died here
    assert [str(v.version) for v in store.versions("j")] == ["s1-g0"]
    shutil.rmtree(writer.staging)
    assert os.listdir(store.root / ".staging" / "j") == []


def test_chunks_are_4_mib_bands_of_whole_rows(tmp_path: Path) -> None:
    import zarr

    s = LocalStore(tmp_path)
    s.write_shard("j", "s1-g0", "w", Region.full((2048, 2048)), np.zeros((2048, 2048), np.float32), dtype="float32", global_shape=(2048, 2048))
    arr = zarr.open_array(str(tmp_path / "j" / "s1-g0" / "w" / "r0-2048_0-2048"), mode="r")
    assert arr.chunks == (512, 2048)
    assert arr.compressors == ()


SHAPE3 = (5, 19, 23)
FULL3 = random_array(SHAPE3, "int16", seed=5)


@pytest.fixture(scope="module", params=["whole-rows", "square"])
def cube(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStore]:
    """A 3-d int16 tensor in two shards with tiny chunks (1 x 5 x 23 whole rows, or the 1 x 11 x 11 of
    stores written before whole-row chunks), so that regions cut chunks in every way."""
    mp = pytest.MonkeyPatch()
    if request.param == "square":
        mp.setattr(local_module, "chunk_shape", square_chunks)
    s = LocalStore(tmp_path_factory.mktemp("cube"), chunk_bytes=256)
    for a, b in ((0, 2), (2, 5)):
        box = Region(((a, b), (0, 19), (0, 23)))
        s.write_shard("j", "s1-g0", "c", box, np.ascontiguousarray(FULL3[box.slices()]), dtype="int16", global_shape=SHAPE3)
    s.commit("j", "s1-g0")
    mp.undo()
    yield s


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(region=regions(SHAPE3))
def test_raw_chunk_reads_match_zarr_in_three_dims(cube: LocalStore, region: Region) -> None:
    import zarr

    out = np.full(region.shape, -1, np.int16)
    cube.read_into("j", "s1-g0", "c", region, out)
    assert out.tobytes() == np.ascontiguousarray(FULL3[region.slices()]).tobytes()
    # the same through zarr's own reader, for the part inside the second shard
    inner = region.intersect(Region(((2, 5), (0, 19), (0, 23))))
    if inner is not None:
        arr = zarr.open_array(str(cube.root / "j" / "s1-g0" / "c" / "r2-5_0-19_0-23"), mode="r")
        via_zarr = arr[inner.relative_to(Region(((2, 5), (0, 19), (0, 23)))).slices()]
        assert via_zarr.tobytes() == np.ascontiguousarray(FULL3[inner.slices()]).tobytes()


def test_one_dimensional_reads(store: LocalStore) -> None:
    data = random_array((5000,), "float64", seed=9)
    store.write_shard("j", "s1-g0", "v", Region(((0, 2500),)), data[:2500].copy(), dtype="float64", global_shape=(5000,))
    store.write_shard("j", "s1-g0", "v", Region(((2500, 5000),)), data[2500:].copy(), dtype="float64", global_shape=(5000,))
    for a, b in ((0, 5000), (7, 4099), (2499, 2501), (4999, 5000)):
        out = np.empty(b - a, np.float64)
        store.read_into("j", "s1-g0", "v", Region(((a, b),)), out, uncommitted=True)
        assert out.tobytes() == data[a:b].tobytes()


@pytest.mark.parametrize("shape", [(1000,), (37, 29), (64, 64), (3, 17, 9), (2, 3, 5, 7)])
@pytest.mark.parametrize("dtype", ["float32", "bool", "bfloat16"])
def test_shards_are_plain_zarr_arrays(tmp_path: Path, shape: tuple[int, ...], dtype: str) -> None:
    """What the store writes (raw chunk files, padded edge chunks) is read back identically by zarr itself."""
    import zarr

    s = LocalStore(tmp_path, chunk_bytes=512)
    data = random_array(shape, dtype, seed=len(shape))
    s.write_shard("j", "s1-g0", "w", Region.full(shape), data, dtype=dtype, global_shape=shape)
    key = "r" + "_".join(f"0-{n}" for n in shape)
    arr = zarr.open_array(str(tmp_path / "j" / "s1-g0" / "w" / key), mode="r")
    assert arr.dtype == storage_dtype(dtype)
    assert arr[...].tobytes() == data.tobytes()


@pytest.mark.parametrize("map_chunks", [True, False])
def test_both_copy_paths_give_the_same_bytes(tmp_path: Path, map_chunks: bool) -> None:
    s = LocalStore(tmp_path, chunk_bytes=1024, map_chunks=map_chunks)
    data = random_array((70, 45), "float32", seed=4)
    s.write_shard("j", "s1-g0", "w", Region.full((70, 45)), data, dtype="float32", global_shape=(70, 45))
    for region in (Region.full((70, 45)), Region(((3, 69), (1, 44))), Region(((16, 32), (0, 45))), Region(((0, 70), (16, 32)))):
        out = np.empty(region.shape, np.float32)
        s.read_into("j", "s1-g0", "w", region, out, uncommitted=True)
        assert out.tobytes() == np.ascontiguousarray(data[region.slices()]).tobytes()


def test_link_shard_refuses_a_shard_damaged_on_disk(store: LocalStore) -> None:
    data = random_array((64, 64), "float32", seed=4)
    region = Region.full(data.shape)
    store.write_shard("j", "s1-g0", "w", region, data, dtype="float32", global_shape=data.shape)
    store.commit("j", "s1-g0")
    chunk = next(p for p in (store.root / "j" / "s1-g0" / "w").rglob("*") if p.is_file() and p.name != "zarr.json")
    raw = bytearray(chunk.read_bytes())
    raw[5] ^= 0x01
    chunk.write_bytes(bytes(raw))
    # Each chunk file's crc32c was recorded at write time: the check reads whole files, no region pass.
    meta = json.loads((chunk.parent / "zarr.json").read_text())
    assert len(meta["attributes"]["tenplex_chunk_crc32c"]) == len(list(chunk.parent.glob("c*")))
    with pytest.raises(ChecksumMismatch, match=rf"chunk file {chunk.name}: crc32c .* damaged on disk"):
        store.link_shard("j", "s1-g0", "w", region, "s2-g1")
    assert "s2-g1" not in [str(v.version) for v in store.versions("j")]  # nothing was installed


@pytest.mark.parametrize("shape", [(1000, 37), (5,), ()])
def test_direct_and_buffered_writes_store_the_same_bytes(tmp_path: Path, shape: tuple[int, ...]) -> None:
    # O_DIRECT writes go through an aligned bounce buffer and an ftruncate to the chunk size; the chunk
    # files must be byte-identical to the buffered ones (edge chunks zero-padded), and zarr must read them.
    data = random_array(shape, "float32", seed=5)
    stores = {d: LocalStore(tmp_path / str(d), chunk_bytes=4096 + 36, direct_writes=d) for d in (True, False)}
    assert stores[True].direct_writes  # tmp_path is on a disk file system here
    for s in stores.values():
        s.write_shard("j", "s1-g0", "w", Region.full(shape), data, dtype="float32", global_shape=shape)
        s.commit("j", "s1-g0")
    files = {d: {p.relative_to(s.root): p.read_bytes() for p in s.root.rglob("*") if p.is_file() and p.name.startswith("c")} for d, s in stores.items()}
    assert files[True] and files[True] == files[False]
    out = np.empty_like(data)
    stores[True].read_into("j", "s1-g0", "w", Region.full(shape), out)
    assert same_bits(out, data) and stores[True].verify("j", "s1-g0") == []


def test_a_file_system_without_o_direct_gets_buffered_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from tenplex.store import rawchunks

    data = random_array((300, 300), "bfloat16", seed=6)
    region = Region.full(data.shape)
    direct_store = LocalStore(tmp_path / "a")  # probed while O_DIRECT works
    assert direct_store.direct_writes
    real_open = os.open

    def refusing_open(path, flags, *args):  # type: ignore[no-untyped-def]
        if flags & rawchunks._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(rawchunks.os, "open", refusing_open)  # a file system that refuses O_DIRECT
    assert not LocalStore(tmp_path / "b").direct_writes  # the probe finds out up front
    # A store that believed in O_DIRECT falls back at the first refusal, and still stores every byte.
    direct_store.write_shard("j", "s1-g0", "w", region, data, dtype="bfloat16", global_shape=data.shape)
    out = np.empty_like(data)
    direct_store.read_into("j", "s1-g0", "w", region, out, uncommitted=True)
    assert same_bits(out, data)


def test_arrays_with_nested_chunk_keys_are_read_directly(tmp_path: Path) -> None:
    # zarr's own default key encoding nests chunk files (c/1/0); shards written that way (by zarr, or by
    # earlier versions of this store) are read through the same direct path.
    import json

    import zarr

    from tenplex.store import rawchunks

    data = random_array((70, 50), "int32", seed=8)
    store = LocalStore(tmp_path, chunk_bytes=1024)
    store.write_shard("j", "s1-g0", "w", Region.full(data.shape), data, dtype="int32", global_shape=data.shape)
    shard_dir = tmp_path / "j" / "s1-g0" / "w" / "r0-70_0-50"
    record = {"tenplex": json.loads((shard_dir / "zarr.json").read_text())["attributes"]["tenplex"]}
    nested = tmp_path / "nested"
    arr = zarr.create_array(str(nested), shape=data.shape, dtype="int32", chunks=(16, 16), compressors=None,
                            filters=None, fill_value=0, attributes=record)
    arr[...] = data
    shutil.rmtree(shard_dir)
    shutil.move(nested, shard_dir)
    assert (shard_dir / "c" / "0" / "0").is_file()
    store.commit("j", "s1-g0")
    reader = store.open_tensor("j", "s1-g0", "w")
    assert isinstance(reader._array(reader._shards[0]), rawchunks.RawChunkReader)
    out = np.empty((33, 21), np.int32)
    store.read_into("j", "s1-g0", "w", Region(((20, 53), (9, 30))), out)
    assert same_bits(out, data[20:53, 9:30]) and store.verify("j", "s1-g0") == []
    # No per-chunk checksums were recorded by zarr: linking verifies the shard with one checksum pass.
    store.link_shard("j", "s1-g0", "w", Region.full(data.shape), "s2-g0")
    raw = bytearray((shard_dir / "c" / "0" / "0").read_bytes())
    raw[0] ^= 0x10
    (shard_dir / "c" / "0" / "0").write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatch, match="crc32c .* recorded"):
        store.link_shard("j", "s1-g0", "w", Region.full(data.shape), "s3-g0")
