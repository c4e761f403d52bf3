"""The persistent tier's store (:class:`~tenplex.store.persistent.PersistentStore`) on a real S3 API and on file://.

The store conformance suite runs against it on both backends (moto's S3 server on a loopback port, and a
tmp dir as a shared file system), then what only the persistent tier promises: a version is committed only
when every shard it must hold is intact (checked from metadata and one listing, no download), an upload cut
short is never read as a shard, a sub-region read fetches only the chunk objects it needs and checks each, a
version is plain zarr v3, retention deletes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
import zarr.storage
from zarr.core.buffer import default_buffer_prototype

from tenplex.errors import ChecksumMismatch, Conflict, InvalidInput, NotFound, StoreUnavailable
from tenplex.ptc.region import Region
from tenplex.store import open_store
from tenplex.store.locations import check_options, check_uri, public_options
from tenplex.store.names import region_key, tensor_dirname
from tenplex.store.persistent import PersistentStore, SmallShard, chunk_shape
from tests.moto_s3 import MotoS3

from .test_conformance import StoreTests
from .test_local import random_array, same_bits

CHUNK_BYTES = 4096
BUCKET = "tenplex-conformance"


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoS3]:
    server = MotoS3().start()
    server.create_bucket(BUCKET)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(moto: MotoS3, monkeypatch: pytest.MonkeyPatch) -> MotoS3:
    """The process's AWS environment pointing at moto: what a node's daemon gets from the chart."""
    for k, v in moto.env.items():
        monkeypatch.setenv(k, v)
    return moto


class TestPersistentFile(StoreTests):
    CHUNKS_ALWAYS_VERIFIED = True

    @pytest.fixture
    def root(self, tmp_path: Path) -> Path:
        return tmp_path / "shared fs" / "ckpt"

    @pytest.fixture
    def store(self, root: Path) -> Iterator[PersistentStore]:
        with PersistentStore(root.as_uri(), chunk_bytes=CHUNK_BYTES) as s:
            yield s  # type: ignore[misc]


class TestPersistentS3(StoreTests):
    """On moto's S3 server: the bucket and prefix stand for the root."""

    CHUNKS_ALWAYS_VERIFIED = True

    @pytest.fixture
    def root(self, s3_env: MotoS3) -> tuple[MotoS3, str]:
        return s3_env, "conformance/run"

    @pytest.fixture
    def store(self, root: tuple[MotoS3, str]) -> Iterator[PersistentStore]:
        with PersistentStore(f"s3://{BUCKET}/{root[1]}", chunk_bytes=CHUNK_BYTES) as s:
            yield s  # type: ignore[misc]

    @staticmethod
    def _shard_prefix(prefix: str, job: str, version: str, tensor: str, region: Region) -> str:
        return f"{prefix}/{job}/{version}/{tensor_dirname(tensor)}/{region_key(region)}/"

    def damage(self, root: Any, job: str, version: str, tensor: str, region: Region) -> None:
        moto, prefix = root
        chunks = sorted(k for k in moto.objects(BUCKET, self._shard_prefix(prefix, job, version, tensor, region)) if "/c/" in k)
        moto.flip_bit(BUCKET, chunks[0])

    def assert_shared(self, root: Any, job: str, old: str, new: str, tensor: str, region: Region) -> None:
        """On an object store a link is a server-side copy of each chunk object: the same bytes under the new
        version, made without a download."""
        moto, prefix = root
        a, b = (self._shard_prefix(prefix, job, v, tensor, region) for v in (old, new))
        old_objects, new_objects = moto.objects(BUCKET, a), moto.objects(BUCKET, b)
        assert len(old_objects) > 2 and {k[len(a):]: n for k, n in old_objects.items()} == {k[len(b):]: n for k, n in new_objects.items()}
        c = moto.client()
        for key in old_objects:
            if "/c/" in key:
                body = c.get_object(Bucket=BUCKET, Key=key)["Body"].read()
                assert body == c.get_object(Bucket=BUCKET, Key=b + key[len(a):])["Body"].read()


