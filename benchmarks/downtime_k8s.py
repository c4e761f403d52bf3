"""Downtime of reconfigurations on Kubernetes (the test cluster), with and without standby pods (issue 18, item 3).

The same job and events as ``benchmarks/downtime.py`` (the reference GPT job,
dp1 tp2 <-> dp2 tp2), run by the Kubernetes backend: the test cluster's kube-apiserver, etcd,
controller-manager and scheduler v1.37.2 (``make k8s-testbed``), three nodes of two GPUs, each with a test kubelet that runs its pods
as processes (tenplex.testing.k8s.kubelet.LocalKubelet) and a real store
daemon as its store pod, and the scheduler (KubernetesScheduler with its REST
API for the workers). The job is an ElasticJob with one GPU per worker pod,
``spec.standby`` on or off. Events, each once the job trains steadily:

- scale up 2 -> 4 (``kubectl scale``): node-0's two pods are kept with
  standby; the new node's two pods are new either way;
- scale down 4 -> 2: with standby the kept node's pods take the new workers;
- failure: a worker process SIGKILLed (with standby inside its pod, which
  lives on; without, the pod's process, so the pod fails);
- redeploy: the job's first node cordoned; its workers move to the free node
  (new pods either way), the other node's pods are kept with standby.

"Data" and "fixed" as in downtime.py: fixed = downtime - (final snapshot +
transfer + restore). What a kubelet costs on a real node (pulling nothing,
creating the sandbox and container: about a second) is not in the test cluster (its kubelets run processes),
so the numbers without standby are a lower bound of a real cluster's; with
standby a kept pod starts nothing of that. The target (fixed <= 1.5 s) is the
issue's for the local backend; it is printed here for comparison.

Run: .venv/bin/python benchmarks/downtime_k8s.py [--sizes demo] [--standby on off] [--json OUT]
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import signal
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import downtime as local  # noqa: E402
from kubernetes import client  # noqa: E402

from tenplex.core.units import human_bytes  # noqa: E402
from tenplex.k8s import crd  # noqa: E402
from tenplex.k8s.backend import LABEL_STANDBY  # noqa: E402
from tenplex.k8s.operator import KubernetesScheduler  # noqa: E402
from tenplex.k8s.settings import KubernetesSettings  # noqa: E402
from tenplex.scheduler.api import create_app  # noqa: E402
from tenplex.scheduler.cli import phases_table  # noqa: E402
from tenplex.scheduler.controller import SchedulerSettings  # noqa: E402
from tenplex.serving import BackgroundServer, bind_socket  # noqa: E402
from tenplex.sockets import free_port  # noqa: E402
from tenplex.testing.k8s.cluster import TestCluster, running_cluster  # noqa: E402
from tenplex.testing.k8s.controlplane import User, binaries_dir  # noqa: E402
from tenplex.testing.k8s.kubelet import LocalKubelet, wait_for  # noqa: E402

NS = "default"
TOKEN = "downtime-token"
NODES = {"node-0": "127.0.9.2", "node-1": "127.0.9.3", "node-2": "127.0.9.4"}
STORE_LABELS = {crd.LABEL_ROLE: crd.ROLE_STORE, "app.kubernetes.io/name": "tenplex"}


def elasticjob(size: str, standby: bool) -> dict[str, Any]:
    model, batch, _every = local.SIZES[size]
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": f"down-{size}-{'sb' if standby else 'nosb'}", "namespace": NS},
            "spec": {"image": "tenplex:bench", "command": local.command(model, batch), "gpus": 2, "minGpus": 1,
                     "maxGpus": 6, "standby": standby,
                     "layout": {"provider": "example-gpt", "model": model},
                     "policy": {"type": "table", "table": [{"gpus": 2, "dp": 1, "tp": 2, "pp": 1},
                                                           {"gpus": 4, "dp": 2, "tp": 2, "pp": 1}]},
                     "env": [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "GLOO_SOCKET_IFNAME", "value": "lo"}],
                     "training": {"steps": 100000, "snapshotEvery": 1000, "heartbeatTimeoutSeconds": 300,
                                  "dataset": {"numSamples": 100000, "globalBatchSize": batch}}}}


def start_cluster(api: TestCluster, root: Path, stack: ExitStack) -> dict[str, LocalKubelet]:
    """Three nodes of two GPUs, each with a kubelet running its pods and a store daemon as its store pod."""
    kubelets = {}
    api.create("secrets", {"metadata": {"name": "tenplex-auth"},
                           "data": {"token": base64.b64encode(TOKEN.encode()).decode()}}, NS)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(REPO)}
    for node, ip in NODES.items():
        api.add_node(node, gpus=2, address=ip)
        kubelet = LocalKubelet(stack.enter_context(api.api_client(User.node(node))), node, ip, root / node,
                               base_env=env, cwd=REPO)
        kubelets[node] = stack.enter_context(kubelet)
        port = free_port(ip)
        api.create("pods", {
            "metadata": {"name": f"store-{node}", "namespace": NS, "labels": dict(STORE_LABELS)},
            "spec": {"nodeName": node, "automountServiceAccountToken": False, "containers": [{
                "name": "store", "image": "tenplex:bench",
                "ports": [{"name": "store", "containerPort": port, "hostPort": port}],
                "command": [sys.executable, "-m", "tenplex", "store", "serve", "--root", str(root / node / "store"),
                            "--host", ip, "--port", str(port)],
                "env": [{"name": "TENPLEX_TOKEN", "valueFrom": {"secretKeyRef": {"name": "tenplex-auth",
                                                                                 "key": "token"}}}]}]}}, NS)
    wait_for(lambda: all((api.get("pods", f"store-{n}", NS).get("status") or {}).get("phase") == "Running"
                         for n in NODES), 60, 0.1, "the store pods running")
    return kubelets


def run(size: str, standby: bool, root: Path) -> list[dict[str, Any]]:
    """The four events on a fresh cluster under ``root`` (the kubelets' pod logs and the scheduler's state)."""
    every = local.SIZES[size][2]
    job = elasticjob(size, standby)
    name = job["metadata"]["name"]
    with ExitStack() as stack:
        api = stack.enter_context(running_cluster(root / "control-plane", binaries_dir(REPO)))
        kubelets = start_cluster(api, root / "nodes", stack)
        sock = bind_socket("127.0.0.1", 0)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        settings = KubernetesSettings(namespace=NS, identity="scheduler-0", auth_secret="tenplex-auth")
        admin = stack.enter_context(api.api_client())
        # Rendezvous and standby ports below this machine's ephemeral range (as production's 29500-29999 are).
        sched = KubernetesScheduler(admin, settings, SchedulerSettings(url=url, token=TOKEN, heartbeat_interval=0.3),
                                    root / "sched", master_ports=(29400, 29499), watch_timeout=10, stop_margin=3.0)
        server = BackgroundServer(create_app(sched, token=TOKEN), sock=sock).start()
        stack.callback(server.stop)
        stack.callback(sched.close)
        sched.recover()
        if not sched.operator.leading.wait(30):
            raise RuntimeError("the scheduler never took the Lease")

        def status() -> dict[str, Any]:
            ctl = sched.find(name)
            if ctl is None:
                return {}
            with ctl.lock:
                st = ctl.status.to_json()
            if st["phase"] == "Failed":
                raise RuntimeError(f"{name} failed: {st['message']}")
            return st

        def steady(gen: int, what: str) -> dict[str, Any]:
            pred = local.steady(gen, every)
            return wait_for(lambda: (st := status()) and pred(st) and st, 600, 0.1, what)

        def scale(n: int) -> None:
            client.CustomObjectsApi(admin).patch_namespaced_custom_object_scale(
                crd.GROUP, crd.VERSION, NS, crd.PLURAL, name, {"spec": {"replicas": n}})

        api.create("elasticjobs", job, NS)
        steady(0, "training on 2 GPUs")
        scale(4)
        steady(1, "training on 4 GPUs")
        scale(2)
        st = steady(2, "training on 2 GPUs again")
        victim = st["workers"][-1]
        if standby:  # the worker's process, inside its pod (the pod and its standby live on)
            pod = next(p for p in sched.kube_backend.job_pods(name)
                       if victim["worker_id"] in (p["metadata"].get("annotations") or {}).get("tenplex.io/workers", ""))
            assert (pod["metadata"].get("labels") or {}).get(LABEL_STANDBY) == "true"
            link = sched.kube_backend.standbys.link(pod["metadata"]["uid"])
            assert link is not None
            os.kill(link.pids[victim["worker_id"]], signal.SIGKILL)
        else:  # the pod's process: the kubelet reports the pod Failed
            node = next(p["spec"]["nodeName"] for p in sched.kube_backend.job_pods(name)
                        if p["metadata"]["name"] == victim["worker_id"])
            kubelets[node].kill(victim["worker_id"], NS)
        st = steady(3, "recovering from the failure")
        api.cordon_node(st["hosts"][0])
        steady(4, "moving off the cordoned node")
        final = status()
    from rich.console import Console

    Console(width=200).print(phases_table(final["history"]))
    rows = []
    for rec in final["history"]:
        if rec["downtime_seconds"] is None:  # interrupted by the next event (a failure during it): no downtime
            print(f"{rec['reason']} {rec['from_hosts']} -> {rec['to_hosts']} did not finish: {rec['error']}", flush=True)
            continue
        rows.append(local.record_row(rec, size, standby))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", choices=sorted(local.SIZES), default=["demo"])
    ap.add_argument("--standby", nargs="+", choices=["on", "off"], default=["on", "off"])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="run in this directory and keep it (pod logs, scheduler state)")
    args = ap.parse_args(argv)
    local.keep_is_new(ap, args)
    logging.basicConfig(level=logging.WARNING)
    results = []
    for size, sb, rows in local.each_run(args, run, "downtime-k8s-"):
        results += rows
        for r in rows:
            ok = "meets" if r["fixed_s"] <= local.TARGET_FIXED_S else "misses"
            launch = sum(r["phases"].get(k, 0.0) for k in ("launch", "imports"))
            print(f"{size:5s} standby {sb:3s} {r['event']:8s} {r['from_hosts']} -> {r['to_hosts']}: downtime "
                  f"{r['downtime_s']:6.2f} s = data {r['data_s']:5.2f} s + fixed {r['fixed_s']:5.2f} s ({ok} "
                  f"{local.TARGET_FIXED_S} s); launch+imports {launch:.2f} s, first step "
                  f"{r['phases'].get('first_step', 0.0):.2f} s; moved {human_bytes(r['bytes_remote'])} remote",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
