"""Chunk shapes, and regions served as runs of chunk files straight from the page cache (no copy).

The runs path must give the same bytes as copying, in payload order, for any
region of any layout (the store's whole-row chunks, the near-square chunks of
stores written before them, zarr's nested keys), and the checksum header of
a body must be the crc32c of the very bytes sent, on every server path.
"""

from __future__ import annotations

import http.client
import json
import math
from collections.abc import Iterator
from pathlib import Path

import crc32c
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenplex.core.version import Version
from tenplex.errors import ChecksumMismatch, InvalidInput, NotFound, StateLost
from tenplex.node.store_routes import StoreServer
from tenplex.ptc.region import Region
from tenplex.store import client as client_module
from tenplex.store import local as local_module
from tenplex.store.base import RegionRead
from tenplex.store.buffers import ReceivedCrcs, chunk_shape, crc32c_combine
from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore
from tenplex.store.model import format_checksum
from tenplex.store.names import region_key
from tenplex.store.rawchunks import (
    RawChunkReader,
    checksum_runs,
    crc_of_views,
    map_runs,
    mapped_batches,
)

from .conftest import square_chunks
from .test_local import random_array

SHAPE = (7, 45, 33)
FULL = random_array(SHAPE, "float32", seed=11)
SHARDS = (Region(((0, 3), (0, 45), (0, 33))), Region(((3, 7), (0, 45), (0, 33))))


@pytest.fixture(scope="module", params=["whole-rows", "square"])
def layout_store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStore]:
    """The 3-d tensor in two shards, with small chunks (~400 bytes) in the store's layout or the older square one."""
    mp = pytest.MonkeyPatch()
    if request.param == "square":
        mp.setattr(local_module, "chunk_shape", square_chunks)
    s = LocalStore(tmp_path_factory.mktemp(request.param), chunk_bytes=400)
    for box in SHARDS:
        s.write_shard("j", "s1-g0", "w", box, np.ascontiguousarray(FULL[box.slices()]), dtype="float32", global_shape=SHAPE)
    s.commit("j", "s1-g0")
    mp.undo()
    yield s


@st.composite
def regions(draw: st.DrawFn, shape: tuple[int, ...]) -> Region:
    bounds = []
    for n in shape:
        a = draw(st.integers(0, n))
        bounds.append((a, draw(st.integers(a, n))))
    return Region(tuple(bounds))


# -- chunk shapes -------------------------------------------------------------


def test_chunk_shapes_of_the_benchmark_and_model_tensors() -> None:
    assert chunk_shape((16384, 16384), 4) == (64, 16384)  # 4 MiB of whole rows: a row slice is whole chunk files
    assert chunk_shape((50304, 1024), 2) == (2014, 1024)  # 25 even chunks of whole pages: 46 rows of padding, not 896
    assert chunk_shape((24, 1024, 1024), 4) == (1, 1024, 1024)  # stacked layers: one layer per chunk
    assert chunk_shape((8, 16, 64), 4) == (8, 16, 64)  # small tensors are one chunk
    assert chunk_shape((4096, 2_000_000), 4) == (1024, 1024)  # a row over 4 MiB: near-square
    assert chunk_shape((4096, 2_000_000), 4, 1 << 20) == (512, 512)
    assert chunk_shape((2, 2_000_000), 4) == (2, 500224)  # few rows: wider chunks (4 even ones)
    assert chunk_shape((3000, 3000), 4, 1024) == (16, 16)  # near-square when one row is larger than a chunk
    assert chunk_shape((), 4) == ()


def test_chunks_are_whole_pages_where_a_multiple_fits() -> None:
    assert chunk_shape((8192, 896), 4) == (1024, 896)  # 8 even chunks of 896 pages; 1170 rows would end mid-page
    assert chunk_shape((1344, 896), 4) == (672, 896)  # 2 even chunks, not 1168 rows + 1168 stored for the other 176
    assert chunk_shape((1344, 897), 4) == (672, 897)  # no whole-page count pads little: even chunks, not whole pages
    assert chunk_shape((10_000_000,), 4) == (1_000_448,)  # 10 chunks of 977 pages; the last one pads 4480 elements
    assert chunk_shape((3, 7, 5), 4) == (3, 7, 5)  # a small tensor is one chunk as it is


