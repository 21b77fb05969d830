"""Replica placement: no constraint ever violated on random inventories; stranded devices equal the exhaustive
optimum on small ones; anti-affinity spreads a pool over nodes; rolling upgrades keep within the surge."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from services.policy.placement import Device, distance, inventory, optimum_stranded, place, upgrade_plan


def random_inventory(rng: random.Random, max_domains: int = 5) -> list[Device]:
    devices = []
    for d in range(rng.randint(1, max_domains)):
        node = f"n{rng.randint(0, 2)}"
        rack = f"r{int(node[1:]) // 2}"
        devices += [Device(f"{node}-d{d}-g{g}", rack, node, f"d{d}") for g in range(rng.randint(0, 8))]
    return devices


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.integers(0, 10**6), st.integers(1, 4), st.integers(0, 6))
def test_constraints_hold_and_stranded_is_optimal(seed, k, n):
    rng = random.Random(seed)
    inv = random_inventory(rng)
    used = {d.id for d in inv if rng.random() < 0.2}
    got = place(inv, used, "decode", k, n)
    seen = set()
    by_id = {d.id: d for d in inv}
    for r in got.replicas:
        assert len(r.devices) == k
        assert {(by_id[i].node, by_id[i].domain) for i in r.devices} == {(r.node, r.domain)}  # one domain
        assert not set(r.devices) & (used | seen)  # free devices, each once
        seen |= set(r.devices)
    best = optimum_stranded(inv, used, k, len(got.replicas))
    assert got.stranded == best
    if got.unplaced:
        assert optimum_stranded(inv, used, k, n) is None  # n really do not fit


def test_a_pool_spreads_over_nodes_before_doubling_up():
    inv = inventory(racks=2, nodes_per_rack=2, domains_per_node=2, devices_per_domain=8)
    got = place(inv, set(), "decode", 4, 4)
    assert len({r.node for r in got.replicas}) == 4 and got.stranded == 0
    more = place(inv, {i for r in got.replicas for i in r.devices}, "decode", 4, 1, existing=got.replicas)
    assert more.replicas and more.unplaced == 0


def test_replicas_go_where_they_strand_nothing_first():
    inv = [Device(f"a{i}", "r", "n0", "a") for i in range(6)] + [Device(f"b{i}", "r", "n1", "b") for i in range(4)]
    got = place(inv, set(), "p", 4, 1)  # into b (4: fills it exactly) or a (6: would strand 2)?
    assert got.replicas[0].domain == "b" and got.stranded == 0  # a's 6 can still take one more
    assert optimum_stranded(inv, set(), 4, 1) == 0


def test_too_many_replicas_place_what_fits():
    inv = inventory(1, 1, 1, 8)
    got = place(inv, set(), "p", 4, 3)
    assert len(got.replicas) == 2 and got.unplaced == 1 and got.stranded == 0


def test_rolling_upgrade_never_exceeds_the_surge():
    inv = inventory(1, 2, 2, 4)
    reps = place(inv, set(), "decode", 4, 4).replicas
    waves = upgrade_plan(reps, surge=1)
    assert len(waves) == 4
    extra = 0
    for wave in waves:
        extra += sum(1 for op, _ in wave if op == "add")
        assert extra <= 1
        extra -= sum(1 for op, _ in wave if op == "remove")
    assert [r for w in waves for op, r in w if op == "remove"] == reps


def test_distance_ranks_domain_node_rack():
    inv = inventory(2, 2, 2, 2)
    reps = place(inv, set(), "p", 2, 8).replicas
    by = {(r.rack, r.node, r.domain): r for r in reps}
    a = by[("r0", "r0n0", "d0")]
    assert distance(a, a) == 0
    assert distance(a, by[("r0", "r0n0", "d1")]) == 1
    assert distance(a, by[("r0", "r0n1", "d0")]) == 2
    assert distance(a, by[("r1", "r1n0", "d0")]) == 3


def test_a_pools_replicas_go_near_the_partner_pool_when_that_costs_nothing():
    inv = inventory(2, 2, 2, 8)
    prefill = place(inv, set(), "prefill", 2, 1).replicas
    used = {d for r in prefill for d in r.devices}
    alone = place(inv, used, "decode", 2, 1).replicas[0]
    paired = place(inv, used, "decode", 2, 1, near=prefill).replicas[0]
    assert distance(alone, prefill[0]) > 0  # by free room alone it goes to an emptier domain
    assert distance(paired, prefill[0]) == 0
    spread = place(inv, used, "decode", 2, 4, near=prefill)  # anti-affinity still spreads them over the nodes
    assert len({r.node for r in spread.replicas}) == 4 and spread.stranded == 0
    assert min(distance(r, prefill[0]) for r in spread.replicas) == 0
