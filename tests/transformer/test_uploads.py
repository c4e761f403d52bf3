"""The node daemon's uploads to the persistent tier, over its HTTP routes, on moto's S3 server and on file://.

Real parts only: a node daemon (uvicorn on 127.0.0.1) over a zarr store on a tmp dir holding a committed
version, moto's S3 API in server mode on a loopback port (stopped and started again on the same port for an
outage), and a daemon process killed with SIGKILL mid-upload. The routes are the ones the scheduler's
housekeeping uses (:mod:`tenplex.scheduler.persist`): submit, follow, commit, retention.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest

from tenplex.core.version import Version
from tenplex.errors import Conflict, InvalidInput, NotFound
from tenplex.node.daemon import NodeDaemon
from tenplex.node.uploads import UploadSettings
from tenplex.ptc.region import Region
from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore
from tenplex.store.persistent import PersistentStore
from tests.moto_s3 import MotoS3

JOB = "up"
V = "s6-g0"
BUCKET = "tenplex-uploads"

# Two tensors, one of them cut in two regions, one larger than several chunk objects of the destination.
TENSORS: dict[str, tuple[tuple[int, ...], str, list[Region]]] = {
    "w": ((96, 64), "float32", [Region(((0, 48), (0, 64))), Region(((48, 96), (0, 64)))]),
    "b": ((64,), "bfloat16", [Region(((0, 64),))]),
}


def _data(name: str, region: Region, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(abs(hash((name, region.format()))) % 2**32)
    st = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
    if st == np.uint16:
        return rng.integers(0, 2**16, size=region.shape, dtype=np.uint16)
    return rng.standard_normal(region.shape).astype(st)


def _fill(store: LocalStore, version: str = V) -> list[list[str]]:
    shards = []
    for name, (shape, dtype, regions) in TENSORS.items():
        for r in regions:
            store.write_shard(JOB, version, name, r, _data(name, r, dtype), dtype=dtype, global_shape=shape)
            shards.append([name, r.format()])
    store.commit(JOB, version)
    return shards


def _uploads(version: str | None = None, suffix: str = "") -> str:
    return f"/v1/jobs/{JOB}/uploads" + (f"/{version}{suffix}" if version else "")


def _persistent(uri: str, version: str | None = None) -> str:
    return f"/v1/jobs/{JOB}/persistent" + (f"/{version}" if version else "") + f"?uri={quote(uri, safe='')}"


def _wait(client: StoreClient, version: str = V, timeout: float = 60.0, until: tuple[str, ...] = ("uploaded",
          "failed", "cancelled", "interrupted")) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        rec = client.request_json("GET", _uploads(version) + "?wait=2")
        if rec["state"] in until or time.monotonic() > deadline:
            return rec
        time.sleep(0.05)


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoS3]:
    server = MotoS3().start()
    server.create_bucket(BUCKET)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["file", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A persistent location; for s3 the daemon's AWS environment points at moto (what the chart sets)."""
    if request.param == "file":
        return (tmp_path / "ckpt").as_uri()
    moto = request.getfixturevalue("moto")
    for k, v in moto.env.items():
        monkeypatch.setenv(k, v)
    return f"s3://{BUCKET}/{request.node.name.replace('[', '-').replace(']', '')}"


def _node(tmp_path: Path, **settings: Any) -> NodeDaemon:
    store = LocalStore(tmp_path / "node", durable=False)
    return NodeDaemon(tmp_path / "node", store=store, token="tok",
                      uploads=UploadSettings(chunk_bytes=4096, backoff_s=0.2, backoff_max_s=0.5, **settings)).start()