def test_direct_writes_from_a_page_aligned_buffer_equal_those_through_the_bounce_buffer(tmp_path: Path) -> None:
    from tenplex.core.buffers import aligned_empty

    data = random_array((2000, 896), "float32", seed=5)  # 64 KiB chunks: 16 rows (whole pages)
    aligned = aligned_empty(data.shape, np.float32)
    aligned[...] = data
    # 4 bytes past a page boundary, always (a slice of a fresh bytearray is a copy that may land on a page)
    unaligned = aligned_empty((data.nbytes + 4,), np.uint8)[4:].view(np.float32).reshape(data.shape)
    unaligned[...] = data
    store = LocalStore(tmp_path, chunk_bytes=64 << 10)
    if not store.direct_writes:
        pytest.skip("the file system of tmp_path refuses O_DIRECT")
    assert aligned.ctypes.data % 4096 == 0 and unaligned.ctypes.data % 4096 != 0
    infos = [
        store.write_shard("j", "s1-g0", name, Region.full(data.shape), buf, dtype="float32", global_shape=data.shape)
        for name, buf in (("in-place", aligned), ("bounced", unaligned))
    ]
    assert infos[0].checksum == infos[1].checksum == format_checksum(crc32c.crc32c(data.tobytes()))
    store.commit("j", "s1-g0")
    shards = [tmp_path / "j" / "s1-g0" / name / "r0-2000_0-896" for name in ("in-place", "bounced")]
    files = sorted(p.name for p in shards[0].glob("c.*"))
    assert files == sorted(p.name for p in shards[1].glob("c.*")) and len(files) == 125
    for name in files:
        assert (shards[0] / name).read_bytes() == (shards[1] / name).read_bytes()
    assert store.verify("j", "s1-g0") == []  # every chunk file against its recorded crc32c
    for name in ("in-place", "bounced"):
        out = np.empty_like(data)
        store.read_into("j", "s1-g0", name, Region.full(data.shape), out)
        assert out.tobytes() == data.tobytes()


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(0, 3000), min_size=1, max_size=4).map(tuple),
    item=st.sampled_from([1, 2, 4, 8]),
    chunk_bytes=st.integers(64, 1 << 20),
)
def test_chunk_shapes_fit_the_budget_and_take_whole_rows_when_they_fit(shape: tuple[int, ...], item: int, chunk_bytes: int) -> None:
    chunks = chunk_shape(shape, item, chunk_bytes)
    assert len(chunks) == len(shape)
    assert all(1 <= c <= max(n, 1) for c, n in zip(chunks, shape, strict=True))
    assert math.prod(chunks) * item <= chunk_bytes
    for c, n in zip(chunks, shape, strict=True):  # zarr stores edge chunks whole: the chunks share a cut evenly
        count = -(-max(n, 1) // c)
        assert count * c - max(n, 1) < count or (count * c - max(n, 1)) * 32 <= n
    if max(shape[-1], 1) * item <= chunk_bytes:
        # trailing dimensions whole, then one partial dimension, then ones: a chunk file is one C-order run
        d = len(shape) - 1
        while d >= 0 and chunks[d] == max(shape[d], 1):
            d -= 1
        assert d < 0 or all(c == 1 for c in chunks[:d])


# -- runs of chunk files --------------------------------------------------------


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(region=regions(SHAPE))
def test_runs_are_the_payload_in_order(layout_store: LocalStore, region: Region) -> None:
    reader = layout_store.open_tensor("j", "s1-g0", "w")
    want = np.ascontiguousarray(FULL[region.slices()]).tobytes()
    runs = reader.runs(region, min_run_bytes=1)
    inside_one = any(s.contains(region) for s in SHARDS) or region.empty
    assert (runs is not None) == inside_one
    if runs is not None:
        assert sum(r.nbytes for r in runs) == len(want)
        assert b"".join(bytes(v) for v in map_runs(runs)) == want
        if runs:
            arr = runs[0].reader
            assert isinstance(arr, RawChunkReader) and arr.run_count(region.relative_to(next(s for s in SHARDS if s.contains(region)))) >= len(runs)
        for batch_bytes, max_maps in ((7, 256), (100, 2), (1 << 20, 1), (1 << 20, 256)):
            got = bytearray()
            for batch in mapped_batches(runs, batch_bytes, max_maps):  # one batch mapped at a time, as the server does
                assert sum(v.nbytes for v in batch) <= batch_bytes
                assert len({v.obj for v in batch}) <= max_maps  # v.obj: the map a view is of
                got += b"".join(bytes(v) for v in batch)
                del batch
            assert bytes(got) == want
            assert checksum_runs(runs, batch_bytes) == (crc32c.crc32c(want) if want else 0)
    assert reader.checksum(region, piece_bytes=256) == (crc32c.crc32c(want) if want else 0)


def test_row_bands_of_whole_row_chunks_are_one_run_per_chunk(tmp_path: Path) -> None:
    s = LocalStore(tmp_path, chunk_bytes=64 * 100 * 4)  # 64 rows fit: 1000 rows in 16 even chunks of 63
    data = random_array((1000, 100), "float32", seed=2)
    s.write_shard("j", "s1-g0", "w", Region.full(data.shape), data, dtype="float32", global_shape=data.shape)
    reader = s.open_tensor("j", "s1-g0", "w", committed_only=False)
    runs = reader.runs(Region(((10, 300), (0, 100))), min_run_bytes=1)
    assert runs is not None and [r.coords for r in runs] == [(k, 0) for k in range(5)]
    assert runs[0].offset == 10 * 400 and runs[0].nbytes == 53 * 400 and runs[-1].nbytes == (300 - 252) * 400
    # a column slice is row segments: the default minimum run length sends it through the copy path
    assert reader.runs(Region(((0, 1000), (0, 50)))) is None
    assert reader.runs(Region(((0, 1000), (0, 50))), min_run_bytes=200) is not None


def test_a_missing_chunk_or_shard_is_an_error_not_fill_values(tmp_path: Path) -> None:
    s = LocalStore(tmp_path, chunk_bytes=1024)
    data = random_array((64, 64), "float32", seed=1)
    s.write_shard("j", "s1-g0", "w", Region.full(data.shape), data, dtype="float32", global_shape=data.shape)
    reader = s.open_tensor("j", "s1-g0", "w", committed_only=False)
    runs = reader.runs(Region.full(data.shape), min_run_bytes=1)
    assert runs
    shard = tmp_path / "j" / "s1-g0" / "w" / "r0-64_0-64"
    (shard / "c.3.0").unlink()
    with pytest.raises(StateLost, match="missing"):
        map_runs(runs)
    (shard / "c.4.0").write_bytes(b"short")
    with pytest.raises(StateLost, match="5 bytes"):
        checksum_runs(runs[4:5], 1 << 20)
    s.delete("j", "s1-g0")
    with pytest.raises(NotFound, match="deleted"):
        map_runs(runs)


def test_views_of_a_deleted_version_stay_valid_until_released(tmp_path: Path) -> None:
    # a body being sent keeps its maps: deleting the version meanwhile must not change what is sent
    s = LocalStore(tmp_path, chunk_bytes=4096)
    data = random_array((128, 32), "float32", seed=6)
    s.write_shard("j", "s1-g0", "w", Region.full(data.shape), data, dtype="float32", global_shape=data.shape)
    s.commit("j", "s1-g0")
    runs = s.open_tensor("j", "s1-g0", "w").runs(Region.full(data.shape), min_run_bytes=1)
    assert runs is not None
    views = map_runs(runs)
    s.delete("j", "s1-g0")
    assert b"".join(bytes(v) for v in views) == data.tobytes()
    assert crc_of_views(views) == crc32c.crc32c(data.tobytes())


# -- over HTTP --------------------------------------------------------------------


def _get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body


@pytest.fixture(scope="module", params=["runs", "sendfile", "copy"])
def http_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreServer]:
    """A server over a one-shard tensor and a two-shard one, with every body sent from chunk-file runs
    (maps of them, or ``sendfile`` of their ranges), or copied."""
    root = tmp_path_factory.mktemp(f"http-{request.param}")
    store = LocalStore(root, chunk_bytes=4096)
    whole = Region.full(SHAPE)
    store.write_shard("j", "s1-g0", "one", whole, FULL, dtype="float32", global_shape=SHAPE)
    for box in SHARDS:
        store.write_shard("j", "s1-g0", "two", box, np.ascontiguousarray(FULL[box.slices()]), dtype="float32", global_shape=SHAPE)
    store.commit("j", "s1-g0")
    min_run = 1 << 30 if request.param == "copy" else 1
    sendfile_min = 1 if request.param == "sendfile" else 1 << 40
    # single pass up to 8 KiB, bigger bodies in 2 KiB batches: small regions take every path
    with StoreServer(root, store=store, single_pass_bytes=8 << 10, piece_bytes=2 << 10, min_run_bytes=min_run,
                     sendfile_min_bytes=sendfile_min) as srv:
        yield srv


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(region=regions(SHAPE), tensor=st.sampled_from(["one", "two"]))
def test_the_checksum_header_is_the_crc32c_of_the_body(http_server: StoreServer, region: Region, tensor: str) -> None:
    status, headers, body = _get(http_server.port, f"/v1/jobs/j/versions/s1-g0/tensors/{tensor}?region={region.format()}")
    assert status == 200
    assert body == np.ascontiguousarray(FULL[region.slices()]).tobytes()
    assert headers["x-tenplex-checksum"] == format_checksum(crc32c.crc32c(body) if body else 0)
    assert headers["content-length"] == str(len(body))
    assert headers["x-tenplex-shape"] == ",".join(map(str, region.shape))


