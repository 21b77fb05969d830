"""The progress bound on a stream (services.policy.progress, issue 65): from the worker's own step times, a stream
with no event within it is stalled; a worker the router stops listing stalls its streams; a stalled worker is
avoided for a while."""

from types import SimpleNamespace

import pytest

from services.policy.progress import Pace, ProgressWatch


def load(address, decode=0.05, prefill=0.001, longest=0.0, chunk=512, outstanding=0):
    return SimpleNamespace(address=address, decode_s_per_step=decode, prefill_s_per_token=prefill,
                           longest_step_s=longest, max_num_batched_tokens=chunk, outstanding_tokens=outstanding)


def test_the_bound_is_a_step_of_the_workers_own_times():
    watch = ProgressWatch(factor=4, floor_s=2)
    watch.update([load("a"), load("b", longest=3.0), load("p", outstanding=1000)], now=0)
    assert watch.next_s("a") == pytest.approx(2 + 4 * 0.05)  # a decode step: it holds no prompt
    assert watch.next_s("p") == pytest.approx(2 + 4 * (0.05 + 512 * 0.001))  # a chunk of the prompts it holds
    assert watch.next_s("b") == pytest.approx(2 + 4 * 3.0)  # its longest recent step is longer
    s = watch.open("a", "decode", 1.0, now=0, prompt_tokens=100)  # sent since its last report: pending there
    assert watch.next_s("a") == pytest.approx(2 + 4 * (0.05 + 0.1))
    watch.event(s, now=0.5)
    assert watch.next_s("a") == pytest.approx(2 + 4 * 0.05) and not watch.pending
    assert watch.first_s("a", "decode", 100) == pytest.approx(2 + 4 * (0.05 + 0.1))  # its prompt, not a full chunk
    assert watch.first_s("p", "prefill", 100) == pytest.approx(2 + 4 * (0.05 + 1.1))  # the queue ahead too
    assert watch.first_s("a", "decode", 1536) == pytest.approx(2 + 4 * (0.05 + 1.536))  # chunks before the last
    assert watch.next_s("unknown") == watch.unmeasured_s
    assert not Pace().measured


def test_a_stream_without_an_event_within_its_bound_stalls_once_and_its_worker_is_avoided():
    watch = ProgressWatch(factor=4, floor_s=2, suspect_s=10)
    watch.update([load("a", prefill=0.0, chunk=0), load("b", prefill=0.0, chunk=0)], now=0)
    bound = watch.next_s("a")  # 2.2 s
    sa = watch.open("a", "decode", bound, now=0, handle="call-a")
    sb = watch.open("b", "decode", bound, now=0)
    watch.event(sb, now=2.0)  # b sent an event at 2 s; read at once
    watch.waiting(sb, bound, now=2.0)
    assert watch.stalled(now=2.1) == ([], [])
    stalled, overdue = watch.stalled(now=2.3)
    assert stalled == [sa] and sa.handle == "call-a" and "no event from it for 2.3 s" in sa.reason and not overdue
    assert watch.stalled(now=2.4) == ([], [])  # reported once: off the watch
    assert watch.avoid(now=5) == ["a"] and watch.avoid(now=12.3) == []
    watch.close(sb)
    assert watch.stalled(now=100) == ([], [])


def test_a_stream_queued_on_a_worker_that_steps_is_not_stalled():
    """Past its own bound, but another stream of its worker had an event within the worker's bound: it waits for a
    batch slot (or in the prompt queue), which is no hang."""
    watch = ProgressWatch(factor=4, floor_s=2)
    watch.update([load("a", prefill=0.0, chunk=0)], now=0)
    queued = watch.open("a", "decode", 2.2, now=0)
    busy = watch.open("a", "decode", 2.2, now=0)
    for t in (1.0, 2.0, 3.0, 4.0):
        watch.event(busy, now=t)
        watch.waiting(busy, 2.2, now=t)
        assert watch.stalled(now=t + 0.1) == ([], [])
    assert queued.due_s > 4.1
    # the worker stops: both stall once the worker's own bound passes without an event
    stalled, _ = watch.stalled(now=4.0 + 2.3 + 2.3)
    assert set(stalled) == {queued, busy}


def test_a_handoff_past_its_bound_on_a_worker_that_steps_is_the_kvstores_to_answer():
    watch = ProgressWatch(factor=4, floor_s=2, suspect_s=10)
    watch.update([load("d", prefill=0.0, chunk=0)], now=0)
    handoff = watch.open("d", "decode", 2.2, now=0, handoff=True)
    other = watch.open("d", "decode", 2.2, now=0)
    watch.event(other, now=2.5)
    watch.waiting(other, 2.2, now=2.5)
    stalled, overdue = watch.stalled(now=2.6)
    assert stalled == [] and overdue == [handoff]
    watch.extend(overdue, now=2.6)  # the kvstore answered
    assert watch.stalled(now=2.7) == ([], [])
    watch.event(other, now=4.8)
    watch.waiting(other, 2.2, now=4.8)
    _, overdue = watch.stalled(now=4.9)
    assert watch.stall_on_kvstore(overdue, "no answer") == [handoff] and handoff.kvstore
    assert watch.avoid(now=5) == []  # the worker is not blamed


def test_a_worker_the_router_stops_listing_stalls_its_streams_once_confirmed():
    watch = ProgressWatch(confirm_s=1.5, unmeasured_s=30)
    watch.update([load("a"), load("b")], now=0)
    s = watch.open("a", "decode", 30, now=0)
    watch.update([load("b")], now=1.0)  # a first missing
    assert watch.stalled(now=1.0) == ([], [])
    watch.update([load("a"), load("b")], now=1.5)  # back (a router that woke from a pause listed nobody a moment)
    watch.update([load("b")], now=2.0)
    watch.update([load("b")], now=3.0)
    assert watch.stalled(now=3.0) == ([], [])  # missing for 1.0 s only
    watch.update([load("b")], now=3.6)
    assert watch.stalled(now=3.6) == ([s], []) and "heartbeats stopped" in s.reason
    # no listing at all (the router itself does not answer) forgets nobody
    t = watch.open("b", "decode", 30, now=4)
    assert watch.stalled(now=20) == ([], []) and t in watch.streams
