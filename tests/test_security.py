"""Tenancy and transport security: job-scoped credentials on the daemons and the scheduler, signed transform grants,
key rotation, TLS verification, and hostile input under a job's credential.

Real parts throughout: node daemons (uvicorn in threads) on 127.0.0.2..4 with a key set and an admin token, the
local scheduler with its own daemon process, credentials signed by the scheduler's issuer (PyJWT), certificates
made by a throwaway CA.
"""

from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import jwt
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tenplex.core import auth
from tenplex.core.auth import Issuer, KeySet
from tenplex.core.tls import ENV_TLS_CA, ServerTLS
from tenplex.errors import Forbidden, StoreUnavailable, TenplexError, Unauthorized
from tenplex.node.daemon import NodeDaemon
from tenplex.ptc import ParallelConfig
from tenplex.ptc.region import Region
from tenplex.scheduler.api import create_app
from tenplex.scheduler.cli import SchedulerClient
from tenplex.scheduler.server import AUTH_KEYS_FILE, LocalScheduler
from tenplex.serving import BackgroundServer
from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore
from tenplex.testing.tls import make_certificates
from tenplex.transformer.plan import make_plan
from tenplex.transformer.remote import PlanRun, TransformRequest, transforms_path
from tests.transformer.conftest import random_state
from tests.transformer.test_transform_e2e import layout

ADMIN = "admin-s3cret"
HOSTS = {"h0": "127.0.0.2", "h1": "127.0.0.3"}
SHAPE = (8, 6)
V1 = "s1-g0"
FULL = Region.full(SHAPE)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> KeySet:
    return KeySet.generate(tmp_path_factory.mktemp("keys") / "keys.json")


@pytest.fixture(scope="module")
def issuer(keys: KeySet) -> Issuer:
    return Issuer(keys)


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory, keys: KeySet) -> Iterator[dict[str, NodeDaemon]]:
    """Two nodes; each holds committed version s1-g0 of jobs 'a' and 'b' (tensor 'w')."""
    root = tmp_path_factory.mktemp("nodes")
    out: dict[str, NodeDaemon] = {}
    try:
        for host, address in HOSTS.items():
            d = out[host] = NodeDaemon(root / host, host=address, token=ADMIN, auth_keys=keys.path,
                                       store=LocalStore(root / host, durable=False)).start()
            for i, job in enumerate(("a", "b")):
                d.store.write_shard(job, V1, "w", Region.full(SHAPE), np.full(SHAPE, i + 1, np.float32),
                                    dtype="float32", global_shape=SHAPE)
                d.store.commit(job, V1)
        yield out
    finally:
        for d in out.values():
            d.stop()


def _raw(url: str, method: str, path: str, token: str | None, body: bytes | None = None) -> tuple[int, dict]:
    host, port = url.split("//")[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    if body is not None:
        headers["Content-Type"] = "application/json"
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data) if data else {}


def _state_of(daemons: dict[str, NodeDaemon], job: str) -> dict[str, object]:
    """Everything a node holds of ``job``: its versions and the manifest and bytes of each (for 'nothing changed')."""
    out: dict[str, object] = {}
    for host, d in daemons.items():
        for vi in d.store.versions(job):
            m = d.store.manifest(job, vi.version)
            out[f"{host}/{vi.version}"] = (vi.committed, json.dumps(m.to_json(), sort_keys=True),
                                           d.store.read(job, vi.version, "w", FULL, "float32").tobytes() if vi.committed else b"")
    return out


