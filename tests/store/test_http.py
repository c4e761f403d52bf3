"""The store over HTTP: a real uvicorn server on an ephemeral port, the real client, raw http.client for bad input."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenplex.errors import (
    ChecksumMismatch,
    InvalidInput,
    NotFound,
    RegionOutOfBounds,
    StoreUnavailable,
    Unauthorized,
)
from tenplex.node.store_routes import StoreServer
from tenplex.ptc.dtypes import DTYPES, storage_dtype
from tenplex.ptc.region import Region
from tenplex.store.client import ReadRequest, StoreClient
from tenplex.store.local import LocalStore

from .conftest import TOKEN
from .test_local import random_array

SHAPE = (40, 30)


def raw(server: StoreServer, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None, token: str | None = TOKEN) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    hdrs = dict(headers or {})
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    conn.request(method, path, body=body, headers=hdrs)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data


def error_of(body: bytes) -> str:
    obj = json.loads(body)
    assert set(obj) == {"error", "detail"} and obj["detail"]
    return obj["error"]


@pytest.fixture(scope="module")
def dataset(server: StoreServer) -> dict[str, np.ndarray]:
    """Job 'props': one tensor per dtype, each stored as four uneven shards, committed as s1-g0."""
    out = {}
    with StoreClient(server.url, TOKEN) as c:
        for i, dtype in enumerate(sorted(DTYPES)):
            data = random_array(SHAPE, dtype, seed=i)
            out[dtype] = data
            for rows in ((0, 13), (13, 40)):
                for cols in ((0, 7), (7, 30)):
                    box = Region((rows, cols))
                    c.write_shard("props", "s1-g0", f"t/{dtype}.w", box, np.ascontiguousarray(data[box.slices()]), dtype=dtype, global_shape=SHAPE)
        c.commit("props", "s1-g0")
    return out


@st.composite
def dtype_and_region(draw: st.DrawFn) -> tuple[str, Region]:
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    bounds = []
    for n in SHAPE:
        a = draw(st.integers(0, n))
        bounds.append((a, draw(st.integers(a, n))))
    return dtype, Region(tuple(bounds))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=dtype_and_region())
def test_random_regions_of_every_dtype_are_bit_exact(client: StoreClient, dataset: dict[str, np.ndarray], case: tuple[str, Region]) -> None:
    dtype, region = case
    out = client.read("props", "s1-g0", f"t/{dtype}.w", region, dtype)
    assert out.dtype == storage_dtype(dtype)
    assert out.tobytes() == np.ascontiguousarray(dataset[dtype][region.slices()]).tobytes()


def test_read_into_torch_and_split_requests(server: StoreServer, dataset: dict[str, np.ndarray]) -> None:
    # max_request_bytes=100 splits one read into many requests, each landing in its slice of the buffer
    with StoreClient(server.url, TOKEN, max_request_bytes=100) as c:
        out = torch.empty(20, 30, dtype=torch.bfloat16)
        c.read_into("props", "s1-g0", "t/bfloat16.w", Region(((5, 25), (0, 30))), out)
        assert out.view(torch.int16).numpy().view(np.uint16).tobytes() == dataset["bfloat16"][5:25].tobytes()
        outs = [np.empty((10, 30), np.float32) for _ in range(4)]
        c.read_many([ReadRequest("props", "s1-g0", "t/float32.w", Region(((10 * i, 10 * i + 10), (0, 30))), o) for i, o in enumerate(outs)], concurrency=3)
        assert np.concatenate(outs).tobytes() == dataset["float32"].tobytes()


def test_streamed_paths_exact_shard_and_two_pass(client: StoreClient, server: StoreServer) -> None:
    # the fixture server answers > 64 KiB from 16 KiB pieces: an exact shard uses its stored checksum,
    # any other region gets a first checksum pass
    data = random_array((300, 100), "float64", seed=7)  # 240 KB
    client.write_shard("big", "s1-g0", "w", Region.full((300, 100)), data, dtype="float64", global_shape=(300, 100))
    client.commit("big", "s1-g0")
    status, headers, body = raw(server, "GET", "/v1/jobs/big/versions/s1-g0/tensors/w")
    assert status == 200 and body == data.tobytes()
    assert headers["x-tenplex-checksum"] == client.manifest("big", "s1-g0").shards[0].checksum
    assert headers["x-tenplex-shape"] == "300,100" and headers["x-tenplex-dtype"] == "float64"
    with StoreClient(server.url, TOKEN, max_request_bytes=1 << 30) as c:
        out = np.empty((250, 99), np.float64)
        c.read_into("big", "s1-g0", "w", Region(((20, 270), (1, 100))), out)
        assert out.tobytes() == np.ascontiguousarray(data[20:270, 1:100]).tobytes()
        full = np.empty((300, 100), np.float64)
        c.read_into("big", "s1-g0", "w", Region.full((300, 100)), full)
        assert full.tobytes() == data.tobytes()


def test_corrupted_disk_is_a_checksum_mismatch_at_the_client(tmp_path: Path) -> None:
    with StoreServer(tmp_path, single_pass_bytes=1024, piece_bytes=4096) as srv, StoreClient(srv.url) as c:
        data = random_array((64, 64), "float32", seed=3)
        c.write_shard("j", "s1-g0", "w", Region.full((64, 64)), data, dtype="float32", global_shape=(64, 64))
        c.commit("j", "s1-g0")
        chunk = next(p for p in (tmp_path / "j" / "s1-g0" / "w" / "r0-64_0-64").iterdir() if p.name.startswith("c"))
        raw_bytes = bytearray(chunk.read_bytes())
        raw_bytes[100] ^= 0x40
        chunk.write_bytes(bytes(raw_bytes))
        with pytest.raises(ChecksumMismatch, match="crc32c"):
            c.read_into("j", "s1-g0", "w", Region.full((64, 64)), np.empty((64, 64), np.float32))
    # the same through the single-buffer path of a default server
    with StoreServer(tmp_path) as srv, StoreClient(srv.url) as c, pytest.raises(ChecksumMismatch):
        c.read_into("j", "s1-g0", "w", Region.full((64, 64)), np.empty((64, 64), np.float32))


def _put(server: StoreServer, path: str, body: bytes, dtype: str = "float32", gshape: str = "4,4", token: str | None = TOKEN, extra: dict[str, str] | None = None) -> tuple[int, bytes]:
    headers = {"X-Tenplex-Dtype": dtype, "X-Tenplex-Global-Shape": gshape, **(extra or {})}
    status, _, data = raw(server, "PUT", path, body=body, headers=headers, token=token)
    return status, data


def test_bad_input_gets_4xx_json_and_changes_nothing(server: StoreServer, client: StoreClient, dataset: dict[str, np.ndarray]) -> None:
    ok = np.zeros((4, 4), np.float32).tobytes()
    base = "/v1/jobs/bad/versions/s1-g0/tensors/w"
    cases = [
        ("GET", "/v1/jobs/nojob/versions", None, 404, "not_found"),
        ("GET", "/v1/jobs/props/versions/s9-g0", None, 404, "not_found"),
        ("GET", "/v1/jobs/props/versions/s1-g0/tensors/nothere", None, 404, "not_found"),
        ("GET", "/v1/jobs/props/versions/s1-g0/tensors/t/float32.w?region=0:1", None, 400, "invalid_region"),
        ("GET", "/v1/jobs/props/versions/s1-g0/tensors/t/float32.w?region=a:b,0:1", None, 400, "invalid_region"),
        ("GET", "/v1/jobs/props/versions/s1-g0/tensors/t/float32.w?region=5:2,0:1", None, 400, "invalid_region"),
        ("GET", "/v1/jobs/props/versions/s1-g0/tensors/t/float32.w?region=0:41,:", None, 416, "region_out_of_bounds"),
        ("GET", "/v1/jobs/props/versions/s1-g0/tensors/t/float32.w?uncommitted=maybe", None, 400, "invalid_input"),
        ("GET", "/v1/jobs/props/versions/bogus", None, 400, "invalid_input"),
        ("GET", "/v1/jobs/props/versions/s1-g0/tensors/t/../float32.w", None, 400, "invalid_input"),
        ("GET", "/v1/jobs/props/versions/s1-g0/tensors/t/%2E%2E/float32.w", None, 400, "invalid_input"),
        ("GET", "/v1/jobs/props/versions/s1-g0/tensors//etc/passwd", None, 400, "invalid_input"),
        ("GET", "/v1/jobs/props/versions/s1-g0/tensors/t%00x", None, 400, "invalid_input"),
        ("GET", "/v1/jobs/props/versions/s1-g0/tensors/t%5Cx", None, 400, "invalid_input"),
        ("GET", "/v1/jobs/.hidden/versions", None, 400, "invalid_input"),
        ("GET", "/v1/jobs/%2E%2E/versions", None, 400, "invalid_input"),
        ("POST", "/v1/jobs/props/versions/s9-g0/commit", None, 404, "not_found"),
        ("DELETE", "/v1/jobs/props/versions/s9-g0", None, 404, "not_found"),
        ("DELETE", "/v1/jobs/nojob/versions/s1-g0", None, 404, "not_found"),
        ("POST", "/v1/jobs/bad/versions/s1-g0/reservation", b'{"nbytes": -1}', 400, "invalid_input"),
        ("POST", "/v1/jobs/bad/versions/s1-g0/reservation", b'{"bytes": 5}', 400, "invalid_input"),
        # links: the body is a LinkRequest naming exactly a stored shard of a committed version
        ("POST", "/v1/jobs/bad/versions/s2-g0/links", b"not json", 400, "invalid_input"),
        ("POST", "/v1/jobs/bad/versions/s2-g0/links", b'{"from_version": "s1-g0", "tensor": "w"}', 400, "invalid_input"),
        ("POST", "/v1/jobs/bad/versions/s2-g0/links", b'{"from_version": "s1-g0", "tensor": "w", "region": ":", "x": 1}', 400, "invalid_input"),
        ("POST", "/v1/jobs/props/versions/s2-g0/links", b'{"from_version": "v1", "tensor": "t/float32.w", "region": ":,:"}', 400, "invalid_input"),
        ("POST", "/v1/jobs/props/versions/s2-g0/links", b'{"from_version": "s1-g0", "tensor": "t/float32.w", "region": "0:41,:"}', 416, "region_out_of_bounds"),
        ("POST", "/v1/jobs/props/versions/s2-g0/links", b'{"from_version": "s1-g0", "tensor": "t/float32.w", "region": ":,:"}', 404, "not_found"),
        ("POST", "/v1/jobs/props/versions/s1-g0/links", b'{"from_version": "s1-g0", "tensor": "t/float32.w", "region": "0:13,0:7"}', 409, "conflict"),
    ]
    for method, path, body, status, code in cases:
        got, _, data = raw(server, method, path, body=body, headers={"Content-Type": "application/json"} if body else None)
        assert (got, error_of(data)) == (status, code), (method, path, data)

    # uploads: wrong length, bad region, bad dtype, bad shape, missing headers, committed version
    assert _put(server, base + "?region=0:4,0:4", ok[:-4])[0] == 400
    assert _put(server, base + "?region=0:4,0:4", ok + b"1234")[0] == 400
    assert _put(server, base + "?region=0:4,0:5", ok)[0] == 416
    assert _put(server, base + "?region=0:4", ok)[0] == 400
    assert _put(server, base, ok)[0] == 400
    assert _put(server, base + "?region=0:4,0:4", ok, dtype="float128")[0] == 400
    assert _put(server, base + "?region=0:4,0:4", ok, gshape="4,x")[0] == 400
    assert _put(server, base + "?region=0:4,0:4", ok, gshape="4,-4")[0] == 400
    assert _put(server, "/v1/jobs/bad/versions/s1-g0/tensors/a/../../x?region=0:4,0:4", ok)[0] == 400
    status, _, data = raw(server, "PUT", base + "?region=0:4,0:4", body=ok, headers={"X-Tenplex-Global-Shape": "4,4"})
    assert status == 400 and "X-Tenplex-Dtype" in json.loads(data)["detail"]
    with pytest.raises(NotFound):
        client.versions("bad")  # nothing at all was stored for job 'bad'
    status, data = _put(server, "/v1/jobs/props/versions/s1-g0/tensors/t/float32.w?region=0:4,0:4", ok, gshape="40,30")
    assert (status, error_of(data)) == (409, "conflict")
    assert client.read("props", "s1-g0", "t/float32.w", Region(((0, 4), (0, 4))), "float32").tobytes() == np.ascontiguousarray(dataset["float32"][:4, :4]).tobytes()
    # a chunked upload body that runs past the region's size is cut off and stores nothing
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("PUT", base + "?region=0:4,0:4")
    for k, v in {"Authorization": f"Bearer {TOKEN}", "X-Tenplex-Dtype": "float32", "X-Tenplex-Global-Shape": "4,4", "Transfer-Encoding": "chunked"}.items():
        conn.putheader(k, v)
    conn.endheaders()
    body = ok + ok
    conn.send(f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
    resp = conn.getresponse()
    assert resp.status == 400 and error_of(resp.read()) == "invalid_input"
    conn.close()
    with pytest.raises(NotFound):
        client.versions("bad")


def test_client_errors_name_the_store(client: StoreClient, dataset: dict[str, np.ndarray]) -> None:
    """The daemon's {"error", "detail"} becomes the same exception class, naming the store that answered
    (the classes for every mistake are the same as the local store's: tests/store/test_conformance.py)."""
    with pytest.raises(NotFound, match=f"store {client.url}"):
        client.manifest("props", "s7-g0")
    with pytest.raises(RegionOutOfBounds, match=f"store {client.url}"):
        client.read("props", "s1-g0", "t/float32.w", Region(((0, 41), (0, 30))), "float32")


def test_auth_is_required_everywhere_but_healthz(server: StoreServer, dataset: dict[str, np.ndarray]) -> None:
    ok = np.zeros((4, 4), np.float32).tobytes()
    for token in (None, "wrong", TOKEN + "x"):
        for method, path in (
            ("GET", "/v1/jobs"),
            ("GET", "/v1/jobs/props/versions"),
            ("GET", "/v1/jobs/props/versions/s1-g0"),
            ("GET", "/v1/jobs/props/versions/s1-g0/tensors/t/float32.w"),
            ("POST", "/v1/jobs/props/versions/s1-g0/commit"),
            ("POST", "/v1/jobs/props/versions/s2-g0/links"),
            ("POST", "/v1/jobs/props/versions/s2-g0/reservation"),
            ("POST", "/v1/jobs/props/versions/s1-g0/regions"),
            ("DELETE", "/v1/jobs/props/versions/s1-g0"),
            ("GET", "/metrics"),
        ):
            status, _, data = raw(server, method, path, token=token)
            assert (status, error_of(data)) == (401, "unauthorized"), (token, method, path)
        status, data = _put(server, "/v1/jobs/authjob/versions/s1-g0/tensors/w?region=0:4,0:4", ok, token=token)
        assert status == 401
    status, _, data = raw(server, "GET", "/healthz", token=None)
    assert status == 200 and json.loads(data) == {"status": "ok"}
    with StoreClient(server.url, TOKEN) as c:
        assert "authjob" not in c.jobs()
        assert any(v.committed for v in c.versions("props"))  # DELETE without a token removed nothing
    with StoreClient(server.url, "wrong") as c, pytest.raises(Unauthorized):
        c.jobs()
    with StoreClient(server.url, "wrong") as c:
        assert c.health()


def test_metrics_count_bytes_latency_and_errors(server: StoreServer, client: StoreClient, dataset: dict[str, np.ndarray]) -> None:
    client.read("props", "s1-g0", "t/int8.w", Region.full(SHAPE), "int8")
    raw(server, "GET", "/v1/jobs/nojob/versions")
    text = client.metrics()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and not line.startswith("#")}
    assert values["tenplex_store_bytes_out_total"] >= 40 * 30
    assert values["tenplex_store_bytes_in_total"] > 0
    assert any(k.startswith("tenplex_store_request_seconds_count{") and "tensors/{tensor:path}" in k for k in values)
    assert values['tenplex_store_errors_total{route="/v1/jobs/{job}/versions",status="404"}'] >= 1


