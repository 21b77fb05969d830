"""Filter -> Scorer -> Picker: every scorer and the load guard, table-driven."""

import pytest

from services.policy.routing.policies import PrefixAware, make_routing_policy
from services.policy.routing.scoring import AdapterScorer, LoadGuard, LoadScorer, PrefixScorer, WeightedPicker
from services.policy.routing.views import RouteContext, WorkerView, loads


def workers(*loads, capacity=1000):
    return [WorkerView(f"w{i}", f"a{i}", "unified", outstanding_tokens=int(load * capacity), capacity_tokens=capacity)
            for i, load in enumerate(loads)]


@pytest.mark.parametrize("loads,expected", [
    ((0.0, 0.0), [1.0, 1.0]),
    ((0.5, 0.25, 0.0), [0.0, 0.5, 1.0]),
    ((1.0, 1.0), [0.0, 0.0]),
])
def test_load_scorer(loads, expected):
    assert LoadScorer().score(workers(*loads), RouteContext(4)) == pytest.approx(expected)


@pytest.mark.parametrize("prompt_blocks,cached,expected", [
    (4, {"w0": 4, "w1": 2}, [1.0, 0.5]),
    (4, {}, [0.0, 0.0]),
    (0, {"w0": 3}, [0.0, 0.0]),
    (2, {"w0": 5}, [1.0, 0.0]),  # never above 1
])
def test_prefix_scorer(prompt_blocks, cached, expected):
    assert PrefixScorer().score(workers(0, 0), RouteContext(prompt_blocks, cached)) == pytest.approx(expected)


@pytest.mark.parametrize("loads,abs_t,rel_t,imbalanced", [
    ((0.9, 0.1), 0.25, 1.5, True),  # gap 0.8 > 0.25 and 0.9 > 0.15
    ((0.3, 0.2), 0.25, 1.5, False),  # gap too small
    ((0.9, 0.7), 0.1, 1.5, False),  # ratio 1.29 < 1.5
    ((0.5, 0.0), 0.25, 1.5, True),  # an idle worker: any ratio
])
def test_load_guard(loads, abs_t, rel_t, imbalanced):
    assert LoadGuard(abs_t, rel_t).imbalanced(workers(*loads)) is imbalanced


@pytest.mark.parametrize("loads,cached,expected,guarded", [
    ((0.2, 0.1), {"w0": 8}, "w0", False),  # cache wins when loads are close
    ((1.5, 0.1), {"w0": 8}, "w1", True),  # load guard (gap > 1.0, ratio > 2): load wins
    ((0.9, 0.1), {"w0": 8}, "w0", False),  # under the default guard: the cache still wins
    ((0.1, 0.1), {}, "w0", False),  # full tie: lower id
    ((0.3, 0.1), {}, "w1", False),  # no cache anywhere: the lighter one
])
def test_prefix_aware_picks(loads, cached, expected, guarded):
    pick, why = PrefixAware().select(workers(*loads), 100, RouteContext(8, cached))
    why = str(why)
    assert pick.worker_id == expected
    assert why.startswith("load guard") is guarded
    assert "prefix=" in why or guarded


def test_weights_change_the_trade_off():
    ws, ctx = workers(0.3, 0.0), RouteContext(8, {"w0": 4})
    only_prefix = WeightedPicker([(PrefixScorer(), 1.0), (LoadScorer(), 0.0)])
    only_load = WeightedPicker([(PrefixScorer(), 0.0), (LoadScorer(), 1.0)])
    assert only_prefix.pick(ws, ctx)[0].worker_id == "w0"
    assert only_load.pick(ws, ctx)[0].worker_id == "w1"


@pytest.mark.parametrize("tokens,capacity,floor,expected", [
    ((100, 100), (1000, 500), (0, 0), [0.1, 0.2]),  # KV capacity alone
    ((100, 100), (1000, 1000), (0.005, 0.010), [0.1, 0.2]),  # half as fast (its steps twice as long): half as big
    ((100, 100), (1000, 1000), (0.005, 0), [0.1, 0.1]),  # a speed not known for all: KV alone
    ((100, 100), (1000, 500), (0.005, 0.010), [0.1, 0.2]),  # half the KV and half the speed: half, not a quarter
    ((100, 100), (1000, 250), (0.005, 0.010), [0.1, 0.4]),  # the tighter of the two limits
])
def test_loads_use_kv_capacity_and_measured_speed(tokens, capacity, floor, expected):
    ws = [WorkerView(f"w{i}", "", "unified", outstanding_tokens=t, capacity_tokens=c, decode_s_floor=f,
                     decode_tps=1000.0 * (i + 1))  # throughput (batch-dependent) plays no part
          for i, (t, c, f) in enumerate(zip(tokens, capacity, floor))]
    assert loads(ws) == pytest.approx(expected)


