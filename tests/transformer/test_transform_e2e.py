"""End-to-end transforms on 4 emulated hosts (real store daemons on 127.0.0.2..5).

Old states of tiny Megatron GPT models are cut from random full tensors and
stored per the old layout; after planning and executing every host's part,
every new device's shards must equal the original tensors' slices bit for bit
(vocabulary padding that only the new layout has must be zeros).
"""

from __future__ import annotations

import zlib

import pytest

from tenplex.ptc import DatasetState, ParallelConfig
from tenplex.ptc.megatron import GPTSpec, megatron_gpt_ptc
from tenplex.transformer.plan import make_plan

from .conftest import check_new_state, populate, random_state, transform_all

pytestmark = pytest.mark.slow

SPEC = GPTSpec(num_layers=3, hidden=16, heads=4, vocab=100, make_vocab_size_divisible_by=8, seq_len=8, bias=False)
DATASET = DatasetState(num_samples=1000, seed=7, global_batch_size=8, consumed_samples=96)


def layout(cfg: ParallelConfig, gpus_per_node: int, hosts: list[str], precision: str):
    return megatron_gpt_ptc(SPEC, cfg, gpus_per_node=gpus_per_node, hosts=hosts, precision=precision, dataset=DATASET)


# (old config, old gpus per node, old hosts) -> (new config, new gpus per node, new hosts)
TRANSITIONS = {
    "dp2tp2-to-tp4pp2": ((ParallelConfig(dp=2, tp=2), 2, ["h0", "h1"]), (ParallelConfig(tp=4, pp=2), 4, ["h1", "h2"])),
    "dp4-to-tp2pp2": ((ParallelConfig(dp=4), 1, ["h0", "h1", "h2", "h3"]), (ParallelConfig(tp=2, pp=2), 2, ["h0", "h1"])),
    "tp2pp2-to-dp4": ((ParallelConfig(tp=2, pp=2), 2, ["h0", "h1"]), (ParallelConfig(dp=4), 1, ["h0", "h1", "h2", "h3"])),
    "uneven-pipeline": (
        (ParallelConfig(dp=2, pp=2, layers_per_stage=(1, 2)), 2, ["h0", "h1"]),
        (ParallelConfig(tp=2, pp=2, layers_per_stage=(2, 1)), 2, ["h1", "h2"]),
    ),
    "zero1-dp2-to-dp4": (
        (ParallelConfig(dp=2, tp=2, zero=1), 2, ["h0", "h1"]),
        (ParallelConfig(dp=4, zero=1), 2, ["h1", "h2"]),
    ),
    "fsdp-dp4-to-dp2tp2": (
        (ParallelConfig(dp=4, zero=3), 2, ["h0", "h1"]),
        (ParallelConfig(dp=2, tp=2, zero=3), 2, ["h2", "h3"]),
    ),
    "redeploy-new-hosts": ((ParallelConfig(dp=2, tp=2), 2, ["h0", "h1"]), (ParallelConfig(dp=2, tp=2), 2, ["h2", "h3"])),
}


# bf16 precision holds bfloat16 parameters and float32 optimizer state, so it covers both dtypes;
# fp32 precision (float32 only) runs for the transitions that change tp, dp and the ZeRO partition.
CASES = [(name, "bf16") for name in TRANSITIONS] + [("dp2tp2-to-tp4pp2", "fp32"), ("zero1-dp2-to-dp4", "fp32")]


@pytest.mark.parametrize(("name", "precision"), CASES)
def test_transition_bit_exact(cluster, name: str, precision: str) -> None:
    (ocfg, ogpn, ohosts), (ncfg, ngpn, nhosts) = TRANSITIONS[name]
    old = layout(ocfg, ogpn, ohosts, precision)
    new = layout(ncfg, ngpn, nhosts, precision)
    state = random_state(old, seed=zlib.crc32(name.encode()))
    job = f"job-{name}"
    populate(cluster, old, state, job, "s5-g0")
    plan = make_plan(old, new, job=job, old_version="s5-g0", new_version="s5-g1")
    assert plan.network_bytes == plan.lower_bound_bytes
    assert plan.dataset is not None and plan.dataset.consumed_samples == DATASET.consumed_samples
    reports = transform_all(cluster, plan)
    assert sum(r.bytes_remote for r in reports.values()) == plan.network_bytes
    assert sum(r.bytes_local for r in reports.values()) == plan.local_bytes
    assert sum(r.bytes_zero for r in reports.values()) == plan.zero_fill_bytes
    assert check_new_state(cluster, new, state, job, "s5-g1") == sum(len(new.shards_on_host(h)) for h in new.hosts)
    # The old version is still there, committed, on every old host.
    for h in ohosts:
        assert any(v.committed and str(v.version) == "s5-g0" for v in cluster.clients[h].versions(job))


def test_the_daemons_run_every_hosts_part_in_parallel(cluster) -> None:
    """The target hosts' daemons pull their own pieces: the reports add up to the plan, kept shards are
    linked, and each daemon's /metrics counts its transform."""
    from tenplex.transformer.remote import PlanRun

    (ocfg, ogpn, ohosts), (ncfg, ngpn, nhosts) = TRANSITIONS["dp4-to-tp2pp2"]
    old = layout(ocfg, ogpn, ohosts, "fp32")
    new = layout(ncfg, ngpn, nhosts, "fp32")
    state = random_state(old, seed=3)
    populate(cluster, old, state, "par", "s1-g0")
    plan = make_plan(old, new, job="par", old_version="s1-g0", new_version="s1-g1")
    seen: dict[str, int] = {}

    def progress(statuses) -> None:
        for h, st in statuses.items():
            seen[h] = max(st.bytes_done, seen.get(h, 0))

    run = PlanRun(plan, {h: s.url for h, s in cluster.servers.items()}, token=None,
                  client_for=lambda url: next(c for c in cluster.clients.values() if c.url == url))
    reports = run.wait(poll_interval=0.05, timeout=120, progress=progress)
    assert set(reports) == set(plan.hosts) == set(seen)
    assert all(seen[h] == plan.hosts[h].bytes_total for h in plan.hosts)
    assert sum(r.bytes_remote for r in reports.values()) == plan.network_bytes
    assert sum(r.bytes_local for r in reports.values()) == plan.local_bytes
    for host in plan.hosts:
        text = cluster.clients[host].metrics()
        assert 'tenplex_transforms_total{outcome="ok"} 1.0' in text, text
    check_new_state(cluster, new, state, "par", "s1-g1")


def test_zero_dim_tensors_move(cluster) -> None:
    """0-d state (AdamW's step counter) must land in the destination buffer, not in a scalar copy."""
    from tenplex.ptc import PTC, Device, Region, Shard, Tensor, TensorKind

    def ptc(hosts: list[str]) -> PTC:
        devices = tuple(Device(i, h) for i, h in enumerate(hosts))
        ids = tuple(range(len(hosts)))
        return PTC({}, devices, (
            Tensor("optim/w/step", (), "float32", TensorKind.OPTIMIZER, (Shard(Region(()), ids),)),
            Tensor("w", (6,), "bfloat16", TensorKind.PARAM,
                   tuple(Shard(r, (i % len(hosts),)) for i, r in enumerate(Region.full((6,)).split(0, 2)))),
        ))

    old, new = ptc(["h0", "h1"]), ptc(["h2"])
    state = random_state(old, seed=5)
    populate(cluster, old, state, "scalar", "s1-g0")
    plan = make_plan(old, new, job="scalar", old_version="s1-g0", new_version="s1-g1")
    transform_all(cluster, plan)
    check_new_state(cluster, new, state, "scalar", "s1-g1")
