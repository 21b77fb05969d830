"""Slot arbitration policies, table-driven, and the scheduler's use of them."""

from dataclasses import dataclass

import pytest

from services.common.arbitration import FcfsPolicy, PriorityPolicy, make_policy
from services.common.sampling import SamplingParams
from tests.support.reference import make_engine


@dataclass
class Claim:
    name: str
    arrival_s: float
    priority: int
    seq_no: int


CLAIMS = [Claim("late-urgent", 3.0, 0, 2), Claim("early-lax", 1.0, 5, 0), Claim("mid-normal", 2.0, 1, 1),
          Claim("tie", 2.0, 1, 3)]


@pytest.mark.parametrize("policy,order,victim", [
    (FcfsPolicy(), ["early-lax", "mid-normal", "tie", "late-urgent"], "late-urgent"),
    (PriorityPolicy(), ["late-urgent", "mid-normal", "tie", "early-lax"], "early-lax"),
])
def test_order_and_victim(policy, order, victim):
    assert [c.name for c in policy.order(CLAIMS)] == order
    assert policy.victim(CLAIMS).name == victim
    assert policy.victim([]) is None


def test_unknown_policy_lists_known():
    with pytest.raises(ValueError, match="fcfs"):
        make_policy("lottery")


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
