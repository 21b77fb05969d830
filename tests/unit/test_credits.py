"""The worker's credit ledger (services/policy/credit_ledger.py): never more credits out than free slots."""

from hypothesis import given, settings
from hypothesis import strategies as st

from services.policy.credit_ledger import CreditLedger


def test_free_slots_are_granted_to_the_subscription_holding_fewest_and_used_up_by_requests():
    ledger = CreditLedger(slots=3)
    ledger.subscribe("g1")
    assert ledger.grant() == {"g1"} and ledger.unused("g1") == 3
    ledger.subscribe("g2")
    assert ledger.grant() == set()  # g1 holds every free slot until it uses one
    assert ledger.accept("g1") and ledger.unused("g1") == 2
    ledger.release()  # that request ended: its slot is free again, and g2 holds none
    assert ledger.grant() == {"g2"} and (ledger.unused("g1"), ledger.unused("g2")) == (2, 1)
    assert not ledger.accept("g2-gone") and ledger.uncredited == 1  # served anyway, without a credit
    ledger.unsubscribe("g1")  # its unused credits return to the free slots
    assert ledger.free == 3 - 1 - 1 and ledger.grant() == {"g2"}


def test_a_credit_given_back_counts_used_once_whether_its_request_came_before_after_or_never():
    ledger = CreditLedger(slots=2)
    ledger.subscribe("g")
    ledger.grant()
    assert ledger.accept("g", "r1") and not ledger.give_back("g", "r1")  # it reached the worker: nothing lost
    assert ledger.give_back("g", "r2") and ledger.lost == 1  # cancelled in flight: its credit counts used
    assert ledger.unused("g") == 0 and ledger.grant() == {"g"}  # and its slot is granted again
    assert not ledger.give_back("g", "r2")  # once
    assert ledger.accept("g", "r2") and ledger.unused("g") == 1  # arriving late, it uses no second credit
    assert not ledger.give_back("g-gone", "r3")  # a subscription that ended holds nothing to give back


ops = st.lists(st.tuples(st.sampled_from(["accept", "release", "subscribe", "unsubscribe", "grant", "lose"]),
                         st.sampled_from(["a", "b", "c", ""])), max_size=60)


@settings(max_examples=200)
@given(st.integers(1, 6), ops)
def test_credited_work_never_exceeds_the_slots_and_lost_credits_come_back(slots, steps):
    ledger, live = CreditLedger(slots), 0
    for i, (op, sub) in enumerate(steps):
        if op == "accept" and sub and ledger.unused(sub) > 0:  # a gateway sends only against a credit it holds
            assert ledger.accept(sub, f"r{i}")
            live += 1
        elif op == "lose" and sub and ledger.unused(sub) > 0:  # sent, cancelled in flight, given back
            assert ledger.give_back(sub, f"r{i}")
        elif op == "release" and live:
            ledger.release()
            live -= 1
        elif op == "subscribe" and sub:
            ledger.subscribe(sub)
        elif op == "unsubscribe":
            ledger.unsubscribe(sub)
        elif op == "grant":
            ledger.grant()
        outstanding = sum(ledger.unused(s) for s in ledger.granted)
        assert live + outstanding <= slots and ledger.max_live <= slots
    for _ in range(live):
        ledger.release()
    ledger.grant()
    assert not ledger.granted or sum(ledger.unused(s) for s in ledger.granted) == slots  # no slot lost for good