# -- what only the persistent tier promises ------------------------------------------------------------


@pytest.fixture(params=["file", "s3"])
def pstore(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PersistentStore]:
    """A fresh persistent store on each backend, with small chunk objects."""
    if request.param == "file":
        uri = (tmp_path / "ckpt").as_uri()
    else:
        moto = request.getfixturevalue("moto")
        uri = f"s3://{BUCKET}/{request.node.name.replace('[', '-').replace(']', '')}"
        with PersistentStore(uri, options=moto.options, chunk_bytes=CHUNK_BYTES) as s:
            yield s
        return
    with PersistentStore(uri, chunk_bytes=CHUNK_BYTES) as s:
        yield s


def _objects(store: PersistentStore, prefix: str) -> list[str]:
    if store.root is not None:
        return sorted(p.relative_to(store.root).as_posix() for p in (store.root / prefix).rglob("*") if p.is_file())
    import obstore

    return sorted(m["path"] for m in obstore.list(store._backend.store, prefix).collect())  # type: ignore[attr-defined]


def _delete_object(store: PersistentStore, key: str) -> None:
    if store.root is not None:
        (store.root / key).unlink()
    else:
        import obstore

        obstore.delete(store._backend.store, key)  # type: ignore[attr-defined]


def _put_object(store: PersistentStore, key: str, data: bytes) -> None:
    if store.root is not None:
        (store.root / key).write_bytes(data)
    else:
        import obstore

        obstore.put(store._backend.store, key, data)  # type: ignore[attr-defined]


def test_a_sub_region_read_fetches_only_the_chunks_it_touches_and_checks_each(pstore: PersistentStore) -> None:
    data = random_array((64, 64), "float32", seed=11)
    whole = Region.full(data.shape)
    pstore.write_shard("j", "s1-g0", "w", whole, data, dtype="float32", global_shape=data.shape)
    pstore.commit("j", "s1-g0")
    chunks = chunk_shape(data.shape, 4, CHUNK_BYTES)
    assert chunks == (32, 32)  # near-square, powers of two: a tp cut of a column falls on a boundary
    base = f"j/s1-g0/w/{region_key(whole)}"
    assert [k.rsplit("/", 3)[-3:] for k in _objects(pstore, base + "/c/")] == [["c", "0", "0"], ["c", "0", "1"],
                                                                                ["c", "1", "0"], ["c", "1", "1"]]
    _delete_object(pstore, f"{base}/c/1/1")
    assert same_bits(pstore.read("j", "s1-g0", "w", Region(((3, 30), (5, 60))), "float32"), data[3:30, 5:60])
    with pytest.raises(ChecksumMismatch, match="c/1/1 is missing"):  # never zeros in place of a lost chunk
        pstore.read("j", "s1-g0", "w", Region(((40, 41), (40, 41))), "float32")
    raw = bytearray(Path(pstore.root / base / "c/0/0").read_bytes()) if pstore.root is not None else None
    if raw is not None:  # a damaged chunk fails its crc32c on any read that touches it
        raw[17] ^= 0x10
        _put_object(pstore, f"{base}/c/0/0", bytes(raw))
        with pytest.raises(ChecksumMismatch, match="crc32c"):
            pstore.read("j", "s1-g0", "w", Region(((0, 1), (0, 1))), "float32")
        assert same_bits(pstore.read("j", "s1-g0", "w", Region(((0, 32), (32, 64))), "float32"), data[:32, 32:])