def test_upload_resubmission_commit_and_retention(tmp_path: Path, location: str) -> None:
    with _node(tmp_path) as node, StoreClient(node.url, "tok") as c:
        shards = _fill(node.store)
        body = {"version": V, "uri": location, "shards": shards}
        first = c.request_json("POST", _uploads(), body)
        assert first["state"] in ("queued", "running", "uploaded") and first["bytes_total"] == 96 * 64 * 4 + 64 * 2
        # the same request again (the scheduler retrying, or a second scheduler): it attaches, nothing restarts
        assert c.request_json("POST", _uploads(), body)["digest"] == first["digest"]
        rec = _wait(c)
        assert rec["state"] == "uploaded" and rec["bytes_done"] == rec["bytes_total"] and rec["error"] is None, rec
        assert set(rec["stages"]) == {"check", "read", "write"}, rec  # "w" in pieces, "b" in a batch
        again = c.request_json("POST", _uploads(), body)
        assert again["state"] == "uploaded" and again["attempts"] == rec["attempts"]
        # uploaded is not committed: nothing lists it as a persistent version yet
        listed = c.request_json("GET", _persistent(location))["versions"]
        assert not [v for v in listed if v.get("committed")], listed
        # the scheduler's commit request: every region of the PTC, and the PTC itself (small metadata)
        ptc = {"config": {"dp": 1}, "note": "kept with the version"}
        with pytest.raises(NotFound, match="not committed"):
            c.request_json("GET", _persistent(location, V).replace("?", "/ptc?"))
        manifest = c.request_json("POST", _uploads(V, "/commit"), {"uri": location, "shards": shards, "ptc": ptc})
        assert manifest["committed"] and len(manifest["shards"]) == 3
        assert c.request_json("POST", _uploads(V, "/commit"), {"uri": location, "shards": shards}) == manifest
        listed = c.request_json("GET", _persistent(location))["versions"]
        assert [v["version"] for v in listed if v.get("committed")] == [V], listed
        assert c.request_json("GET", _persistent(location, V).replace("?", "/ptc?")) == ptc
        with pytest.raises(InvalidInput, match="'ptc' must be"):
            c.request_json("POST", _uploads(V, "/commit"), {"uri": location, "shards": shards, "ptc": "{}"})
        # the bytes there are the node's, bit for bit
        with PersistentStore(location) as p:
            for name, (_shape, dtype, regions) in TENSORS.items():
                for r in regions:
                    got = np.empty(r.shape, _data(name, r, dtype).dtype)
                    p.read_into(JOB, V, name, r, got)
                    assert got.tobytes() == _data(name, r, dtype).tobytes()
        # a conflicting request for the uploaded version (other shards) is refused, naming both
        with pytest.raises(Conflict, match="exists with other shards"):
            c.request_json("POST", _uploads(), {**body, "shards": shards[:1]})
        # the listing of this node's uploads
        assert [u["version"] for u in c.request_json("GET", _uploads())["uploads"]] == [V]
        # retention
        assert c.request_json("DELETE", _persistent(location, V))["deleted"] is True
        with pytest.raises(NotFound):
            c.request_json("GET", _persistent(location, V))
        with pytest.raises(NotFound):
            c.request_json("DELETE", _persistent(location, V))
        assert c.request_json("GET", _persistent(location))["versions"] == []


def test_many_small_shards_go_in_batches_and_a_resubmission_sends_only_what_is_missing(tmp_path: Path) -> None:
    location = (tmp_path / "ckpt").as_uri()
    with _node(tmp_path, batch_shards=4) as node, StoreClient(node.url, "tok") as c:
        shards = []
        for i in range(18):
            r = Region(((0, 4 + i), (0, 8)))
            node.store.write_shard(JOB, V, f"layers.{i}.w", r, _data(f"l{i}", r, "float32"), dtype="float32",
                                   global_shape=r.shape)
            shards.append([f"layers.{i}.w", r.format()])
        node.store.commit(JOB, V)
        body = {"version": V, "uri": location, "shards": shards}
        c.request_json("POST", _uploads(), body)
        assert _wait(c)["state"] == "uploaded"
        # three shards' metadata lost (a torn upload): they are not there; the others are, complete
        with PersistentStore(location) as p:
            keys = [p._skey(JOB, Version.parse(V), f"layers.{i}.w", Region(((0, 4 + i), (0, 8)))) for i in (0, 7, 17)]
        for key in keys:
            (tmp_path / "ckpt" / key / "zarr.json").unlink()
        with pytest.raises(Conflict, match="3 shards are not intact"):
            c.request_json("POST", _uploads(V, "/commit"), {"uri": location, "shards": shards})
        c.request_json("DELETE", _uploads(V))  # forget the record: the next submission is a new upload
        skipped_before = _metric(c, "tenplex_upload_skipped_bytes_total")
        c.request_json("POST", _uploads(), body)
        assert _wait(c)["state"] == "uploaded"
        sent_again = sum((4 + i) * 8 * 4 for i in (0, 7, 17))
        total = sum((4 + i) * 8 * 4 for i in range(18))
        assert _metric(c, "tenplex_upload_skipped_bytes_total") - skipped_before == total - sent_again
        manifest = c.request_json("POST", _uploads(V, "/commit"), {"uri": location, "shards": shards})
        assert manifest["committed"] and len(manifest["shards"]) == 18
        with PersistentStore(location) as p:
            for i in range(18):
                r = Region(((0, 4 + i), (0, 8)))
                got = np.empty(r.shape, np.float32)
                p.read_into(JOB, V, f"layers.{i}.w", r, got)
                assert got.tobytes() == _data(f"l{i}", r, "float32").tobytes()


