"""The job's persisted state at the scale the planner claims: record and API-server object sizes, plan recompute.

For GPT-3 175B (tp8 x pp16 x dp8, 1,024 GPUs on 128 hosts) and a 405B GPT with
ZeRO-1 (tp8 x pp16 x dp128, 16,384 GPUs on 2,048 hosts), each through a
scale-down and a host loss (the layouts of benchmarks/plan_scale.py), this
builds the job record as the scheduler holds it in the transferring stage of
the change (the new generation's workers, named and placed as the launcher
does, registered and heartbeating; the history; the plan's inputs, not the
plan) and measures, offline:

- the record as the local backend's state directory writes it (JSON) and as
  the Kubernetes job store writes it (the ``<job>-tenplex-state`` ConfigMap,
  serialized as sent to the API server: gzip + base64 inside JSON);
- every ConfigMap that holds a generation's PTC (chunks of 512 KiB of gzip)
  serialized the same way, against the 1 MiB object limit;
- the time to compute the plan again from the record's inputs and the PTCs
  (what a restarted scheduler does), and that it is the same plan (every host's
  encoded part compared byte for byte);
- with --json, the plan as JSON and gzipped (what the record held before).

The worker pids are those of processes launched one after another (increasing,
small gaps), as on the local backend; on Kubernetes every pod has its own pid
namespace and the pids repeat, which compresses better.

With --apiserver, every job's objects are also written through the product's
Kubernetes job store to a real kube-apiserver and etcd (the test control plane,
in a temporary directory) and read back as a restarted scheduler reads them.

Run: .venv/bin/python benchmarks/record_scale.py [--cases 175b,405b] [--json] [--apiserver]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_scale import timed_build  # noqa: E402

from tenplex.k8s.jobstore import (  # noqa: E402
    CONFIGMAP_LIMIT,
    owned_configmap,
    ptc_chunks,
    state_configmap,
    state_data,
)
from tenplex.ptc import PTC, ParallelConfig  # noqa: E402
from tenplex.scheduler.plans import PlanInputs  # noqa: E402
from tenplex.scheduler.state import JobStatus  # noqa: E402
from tenplex.testing.scale import Change, changes, transferring_record  # noqa: E402
from tenplex.transformer import part  # noqa: E402

JOB = "big"
JOB_OBJ = {"apiVersion": "tenplex.io/v1alpha1", "kind": "ElasticJob",
           "metadata": {"name": JOB, "namespace": "training", "uid": "6f0c1e2a-0000-4000-8000-000000000001"}}


def serialized(body: dict) -> int:
    return len(json.dumps(body, separators=(",", ":")))


def timed(model: object, parallel: ParallelConfig, **kwargs: object) -> PTC:
    what = f"dp{parallel.dp} x tp{parallel.tp} x pp{parallel.pp} on {len(kwargs['hosts'])} hosts"  # type: ignore[arg-type]
    return timed_build(what, model, parallel, **kwargs)


def through_apiserver(plane_root: Path, found: list[Change]) -> None:
    """Write every job's objects through the product's Kubernetes job store to a real kube-apiserver (the test
    control plane of tests/k8s, on 127.0.0.1), read them back as a restarted scheduler does, and print their
    sizes as the server stores them."""
    from tenplex.k8s.jobstore import ElasticJobIndex, KubeJobStore
    from tenplex.k8s.settings import KubernetesSettings
    from tenplex.testing.k8s.cluster import running_cluster
    from tenplex.testing.k8s.controlplane import binaries_dir, missing_binaries

    bin_dir = binaries_dir(Path(__file__).resolve().parents[1])
    if missing := missing_binaries(bin_dir):
        raise SystemExit(f"--apiserver: {', '.join(missing)} not built in {bin_dir}: run `make k8s-testbed`")
    with running_cluster(plane_root, bin_dir) as cluster:
        settings = KubernetesSettings(namespace="default", identity="record-scale", leader_election=False)
        with cluster.api_client() as api_client:
            index = ElasticJobIndex(api_client, settings, watch_timeout=5)
            index.start()
            try:
                for n, change in enumerate(found):
                    job = f"{JOB}{n}"
                    spec, status = transferring_record(job, change)
                    cluster.create("elasticjobs", _elasticjob(job), "default")
                    deadline = time.monotonic() + 30
                    while index.find(job) is None and time.monotonic() < deadline:
                        time.sleep(0.05)
                    store = KubeJobStore(api_client, index, plane_root / "jobs")
                    start = time.perf_counter()
                    store.save_ptc(job, 0, change.old)
                    store.save_ptc(job, 1, change.new)
                    store.save(spec, status)
                    wrote = time.perf_counter() - start
                    sizes = {cm.metadata.name: serialized(api_client.sanitize_for_serialization(cm))
                             for cm in store.core.list_namespaced_config_map("default").items
                             if cm.metadata.name.startswith(f"{job}-tenplex-")}
                    start = time.perf_counter()
                    again = KubeJobStore(api_client, index, plane_root / "again")  # as a restarted scheduler
                    ptc, loaded = again.load_ptc(job, 1), again.load(job)
                    read = time.perf_counter() - start
                    same = (loaded is not None and ptc.to_json() == change.new.to_json()
                            and loaded[1].to_record() == JobStatus.from_json(status.to_record()).to_record())
                    print(f"{change.name}: through kube-apiserver: {len(sizes)} ConfigMaps, largest "
                          f"{max(sizes.values()) / 1024:.0f} KiB as stored (limit {CONFIGMAP_LIMIT // 1024} KiB), "
                          f"{sum(sizes.values()) / 1024:.0f} KiB in all; written in {wrote:.2f} s, read back in "
                          f"{read:.2f} s; read back equal: {same}")
                    assert same and max(sizes.values()) < CONFIGMAP_LIMIT
            finally:
                index.stop()


def _elasticjob(name: str) -> dict:
    from tenplex.k8s import crd

    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name, "namespace": "default"},
            "spec": {"image": "tenplex:bench", "command": ["python", "-m", "train"], "gpus": 8, "minGpus": 1,
                     "maxGpus": 8, "layout": {"provider": "megatron-gpt", "model": {"num_layers": 2, "hidden": 16,
                                                                                      "heads": 2, "vocab": 64,
                                                                                      "seq_len": 8}}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="175b,405b")
    parser.add_argument("--json", action="store_true", help="also the plan as JSON (what the record held before)")
    parser.add_argument("--apiserver", action="store_true",
                        help="also write every job's objects to a real kube-apiserver (the test control plane, "
                             "`make k8s-testbed` builds it, started in a temporary directory) and read them back")
    args = parser.parse_args()
    print(f"machine: nproc={os.cpu_count()}, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    found: list[Change] = []
    for case in args.cases.split(","):
        for change in changes(case.strip(), timed):
            old, new = change.old, change.new
            inputs = change.inputs(JOB)
            plan = inputs.plan(old, new)
            spec, status = transferring_record(JOB, change)
            found.append(change)
            local = len(json.dumps({"spec": spec.to_json(), "status": status.to_record()}, separators=(",", ":")))
            cm = serialized(owned_configmap(JOB_OBJ, state_configmap(JOB), state_data(spec, status)))
            print(f"{change.name}: {len(status.workers)} workers on {len(status.hosts)} hosts")
            print(f"  job record: state directory {local / 1024:.1f} KiB of JSON; Kubernetes state ConfigMap "
                  f"{cm / 1024:.1f} KiB serialized (limit 1024 KiB; target <= 64 KiB)")
            for gen, ptc in ((0, old), (1, new)):
                sizes = [serialized(owned_configmap(JOB_OBJ, n, d, t)) for n, d, t in ptc_chunks(JOB, gen, ptc)]
                assert max(sizes) < CONFIGMAP_LIMIT
                print(f"  PTC generation {gen} ({sum(len(t.shards) for t in ptc.tensors)} shards): {len(sizes)} "
                      f"ConfigMap{'s' if len(sizes) > 1 else ''}, largest {max(sizes) / 1024:.0f} KiB serialized, "
                      f"{sum(sizes) / 1024:.0f} KiB in all")
            back = JobStatus.from_json(json.loads(json.dumps(status.to_record())))
            again_inputs = PlanInputs.from_json(back.last_plan["inputs"] if back.last_plan else None)
            start, cpu = time.perf_counter(), time.process_time()
            again = again_inputs.plan(old, new)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            same = all(part.encode(again, h) == part.encode(plan, h) for h in plan.hosts)
            print(f"  plan computed again from the record: {wall:.2f} s (CPU {cpu:.2f} s), load "
                  f"{os.getloadavg()[0]:.1f}; the same plan (every host's part byte for byte): {same}")
            assert same
            if args.json:
                text = plan.dumps().encode()
                print(f"  the plan as JSON (stored before): {len(text) / 2**20:.1f} MiB, gzipped "
                      f"{len(gzip.compress(text, 6)) / 2**20:.2f} MiB")
    if args.apiserver:
        with tempfile.TemporaryDirectory(prefix="record-scale-") as root:
            through_apiserver(Path(root), found)


if __name__ == "__main__":
    main()
