"""Criticality bands (strict between them, sheddable pushed out first) and SLOs on the request (predicted at arrival,
rejected at once, met and missed counted): the gateway's core, its wrapper and the engine's scheduler."""

import asyncio
import contextlib

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services.common.errors import CapacityExhausted, InvalidRequest, PermissionDenied
from services.common.pb import meshserve_pb2 as pb
from services.common.request import ClientRequest, with_headers
from services.common.sampling import SamplingParams
from services.gateway.admission import Admission
from services.policy.admission_core import AdmissionCore, Slo
from services.policy.bands import CRITICAL, SHEDDABLE, STANDARD, band_of
from services.policy.tenants import Tenant
from tests.support.fakes import Clock
from tests.support.metrics import metric_points
from tests.support.reference import make_engine

A, B = Tenant("A"), Tenant("B")


def core(policy="fair", slots=1, clock=None):
    c = AdmissionCore(policy, 30.0, clock=clock or Clock(100.0), queue_bursts=False)
    c.update_view([pb.WorkerLoad(role="unified", max_num_seqs=slots, kv_capacity_tokens=100_000,
                                 prefill_s_per_token=1e-3, decode_s_per_step=0.01)], "unified")
    return c


def dispatch(c):
    return [p.req_id for p in c.sweep()[1]]


def test_band_of_names_and_negative_priority():
    assert band_of("") == STANDARD and band_of("Critical") == CRITICAL and band_of("", -1) == SHEDDABLE
    assert band_of("sheddable", -3) == SHEDDABLE
    with pytest.raises(InvalidRequest, match="criticality must be one of"):
        band_of("urgent")
    with pytest.raises(InvalidRequest, match="negative priority"):
        band_of("critical", -1)


@pytest.mark.parametrize("policy", ["fcfs", "fair", "fair-deadline", "priority", "deadline"])
def test_a_more_urgent_band_leaves_the_queue_first_under_every_policy(policy):
    c = core(policy)
    c.offer(A, "running", 10, 10, 0, None)
    assert dispatch(c) == ["running"]
    c.offer(A, "standard", 10, 10, 0, None)
    c.offer(A, "sheddable", 10, 10, 0, None, band=SHEDDABLE)
    c.offer(B, "critical", 10, 10, 5, None, band=CRITICAL)  # a lax priority class, a newer arrival, another tenant
    order = []
    while c.queue.queue or c.queue.running:
        for p in list(c.queue.running.values()):
            c.done(p, 10)
        order += dispatch(c)
    assert order == ["critical", "standard", "sheddable"]


def test_a_critical_request_goes_past_a_full_mesh_once_per_lower_band_request_running():
    """The band decision of preemption: with every slot taken by standard requests, a critical one is dispatched at
    once (the engine gives it a standard request's slot), but no more critical ones than standard ones running."""
    c = core("fcfs", slots=2)
    c.offer(A, "s1", 10, 10, 0, None)
    c.offer(A, "s2", 10, 10, 0, None)
    assert dispatch(c) == ["s1", "s2"]
    for i in range(3):
        c.offer(B, f"c{i}", 10, 10, 0, None, band=CRITICAL)
    assert dispatch(c) == ["c0", "c1"]  # two standard requests to preempt, two critical ones past capacity
    assert c.over_capacity == 2 and [p.req_id for p in c.queue.queue] == ["c2"]
    running = {p.req_id: p for p in c.queue.running.values()}
    c.done(running["c0"], 10)  # one request fewer past capacity: c2 may take a standard request's slot
    assert c.over_capacity == 1 and dispatch(c) == ["c2"]
    c.offer(A, "s3", 10, 10, 0, None)
    running = {p.req_id: p for p in c.queue.running.values()}
    for r in ("c1", "c2"):
        c.done(running[r], 10)
    assert c.over_capacity == 0 and dispatch(c) == []  # s1 and s2 have the two slots back
    c.done(running["s1"], 10)
    assert dispatch(c) == ["s3"]


