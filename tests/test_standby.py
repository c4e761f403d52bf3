"""Warm standbys: one process per host with the job's code imported forks the workers (tenplex worker standby)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tenplex.core.commands import STANDBY_READY, PythonCommand
from tenplex.core.protocol import ENV_STORE_ROOT
from tenplex.errors import InvalidConfig, InvalidInput
from tenplex.scheduler.backend import LocalBackend, LocalCluster, WorkerLaunch
from tenplex.sockets import free_port

REPO = Path(__file__).resolve().parents[1]
JOB = [sys.executable, "-m", "tests.standby_fixture", "--flag", "x"]


def test_python_commands_are_understood_and_others_refused() -> None:
    cmd = PythonCommand.parse([sys.executable, "-u", "-m", "examples.gpt.train", "--dim", "8"])
    assert (cmd.module, cmd.script, cmd.argv) == ("examples.gpt.train", None, ("examples.gpt.train", "--dim", "8"))
    cmd = PythonCommand.parse(["python3", "train.py", "--a"])
    assert (cmd.module, cmd.script, cmd.argv) == (None, "train.py", ("train.py", "--a"))
    for bad in ([], ["bash", "-c", "true"], [sys.executable, "-c", "print(1)"], [sys.executable]):
        with pytest.raises(InvalidInput):
            PythonCommand.parse(bad)


def _read_line(stream) -> str:  # type: ignore[no-untyped-def]
    line = stream.readline().decode().strip()
    assert line, "the standby closed its output"
    return line


def test_a_standby_imports_once_and_forks_each_worker_with_its_own_env_log_session_and_exit_code(tmp_path: Path) -> None:
    imports = tmp_path / "imports"
    # with a node store directory, as the local backend gives it, the standby also imports the local store
    env = {**os.environ, "STANDBY_IMPORTS": str(imports), "PYTHONPATH": str(REPO), ENV_STORE_ROOT: str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "tenplex", "worker", "standby", "--", *JOB], env=env, cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert _read_line(proc.stdout) == STANDBY_READY
        started = []
        for who, code in (("a", "0"), ("b", "3")):
            worker_env = {"WHO": who, "CODE": code, "PATH": os.environ["PATH"], "PYTHONPATH": str(REPO)}
            proc.stdin.write((f'{{"env": {__import__("json").dumps(worker_env)}, "log": "{tmp_path / who}.log"}}\n').encode())
            proc.stdin.flush()
            reply = _read_line(proc.stdout)
            assert reply.startswith("started "), reply
            started.append(int(reply.split()[1]))
        ends = {}
        while len(ends) < 2:
            word, pid, code = _read_line(proc.stdout).split()
            assert word == "exited"
            ends[int(pid)] = int(code)
        assert ends == {started[0]: 0, started[1]: 3}
        for who, pid in zip("ab", started, strict=True):
            text = (tmp_path / f"{who}.log").read_text()
            # its own environment, its own session (pgid = pid), the command's arguments
            assert f"worker {who} pid {pid} pgid {pid} argv ['--flag', 'x']" in text, text
            assert "local store imported before the worker ran: True" in text, text
        # the module ran as __main__ in each worker, but was imported once: by the standby
        assert [line.split()[1] for line in imports.read_text().splitlines()] == ["tests.standby_fixture"]
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_local_backend_forks_workers_from_its_standbys(tmp_path: Path) -> None:
    cluster = LocalCluster(root=tmp_path / "cluster")
    backend = LocalBackend(cluster, cwd=REPO, host_timeout=None)
    try:
        cluster.start_host("host-0", "127.0.0.2")
        with pytest.raises(InvalidInput, match="not a Python interpreter"):
            backend.keep_standby("j", ["bash", "-c", "true"], {}, tmp_path / "logs")
        assert backend.keep_standby("j", JOB, {"PYTHONPATH": str(REPO)}, tmp_path / "logs") == 1
        deadline = time.monotonic() + 60
        while backend.standby_ready("j") < 1:
            assert time.monotonic() < deadline, "the standby never became ready"
            time.sleep(0.05)
        standby_pid = next(iter(backend._standby.values())).proc.pid
        launches = [WorkerLaunch("j-g0-r0", 0, "host-0", 0, {"WHO": "r0", "CODE": "0"}),
                    WorkerLaunch("j-g0-r1", 1, "host-0", 1, {"WHO": "r1", "CODE": "7"}),
                    WorkerLaunch("j-g0-r2", 2, "host-0", 2, {"WHO": "r2", "SLEEP": "60"})]
        pids = backend.launch("j", JOB, launches, tmp_path / "logs" / "g0")
        # Forked by the standby, not started by the backend: the long-lived one's parent is the standby (the
        # others may be gone already; their exit codes below come from the standby, which alone reaps them).
        assert all(pids.values())
        ppid = Path(f"/proc/{pids['j-g0-r2']}/stat").read_text().rsplit(")", 1)[1].split()[1]
        assert ppid == str(standby_pid)
        deadline = time.monotonic() + 60
        while len(backend.exited("j", ["j-g0-r0", "j-g0-r1"])) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert backend.exited("j", ["j-g0-r0", "j-g0-r1", "j-g0-r2"]) == {"j-g0-r0": 0, "j-g0-r1": 7}
        assert "worker r1" in (tmp_path / "logs" / "g0" / "j-g0-r1.log").read_text()
        backend.release("j")  # the standby ends; the worker it started goes on
        assert backend.exited("j", ["j-g0-r2"]) == {}
        backend.stop("j", ["j-g0-r2"], grace=5)
        deadline = time.monotonic() + 30
        while backend.exited("j", ["j-g0-r2"]) == {}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        code = backend.exited("j", ["j-g0-r2"])["j-g0-r2"]
        assert code in (None, 128 + signal.SIGTERM)  # reported while its standby lived, else unknown
    finally:
        backend.close()
        cluster.stop()


def test_a_job_asking_for_standbys_on_a_backend_without_them_is_refused(tmp_path: Path) -> None:
    from tenplex.ptc import DatasetState
    from tenplex.scheduler.controller import SchedulerSettings
    from tenplex.scheduler.layouts import LayoutSpec
    from tenplex.scheduler.service import Scheduler
    from tenplex.scheduler.state import JobSpec, StateDir

    class NoStandby(LocalBackend):
        supports_standby = False

    backend = NoStandby(LocalCluster(root=tmp_path / "c"), host_timeout=None)
    sched = Scheduler(backend, StateDir(tmp_path / "s"), SchedulerSettings(url="http://127.0.0.1:1"))
    spec = JobSpec(name="j", layout=LayoutSpec("megatron-gpt", {"num_layers": 2, "hidden": 8, "heads": 2, "vocab": 16}),
                   dataset=DatasetState(100, 0, 4), command=tuple(JOB), gpus=1, standby=True)
    with pytest.raises(InvalidConfig, match="keeps no standbys"):
        sched.create(spec)
    bad = JobSpec(name="k", layout=spec.layout, dataset=spec.dataset, command=("bash", "-c", "true"), gpus=1,
                  standby=True)
    with pytest.raises(InvalidInput, match="Python worker commands"):
        Scheduler(LocalBackend(LocalCluster(root=tmp_path / "c2"), host_timeout=None), StateDir(tmp_path / "s2"),
                  SchedulerSettings(url="http://127.0.0.1:1")).create(bad)


class _Scheduler:
    """The scheduler's side of a pod standby's connection (what the Kubernetes backend's links do)."""

    def __init__(self, port: int, token: str | None) -> None:
        import socket

        deadline = time.monotonic() + 60
        while True:
            try:
                self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.lines = self.sock.makefile("r")
        if token is not None:
            self.send({"hello": {"token": token}})

    def send(self, message: dict) -> None:
        import json

        self.sock.sendall((json.dumps(message) + "\n").encode())

    def read(self) -> str:
        line = self.lines.readline().strip()
        assert line, "the standby closed the connection"
        return line

    def close(self) -> None:
        self.lines.close()
        self.sock.close()


def test_a_pod_standby_runs_its_first_assignment_then_takes_launches_stops_and_replays_over_tcp(tmp_path: Path) -> None:
    import json

    port = free_port()
    ranks = [{"RANK": "4", "LOCAL_RANK": "0", "TENPLEX_WORKER_ID": "j-g0-r4", "WHO": "r4"},
             {"RANK": "5", "LOCAL_RANK": "1", "TENPLEX_WORKER_ID": "j-g0-r5", "WHO": "r5", "CODE": "3"}]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TENPLEX_NODE_IP": "127.0.0.1", "TENPLEX_TOKEN": "secret",
           "TENPLEX_POD_RANKS": json.dumps(ranks), "FROM_POD": "kept"}
    out = tmp_path / "pod.log"
    with open(out, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tenplex", "worker", "standby", "--port", str(port), "--", *JOB],
                                env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        intruder = _Scheduler(port, "wrong")
        assert intruder.read().startswith("refused ")  # then closed: no launch without the job's token
        assert intruder.lines.readline() == ""
        intruder.close()
        sched = _Scheduler(port, "secret")
        assert sched.read() == STANDBY_READY
        seen: dict[str, int] = {}
        codes: dict[int, int] = {}
        while len(codes) < 2:  # the replay and the ends of the pod's first assignment (one rank per entry)
            word, pid, rest = sched.read().split()
            if word == "started":
                seen[rest] = int(pid)
            else:
                codes[int(pid)] = int(rest)
        assert set(seen) == {"j-g0-r4", "j-g0-r5"}
        assert codes == {seen["j-g0-r4"]: 0, seen["j-g0-r5"]: 3}
        # a launch with the pod's environment under the request's
        sched.send({"env": {"TENPLEX_WORKER_ID": "j-g1-r0", "WHO": "g1", "SLEEP": "60"}, "inherit": True})
        word, pid, wid = sched.read().split()
        assert (word, wid) == ("started", "j-g1-r0")
        deadline = time.monotonic() + 30
        while f"worker g1 pid {pid}" not in out.read_text():  # it runs (a stop before it printed would be fine too)
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        sched.close()  # a scheduler that goes away ends nothing; the next one hears everything again
        sched = _Scheduler(port, "secret")
        lines = [sched.read() for _ in range(6)]
        assert lines[0] == STANDBY_READY and f"started {pid} j-g1-r0" in lines
        sched.send({"stop": int(pid), "grace": 5})
        assert sched.read() == f"exited {pid} {128 + signal.SIGTERM}"
        sched.send({"stop": "x"})
        assert sched.read().startswith("refused ")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0  # its latest worker ended by the stop asked for (not a failure it saw)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    assert f"worker r4 pid {seen['j-g0-r4']}" in text and f"worker g1 pid {pid}" in text, text


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_pod_standbys_workers_end_with_it_as_a_containers_processes_do(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TENPLEX_NODE_IP": "127.0.0.1", "TENPLEX_WORKER_ID": "j-g0-r0",
           "SLEEP": "120"}
    proc = subprocess.Popen([sys.executable, "-m", "tenplex", "worker", "standby", "--port", str(port), "--", *JOB],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        sched = _Scheduler(port, "")
        assert sched.read() == STANDBY_READY
        word, pid, wid = sched.read().split()
        assert (word, wid) == ("started", "j-g0-r0")
        sched.close()
        os.kill(int(pid), 0)  # it runs
        proc.kill()  # the kubelet's SIGKILL after the grace period, or the standby crashing
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(int(pid)):
            assert time.monotonic() < deadline, f"worker {pid} outlived its pod's standby"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
