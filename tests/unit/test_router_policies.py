"""Router registry and policies, table-driven, with an injected clock."""

import pytest

from services.common.errors import Unavailable
from services.router.policies import LeastOutstanding, RoundRobin, make_policy
from services.router.registry import Registry
from tests.support.fakes import Clock


def registry_with(loads, clock=None):
    reg = Registry(clock or Clock(), ttl_s=3.0)
    for i, (outstanding, capacity) in enumerate(loads):
        reg.beat(f"w{i}", f"127.0.0.1:{9000 + i}", "decode", outstanding, capacity)
    return reg


@pytest.mark.parametrize("loads,expected", [
    ([(100, 1000), (50, 1000), (70, 1000)], "w1"),
    ([(100, 1000), (100, 4000)], "w1"),  # same tokens, bigger pool: lower load
    ([(0, 1000), (0, 1000)], "w0"),  # tie: lower id
])
def test_least_outstanding_picks_lowest_load(loads, expected):
    reg = registry_with(loads)
    assert LeastOutstanding().select(reg.live("decode"), 10)[0].worker_id == expected


def test_in_flight_correction_spreads_a_burst():
    reg = registry_with([(0, 1000), (0, 1000)])
    policy = LeastOutstanding()
    picks = []
    for _ in range(4):
        w, _ = policy.select(reg.live("decode"), 100)
        policy.on_routed(w, 100)
        picks.append(w.worker_id)
    assert picks == ["w0", "w1", "w0", "w1"]


def test_round_robin_cycles():
    reg = registry_with([(0, 1), (999, 1), (5, 1)])
    policy = RoundRobin()
    picks = []
    for _ in range(6):
        w, _ = policy.select(reg.live("decode"), 1)
        policy.on_routed(w, 1)
        picks.append(w.worker_id)
    assert picks == ["w0", "w1", "w2"] * 2


def test_silent_worker_is_dropped_after_three_missed_beats():
    clock = Clock()
    reg = registry_with([(0, 1), (0, 1)], clock)
    clock.now = 2.0
    reg.beat("w0", "127.0.0.1:9000", "decode", 0, 1)
    clock.now = 3.5  # w1 last beat at 0.0: 3.5 s of silence > 3 s
    assert [w.worker_id for w in reg.live("decode")] == ["w0"]
    clock.now = 10.0
    with pytest.raises(Unavailable):
        reg.live("decode")


def test_unknown_policy():
    with pytest.raises(ValueError, match="least-outstanding"):
        make_policy("random")
