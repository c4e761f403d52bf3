"""Batch reads (``POST .../regions``): many regions of one version in one request, against real servers."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import crc32c
import numpy as np
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenplex.errors import ChecksumMismatch, InvalidInput, NotFound, RegionOutOfBounds
from tenplex.node.store_routes import StoreServer, create_app
from tenplex.ptc.dtypes import storage_dtype
from tenplex.ptc.region import Region
from tenplex.serving import bind_socket
from tenplex.store.base import RegionRead
from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore
from tenplex.store.model import format_checksum
from tenplex.store.wire import MAX_BATCH_REGIONS

from .test_local import random_array

# tensor -> (dtype, shape, shards' row splits): a big one in 64 KiB chunk files (sent as runs), small
# ones (biases: one small chunk file each), and one cut in uneven row bands (regions across shards)
TENSORS = {
    "w": ("float32", (512, 256), [(0, 512)]),
    "bias": ("float32", (96,), [(0, 96)]),
    "norm": ("bfloat16", (40,), [(0, 40)]),
    "emb": ("float16", (100, 24), [(0, 37), (37, 100)]),
}


def _populate(store: LocalStore) -> dict[str, np.ndarray]:
    data = {}
    for i, (name, (dtype, shape, rows)) in enumerate(TENSORS.items()):
        data[name] = random_array(shape, dtype, seed=40 + i)
        for a, b in rows:
            box = Region(((a, b), *((0, n) for n in shape[1:])))
            store.write_shard("j", "s1-g0", name, box, np.ascontiguousarray(data[name][box.slices()]), dtype=dtype, global_shape=shape)
    store.commit("j", "s1-g0")
    return data


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[StoreServer, dict[str, np.ndarray]]]:
    root = tmp_path_factory.mktemp("batch")
    store = LocalStore(root, chunk_bytes=64 << 10)
    data = _populate(store)
    with StoreServer(root, store=store, piece_bytes=256 << 10) as srv:
        yield srv, data


def _post(port: int, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


def _regions_body(regions: list[tuple[str, Region]]) -> bytes:
    return json.dumps({"regions": [{"tensor": t, "region": r.format()} for t, r in regions]}).encode()


@st.composite
def region_lists(draw: st.DrawFn) -> list[tuple[str, Region]]:
    out = []
    for _ in range(draw(st.integers(1, 12))):
        name = draw(st.sampled_from(sorted(TENSORS)))
        bounds = []
        for n in TENSORS[name][1]:
            a = draw(st.integers(0, n))
            bounds.append((a, draw(st.integers(a, n))))
        out.append((name, Region(tuple(bounds))))
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(regions=region_lists())
def test_every_part_of_a_batch_is_bit_exact_and_carries_its_own_checksum(
    served: tuple[StoreServer, dict[str, np.ndarray]], regions: list[tuple[str, Region]]
) -> None:
    srv, data = served
    status, headers, body = _post(srv.port, "/v1/jobs/j/versions/s1-g0/regions", _regions_body(regions))
    assert status == 200
    parts = json.loads(headers["x-tenplex-parts"])
    assert len(parts) == len(regions)
    offset = 0
    for (name, region), (dtype, shape, checksum) in zip(regions, parts, strict=True):
        want = np.ascontiguousarray(data[name][region.slices()]).tobytes()
        got = body[offset : offset + len(want)]
        assert got == want and dtype == TENSORS[name][0] and shape == ",".join(map(str, region.shape))
        assert checksum == format_checksum(crc32c.crc32c(want))
        offset += len(want)
    assert offset == len(body)
    # the client lands every part in its own buffer
    outs = [np.empty(r.shape, storage_dtype(TENSORS[n][0])) for n, r in regions]
    with StoreClient(srv.url) as c:
        c.read_regions("j", "s1-g0", [RegionRead(n, r, o) for (n, r), o in zip(regions, outs, strict=True)])
    for (name, region), out in zip(regions, outs, strict=True):
        assert out.tobytes() == np.ascontiguousarray(data[name][region.slices()]).tobytes()


def test_whole_shards_carry_their_recorded_checksums_and_go_out_with_sendfile(
    served: tuple[StoreServer, dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tenplex import serving

    srv, data = served
    calls: list[int] = []
    real = serving._sendfile_all
    monkeypatch.setattr(serving, "_sendfile_all", lambda *a: calls.append(len(a[1])) or real(*a))
    regions = [("w", Region.full((512, 256))), ("bias", Region.full((96,))), ("norm", Region.full((40,)))]
    status, headers, body = _post(srv.port, "/v1/jobs/j/versions/s1-g0/regions", _regions_body(regions))
    assert status == 200 and body == b"".join(data[n].tobytes() for n, _r in regions)
    recorded = {s.tensor: s.checksum for s in srv.store.manifest("j", "s1-g0").shards}
    assert [p[2] for p in json.loads(headers["x-tenplex-parts"])] == [recorded[n] for n, _r in regions]
    # 512 KiB of w in 64 KiB chunk files, then the two small files, all runs: sent in batches of at most
    # 256 KiB (the server's piece size), the two small files together, not a hand-off each
    assert calls == [4, 4, 2]


def test_the_client_splits_batches_at_its_limits(served: tuple[StoreServer, dict[str, np.ndarray]]) -> None:
    srv, data = served
    requests = []
    with StoreClient(srv.url, max_request_bytes=200 << 10) as c:
        real = c._fetch_batch
        c._fetch_batch = lambda job, v, batch, verify: requests.append(len(batch)) or real(job, v, batch, verify)  # type: ignore[method-assign]
        # 300 small regions: two requests by count; w (512 KiB) is over max_request_bytes and read on its own
        reads = [RegionRead("bias", Region(((i % 90, i % 90 + 6),)), np.empty(6, np.float32)) for i in range(300)]
        whole = np.empty((512, 256), np.float32)
        c.read_regions("j", "s1-g0", [*reads[:150], RegionRead("w", Region.full(whole.shape), whole), *reads[150:]])
    assert requests == [MAX_BATCH_REGIONS, 300 - MAX_BATCH_REGIONS]
    assert whole.tobytes() == data["w"].tobytes()
    for i, r in enumerate(reads):
        assert r.out.tobytes() == data["bias"][i % 90 : i % 90 + 6].tobytes()


def test_each_part_is_reported_done_as_it_arrives_and_a_retry_never_rewrites_it(
    served: tuple[StoreServer, dict[str, np.ndarray]],
) -> None:
    """What lets the executor store a shard while the rest of a large batch is on the wire (execute._fetch_batch)."""
    srv, data = served
    events: list[str] = []
    with StoreClient(srv.url, backoff=0.01) as c:
        real = c._receive
        cut = [True]

        def receive(resp, target, checksum, what, version, received=None):  # type: ignore[no-untyped-def]
            if "'bias'" in what and cut[0]:  # the connection drops in the second part, once: the request is retried
                cut[0] = False
                raise ConnectionResetError("cut mid-body by the test")
            events.append(f"receive {what}")
            real(resp, target, checksum, what, version, received)

        c._receive = receive  # type: ignore[method-assign]
        w, bias, emb = np.empty((512, 256), np.float32), np.empty(96, np.float32), np.empty((100, 24), np.float16)

        def done(name: str, out: np.ndarray) -> None:
            events.append(f"done {name}")
            assert out.tobytes() == data[name].tobytes()  # in and verified when reported
            out[...] = 0  # the caller owns it now: a retry must not write it again

        c.read_regions("j", "s1-g0", [
            RegionRead("w", Region.full(w.shape), w, done=lambda: done("w", w)),
            RegionRead("bias", Region.full((96,)), bias, done=lambda: done("bias", bias)),
            RegionRead("emb", Region.full((100, 24)), emb, done=lambda: done("emb", emb)),
        ])
    assert events == ["receive 'w' '0:512,0:256'", "done w",  # then the cut, and the retry reads past w
                      "receive 'bias' '0:96'", "done bias", "receive 'emb' '0:100,0:24'", "done emb"]
    assert not w.any() and not bias.any() and not emb.any()


def test_bad_batches_get_clear_errors(served: tuple[StoreServer, dict[str, np.ndarray]]) -> None:
    srv, _data = served
    path = "/v1/jobs/j/versions/s1-g0/regions"
    status, _h, body = _post(srv.port, path, _regions_body([("bias", Region(((0, 1),)))] * (MAX_BATCH_REGIONS + 1)))
    assert status == 400 and b"at most 256" in body
    status, _h, body = _post(srv.port, path, b"{not json")
    assert status == 400 and json.loads(body)["error"] == "invalid_input"
    status, _h, body = _post(srv.port, path, b'{"regions": [{"tensor": "bias"}]}')
    assert status == 400 and b"region" in body
    status, _h, body = _post(srv.port, "/v1/jobs/j/versions/s9-g0/regions", _regions_body([("bias", Region(((0, 1),)))]))
    assert status == 404
    with StoreClient(srv.url) as c:
        with pytest.raises(NotFound, match="'nope'"):
            c.read_regions("j", "s1-g0", [RegionRead("bias", Region(((0, 4),)), np.empty(4, np.float32)),
                                          RegionRead("nope", Region(((0, 1),)), np.empty(1, np.float32))])
        with pytest.raises(RegionOutOfBounds, match="0:97"):
            c.read_regions("j", "s1-g0", [RegionRead("bias", Region(((0, 97),)), np.empty(97, np.float32))])
        with pytest.raises(InvalidInput, match="2-byte elements"):  # the buffer's element size is not the tensor's
            c.read_regions("j", "s1-g0", [RegionRead("bias", Region(((0, 4),)), np.empty(4, np.float16))])
        with pytest.raises(InvalidInput, match="shape"):
            c.read_regions("j", "s1-g0", [RegionRead("bias", Region(((0, 4),)), np.empty(5, np.float32))])
        out = np.empty(96, np.float32)  # and the daemon serves on as before
        c.read_regions("j", "s1-g0", [RegionRead("bias", Region.full((96,)), out)])
        assert out.tobytes() == _data["bias"].tobytes()


def test_a_damaged_chunk_fails_its_part_at_the_client(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, chunk_bytes=64 << 10)
    data = _populate(store)
    chunk = next(p for p in (tmp_path / "j" / "s1-g0" / "bias").rglob("c*") if p.is_file())
    damaged = bytearray(chunk.read_bytes())
    damaged[8] ^= 0x10
    chunk.write_bytes(bytes(damaged))
    with StoreServer(tmp_path, store=store) as srv, StoreClient(srv.url) as c:
        w = np.empty((512, 256), np.float32)
        with pytest.raises(ChecksumMismatch, match="'bias'"):
            c.read_regions("j", "s1-g0", [RegionRead("w", Region.full(w.shape), w), RegionRead("bias", Region.full((96,)), np.empty(96, np.float32))])
        assert w.tobytes() == data["w"].tobytes()  # the part before it arrived whole


def test_without_sendfile_parts_are_read_into_memory_within_the_single_pass_limit(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, chunk_bytes=64 << 10)
    data = _populate(store)
    sock = bind_socket("127.0.0.1", 0)
    app = create_app(store, token=None, single_pass_bytes=600 << 10)
    server = uvicorn.Server(uvicorn.Config(app, http="httptools", lifespan="off", log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            threading.Event().wait(0.01)
        port = sock.getsockname()[1]
        regions = [("w", Region(((1, 512), (0, 256)))), ("emb", Region(((30, 60), (2, 20)))), ("norm", Region(((3, 9),)))]
        status, headers, body = _post(port, "/v1/jobs/j/versions/s1-g0/regions", _regions_body(regions))
        assert status == 200
        assert body == b"".join(np.ascontiguousarray(data[n][r.slices()]).tobytes() for n, r in regions)
        assert len(json.loads(headers["x-tenplex-parts"])) == 3
        # more than single_pass_bytes to read into memory: refused before anything is read
        status, _h, body = _post(port, "/v1/jobs/j/versions/s1-g0/regions", _regions_body([("w", Region.full((512, 256)))] * 2))
        assert status == 400 and b"fewer regions per request" in body
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