# -- the daemons ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_a_worker_of_job_a_gets_403_on_job_b_on_its_own_and_a_peers_daemon(daemons, issuer, host) -> None:
    before = _state_of(daemons, "b")
    cred = issuer.worker("a")
    with StoreClient(daemons[host].url, cred, retries=0) as c:
        for call in (lambda: c.read("b", V1, "w", FULL, "float32"), lambda: c.manifest("b", V1), lambda: c.versions("b"),
                     lambda: c.write_shard("b", "s2-g0", "w", Region.full(SHAPE), np.zeros(SHAPE, np.float32),
                                           dtype="float32", global_shape=SHAPE),
                     lambda: c.commit("b", V1), lambda: c.delete("b", V1), lambda: c.delete("a", V1),
                     lambda: c.link_shard("b", V1, "w", FULL, "s2-g0"), lambda: c.place("b", "s2-g0", 8), lambda: c.metrics(),
                     lambda: c.request_json("GET", transforms_path("a", "s2-g1")),
                     lambda: c.request_json("GET", "/v1/jobs/b/uploads"),
                     lambda: c.request_json("GET", "/v1/jobs/a/uploads")):
            with pytest.raises(Forbidden):
                call()
        # its own job: read, write a new version, commit; the job list shows it alone
        assert (c.read("a", V1, "w", FULL, "float32") == 1).all()
        assert c.jobs() == ["a"]
    status, body = _raw(daemons[host].url, "GET", f"/v1/jobs/b/versions/{V1}/tensors/w", cred)
    assert status == 403 and body["error"] == "forbidden" and "job 'b'" in body["detail"]
    assert _state_of(daemons, "b") == before


def test_a_worker_writes_and_commits_its_own_jobs_versions(daemons, issuer) -> None:
    with StoreClient(daemons["h0"].url, issuer.worker("a"), retries=0) as c:
        c.write_shard("a", "s5-g0", "w", Region.full(SHAPE), np.full(SHAPE, 5, np.float32), dtype="float32",
                      global_shape=SHAPE)
        c.commit("a", "s5-g0")
        assert (c.read("a", "s5-g0", "w", FULL, "float32") == 5).all()
        assert c.place("a", "s6-g0", 8) is False  # a reservation (this daemon has no memory tier: disk)
    with StoreClient(daemons["h0"].url, issuer.grant("a"), retries=0) as reader:
        with pytest.raises(Forbidden):
            reader.write_shard("a", "s6-g0", "w", Region.full(SHAPE), np.zeros(SHAPE, np.float32), dtype="float32",
                               global_shape=SHAPE)  # a transform's grant only reads
        with pytest.raises(Forbidden):
            reader.place("a", "s6-g0", 8)
    daemons["h0"].store.delete("a", "s5-g0")


def test_forged_expired_and_garbage_credentials_get_401_with_a_clear_body(daemons, issuer, keys) -> None:
    claims = {"iss": auth.ISSUER, "aud": auth.AUDIENCE, "iat": int(time.time()), "exp": int(time.time()) + 600,
              "role": "admin"}
    kid, _key = keys.active()
    forged = jwt.encode(claims, "x" * 48, algorithm="HS256", headers={"kid": kid})
    unknown_kid = jwt.encode(claims, "x" * 48, algorithm="HS256", headers={"kid": "nope"})
    unsigned = jwt.encode(claims, None, algorithm="none", headers={"kid": kid})
    expired = issuer.mint("worker", "a", ttl_s=-(auth.LEEWAY_S + 60))
    tampered = issuer.worker("a").rsplit(".", 1)[0] + "." + issuer.worker("b").rsplit(".", 1)[1]
    for token, says in ((forged, "does not verify"), (unknown_kid, "unknown key id"), (unsigned, "bad credential"),
                        (expired, "expired"), (tampered, "does not verify"), ("garbage", "wrong bearer"),
                        (None, "missing")):
        for d in daemons.values():
            status, body = _raw(d.url, "GET", f"/v1/jobs/a/versions/{V1}", token)
            assert status == 401 and body["error"] == "unauthorized" and says in body["detail"], (token, body)
    with StoreClient(daemons["h0"].url, expired, retries=0) as c, pytest.raises(Unauthorized):
        c.versions("a")


