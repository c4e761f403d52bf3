"""``tenplex worker launch``: the ranks of a multi-GPU worker pod as real child processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tenplex.errors import InvalidInput
from tenplex.launcher import (
    ENV_POD_RANKS,
    LocalRank,
    PodLauncher,
    exit_status,
    launch,
    parse_pod_ranks,
)

REPO = Path(__file__).resolve().parents[2]


def pod_ranks(*ranks: int, **extra: str) -> str:
    return json.dumps([{"RANK": str(r), "LOCAL_RANK": str(i), "TENPLEX_WORKER_ID": f"job-g0-r{r}", **extra}
                       for i, r in enumerate(ranks)], separators=(",", ":"))


def child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_pod_ranks_are_parsed_in_local_rank_order() -> None:
    text = json.dumps([{"RANK": "5", "LOCAL_RANK": "1", "X": "b"}, {"RANK": "4", "LOCAL_RANK": "0", "X": "a"}])
    assert parse_pod_ranks(text) == (LocalRank(4, 0, {"RANK": "4", "LOCAL_RANK": "0", "X": "a"}),
                                     LocalRank(5, 1, {"RANK": "5", "LOCAL_RANK": "1", "X": "b"}))


@pytest.mark.parametrize(("text", "message"), [
    (None, "TENPLEX_POD_RANKS is not set"),
    ("", "TENPLEX_POD_RANKS is not set"),
    ("[{", "is not valid JSON"),
    ("{}", "must be a non-empty JSON list of objects, got '{}'"),
    ("[]", "must be a non-empty JSON list"),
    ('["RANK=0"]', r"TENPLEX_POD_RANKS\[0\] must be an object of environment variables, got 'RANK=0'"),
    ('[{"RANK": "0"}]', r"\[0\]: LOCAL_RANK must be a non-negative integer, got None"),
    ('[{"RANK": "-1", "LOCAL_RANK": "0"}]', r"\[0\]: RANK must be a non-negative integer, got '-1'"),
    ('[{"RANK": 0, "LOCAL_RANK": "0"}]', r"string value, got \{'RANK': 0\}"),
    ('[{"RANK": "0", "LOCAL_RANK": "0"}, {"RANK": "1", "LOCAL_RANK": "0"}]',
     r"its own LOCAL_RANK, got \[0, 0\]"),
    ('[{"RANK": "3", "LOCAL_RANK": "0"}, {"RANK": "3", "LOCAL_RANK": "1"}]', r"its own RANK, got \[3, 3\]"),
])
def test_bad_pod_ranks_are_clear_errors(text: str | None, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        parse_pod_ranks(text)


def test_no_command_is_refused() -> None:
    with pytest.raises(InvalidInput, match="no command to launch"):
        PodLauncher([], parse_pod_ranks(pod_ranks(0)), {})


def test_child_environment_is_shared_env_plus_the_rank_overrides() -> None:
    launcher = PodLauncher(["true"], parse_pod_ranks(pod_ranks(6, 7)),
                           {ENV_POD_RANKS: "x", "CUDA_VISIBLE_DEVICES": "2,3", "MASTER_PORT": "29500", "RANK": "9"})
    env = launcher.child_env(launcher.ranks[1])
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3", "MASTER_PORT": "29500", "RANK": "7", "LOCAL_RANK": "1",
                   "LOCAL_WORLD_SIZE": "2", "TENPLEX_WORKER_ID": "job-g0-r7"}
    assert exit_status(-9) == 137 and exit_status(3) == 3


@pytest.mark.slow
def test_every_rank_runs_with_its_environment_and_all_zero_is_zero(tmp_path: Path) -> None:
    code = ("import json, os, pathlib; pathlib.Path(os.environ['OUT'], os.environ['RANK']).write_text(json.dumps("
            "{k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'TENPLEX_WORKER_ID', "
            "'CUDA_VISIBLE_DEVICES', 'TENPLEX_POD_RANKS', 'SHARED')}))")
    environ = {**os.environ, ENV_POD_RANKS: pod_ranks(2, 3), "OUT": str(tmp_path), "SHARED": "yes",
               "CUDA_VISIBLE_DEVICES": "0,1"}
    assert launch(child(code), environ) == 0
    seen = {int(p.name): json.loads(p.read_text()) for p in tmp_path.iterdir()}
    assert seen == {
        rank: {"RANK": str(rank), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "2", "TENPLEX_WORKER_ID": f"job-g0-r{rank}",
               "CUDA_VISIBLE_DEVICES": "0,1", "TENPLEX_POD_RANKS": None, "SHARED": "yes"}
        for local, rank in ((0, 2), (1, 3))}


@pytest.mark.slow
def test_a_failing_rank_ends_the_pod_promptly_with_its_exit_code(tmp_path: Path) -> None:
    # Rank 0 ignores SIGTERM (as a rank stuck in a collective may) and would run for ever: the launch returns
    # only because it was killed after the failure grace.
    code = ("import os, signal, sys, time\n"
            "if os.environ['RANK'] == '1':\n"
            "    time.sleep(0.3); sys.exit(3)\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "while True: time.sleep(1)")
    assert launch(child(code), {**os.environ, ENV_POD_RANKS: pod_ranks(0, 1)}, failure_grace=0.5) == 3

    # A rank killed by a signal: the pod reports 128 + N, as the container runtime does.
    crash = "import os, signal, time; os.kill(os.getpid(), signal.SIGKILL) if os.environ['RANK'] == '0' else time.sleep(60)"
    assert launch(child(crash), {**os.environ, ENV_POD_RANKS: pod_ranks(0, 1)}, failure_grace=5) == 137


@pytest.mark.slow
def test_sigterm_is_forwarded_to_every_rank(tmp_path: Path) -> None:
    code = ("import os, pathlib, signal, sys, time\n"
            "out = pathlib.Path(os.environ['OUT'])\n"
            "def stop(signum, frame):\n"
            "    (out / ('stopped-' + os.environ['RANK'])).write_text(str(signum)); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            "(out / ('ready-' + os.environ['RANK'])).write_text('')\n"
            "time.sleep(60)")
    env = {**os.environ, ENV_POD_RANKS: pod_ranks(0, 1), "OUT": str(tmp_path)}
    log = tmp_path / "launcher.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tenplex", "worker", "launch", "--", *child(code)], env=env,
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # to the launcher only, as the kubelet stops a container's PID 1
        assert proc.wait(timeout=20) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert {p.name: p.read_text() for p in tmp_path.glob("stopped-*")} == {
        "stopped-0": str(int(signal.SIGTERM)), "stopped-1": str(int(signal.SIGTERM))}
    text = log.read_text()
    assert "started rank 0 (local rank 0)" in text and "started rank 1 (local rank 1)" in text
    assert "forwarded it to ranks" in text and "rank 1 (local rank 1" in text and "exited with code 0" in text


@pytest.mark.slow
def test_cli_bad_input_exits_2_and_an_unrunnable_command_127(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != ENV_POD_RANKS}
    cases = [
        (["--", sys.executable, "-c", "pass"], env, 2, "TENPLEX_POD_RANKS is not set"),
        (["--"], {**env, ENV_POD_RANKS: pod_ranks(0)}, 2, "no command to launch"),
        (["--", sys.executable], {**env, ENV_POD_RANKS: '[{"RANK": "x", "LOCAL_RANK": "0"}]'}, 2,
         "RANK must be a non-negative integer, got 'x'"),
        (["--", str(tmp_path / "missing")], {**env, ENV_POD_RANKS: pod_ranks(0, 1)}, 127, "cannot start rank 0"),
    ]
    for argv, environ, code, message in cases:
        done = subprocess.run([sys.executable, "-m", "tenplex", "worker", "launch", *argv], env=environ, cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == code and message in done.stderr, (argv, done.returncode, done.stderr)


@pytest.mark.slow
def test_ranks_ended_by_a_forwarded_sigterm_give_the_pod_128_plus_15(tmp_path: Path) -> None:
    code = ("import os, pathlib, time; pathlib.Path(os.environ['OUT'], os.environ['RANK']).write_text(''); "
            "[time.sleep(1) for _ in iter(int, 1)]")  # for ever: only the forwarded SIGTERM ends the ranks

    def stop_when_ready() -> None:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)  # handled by the launcher's handler in this (the main) thread

    before = signal.getsignal(signal.SIGTERM)
    stopper = threading.Thread(target=stop_when_ready, daemon=True)
    stopper.start()
    assert launch(child(code), {**os.environ, ENV_POD_RANKS: pod_ranks(0, 1), "OUT": str(tmp_path)}) == 128 + 15
    stopper.join(timeout=5)
    assert signal.getsignal(signal.SIGTERM) == before  # the launcher put the previous handler back
