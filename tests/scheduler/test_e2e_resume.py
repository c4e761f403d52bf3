"""A new job started from a persistent version (``resume_from``), end to end on the local backend.

Real processes throughout, as in :mod:`tests.scheduler.test_e2e_persistent`: the scheduler's REST API, one
store daemon per emulated host, the reference GPT job as gloo workers. Job ``orig`` (dp=2) persists versions
to an S3 bucket (moto) and is deleted; job ``copy`` (dp=1, another name) is created
from one of those versions: it starts at that version's step and data position, its state comes from the
persistent tier only (read under ``orig``'s prefix by the daemons; the workers verify every checksum), equal
to what was saved, and it trains on to the end. Bad ``resume_from`` inputs fail the job (or are refused) with
a message naming what is wrong.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tenplex.core.version import Version
from tenplex.errors import InvalidInput, NotFound
from tenplex.ptc.dtypes import storage_dtype
from tenplex.scheduler.cli import SchedulerClient
from tenplex.scheduler.server import LocalScheduler
from tenplex.store.client import StoreClient
from tenplex.store.persistent import PersistentStore
from tests.moto_s3 import MotoS3

from .test_e2e_local import job, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

INTERVAL = 6
BUCKET = "tenplex-resume"
STEPS = 24


@pytest.fixture
def moto(monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoS3]:
    server = MotoS3().start()
    server.create_bucket(BUCKET)
    for k, v in server.env.items():  # the daemons (children of this process) inherit it
        monkeypatch.setenv(k, v)
    try:
        yield server
    finally:
        server.stop()


def _failed(client: SchedulerClient, name: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    st: dict = {}
    while time.monotonic() < deadline:
        st = client.job(name)["status"]
        if st["phase"] == "Failed":
            return st
        assert st["phase"] in ("Pending", "Reconfiguring"), st  # never trains from step 0 instead
        time.sleep(0.2)
    raise AssertionError(f"{name} did not fail: {st}")


def _versions(client: StoreClient, job: str) -> list:
    """The job's versions on a node store (none where it never ran)."""
    try:
        return client.versions(job)
    except NotFound:
        return []


def _assert_equal_to_saved(sched: LocalScheduler, job: str, version: str, uri: str, source_job: str,
                           source_version: str, options: dict | None) -> int:
    """Every shard of ``job``'s ``version`` on its node stores equals the same region of the saved version;
    the number of bytes compared."""
    compared = 0
    with PersistentStore(uri, options=options) as saved:
        for h in sched.cluster.describe():
            client = StoreClient(str(h["store_url"]), None)
            try:
                try:
                    infos = {str(v.version): v.committed for v in client.versions(job)}
                except NotFound:  # the job never ran on this host
                    continue
                if version not in infos:
                    continue
                assert infos[version], (h["name"], infos)
                for shard in client.manifest(job, version).shards:
                    shape = shard.region.shape
                    dt = storage_dtype(shard.dtype)
                    ours, theirs = np.empty(shape, dt), np.empty(shape, dt)
                    client.read_into(job, version, shard.tensor, shard.region, ours)
                    saved.read_into(source_job, source_version, shard.tensor, shard.region, theirs)
                    assert ours.tobytes() == theirs.tobytes(), (shard.tensor, shard.region)
                    compared += shard.nbytes
            finally:
                client.close()
    return compared