def test_an_upload_cut_short_is_never_a_shard_nor_committed(pstore: PersistentStore) -> None:
    data = random_array((40, 30), "bfloat16", seed=12)
    pstore.write_shard("j", "s2-g0", "a", Region.full((40, 30)), data, dtype="bfloat16", global_shape=(40, 30))
    writer = pstore.open_writer("j", "s2-g0", "b", Region(((0, 40), (0, 30))), dtype="bfloat16", global_shape=(40, 30))
    assert len(writer.pieces) == 1
    writer.write_piece(0, data)  # its chunks are there; the daemon was killed before its metadata
    assert any("/b/" in k for k in _objects(pstore, "j/s2-g0/"))
    manifest = pstore.manifest("j", "s2-g0")
    assert not manifest.committed and [s.tensor for s in manifest.shards] == ["a"]
    with pytest.raises(NotFound):
        pstore.read_into("j", "s2-g0", "b", Region.full((40, 30)), np.empty((40, 30), np.uint16), uncommitted=True)
    with pytest.raises(Conflict, match=r"b 0:40,0:30: incomplete"):
        pstore.commit("j", "s2-g0")
    with pytest.raises(Conflict, match=r"b 0:40,0:30: missing"):
        pstore.commit("j", "s2-g0", expect=[("a", Region.full((40, 30)), None), ("b", Region.full((40, 30)), None)])
    assert [(str(v.version), v.committed) for v in pstore.versions("j")] == [("s2-g0", False)]
    with pytest.raises(NotFound, match="not committed"):
        pstore.read("j", "s2-g0", "a", Region.full((40, 30)), "bfloat16")
    committed = pstore.commit("j", "s2-g0", expect=[("a", Region.full((40, 30)), manifest.shards[0].checksum)])
    assert committed.committed and [s.tensor for s in committed.shards] == ["a"]
    out = torch.empty(40, 30, dtype=torch.bfloat16)
    pstore.read_into("j", "s2-g0", "a", Region.full((40, 30)), out)
    assert out.view(torch.int16).numpy().tobytes() == data.tobytes()  # bf16 bit-exact
    with pytest.raises(NotFound):  # the torn shard is not part of the committed version
        pstore.read("j", "s2-g0", "b", Region.full((40, 30)), "bfloat16")


def test_commit_checks_every_expected_shard_without_downloading_and_names_each_problem(pstore: PersistentStore) -> None:
    tiles = [Region(((0, 32), (0, 48))), Region(((32, 64), (0, 48))), Region(((64, 70), (0, 48)))]
    data = random_array((70, 48), "float32", seed=13)
    infos = [pstore.write_shard("j", "s3-g0", "w", t, np.ascontiguousarray(data[t.slices()]), dtype="float32",
                                global_shape=data.shape) for t in tiles]
    expect = [("w", t, i.checksum) for t, i in zip(tiles, infos, strict=True)]
    base = f"j/s3-g0/w/{region_key(tiles[1])}"
    first_chunk = next(k for k in _objects(pstore, base + "/c/"))
    _put_object(pstore, first_chunk, b"torn")  # a truncated object: the listing shows it
    wrong = [(t, r, c) for t, r, c in expect[:2]] + [("w", tiles[2], "crc32c:00000000"), ("w", Region(((0, 1), (0, 48))), None)]
    with pytest.raises(Conflict) as err:
        pstore.commit("j", "s3-g0", expect=wrong)
    detail = err.value.detail
    assert "3 shards are not intact" in detail
    assert f"w {tiles[1].format()}: chunk c/0/0 has 4 bytes" in detail
    assert f"w {tiles[2].format()}: checksum {infos[2].checksum} recorded, crc32c:00000000 expected" in detail
    assert "w 0:1,0:48: missing" in detail
    assert not any(v.committed for v in pstore.versions("j"))  # nothing was written
    pstore.write_shard("j", "s3-g0", "w", tiles[1], np.ascontiguousarray(data[tiles[1].slices()]), dtype="float32",
                       global_shape=data.shape)  # the upload is redone
    manifest = pstore.commit("j", "s3-g0", expect=expect)
    assert [s.region for s in manifest.shards] == tiles and manifest.nbytes == data.nbytes
    assert pstore.commit("j", "s3-g0", expect=expect) == manifest  # idempotent
    with pytest.raises(Conflict, match="other shards"):
        pstore.commit("j", "s3-g0", expect=expect[:2])
    assert same_bits(pstore.read("j", "s3-g0", "w", Region(((10, 66), (7, 40))), "float32"), data[10:66, 7:40])


