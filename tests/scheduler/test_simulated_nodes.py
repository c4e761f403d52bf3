"""Simulated node agents and simulated workers against the real scheduler: a scale-down, then a host lost.

The small version of ``benchmarks/control_plane.py --nodes simulated`` (16,384 workers on 2,048 simulated
nodes): the scheduler (REST API, controller, planner) is the product's, on the simulated-worker backend; its
daemons are :class:`tenplex.testing.simnodes.SimNodes` agents, which decode every sub-plan and move no data.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import struct
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tenplex.errors import InvalidInput
from tenplex.scheduler import api
from tenplex.scheduler.api import create_app
from tenplex.scheduler.server import build_scheduler
from tenplex.serving import BackgroundServer, bind_socket, url_for
from tenplex.store.client import StoreClient
from tenplex.testing.simnodes import SimNodes
from tenplex.testing.simworkers import ENV_AGENT, run_agent
from tenplex.transformer.remote import REQUEST_CONTENT_TYPE, encode_request

TOKEN = "sim-token"
MODEL = {"num_layers": 4, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 0, "normalization": "RMSNorm",
         "bias": False, "make_vocab_size_divisible_by": 8}


def call(url: str, method: str = "GET", body: Any = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Authorization": f"Bearer {TOKEN}",
                                                                         "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_scale_down_then_host_loss_on_simulated_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # every view counts as a large job's: GET /v1/jobs/{job} answers the last one, made again in the background
    monkeypatch.setattr(api, "VIEW_INLINE_S", 0.0)
    monkeypatch.setattr(api, "VIEW_REFRESH_S", 0.05)
    nodes = SimNodes(8, 2, token=TOKEN)
    agent = run_agent(step_seconds=0.05, nodes=nodes)
    scheduler = server = None
    try:
        agent_url = f"http://127.0.0.1:{agent.port}"
        hosts = call(f"{agent_url}/nodes/start", "POST", {})
        assert [h["name"] for h in hosts] == [f"node-{i}" for i in range(8)]
        (tmp_path / "hosts.json").write_text(json.dumps(hosts))
        monkeypatch.setenv(ENV_AGENT, agent_url)
        sock = bind_socket("127.0.0.1", 0)
        url = url_for("127.0.0.1", sock.getsockname()[1])
        scheduler = build_scheduler("tenplex.testing.simworkers:simulated_scheduler", tmp_path / "state", url, TOKEN,
                                    hosts_file=tmp_path / "hosts.json", heartbeat_interval=0.2, host_timeout=30.0)
        # the workers get the PTC from ptc_url (not inlined), through their node daemons
        scheduler.settings = dataclasses.replace(scheduler.settings, ptc_inline_limit=0)
        server = BackgroundServer(create_app(scheduler, token=TOKEN), sock=sock).start()

        # tp2 x pp2 x dp4 on 8 nodes of 2 GPUs (ZeRO-0: every shard on 4 dp replicas), then dp3 on 6 of them
        call(f"{url}/v1/jobs", "POST", {
            "name": "sim", "layout": {"provider": "megatron-gpt", "model": MODEL, "precision": "fp32"},
            "dataset": {"num_samples": 1 << 20, "global_batch_size": 48}, "command": ["simulated"],
            "gpus": 16, "min_gpus": 4, "max_gpus": 16, "steps": 1 << 30, "snapshot_every": 1 << 30,
            "policy": {"table": {"16": {"dp": 4, "tp": 2, "pp": 2}, "12": {"dp": 3, "tp": 2, "pp": 2}}}})

        def wait(pred: Any, what: str, timeout: float = 60.0) -> dict[str, Any]:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                st = call(f"{url}/v1/jobs/sim")["status"]
                assert st["phase"] != "Failed", st["message"]
                if pred(st):
                    return st
                time.sleep(0.1)
            raise AssertionError(f"timed out waiting for {what}: {st['phase']} {st['stage']} {st['message']}")

        def training(gen: int) -> Any:
            return lambda s: (s["phase"] == "Running" and s["generation"] == gen and len(s["workers"]) > 0
                              and all(w["registered"] for w in s["workers"]) and s["step"] > (s["restored_step"] or 0)
                              and s["downtime_started_at"] is None)

        wait(training(0), "16 workers training")
        # the PTC route gzips for a client that accepts it (every worker fetches a large PTC): the same JSON
        plain = urllib.request.Request(f"{url}/v1/jobs/sim/ptc", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(plain, timeout=30) as resp:
            assert resp.headers.get("Content-Encoding") is None
            raw = resp.read()
        plain.add_header("Accept-Encoding", "gzip")
        with urllib.request.urlopen(plain, timeout=30) as resp:
            assert resp.headers.get("Content-Encoding") == "gzip"
            assert gzip.decompress(resp.read()) == raw
        call(f"{url}/v1/jobs/sim/scale", "POST", {"gpus": 12})
        st = wait(training(1), "the job training in dp3")
        rec = st["history"][-1]
        assert (rec["from_gpus"], rec["to_gpus"]) == (16, 12) and st["parallel"]["dp"] == 3
        assert rec["bytes_remote"] + rec["bytes_local"] > 0  # the agents' reports, from the parts they decoded
        scaled_hosts = list(st["hosts"])
        assert len(scaled_hosts) == 6 and len(st["workers"]) == 12

        # a host of the dp3 job is lost: its agent stops answering, its ranks end as killed
        lost = scaled_hosts[1]
        killed = call(f"{agent_url}/nodes/kill", "POST", {"host": lost})
        assert killed["ranks_killed"] == 2
        st = wait(lambda s: training(2)(s) or training(3)(s), "the job recovered without the lost host", 90)
        rec, scaled = st["history"][-1], st["history"][-2]
        assert rec["reason"] == "failure" and "exited with code -9" in rec["error"], rec
        assert lost not in st["hosts"] and len(st["hosts"]) == 6 and len(st["workers"]) == 12
        # recovered from the scale-down's version, which the surviving dp replicas hold: no step lost beyond it
        assert rec["version_from"] == scaled["version_to"] and rec["to_config"] == scaled["to_config"], rec

        counts = call(f"{agent_url}/nodes/counts")
        c = counts["counts"]
        # every sub-plan of the two changes reached its agent and was decoded; none was refused
        assert c["parts received"] == c["parts decoded"] == 12 and not counts["refused"], counts
        assert c.get("parts refused", 0) == 0
        # every rank got its generation's PTC through its node daemon, which fetched it once per host
        ranks = call(f"{agent_url}/counts")
        assert ranks["ptc_relayed"] == 16 + 12 + 12 and ranks["ptc"] == 8 + 6 + 6, ranks
        # the 16 ranks of the first generation reported their snapshot and exit through their node daemons, whose
        # batches carry the reports of a host's ranks together
        assert ranks["snapshot"] >= 16 and ranks["exit"] >= 16, ranks
        assert ranks["report_batch"] < ranks["snapshot"] + ranks["exit"], ranks
    finally:
        if server is not None:
            server.stop(timeout=5)
        if scheduler is not None:
            scheduler.close()
        agent.stop(timeout=5)


def test_a_part_the_agent_cannot_read_is_refused() -> None:
    """The agents decode every sub-plan: a body that is not a transform request, or a part of another format
    version, is a 400 with the decoder's error, as a node daemon answers it, and nothing is recorded."""
    nodes = SimNodes(2, 8, token=TOKEN)
    agent = run_agent(nodes=nodes)
    try:
        hosts = call(f"http://127.0.0.1:{agent.port}/nodes/start", "POST", {})
        client = StoreClient(hosts[0]["store_url"], token=TOKEN, retries=0)
        with pytest.raises(InvalidInput, match="starts with"):
            client.request_json("POST", "/v1/jobs/j/transforms", b"garbage", content_type=REQUEST_CONTENT_TYPE)
        part = bytearray(encode_request("node-0", b"TPLXPART" + struct.pack("<II", 99, 0), {}, None))
        with pytest.raises(InvalidInput, match="format version 99"):
            client.request_json("POST", "/v1/jobs/j/transforms", bytes(part), content_type=REQUEST_CONTENT_TYPE)
        assert client.versions("j") == []
        counts = call(f"http://127.0.0.1:{agent.port}/nodes/counts")["counts"]
        assert counts["parts received"] == counts["parts refused"] == 2 and "parts decoded" not in counts
        client.close()
    finally:
        agent.stop(timeout=5)