def test_whole_shard_bodies_carry_the_recorded_checksum(http_server: StoreServer) -> None:
    manifest = http_server.store.manifest("j", "s1-g0")
    for info in manifest.shards:
        status, headers, body = _get(http_server.port, f"/v1/jobs/j/versions/s1-g0/tensors/{info.tensor}?region={info.region.format()}")
        assert status == 200 and headers["x-tenplex-checksum"] == info.checksum
        assert body == np.ascontiguousarray(FULL[info.region.slices()]).tobytes()


def test_a_corrupted_chunk_under_a_recorded_checksum_fails_at_the_client(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, chunk_bytes=4096)
    data = random_array((256, 64), "float32", seed=9)
    store.write_shard("j", "s1-g0", "w", Region.full(data.shape), data, dtype="float32", global_shape=data.shape)
    store.commit("j", "s1-g0")
    chunk = tmp_path / "j" / "s1-g0" / "w" / "r0-256_0-64" / "c.2.0"
    damaged = bytearray(chunk.read_bytes())
    damaged[7] ^= 0x10
    chunk.write_bytes(bytes(damaged))
    expected = data.copy()
    expected.reshape(-1).view(np.uint8)[32 * 256 + 7] ^= 0x10  # chunk c.2.0 holds rows 32..47
    # mapped once and sent, streamed in batches, and sent with sendfile
    for single_pass, sendfile_min in ((1 << 20, 1 << 40), (1024, 1 << 40), (1 << 20, 1)):
        with StoreServer(tmp_path, store=store, single_pass_bytes=single_pass, piece_bytes=4096, min_run_bytes=1,
                         sendfile_min_bytes=sendfile_min) as srv:
            with StoreClient(srv.url, retries=0) as c, pytest.raises(ChecksumMismatch, match="crc32c"):
                c.read_into("j", "s1-g0", "w", Region.full(data.shape), np.empty_like(data))
            # a region that is not the whole shard is checksummed from the bytes sent: they arrive as they are on disk
            with StoreClient(srv.url, retries=0) as c:
                out = np.empty((255, 64), np.float32)
                c.read_into("j", "s1-g0", "w", Region(((1, 256), (0, 64))), out)
                assert out.tobytes() == expected[1:].tobytes()
            # a region of whole chunk files carries their recorded checksums, combined: damage fails at the client
            with StoreClient(srv.url, retries=0) as c, pytest.raises(ChecksumMismatch, match="crc32c"):
                c.read_into("j", "s1-g0", "w", Region(((16, 64), (0, 64))), np.empty((48, 64), np.float32))
            with StoreClient(srv.url, retries=0) as c:  # chunks 0, 1 and 3 are intact
                out = np.empty((16, 64), np.float32)
                c.read_into("j", "s1-g0", "w", Region(((48, 64), (0, 64))), out)
                assert out.tobytes() == data[48:64].tobytes()