def test_keys_rotate_without_restarting_the_daemons(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "RELOAD_CHECK_S", 0.0)
    keys = KeySet.generate(tmp_path / "keys.json")
    old_kid, old_secret = keys.active()
    with NodeDaemon(tmp_path / "n", token=ADMIN, auth_keys=keys.path) as d:
        issuer = Issuer(KeySet(keys.path))
        old = issuer.worker("a")
        with StoreClient(d.url, old, retries=0) as c:
            assert c.jobs() == []
        # add a key and make it active: old and new credentials both verify
        (tmp_path / "keys.json").write_text(json.dumps({"active": "k-new", "keys": {
            old_kid: old_secret.decode(), "k-new": "n" * 40}}))
        new = issuer.worker("a")
        assert jwt.get_unverified_header(new)["kid"] == "k-new"
        for cred in (old, new):
            with StoreClient(d.url, cred, retries=0) as c:
                assert c.jobs() == []
        # retire the old key: what it signed is refused, the new credential goes on
        (tmp_path / "keys.json").write_text(json.dumps({"active": "k-new", "keys": {"k-new": "n" * 40}}))
        with StoreClient(d.url, old, retries=0) as c, pytest.raises(Unauthorized, match="unknown key id"):
            c.jobs()
        with StoreClient(d.url, new, retries=0) as c:
            assert c.jobs() == []
        # a broken file keeps the keys read before
        (tmp_path / "keys.json").write_text("{not json")
        with StoreClient(d.url, new, retries=0) as c:
            assert c.jobs() == []


# -- transforms: only the scheduler submits them; sources serve what its grant names ---------------------------------


@pytest.fixture
def transform_nodes(tmp_path: Path, keys: KeySet) -> Iterator[tuple[dict[str, NodeDaemon], object]]:
    old = layout(ParallelConfig(pp=2), 1, ["h0", "h1"], "fp32")  # one stage per node
    new = layout(ParallelConfig(pp=2), 2, ["h1"], "fp32")  # both on h1: it pulls h0's stage
    nodes = {h: NodeDaemon(tmp_path / h, host=a, token=ADMIN, auth_keys=keys.path,
                           store=LocalStore(tmp_path / h, durable=False)).start() for h, a in HOSTS.items()}
    try:
        state = random_state(old, seed=3)
        for host in old.hosts:
            for t, s in old.shards_on_host(host):
                nodes[host].store.write_shard("tj", "s3-g0", t.name, s.region, state[t.name][s.region.slices()].copy(),
                                              dtype=t.dtype, global_shape=t.shape)
            nodes[host].store.commit("tj", "s3-g0")
        yield nodes, make_plan(old, new, job="tj", old_version="s3-g0", new_version="s3-g1")
    finally:
        for d in nodes.values():
            d.stop()


def test_a_daemon_refuses_a_transform_not_submitted_by_the_scheduler(transform_nodes, issuer) -> None:
    nodes, plan = transform_nodes
    target = nodes["h1"]
    body = json.dumps(TransformRequest(host="h1", plan=plan.for_host("h1"), sources={"h0": nodes["h0"].url},
                                       token=issuer.grant("tj")).to_json()).encode()
    forged = jwt.encode({"iss": auth.ISSUER, "aud": auth.AUDIENCE, "iat": int(time.time()),
                         "exp": int(time.time()) + 60, "role": "admin"}, "f" * 48, algorithm="HS256",
                        headers={"kid": issuer.keys.active()[0]})
    for token, status in ((issuer.worker("tj"), 403), (issuer.grant("tj"), 403), (forged, 401), (None, 401)):
        got, answer = _raw(target.url, "POST", "/v1/jobs/tj/transforms", token, body)
        assert got == status, answer
    assert _raw(target.url, "GET", "/v1/jobs/tj/transforms", ADMIN)[1]["transforms"] == []
    assert [v.version for v in target.store.versions("tj")] == [plan.old_version]