def test_retention_keeps_the_newest_committed_versions(pstore: PersistentStore) -> None:
    for step in (10, 20, 30, 40):
        pstore.write_shard("j", f"s{step}-g0", "w", Region.full((8,)), np.full(8, step, np.int32), dtype="int32", global_shape=(8,))
        if step != 40:
            pstore.commit("j", f"s{step}-g0")
    pstore.write_shard("j", "s5-g0", "w", Region.full((8,)), np.zeros(8, np.int32), dtype="int32", global_shape=(8,))
    assert [str(v) for v in pstore.gc("j", keep_last=2)] == ["s5-g0", "s10-g0"]
    assert [(str(v.version), v.committed) for v in pstore.versions("j")] == [("s20-g0", True), ("s30-g0", True), ("s40-g0", False)]
    assert not any("/s10-g0/" in k or k.endswith("s10-g0.json") for k in _objects(pstore, "j/"))
    pstore.delete("j", "s20-g0")
    with pytest.raises(NotFound):
        pstore.delete("j", "s20-g0")
    assert [str(v.version) for v in pstore.versions("j")] == ["s30-g0", "s40-g0"]
    assert pstore.read("j", "s30-g0", "w", Region.full((8,)), "int32").tolist() == [30] * 8


def test_a_committed_version_keeps_its_ptc_until_it_is_deleted(pstore: PersistentStore) -> None:
    ptc = {"format": "example", "config": {"dp": 2}, "dataset": {"consumed_samples": 80}}
    pstore.write_shard("j", "s10-g0", "w", Region.full((8,)), np.arange(8, dtype=np.int32), dtype="int32",
                       global_shape=(8,))
    with pytest.raises(NotFound, match="not committed"):
        pstore.ptc_document("j", "s10-g0")
    with pytest.raises(InvalidInput, match="JSON object"):
        pstore.commit("j", "s10-g0", ptc=[1, 2])  # type: ignore[arg-type]
    pstore.commit("j", "s10-g0", ptc=ptc)
    assert pstore.ptc_document("j", "s10-g0") == ptc
    # the PTC is not a version, nor a tensor of one
    assert [str(v.version) for v in pstore.versions("j")] == ["s10-g0"]
    assert [s.tensor for s in pstore.manifest("j", "s10-g0").shards] == ["w"]
    # committed without one (an older Tenplex): said so
    pstore.write_shard("j", "s20-g0", "w", Region.full((8,)), np.arange(8, dtype=np.int32), dtype="int32",
                       global_shape=(8,))
    pstore.commit("j", "s20-g0")
    with pytest.raises(NotFound, match="without its PTC"):
        pstore.ptc_document("j", "s20-g0")
    pstore.delete("j", "s10-g0")
    with pytest.raises(NotFound):
        pstore.ptc_document("j", "s10-g0")
    assert not [k for k in _objects(pstore, "j/") if "s10-g0" in k]


