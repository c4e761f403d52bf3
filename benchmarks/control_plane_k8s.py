"""The control plane on Kubernetes at GPT-3 175B's layout: 1,024 simulated workers on 128 nodes, a scale-down and a
node loss, with the job's state in a real API server and every object it writes measured against its limit.

Issue 27, item 5(a), Kubernetes backend. What is real and what is simulated:

- real: etcd, kube-apiserver, kube-controller-manager (node lifecycle, garbage collector) and kube-scheduler
  v1.37 (``tenplex.testing.k8s``, built by ``make k8s-testbed``); the ElasticJob (CRD-validated) and its scale;
  the scheduler as ``tenplex scheduler serve --backend kubernetes`` runs it (:class:`~tenplex.k8s.operator.
  KubernetesScheduler`: the operator, the Kubernetes backend creating and deleting worker pods, the job store
  writing the job record, the generations' chunked PTCs and the ElasticJob status into the API server), with
  its REST API, controller and planner, in its own process; 128 Node objects with 8 ``nvidia.com/gpu`` each;
  a store pod per node and 128 worker pods of 8 ranks (``gpusPerPod: 8``), created, watched, deleted and
  garbage-collected by the API server's rules;
- simulated: the kubelets (:class:`~tenplex.testing.k8s.simkubelet.SimulatedRanksKubelet`, one per node with its
  own node credentials: node Lease and status, pod admission by GPUs, status reports, deletion confirmations;
  the containers are simulated ranks), the ranks (:mod:`tenplex.testing.simworkers`: the worker protocol over
  HTTP, no torch, no bytes), and the node stores (:mod:`tenplex.testing.simnodes`: every daemon request the
  scheduler makes is answered, every sub-plan is decoded with the daemon's decoder, nothing moves).

Processes besides this driver (which holds the control plane, creates the ElasticJob, scales it with the scale
subresource, probes ``GET /v1/jobs/{job}`` and watches the API server's objects): the scheduler (``--role
scheduler``, with the per-thread CPU sampler of ``control_plane.py``); the simulated nodes and ranks (``--role
cluster`` of ``control_plane_16k.py``); the 128 kubelets (``--role kubelets``).

The node loss: the node's simulated store stops answering, its ranks end as SIGKILLed, its kubelet stops; the
real node lifecycle controller marks the node Unknown once its Lease is ``--node-grace`` seconds old (kubelets
renew every ``--kubelet-heartbeat`` s), and the scheduler, watching nodes, recovers from the survivors' replicas.

The job: GPT-3 175B's real dimensions (``tenplex.testing.scale.GPT3_175B``, bf16; 4,628 tensors) as tp8 x pp16
x dp8 (ZeRO-0, so a lost node's shards have replicas), scaled down to tp8 x pp12 x dp8 (768 GPUs, 96 nodes).

Run: .venv/bin/python benchmarks/control_plane_k8s.py [--nodes 128] [--pp 16] [--pp-to 12] [--out DIR]
     (small: --nodes 16 --pp 2 --pp-to 1 --model toy)
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from control_plane import (
    JOB,
    TOKEN,
    CpuSampler,
    diff,
    pct,
    print_latencies,
    proc_cpu,
    read_json,
    request,
    top,
    training,
    wait_file,
    wait_status,
)
from control_plane_16k import StageProbe, planner_cpu, rss, steady_training

from tenplex.testing.processes import stop_processes

REPO = Path(__file__).resolve().parents[1]
NS = "default"
CONFIGMAP_LIMIT = 1 << 20
"""A ConfigMap's data may not exceed 1 MiB (the API server refuses it)."""
REQUEST_LIMIT = int(1.5 * (1 << 20))
"""etcd's default request limit (--max-request-bytes): no object written may exceed it."""


# -- the scheduler's process -----------------------------------------------------------------------------


def role_scheduler(args: argparse.Namespace) -> None:
    from kubernetes import config as kube_config

    from tenplex.k8s.operator import KubernetesScheduler
    from tenplex.k8s.settings import KubernetesSettings
    from tenplex.scheduler.api import create_app
    from tenplex.scheduler.controller import SchedulerSettings
    from tenplex.serving import bind_socket, serve_forever, url_for, write_port_file

    logging.basicConfig(filename=args.log, level=logging.INFO, format="%(created).3f %(name)s [%(threadName)s] %(message)s")
    sampler = CpuSampler(Path(args.profile)).start()
    sock = bind_socket("127.0.0.1", 0)
    url = url_for("127.0.0.1", sock.getsockname()[1])
    api_client = kube_config.new_client_from_config(args.kubeconfig)
    settings = KubernetesSettings(namespace=NS, identity="bench-scheduler", leader_election=False)
    scheduler = KubernetesScheduler(api_client, settings, SchedulerSettings(url=url, token=TOKEN, heartbeat_interval=1.0),
                                    Path(args.state_dir))
    scheduler.recover()
    write_port_file(args.port_file, sock.getsockname()[1])
    try:
        serve_forever(create_app(scheduler, token=TOKEN), sock, log_level="warning")
    finally:
        sampler.stop()
        scheduler.close()


