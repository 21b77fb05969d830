"""The engine scheduler's use of the arbitration policies (the policies themselves: test_admission.py)."""

from services.common.sampling import SamplingParams
from tests.support.reference import make_engine


def test_priority_policy_admits_urgent_first_and_preempts_lax(tiny_model):
    engine = make_engine(tiny_model, num_blocks=6, block_size=16, budget=256, max_seqs=4, policy="priority")
    lax = engine.add_request("lax", list(range(3, 40)), SamplingParams(max_tokens=40, ignore_eos=True), priority=5)
    engine.step()
    urgent = engine.add_request("urgent", list(range(50, 90)), SamplingParams(max_tokens=40, ignore_eos=True),
                                priority=0)
    while urgent.status.value != "finished":
        engine.step()
        engine.kv.check_integrity()
    assert lax.num_preemptions >= 1
    assert lax.status.value != "finished"


def test_fair_policy_in_the_engine_gives_the_next_slot_to_the_light_tenant(tiny_model):
    engine = make_engine(tiny_model, num_blocks=64, block_size=16, budget=64, max_seqs=1, policy="fair")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"heavy-{i}", list(range(3 + i, 40 + i)), params, tenant="heavy")
    engine.step()  # heavy-0 takes the only slot and is charged
    engine.add_request("light-0", list(range(50, 60)), params, tenant="light")
    finished = []
    while engine.has_unfinished():
        finished += [o.req_id for o in engine.step() if o.finished]
    assert finished.index("light-0") == 1  # right after the running request, ahead of heavy-1 and heavy-2
    assert engine.scheduler.policy.counter("light") > 0


def test_deadline_policy_in_the_engine_serves_least_slack_first(tiny_model):
    engine = make_engine(tiny_model, num_blocks=64, block_size=16, budget=64, max_seqs=1, policy="deadline")
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    now = engine.clock()
    engine.add_request("lax", list(range(3, 20)), params, deadline_s=now + 100)
    engine.add_request("none", list(range(3, 21)), params)
    engine.add_request("tight", list(range(3, 22)), params, deadline_s=now + 5)
    finished = []
    while engine.has_unfinished():
        finished += [o.req_id for o in engine.step() if o.finished]
    assert finished == ["tight", "lax", "none"]


def test_a_backlogged_light_tenant_preempts_once_the_heavy_one_is_a_whole_request_ahead(tiny_model):
    engine = make_engine(tiny_model, num_blocks=64, block_size=16, budget=64, max_seqs=1, policy="fair")
    heavy = engine.add_request("heavy", list(range(3, 40)), SamplingParams(max_tokens=120, ignore_eos=True),
                               tenant="heavy")
    engine.step()
    light = [engine.add_request(f"light-{i}", list(range(50 + i, 60 + i)),
                                SamplingParams(max_tokens=4, ignore_eos=True), tenant="light") for i in range(2)]
    policy, finished, order = engine.scheduler.policy, [], []
    while engine.has_unfinished():
        finished += [o.req_id for o in engine.step() if o.finished]
        order.append(policy.counter("heavy") - policy.counter("light"))
        engine.kv.check_integrity()
    # light waited until heavy was more than a whole light request (10 + 2 x 4 = 18) ahead, then both light
    # requests ran before heavy finished; heavy was preempted once and never took the slot back early
    assert finished == ["light-0", "light-1", "heavy"]
    assert heavy.num_preemptions == 1 and all(r.num_preemptions == 0 for r in light)