def test_a_transform_reads_its_sources_with_the_scheduler_signed_grant_of_its_job(transform_nodes, issuer) -> None:
    nodes, plan = transform_nodes
    stores = {h: d.url for h, d in nodes.items()}

    def client_for(url: str) -> StoreClient:
        return StoreClient(url, ADMIN, retries=0)

    # a grant for another job: the source daemon refuses every read, the target commits nothing
    wrong = PlanRun(plan, stores, token=issuer.grant("other"), client_for=client_for)
    statuses = wrong.submit()
    deadline = time.monotonic() + 60
    while not all(s.finished for s in statuses.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
        statuses = wrong.poll()
    assert statuses["h1"].state == "failed" and "may not read job 'tj'" in statuses["h1"].error
    assert [v.version for v in nodes["h1"].store.versions("tj")] == [plan.old_version]
    with StoreClient(nodes["h1"].url, ADMIN) as admin:  # the failed record goes, so the plan may run again
        admin.request_json("DELETE", transforms_path("tj", str(plan.new_version)))
    # the scheduler's grant for the job: the transform runs and commits
    reports = PlanRun(plan, stores, token=issuer.grant("tj"), client_for=client_for).wait(poll_interval=0.05, timeout=60)
    assert reports["h1"].bytes_remote > 0
    assert any(v.committed and v.version == plan.new_version for v in nodes["h1"].store.versions("tj"))


# -- the scheduler ----------------------------------------------------------------------------------------------------

JOB = {
    "name": "a",
    "layout": {"provider": "megatron-gpt", "precision": "fp32",
               "model": {"num_layers": 2, "hidden": 32, "heads": 4, "vocab": 100, "seq_len": 16,
                         "make_vocab_size_divisible_by": 8}},
    "dataset": {"num_samples": 256, "seed": 0, "global_batch_size": 8},
    "command": ["python", "-c", "pass"],
    "gpus": 4, "min_gpus": 1, "max_gpus": 8,  # more GPUs than the host has: Pending, no process starts
}


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalScheduler]:
    sched = LocalScheduler(tmp_path_factory.mktemp("sched"), hosts=1, gpus_per_host=2, token=ADMIN).start()
    try:
        admin = SchedulerClient(sched.url, ADMIN)
        for name in ("a", "b"):
            admin.create({**JOB, "name": name})
        yield sched
    finally:
        sched.stop()


def _jobs(sched: LocalScheduler) -> dict[str, object]:
    return {c.spec.name: (c.status.phase, c.status.target_gpus, c.status.gpus) for c in sched.scheduler.list()}


def test_the_local_scheduler_makes_its_key_set_and_hands_its_daemons_the_same(scheduler) -> None:
    path = scheduler.state_dir / AUTH_KEYS_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    cred = Issuer(KeySet(path)).worker("a")
    host = scheduler.cluster.hosts()[0]
    with StoreClient(host.store_url, cred, retries=0) as c:
        assert c.jobs() == []  # the daemon verifies the scheduler's credentials
        with pytest.raises(Forbidden):
            c.versions("b")


