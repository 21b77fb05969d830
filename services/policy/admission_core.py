"""The gateway's admission decisions, I/O-free: the core that the gateway (admission.py) and the simulator
(sim/cluster.py) both run. The clock is injected; nothing here waits, sends or logs.

A request is offered (offer(): the tenant's rate limits, then the admission queue, which may reject it or push
out another), waits in the queue (services.policy.admission_queue.AdmissionQueue with its arbitration policy), and
leaves it when sweep() finds room for it: the tenant's `max_concurrent` not reached, and either room on the mesh
(has_room(): an unused credit of the workers' not yet routed against, or before the credit streams are known a
free batch slot in the view; and KV room for its prompt and output), or a request of a less urgent band running
that no other request already dispatched past capacity is taking the slot of (outranks(): the engine preempts it,
services.policy.bands), or, with `share_preemption` under the fair policies, its tenant below its weighted share of
the slots (under_share). Without it (the default: late binding) requests wait here, not in the engines, and the
fair order gives the next free slot; preempting for a share recomputes the victim's prompt, which on the real model
cost the fair policy 11% of throughput (issue 39). The fair policy may keep slots in reserve for tenants within
their share (services.policy.arbitration): the others' requests then need more free slots than that (held_back()).
done() frees its share and teaches the cost model; withdraw() takes back a request whose caller left. Requests that
wait the starvation bound without a slot are dropped by sweep() (the bound is a promise: services.policy.admission_queue
timed_out()).

SLOs on the request (slo_ttft_s, slo_tpot_s; offer()): once the cost model is trusted (it has measured enough
completed requests), a request whose time to first token (its predicted wait in the queue, ahead of it only what
its band and the policy put ahead, plus its prompt's predicted time) or whose time per output token (the decode
step as measured now) is predicted past its target is rejected at once, with RESOURCE_EXHAUSTED naming both and a
retry-after; slo_outcome() says of a finished request which targets it met.

The wrappers own what is not decided here: the gateway settles futures, counts metrics and builds the gRPC
errors; the simulator schedules events. Capacity comes in as a MeshView (update_view() from the router's
ListWorkers, or the simulator's own) and, at the gateway, the workers' credit streams (`credits`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from services.common.errors import CapacityExhausted, MeshError
from services.policy.admission_queue import AdmissionQueue, Pending, ServiceTimeModel, under_share
from services.policy.arbitration import FairPolicy, make_arbitration_policy
from services.policy.bands import STANDARD, band_name
from services.policy.tenants import Tenant, TenantState


@dataclass(frozen=True)
class Slo:
    """A request's latency targets, seconds (None = none)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    @staticmethod
    def of_ms(ttft_ms: int, tpot_ms: int) -> Slo:
        """From milliseconds, 0 meaning none (as the request fields carry them)."""
        return Slo(ttft_ms / 1000 if ttft_ms else None, tpot_ms / 1000 if tpot_ms else None)


NO_SLO = Slo()


@dataclass
class MeshView:
    slots: int = 0  # batch slots of the serving workers (0 = unknown: admit one at a time)
    kv_tokens: int = 0  # their KV token capacity
    outstanding_tokens: int = 0  # what they report as outstanding
    block_size: int = 0  # of the workers that compute prompts, when they all agree (0: none or mixed)