def test_sheddable_requests_are_pushed_out_first_and_standard_ones_before_critical():
    """The queue holds at most the bound's work: past it, the newest request of the least urgent band goes (with a
    retry-after), whoever arrives."""
    c = core("fcfs", slots=1)
    c.offer(A, "running", 10, 100, 0, None)  # ~1 s each at 10 ms a step
    dispatch(c)
    for i in range(10):
        c.offer(A, f"shed{i}", 10, 100, 0, None, band=SHEDDABLE)
    for i in range(40):
        with contextlib.suppress(CapacityExhausted):  # past the bound, standard newcomers are turned away too
            c.offer(A, f"std{i}", 10, 100, 0, None)
    waiting = [p.req_id for p in c.queue.queue]
    assert not any(r.startswith("shed") for r in waiting), waiting  # all ten gave their place to standard ones
    assert waiting[-1] != "std39"  # and then standard newcomers were the ones refused
    with pytest.raises(CapacityExhausted, match="overloaded") as e:  # a sheddable newcomer: no room for it at all
        c.offer(A, "shed-late", 10, 100, 0, None, band=SHEDDABLE)
    assert e.value.retry_after_ms > 0
    _, pushed = c.offer(B, "crit", 10, 100, 0, None, band=CRITICAL)
    assert [p.req_id for p in pushed] == [waiting[-1]]  # the newest standard request makes room for the critical one
    assert c.queue.queue[-1].req_id == "crit"


def test_a_critical_request_is_not_rejected_for_a_standard_backlog():
    c = core("fcfs", slots=1)
    c.offer(A, "running", 10, 100, 0, None)
    dispatch(c)
    accepted = 0
    for i in range(60):
        try:
            c.offer(A, f"std{i}", 10, 100, 0, None)
            accepted += 1
        except CapacityExhausted:
            pass
    assert accepted < 60  # the standard band is at its bound
    c.offer(B, "crit", 10, 100, 0, None, band=CRITICAL)  # not "overloaded": nothing of its band is ahead of it


def trusted(c, step_s=0.01, prefill_s=1e-3, n=8):
    """Teach the core's cost model n completions at these costs (as done() does)."""
    for _ in range(n):
        c.cost.observe(100, 11, 100 * prefill_s, 10 * step_s)
    c.queue.trust_predictions = c.cost.trusted


def test_slo_rejects_at_arrival_what_the_queue_and_the_step_time_predict_late():
    clock = Clock(100.0)
    c = core("fcfs", slots=1, clock=clock)
    c.offer(A, "untrusted", 100, 100, 0, None, slo=Slo(0.001, 0.001))  # nothing measured yet: admitted
    dispatch(c)
    trusted(c, step_s=0.02)
    with pytest.raises(CapacityExhausted, match="time per output token 20.0 ms over the 10.0 ms target"):
        c.offer(A, "tpot", 100, 10, 0, None, slo=Slo(tpot_s=0.010))
    c.offer(A, "tpot-ok", 100, 10, 0, None, slo=Slo(tpot_s=0.025))
    for i in range(5):  # 100 steps of 20 ms each: ~2 s apiece ahead in the queue
        c.offer(A, f"q{i}", 100, 100, 0, None)
    with pytest.raises(CapacityExhausted, match="time to first token") as e:
        c.offer(A, "ttft", 100, 100, 0, None, slo=Slo(ttft_s=1.0))
    assert e.value.retry_after_ms >= 1000  # the queue must drain by the excess first
    c.offer(B, "critical", 100, 100, 0, None, band=CRITICAL, slo=Slo(ttft_s=1.0))  # nothing of its band ahead


def test_slo_outcome_met_and_missed():
    c = core("fcfs")
    p, _ = c.offer(A, "r", 10, 11, 0, None, slo=Slo(ttft_s=0.5, tpot_s=0.02))
    assert c.slo_outcome(p, 11, p.arrival_s + 0.4, p.arrival_s + 0.4 + 10 * 0.019) == {"ttft": True, "tpot": True}
    assert c.slo_outcome(p, 11, p.arrival_s + 0.6, p.arrival_s + 0.6 + 10 * 0.021) == {"ttft": False, "tpot": False}
    assert c.slo_outcome(p, 0, None, None) == {"ttft": False, "tpot": False}


def test_the_gateway_counts_slo_outcomes_per_tenant_and_rejections():
    async def go():
        reader, clock = InMemoryMetricReader(), Clock(100.0)
        adm = Admission("fcfs", 30.0, clock=clock, meter=MeterProvider(metric_readers=[reader]).get_meter("t"))
        adm.update_view([pb.WorkerLoad(role="unified", max_num_seqs=4, kv_capacity_tokens=10_000,
                                       decode_s_per_step=0.05)], "unified")
        trusted(adm, step_s=0.05)
        p = await adm.admit(A, "met", 10, 3, 0, None, slo=Slo(ttft_s=1.0))
        adm.done(p, 3, clock.now + 0.1, clock.now + 0.2)
        with pytest.raises(CapacityExhausted):
            await adm.admit(A, "rejected", 10, 3, 0, None, slo=Slo(tpot_s=0.01))
        points = {(d.attributes["tenant"], d.attributes["objective"], d.attributes["outcome"]): d.value
                  for d in metric_points(reader)["meshserve.gateway.slo"]}
        assert points == {("A", "ttft", "met"): 1, ("A", "tpot", "rejected"): 1}
    asyncio.run(go())


