"""LoRA placement: replicas by measured demand, homes that balance demand and stay put, prefetch orders to homes
that lack their adapter, a bounded rate."""

from hypothesis import given, settings
from hypothesis import strategies as st

from services.policy.routing.adapter_placement import AdapterPlacement
from services.policy.routing.views import WorkerView

NAMES = ("hot", "warm", "cold", "a", "b", "c")


def fleet(n=4, slots=8, **kw):
    return [WorkerView(f"w{i}", f"a:{i}", "unified", lora_slots=slots, free_lora_slots=slots, known_adapters=NAMES,
                       **kw) for i in range(n)]


def observe(p, counts: dict, now=0.0):
    for adapter, n in counts.items():
        for _ in range(n):
            p.observe(adapter, now)


def test_a_hot_adapter_is_replicated_by_its_share_and_a_cold_one_homed_once():
    p, ws = AdapterPlacement(), fleet()
    observe(p, {"hot": 50, "warm": 2, "cold": 1, "": 47})  # 100 requests: hot 50%, warm 2%, cold 1%
    assert p.replicas("hot", ws) == 4 and p.replicas("warm", ws) == 1 and p.replicas("cold", ws) == 1
    orders = p.plan(ws, 1.0)
    assert p.home("unified", "hot") == {"w0", "w1", "w2", "w3"}
    assert len(p.home("unified", "warm")) == 1 and len(p.home("unified", "cold")) == 1
    assert p.home("unified", "warm") != p.home("unified", "cold")  # demand spread over the workers
    assert sorted(a for _, a in orders) == ["hot"] * 4  # single homes read on demand
    assert p.plan(ws, 2.0) == []  # ordered: not again until the heartbeats show it (or reorder_s passes)


def test_homes_balance_demand_and_stay_where_the_adapter_is_held():
    p, ws = AdapterPlacement(), fleet(n=2, slots=1)
    observe(p, {"a": 30, "b": 30, "c": 30, "": 10})
    p.plan(ws, 1.0)
    homes = {a: p.home("unified", a) for a in "abc"}
    assert all(len(h) == 1 for h in homes.values())
    load = {w: sum(30 for h in homes.values() if w in h) for w in ("w0", "w1")}
    assert sorted(load.values()) == [30, 60]  # three equal adapters on two workers: as even as it gets
    ws[1].host_adapters = ("a",)  # w1 holds a: a's home is there (the imbalance is no larger either way)
    q = AdapterPlacement()
    observe(q, {"a": 30, "b": 30, "c": 30, "": 10})
    q.plan(ws, 1.0)
    assert q.home("unified", "a") == {"w1"}


def test_demand_ages_out_of_the_window():
    p, ws = AdapterPlacement(window_s=10), fleet()
    observe(p, {"hot": 50, "": 50}, now=0.0)
    observe(p, {"": 100}, now=20.0)
    assert p.replicas("hot", ws) == 0 and p.plan(ws, 20.0) == [] and not p.home("unified", "hot")


def test_only_workers_that_know_the_adapter_are_homes():
    p, ws = AdapterPlacement(), fleet()
    ws[1].known_adapters = ()
    observe(p, {"hot": 100})
    p.plan(ws, 1.0)
    assert p.home("unified", "hot") == {"w0", "w2", "w3"}


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.dictionaries(st.sampled_from(NAMES + ("",)), st.integers(0, 200)), st.integers(1, 6), st.integers(1, 8),
       st.integers(1, 3))
def test_orders_never_exceed_the_rate_bound_and_go_only_to_homes(counts, n, slots, max_orders):
    p, ws = AdapterPlacement(max_orders=max_orders), fleet(n=n, slots=slots)
    observe(p, counts)
    orders = p.plan(ws, 1.0)
    per_worker = {}
    for w, a in orders:
        per_worker[w.worker_id] = per_worker.get(w.worker_id, 0) + 1
        assert w.worker_id in p.home("unified", a) and len(p.home("unified", a)) > 1
    assert all(v <= max_orders for v in per_worker.values())
    assert len(set((w.worker_id, a) for w, a in orders)) == len(orders)
    for a, c in counts.items():
        if a and c:
            assert len(p.home("unified", a)) == p.replicas(a, ws) >= 1
