"""Router registry and policies, table-driven, with an injected clock."""

import pytest

from services.common.errors import Unavailable
from services.policy.routing.policies import LeastOutstanding, PowerOfTwo, RoundRobin, make_routing_policy
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


def test_power_of_two_takes_the_less_loaded_of_its_two_draws_and_never_the_busiest():
    reg = registry_with([(900, 1000), (100, 1000), (500, 1000), (300, 1000)])
    policy = make_routing_policy("power-of-two", {"seed": 3})
    assert isinstance(policy, PowerOfTwo)
    picks = [policy.select(reg.live("decode"), 10)[0].worker_id for _ in range(1200)]
    assert "w0" not in picks  # the busiest loses whichever worker it is drawn with
    assert set(picks) == {"w1", "w2", "w3"}  # not always the least loaded: that is least-outstanding
    assert picks.count("w1") > picks.count("w3") > picks.count("w2")  # w1 wins every draw it is in (3 of 6 pairs)
    again = make_routing_policy("power-of-two", {"seed": 3})
    assert [again.select(reg.live("decode"), 10)[0].worker_id for _ in range(1200)] == picks  # seeded: repeatable
    one = registry_with([(5, 10)])
    assert PowerOfTwo(0).select(one.live("decode"), 10)[0].worker_id == "w0"


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
        make_routing_policy("random")


def test_filters_keep_the_decode_hop_to_the_prefill_block_size_and_name_the_filter():
    from services.policy.routing.filters import Need

    reg = Registry(Clock(), ttl_s=3.0)
    reg.beat("d8", "127.0.0.1:9001", "decode", 0, 100, block_size=8)
    reg.beat("d16", "127.0.0.1:9002", "decode", 0, 100, block_size=16, known_adapters=("sql",))
    assert [w.worker_id for w in reg.live(Need("decode", block_size=16))] == ["d16"]
    assert [w.worker_id for w in reg.live(Need("decode", adapter="sql"))] == ["d16"]  # only where it is registered
    assert {w.worker_id for w in reg.live(Need("decode"))} == {"d8", "d16"}
    with pytest.raises(Unavailable, match="block-size filter"):
        reg.live(Need("decode", block_size=32))
    with pytest.raises(Unavailable, match="adapter filter"):
        reg.live(Need("decode", adapter="other"))


def test_a_resumed_request_avoids_the_workers_that_failed_it_while_another_can_take_it():
    from services.policy.routing.filters import Need

    reg = Registry(Clock(), ttl_s=3.0)
    reg.beat("d0", "127.0.0.1:9001", "decode", 0, 100)
    reg.beat("d1", "127.0.0.1:9002", "decode", 50, 100)
    assert [w.worker_id for w in reg.live(Need("decode", avoid=frozenset({"127.0.0.1:9001"})))] == ["d1"]
    everyone = frozenset({"127.0.0.1:9001", "127.0.0.1:9002"})  # nobody else: the failed ones (one may be back)
    assert {w.worker_id for w in reg.live(Need("decode", avoid=everyone))} == {"d0", "d1"}


def test_heartbeat_fields_round_trip_through_the_one_conversion():
    from services.common.convert import load_from_pb, load_to_pb
    from services.common.pb import meshserve_pb2 as pb

    beat = pb.WorkerLoad(worker_id="w", address="a:1", role="decode", outstanding_tokens=5, kv_capacity_tokens=64,
                         running=2, waiting=1, adapters=["x"], block_size=8, index_member="w#1",
                         decode_tokens_per_s=12.5, max_num_seqs=4, prefill_s_per_token=1e-3, decode_s_per_step=2e-3,
                         host_adapters=["x", "y"], known_adapters=["x", "y", "z"], pinned_adapters=["x"], lora_slots=2,
                         free_lora_slots=1, topology="r0/n1/numa0")
    reg = Registry(Clock(), ttl_s=3.0)
    reg.beat_view(load_from_pb(beat))
    assert load_to_pb(reg.live("decode")[0]) == beat
