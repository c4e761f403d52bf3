"""``tenplex export`` / ``tenplex import`` from the command line: store roots, a store daemon, the scheduler."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from tenplex.cli import main
from tenplex.ptc import PTC
from tenplex.ptc.dtypes import torch_dtype
from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore

from .conftest import (
    JOB,
    RECORDED,
    TOKEN,
    VERSION,
    Cluster,
    assert_bits_equal,
    random_state,
    source_ptc,
    target_ptc,
    write_version,
)


def test_export_then_import_through_the_cli(cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ptc = source_ptc()
    state = random_state(ptc, seed=11)
    write_version(ptc, cluster.stores(), state, JOB, VERSION, record_dataset=RECORDED)
    ptc.save(tmp_path / "src.json")
    out = tmp_path / "ckpt"
    argv = ["export", JOB, VERSION, str(out), "--format", "dcp", "--ptc", str(tmp_path / "src.json"), "--token", TOKEN,
            "--store-root", f"h0={cluster.roots['h0']}", "--store", f"h1={cluster.server.url}",
            "--store-root", f"h2={cluster.roots['h2']}"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["bytes"] == ptc.total_bytes and report["dataset"] == RECORDED.to_json()
    assert "export job-a s7-g2" in captured.err  # the progress bar

    new = target_ptc()
    new.save(tmp_path / "new.json")
    roots = {h: tmp_path / "new" / h for h in new.hosts}
    argv = ["import", str(out), "--ptc", str(tmp_path / "new.json"), "--job", "job-b", "--no-progress",
            "--ptc-out", str(tmp_path / "resumed.json"), *[a for h, r in roots.items() for a in ("--store-root", f"{h}={r}")]]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["version"] == "s7-g0" and report["step"] == 7
    resumed = PTC.load(tmp_path / "resumed.json")
    assert resumed.dataset is not None and resumed.dataset.consumed_samples == RECORDED.consumed_samples
    for host, root in roots.items():
        for t, s in new.shards_on_host(host):
            buf = torch.empty(s.region.shape, dtype=torch_dtype(t.dtype))
            LocalStore(root).read_into("job-b", "s7-g0", t.name, s.region, buf)
            assert_bits_equal(buf, state[t.name][s.region.slices()], f"{t.name} {s.region}")
    # the same import again: the version exists
    assert main(argv) == 1
    assert "already exists in the store of n0 (committed)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["export", "j", "s1-g0", "OUT"], "give the layout: --ptc PTC.json or --scheduler URL"),
        (["export", "j", "s1-g0", "OUT", "--ptc", "PTC", "--store", "h0"], "must look like HOST=VALUE"),
        (["export", "j", "v1", "OUT", "--ptc", "PTC"], "is not of the form s<step>-g<generation>"),
        (["export", "j", "s1-g0", "OUT", "--ptc", "PTC"], "give the stores"),
        (["export", "j", "s1-g0", "OUT", "--ptc", "PTC", "--store-root", "h0=/nonexistent/x"], "does not exist"),
        (["export", "j", "s1-g0", "OUT", "--ptc", "PTC", "--store-root", "h0=ROOT", "--key-map", "nope"], "unknown key map"),
        (["export", "j", "s1-g0", "OUT", "--ptc", "PTC", "--store-root", "h0=ROOT", "--key-map-option", "x"], "KEY=VALUE"),
        (["import", "OUT", "--ptc", "PTC", "--job", "j", "--store-root", "h0=ROOT"], "is not a DCP checkpoint"),
    ],
)
def test_cli_refuses_bad_arguments_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    source_ptc().save(tmp_path / "ptc.json")
    (tmp_path / "root").mkdir()
    (tmp_path / "out").mkdir()
    subst = {"OUT": str(tmp_path / "out"), "PTC": str(tmp_path / "ptc.json"), "h0=ROOT": f"h0={tmp_path / 'root'}"}
    assert main([subst.get(a, a) for a in argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_export_with_the_layout_and_stores_from_the_scheduler(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A job's PTC of the version's generation and its hosts' store URLs come from the scheduler's REST API."""
    from tenplex.scheduler.cli import SchedulerClient
    from tenplex.scheduler.server import LocalScheduler

    sched = LocalScheduler(tmp_path / "sched", hosts=1, gpus_per_host=2, token=TOKEN).start()
    try:
        client = SchedulerClient(sched.url, TOKEN)
        client.create({
            "name": "gpt", "gpus": 2, "command": [sys.executable, "-c", "import time; time.sleep(120)"],
            "layout": {"provider": "megatron-gpt", "precision": "bf16",
                       "model": {"num_layers": 2, "hidden": 16, "heads": 2, "vocab": 40, "seq_len": 8,
                                 "make_vocab_size_divisible_by": 8}},
            "dataset": {"num_samples": 64, "seed": 0, "global_batch_size": 4},
        })
        deadline = time.monotonic() + 60
        while True:
            try:
                ptc = PTC.from_json(client.request("GET", "/v1/jobs/gpt/ptc?generation=0"))
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        urls = {h["name"]: h["store_url"] for h in client.request("GET", "/v1/hosts")["hosts"]}
        state = random_state(ptc, seed=12)
        stores = {h: StoreClient(u, TOKEN) for h, u in urls.items()}
        write_version(ptc, stores, state, "gpt", "s3-g0")
        out = tmp_path / "ckpt"
        assert main(["export", "gpt", "s3-g0", str(out), "--scheduler", sched.url, "--token", TOKEN, "--no-progress"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["bytes"] == ptc.total_bytes and report["dataset"] == ptc.dataset.to_json()
        import torch.distributed.checkpoint as dcp

        sd = {t.name: torch.zeros(t.shape, dtype=torch_dtype(t.dtype)) for t in ptc.tensors}
        dcp.load(sd, checkpoint_id=out, no_dist=True)
        for name, want in state.items():
            assert_bits_equal(sd[name], want, name)
        client.delete("gpt")
    finally:
        sched.stop()
