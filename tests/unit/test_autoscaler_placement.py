"""Group placement (services/policy/placement.py): a group is never split and never overfills a host; it goes
beside its partner role where KV moves by shared memory, else into a rack short of its role against its partner's,
then packs (in-use hosts first, best fit), leaving whole
hosts free; a simulated cluster of 10,000 devices in mixed host sizes is filled in under a second; on small
random clusters every choice equals a brute-force reading of the rules."""

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.policy.placement import PARTNER, Group, Host, free_cores, place

SIZES = (4, 8, 16, 32, 64, 128)


def cluster(devices: int, seed: int) -> list[Host]:
    rng, hosts, total = random.Random(seed), [], 0
    while total < devices:
        cores = min(rng.choice(SIZES), devices - total)
        hosts.append(Host(f"h{len(hosts):04d}", cores, rack=f"r{len(hosts) // 16}", shm_kv=rng.random() < 0.8))
        total += cores
    return hosts


def check(hosts: list[Host], groups: list[Group]) -> None:
    """No host overfilled; every group on one known host (a Group names exactly one host: never split)."""
    free = free_cores(hosts, groups)
    assert min(free.values()) >= 0, {h: f for h, f in free.items() if f < 0}


def test_ten_thousand_devices_fill_in_under_a_second_without_splitting_a_group():
    hosts = cluster(10_000, seed=1)
    assert sum(h.cores for h in hosts) == 10_000 and set(SIZES) <= {h.cores for h in hosts}
    rng = random.Random(2)
    asks = [(f"pool{i % 6}", rng.choice(("prefill", "decode", "unified")), rng.choice((1, 2, 4, 8, 16)),
             rng.randint(1, 40)) for i in range(200)]
    placed, unplaced = [], 0
    t0 = time.perf_counter()
    for pool, role, size, n in asks:
        got = place(hosts, placed, pool, role, size, n)
        placed += got.groups
        unplaced += got.unplaced
    elapsed = time.perf_counter() - t0
    check(hosts, placed)
    assert len(placed) > 1500 and unplaced > 0  # the cluster was filled up
    free = free_cores(hosts, placed)
    for pool, role, size, _ in asks[-20:]:  # what did not fit fits nowhere
        if place(hosts, placed, pool, role, size, 1).unplaced:
            assert max(free.values()) < size
    assert elapsed < 1.0, f"placing {len(placed)} groups took {elapsed:.2f} s"


def brute_force_choice(hosts: list[Host], placed: list[Group], role: str, size: int) -> str | None:
    """The host the module doc's rules pick, read literally over every host."""
    free = free_cores(hosts, placed)
    partners = {g.host for g in placed if g.role == PARTNER.get(role)}
    rack = {h.name: h.rack for h in hosts}
    mine = {r: sum(g.size for g in placed if rack[g.host] == r and g.role == role) for r in set(rack.values())}
    theirs = {r: sum(g.size for g in placed if rack[g.host] == r and g.role == PARTNER.get(role))
              for r in set(rack.values())}
    m, t = sum(v for r, v in mine.items() if r), sum(v for r, v in theirs.items() if r)
    racks = {r for r in theirs if r and theirs[r] and (not m or mine[r] * t < theirs[r] * m)}
    in_use = {g.host for g in placed}
    fits = [h for h in hosts if free[h.name] >= size]
    if not fits:
        return None
    return min(fits, key=lambda h: (not (h.name in partners and h.shm_kv), h.rack not in racks, h.name not in in_use,
                                    free[h.name] - size, h.name)).name


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.integers(0, 10**6), st.integers(1, 8), st.integers(0, 8), st.sampled_from(("prefill", "decode", "unified")))
def test_every_choice_follows_the_rules(seed, size, n, role):
    rng = random.Random(seed)
    hosts = [Host(f"h{i}", rng.choice((2, 4, 8, 16)), rack=rng.choice(("", "r0", "r1")), shm_kv=rng.random() < 0.7)
             for i in range(rng.randint(1, 6))]
    placed = []
    for _ in range(rng.randint(0, 6)):
        placed += place(hosts, placed, "other", rng.choice(("prefill", "decode")), rng.randint(1, 4), 1).groups
    before = list(placed)
    got = place(hosts, placed, "p", role, size, n)
    check(hosts, before + got.groups)
    for g in got.groups:
        assert g.host == brute_force_choice(hosts, before, role, size)
        before.append(g)
    assert got.unplaced == n - len(got.groups)
    if got.unplaced:
        assert brute_force_choice(hosts, before, role, size) is None


def test_a_decode_group_lands_beside_its_prefill_group_and_whole_hosts_stay_free():
    hosts = [Host("a", 8), Host("b", 8), Host("c", 4)]
    prefill = place(hosts, [], "prefill", "prefill", 2, 1).groups
    assert [g.host for g in prefill] == ["c"]  # best fit: the small host, leaving both large ones whole
    decode = place(hosts, prefill, "decode", "decode", 2, 2).groups
    assert [g.host for g in decode] == ["c", "a"]  # beside it until that host is full, then on one large host
    everything = prefill + decode
    assert sorted(free_cores(hosts, everything).values()) == [0, 6, 8]  # one large host still whole


def test_no_shared_memory_there_means_no_pull_toward_the_partner():
    hosts = [Host("big", 16, shm_kv=False), Host("small", 4)]
    placed = [Group("prefill", "prefill", "big", 2)]
    assert place(hosts, placed, "decode", "decode", 2, 1).groups[0].host == "big"  # packing still prefers in use
    hosts = [Host("big", 16, shm_kv=False), Host("small", 4), Host("mid", 6)]
    placed = [Group("prefill", "prefill", "big", 2), Group("prefill", "prefill", "small", 2)]
    assert place(hosts, placed, "decode", "decode", 2, 1).groups[0].host == "small"  # the partner with shared memory


def test_a_decode_group_with_no_room_beside_its_prefill_group_stays_in_that_rack():
    hosts = [Host("a1", 8, rack="a"), Host("a2", 8, rack="a"), Host("b1", 4, rack="b")]
    placed = [Group("prefill", "prefill", "a1", 8)]  # its host is full
    # best fit alone would take b1 (the smallest host that fits); the prefill group's rack wants decode groups
    assert place(hosts, placed, "decode", "decode", 4, 1).groups[0].host == "a2"
    assert place(hosts, [], "decode", "decode", 4, 1).groups[0].host == "b1"  # no partner anywhere: best fit


def test_a_group_larger_than_every_host_is_unplaced_not_split():
    got = place([Host("a", 4), Host("b", 4)], [], "decode", "decode", 6, 1)
    assert got.groups == [] and got.unplaced == 1


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="size"):
        place([Host("a", 4)], [], "p", "decode", 0, 1)
    with pytest.raises(ValueError, match="unique"):
        place([Host("a", 4), Host("a", 2)], [], "p", "decode", 1, 1)
    with pytest.raises(ValueError, match="unknown host"):
        place([Host("a", 4)], [Group("p", "decode", "zz", 1)], "p", "decode", 1, 1)
    assert Host("a", 4, rack="r1").topology == "r1/a/"