@pytest.mark.parametrize("tokens,running,waiting,seqs,expected", [
    (100, 2, 0, 16, 0.125),  # slots fuller than the KV pool (100 / 1000 = 0.1)
    (500, 2, 0, 16, 0.5),  # KV fuller
    (100, 10, 10, 16, 1.25),  # more requests than slots: queued in the engine
    (100, 50, 0, 0, 0.1),  # slots not reported: KV alone
])
def test_load_is_the_fuller_of_kv_and_slots(tokens, running, waiting, seqs, expected):
    w = WorkerView("w0", "", "unified", outstanding_tokens=tokens, capacity_tokens=1000, running=running,
                   waiting=waiting, max_num_seqs=seqs)
    assert loads([w]) == pytest.approx([expected])


def test_in_flight_correction_counts_requests_against_slots():
    ws = [WorkerView(f"w{i}", "", "unified", capacity_tokens=10**6, max_num_seqs=4) for i in range(2)]
    policy = make_routing_policy("least-outstanding")
    picks = []
    for _ in range(4):
        w, _ = policy.select(ws, 1)
        policy.on_routed(w, 1)
        picks.append(w.worker_id)
    assert picks == ["w0", "w1", "w0", "w1"]


def test_adapter_scorer_ranks_slot_over_host_over_free_slot_over_evicting():
    ws = [WorkerView("slot", "", "unified", adapters=("sql",), host_adapters=("sql",)),
          WorkerView("host", "", "unified", host_adapters=("sql",)),
          WorkerView("free", "", "unified", free_lora_slots=1),
          WorkerView("full", "", "unified", adapters=("a", "b"), lora_slots=2),
          WorkerView("blocked", "", "unified", adapters=("a", "b"), pinned_adapters=("a", "b"), lora_slots=2,
                     host_adapters=("sql",)),
          WorkerView("blocked-since", "", "unified", adapters=("a", "b"), pinned_adapters=("a",), lora_slots=2,
                     routed_adapters={"b"})]
    assert AdapterScorer().score(ws, RouteContext(adapter="sql")) == [1.0, 0.8, 0.6, 0.3, 0.0, 0.0]
    assert AdapterScorer().score(ws, RouteContext()) == [0.0] * 6
    assert AdapterScorer().score(ws, RouteContext(adapter="a"))[4] == 1.0  # joins its own pinned slot


def test_lora_aware_keeps_an_adapter_where_it_is_resident_unless_a_replica_is_less_loaded():
    from services.policy.routing.policies import make_routing_policy

    policy = make_routing_policy("lora-aware")
    a = WorkerView("w0", "", "unified", capacity_tokens=1000, adapters=("sql",), known_adapters=("sql",))
    b = WorkerView("w1", "", "unified", capacity_tokens=1000, known_adapters=("sql",), lora_slots=1,
                   adapters=("x",), pinned_adapters=("x",))
    a.outstanding_tokens, b.outstanding_tokens = 600, 100
    assert policy.select([a, b], 10, RouteContext(adapter="sql"))[0].worker_id == "w0"  # b's one slot is in use
    b.pinned_adapters = ()
    assert policy.select([a, b], 10, RouteContext(adapter="sql"))[0].worker_id == "w1"  # b can evict an idle slot
    b.pinned_adapters, b.lora_slots = ("x",), 2
    b.host_adapters = ("sql",)  # a replica in b's memory (placement) and a slot to be had: load decides
    assert policy.select([a, b], 10, RouteContext(adapter="sql"))[0].worker_id == "w1"
    a.outstanding_tokens = 50
    assert policy.select([a, b], 10, RouteContext(adapter="sql"))[0].worker_id == "w0"


def test_policy_config_from_the_mesh_file():
    policy = make_routing_policy("prefix-aware",
                                 {"weights": {"prefix": 0.0, "load": 1.0}, "guard": {"abs": 0.5, "rel": 2}})
    assert policy.picker.guard == LoadGuard(0.5, 2.0)
    pick, _ = policy.select(workers(0.3, 0.0), 10, RouteContext(8, {"w0": 8}))
    assert pick.worker_id == "w1"  # prefix weight 0: load decides


@pytest.mark.parametrize("config,fragment", [
    ({"weights": {"cache": 1.0}}, "unknown scorer"),
    ({"weights": {"load": -1}}, ">= 0"),
    ({"guard": {"absolute": 1}}, "unknown load guard"),
])
def test_bad_policy_config_is_refused(config, fragment):
    with pytest.raises(ValueError, match=fragment):
        make_routing_policy("prefix-aware", config)


def test_an_adapters_homes_count_half_of_its_affinity_and_never_lower_a_worker_holding_it():
    ws = [WorkerView("home", "", "unified", lora_slots=2, free_lora_slots=2),
          WorkerView("slot", "", "unified", lora_slots=2, adapters=("sql",)),
          WorkerView("host", "", "unified", lora_slots=2, free_lora_slots=2, host_adapters=("sql",))]
    assert AdapterScorer().score(ws, RouteContext(adapter="sql")) == [0.6, 1.0, 0.8]  # no plan yet: residency alone
    # a home without the adapter: half its residency + half; the others keep theirs (homes move with demand, and
    # a request sent after a moved home would read what a holder already has)
    assert AdapterScorer().score(ws, RouteContext(adapter="sql", homes=frozenset({"home"}))) == [0.8, 1.0, 0.8]
    assert AdapterScorer().score(ws, RouteContext(adapter="sql", homes=frozenset({"host"}))) == [0.6, 1.0, 0.9]
