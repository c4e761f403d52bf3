"""Crash safety: writers killed mid-version or mid-commit never damage the committed version or fake a commit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tenplex.errors import NotFound
from tenplex.node.store_routes import StoreServer
from tenplex.ptc.region import Region
from tenplex.store.local import LocalStore

WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from tenplex.ptc.region import Region
    from tenplex.store.local import LocalStore

    store = LocalStore(sys.argv[1], chunk_bytes=64 << 10)
    i = 0
    while True:  # until killed
        rows = (i % 64) * 16
        data = np.full((16, 4096), i, np.float32)
        store.write_shard("job", "s2-g0", f"layers.{i // 64}.w", Region(((rows, rows + 16), (0, 4096))), data,
                          dtype="float32", global_shape=(1024, 4096))
        i += 1
        if i == 1:
            print("first", flush=True)
    """
)

COMMITTER = textwrap.dedent(
    """
    import sys
    from tenplex.store.local import LocalStore

    print("go", flush=True)
    LocalStore(sys.argv[1]).commit("job", sys.argv[2])
    print("done", flush=True)
    """
)


def _committed_baseline(root: Path) -> tuple[LocalStore, np.ndarray]:
    store = LocalStore(root, chunk_bytes=64 << 10)
    base = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)
    store.write_shard("job", "s1-g0", "layers.0.w", Region.full((256, 256)), base, dtype="float32", global_shape=(256, 256))
    store.commit("job", "s1-g0")
    return store, base


def _check_baseline(store: LocalStore, base: np.ndarray) -> None:
    out = np.empty_like(base)
    store.read_into("job", "s1-g0", "layers.0.w", Region.full(base.shape), out)
    assert np.array_equal(out, base)
    assert store.verify("job", "s1-g0") == []


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.15, 0.4])
def test_writer_killed_mid_version(tmp_path: Path, delay: float) -> None:
    store, base = _committed_baseline(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, env=_env())
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"first"
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)

    _check_baseline(store, base)
    infos = {str(v.version): v.committed for v in store.versions("job")}
    assert infos == {"s1-g0": True, "s2-g0": False}
    with pytest.raises(NotFound, match="not committed"):
        store.read_into("job", "s2-g0", "layers.0.w", Region(((0, 16), (0, 4096))), np.empty((16, 4096), np.float32))
    torn = store.manifest("job", "s2-g0")
    assert not torn.committed and len(torn.shards) >= 1
    # every shard that is visible is whole: the kill can only have hit a shard still in staging
    assert store.verify("job", "s2-g0") == []
    for info in torn.shards:
        out = np.empty(info.region.shape, np.float32)
        store.read_into("job", "s2-g0", info.tensor, info.region, out, uncommitted=True)
        assert out.min() == out.max()
    # the torn version is newer than every committed one: gc keeps it (it could be in progress) ...
    assert store.gc("job", keep_last=1) == []
    # ... until a newer version is committed
    store.write_shard("job", "s3-g0", "x", Region.full((1,)), np.zeros(1, np.int8), dtype="int8", global_shape=(1,))
    store.commit("job", "s3-g0")
    assert sorted(map(str, store.gc("job", keep_last=2))) == ["s2-g0"]
    _check_baseline(store, base)
    # the shard the writer was in the middle of stays in staging until it is stale
    staging = tmp_path / ".staging" / "job"
    partial = [p for p in staging.iterdir() if p.name.startswith("shard-")]
    store.gc("job", keep_last=2)
    assert [p for p in staging.iterdir() if p.name.startswith("shard-")] == partial
    store.gc("job", keep_last=2, stale_staging_s=-1.0)
    assert not any(staging.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2, 0.6])
def test_killed_mid_commit_is_all_or_nothing(tmp_path: Path, delay: float) -> None:
    store, base = _committed_baseline(tmp_path)
    rng = np.random.default_rng(0)
    for i in range(40):
        store.write_shard("job", "s2-g0", f"t{i}", Region.full((128, 128)), rng.random((128, 128), np.float32), dtype="float32", global_shape=(128, 128))
    proc = subprocess.Popen([sys.executable, "-c", COMMITTER, str(tmp_path), "s2-g0"], stdout=subprocess.PIPE, env=_env())
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"go"
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    _check_baseline(store, base)
    manifest = store.manifest("job", "s2-g0")
    if manifest.committed:  # the commit got through before the kill: then it is complete
        assert len(manifest.shards) == 40 and store.verify("job", "s2-g0") == []
    else:
        assert {v.committed for v in store.versions("job") if str(v.version) == "s2-g0"} == {False}
        store.commit("job", "s2-g0")  # and a retried commit succeeds
        assert len(store.manifest("job", "s2-g0").shards) == 40


def test_a_torn_commit_marker_does_not_commit(tmp_path: Path) -> None:
    store, base = _committed_baseline(tmp_path)
    store.write_shard("job", "s2-g0", "w", Region.full((2,)), np.zeros(2, np.int8), dtype="int8", global_shape=(2,))
    # what a crash between writing the temporary marker and renaming it leaves behind
    (tmp_path / "job" / ".commits" / ".s2-g0.json.0123abcd.tmp").write_text('{"job": "job", "vers')
    assert [(str(v.version), v.committed) for v in store.versions("job")] == [("s1-g0", True), ("s2-g0", False)]
    with pytest.raises(NotFound, match="not committed"):
        store.read_into("job", "s2-g0", "w", Region.full((2,)), np.empty(2, np.int8))
    _check_baseline(store, base)


@pytest.mark.slow
def test_upload_cut_off_mid_body_stores_nothing(tmp_path: Path) -> None:
    store, base = _committed_baseline(tmp_path)
    with StoreServer(tmp_path, store=store) as srv:
        body_len = 4096 * 4096 * 4
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(
            (
                f"PUT /v1/jobs/job/versions/s2-g0/tensors/w?region=0:4096,0:4096 HTTP/1.1\r\nHost: x\r\n"
                f"X-Tenplex-Dtype: float32\r\nX-Tenplex-Global-Shape: 4096,4096\r\nContent-Length: {body_len}\r\n\r\n"
            ).encode()
        )
        sock.sendall(b"\x01" * (body_len // 3))  # a third of the body, then the writer dies
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()
        deadline = time.monotonic() + 20
        staging = tmp_path / ".staging" / "job"
        while time.monotonic() < deadline and staging.exists() and any(staging.iterdir()):
            time.sleep(0.05)
        assert not staging.exists() or not any(staging.iterdir()), list(staging.iterdir())
        assert [str(v.version) for v in store.versions("job")] == ["s1-g0"]
        _check_baseline(store, base)