def test_unreachable_store_and_retry_until_it_comes_up(tmp_path: Path) -> None:
    dead = StoreClient("http://127.0.0.1:9", retries=2, backoff=0.01)
    with pytest.raises(StoreUnavailable, match="127.0.0.1:9.*3 attempts"):
        dead.jobs()
    assert not dead.health()
    # a server that starts while the client is retrying is reached
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    late = StoreServer(tmp_path, port=port)
    timer = threading.Timer(0.3, late.start)
    timer.start()
    try:
        with StoreClient(f"http://127.0.0.1:{port}", retries=6, backoff=0.1) as c:
            assert c.jobs() == []
    finally:
        timer.join()
        late.stop()
    with pytest.raises(InvalidInput, match="http://HOST:PORT"):
        StoreClient("ftp://x")


@pytest.mark.slow
def test_concurrent_readers_and_writers(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, chunk_bytes=4096)
    base = random_array((64, 64), "float32", seed=11)
    store.write_shard("c", "s1-g0", "w", Region.full((64, 64)), base, dtype="float32", global_shape=(64, 64))
    store.commit("c", "s1-g0")
    errors: list[BaseException] = []
    stop = time.monotonic() + 3.0

    with StoreServer(tmp_path, store=store) as srv:

        def reader() -> None:
            try:
                with StoreClient(srv.url) as c:
                    while time.monotonic() < stop:
                        r = Region(((3, 61), (5, 40)))
                        assert c.read("c", "s1-g0", "w", r, "float32").tobytes() == np.ascontiguousarray(base[r.slices()]).tobytes()
            except BaseException as exc:
                errors.append(exc)

        def writer(k: int) -> None:
            # replicas on one host race to write the same shards of the new version: last one wins, whole
            try:
                with StoreClient(srv.url) as c:
                    for i in range(8):
                        rows = (8 * i, 8 * i + 8)
                        data = np.full((8, 64), k, np.float32)
                        c.write_shard("c", "s2-g0", "w", Region((rows, (0, 64))), data, dtype="float32", global_shape=(64, 64))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=reader) for _ in range(3)] + [threading.Thread(target=writer, args=(k,)) for k in (1, 2, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        with StoreClient(srv.url) as c:
            c.commit("c", "s2-g0")
            got = c.read("c", "s2-g0", "w", Region.full((64, 64)), "float32")
        for i in range(8):
            block = got[8 * i : 8 * i + 8]
            assert block.min() == block.max() and block[0, 0] in (1, 2, 3)  # never a mix of two writers
        assert store.verify("c", "s2-g0") == []
        assert len(store.manifest("c", "s2-g0").shards) == 8


def test_a_worker_waiting_for_its_version_is_answered_at_the_commit_by_one_long_poll(
        server: StoreServer, client: StoreClient) -> None:
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    client.write_shard("waits", "s5-g1", "w", Region.full((3, 4)), data, dtype="float32", global_shape=(3, 4))
    assert client.wait_committed("waits", "s5-g1", 0.0) is False
    assert client.wait_committed("waits", "s5-g1", 0.2) is False  # uncommitted: the wait ends with its timeout
    assert client.wait_committed("nojob", "s1-g0", 0.0) is False  # unknown: not committed, no error

    def polls() -> float:
        text = client.metrics()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("tenplex_store_request_seconds_count{") and "/committed" in line)

    before = polls()
    answer: list[bool] = []
    waiter = threading.Thread(target=lambda: answer.append(client.wait_committed("waits", "s5-g1", 25.0)))
    waiter.start()
    time.sleep(0.5)  # the long poll is in flight (not an assertion: only what the daemon is asked is counted)
    assert waiter.is_alive() and not answer
    client.commit("waits", "s5-g1")
    waiter.join(timeout=25)
    assert answer == [True]
    assert polls() - before == 1  # one request, answered by the commit: not a loop of asks
    status, _headers, body = raw(server, "GET", "/v1/jobs/waits/versions/s5-g1/committed?wait=31", token=TOKEN)
    assert status == 400 and error_of(body) == "invalid_input"
