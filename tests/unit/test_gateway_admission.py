"""The gateway's admission wrapper: capacity from the router's view, per-tenant metrics, push-out."""

import asyncio

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services.common.errors import CapacityExhausted, DeadlineExceeded
from services.common.pb import meshserve_pb2 as pb
from services.common.telemetry import prometheus_name
from services.gateway.admission import Admission
from services.policy.tenants import Limits, Tenant
from tests.support.fakes import Clock
from tests.support.metrics import metric_points

A, B = Tenant("A", weight=1.0), Tenant("B", weight=1.0, limits=Limits(requests_per_s=1))


def test_queue_when_full_dispatch_on_finish_and_per_tenant_metrics():
    async def go():
        reader, clock = InMemoryMetricReader(), Clock(100.0)
        adm = Admission("fcfs", 30.0, clock=clock, meter=MeterProvider(metric_readers=[reader]).get_meter("t"))
        adm.update_view([pb.WorkerLoad(role="unified", max_num_seqs=1, kv_capacity_tokens=10_000)], "unified")
        first = await adm.admit(A, "a1", 10, 5, 0, None)  # room: dispatched at once
        waiting = asyncio.ensure_future(adm.admit(A, "a2", 10, 5, 0, None))
        await asyncio.sleep(0)
        assert not waiting.done()  # the only slot is taken: queued
        clock.now += 0.25
        adm.done(first, output_tokens=5)  # a slot frees: the queued one goes
        second = await asyncio.wait_for(waiting, 1)
        assert second.dispatched_s - second.arrival_s == pytest.approx(0.25)
        adm.done(second, output_tokens=2)
        await adm.admit(B, "b1", 10, 5, 0, None)
        with pytest.raises(CapacityExhausted, match="requests/s"):
            await adm.admit(B, "b2", 10, 5, 0, None)
        p = metric_points(reader)
        outcomes = {(d.attributes["tenant"], d.attributes["outcome"], d.attributes.get("reason", "")): d.value
                    for d in p["meshserve.gateway.requests"]}
        assert outcomes[("A", "admitted", "")] == 2 and outcomes[("B", "rejected", "limit")] == 1
        tokens = {(d.attributes["tenant"], d.attributes["kind"]): d.value for d in p["meshserve.gateway.tokens_served"]}
        assert tokens[("A", "prompt")] == 20 and tokens[("A", "output")] == 7
        waits = {d.attributes["tenant"]: d for d in p["meshserve.gateway.queue_wait"]}
        assert waits["A"].count == 2 and waits["A"].max == pytest.approx(250.0)
    asyncio.run(go())


def test_poisoned_heartbeat_costs_cannot_reject_feasible_work():
    """Issue 19: one burst of heartbeats with huge step costs made every request with a deadline fail for as long as
    the gateway ran, and in disaggregated mode (decode workers report no prefill cost) predictions were ~30x high.
    Now a prediction alone rejects nothing until this gateway has measured completions itself, and then its own fit
    is used: heartbeats can no longer poison it."""
    async def go():
        clock = Clock(100.0)
        adm = Admission("fair-deadline", 30.0, clock=clock)
        poisoned = [pb.WorkerLoad(role="prefill", max_num_seqs=8, kv_capacity_tokens=10_000,
                                  prefill_s_per_token=1e6, decode_s_per_step=1e6),
                    pb.WorkerLoad(role="decode", max_num_seqs=8, kv_capacity_tokens=10_000, decode_s_per_step=1e6)]
        adm.update_view(poisoned, "decode")
        assert adm.cost.prefill_s_per_token <= 1e-2 and adm.cost.decode_s_per_step <= 2.0  # clamped
        for i in range(12):  # 64-token prompts, 16 tokens each: served in 40 ms against a 500 ms deadline
            p = await adm.admit(A, f"r{i}", 64, 16, 0, clock.now + 0.5)
            clock.now += 0.04
            adm.done(p, 16, first_token_s=p.dispatched_s + 0.01, last_token_s=clock.now)
        assert adm.cost.trusted and adm.cost.predict(64, 16) == pytest.approx(0.04, rel=0.1)
        adm.update_view(poisoned, "decode")  # more poison after the fit: the measured costs stand
        assert adm.cost.predict(64, 16) == pytest.approx(0.04, rel=0.1)
        await adm.admit(A, "after", 64, 16, 0, clock.now + 0.5)
        with pytest.raises(DeadlineExceeded):  # and a trusted prediction still turns away the infeasible
            await adm.admit(A, "too-tight", 64, 16, 0, clock.now + 0.01)
    asyncio.run(go())