def _metric(c: StoreClient, name: str) -> float:
    for line in c.metrics().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}")


def test_commit_refuses_a_missing_shard_naming_it(tmp_path: Path, location: str) -> None:
    with _node(tmp_path) as node, StoreClient(node.url, "tok") as c:
        shards = _fill(node.store)
        c.request_json("POST", _uploads(), {"version": V, "uri": location, "shards": shards[:2]})
        assert _wait(c)["state"] == "uploaded"
        with pytest.raises(Conflict) as info:
            c.request_json("POST", _uploads(V, "/commit"), {"uri": location, "shards": shards})
        assert "b 0:64" in str(info.value) and "not intact" in str(info.value), info.value
        listed = c.request_json("GET", _persistent(location))["versions"]
        assert not [v for v in listed if v.get("committed")], listed


def test_bad_requests_are_4xx_with_a_reason(tmp_path: Path) -> None:
    uri = (tmp_path / "ckpt").as_uri()
    with _node(tmp_path) as node, StoreClient(node.url, "tok", retries=0) as c:
        shards = _fill(node.store)
        node.store.write_shard(JOB, "s9-g0", "b", Region(((0, 64),)), np.zeros(64, np.uint16), dtype="bfloat16",
                               global_shape=(64,))
        cases: list[tuple[Any, type[Exception], str]] = [
            ({"version": V, "uri": uri}, InvalidInput, "needs 'shards'"),
            ({"version": V, "uri": "http://x/y", "shards": shards}, InvalidInput, "s3://bucket/prefix or file:///path"),
            ({"version": V, "uri": uri, "shards": [["w", "0:48"]]}, NotFound, "holds no shard exactly w 0:48"),
            ({"version": V, "uri": uri, "shards": [["w", "zero"]]}, InvalidInput, "start:stop"),
            ({"version": V, "uri": uri, "shards": shards, "extra": 1}, InvalidInput, "unknown fields"),
            ({"version": "s9-g0", "uri": uri, "shards": [["b", "0:64"]]}, Conflict, "not committed on this node"),
            ({"version": "nope", "uri": uri, "shards": shards}, InvalidInput, "version"),
        ]
        for body, error, text in cases:
            with pytest.raises(error, match=text):
                c.request_json("POST", _uploads(), body)
        with pytest.raises(InvalidInput, match="'shards' must be a non-empty list"):
            c.request_json("POST", _uploads(V, "/commit"), {"uri": uri, "shards": []})
        with pytest.raises(NotFound, match="no upload of s6-g0"):
            c.request_json("GET", _uploads(V))
        with pytest.raises(NotFound):
            c.request_json("DELETE", _persistent(uri, V))
        assert c.request_json("GET", _uploads())["uploads"] == []