# On S3 (moto) here; losing a host (test_e2e_persistent.py) runs on file://. The persistent store's conformance
# suite (tests/store/test_persistent.py) runs every operation on both backends.
def test_a_copy_of_a_job_resumes_from_its_persistent_version_in_another_layout(tmp_path: Path, moto: MotoS3) -> None:
    options = moto.options
    uri = f"s3://{BUCKET}/jobs"
    with LocalScheduler(tmp_path / "sched", hosts=2, gpus_per_host=1, heartbeat_interval=0.3) as sched:
        client = SchedulerClient(sched.url)
        orig = job("orig", gpus=2, steps=200)
        orig["policy"] = {"table": {"2": {"dp": 2, "tp": 1, "pp": 1}}}
        orig["checkpoint"] = {"uri": uri, "interval_steps": INTERVAL, "keep_last": 5}
        client.create(orig)
        st = wait_for(client, "orig", lambda s: bool(s.get("persisted")), "persisting a version", timeout=300)
        client.delete("orig")  # its workers stop; the persistent versions stay
        saved = st["persisted"][-1]
        step = Version.parse(saved).step
        assert step >= INTERVAL

        # The same model in another layout, under another name: from orig's version, dp1 on one GPU.
        copy = job("copy", gpus=1, steps=STEPS)
        copy["resume_from"] = {"uri": uri, "job": "orig", "version": saved}
        client.create(copy)
        st = wait_for(client, "copy", lambda s: s["phase"] == "Succeeded", "resuming and training to the end",
                      timeout=300)
        assert st["step"] == STEPS, st
        assert st["resumed_from"] == {"uri": uri, "job": "orig", "version": saved, "step": step,
                                      "consumed_samples": step * 8}, st["resumed_from"]
        [rec] = st["history"]
        assert rec["reason"] == "resume" and rec["error"] is None, rec
        assert rec["version_from"] == saved and rec["source"] == f"{uri} (job orig)", rec
        assert rec["from_config"].startswith("dp2") and rec["to_config"].startswith("dp1"), rec
        assert Version.parse(rec["version_to"]).step == step, rec
        # Every byte came from the checkpoint, over the network: the lower bound is the whole state.
        assert rec["bytes_remote"] == rec["lower_bound_bytes"] > 0 and rec["bytes_local"] == 0, rec
        assert rec["downtime_seconds"] is not None, rec
        # The restored version holds exactly what orig saved.
        compared = _assert_equal_to_saved(sched, "copy", rec["version_to"], uri, "orig", saved, options)
        assert compared == rec["bytes_remote"], (compared, rec)
        # It went on from there: its own versions are all at or after that step, none from step 0.
        mine = [Version.parse(v) for v in st["committed"]]
        assert mine and min(v.step for v in mine) >= step, st["committed"]

        # "latest" resolves to the newest committed version; under the job's own name by default.
        again = job("orig", gpus=1, steps=step + 3)
        again["resume_from"] = {"uri": uri}
        client.create(again)
        st = wait_for(client, "orig", lambda s: s["phase"] == "Succeeded", "resuming orig from latest", timeout=300)
        with PersistentStore(uri, options=options) as p:
            latest = [str(v.version) for v in p.versions("orig") if v.committed][-1]
        assert st["resumed_from"]["version"] == latest and st["step"] == step + 3, st


