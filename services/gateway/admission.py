"""The gateway's admission control: tenants' limits, then the admission queue when the mesh is full.

Thin and asyncio-bound; the decisions are the pure objects' (services.common.tenants,
services.common.admission, services.common.arbitration). The mesh's capacity is the credits the
serving workers grant this gateway (services/gateway/credits.py: pushed the moment a slot
frees): a request is dispatched only while an unused credit is held that no dispatched request
has yet been routed against, and is then routed to a worker holding one (the router is asked to
avoid the others) and uses it up. Until the first credit stream is open, capacity comes from the
router's view of the workers (update_view(), fed by the gateway's poll of ListWorkers): their
batch slots and KV token capacity, against what this gateway has dispatched. The view also
gives the workers' fitted step costs, for predicted service times. A request waits in the queue
only while the mesh is at capacity; an under-share tenant's request may go past it (see
_under_share).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from opentelemetry import metrics

from services.common.admission import AdmissionQueue, CostModel, Pending, under_share
from services.common.arbitration import make_policy
from services.common.errors import CapacityExhausted, DeadlineExceeded, MeshError
from services.common.tenants import Tenant, TenantState

log = logging.getLogger("meshserve.gateway.admission")


@dataclass
class MeshView:
    slots: int = 0  # batch slots of the serving workers (0 = unknown: admit one at a time)
    kv_tokens: int = 0  # their KV token capacity
    outstanding_tokens: int = 0  # what they report as outstanding
    block_size: int = 0  # of the workers that compute prompts, when they all agree (0: none or mixed)


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

    def outcome(self, tenant: str, outcome: str, reason: str = "") -> None:
        self.requests.add(1, {"tenant": tenant, "outcome": outcome, **({"reason": reason} if reason else {})})


class Admission:
    def __init__(self, policy_name: str = "fair-deadline", starvation_s: float = 30.0, clock=time.monotonic,
                 meter=None, queue_bursts: bool = True):
        self.clock = clock
        self.cost = CostModel()
        self.queue = AdmissionQueue(make_policy(policy_name, starvation_s), starvation_s=starvation_s,
                                    trust_predictions=self.cost.trusted, queue_bursts=queue_bursts)
        self.view = MeshView()
        self.states: dict[str, TenantState] = {}
        self.waiters: dict[int, asyncio.Future] = {}
        self.running_requests = 0
        self.running_tokens = 0
        self.unrouted = 0  # dispatched, not yet routed against a credit
        self.credits = None  # CreditPool, once the gateway follows the workers' credit streams
        self.metrics = GatewayMetrics(meter)

    def state(self, tenant: Tenant, now: float) -> TenantState:
        st = self.states.get(tenant.name)
        if st is None:
            st = self.states[tenant.name] = TenantState(tenant, now)
        return st

    def update_view(self, workers: list, role: str) -> None:
        """From the router's ListWorkers: capacity and step costs of the workers of `role`."""
        serving = [w for w in workers if w.role == role]
        sizes = {w.block_size for w in workers if w.role in ("prefill", "unified")}
        self.view = MeshView(sum(w.max_num_seqs for w in serving), sum(w.kv_capacity_tokens for w in serving),
                             sum(w.outstanding_tokens for w in serving), sizes.pop() if len(sizes) == 1 else 0)
        self.queue.slots = max(self.view.slots, 1)
        # Each cost from the role that measures it (decode workers never prefill a prompt: in disaggregated mode
        # the prefill cost comes from the prefill workers); the model takes medians and clamps them.
        decoders = [w for w in workers if w.role in ("decode", "unified")]
        self.cost.update([w.prefill_s_per_token for w in workers if w.role in ("prefill", "unified")],
                         [w.decode_s_per_step for w in decoders], [w.decode_s_floor for w in decoders])
        if self.credits is not None:
            self.credits.sync(w.address for w in serving)
        self.pump()

    def routed(self, p: Pending, worker: str) -> str:
        """A dispatched request was routed to `worker` (again, for a resume): use a credit of that worker's; returns
        the subscription to name in the request ("" = none held)."""
        if not p.routed:
            p.routed = True
            self.unrouted -= 1
        return self.credits.take(worker) if self.credits is not None else ""

    def give_back(self, worker: str, credit: str, request_id: str) -> None:
        """A request routed to `worker` with `credit` (routed()'s) ended early: the credit may be unused there."""
        if self.credits is not None and credit:
            self.credits.give_back(worker, credit, request_id)

    def avoid(self) -> list[str]:
        """Serving workers that hold no unused credit of this gateway's."""
        return self.credits.without() if self.credits is not None and self.credits.known else []

    def _has_room(self, p: Pending) -> bool:
        v = self.view
        if self.credits is not None and self.credits.known:
            if self.credits.total() - self.unrouted <= 0:
                return False
        elif self.running_requests == 0:
            return True  # never stall an idle mesh on a stale or empty view
        elif v.slots and self.running_requests >= v.slots:
            return False
        load = max(self.running_tokens, v.outstanding_tokens)
        return not v.kv_tokens or load + p.input_tokens + p.max_tokens <= v.kv_tokens

    async def admit(self, tenant: Tenant, req_id: str, prompt_tokens: int, max_tokens: int, priority: int,
                    deadline_s: float | None) -> Pending:
        """Wait for a dispatch slot; raises the tenant's and the queue's rejections. Call done() after."""
        now = self.clock()
        st = self.state(tenant, now)
        try:
            st.admit_rates(prompt_tokens + max_tokens, now)
            prioritized = deadline_s is not None and self.queue.policy.uses_deadlines  # deadline-aware batching's
            predicted = (self.cost.predict_prioritized(prompt_tokens, max_tokens) if prioritized
                         else self.cost.predict(prompt_tokens, max_tokens))
            p = Pending(req_id, tenant.name, tenant.weight, now, 0, prompt_tokens, max_tokens, priority=priority,
                        deadline_s=deadline_s, predicted_s=predicted, max_queued=tenant.limits.max_queued,
                        predicted_first_s=min(self.cost.predict_first(prompt_tokens), predicted))
            pushed = self.queue.offer(p, now)
        except MeshError as e:
            self.metrics.outcome(tenant.name, "rejected", _reason(e))
            raise
        for q in pushed:
            self.metrics.outcome(q.tenant, "rejected", "pushed-out")
            _settle(self.waiters.get(id(q)), CapacityExhausted(
                f"pushed out of the admission queue: the mesh is overloaded and tenant {q.tenant!r} is the furthest "
                f"over its share", retry_after_ms=math.ceil(self.queue.starvation_s * 1000)))
        fut = asyncio.get_running_loop().create_future()
        self.waiters[id(p)] = fut
        st.queued += 1
        self.metrics.outcome(tenant.name, "queued")
        try:
            self.pump()
            await fut
        except BaseException:
            self.queue.cancel(p)
            # Dispatched just as the caller went away: also when its future was cancelled first and pump() then
            # dispatched it (it found the future done and could not tell it); the slot goes back either way.
            if id(p) in self.queue.running:
                self._release(p, 0)
                self.pump()
            raise
        finally:
            self.waiters.pop(id(p), None)
            st.queued -= 1
        self.metrics.outcome(tenant.name, "admitted")
        self.metrics.queue_wait.record((p.dispatched_s - p.arrival_s) * 1e3, {"tenant": tenant.name})
        return p

    def done(self, p: Pending, output_tokens: int, first_token_s: float | None = None,
             last_token_s: float | None = None) -> None:
        """A dispatched request ended (any way): free its share of capacity; refund unused reservation. With the
        times of its first and last token (this gateway's clock), a completed request teaches the cost model."""
        if p.dispatched_s is not None and first_token_s is not None and last_token_s is not None:
            self.cost.observe(p.input_tokens, output_tokens, first_token_s - p.dispatched_s,
                              last_token_s - first_token_s)
            self.queue.trust_predictions = self.cost.trusted
        self._release(p, output_tokens, first_token_s)
        self.metrics.tokens.add(p.input_tokens, {"tenant": p.tenant, "kind": "prompt"})
        self.metrics.tokens.add(output_tokens, {"tenant": p.tenant, "kind": "output"})
        self.pump()

    def _release(self, p: Pending, output_tokens: int, first_token_s: float | None = None) -> None:
        if id(p) not in self.queue.running:
            return  # never dispatched, or released already
        self.running_requests -= 1
        self.running_tokens -= p.input_tokens + p.max_tokens
        if not p.routed:
            self.unrouted -= 1
        self.states[p.tenant].running -= 1
        self.queue.finished(p, output_tokens, self.clock(), first_token_s)

    def pump(self) -> None:
        """Drop what can no longer meet its deadline; dispatch while there is room."""
        now = self.clock()
        for p in self.queue.expired(now):
            self.metrics.outcome(p.tenant, "rejected", "deadline")
            _settle(self.waiters.get(id(p)), DeadlineExceeded(
                f"the deadline cannot be met: it passed or too little time is left after "
                f"{(now - p.arrival_s) * 1e3:.0f} ms in the admission queue"))
        while self.queue.queue:
            p = self.queue.next(now, can_run=self._can_run)
            if p is None:
                return
            self.running_requests += 1
            self.running_tokens += p.input_tokens + p.max_tokens
            self.unrouted += 1
            self.states[p.tenant].running += 1
            _settle(self.waiters.get(id(p)), None)

    def _can_run(self, p: Pending) -> bool:
        st = self.states[p.tenant]
        limit = st.tenant.limits.max_concurrent
        if limit is not None and st.running >= limit:
            return False
        return self._has_room(p) or self._under_share(st)

    def _under_share(self, st: TenantState) -> bool:
        """The fair policies' bypass of a full mesh (services.common.admission.under_share)."""
        if not self.queue.policy.name.startswith("fair"):
            return False
        active = {x.tenant.name: x for x in self.states.values() if x.running or x.queued}
        active[st.tenant.name] = st
        return under_share(st.tenant.name, {t: x.tenant.weight for t, x in active.items()},
                           {t: x.running for t, x in active.items()}, self.view.slots, self.queue.queue, self.clock(),
                           self.queue.starvation_s)

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
