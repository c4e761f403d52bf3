"""The policy's placement: blocks of ranks go to the hosts that hold their state, never moving more than the
preference order alone (issue 26, item 3)."""

from __future__ import annotations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tenplex.ptc import PTC, ParallelConfig, Placement
from tenplex.ptc.megatron import GPTSpec, megatron_gpt_ptc
from tenplex.scheduler.policy import Policy, choose
from tenplex.transformer.plan import host_overlap, make_plan

SPEC = GPTSpec(num_layers=4, hidden=64, heads=4, vocab=128, seq_len=32)
GPUS_PER_NODE = 2


def build(cfg: ParallelConfig, placement: Placement) -> PTC:
    return megatron_gpt_ptc(SPEC, cfg, gpus_per_node=placement.gpus_per_node, hosts=placement.hosts, precision="fp32")


def bound(old: PTC, new: PTC, alive: set[str]) -> tuple[int, int, int]:
    """(busiest receive, busiest send or receive, network bytes) of the plan between the layouts."""
    plan = make_plan(old, new, job="j", old_version="s1-g0", new_version="s1-g1", alive=alive)
    receive = max(plan.receive_bytes().values(), default=0)
    return receive, max([receive, *plan.send_bytes().values()]), plan.network_bytes


def test_a_dp_scale_up_keeps_every_stage_where_it_is() -> None:
    """The cluster_reshard dp case: dp1 tp2 pp2 on 2 hosts -> dp2 on 4. The preference order puts the new
    replica's first stage on host-1 (which held the second stage), so both stages move; placed where the
    state is, the old hosts keep their stages and only the new replica's bytes move (half)."""
    hosts = [f"host-{i}" for i in range(4)]
    old = build(ParallelConfig(dp=1, tp=2, pp=2), Placement(GPUS_PER_NODE, tuple(hosts[:2])))
    given_order = choose(8, Policy(table={8: ParallelConfig(dp=2, tp=2, pp=2)}), build, hosts, GPUS_PER_NODE)
    placed = choose(8, Policy(table={8: ParallelConfig(dp=2, tp=2, pp=2)}), build, hosts, GPUS_PER_NODE,
                    old=old, holders=hosts[:2])
    before, after = bound(old, given_order.ptc, set(hosts)), bound(old, placed.ptc, set(hosts))
    state = sum(t.nbytes for t in old.tensors)
    assert before[2] > state  # both stages move, and the second replica's too
    assert after[2] == state  # only the new replica: one copy of the state
    assert after[1] <= 0.55 * before[1]  # the busiest host's bytes about halve (the stages differ in size)
    assert placed.placement.hosts != given_order.placement.hosts and set(placed.placement.hosts) == set(hosts)
    assert "placed where the state is" in placed.reason
    # the old hosts kept all they held: nothing of theirs goes over the network to them
    ov = host_overlap(old, placed.ptc, hosts[:2])
    for h in hosts[:2]:
        b = ov.new_hosts.index(h)
        assert ov.keep[b, ov.old_hosts.index(h)] == ov.need[b]


def test_a_replicated_dp_scale_down_keeps_every_stage_on_its_hosts() -> None:
    """ZeRO-0, dp12 -> dp10 on pp2 (hosts s*dp + d): every dp rank of a stage holds the same bytes, so each block
    has 12 equally good hosts and the best few of every block are the same few. Each block still gets a host of
    its own stage: nothing moves over the network (before: every block past the first few took a host of the
    other stage, and most of the state moved)."""
    hosts = [f"host-{i}" for i in range(24)]
    old = build(ParallelConfig(dp=12, tp=2, pp=2), Placement(GPUS_PER_NODE, tuple(hosts)))
    policy = Policy(table={40: ParallelConfig(dp=10, tp=2, pp=2)})
    placed = choose(40, policy, build, hosts, GPUS_PER_NODE, old=old, holders=hosts)
    assert bound(old, placed.ptc, set(hosts))[2] == 0
    assert "placed where the state is" in placed.reason


@st.composite
def changes(draw: st.DrawFn) -> tuple[ParallelConfig, list[str], ParallelConfig, list[str], set[str]]:
    old_cfg = draw(st.sampled_from([ParallelConfig(dp=d, tp=t, pp=p) for d in (1, 2) for t in (1, 2) for p in (1, 2, 4)]))
    new_cfg = draw(st.sampled_from([ParallelConfig(dp=d, tp=t, pp=p) for d in (1, 2, 3) for t in (1, 2) for p in (1, 2, 4)]))
    pool = [f"h{i}" for i in range(8)]
    old_nodes = -(-old_cfg.world_size // GPUS_PER_NODE)
    old_hosts = draw(st.permutations(pool))[:old_nodes]
    dead = set(draw(st.lists(st.sampled_from(old_hosts), max_size=1, unique=True)))
    # usable hosts in preference order: survivors first (as the scheduler orders them), then others
    others = [h for h in draw(st.permutations(pool)) if h not in old_hosts]
    usable = [h for h in old_hosts if h not in dead] + others
    return old_cfg, old_hosts, new_cfg, usable, dead


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes())
def test_the_chosen_placement_never_moves_more_than_the_preference_order(
    change: tuple[ParallelConfig, list[str], ParallelConfig, list[str], set[str]],
) -> None:
    old_cfg, old_hosts, new_cfg, usable, dead = change
    old = build(old_cfg, Placement(GPUS_PER_NODE, tuple(old_hosts)))
    holders = [h for h in old_hosts if h not in dead]
    policy = Policy(table={new_cfg.world_size: new_cfg})
    assume(new_cfg.world_size <= len(usable) * GPUS_PER_NODE)
    # the state survives the dead host (else there is no plan either way)
    assume(all({old.device(d).host for d in s.devices} - dead for t in old.tensors for s in t.shards))
    given_order = choose(new_cfg.world_size, policy, build, usable, GPUS_PER_NODE)
    placed = choose(new_cfg.world_size, policy, build, usable, GPUS_PER_NODE, old=old, holders=holders)
    # today's rules hold: the same configuration on usable, distinct hosts, tp inside a node
    assert placed.parallel == given_order.parallel
    assert len(placed.placement.hosts) == len(given_order.placement.hosts)
    assert set(placed.placement.hosts) <= set(usable)
    placed.placement.check(placed.parallel)
    alive = set(usable) | set(holders)
    before, after = bound(old, given_order.ptc, alive), bound(old, placed.ptc, alive)
    assert after[0] <= before[0]  # the busiest host receives no more
    assert (after[0], after[2]) <= (before[0], before[2])
    assert after[1] <= before[1]  # nor does the busiest link carry more, either way