def test_resume_from_errors_name_what_is_wrong(tmp_path: Path) -> None:
    uri = (tmp_path / "persistent").as_uri()
    with LocalScheduler(tmp_path / "sched", hosts=2, gpus_per_host=1, heartbeat_interval=0.3) as sched:
        client = SchedulerClient(sched.url)
        # Refused up front: malformed resume_from bodies.
        for bad, says in (({"uri": "http://x/y"}, "uri"), ({"uri": uri, "version": "step-3"}, "version"),
                          ({"uri": uri, "job": "Not_A_Name"}, "job"), ({"uri": uri, "extra": 1}, "extra"),
                          ({"version": "latest"}, "uri")):
            spec = job("bad", gpus=1, steps=10)
            spec["resume_from"] = bad
            with pytest.raises(InvalidInput) as err:  # a 400
                client.create(spec)
            assert says in err.value.detail, (bad, err.value.detail)

        # Nothing at the location yet.
        spec = job("nothing", gpus=1, steps=10)
        spec["resume_from"] = {"uri": uri, "job": "orig"}
        client.create(spec)
        st = _failed(client, "nothing")
        assert st["message"].startswith(f"cannot resume from latest of job 'orig' at {uri}: job 'orig' is not at {uri}"), \
            st["message"]
        assert st["workers"] == [] and st["history"] == [], st

        orig = job("orig", gpus=1, steps=200)
        orig["checkpoint"] = {"uri": uri, "interval_steps": INTERVAL, "keep_last": 5}
        client.create(orig)
        st = wait_for(client, "orig", lambda s: bool(s.get("persisted")), "persisting a version", timeout=300)
        client.delete("orig")
        saved = st["persisted"][-1]

        # A version that is not there.
        spec = job("missing", gpus=1, steps=10)
        spec["resume_from"] = {"uri": uri, "job": "orig", "version": "s99999-g0"}
        client.create(spec)
        st = _failed(client, "missing")
        assert "version s99999-g0 of job 'orig'" in st["message"] and "is not there" in st["message"], st["message"]
        assert saved in st["message"], st["message"]  # the committed versions it could have used

        # A version that is there but not committed (a torn or running upload: its objects, no marker).
        torn = Version(Version.parse(saved).step + 1, 0)
        shutil.copytree(tmp_path / "persistent" / "orig" / saved, tmp_path / "persistent" / "orig" / str(torn))
        spec = job("torn", gpus=1, steps=10)
        spec["resume_from"] = {"uri": uri, "job": "orig", "version": str(torn)}
        client.create(spec)
        st = _failed(client, "torn")
        assert f"version {torn} of job 'orig'" in st["message"] and "is there but not committed" in st["message"], \
            st["message"]
        # "latest" is the newest committed one, not the torn one.
        spec = job("fromlatest", gpus=1, steps=Version.parse(saved).step + 1)
        spec["resume_from"] = {"uri": uri, "job": "orig"}
        client.create(spec)
        st = wait_for(client, "fromlatest", lambda s: s["phase"] == "Succeeded", "resuming from latest")
        assert st["resumed_from"]["version"] == saved, st["resumed_from"]

        # A damaged copy (one chunk's bytes changed after the commit): the daemons' checksums catch it, the job
        # fails naming the transfer's error, and nothing of it is committed on the nodes.
        shutil.copytree(tmp_path / "persistent" / "orig", tmp_path / "persistent" / "dmg",
                        ignore=shutil.ignore_patterns(str(torn)))
        chunks = [f for f in (tmp_path / "persistent" / "dmg" / saved).rglob("*") if f.is_file()
                  and f.name != "zarr.json"]
        victim = max(chunks, key=lambda f: f.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        spec = job("damaged", gpus=1, steps=10 + Version.parse(saved).step)
        spec["resume_from"] = {"uri": uri, "job": "dmg", "version": saved}
        client.create(spec)
        st = _failed(client, "damaged", timeout=180)
        assert st["message"].startswith("transfer failed:"), st["message"]
        assert "checksum" in st["message"].lower() or "crc" in st["message"].lower(), st["message"]
        [rec] = st["history"]
        assert rec["reason"] == "resume" and rec["error"] == st["message"], rec
        for h in sched.cluster.describe():
            with StoreClient(str(h["store_url"]), None) as c:
                assert not [v for v in _versions(c, "damaged") if v.committed], h["name"]

        # A model that does not match the saved state (another width): refused before anything runs.
        spec = job("wrong", gpus=1, steps=10)
        spec["layout"]["model"] = {**spec["layout"]["model"], "dim": 48}
        spec["resume_from"] = {"uri": uri, "job": "orig", "version": saved}
        client.create(spec)
        st = _failed(client, "wrong")
        assert "does not match the saved state" in st["message"] and "saved [" in st["message"], st["message"]
        assert st["workers"] == [] and st["history"] == [], st

        # Nothing left to train.
        spec = job("done", gpus=1, steps=Version.parse(saved).step)
        spec["resume_from"] = {"uri": uri, "job": "orig", "version": saved}
        client.create(spec)
        st = _failed(client, "done")
        assert f"must go past the version's step {Version.parse(saved).step}" in st["message"], st["message"]

        # Another dataset: the data position would name other samples.
        spec = job("otherdata", gpus=1, steps=10)
        spec["dataset"] = {**spec["dataset"], "seed": 7}
        spec["resume_from"] = {"uri": uri, "job": "orig", "version": saved}
        client.create(spec)
        st = _failed(client, "otherdata")
        assert "seed 7" in st["message"] and "seed 0" in st["message"], st["message"]

        # An unreachable location (a bucket whose endpoint does not answer is the same path through the daemon).
        spec = job("nowhere", gpus=1, steps=10)
        spec["resume_from"] = {"uri": (tmp_path / "no" / "such" / "dir").as_uri(), "job": "orig"}
        client.create(spec)
        st = _failed(client, "nowhere")
        assert st["message"].startswith("cannot resume from latest of job 'orig' at file://"), st["message"]
        assert "job 'orig' is not at file://" in st["message"] and "no/such/dir" in st["message"], st["message"]


def test_a_resume_cut_short_by_a_lost_host_resumes_again_from_the_persistent_version(tmp_path: Path) -> None:
    """The host building the resumed version dies mid-transfer (one chunk of the saved version is a FIFO
    nobody writes to, so its daemon is stuck reading it when it is killed): the job neither fails nor starts
    from step 0; it resumes again from the same persistent version on the other host."""
    uri = (tmp_path / "persistent").as_uri()
    with LocalScheduler(tmp_path / "sched", hosts=2, gpus_per_host=1, heartbeat_interval=0.3) as sched:
        client = SchedulerClient(sched.url)
        orig = job("orig", gpus=1, steps=200)
        orig["checkpoint"] = {"uri": uri, "interval_steps": INTERVAL, "keep_last": 5}
        client.create(orig)
        st = wait_for(client, "orig", lambda s: bool(s.get("persisted")), "persisting a version", timeout=300)
        client.delete("orig")
        saved = st["persisted"][-1]
        step = Version.parse(saved).step
        chunks = [f for f in (tmp_path / "persistent" / "orig" / saved).rglob("*") if f.is_file()
                  and f.name != "zarr.json"]
        chunk = max(chunks, key=lambda f: f.stat().st_size)
        held = tmp_path / "held-chunk"
        chunk.rename(held)
        os.mkfifo(chunk)

        copy = job("copy", gpus=1, steps=step + 6)
        copy["resume_from"] = {"uri": uri, "job": "orig", "version": saved}
        client.create(copy)
        first = wait_for(client, "copy", lambda s: s["stage"] == "transferring" and s["workers"]
                         and all(w.get("pid") for w in s["workers"]), "transferring the resumed version")
        time.sleep(2.0)  # the daemon is blocked opening the FIFO
        assert client.job("copy")["status"]["stage"] == "transferring"
        victim = first["hosts"][0]
        chunk.unlink()  # the next attempt reads the real chunk; the blocked open never returns
        held.rename(chunk)
        daemon = next(h["pid"] for h in sched.cluster.describe() if h["name"] == victim)
        for pid in [daemon] + [w["pid"] for w in first["workers"]]:
            os.killpg(pid, signal.SIGKILL)
        st = wait_for(client, "copy", lambda s: s["phase"] == "Succeeded", "resuming again and training to the end",
                      timeout=300)

    assert st["step"] == step + 6 and victim not in st["hosts"], st
    assert st["resumed_from"]["version"] == saved and st["resumed_from"]["step"] == step, st["resumed_from"]
    reasons = [r["reason"] for r in st["history"]]
    assert reasons == ["resume", "failure", "resume"], st["history"]
    cut, failure, again = st["history"]
    assert "interrupted by a failure" in (cut["error"] or ""), cut
    assert victim in (failure["error"] or "") or "transfer interrupted" in (failure["error"] or ""), failure
    assert again["error"] is None and again["version_from"] == saved and victim not in again["to_hosts"], again
    assert Version.parse(again["version_to"]).generation > Version.parse(cut["version_to"]).generation, (cut, again)
    assert again["bytes_remote"] == again["lower_bound_bytes"] > 0, again