def test_one_poisoned_worker_of_three_does_not_move_the_reported_cost():
    adm = Admission("fair-deadline", 30.0, clock=Clock(0.0))
    honest = dict(role="unified", max_num_seqs=8, kv_capacity_tokens=10_000, prefill_s_per_token=2e-4,
                  decode_s_per_step=0.02)
    adm.update_view([pb.WorkerLoad(**honest), pb.WorkerLoad(**honest),
                     pb.WorkerLoad(**{**honest, "prefill_s_per_token": 50.0, "decode_s_per_step": 900.0})], "unified")
    assert (adm.cost.prefill_s_per_token, adm.cost.decode_s_per_step) == (2e-4, 0.02)


def test_a_request_cancelled_as_it_is_dispatched_gives_its_slot_back():
    """Found by the early-cancel test (issue 19): the caller's task is cancelled (its future with it), then a slot
    frees and pump() dispatches the request to the cancelled future before the task runs its cleanup. The
    slot used to stay counted forever: with every slot lost so, every later request waited until its deadline."""
    async def go():
        clock = Clock(100.0)
        adm = Admission("fcfs", 30.0, clock=clock)
        adm.update_view([pb.WorkerLoad(role="unified", max_num_seqs=1, kv_capacity_tokens=10_000)], "unified")
        first = await adm.admit(A, "a1", 10, 5, 0, None)
        waiting = asyncio.ensure_future(adm.admit(A, "a2", 10, 5, 0, None))
        await asyncio.sleep(0)  # queued behind the only slot
        waiting.cancel()  # the client goes away...
        adm.done(first, 5)  # ...just as the slot frees: pump() hands it to the cancelled waiter
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert adm.running_requests == 0 and not adm.queue.running
        third = await asyncio.wait_for(adm.admit(A, "a3", 10, 5, 0, None), 1)  # the slot is free for the next
        assert third.dispatched_s is not None
    asyncio.run(go())


def test_prompt_and_output_tokens_are_limited_apart_and_unmade_output_is_given_back():
    """Token-based rate limits per tenant: prompt and output tokens per minute, each its own bucket. Output is
    reserved as max_tokens at admission and the part a request did not make comes back when it ends; a request
    the queue refuses or drops is charged nothing."""
    async def go():
        clock = Clock(100.0)
        t = Tenant("T", limits=Limits(prompt_tokens_per_min=600, output_tokens_per_min=120))
        adm = Admission("fcfs", 30.0, clock=clock)
        adm.update_view([pb.WorkerLoad(role="unified", max_num_seqs=8, kv_capacity_tokens=100_000)], "unified")
        a = await adm.admit(t, "a", 100, 100, 0, None)  # reserves 100 of the 120 output tokens
        with pytest.raises(CapacityExhausted, match="output tokens/min") as over:
            await adm.admit(t, "b", 100, 100, 0, None)
        # 80 more output tokens at 2 per second: 40 s, said in Retry-After's terms
        assert over.value.retry_after_ms == 40_000
        adm.done(a, output_tokens=10)  # made 10 of its 100: 90 come back
        b = await adm.admit(t, "b", 100, 100, 0, None)  # fits now: 120 - 10 - 100 = 10 left
        adm.done(b, output_tokens=100)
        with pytest.raises(CapacityExhausted, match="prompt tokens/min") as over:
            await adm.admit(t, "c", 500, 1, 0, None)  # 400 of 600 prompt tokens left
        assert over.value.retry_after_ms == 10_000  # 100 more at 10 a second
        with pytest.raises(CapacityExhausted, match="retrying will not help") as over:
            await adm.admit(t, "d", 10, 121, 0, None)  # more output than the whole minute's budget
        assert over.value.retry_after_ms == 0
        clock.now += 60  # a minute on, both buckets are full again
        c = await adm.admit(t, "c", 500, 1, 0, None)
        adm.done(c, output_tokens=1)
        # refused by the queue (a deadline already past): nothing charged
        st = adm.states["T"]
        before = {k: b.level for k, b in st.buckets.items()}
        with pytest.raises(DeadlineExceeded):
            await adm.admit(t, "e", 50, 50, 0, clock.now - 1)
        assert {k: b.level for k, b in st.buckets.items()} == pytest.approx(before)
    asyncio.run(go())