# -- the kubelets' process -------------------------------------------------------------------------------


def role_kubelets(args: argparse.Namespace) -> None:
    """One simulated kubelet per node (each with its node's own credentials, from ``--kubeconfigs``), their ranks run
    by the agent at ``--agent``; ``POST /kill?node=N`` stops node N's kubelet (the node's loss). Apart from the
    driver, so that the driver's probe of the scheduler does not wait among 256 kubelet threads for the GIL."""
    import http.server

    from kubernetes import config as kube_config

    from tenplex.serving import write_port_file
    from tenplex.testing.k8s.simkubelet import AgentLink, SimulatedRanksKubelet

    logging.basicConfig(level=logging.WARNING, format="%(created).3f %(name)s [%(threadName)s] %(message)s")
    link = AgentLink(args.agent)
    kubelets: dict[str, SimulatedRanksKubelet] = {}
    for h in json.loads(Path(args.hosts_file).read_text()):
        api_client = kube_config.new_client_from_config(str(Path(args.kubeconfigs) / f"{h['name']}.kubeconfig"))
        kubelets[h["name"]] = SimulatedRanksKubelet(api_client, h["name"], h["address"], link,
                                                    heartbeat_seconds=args.kubelet_heartbeat)
        kubelets[h["name"]].start()

    class Kill(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            node = self.path.rsplit("=", 1)[-1]
            kubelet = kubelets.get(node)
            if kubelet is not None:
                kubelet.stop()
            self.send_response(200 if kubelet is not None else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Kill)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    write_port_file(args.port_file, server.server_address[1])
    stop.wait()
    server.shutdown()
    link.close()
    for k in kubelets.values():
        k._stop.set()  # all at once: each stop() below then only joins
    for k in kubelets.values():
        k.stop()


# -- what the API server holds ------------------------------------------------------------------------------


class ObjectSizes(threading.Thread):
    """Watches the namespace's ConfigMaps and ElasticJobs and records each object's largest serialized size (the
    JSON the API server stores, metadata included) and, for a ConfigMap, its data's (the 1 MiB limit's)."""

    def __init__(self, api_client: Any) -> None:
        super().__init__(name="object-sizes", daemon=True)
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.api_client = api_client
        self.largest: dict[str, tuple[int, int]] = {}
        """kind/name -> (largest object bytes, largest data bytes)."""
        self.writes = 0
        self.halt = threading.Event()
        self._lock = threading.Lock()

    def _record(self, kind: str, obj: dict[str, Any]) -> None:
        size = len(json.dumps(obj, separators=(",", ":")).encode())
        # the API server's ConfigMap limit: the keys and values of data and binaryData (decoded) together
        data = sum(len(k) + len(v.encode()) for k, v in (obj.get("data") or {}).items()) \
            + sum(len(k) + len(base64.b64decode(v)) for k, v in (obj.get("binaryData") or {}).items()) \
            if kind == "ConfigMap" else size
        key = f"{kind}/{obj['metadata']['name']}"
        with self._lock:
            self.writes += 1
            old = self.largest.get(key, (0, 0))
            self.largest[key] = (max(old[0], size), max(old[1], data))

    def _watch(self, kind: str, lister: Any) -> None:
        from kubernetes import watch

        while not self.halt.is_set():
            try:
                for ev in watch.Watch().stream(lister, NS, timeout_seconds=5):
                    obj = ev["object"]
                    if not isinstance(obj, dict):
                        obj = self.api_client.sanitize_for_serialization(obj)
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        self._record(kind, obj)
                    if self.halt.is_set():
                        return
            except Exception as exc:  # noqa: BLE001 - a dropped watch is listed again
                logging.getLogger(__name__).info("object watch %s: %s", kind, exc)
                self.halt.wait(0.5)

    def run(self) -> None:
        from tenplex.k8s import crd

        def jobs(namespace: str, **kw: Any) -> Any:
            return self.custom.list_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, **kw)

        t = threading.Thread(target=self._watch, args=("ElasticJob", jobs), daemon=True)
        t.start()
        self._watch("ConfigMap", self.core.list_namespaced_config_map)
        t.join(timeout=10)

    def report(self) -> list[str]:
        with self._lock:
            items = sorted(self.largest.items(), key=lambda kv: -kv[1][0])
        lines = []
        for key, (size, data) in items[:8]:
            lines.append(f"    {key:<40} {size / 1024:8.1f} KiB object" + (f", {data / 1024:8.1f} KiB data"
                                                                           if key.startswith("ConfigMap") else ""))
        over = [k for k, (size, data) in items if size > REQUEST_LIMIT or (k.startswith("ConfigMap") and data > CONFIGMAP_LIMIT)]
        lines.append(f"  objects over their limits (ConfigMap data 1 MiB, any object 1.5 MiB): {over or 'none'}")
        return lines