def test_an_unreachable_object_store_is_retried_until_it_is_back(tmp_path: Path, moto: MotoS3,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in moto.env.items():
        monkeypatch.setenv(k, v)
    uri = f"s3://{BUCKET}/outage"
    with _node(tmp_path, retry_for_s=120.0) as node, StoreClient(node.url, "tok") as c:
        shards = _fill(node.store)
        moto.stop()
        try:
            c.request_json("POST", _uploads(), {"version": V, "uri": uri, "shards": shards})
            deadline = time.monotonic() + 60
            while True:
                rec = c.request_json("GET", _uploads(V))
                if rec["attempts"] >= 2:
                    break
                assert time.monotonic() < deadline, rec
                time.sleep(0.1)
            assert rec["state"] == "running" and rec["last_error"] and rec["error_code"] == "store_unavailable", rec
            assert 'tenplex_uploads_active{state="running"} 1.0' in _metrics_text(node.url)
        finally:
            moto.start()  # the same port: the store is back, with its objects
        rec = _wait(c, timeout=90)
        assert rec["state"] == "uploaded" and rec["attempts"] >= 2 and rec["bytes_done"] == rec["bytes_total"], rec
        c.request_json("POST", _uploads(V, "/commit"), {"uri": uri, "shards": shards})
        text = _metrics_text(node.url)
    assert 'tenplex_uploads_total{outcome="uploaded"} 1.0' in text
    assert "tenplex_upload_retries_total" in text and "tenplex_upload_bytes_total" in text
    assert 'tenplex_uploads_active{state="running"} 0.0' in text and 'tenplex_uploads_active{state="queued"} 0.0' in text


def _metrics_text(url: str) -> str:
    import urllib.request

    req = urllib.request.Request(url + "/metrics", headers={"Authorization": "Bearer tok"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def _start_daemon(root: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    port_file = root.parent / f"{root.name}.port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tenplex", "--log-level", "WARNING", "store", "serve", "--root", str(root),
         "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file), *extra],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**(env if env is not None else os.environ), "TENPLEX_TOKEN": "tok"},
    )
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port_file.read_text().strip()}"


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_a_daemon_killed_mid_upload_leaves_no_persistent_version_and_a_resubmission_finishes(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    root = tmp_path / "node"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    flags: tuple[str, ...] = ()
    options = None
    if backend == "file":
        uri = (tmp_path / "ckpt").as_uri()
    else:  # the endpoint as the daemon's flag (the chart's store.persistent.endpoint), credentials in its env
        moto = request.getfixturevalue("moto")
        uri, options = f"s3://{BUCKET}/torn", moto.options
        env.update(AWS_ACCESS_KEY_ID=moto.options["access_key_id"], AWS_SECRET_ACCESS_KEY=moto.options["secret_access_key"])
        flags = ("--s3-endpoint", moto.endpoint, "--s3-region", moto.options["region"])
    store = LocalStore(root, durable=False)
    shards = []
    for i in range(300):  # many small shards, one at a time: the kill lands between them
        r = Region(((i * 64, (i + 1) * 64),))
        store.write_shard(JOB, V, "emb", r, np.full(64, i, np.float32),
                          dtype="float32", global_shape=(300 * 64,))
        shards.append(["emb", r.format()])
    store.commit(JOB, V)
    store.close()
    proc, url = _start_daemon(root, "--upload-concurrency", "1", *flags, env=env)
    try:
        with StoreClient(url, "tok", retries=0, timeout=10) as c:
            c.request_json("POST", _uploads(), {"version": V, "uri": uri, "shards": shards})
            while (rec := c.request_json("GET", _uploads(V)))["shards_done"] < 5:
                assert rec["state"] in ("queued", "running"), rec
                time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert rec["shards_done"] < len(shards), "the upload finished before the kill: make it longer"
        # torn: some shards are there, no commit marker; nothing lists it as a persistent version
        with PersistentStore(uri, options=options) as p:
            assert [v for v in p.versions(JOB) if v.committed] == []
            with pytest.raises(NotFound):
                p.read_into(JOB, V, "emb", Region(((0, 64),)), np.empty(64, np.float32))
        proc, url = _start_daemon(root, "--upload-concurrency", "4", *flags, env=env)
        with StoreClient(url, "tok", retries=1, timeout=10) as c:
            rec = c.request_json("GET", _uploads(V))
            assert rec["state"] == "interrupted" and "stopped" in rec["error"], rec
            with pytest.raises(Conflict, match="not intact"):
                c.request_json("POST", _uploads(V, "/commit"), {"uri": uri, "shards": shards})
            # the scheduler's next attempt resubmits: what is there with its checksum is not uploaded again
            c.request_json("POST", _uploads(), {"version": V, "uri": uri, "shards": shards})
            rec = _wait(c, timeout=120)
            assert rec["state"] == "uploaded", rec
            c.request_json("POST", _uploads(V, "/commit"), {"uri": uri, "shards": shards})
            metrics = _metrics_text(url)
        skipped = float(next(line.split()[-1] for line in metrics.splitlines()
                             if line.startswith("tenplex_upload_skipped_bytes_total")))
        assert skipped >= 5 * 64 * 4, metrics
        with PersistentStore(uri, options=options) as p:
            got = np.empty(64, np.float32)
            p.read_into(JOB, V, "emb", Region(((64 * 7, 64 * 8),)), got)
            assert (got == 7).all()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_the_daemons_persist_a_version_and_a_reconfiguration_reads_the_lost_regions_back(
    cluster, location: str
) -> None:
    """The whole daemon side: each holder uploads its regions (each once), one commits, a host dies, and the
    new hosts' daemons take what no survivor holds from the persistent location (opened with open_store, the
    daemons' own AWS environment for s3://), bit for bit."""
    from tenplex.ptc import ParallelConfig
    from tenplex.scheduler.persist import assign_uploads
    from tenplex.transformer.plan import CHECKPOINT, make_plan

    from .conftest import check_new_state, populate, random_state, transform_on_daemons
    from .test_transform_e2e import layout

    old_v, new_v = "s7-g0", "s7-g1"
    old = layout(ParallelConfig(tp=2, pp=2), 2, ["h0", "h1"], "bf16")  # no replicas: h1 holds stage 1 alone
    new = layout(ParallelConfig(dp=2, tp=2), 2, ["h2", "h3"], "bf16")
    state = random_state(old, seed=21)
    populate(cluster, old, state, "lost", old_v)
    parts = assign_uploads(old, ["h0", "h1"])
    assert sorted(parts) == ["h0", "h1"]
    for host, shards in parts.items():
        cluster.clients[host].request_json("POST", "/v1/jobs/lost/uploads",
                                           {"version": old_v, "uri": location, "shards": [list(s) for s in shards]})
    for host in parts:
        deadline = time.monotonic() + 60
        while (rec := cluster.clients[host].request_json("GET", f"/v1/jobs/lost/uploads/{old_v}"))["state"] != "uploaded":
            assert rec["state"] in ("queued", "running") and time.monotonic() < deadline, rec
            time.sleep(0.05)
    expected = [[t.name, s.region.format()] for t in old.tensors for s in t.shards]
    cluster.clients["h0"].request_json("POST", f"/v1/jobs/lost/uploads/{old_v}/commit",
                                       {"uri": location, "shards": expected})
    cluster.stop("h1")
    plan = make_plan(old, new, job="lost", old_version=old_v, new_version=new_v, alive={"h0", "h2", "h3"},
                     checkpoint=location)
    from_ckpt = sum(t.nbytes for hp in plan.hosts.values() for t in hp.transfers if t.source == CHECKPOINT)
    assert from_ckpt > 0
    reports = transform_on_daemons(cluster, plan, hosts=["h0", "h2", "h3"])
    assert sum(r.bytes_checkpoint for r in reports.values()) == from_ckpt
    check_new_state(cluster, new, state, "lost", new_v)

    # A copy of the job under another name, from the persistent version alone: every piece is read from the
    # checkpoint under the original job's prefix, none from a node (they hold "lost", not "copy").
    with pytest.raises(InvalidInput, match="reads only the checkpoint"):
        make_plan(old, new, job="copy", old_version=old_v, new_version=new_v, holders={"h0": old_v},
                  checkpoint=location, old_job="lost")
    with pytest.raises(InvalidInput, match="needs the checkpoint"):
        make_plan(old, new, job="copy", old_version=old_v, new_version=new_v, holders={}, old_job="lost")
    copy = make_plan(old, new, job="copy", old_version=old_v, new_version=new_v, holders={}, alive={"h2", "h3"},
                     checkpoint=location, old_job="lost")
    assert copy.source_job == "lost" and copy.to_json()["old_job"] == "lost"
    assert all(t.source == CHECKPOINT for hp in copy.hosts.values() for t in hp.transfers if t.nbytes)
    reports = transform_on_daemons(cluster, copy, hosts=["h2", "h3"])
    assert sum(r.bytes_checkpoint for r in reports.values()) == copy.network_bytes > 0
    check_new_state(cluster, new, state, "copy", new_v)


def test_an_upload_gives_up_once_its_retry_time_is_spent(tmp_path: Path) -> None:
    """A location that cannot be written (below a file): attempts until the next would start after
    ``retry_for_s``, then ``failed`` with the last error and how long it tried."""
    (tmp_path / "a-file").write_text("not a directory")
    uri = (tmp_path / "a-file" / "ckpt").as_uri()
    with _node(tmp_path, retry_for_s=0.5) as node, StoreClient(node.url, "tok") as c:
        c.request_json("POST", _uploads(), {"version": V, "uri": uri, "shards": _fill(node.store)})
        rec = _wait(c)
        text = _metrics_text(node.url)
    assert rec["state"] == "failed" and rec["attempts"] == 2 and rec["error_code"], rec
    assert "gave up after 2 attempts" in rec["error"], rec
    assert 'tenplex_uploads_total{outcome="failed"} 1.0' in text
