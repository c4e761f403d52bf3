"""Fault injection: hosts lost before planning, a source killed mid-transfer, every holder gone, checkpoint fallback."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np
import pytest

from tenplex.errors import ChecksumMismatch, NotFound, StateLost, TransformFailed
from tenplex.node.store_routes import StoreServer
from tenplex.ptc import PTC, Device, ParallelConfig, Region, build_tensor
from tenplex.store.client import StoreClient
from tenplex.store.local import LocalStore
from tenplex.store.names import region_key, tensor_dirname
from tenplex.transformer.execute import TransformMetrics, execute_host_plan
from tenplex.transformer.plan import CHECKPOINT, make_plan

from .conftest import check_new_state, populate, random_state, transform_all
from .test_transform_e2e import layout

pytestmark = pytest.mark.slow

OLD_V, NEW_V = "s7-g0", "s7-g1"


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_loss_of_a_host_sources_only_survivors(cluster, precision: str) -> None:
    old = layout(ParallelConfig(dp=2, tp=2), 2, ["h0", "h1"], precision)
    new = layout(ParallelConfig(tp=2, pp=2), 2, ["h0", "h2"], precision)
    state = random_state(old, seed=11)
    populate(cluster, old, state, "loss", OLD_V)
    cluster.stop("h1")
    plan = make_plan(old, new, job="loss", old_version=OLD_V, new_version=NEW_V, alive={"h0", "h2", "h3"})
    assert all(t.source in ("h0", None) for hp in plan.hosts.values() for t in hp.transfers)
    assert all("h1" not in t.alternatives for hp in plan.hosts.values() for t in hp.transfers)
    assert plan.network_bytes == plan.lower_bound_bytes > 0
    reports = transform_all(cluster, plan)
    assert all(r.replanned_pieces == 0 for r in reports.values())
    check_new_state(cluster, new, state, "loss", NEW_V)


@pytest.mark.parametrize("batch_bytes", [0, 8 << 10], ids=["piece-requests", "batch-reads"])
def test_source_killed_mid_transfer_completes_from_the_other_replica(cluster, batch_bytes: int) -> None:
    # Old: two full replicas (dp2) on h0 and h1; new: redeployed onto h2, so every piece is remote
    # and balanced over h0 and h1. h0 is stopped once a third of the bytes are in, with the pieces
    # fetched one per request and in batch reads (small ones here: the whole state is 184 KB).
    old = layout(ParallelConfig(dp=2, tp=2), 2, ["h0", "h1"], "bf16")
    new = layout(ParallelConfig(tp=2), 2, ["h2"], "bf16")
    state = random_state(old, seed=12)
    populate(cluster, old, state, "kill", OLD_V)
    plan = make_plan(old, new, job="kill", old_version=OLD_V, new_version=NEW_V)
    sends = plan.send_bytes()
    assert set(sends) == {"h0", "h1"} and min(sends.values()) > 0

    stopped = threading.Event()
    lock = threading.Lock()

    def progress(done: int, total: int) -> None:
        with lock:  # stop synchronously: every later read from h0 must fail
            if not stopped.is_set() and done * 3 >= total:
                cluster.stop("h0")
                stopped.set()

    metrics = TransformMetrics()
    report = execute_host_plan(
        plan, "h2", target=cluster.clients["h2"],
        sources={h: cluster.clients[h] for h in ("h0", "h1")},
        concurrency=2, progress=progress, metrics=metrics, batch_bytes=batch_bytes,
    )
    assert stopped.is_set()
    assert report.replanned_pieces > 0
    pieces = len(plan.host("h2").transfers)
    assert report.requests == pieces if batch_bytes == 0 else report.requests < pieces / 2
    assert report.bytes_remote == plan.network_bytes
    check_new_state(cluster, new, state, "kill", NEW_V)
    assert metrics.registry.get_sample_value("tenplex_transform_replanned_pieces_total") == report.replanned_pieces
    assert metrics.registry.get_sample_value("tenplex_transform_bytes_total", {"kind": "remote"}) == report.bytes_remote
    assert metrics.registry.get_sample_value("tenplex_transforms_total", {"outcome": "ok"}) == 1


def test_every_holder_lost(cluster, tmp_path) -> None:
    old = layout(ParallelConfig(tp=2, pp=2), 2, ["h0", "h1"], "bf16")  # no replicas: h1 holds stage 1 alone
    new = layout(ParallelConfig(dp=2, tp=2), 2, ["h2", "h3"], "bf16")
    state = random_state(old, seed=13)
    populate(cluster, old, state, "lost", OLD_V)

    # Planning with h1 dead: a clear error naming what is lost and who held it.
    with pytest.raises(StateLost) as info:
        make_plan(old, new, job="lost", old_version=OLD_V, new_version=NEW_V, alive={"h0", "h2", "h3"})
    assert "held by no surviving host" in info.value.detail and "layers.2" in info.value.detail
    assert "h1" in info.value.detail

    # h1 dies after planning: the transform fails, nothing is committed, the old version is intact.
    plan = make_plan(old, new, job="lost", old_version=OLD_V, new_version=NEW_V)
    cluster.stop("h1")
    with pytest.raises(TransformFailed) as failed:
        execute_host_plan(plan, "h2", target=cluster.clients["h2"],
                          sources={h: cluster.clients[h] for h in ("h0", "h1")}, concurrency=2)
    assert "no source could deliver" in failed.value.detail and "h1" in failed.value.detail
    # nothing of the new version at h2 (when h1's pieces failed first, not even the job)
    with contextlib.suppress(NotFound):
        assert all(str(v.version) != NEW_V for v in cluster.clients["h2"].versions("lost"))
    assert [str(v.version) for v in cluster.clients["h0"].versions("lost") if v.committed] == [OLD_V]

    # With a persistent checkpoint holding the old version (another layout: whole tensors), the
    # lost regions come from there and the transform completes.
    ckpt_root = tmp_path / "checkpoint"
    with StoreServer(ckpt_root, host="127.0.0.6", store=LocalStore(ckpt_root, durable=False)) as server:
        for t in old.tensors:
            server.store.write_shard("lost", OLD_V, t.name, t.region, state[t.name], dtype=t.dtype, global_shape=t.shape)
        server.store.commit("lost", OLD_V)
        plan = make_plan(old, new, job="lost", old_version=OLD_V, new_version=NEW_V,
                         alive={"h0", "h2", "h3"}, checkpoint=server.url)
        from_ckpt = sum(t.nbytes for hp in plan.hosts.values() for t in hp.transfers if t.source == CHECKPOINT)
        assert from_ckpt > 0 and plan.network_bytes == plan.lower_bound_bytes
        with StoreClient(server.url) as ckpt:
            reports = transform_all(cluster, plan, checkpoint=ckpt)
        assert sum(r.bytes_checkpoint for r in reports.values()) == from_ckpt
    check_new_state(cluster, new, state, "lost", NEW_V)


def test_target_failure_leaves_nothing_committed(cluster) -> None:
    old = layout(ParallelConfig(dp=2), 1, ["h0", "h1"], "fp32")
    new = layout(ParallelConfig(tp=2), 2, ["h2"], "fp32")
    state = random_state(old, seed=14)
    populate(cluster, old, state, "tgt", OLD_V)
    plan = make_plan(old, new, job="tgt", old_version=OLD_V, new_version=NEW_V)
    # A version that is already committed at the target must not be overwritten.
    t0 = new.tensors[0]
    cluster.servers["h2"].store.write_shard("tgt", NEW_V, t0.name, t0.region, np.zeros(t0.shape, np.float32),
                                            dtype=t0.dtype, global_shape=t0.shape)
    cluster.servers["h2"].store.commit("tgt", NEW_V)
    with pytest.raises(TransformFailed, match="already committed"):
        execute_host_plan(plan, "h2", target=cluster.clients["h2"], sources=cluster.clients)
    # An uncommitted leftover of an earlier attempt is replaced.
    cluster.servers["h2"].store.delete("tgt", NEW_V)
    cluster.servers["h2"].store.write_shard("tgt", NEW_V, "stale.tensor", t0.region, np.zeros(t0.shape, np.float32),
                                            dtype=t0.dtype, global_shape=t0.shape)
    execute_host_plan(plan, "h2", target=cluster.clients["h2"], sources=cluster.clients)
    check_new_state(cluster, new, state, "tgt", NEW_V)


def test_local_target_and_corrupt_local_copy_falls_back_to_a_replica(cluster) -> None:
    # Old: dp2 replicas on h0 and h1; new on h1 (and h2). h1 runs its part in-process on its own
    # LocalStore; one of its local shards is corrupted on disk, so that piece must come
    # from h0's replica instead, and the result is still bit-exact.
    old = layout(ParallelConfig(dp=2, tp=2), 2, ["h0", "h1"], "fp32")
    new = layout(ParallelConfig(tp=2, pp=2), 2, ["h1", "h2"], "fp32")
    state = random_state(old, seed=15)
    populate(cluster, old, state, "local", OLD_V)
    plan = make_plan(old, new, job="local", old_version=OLD_V, new_version=NEW_V)
    local = [t for t in plan.hosts["h1"].transfers if t.source == "h1" and t.alternatives == ("h0",)]
    victim = max(local, key=lambda t: t.nbytes)
    store = cluster.servers["h1"].store
    shard_dir = store.root / "local" / OLD_V / tensor_dirname(victim.tensor) / region_key(victim.region)
    chunk = max((p for p in shard_dir.rglob("*") if p.is_file() and p.name != "zarr.json"), key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))

    report = execute_host_plan(plan, "h1", target=store, sources={"h0": cluster.clients["h0"]})
    assert report.replanned_pieces >= 1
    assert report.bytes_remote == plan.hosts["h1"].bytes_remote + victim.nbytes
    execute_host_plan(plan, "h2", target=cluster.clients["h2"], sources={h: cluster.clients[h] for h in ("h0", "h1")})
    check_new_state(cluster, new, state, "local", NEW_V)


class _FlippedBits(LocalStore):
    """A source whose next ``flips`` reads fail their checksum (bits flipped on the way), then read correctly."""

    flips = 0
    reads = 0

    def read_into(self, *args: Any, **kwargs: Any) -> None:
        self.reads += 1
        if self.flips:
            self.flips -= 1
            raise ChecksumMismatch("checksum mismatch (bits flipped on the way)")
        return super().read_into(*args, **kwargs)


@pytest.mark.parametrize("flips", [1, 2])
def test_a_checksum_mismatch_is_read_once_more_then_the_next_holder(tmp_path, flips: int) -> None:
    def ptc(hosts: list[str]) -> PTC:
        w = build_tensor("w", (8, 4), "float32", "param", [(Region.full((8, 4)), list(range(len(hosts))))])
        return PTC({}, tuple(Device(i, h) for i, h in enumerate(hosts)), (w,))

    data = np.arange(32, dtype=np.float32).reshape(8, 4)
    src, alt = _FlippedBits(tmp_path / "h0", durable=False), LocalStore(tmp_path / "h2", durable=False)
    for s in (src, alt):
        s.write_shard("j", OLD_V, "w", Region.full((8, 4)), data, dtype="float32", global_shape=(8, 4))
        s.commit("j", OLD_V)
    plan = make_plan(ptc(["h0", "h2"]), ptc(["h1"]), job="j", old_version=OLD_V, new_version=NEW_V)
    assert [(t.source, t.alternatives) for t in plan.hosts["h1"].transfers] == [("h0", ("h2",))]
    src.flips = flips
    target = LocalStore(tmp_path / "h1", durable=False)
    report = execute_host_plan(plan, "h1", target=target, sources={"h0": src, "h2": alt}, batch_bytes=0)
    assert src.reads == 2  # read once more after the first mismatch, never a third time
    assert report.replanned_pieces == flips - 1  # a second mismatch moves the piece to the other holder
    out = np.empty((8, 4), np.float32)
    target.read_into("j", NEW_V, "w", Region.full((8, 4)), out)
    np.testing.assert_array_equal(out, data)


def test_survivor_links_the_shards_it_keeps(cluster) -> None:
    # h1 fails; h0 keeps its (dp0, tp0/tp1) shards of the first pipeline stage exactly as they were,
    # so running on its own store it links them into the new version instead of copying their bytes.
    old = layout(ParallelConfig(dp=2, tp=2), 2, ["h0", "h1"], "fp32")
    new = layout(ParallelConfig(tp=2, pp=2), 2, ["h0", "h2"], "fp32")
    state = random_state(old, seed=16)
    populate(cluster, old, state, "keep", OLD_V)
    plan = make_plan(old, new, job="keep", old_version=OLD_V, new_version=NEW_V, alive={"h0", "h2"})
    kept = {(t.name, s.region) for t, s in old.shards_on_host("h0")}
    expected_linked = sum(d.nbytes for d in plan.hosts["h0"].shards if (d.tensor, d.region) in kept)
    assert expected_linked > 0
    store = cluster.servers["h0"].store
    report = execute_host_plan(plan, "h0", target=store, sources={})
    assert report.bytes_linked == expected_linked
    assert report.bytes_local == plan.hosts["h0"].bytes_local and report.bytes_remote == plan.hosts["h0"].bytes_remote
    some = next(d for d in plan.hosts["h0"].shards if (d.tensor, d.region) in kept and d.nbytes > 0)
    shard_dir = store.root / "keep" / NEW_V / tensor_dirname(some.tensor) / region_key(some.region)
    assert all(p.stat().st_nlink >= 2 for p in shard_dir.rglob("*") if p.is_file())
    execute_host_plan(plan, "h2", target=cluster.clients["h2"], sources={"h0": cluster.clients["h0"]})
    check_new_state(cluster, new, state, "keep", NEW_V)
    store.delete("keep", OLD_V)  # the new version's linked shards stay intact
    check_new_state(cluster, new, state, "keep", NEW_V)


def test_batches_held_back_are_sent_before_waiting_for_buffer_budget(cluster) -> None:
    # A buffer budget smaller than one batch: every shard waits for the one before it to be stored, and
    # the pieces gathered for a batch must go out before each wait (else the transform would never end).
    old = layout(ParallelConfig(dp=2, tp=2), 2, ["h0", "h1"], "bf16")
    new = layout(ParallelConfig(tp=2), 2, ["h2"], "bf16")
    state = random_state(old, seed=14)
    populate(cluster, old, state, "budget", OLD_V)
    plan = make_plan(old, new, job="budget", old_version=OLD_V, new_version=NEW_V)
    report = execute_host_plan(plan, "h2", target=cluster.clients["h2"],
                               sources={h: cluster.clients[h] for h in ("h0", "h1")},
                               concurrency=2, max_buffer_bytes=4096, batch_bytes=1 << 20)
    assert report.bytes_remote == plan.network_bytes
    check_new_state(cluster, new, state, "budget", NEW_V)
