"""``tenplex store serve|ls|get|verify|gc`` end to end: the daemon as a separate OS process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tenplex.cli import main
from tenplex.core.protocol import RELAY_PATH, RelayInfo
from tenplex.ptc.region import Region
from tenplex.store.client import StoreClient
from tenplex.testing.processes import stop_processes

TOKEN = "cli-token"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("daemon")
    port_file = root.parent / f"{root.name}.port"
    env = {**os.environ, "TENPLEX_TOKEN": TOKEN, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tenplex", "store", "serve", "--root", str(root), "--port", "0", "--port-file", str(port_file)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "daemon did not write its port file"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        with StoreClient(url, TOKEN) as c:
            while not c.health():
                assert time.monotonic() < deadline
                time.sleep(0.05)
        yield url, root
    finally:
        stop_processes([proc])
        assert proc.stderr is not None
        log = proc.stderr.read()
        assert f"serving {root}" in log or "serving" in log


@pytest.mark.slow
def test_serve_ls_get_verify_gc(daemon: tuple[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    url, root = daemon
    monkeypatch.setenv("TENPLEX_TOKEN", TOKEN)
    w = np.arange(12 * 10, dtype=np.float32).reshape(12, 10)
    e = torch.randn(5, 3, dtype=torch.bfloat16)
    with StoreClient(url) as c:  # token from the environment
        for step in (1, 2, 3):
            c.write_shard("gpt", f"s{step}-g0", "layers.0/w", Region(((0, 12), (0, 10))), w, dtype="float32", global_shape=(12, 10))
            c.write_shard("gpt", f"s{step}-g0", "emb", Region.full((5, 3)), e, dtype="bfloat16", global_shape=(5, 3))
            if step < 3:
                c.commit("gpt", f"s{step}-g0")

    assert main(["store", "ls", url]) == 0
    out = capsys.readouterr().out
    assert "gpt" in out and "s2-g0" in out
    assert main(["store", "ls", url, "gpt"]) == 0
    out = capsys.readouterr().out
    assert "s1-g0" in out and "s3-g0" in out and "no" in out

    target = tmp_path / "w.npy"
    assert main(["store", "get", url, "gpt", "s2-g0", "layers.0/w", "--region", "2:5,:", "-o", str(target)]) == 0
    assert np.array_equal(np.load(target), w[2:5])
    bf = tmp_path / "e.npy"
    assert main(["store", "get", url, "gpt", "s2-g0", "emb", "-o", str(bf)]) == 0
    assert "uint16" in capsys.readouterr().err
    assert torch.equal(torch.from_numpy(np.load(bf)).view(torch.bfloat16), e)
    assert main(["store", "get", url, "gpt", "s3-g0", "emb", "-o", str(bf)]) == 1  # not committed
    assert "not committed" in capsys.readouterr().err
    assert main(["store", "get", url, "gpt", "s3-g0", "emb", "--uncommitted", "-o", str(bf)]) == 0
    assert main(["store", "get", url, "gpt", "s2-g0", "emb", "--region", "0:9,:", "-o", str(bf)]) == 1
    assert "exceeds dimension 0" in capsys.readouterr().err
    assert main(["store", "get", url, "gpt", "s2-g0", "nope", "-o", str(bf)]) == 1

    monkeypatch.setenv("TENPLEX_TOKEN", "wrong")
    assert main(["store", "ls", url]) == 1
    assert "unauthorized" in capsys.readouterr().err

    assert main(["store", "verify", "--root", str(root), "gpt", "s2-g0"]) == 0
    assert "intact" in capsys.readouterr().out
    assert main(["store", "gc", "--root", str(root), "gpt", "--keep", "1"]) == 0
    assert "s1-g0" in capsys.readouterr().out
    assert main(["store", "gc", "--root", str(root), "gpt", "--keep", "0"]) == 1


@pytest.mark.slow
def test_serve_with_worker_processes(tmp_path: Path) -> None:
    """Two uvicorn workers on one port share the root; /metrics sums both processes; each relays heartbeats to the
    scheduler the daemon was started for."""
    port_file = tmp_path / "port"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    root = tmp_path / "root"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tenplex", "store", "serve", "--root", str(root), "--port-file", str(port_file), "--workers", "2", "--token", TOKEN,
         "--scheduler-url", "http://127.0.0.1:9", "--relay-interval", "2"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        with StoreClient(f"http://127.0.0.1:{int(port_file.read_text())}", TOKEN, max_connections=4) as c:
            while not c.health():
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            data = np.arange(64 * 32, dtype=np.int32).reshape(64, 32)
            for i in range(8):  # spread over both workers (new connections land on either)
                box = Region(((8 * i, 8 * i + 8), (0, 32)))
                c.write_shard("mw", "s1-g0", "w", box, np.ascontiguousarray(data[box.slices()]), dtype="int32", global_shape=(64, 32))
            c.commit("mw", "s1-g0")
            from tenplex.store.client import ReadRequest

            outs = [np.empty((16, 32), np.int32) for _ in range(4)]
            c.read_many([ReadRequest("mw", "s1-g0", "w", Region(((16 * i, 16 * i + 16), (0, 32))), o) for i, o in enumerate(outs)], concurrency=4)
            assert np.array_equal(np.concatenate(outs), data)
            metrics = {
                line.split(" ")[0]: float(line.split(" ")[1]) for line in c.metrics().splitlines() if line and not line.startswith("#")
            }
            assert metrics["tenplex_store_bytes_in_total"] == data.nbytes
            assert metrics["tenplex_store_bytes_out_total"] == data.nbytes
            for _ in range(4):  # new connections land on either process
                with urllib.request.urlopen(urllib.request.Request(
                        f"{c.url}{RELAY_PATH}", headers={"Authorization": f"Bearer {TOKEN}", "Connection": "close"})) as r:
                    assert RelayInfo.model_validate_json(r.read()) == RelayInfo(scheduler_url="http://127.0.0.1:9",
                                                                               interval_s=2.0)
    finally:
        stop_processes([proc])
    assert proc.returncode == 0