def test_a_version_is_plain_zarr_v3(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    data = random_array((20, 12), "float16", seed=14)
    with PersistentStore(root.as_uri(), chunk_bytes=CHUNK_BYTES) as store:
        store.write_shard("job-1", "s7-g2", "optim/w/exp_avg", Region.full(data.shape), data, dtype="float16",
                          global_shape=data.shape)
        store.commit("job-1", "s7-g2")
    group = zarr.open_group(zarr.storage.LocalStore(root, read_only=True), path="job-1/s7-g2", mode="r", zarr_format=3)
    assert group.attrs["tenplex"] == {"job": "job-1", "version": "s7-g2"}
    arr = group[f"{tensor_dirname('optim/w/exp_avg')}/{region_key(Region.full(data.shape))}"]
    assert same_bits(arr[...], data) and arr.attrs["tenplex"]["tensor"] == "optim/w/exp_avg"
    marker = json.loads((root / "job-1" / ".commits" / "s7-g2.json").read_text())
    assert marker["committed"] and marker["shards"][0]["checksum"] == arr.attrs["tenplex"]["checksum"]


def _small(name: str, shape: tuple[int, ...], dtype: str, seed: int, **kw: Any) -> SmallShard:
    data = random_array(shape, dtype, seed=seed)
    st = data.view(np.uint16) if dtype == "bfloat16" else data
    return SmallShard(name, Region.full(shape), dtype, shape, np.array(st, order="C"), **kw)


def test_small_shards_written_at_once_are_the_format_one_at_a_time_writes(pstore: PersistentStore) -> None:
    """write_shards (the uploads' batches) stores exactly the objects write_shard stores: the same metadata and
    chunk bytes (zarr's bytes + crc32c codecs), so readers of either, older Tenplex included, read both."""
    shards = [_small("a/w", (16, 8), "float32", 1), _small("a/b", (8,), "bfloat16", 2), _small("scalar", (), "float32", 3),
              _small("empty", (0, 4), "float16", 4), _small("i", (3, 5), "int64", 5)]
    infos = pstore.write_shards("j", "s4-g0", [_small(s.tensor, s.global_shape, s.dtype, seed, expected=None)
                                                for s, seed in zip(shards, range(1, 6), strict=True)])
    for s in shards:
        pstore.write_shard("j", "s8-g0", s.tensor, s.region, s.data, dtype=s.dtype, global_shape=s.global_shape)
    assert [i.checksum for i in infos] == [pstore.shard("j", "s8-g0", s.tensor, s.region).checksum for s in shards]
    batch, single = _objects(pstore, "j/s4-g0/"), _objects(pstore, "j/s8-g0/")
    # per shard its tensor group, its metadata, its chunk (none for "empty"); and the version group
    assert [k.replace("s4-g0", "s8-g0") for k in batch] == single and len(batch) == 3 * len(shards) - 1 + 1
    for key in batch:
        a = pstore._run(pstore._backend.get(key, prototype=default_buffer_prototype()), "test")
        b = pstore._run(pstore._backend.get(key.replace("s4-g0", "s8-g0"), prototype=default_buffer_prototype()), "test")
        assert a.to_bytes().replace(b"s8-g0", b"s4-g0") == b.to_bytes().replace(b"s8-g0", b"s4-g0"), key
    assert pstore.uploaded("j", "s4-g0") == {(i.tensor, i.region): i for i in infos}
    manifest = pstore.commit("j", "s4-g0", expect=[(i.tensor, i.region, i.checksum) for i in infos])
    assert manifest.committed and len(manifest.shards) == len(shards)
    with pytest.raises(Conflict, match="immutable"):
        pstore.write_shards("j", "s4-g0", shards[:1])
    for s in shards:
        out = np.empty(s.region.shape, s.data.dtype)
        pstore.read_into("j", "s4-g0", s.tensor, s.region, out.view(np.uint16) if s.dtype == "bfloat16" else out)
        assert same_bits(out, s.data)


def test_small_shards_are_checked_before_any_is_written(pstore: PersistentStore) -> None:
    good, bad = _small("g", (4, 4), "float32", 1), _small("b", (4, 4), "float32", 2)
    with pytest.raises(ChecksumMismatch, match="'b'.*not uploaded"):
        pstore.write_shards("j", "s4-g0", [good, SmallShard(bad.tensor, bad.region, bad.dtype, bad.global_shape, bad.data,
                                                            expected="crc32c:00000000")])
    assert not _objects(pstore, "j/s4-g0/") and pstore.uploaded("j", "s4-g0") == {}
    with pytest.raises(InvalidInput, match="several chunk objects"):  # CHUNK_BYTES is 4 KiB
        pstore.write_shards("j", "s4-g0", [_small("big", (64, 64), "float32", 3)])
    # a shard there with other bytes is replaced: its old metadata goes first, the new one last
    pstore.write_shards("j", "s4-g0", [good])
    [info] = pstore.write_shards("j", "s4-g0", [SmallShard("g", good.region, "float32", (4, 4), bad.data, replace=True)])
    assert pstore.uploaded("j", "s4-g0")[("g", good.region)] == info and info.checksum != _info_of(pstore, good)


def _info_of(pstore: PersistentStore, s: SmallShard) -> str:
    from tenplex.store.buffers import crc_of
    from tenplex.store.model import format_checksum

    return format_checksum(crc_of(s.data))


def test_a_version_of_small_shards_is_plain_zarr_v3(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shards = [_small(f"layers.{i}.w", (4 * (i + 1), 8), "float32", i) for i in range(5)]
    with PersistentStore(root.as_uri(), chunk_bytes=CHUNK_BYTES) as store:
        store.write_shards("job-1", "s4-g0", shards)
        store.commit("job-1", "s4-g0")
    group = zarr.open_group(zarr.storage.LocalStore(root, read_only=True), path="job-1/s4-g0", mode="r", zarr_format=3)
    for s in shards:
        arr = group[f"{tensor_dirname(s.tensor)}/{region_key(s.region)}"]
        assert same_bits(arr[...], s.data) and arr.attrs["tenplex"]["tensor"] == s.tensor


def test_an_unreachable_object_store_is_store_unavailable(tmp_path: Path) -> None:
    from tenplex.sockets import free_port

    with PersistentStore("s3://nowhere-bucket/x", options={"endpoint": f"http://127.0.0.1:{free_port()}"},
                         timeout_s=2.0, retries=0) as store:
        with pytest.raises(StoreUnavailable, match="s3://nowhere-bucket/x is unavailable"):
            store.versions("j")
        with pytest.raises(StoreUnavailable):
            store.write_shard("j", "s1-g0", "w", Region.full((4,)), np.zeros(4, np.int8), dtype="int8", global_shape=(4,))


def test_locations_and_options_are_checked() -> None:
    assert check_uri("s3://bucket-1/a/b/") == "s3://bucket-1/a/b"
    assert check_uri("file:///mnt/ckpt/") == "file:///mnt/ckpt"
    for bad, match in [("s3://B/x", "bucket name"), ("s3://bucket-1/a//b", "empty"), ("file://host/x", "this machine"),
                       ("file://relative", "this machine"), ("gs://b/x", "s3://"), ("s3://bucket-1/x?y=1", "query"), ("", "needed")]:
        with pytest.raises(InvalidInput, match=match):
            check_uri(bad)
    opts = check_options({"endpoint": "http://minio:9000", "access_key_id": "AKIA", "secret_access_key": "s3cr3t",
                          "allow_http": True})
    assert public_options(opts) == {"endpoint": "http://minio:9000", "allow_http": True}
    for bad, match in [({"endpoint": "minio:9000"}, "https://HOST"), ({"bucket": "x"}, "unknown"), ({"allow_http": "yes"}, "bool")]:
        with pytest.raises(InvalidInput, match=match):
            check_options(bad)
    with pytest.raises(InvalidInput, match="http"):
        open_store("gs://bucket/x")


def test_persistent_chunks_suit_row_and_column_cuts() -> None:
    assert chunk_shape((4096, 16384), 4, 8 << 20) == (2048, 1024)
    assert chunk_shape((50257, 1024), 2, 8 << 20) == (3866, 1024)  # vocab rows: 13 even shares (50258 rows stored)
    assert chunk_shape((16384,), 4, 8 << 20) == (16384,)
    assert chunk_shape((), 4) == ()
    assert chunk_shape((3, 0, 5), 4, 64) == (3, 1, 5)
