"""LoRA placement: replicas by measured demand, orders to the emptiest workers, no repeats, a bounded rate."""

from hypothesis import given, settings, strategies as st

from services.router.placement import AdapterPlacement
from services.router.views import WorkerView


def fleet(n=4, slots=8, **kw):
    return [WorkerView(f"w{i}", f"a:{i}", "unified", lora_slots=slots, free_lora_slots=slots,
                       known_adapters=("hot", "warm", "cold"), **kw) for i in range(n)]


def observe(p, counts: dict, now=0.0):
    for adapter, n in counts.items():
        for _ in range(n):
            p.observe(adapter, now)


def test_a_hot_adapter_is_replicated_by_its_share_and_a_cold_one_left_alone():
    p, ws = AdapterPlacement(), fleet()
    observe(p, {"hot": 50, "warm": 2, "cold": 1, "": 47})  # 100 requests: hot 50%, warm 2%, cold 1%
    assert p.replicas("hot", ws) == 4 and p.replicas("warm", ws) == 1 and p.replicas("cold", ws) == 1
    orders = p.plan(ws, 1.0)
    assert sorted((w.worker_id, a) for w, a in orders) == [("w0", "hot"), ("w1", "hot"), ("w2", "hot"), ("w3", "hot")]
    assert p.plan(ws, 2.0) == []  # ordered: not again until the heartbeats show it (or reorder_s passes)


def test_holders_count_and_new_replicas_go_to_free_slots_first():
    p, ws = AdapterPlacement(), fleet(n=3, slots=2)
    observe(p, {"hot": 60, "": 40})  # replicas = ceil(0.6 * 3 * 2) = 3 -> all three
    ws[0].host_adapters = ("hot",)
    ws[1].free_lora_slots, ws[2].free_lora_slots = 0, 2
    assert [(w.worker_id, a) for w, a in p.plan(ws, 1.0)] == [("w2", "hot"), ("w1", "hot")]


def test_demand_ages_out_of_the_window():
    p, ws = AdapterPlacement(window_s=10), fleet()
    observe(p, {"hot": 50, "": 50}, now=0.0)
    observe(p, {"": 100}, now=20.0)
    assert p.replicas("hot", ws) == 0 and p.plan(ws, 20.0) == []


def test_only_workers_that_know_the_adapter_get_orders():
    p, ws = AdapterPlacement(), fleet()
    ws[1].known_adapters = ()
    observe(p, {"hot": 100})
    assert {w.worker_id for w, _ in p.plan(ws, 1.0)} == {"w0", "w2", "w3"}


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.dictionaries(st.sampled_from(["hot", "warm", "cold", ""]), st.integers(0, 200)), st.integers(1, 6),
       st.integers(1, 8), st.integers(1, 3))
def test_orders_never_exceed_the_rate_bound_or_the_replica_target(counts, n, slots, max_orders):
    p, ws = AdapterPlacement(max_orders=max_orders), fleet(n=n, slots=slots)
    observe(p, counts)
    orders = p.plan(ws, 1.0)
    per_worker = {}
    for w, a in orders:
        per_worker[w.worker_id] = per_worker.get(w.worker_id, 0) + 1
        assert p.replicas(a, ws) >= 2
    assert all(v <= max_orders for v in per_worker.values())
    assert len(set((w.worker_id, a) for w, a in orders)) == len(orders)
    for a in {a for _, a in orders}:
        assert sum(1 for _, b in orders if b == a) <= p.replicas(a, ws)