def test_a_job_credential_reaches_only_its_own_jobs_routes_on_the_scheduler(scheduler) -> None:
    before = _jobs(scheduler)
    cred = Issuer(KeySet(scheduler.state_dir / AUTH_KEYS_FILE)).worker("a")
    worker = "b-g0-r0"
    refused = [
        ("GET", "/v1/jobs/b", None), ("GET", "/v1/jobs/b/plan", None), ("GET", "/v1/jobs/b/ptc", None),
        ("POST", "/v1/jobs/b/events", {"kind": "peer_failure"}),
        ("POST", "/v1/jobs/b/workers/register", {"worker_id": worker}),
        ("GET", f"/v1/jobs/b/workers/{worker}/assignment", None),
        ("POST", f"/v1/jobs/b/workers/{worker}/peer-failure", {"detail": "x"}),
        ("POST", f"/v1/jobs/b/workers/{worker}/heartbeat", {"step": 1}),
        ("POST", f"/v1/jobs/b/workers/{worker}/snapshot", {"version": "s1-g0"}),
        ("POST", f"/v1/jobs/b/workers/{worker}/exit", {"code": 0}),
        ("GET", "/v1/jobs", None), ("POST", "/v1/jobs", {**JOB, "name": "c"}), ("DELETE", "/v1/jobs/a", None),
        ("DELETE", "/v1/jobs/b", None), ("POST", "/v1/jobs/a/scale", {"gpus": 1}), ("GET", "/v1/hosts", None),
        ("GET", "/metrics", None), ("POST", "/v1/jobs/a/events", {"kind": "cordon", "host": "host-0"}),
    ]
    for method, path, body in refused:
        status, answer = _raw(scheduler.url, method, path, cred, json.dumps(body).encode() if body else None)
        assert status == 403 and answer["error"] == "forbidden" and answer["detail"], (method, path, answer)
    # its own job's routes answer
    client = SchedulerClient(scheduler.url, cred)
    assert client.job("a")["status"]["phase"] == "Pending"
    assert _raw(scheduler.url, "GET", "/v1/jobs/a/plan", cred)[0] in (200, 404)
    for token, says in (("x.y.z", "bad credential"), (Issuer(KeySet.generate(scheduler.state_dir / "other.json"))
                                                      .worker("a"), "unknown key id"), (None, "missing")):
        status, answer = _raw(scheduler.url, "GET", "/v1/jobs/a", token)
        assert status == 401 and answer["error"] == "unauthorized" and says in answer["detail"], answer
        status, answer = _raw(scheduler.url, "POST", "/v1/jobs/a/workers/a-g0-r0/heartbeat", token, b'{"step": 1}')
        assert status == 401 and answer["error"] == "unauthorized", answer
    assert _jobs(scheduler) == before
    assert SchedulerClient(scheduler.url, ADMIN).request("GET", "/v1/hosts")  # the operator's credential reaches it
    # a reader credential of job a: its GET routes only
    reader = Issuer(KeySet(scheduler.state_dir / AUTH_KEYS_FILE)).grant("a")
    assert _raw(scheduler.url, "GET", "/v1/jobs/a", reader)[0] == 200
    for method, path, body in (("GET", "/v1/jobs/b", None), ("POST", "/v1/jobs/a/events", {"kind": "peer_failure"}),
                               ("POST", "/v1/jobs/a/workers/a-g0-r0/heartbeat", {"step": 1})):
        assert _raw(scheduler.url, method, path, reader, json.dumps(body).encode() if body else None)[0] == 403
    assert _jobs(scheduler) == before


def test_hostile_input_under_a_job_credential_changes_nothing_outside_the_job(scheduler, daemons, issuer) -> None:
    """schemathesis over the daemon's and the scheduler's published operations with job a's credential: no 5xx,
    and job b's state (on both nodes) and every job record of the scheduler stay as they were."""
    before_b, before_jobs = _state_of(daemons, "b"), _jobs(scheduler)
    sched_cred = Issuer(KeySet(scheduler.state_dir / AUTH_KEYS_FILE)).worker("a")
    targets = [(daemons["h0"].url, issuer.worker("a"), 3), (scheduler.url, sched_cred, 2)]
    for base, cred, examples in targets:
        schema = schemathesis.openapi.from_url(base + "/openapi.json")
        for op in (result.ok() for result in schema.get_all_operations()):
            _fuzz(op, base, cred, examples)
    assert _state_of(daemons, "b") == before_b
    assert set(daemons["h0"].store.jobs()) <= {"a", "b"} and set(daemons["h1"].store.jobs()) <= {"a", "b"}
    assert _jobs(scheduler) == before_jobs


