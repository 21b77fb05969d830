"""The gateway's admission control: tenants' limits, then the admission queue when the mesh is full.

Thin and asyncio-bound; the decisions are services/policy/admission_core.py's (which the simulator runs too) and
the pure objects' under it (services.policy.tenants, services.policy.admission_queue,
services.policy.arbitration). The mesh's capacity is the credits the
serving workers grant this gateway (services/gateway/credits.py: pushed the moment a slot
frees): a request is dispatched only while an unused credit is held that no dispatched request
has yet been routed against, and is then routed to a worker holding one (the router is asked to
avoid the others) and uses it up. Until the first credit stream is open, capacity comes from the
router's view of the workers (update_view(), fed by the gateway's poll of ListWorkers): their
batch slots and KV token capacity, against what this gateway has dispatched. The view also
gives the workers' fitted step costs, for predicted service times. A request waits in the queue
only while the mesh is at capacity; an under-share tenant's request may go past it (see
AdmissionCore._under_share).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from opentelemetry import metrics

from services.common.errors import CapacityExhausted, DeadlineExceeded, MeshError
from services.common.telemetry import (
    FLOW_QUEUE_DURATION,
    FLOW_QUEUE_SIZE,
    FLOW_SATURATION,
    QUEUE_DEPTH,
    QUEUE_OLDEST_WAIT,
    QUEUE_WAIT_BUCKETS_S,
)
from services.policy.admission_core import NO_SLO, AdmissionCore, Slo
from services.policy.admission_queue import Pending
from services.policy.bands import STANDARD
from services.policy.tenants import Tenant

log = logging.getLogger("meshserve.gateway.admission")


class GatewayMetrics:
    """Per tenant: queued, admitted, rejected by reason, tokens served, queue wait, TTFT."""

    def __init__(self, meter: metrics.Meter | None = None):
        meter = meter or metrics.get_meter("meshserve.gateway")
        self.requests = meter.create_counter("meshserve.gateway.requests", description=(
            "requests by tenant and outcome (queued, admitted, rejected) and rejection reason"))
        self.tokens = meter.create_counter("meshserve.gateway.tokens_served", unit="{token}",
                                           description="prompt and output tokens served, by tenant and kind")
        self.queue_wait = meter.create_histogram("meshserve.gateway.queue_wait", unit="ms",
                                                 description="time in the admission queue, by tenant")
        self.ttft = meter.create_histogram("meshserve.gateway.ttft", unit="ms", description="time to first token")
        self.flow_queue_duration = meter.create_histogram(
            FLOW_QUEUE_DURATION, unit="s", explicit_bucket_boundaries_advisory=QUEUE_WAIT_BUCKETS_S,
            description="time in the admission queue, by fairness_id (tenant), priority and outcome (the Gateway API "
                        "Inference Extension's name)")
        self.slo = meter.create_counter("meshserve.gateway.slo", description=(
            "requests carrying a latency target, by tenant, objective (ttft, tpot) and outcome (met, missed, "
            "rejected: refused at arrival as predicted to miss)"))

    def outcome(self, tenant: str, outcome: str, reason: str = "") -> None:
        self.requests.add(1, {"tenant": tenant, "outcome": outcome, **({"reason": reason} if reason else {})})


class Admission(AdmissionCore):
    """The core's decisions (services/policy/admission_core.py) on the event loop: a caller waits on a future that
    sweep()'s dispatch, push-out or expiry settles; metrics per tenant."""

    def __init__(self, policy_name: str = "fair-deadline", starvation_s: float = 30.0, clock=time.monotonic,
                 meter=None, queue_bursts: bool = True, share_preemption: bool = False):
        super().__init__(policy_name, starvation_s, clock, queue_bursts, share_preemption)
        self.waiters: dict[int, asyncio.Future] = {}
        self.metrics = GatewayMetrics(meter)
        self._reported: set = set()  # (tenant, band, priority) reported once: they report 0 when their queue empties
        meter = meter or metrics.get_meter("meshserve.gateway")
        meter.create_observable_gauge(QUEUE_DEPTH, [self._observe_depth], unit="{request}",
                                      description="requests waiting in the admission queue, by tenant, band and "
                                                  "priority")
        meter.create_observable_gauge(QUEUE_OLDEST_WAIT, [self._observe_oldest], unit="s",
                                      description="how long the oldest waiting request has waited, by tenant, band "
                                                  "and priority")
        # the same queue under the Gateway API Inference Extension's flow-control names (llm-d's EPP exports them):
        # dashboards and KEDA triggers written for those read the gateway unchanged
        meter.create_observable_gauge(FLOW_QUEUE_SIZE, [self._observe_flow_queue], unit="{request}",
                                      description="requests waiting in the admission queue, by fairness_id (tenant) "
                                                  "and priority")
        meter.create_observable_gauge(FLOW_SATURATION, [self._observe_saturation],
                                      description="how full the pool is (slots or KV tokens in use over capacity, the "
                                                  "larger): at 1 or more requests wait in the queue")

    def _queue_levels(self):
        """((tenant, band, priority), (depth, oldest wait)) of every key seen so far (0 once its queue empties)."""
        now = self.waiting()
        self._reported |= set(now)
        return [(key, now.get(key, (0, 0.0))) for key in sorted(self._reported)]

    def _observe(self, index: int):
        for (tenant, band, priority), values in self._queue_levels():
            yield metrics.Observation(values[index], {"tenant": tenant, "band": band, "priority": str(priority),
                                                      "pool": self.pool})

    def _observe_flow_queue(self, options):
        for (tenant, band, priority), (depth, _) in self._queue_levels():
            yield metrics.Observation(depth, {"fairness_id": tenant, "priority": str(priority), "band": band,
                                              "inference_pool": self.pool})

    def _observe_saturation(self, options):
        yield metrics.Observation(self.saturation(), {"inference_pool": self.pool})

    def _observe_depth(self, options):
        return self._observe(0)

    def _observe_oldest(self, options):
        return self._observe(1)

    def update_view(self, workers: list, role: str) -> None:
        super().update_view(workers, role)
        self.pump()

    async def admit(self, tenant: Tenant, req_id: str, prompt_tokens: int, max_tokens: int, priority: int,
                    deadline_s: float | None, band: int = STANDARD, slo: Slo = NO_SLO) -> Pending:
        """Wait for a dispatch slot; raises the tenant's and the queue's rejections. Call done() after."""
        try:
            p, pushed = self.offer(tenant, req_id, prompt_tokens, max_tokens, priority, deadline_s, band, slo)
        except MeshError as e:
            self.metrics.outcome(tenant.name, "rejected", _reason(e))
            for objective, target in (("ttft", slo.ttft_s), ("tpot", slo.tpot_s)):
                if target is not None:
                    self.metrics.slo.add(1, {"tenant": tenant.name, "objective": objective, "outcome": "rejected"})
            raise
        for q in pushed:
            self.metrics.outcome(q.tenant, "rejected", "pushed-out")
            _settle(self.waiters.get(id(q)), CapacityExhausted(
                f"pushed out of the admission queue: the mesh is overloaded and tenant {q.tenant!r} is the furthest "
                f"over its share", retry_after_ms=math.ceil(self.queue.starvation_s * 1000)))
        fut = asyncio.get_running_loop().create_future()
        self.waiters[id(p)] = fut
        self.metrics.outcome(tenant.name, "queued")
        try:
            self.pump()
            await fut
        except BaseException:
            # Dispatched just as the caller went away: also when its future was cancelled first and pump() then
            # dispatched it (it found the future done and could not tell it); the slot goes back either way.
            if self.withdraw(p):
                self.pump()
            raise
        finally:
            self.waiters.pop(id(p), None)
        self.metrics.outcome(tenant.name, "admitted")
        self.metrics.queue_wait.record((p.dispatched_s - p.arrival_s) * 1e3, {"tenant": tenant.name})
        self.metrics.flow_queue_duration.record(p.dispatched_s - p.arrival_s, {
            "fairness_id": tenant.name, "priority": str(p.priority), "outcome": "Dispatched",
            "inference_pool": self.pool})
        return p

    def done(self, p: Pending, output_tokens: int, first_token_s: float | None = None,
             last_token_s: float | None = None) -> None:
        super().done(p, output_tokens, first_token_s, last_token_s)
        outcomes = self.slo_outcome(p, output_tokens, first_token_s, last_token_s) if last_token_s is not None else {}
        for objective, met in outcomes.items():  # of completed requests (a cancelled one met or missed nothing)
            self.metrics.slo.add(1, {"tenant": p.tenant, "objective": objective, "outcome": "met" if met else "missed"})
        self.metrics.tokens.add(p.input_tokens, {"tenant": p.tenant, "kind": "prompt"})
        self.metrics.tokens.add(output_tokens, {"tenant": p.tenant, "kind": "output"})
        self.pump()

    def pump(self) -> None:
        """The core's sweep: settle the expired requests' callers with DEADLINE_EXCEEDED, the dispatched ones'
        with their slot."""
        expired, dispatched = self.sweep()
        now = self.clock()
        for p in expired:
            if p.dropped == "bound":
                self.metrics.outcome(p.tenant, "rejected", "bound")
                _settle(self.waiters.get(id(p)), CapacityExhausted(
                    f"no slot within the {self.queue.starvation_s:g} s starvation bound: the mesh is overloaded "
                    f"(waited {now - p.arrival_s:.1f} s in the admission queue)",
                    retry_after_ms=math.ceil(self.queue.predicted_wait(now, self.queue.queue) * 1000) or 1000))
                continue
            self.metrics.outcome(p.tenant, "rejected", "deadline")
            _settle(self.waiters.get(id(p)), DeadlineExceeded(
                f"the deadline cannot be met: it passed or too little time is left after "
                f"{(now - p.arrival_s) * 1e3:.0f} ms in the admission queue"))
        for p in dispatched:
            _settle(self.waiters.get(id(p)), None)

    async def tick(self, period_s: float = 0.05) -> None:
        """Expire and dispatch on a clock too (deadlines pass without any event)."""
        while True:
            await asyncio.sleep(period_s)
            if self.queue.queue:
                self.pump()


def _settle(fut: asyncio.Future | None, error: Exception | None) -> None:
    if fut is None or fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def _reason(e: MeshError) -> str:
    if isinstance(e, DeadlineExceeded):
        return "deadline"
    if isinstance(e, CapacityExhausted):
        return "limit" if "tenant" in str(e) else "overload"
    return e.code.lower()