def test_headers_fill_what_the_request_left_empty():
    req = ClientRequest("id", SamplingParams(max_tokens=1), text="x", slo_tpot_ms=30)
    out = with_headers(req, {"x-criticality": "critical", "x-slo-ttft-ms": " 250 ", "x-slo-tpot-ms": "99"})
    assert (out.criticality, out.slo_ttft_ms, out.slo_tpot_ms) == ("critical", 250, 30)
    with pytest.raises(InvalidRequest, match="x-slo-ttft-ms must be an integer"):
        with_headers(req, {"x-slo-ttft-ms": "soon"})


def test_a_tenant_may_be_refused_bands_but_never_sheddable():
    t = Tenant("T", criticalities=frozenset({STANDARD}), priorities=frozenset({1}))
    t.check_request(10, 10, 1, "", STANDARD)
    t.check_request(10, 10, -1, "", SHEDDABLE)  # asking for less is always allowed
    with pytest.raises(PermissionDenied, match="may not send critical requests"):
        t.check_request(10, 10, 1, "", CRITICAL)


def test_the_engine_preempts_a_less_urgent_band_for_a_waiting_critical_request(tiny_model):
    """Every slot taken by standard requests: a critical one takes a slot at once (under FCFS, which never preempts
    inside a band), and the preempted standard request still finishes with its tokens."""
    engine = make_engine(tiny_model, num_blocks=64, block_size=16, budget=256, max_seqs=2, policy="fcfs")
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    std = [engine.add_request(f"s{i}", list(range(3 + i, 30 + i)), params) for i in range(2)]
    engine.step()
    crit = engine.add_request("c", list(range(50, 70)), SamplingParams(max_tokens=3, ignore_eos=True), band=CRITICAL)
    engine.step()
    assert crit.status.value == "running" and engine.scheduler.slot_preemptions == 1
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_integrity()
    assert all(len(r.tokens) - len(r.prompt_token_ids) == 30 for r in std)


def test_429_and_503_carry_retry_after_over_http():
    from services.common.errors import NoWorker
    from services.gateway.http import OpenAIError

    busy = OpenAIError.of(CapacityExhausted("queue full", retry_after_ms=2500)).response()
    assert busy.status_code == 429 and busy.headers["retry-after"] == "3" and busy.headers["retry-after-ms"] == "2500"
    gone = OpenAIError.of(NoWorker("no decode worker for 30 s", retry_after_ms=5000)).response()
    assert gone.status_code == 503 and gone.headers["retry-after"] == "5"
    assert "retry-after" not in OpenAIError.of(InvalidRequest("bad")).response().headers


def test_a_request_that_waits_the_starvation_bound_is_answered_then_with_a_retry_after():
    """The bound is a promise: predictions that let a request in wrongly cost it a refusal at the bound, not a longer
    wait. A lone tenant's burst (queued past the bound on purpose) is not held to it."""
    async def go():
        clock = Clock(100.0)
        adm = Admission("fcfs", 30.0, clock=clock)
        adm.update_view([pb.WorkerLoad(role="unified", max_num_seqs=1, kv_capacity_tokens=10_000)], "unified")
        first = await adm.admit(A, "a1", 10, 5, 0, None)
        burst = asyncio.ensure_future(adm.admit(A, "a2", 10, 5, 0, None))  # A alone: a burst, not held to the bound
        await asyncio.sleep(0)
        clock.now += 1.0
        late = asyncio.ensure_future(adm.admit(B, "b1", 10, 5, 0, None))
        await asyncio.sleep(0)
        clock.now += 29.5
        adm.pump()
        assert not late.done()  # 29.5 s: still within the bound
        clock.now += 0.5
        adm.pump()
        with pytest.raises(CapacityExhausted, match="no slot within the 30 s starvation bound") as e:
            await late
        assert e.value.retry_after_ms > 0 and not burst.done()
        adm.done(first, 5)
        await asyncio.wait_for(burst, 1)  # the burst is served in its turn, past the bound
    asyncio.run(go())