def test_the_queue_is_exported_by_tenant_and_priority_and_empties_to_zero():
    """The admission queue as a signal: depth and the oldest wait per tenant and priority, 0 once it empties."""
    async def go():
        reader, clock = InMemoryMetricReader(), Clock(100.0)
        adm = Admission("fcfs", 30.0, clock=clock, meter=MeterProvider(metric_readers=[reader]).get_meter("t"))
        adm.update_view([pb.WorkerLoad(role="unified", max_num_seqs=1, kv_capacity_tokens=10_000)], "unified")
        running = await adm.admit(A, "a1", 10, 5, 0, None)
        waiting = [asyncio.ensure_future(adm.admit(A, f"a{i}", 10, 5, p, None)) for i, p in ((2, 0), (3, 1))]
        await asyncio.sleep(0)
        clock.now += 2.0
        waiting.append(asyncio.ensure_future(adm.admit(B, "b1", 10, 5, 0, None)))
        await asyncio.sleep(0)
        clock.now += 0.5
        p = metric_points(reader)
        depth = {(d.attributes["tenant"], d.attributes["priority"]): d.value
                 for d in p["meshserve.gateway.queue_depth"] if d.attributes["band"] == "standard"}
        oldest = {(d.attributes["tenant"], d.attributes["priority"]): d.value
                  for d in p["meshserve.gateway.queue_oldest_wait"] if d.attributes["band"] == "standard"}
        assert depth == {("A", "0"): 1, ("A", "1"): 1, ("B", "0"): 1}
        assert oldest == pytest.approx({("A", "0"): 2.5, ("A", "1"): 2.5, ("B", "0"): 0.5})
        # the same under the Gateway API Inference Extension's names, and the pool's saturation (its one slot held)
        flow = {(d.attributes["fairness_id"], d.attributes["priority"]): d.value
                for d in p["inference_extension.flow_control.queue_size"]}
        assert flow == depth
        assert [(d.value, d.attributes["inference_pool"]) for d in p["inference_extension.flow_control.pool_saturation"]
                ] == [(1.0, "unified")]
        assert prometheus_name("inference_extension.flow_control.request_queue_duration", "s") == \
            "inference_extension_flow_control_request_queue_duration_seconds"
        for _ in waiting:  # one at a time through the single slot
            adm.done(running, output_tokens=5)
            running = await next(asyncio.as_completed(waiting))
            waiting = [w for w in waiting if not w.done()]
        adm.done(running, output_tokens=5)
        p = metric_points(reader)
        assert {d.value for d in p["meshserve.gateway.queue_depth"]} == {0}
        assert {d.value for d in p["meshserve.gateway.queue_oldest_wait"]} == {0}
        waits = {(d.attributes["fairness_id"], d.attributes["priority"]): d.count
                 for d in p["inference_extension.flow_control.request_queue_duration"]}
        assert waits == {("A", "0"): 2, ("A", "1"): 1, ("B", "0"): 1}  # every dispatch, a1's at once included
    asyncio.run(go())
