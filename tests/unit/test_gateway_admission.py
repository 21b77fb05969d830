"""The gateway's admission wrapper: capacity from the router's view, per-tenant metrics, push-out."""

import asyncio

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services.common.errors import CapacityExhausted
from services.common.pb import meshserve_pb2 as pb
from services.common.tenants import Limits, Tenant
from services.gateway.admission import Admission
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