class AdmissionCore:
    def __init__(self, policy_name: str = "fair-deadline", starvation_s: float = 30.0, clock=time.monotonic,
                 queue_bursts: bool = True, share_preemption: bool = False):
        self.clock = clock
        self.share_preemption = share_preemption  # the fair policies' bypass of a full mesh (_under_share)
        self.cost = ServiceTimeModel()
        self.queue = AdmissionQueue(make_arbitration_policy(policy_name, starvation_s), starvation_s=starvation_s,
                                    trust_predictions=self.cost.trusted, queue_bursts=queue_bursts)
        self.view = MeshView()
        self.pool = ""  # the role of the serving workers whose capacity the queue waits for (update_view())
        self.states: dict[str, TenantState] = {}
        self.running_requests = 0
        self.running_tokens = 0
        self.unrouted = 0  # dispatched, not yet routed against a credit
        self.over_capacity = 0  # how many requests the mesh runs past its capacity, dispatched so for their band
        # (outranks()): each release brings it one closer to capacity
        self.credits = None  # CreditPool, once the gateway follows the workers' credit streams

    def state(self, tenant: Tenant, now: float) -> TenantState:
        st = self.states.get(tenant.name)
        if st is None:
            st = self.states[tenant.name] = TenantState(tenant, now)
        return st

    # ---- capacity ---------------------------------------------------------------------------------------------

    def set_view(self, view: MeshView) -> None:
        self.view = view
        self.queue.slots = max(view.slots, 1)

    def update_view(self, workers: list, role: str) -> None:
        """From the router's ListWorkers: capacity and step costs of the workers of `role`."""
        self.pool = role
        serving = [w for w in workers if w.role == role]
        sizes = {w.block_size for w in workers if w.role in ("prefill", "unified")}
        self.set_view(MeshView(sum(w.max_num_seqs for w in serving), sum(w.kv_capacity_tokens for w in serving),
                               sum(w.outstanding_tokens for w in serving), sizes.pop() if len(sizes) == 1 else 0))
        # Each cost from the role that measures it (decode workers never prefill a prompt: in disaggregated mode
        # the prefill cost comes from the prefill workers); the model takes medians and clamps them.
        decoders = [w for w in workers if w.role in ("decode", "unified")]
        self.cost.update([w.prefill_s_per_token for w in workers if w.role in ("prefill", "unified")],
                         [w.decode_s_per_step for w in decoders], [w.decode_s_floor for w in decoders])
        if self.credits is not None:
            self.credits.sync(w.address for w in serving)

    def has_room(self, p: Pending) -> bool:
        v, held = self.view, self.held_back(p)
        if self.credits is not None and self.credits.known:
            if self.credits.total() - self.unrouted <= held:
                return False
        elif self.running_requests == 0:
            return True  # never stall an idle mesh on a stale or empty view
        elif v.slots and self.running_requests >= v.slots - held:
            return False
        load = max(self.running_tokens, v.outstanding_tokens)
        return not v.kv_tokens or load + p.input_tokens + p.max_tokens <= v.kv_tokens

    def held_back(self, p: Pending) -> int:
        """Slots p may not take: the policy's slots in reserve, unless p's tenant is one they are kept for."""
        policy = self.queue.policy
        if not policy.reserve_fraction:
            return 0
        holders = policy.reserve_holders(self.clock())
        if not holders or p.tenant in holders:
            return 0
        return int(self.view.slots * policy.reserve_fraction)

    def saturation(self) -> float:
        """How full the pool is by the measures has_room() gates on: the larger of slots in use over slots and
        tokens held over KV tokens (0 with no view; 1 or more: a request waits in the queue for a release)."""
        v = self.view
        slots = self.running_requests / v.slots if v.slots else 0.0
        kv = max(self.running_tokens, v.outstanding_tokens) / v.kv_tokens if v.kv_tokens else 0.0
        return max(slots, kv)

    # ---- a request's life -------------------------------------------------------------------------------------

    def offer(self, tenant: Tenant, req_id: str, prompt_tokens: int, max_tokens: int, priority: int,
              deadline_s: float | None, band: int = STANDARD, slo: Slo = NO_SLO) -> tuple[Pending, list[Pending]]:
        """Queue a request: (its Pending, the requests it pushed out of the queue). Raises the tenant's and the
        queue's rejections (MeshError)."""
        now = self.clock()
        st = self.state(tenant, now)
        prioritized = deadline_s is not None and self.queue.policy.uses_deadlines  # deadline-aware batching's
        predicted = (self.cost.predict_prioritized(prompt_tokens, max_tokens) if prioritized
                     else self.cost.predict(prompt_tokens, max_tokens))
        p = Pending(req_id, tenant.name, tenant.weight, now, 0, prompt_tokens, max_tokens, priority=priority,
                    band=band, deadline_s=deadline_s, predicted_s=predicted, max_queued=tenant.limits.max_queued,
                    predicted_first_s=min(self.cost.predict_first(prompt_tokens), predicted),
                    slo_ttft_s=slo.ttft_s, slo_tpot_s=slo.tpot_s)
        self._check_slo(p, now)
        st.admit_rates(prompt_tokens, max_tokens, now)
        try:
            pushed = self.queue.offer(p, now)
        except MeshError:
            st.settle(prompt_tokens, max_tokens, None)  # refused by the queue: it was never served
            raise
        st.queued += 1
        for q in pushed:
            self.states[q.tenant].queued -= 1
            self.states[q.tenant].settle(q.input_tokens, q.max_tokens, None)
        return p, pushed

    def sweep(self) -> tuple[list[Pending], list[Pending]]:
        """Drop what can no longer meet its deadline, dispatch while there is room, then drop what has waited the
        starvation bound: (dropped, dispatched), each in order; a dropped request's `dropped` says why ("deadline"
        or "bound")."""
        now = self.clock()
        expired = self.queue.expired(now)
        self._drop(expired)
        dispatched = []
        while self.queue.queue:
            p = self.queue.next(now, can_run=self._can_run)
            if p is None:
                break
            if p.band < self._worst_running_band() and not self.has_room(p):
                self.over_capacity += 1
            self.running_requests += 1
            self.running_tokens += p.input_tokens + p.max_tokens
            self.unrouted += 1
            st = self.states[p.tenant]
            st.queued -= 1
            st.running += 1
            dispatched.append(p)
        timed_out = self.queue.timed_out(now)
        self._drop(timed_out)
        return expired + timed_out, dispatched

    def _drop(self, dropped: list[Pending]) -> None:
        for p in dropped:
            self.states[p.tenant].queued -= 1
            self.states[p.tenant].settle(p.input_tokens, p.max_tokens, None)

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

    def withdraw(self, p: Pending) -> bool:
        """The caller of a queued or dispatched request went away: out of the queue, its slot back if it held one
        (True then: the caller should sweep())."""
        if self.queue.cancel(p):
            self.states[p.tenant].queued -= 1
            self.states[p.tenant].settle(p.input_tokens, p.max_tokens, None)
        if id(p) in self.queue.running:
            self.release(p, 0)
            return True
        return False

    def done(self, p: Pending, output_tokens: int, first_token_s: float | None = None,
             last_token_s: float | None = None) -> None:
        """A dispatched request ended (any way): free its share of capacity; refund unused reservation. With the
        times of its first and last token (the core's clock), a completed request teaches the cost model; a request
        cut short has no last token (None), and its first token's time, if any, teaches only the deadline figures."""
        if p.dispatched_s is not None and first_token_s is not None and last_token_s is not None:
            self.cost.observe(p.input_tokens, output_tokens, first_token_s - p.dispatched_s,
                              last_token_s - first_token_s)
            self.queue.trust_predictions = self.cost.trusted
        self.release(p, output_tokens, first_token_s)

    def release(self, p: Pending, output_tokens: int, first_token_s: float | None = None) -> None:
        if id(p) not in self.queue.running:
            return  # never dispatched, or released already
        self.running_requests -= 1
        self.running_tokens -= p.input_tokens + p.max_tokens
        if self.over_capacity:  # whichever request ends, the mesh runs one fewer past its capacity
            self.over_capacity -= 1
        if not p.routed:
            self.unrouted -= 1
        self.states[p.tenant].running -= 1
        self.states[p.tenant].settle(p.input_tokens, p.max_tokens, output_tokens)
        self.queue.finished(p, output_tokens, self.clock(), first_token_s)

    def waiting(self) -> dict:
        """{(tenant, band name, priority): (requests in the queue, seconds the oldest of them has waited)}, now."""
        now, out = self.clock(), {}
        for p in self.queue.queue:
            key = (p.tenant, band_name(p.band), p.priority)
            n, oldest = out.get(key, (0, 0.0))
            out[key] = (n + 1, max(oldest, now - p.arrival_s))
        return out

    # ---- the rules ----------------------------------------------------------------------------------------------

    def _can_run(self, p: Pending) -> bool:
        st = self.states[p.tenant]
        limit = st.tenant.limits.max_concurrent
        if limit is not None and st.running >= limit:
            return False
        return self.has_room(p) or self.outranks(p) or self._under_share(st)

    def _worst_running_band(self) -> int:
        return max((q.band for q in self.queue.running.values()), default=-1)

    def outranks(self, p: Pending) -> bool:
        """May p go past a full mesh for its band? Yes while more requests of less urgent bands run than the mesh runs
        past its capacity already (each of those holds one of their slots, by the engines' band preemption)."""
        if p.band >= self._worst_running_band():
            return False
        lower = sum(1 for q in self.queue.running.values() if q.band > p.band)
        return lower > self.over_capacity

    def _check_slo(self, p: Pending, now: float) -> None:
        """Reject p at once when a target of its cannot be met (module docstring); no-op until the cost model is
        trusted."""
        if (p.slo_ttft_s is None and p.slo_tpot_s is None) or not self.cost.trusted:
            return
        wait = self.predicted_queue_wait(p, now)
        ttft = wait + self.cost.predict_first(p.input_tokens) + self.decode_step_s()
        tpot = self.decode_step_s()
        missed = []
        if p.slo_ttft_s is not None and ttft > p.slo_ttft_s:
            missed.append(f"time to first token {ttft * 1e3:.0f} ms (queue {wait * 1e3:.0f} ms) over the "
                          f"{p.slo_ttft_s * 1e3:.0f} ms target")
        if p.slo_tpot_s is not None and tpot > p.slo_tpot_s:
            missed.append(f"time per output token {tpot * 1e3:.1f} ms over the {p.slo_tpot_s * 1e3:.1f} ms target")
        if missed:
            # Try again once the queue has drained by the excess (a time-per-token miss: once today's queue has)
            late = p.slo_ttft_s is not None and ttft > p.slo_ttft_s
            retry = max(ttft - p.slo_ttft_s if late else wait, 0.1)
            raise CapacityExhausted(f"the {band_name(p.band)} request's SLO cannot be met now: predicted "
                                    + "; ".join(missed), retry_after_ms=math.ceil(retry * 1000))

    def decode_step_s(self) -> float:
        """A decode step as measured now (this gateway's fit when trusted, else the workers' reports)."""
        return self.cost.measured_decode_s_per_step or self.cost.decode_s_per_step

    def predicted_queue_wait(self, p: Pending, now: float) -> float:
        """How long p would wait in the queue: 0 when the mesh has room and nobody of its band or a more urgent one
        waits; else until a slot frees, plus the work the policy serves before it (under the fair policies, its own
        tenant's queued work at its share; otherwise every queued request of its band or a more urgent one)."""
        ahead = [q for q in self.queue.queue if q.band <= p.band]
        if not ahead and (self.has_room(p) or self.outranks(p)):
            return 0.0
        if isinstance(self.queue.policy, FairPolicy):
            own = [q for q in ahead if q.tenant == p.tenant]
            return (self.queue.predicted_wait(now, [])
                    + (self.queue.tenant_wait(p.tenant, own, p.weight) if own else 0.0))
        return self.queue.predicted_wait(now, ahead)

    @staticmethod
    def slo_outcome(p: Pending, output_tokens: int, first_token_s: float | None,
                    last_token_s: float | None) -> dict:
        """{"ttft"|"tpot": met} for the targets p carried (first and last token times on the core's clock; a
        request that produced no token met neither)."""
        out = {}
        if p.slo_ttft_s is not None:
            out["ttft"] = first_token_s is not None and first_token_s - p.arrival_s <= p.slo_ttft_s
        if p.slo_tpot_s is not None:
            if first_token_s is None or last_token_s is None:
                out["tpot"] = False
            elif output_tokens > 1:
                out["tpot"] = (last_token_s - first_token_s) / (output_tokens - 1) <= p.slo_tpot_s
            else:
                out["tpot"] = True
        return out

    def _under_share(self, st: TenantState) -> bool:
        """The fair policies' bypass of a full mesh (services.policy.admission_queue.under_share)."""
        if not self.share_preemption or not isinstance(self.queue.policy, FairPolicy):
            return False
        active = {x.tenant.name: x for x in self.states.values() if x.running or x.queued}
        active[st.tenant.name] = st
        return under_share(st.tenant.name, {t: x.tenant.weight for t, x in active.items()},
                           {t: x.running for t, x in active.items()}, self.view.slots, self.queue.queue, self.clock(),
                           self.queue.starvation_s)
