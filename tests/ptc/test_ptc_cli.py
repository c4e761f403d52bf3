"""``tenplex ptc megatron-gpt | show | validate``: files written, exit codes, messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tenplex.cli import main
from tenplex.ptc import PTC

GPT = ["ptc", "megatron-gpt", "--layers", "4", "--hidden", "16", "--heads", "4", "--vocab", "100"]


def test_megatron_gpt_writes_a_valid_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich sizes its tables to the terminal
    out = tmp_path / "gpt.json"
    argv = [*GPT, "--kv-heads", "2", "--gated", "--tied", "--seq-len", "0", "--dp", "2", "--tp", "2", "--pp", "2",
            "--layers-per-stage", "3,1", "--zero", "1", "--gpus-per-node", "4", "--hosts", "a,b",
            "--precision", "fp16", "--samples", "1000", "--global-batch", "8", "--seed", "3", "-o", str(out)]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{out}: megatron-gpt dp2 x tp2 x pp2, zero1, layers [3, 1] fp16")
    assert "8 devices on 2 hosts" in line
    ptc = PTC.load(out)
    assert ptc.config["provider"] == "megatron-gpt" and ptc.config["layers_per_stage"] == [3, 1]
    assert ptc.config["model"]["gated_mlp"] and ptc.config["model"]["kv_heads"] == 2
    assert ptc.hosts == ("a", "b")
    assert ptc.dataset is not None and ptc.dataset.global_batch_size == 8
    assert ptc.tensor("layers.0.input_layernorm.weight").dtype == "float16"
    assert ptc.tensor("optim/layers.3.mlp.linear_fc1.weight/master").dtype == "float32"
    assert [s.devices for s in ptc.tensor("embedding.word_embeddings.weight").shards] == [(0, 2, 4, 6), (1, 3, 5, 7)]

    assert main(["ptc", "validate", str(out)]) == 0
    assert "valid (" in capsys.readouterr().out

    assert main(["ptc", "show", str(out), "--tensors", "0"]) == 0
    shown = capsys.readouterr().out
    assert "layers.3.mlp.linear_fc2.weight" in shown
    assert "dataset: 1000 samples, seed 3, global batch 8" in shown
    assert "host store bytes" in shown


def test_megatron_gpt_core_conventions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--naming core: GPTModel's names and no vocabulary padding (--pad-vocab brings Megatron-LM's back)."""
    out = tmp_path / "core.json"
    argv = [*GPT, "--naming", "core", "--norm", "RMSNorm", "--no-bias", "--seq-len", "0", "--dp", "2", "--tp", "2",
            "--pp", "1", "--zero", "1", "--overlap-grad-reduce", "--ddp-bucket-size", "500", "-o", str(out)]
    assert main(argv) == 0
    assert "megatron-core names, vocab 100," in capsys.readouterr().out
    ptc = PTC.load(out)
    assert ptc.tensor("embedding.word_embeddings.weight").shape == (100, 16)
    assert ptc.has_tensor("decoder.layers.3.mlp.linear_fc1.weight")
    assert ptc.has_tensor("decoder.final_layernorm.weight") and not ptc.has_tensor("decoder.final_layernorm.bias")
    assert ptc.config["model"]["ddp_bucket_size"] == 500 and ptc.config["model"]["overlap_grad_reduce"]
    assert main([*argv[:-2], "--pad-vocab", "--vocab-divisible-by", "8", "-o", str(out)]) == 0
    assert "vocab 112," in capsys.readouterr().out
    assert PTC.load(out).tensor("output_layer.weight").shape == (112, 16)
    assert main([*GPT, "--naming", "core", "--dp", "1", "--tp", "8", "--pp", "1", "--heads", "8", "-o", str(out)]) == 1
    assert "vocab 100 % tp 8 = 4 (not padded)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dp", "1", "--tp", "8", "--pp", "1"], "tp=8 does not divide the model: heads 4 % tp 8 = 4"),
        (["--dp", "1", "--tp", "1", "--pp", "3", "--layers-per-stage", "2,1"],
         "layers_per_stage [2, 1] has 2 entries, pp is 3"),
        (["--dp", "1", "--tp", "1", "--pp", "2", "--layers-per-stage", "2,x"],
         "--layers-per-stage must be comma-separated integers, got '2,x'"),
        (["--dp", "3", "--tp", "1", "--pp", "1", "--samples", "10", "--global-batch", "8", "--seed", "1"],
         "global batch size 8 is not divisible by data-parallel size 3"),
        (["--dp", "1", "--tp", "1", "--pp", "1", "--samples", "10"], "--global-batch, --seed missing"),
        (["--dp", "0", "--tp", "1", "--pp", "1"], "dp must be a positive integer, got 0"),
        (["--dp", "4", "--tp", "1", "--pp", "1", "--gpus-per-node", "2", "--hosts", "x"],
         "needs 4 GPUs; 1 hosts x 2 have 2"),
    ],
)
def test_megatron_gpt_invalid_combinations_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    out = tmp_path / "gpt.json"
    assert main([*GPT, *extra, "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tenplex: error: ")
    assert message in err
    assert not out.exists()


def test_validate_rejects_an_inconsistent_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gpt.json"
    assert main([*GPT, "--dp", "2", "--tp", "2", "--pp", "1", "-o", str(out)]) == 0
    capsys.readouterr()
    obj = json.loads(out.read_text())
    obj["tensors"][0]["shards"][0]["region"][0][1] += 1  # now overlaps its neighbour
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(obj))
    assert main(["ptc", "validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "tensor 'embedding.word_embeddings.weight'" in err and "overlap" in err
    assert main(["ptc", "validate", str(tmp_path / "missing.json")]) == 1
    assert "cannot read PTC file" in capsys.readouterr().err


def test_entry_point_in_a_subprocess(tmp_path: Path) -> None:
    out = tmp_path / "gpt.json"
    run = subprocess.run(
        [sys.executable, "-m", "tenplex", *GPT, "--dp", "1", "--tp", "2", "--pp", "2", "-o", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert run.returncode == 0, run.stderr
    ok = subprocess.run([sys.executable, "-m", "tenplex", "ptc", "validate", str(out)],
                        capture_output=True, text=True, timeout=120, check=False)
    assert ok.returncode == 0 and "valid" in ok.stdout
    out.write_text('{"format": "tenplex.ptc/v2"}')
    bad = subprocess.run([sys.executable, "-m", "tenplex", "ptc", "validate", str(out)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 1
    assert "unsupported format 'tenplex.ptc/v2'" in bad.stderr