def _fuzz(op, base: str, cred: str, examples: int) -> None:
    @given(case=op.as_strategy())
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        case.call_and_validate(base_url=base, headers={"Authorization": f"Bearer {cred}"}, checks=[not_a_server_error])

    check()


# -- TLS --------------------------------------------------------------------------------------------------------------


def test_tls_daemon_and_scheduler_verify_against_the_configured_ca(tmp_path: Path, scheduler,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    good = make_certificates(tmp_path / "good")
    wrong = make_certificates(tmp_path / "wrong")
    tls = ServerTLS(str(good.cert), str(good.key))
    data = np.arange(64 * 1024, dtype=np.float32).reshape(256, 256)  # 256 KiB: one region body, read back exactly
    with NodeDaemon(tmp_path / "n", token=ADMIN, tls=tls) as d:
        assert d.url.startswith("https://")
        monkeypatch.setenv(ENV_TLS_CA, str(good.ca))
        with StoreClient(d.url, ADMIN, retries=0) as c:
            c.write_shard("t", V1, "w", Region.full(data.shape), data, dtype="float32", global_shape=data.shape)
            c.commit("t", V1)
            assert np.array_equal(c.read("t", V1, "w", Region.full(data.shape), "float32"), data)
        monkeypatch.setenv(ENV_TLS_CA, str(wrong.ca))
        with StoreClient(d.url, ADMIN, retries=3) as c, pytest.raises(StoreUnavailable, match="TLS handshake"):
            c.versions("t")
        status = http.client.HTTPConnection("127.0.0.1", d.port, timeout=10)
        status.request("GET", "/healthz")  # plain HTTP to a TLS port: no answer in clear text
        with pytest.raises((http.client.HTTPException, OSError)):
            status.getresponse().read()
    with BackgroundServer(create_app(scheduler.scheduler, token=ADMIN), tls=tls) as server:
        monkeypatch.setenv(ENV_TLS_CA, str(good.ca))
        assert SchedulerClient(server.url, ADMIN).job("a")["status"]["phase"] == "Pending"
        monkeypatch.setenv(ENV_TLS_CA, str(wrong.ca))
        with pytest.raises((TenplexError, OSError), match="CERTIFICATE_VERIFY_FAILED"):
            SchedulerClient(server.url, ADMIN, timeout=10).job("a")
    assert os.environ[ENV_TLS_CA] == str(wrong.ca)


def test_tenplex_auth_rotates_retires_and_hands_out_a_jobs_reader_credential(daemons, keys, tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from tenplex.cli import main

    path = tmp_path / "keys.json"
    assert main(["auth", "new-keys", str(path)]) == 0
    first = json.loads(path.read_text())["active"]
    assert main(["auth", "rotate", str(path)]) == 0
    rotated = json.loads(path.read_text())
    assert rotated["active"] != first and set(rotated["keys"]) == {first, rotated["active"]}
    assert path.stat().st_mode & 0o777 == 0o600
    assert main(["auth", "retire", str(path), rotated["active"]]) == 1  # not the active key
    assert main(["auth", "retire", str(path), first]) == 0
    assert set(json.loads(path.read_text())["keys"]) == {rotated["active"]}
    assert main(["auth", "token", "--keys", str(path), "--role", "admin", "--job", "a"]) == 1
    capsys.readouterr()
    # a reader credential for job a, signed with the daemons' key set: lists a's versions, nothing of b's
    assert main(["auth", "token", "--keys", str(keys.path), "--role", "reader", "--job", "a", "--ttl", "10m"]) == 0
    cred = capsys.readouterr().out.strip()
    assert main(["store", "ls", daemons["h0"].url, "a", "--token", cred]) == 0
    assert V1 in capsys.readouterr().out
    assert main(["store", "ls", daemons["h0"].url, "b", "--token", cred]) == 1
    assert "forbidden" in capsys.readouterr().err