# -- the driver ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["driver", "scheduler", "kubelets"], default="driver")
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--pp-to", type=int, default=12)
    parser.add_argument("--model", choices=["175b", "toy"], default="175b")
    parser.add_argument("--window", type=float, default=10.0, help="seconds of steady training measured")
    parser.add_argument("--step-seconds", type=float, default=0.5)
    parser.add_argument("--kubelet-heartbeat", type=float, default=5.0, help="node Lease renewal (s)")
    parser.add_argument("--node-grace", default="20s", help="the node lifecycle controller's grace period")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--kubeconfig"), parser.add_argument("--state-dir"), parser.add_argument("--port-file")
    parser.add_argument("--log"), parser.add_argument("--profile")
    parser.add_argument("--agent"), parser.add_argument("--hosts-file"), parser.add_argument("--kubeconfigs")
    args = parser.parse_args()
    if args.role == "scheduler":
        return role_scheduler(args)
    if args.role == "kubelets":
        return role_kubelets(args)

    from kubernetes import client as kclient

    from tenplex.k8s import crd
    from tenplex.testing.k8s.cluster import TestCluster
    from tenplex.testing.k8s.controlplane import ControlPlane, User, binaries_dir, missing_binaries

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    tp, dp = args.gpus_per_node, args.dp
    gpus, gpus_to = dp * tp * args.pp, dp * tp * args.pp_to
    if gpus > args.nodes * tp:
        raise SystemExit(f"dp{dp} x tp{tp} x pp{args.pp} needs {gpus // tp} nodes, there are {args.nodes}")
    if args.model == "175b":
        from tenplex.testing.scale import GPT3_175B
        model: dict[str, Any] = {k: v for k, v in vars(GPT3_175B).items() if v is not None}
        precision = "bf16"
    else:
        model = {"num_layers": 4, "hidden": 64, "heads": 8, "vocab": 512, "seq_len": 0, "make_vocab_size_divisible_by": 8}
        precision = "fp32"
    missing = missing_binaries(binaries_dir(REPO))
    if missing:
        raise SystemExit(f"{', '.join(missing)} missing from {binaries_dir(REPO)}: run `make k8s-testbed`")
    out = args.out or Path(tempfile.mkdtemp(prefix="tenplex-control-plane-k8s-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: nproc={os.cpu_count()}, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"files in {out}", flush=True)
    here = Path(__file__).resolve()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    children: list[subprocess.Popen] = []
    clients: list[Any] = []

    def spawn(argv: list[str], log: str) -> subprocess.Popen:
        f = open(out / log, "ab")  # noqa: SIM115 - handed to the child
        p = subprocess.Popen([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        f.close()
        children.append(p)
        return p

    t = time.perf_counter()
    plane = ControlPlane(out / "k8s", binaries_dir(REPO), crds=(crd.crd_manifest(),),
                         node_monitor_grace_period=args.node_grace).start()
    api = TestCluster(plane)
    sizes: ObjectSizes | None = None
    try:
        api.install_crd()
        print(f"Kubernetes control plane up in {time.perf_counter() - t:.1f} s (node grace {args.node_grace})", flush=True)
        t = time.perf_counter()
        cluster = spawn([str(here.parent / "control_plane_16k.py"), "--role", "cluster", "--hosts", str(args.nodes),
                         "--gpus-per-host", str(tp), "--hosts-file", str(out / "hosts.json"),
                         "--port-file", str(out / "agent.port"), "--step-seconds", str(args.step_seconds)], "cluster.log")
        agent_url = f"http://127.0.0.1:{wait_file(out / 'agent.port', cluster, 'the cluster', 300)}"
        hosts = json.loads((out / "hosts.json").read_text())
        (out / "kubeconfigs").mkdir(exist_ok=True)
        for h in hosts:
            api.add_node(h["name"], gpus=tp, address=h["address"])
            port = int(h["store_url"].rsplit(":", 1)[1])
            api.create("pods", {
                "metadata": {"name": f"store-{h['name']}", "labels": {crd.LABEL_ROLE: crd.ROLE_STORE}},
                "spec": {"nodeName": h["name"], "automountServiceAccountToken": False, "containers": [
                    {"name": "store", "image": "tenplex:bench",
                     "ports": [{"name": "store", "containerPort": port, "hostPort": port}]}]}}, NS)
            (out / "kubeconfigs" / f"{h['name']}.kubeconfig").write_text(
                yaml.safe_dump(plane.kubeconfig(User.node(h["name"]))))
        kubelet_proc = spawn([str(here), "--role", "kubelets", "--agent", agent_url, "--hosts-file", str(out / "hosts.json"),
                              "--kubeconfigs", str(out / "kubeconfigs"), "--port-file", str(out / "kubelets.port"),
                              "--kubelet-heartbeat", str(args.kubelet_heartbeat)], "kubelets.log")
        kubelets_url = f"http://127.0.0.1:{wait_file(out / 'kubelets.port', kubelet_proc, 'the kubelets', 300)}"
        print(f"{args.nodes} nodes (simulated stores, kubelets, store pods) up in {time.perf_counter() - t:.1f} s",
              flush=True)
        kubeconfig = out / "scheduler.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(plane.kubeconfig()))
        sched = spawn([str(here), "--role", "scheduler", "--kubeconfig", str(kubeconfig), "--state-dir",
                       str(out / "state"), "--port-file", str(out / "scheduler.port"), "--log", str(out / "scheduler.log"),
                       "--profile", str(out / "scheduler-cpu.json")], "scheduler.out")
        url = f"http://127.0.0.1:{wait_file(out / 'scheduler.port', sched, 'the scheduler', 300)}"
        admin = api.api_client()
        clients.append(admin)
        sizes = ObjectSizes(admin)
        sizes.start()
        custom = kclient.CustomObjectsApi(admin)

        table = [{"gpus": gpus, "dp": dp, "tp": tp, "pp": args.pp, "zero": 0},
                 {"gpus": gpus_to, "dp": dp, "tp": tp, "pp": args.pp_to, "zero": 0}]
        ej = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": JOB, "namespace": NS},
              "spec": {"image": "tenplex:bench", "command": ["simulated"], "gpus": gpus, "minGpus": tp * args.pp_to,
                       "maxGpus": gpus, "gpusPerPod": tp,
                       "layout": {"provider": "megatron-gpt", "model": model, "precision": precision},
                       "training": {"steps": 1 << 30, "snapshotEvery": 1 << 30, "heartbeatTimeoutSeconds": 600,
                                    "dataset": {"numSamples": 1 << 30, "globalBatchSize": 1536}},
                       "policy": {"type": "table", "table": table}}}
        t = time.perf_counter()
        api.create("elasticjobs", ej, NS)

        def wait(pred: Any, what: str, timeout: float = 900.0) -> dict[str, Any]:
            return wait_status(url, JOB, pred, what, timeout)

        wait(lambda s: training(0)(s) and s["step"] >= 2, f"{gpus} workers registered and training")
        print(f"ElasticJob on {gpus} GPUs (dp{dp} x tp{tp} x pp{args.pp}, {gpus // tp} worker pods of {tp} ranks) "
              f"training after {time.perf_counter() - t:.1f} s; scheduler RSS {rss(sched.pid)[0]:.0f} MiB "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
        steady_training(agent_url, out / "scheduler-cpu.json", sched.pid, args.window, 8)

        results: list[dict[str, Any]] = []

        def change(name: str, act: Any, done: Any, data_of: Any, detection: bool = False) -> dict[str, Any]:
            probe = StageProbe(url)
            probe.start()
            time.sleep(1.0)
            prof_a, cpu_a = read_json(out / "scheduler-cpu.json"), proc_cpu(sched.pid)
            nodes_a = request(f"{agent_url}/nodes/counts")["counts"]
            t_req = time.time()
            act()
            st = wait(done, name)
            rec = st["history"][-1]
            t_done = rec["finished_at"]
            time.sleep(0.5)
            probe.halt.set()
            probe.join()
            prof_b, cpu_b = read_json(out / "scheduler-cpu.json"), proc_cpu(sched.pid)
            nodes = request(f"{agent_url}/nodes/counts")
            marks = rec["marks"]
            total = t_done - t_req
            noticed = marks["requested"] - t_req if detection else 0.0
            planning = marks["planned"] - marks.get("committed", marks["requested"])
            data = data_of()
            prof = diff(prof_a, prof_b)
            now_rss, peak_rss = rss(sched.pid)
            print(f"\n{name}: {rec['from_config']} -> {rec['to_config']} ({rec['from_gpus']} -> {rec['to_gpus']} GPUs), "
                  f"reason {rec['reason']}, load {os.getloadavg()[0]:.1f}", flush=True)
            for k, v in sorted(marks.items(), key=lambda kv: kv[1]):
                print(f"    {v - t_req:+8.2f} s  {k}")
            print(f"    {total:+8.2f} s  training again (the scheduler sees the new generation's first step)")
            parts = {k: nodes["counts"].get(k, 0) - nodes_a.get(k, 0) for k in
                     ("parts received", "parts decoded", "parts refused")}
            print(f"  sub-plans: {parts}; phases (job record): "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in rec["phases"].items()))
            beyond = total - noticed - planning - data
            print(f"  total {total:.2f} s = " + (f"detection {noticed:.2f} s (node lifecycle controller, grace "
                                                 f"{args.node_grace}) + " if detection else "")
                  + f"planning {planning:.2f} s (planner CPU {planner_cpu(prof):.2f} s) + data {data:.2f} s + "
                  f"orchestration {beyond:.2f} s")
            window = print_latencies(probe, t_req, t_done, " (target p99 < 100 ms)")
            print(f"  scheduler: CPU {cpu_b - cpu_a:.1f} s in {total:.1f} s; RSS {now_rss:.0f} MiB, peak {peak_rss:.0f} MiB")
            for line in top(prof, 10, total):
                print(line)
            sys.stdout.flush()
            result = {"name": name, "total": total, "detection": noticed, "planning": planning, "data": data,
                      "orchestration": beyond, "p99_ms": 1e3 * pct(window, 0.99), "p50_ms": 1e3 * pct(window, 0.5),
                      "rss_mib": now_rss, "peak_rss_mib": peak_rss, "cpu_s": cpu_b - cpu_a, "parts": parts,
                      "record": rec, "status": st, "load": os.getloadavg()[0]}
            results.append(result)
            return result

        def snapshot_time() -> float:
            tl = request(f"{agent_url}/timeline").get(f"{JOB}/g0", {})
            return tl.get("snapshot_written", 0.0) - tl.get("stop_step", 0.0)

        def scale() -> None:
            custom.patch_namespaced_custom_object_scale(crd.GROUP, crd.VERSION, NS, crd.PLURAL, JOB,
                                                        {"spec": {"replicas": gpus_to}})

        scaled = change(f"scale-down pp{args.pp} -> pp{args.pp_to} (kubectl scale)", scale,
                        lambda s: training(1)(s) and s["history"] and s["history"][-1]["finished_at"] is not None,
                        snapshot_time)
        st = scaled["status"]
        assert scaled["parts"]["parts decoded"] >= len(st["hosts"]) and not scaled["parts"]["parts refused"], \
            scaled["parts"]
        lost = sorted(st["hosts"])[len(st["hosts"]) // 3]
        gen = st["generation"]

        def kill() -> None:
            request(f"{agent_url}/nodes/kill", "POST", {"host": lost})
            urllib.request.urlopen(urllib.request.Request(f"{kubelets_url}/kill?node={lost}", data=b"", method="POST"),
                                   timeout=60).read()

        loss = change(f"loss of node {lost}", kill,
                      lambda s: (training(gen + 1)(s) and s["history"][-1]["reason"] == "failure"
                                 and s["history"][-1]["finished_at"] is not None), lambda: 0.0, detection=True)
        rec = loss["record"]
        print(f"  recovered from {rec['version_from']} (the scale-down's {scaled['record']['version_to']}); "
              f"{lost} among the new hosts: {lost in loss['status']['hosts']}")
        time.sleep(2.0)
        pods = api.list("pods", NS, label_selector=crd.worker_selector(JOB))
        print(f"\nworker pods now: {len(pods)} ({sum(1 for p in pods if (p.get('status') or {}).get('phase') == 'Running')} "
              f"Running); the API server's objects (largest serialized sizes, {sizes.writes} writes seen):")
        for line in sizes.report():
            print(line)
        (out / "results.json").write_text(json.dumps(
            {"changes": [{k: v for k, v in r.items() if k != "status"} for r in results],
             "objects": {k: {"bytes": a, "data_bytes": b} for k, (a, b) in sizes.largest.items()}}, indent=1, default=str))
        print(f"\nload average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        if sizes is not None:
            sizes.halt.set()
        stop_processes(reversed(children), signal.SIGTERM, grace=30)
        for c in clients:
            with contextlib.suppress(Exception):
                c.close()
        api.close()
        plane.stop()


if __name__ == "__main__":
    main()