@settings(max_examples=200, deadline=None)
@given(a=st.binary(max_size=300), b=st.binary(max_size=300), zeros=st.integers(0, 1 << 22))
def test_crc32c_combine_equals_the_checksum_of_the_concatenation(a: bytes, b: bytes, zeros: int) -> None:
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)
    # lengths of chunk-file size, without materialising most of the bytes
    tail = bytes(zeros % 5000) + b
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(tail), len(tail)) == crc32c.crc32c(a + tail)


def test_chunk_aligned_bodies_use_the_recorded_chunk_checksums(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, chunk_bytes=4096)
    data = random_array((256, 64), "float32", seed=12)  # 16-row chunk files
    store.write_shard("j", "s1-g0", "w", Region.full(data.shape), data, dtype="float32", global_shape=data.shape)
    store.commit("j", "s1-g0")
    reader = store.open_tensor("j", "s1-g0", "w")
    aligned = reader.runs(Region(((32, 96), (0, 64))), 1)
    assert aligned is not None and reader.recorded_checksum(aligned) == crc32c.crc32c(data[32:96].tobytes())
    partial = reader.runs(Region(((33, 96), (0, 64))), 1)
    assert partial is not None and reader.recorded_checksum(partial) is None  # starts inside a chunk


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=700), block=st.integers(1, 100), start=st.integers(0, 700), length=st.integers(0, 700))
def test_received_crc_prefixes_give_the_checksum_of_any_part(data: bytes, block: int, start: int, length: int) -> None:
    buf = np.frombuffer(data, np.uint8).copy()
    received = ReceivedCrcs(buf, block)
    view = memoryview(buf)
    assert received.crc_of(view) is None or not data  # nothing recorded yet
    for k in range(0, len(data), block):
        received.prefix.append(crc32c.crc32c(data[: k + block]))
    start = min(start, len(data))
    stop = min(len(data), start + length)
    assert received.crc_of(view[start:stop]) == crc32c.crc32c(data[start:stop])
    if data:
        assert received.crc_of(memoryview(bytearray(data))) is None  # other memory: the caller checksums it


