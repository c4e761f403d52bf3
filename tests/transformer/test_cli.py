"""``tenplex plan`` and ``tenplex transform`` through the real entry point."""

from __future__ import annotations

import json

import pytest

from tenplex.cli import main
from tenplex.ptc import ParallelConfig
from tenplex.transformer.plan import Plan

from .conftest import check_new_state, populate, random_state
from .test_transform_e2e import layout


@pytest.fixture
def ptc_files(tmp_path):
    old = layout(ParallelConfig(dp=2, tp=2), 2, ["h0", "h1"], "bf16")
    new = layout(ParallelConfig(tp=2, pp=2), 2, ["h1", "h2"], "bf16")
    old.save(tmp_path / "old.json")
    new.save(tmp_path / "new.json")
    return old, new, tmp_path / "old.json", tmp_path / "new.json"


def test_plan_explain_and_json(ptc_files, tmp_path, capsys) -> None:
    old, new, old_file, new_file = ptc_files
    out = tmp_path / "plan.json"
    rc = main(["plan", "--from", str(old_file), "--to", str(new_file), "--job", "j", "--old-version", "s3-g0",
               "--explain", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for words in ("lower bound", "ratio 1.000", "largest send", "largest receive", "per host", "per tensor", "h2"):
        assert words in text
    obj = json.loads(out.read_text())
    assert obj["network_bytes"] == obj["lower_bound_bytes"] > 0 and obj["local_bytes"] > 0
    assert obj["new_version"] == "s3-g1"
    assert {"h1", "h2"} == set(obj["hosts"]) and obj["hosts"]["h2"]["transfers"]
    first = obj["hosts"]["h2"]["transfers"][0]
    assert {"source", "tensor", "region", "shard", "offset", "nbytes", "alternatives"} <= set(first)
    plan = Plan.load(out)
    assert plan.network_bytes == obj["network_bytes"] and plan.hosts["h2"].transfers[0].nbytes == first["nbytes"]


def test_plan_bad_input_is_one_clear_line(ptc_files, capsys) -> None:
    _, _, old_file, new_file = ptc_files
    assert main(["plan", "--from", str(old_file), "--to", str(new_file), "--alive", "h0,nowhere"]) == 1
    assert "nowhere" in capsys.readouterr().err
    # h1 holds another version: h0's full replica serves everything.
    assert main(["plan", "--from", str(old_file), "--to", str(new_file), "--alive", "h0,h1,h2",
                 "--holder", "h1=s9-g0"]) == 0
    assert main(["plan", "--from", str(old_file), "--to", str(new_file), "--holder", "h1"]) == 1
    assert "--holder must look like NAME=VALUE, got 'h1'" in capsys.readouterr().err
    assert main(["plan", "--from", str(old_file), "--to", str(old_file), "--new-version", "s0-g0"]) == 1
    assert "must differ" in capsys.readouterr().err


@pytest.mark.slow
def test_transform_cli_runs_one_host(cluster, ptc_files, tmp_path, capsys) -> None:
    old, new, old_file, new_file = ptc_files
    state = random_state(old, seed=21)
    populate(cluster, old, state, "cli", "s3-g0")
    plan_file = tmp_path / "plan.json"
    assert main(["plan", "--from", str(old_file), "--to", str(new_file), "--job", "cli", "--old-version", "s3-g0",
                 "--json", str(plan_file)]) == 0
    sources = [f"--source={h}={cluster.servers[h].url}" for h in ("h0", "h1", "h2")]
    # h1 runs on its own store directory (node-side), h2 through its daemon with a progress bar.
    for host, extra in (("h1", ["--no-progress", "--store-root", str(cluster.servers["h1"].store.root)]),
                        ("h2", ["--store", cluster.servers["h2"].url])):
        rc = main(["transform", "--plan", str(plan_file), "--host", host, *sources, "--concurrency", "3", *extra])
        assert rc == 0
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report["host"] == host and report["bytes_remote"] + report["bytes_local"] > 0
    check_new_state(cluster, new, state, "cli", "s3-g1")
    # Unknown host: a clear error.
    assert main(["transform", "--plan", str(plan_file), "--host", "h9", "--store", cluster.servers["h0"].url]) == 1
    assert "h9" in capsys.readouterr().err