def test_a_batch_read_records_the_prefixes_the_writer_takes_its_checksums_from(
    http_server: StoreServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(client_module, "VERIFY_BLOCK_BYTES", 1000)  # receive blocks that are not prefix blocks
    box = Region(((3, 4), (0, 45), (0, 33)))  # 5940 bytes: one request on every server of the fixture
    out = np.empty(box.shape, np.float32)
    received = ReceivedCrcs(out, block=768)
    with StoreClient(http_server.url) as c:
        c.read_regions("j", "s1-g0", [RegionRead("two", box, out, received)])
    expected = np.ascontiguousarray(FULL[box.slices()])
    assert out.tobytes() == expected.tobytes()
    assert received.complete and received.prefix[-1] == crc32c.crc32c(expected.tobytes())
    # the writer's chunk files and shard checksum equal those of a store that checksummed the bytes itself
    given_crcs, plain = LocalStore(tmp_path / "given", chunk_bytes=1024), LocalStore(tmp_path / "plain", chunk_bytes=1024)
    a = given_crcs.write_shard("j", "s1-g1", "two", box, out, dtype="float32", global_shape=SHAPE, received=received)
    b = plain.write_shard("j", "s1-g1", "two", box, expected, dtype="float32", global_shape=SHAPE)
    assert a.checksum == b.checksum
    meta = [json.loads((s.root / "j" / "s1-g1" / "two" / region_key(box) / "zarr.json").read_text()) for s in (given_crcs, plain)]
    assert meta[0]["attributes"][local_module.CHUNK_CRCS] == meta[1]["attributes"][local_module.CHUNK_CRCS]
    with pytest.raises(InvalidInput, match="another buffer"):
        given_crcs.write_shard("j", "s1-g1", "two", box, expected, dtype="float32", global_shape=SHAPE, received=received)


def test_the_client_verifies_in_blocks_that_do_not_divide_the_body(http_server: StoreServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "VERIFY_BLOCK_BYTES", 1000)  # not a multiple of the element size either
    with StoreClient(http_server.url, max_request_bytes=1 << 30) as c:
        out = np.empty(SHAPE, np.float32)
        c.read_into("j", "s1-g0", "one", Region.full(SHAPE), out)
        assert out.tobytes() == FULL.tobytes()


def test_runs_of_chunks_not_in_the_page_cache_are_read_on_mapping(tmp_path: Path) -> None:
    # chunk files written with O_DIRECT (or evicted) are not cached: mapping them reads them (several at
    # once, off the GIL), so that a body's first touch in the event loop's socket write finds them mapped
    import os

    from tenplex.store import rawchunks

    s = LocalStore(tmp_path, chunk_bytes=64 * 128 * 4)  # 32 KiB chunk files: whole pages
    data = random_array((1000, 128), "float32", seed=12)
    s.write_shard("j", "s1-g0", "w", Region.full(data.shape), data, dtype="float32", global_shape=data.shape)
    shard = tmp_path / "j" / "s1-g0" / "w" / "r0-1000_0-128"
    os.sync()  # a file system without O_DIRECT wrote them through the cache: clean pages can be dropped
    for chunk in shard.glob("c.*"):
        fd = os.open(chunk, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    runs = s.open_tensor("j", "s1-g0", "w", committed_only=False).runs(Region(((5, 1000), (0, 128))), min_run_bytes=1)
    assert runs is not None and len(runs) == 16
    probe = memoryview(runs[3].reader.map_chunk(runs[3].coords))
    assert not rawchunks._first_page_cached(probe)  # evicted
    views = map_runs(runs)
    assert rawchunks._first_page_cached(probe)  # read by mapping the runs
    assert b"".join(bytes(v) for v in views) == data[5:].tobytes()


# -- sendfile -------------------------------------------------------------------------------------


@pytest.fixture
def big_server(tmp_path: Path) -> Iterator[tuple[StoreServer, np.ndarray]]:
    """A server over one 16 MiB shard in 64 KiB chunk files whose bodies all go out with sendfile."""
    store = LocalStore(tmp_path, chunk_bytes=64 << 10)
    data = random_array((1024, 4096), "float32", seed=21)
    store.write_shard("j", "s1-g0", "w", Region.full(data.shape), data, dtype="float32", global_shape=data.shape)
    store.commit("j", "s1-g0")
    with StoreServer(tmp_path, store=store, piece_bytes=1 << 20, min_run_bytes=1, sendfile_min_bytes=1) as srv:
        yield srv, data


def _open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


def _settled_fds(limit: int, timeout: float = 10.0) -> int:
    """The process's open descriptors once they are down to ``limit`` (or whatever is left at the timeout)."""
    import time

    deadline = time.monotonic() + timeout
    n = _open_fds()
    while n > limit and time.monotonic() < deadline:
        time.sleep(0.05)
        n = _open_fds()
    return n


def test_sendfile_bodies_are_exact_and_the_connection_is_reused(big_server: tuple[StoreServer, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    from tenplex import serving

    srv, data = big_server
    calls = []
    real = serving._sendfile_all
    monkeypatch.setattr(serving, "_sendfile_all", lambda *a: calls.append(len(a[1])) or real(*a))
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    for region in (Region.full(data.shape), Region(((3, 1000), (0, 4096))), Region(((0, 1024), (8, 4000)))):
        conn.request("GET", f"/v1/jobs/j/versions/s1-g0/tensors/w?region={region.format()}")
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 200 and body == np.ascontiguousarray(data[region.slices()]).tobytes()
        assert resp.getheader("X-Tenplex-Checksum") == format_checksum(crc32c.crc32c(body))
    conn.close()
    # on one kept-alive connection: the whole shard in 16 batches of 1 MiB (16 chunk files each), rows 3:1000
    # in 16 batches (the first chunk file partly), the column cut in batches of 1 MiB of row segments
    assert calls[:16] == [16] * 16 and len(calls) == 16 + 16 + 16


def test_a_client_that_leaves_mid_body_costs_nothing(big_server: tuple[StoreServer, np.ndarray]) -> None:
    import socket

    srv, data = big_server
    before = _open_fds()
    for _ in range(5):
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(b"GET /v1/jobs/j/versions/s1-g0/tensors/w HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536)  # headers and the start of the body
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset
        sock.close()
    with StoreClient(srv.url) as c:  # the daemon serves the next request as before
        out = np.empty(data.shape, np.float32)
        c.read_into("j", "s1-g0", "w", Region.full(data.shape), out)
        assert out.tobytes() == data.tobytes()
    assert _settled_fds(before) <= before  # no chunk file or socket descriptor left behind


def test_a_client_that_stops_reading_is_dropped_after_the_stall_limit(big_server: tuple[StoreServer, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import time

    from tenplex import serving

    srv, data = big_server
    monkeypatch.setattr(serving, "SENDFILE_STALL_S", 0.5)
    before = _open_fds()
    sock = socket.create_connection(("127.0.0.1", srv.port))  # one more descriptor in this process
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # far less than the body: sendfile stalls
    sock.sendall(b"GET /v1/jobs/j/versions/s1-g0/tensors/w HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.3)
    assert _open_fds() > before + 1  # the server holds the chunk files and the connection
    # nothing is read: after the stall limit the server gives up, closes the connection and the files
    assert _settled_fds(before + 1) <= before + 1
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()
    with StoreClient(srv.url) as c:
        out = np.empty(data.shape, np.float32)
        c.read_into("j", "s1-g0", "w", Region.full(data.shape), out)
        assert out.tobytes() == data.tobytes()


def test_without_the_sendfile_extension_bodies_are_sent_from_maps(tmp_path: Path) -> None:
    # the app runs under a server that does not offer tenplex.sendfile (plain uvicorn): same bytes
    import threading

    import uvicorn

    from tenplex.node.store_routes import create_app
    from tenplex.serving import bind_socket

    store = LocalStore(tmp_path, chunk_bytes=64 << 10)
    data = random_array((512, 1024), "float32", seed=22)
    store.write_shard("j", "s1-g0", "w", Region.full(data.shape), data, dtype="float32", global_shape=data.shape)
    store.commit("j", "s1-g0")
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(store, token=None, sendfile_min_bytes=1), http="httptools",
                                           lifespan="off", log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            threading.Event().wait(0.01)
        status, headers, body = _get(sock.getsockname()[1], "/v1/jobs/j/versions/s1-g0/tensors/w?region=1:512,0:1024")
        assert status == 200 and body == data[1:].tobytes()
        assert headers["x-tenplex-checksum"] == format_checksum(crc32c.crc32c(body))
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_the_first_read_of_a_committed_version_opens_its_other_tensors_ahead(tmp_path: Path) -> None:
    import time

    store = LocalStore(tmp_path)
    names = [f"layers.{i}/w" for i in range(12)]
    for name in names:
        store.write_shard("j", "s1-g0", name, Region.full((4, 4)), np.full((4, 4), 1.0, np.float32), dtype="float32", global_shape=(4, 4))
    store.commit("j", "s1-g0")
    served = LocalStore(tmp_path)  # the daemon's own store object: nothing cached yet
    with StoreServer(tmp_path, store=served) as srv, StoreClient(srv.url) as c:
        assert c.read("j", "s1-g0", names[0], Region.full((4, 4)), "float32").sum() == 16
        deadline = time.monotonic() + 10
        while any(served.cached_tensor("j", Version.parse("s1-g0"), n) is None for n in names) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(served.cached_tensor("j", Version.parse("s1-g0"), n) is not None for n in names)
    assert LocalStore(tmp_path).preload("j", "s1-g0") == len(names)  # the method itself, on a fresh cache


@pytest.mark.parametrize("shape", [(1000, 64), (7, 300, 64), (5000,)])
def test_a_shards_checksum_combined_from_its_chunk_files_is_the_checksum_of_its_bytes(tmp_path: Path, shape) -> None:
    """The writer takes a shard's crc32c from its chunk files' (no second pass over the bytes), padded edge
    chunks included: it must be exactly the crc32c of the shard's C-order bytes."""
    store = LocalStore(tmp_path, chunk_bytes=16 << 10)
    data = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    region = Region.full(shape)
    info = store.write_shard("j", "s1-g0", "t", region, data, dtype="float32", global_shape=shape)
    assert info.checksum == format_checksum(crc32c.crc32c(data.tobytes()))
    store.commit("j", "s1-g0")
    out = np.empty(shape, np.float32)
    store.read_into("j", "s1-g0", "t", region, out)
    assert np.array_equal(out, data) and store.verify("j", "s1-g0") == []
    store.close()
