"""Iteration-level scheduling: the batch is rebuilt before every forward pass.

One token budget, no phases (as vLLM v1): each request tracks computed vs known tokens, and
schedule() hands out num_new tokens per request under max_num_batched_tokens and max_num_seqs.
Running requests come first (decodes take one token, partial prefills the rest of the budget),
then waiting requests in the arbitration policy's order, their prompts chunked to the budget
left and reusing cached prefix blocks. When blocks run out, the policy's victim among the
requests not yet scheduled this step is preempted: its blocks are freed and it recomputes
later (its sampled tokens are kept, so its output is unchanged). When every slot is taken and the
policy gives a waiting request a running one's slot (services.policy.arbitration
slot_preemption: under the fair policies, an under-share tenant takes the slot of the tenant
furthest over its weighted share), the running one yields it the same way and the waiting one is
admitted in the same step. A step that preempted for blocks admits nobody new. The policy learns
of service through charge(): prompt tokens computed when a request is first admitted (the engine
charges output tokens as they are sampled), and of a tenant becoming backlogged through activate().

Deadline-aware batching (the deadline-aware policies, deadline and fair-deadline; BatchCap): a running request with a
deadline needs a step at least every (deadline - now) x SAFETY / steps it has left. While one
does, the step carries at most `cap` sequences: deadline requests first, earliest deadline first,
then requests whose prompt is not through yet (a chunked prompt goes on, so its first token is
not held back behind the cap: issue 39 measured the light tenant's first token 4.8 s after its
dispatch at the median under fair-deadline), then the others in the policy's order; those left
out keep their blocks and run again when the cap lifts. Waiting requests still join (their
prompts go in, their first tokens come out), but a capped step carries only as many prompt
tokens as the step time left over allows (by the engine's step-time fit, step_cost; at least an
eighth of the budget). The cap starts at the floor
when a deadline request arrives, then follows the step times measured (which carry what a fit
cannot: the CPU the servicer and the other processes take): a step slower than needed cuts the
cap in proportion, one well within it raises the cap by one. Never below
deadline_min_batch (the floor: the others' throughput is never squeezed below it), and a request
clearly lost (it needs steps in under half the floor's measured step time) does not shrink it.

With LoRA (lora: services.engine.lora_residency.AdapterResidency), a request is admitted only with a slot pinned
for its adapter, held until it leaves the batch, so a batch never has more adapters than slots. Waiting
requests whose adapter is in a slot (or none) go before those that would need one, unless these have
waited ADAPTER_BYPASS_STEPS of the engine's decode steps (by its step-time fit; ADAPTER_BYPASS_S before it has
one: the bound follows the engine's pace, a CPU's or an accelerator's, and a mock engine's time scale); slots
are taken in that order (once one request cannot get a slot, nobody behind it takes one this step), and a
request whose adapter is still being read is passed over meanwhile.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field

from services.engine.kv_manager import KVCacheManager
from services.engine.request import Request, Status
from services.policy.arbitration import ArbitrationPolicy

SAFETY = 0.85  # deadline-aware batching aims to finish with this fraction of the time left
LOST = 0.5  # a deadline request needing steps faster than this fraction of a step at the floor is given up
ADAPTER_BYPASS_STEPS = 50  # how long a request needing an adapter slot may be overtaken by ones whose adapter sits
ADAPTER_BYPASS_S = 1.0  # in one, in decode steps; in seconds before the engine has measured a step


@dataclass
class ScheduledSeq:
    request: Request
    num_computed: int  # tokens in the KV cache before this step
    num_new: int  # tokens computed this step
    sample: bool  # this step reaches the last known token, so a new token is sampled


@dataclass
class SchedulerOutput:
    seqs: list = field(default_factory=list)  # ScheduledSeq, in batch order
    preempted: list = field(default_factory=list)  # requests sent back to recompute
    num_tokens: int = 0  # tokens in the batch

    @property
    def empty(self) -> bool:
        return not self.seqs


def _remaining(req: Request) -> int:
    """Prompt tokens still to compute and output tokens still expected (what a heartbeat's outstanding tokens sum)."""
    return max(req.num_tokens - req.num_computed, 0) + max(req.params.max_tokens - req.num_output, 0)


class Scheduler:
    def __init__(self, kv: KVCacheManager, policy: ArbitrationPolicy, max_num_seqs: int,
                 max_num_batched_tokens: int, clock=time.monotonic, lora=None, step_cost=None,
                 deadline_min_batch: int = 4, before_admit=None):
        """before_admit(req): called with a waiting request that carries pooled blocks, before admitting it (the
        engine's KVTransfer.admit_pooled)."""
        self.kv, self.policy, self.clock, self.lora = kv, policy, clock, lora
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.cap = BatchCap(max_num_seqs, deadline_min_batch, step_cost, max_num_batched_tokens)
        self.slot_preemptions = 0  # since start
        self.started = 0  # requests first scheduled, since start
        self.queue_wait_s = 0.0  # their waits from arrival to first scheduled, summed
        self.last_cap = max_num_seqs  # the latest step's batch cap
        self.waiting: list[Request] = []  # in arrival order, or kept in the policy's order when it has a sort_key
        self.waiting_tokens = 0  # prompt tokens to compute and output tokens expected of the waiting requests
        self.running: list[Request] = []
        self.before_admit = before_admit

    def add(self, req: Request) -> None:
        if self.policy.tracks_activation:
            backlogged = {r.tenant for r in self.waiting}
            if req.tenant not in backlogged:
                self.policy.activate(req.tenant, backlogged)
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        key = self.policy.sort_key
        if key is None or not self.waiting or key(self.waiting[-1]) <= key(req):
            self.waiting.append(req)
        else:
            bisect.insort(self.waiting, req, key=key)
        self.waiting_tokens += _remaining(req)  # fixed while it waits

    def _dequeue(self, req: Request) -> None:
        self.waiting.remove(req)
        self.waiting_tokens -= _remaining(req)

    def add_running(self, req: Request) -> None:
        """Join a request whose KV is already in place (an import) to the running batch."""
        self.running.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        now = self.clock()
        promoted = self._preempt_for_slot(out, now)
        cap = self.last_cap = self.batch_cap(now)
        self.cap.stepped(now)
        capped = cap < self.max_num_seqs
        if capped:  # slots kept for the deadline requests about to join
            joining = min(sum(r.deadline_s is not None for r in self.waiting), self.max_num_seqs - len(self.running))
            budget = self._schedule_running(out, self.cap.token_budget(cap), now, cap - joining)
        else:
            budget = self._schedule_running(out, self.budget, now, cap)
        if promoted is not None and out.preempted == [promoted[1]]:
            self._schedule_waiting(out, budget, now, [promoted[0]])  # the slot it was given
        elif not out.preempted and budget > 0 and len(self.running) < self.max_num_seqs and self.waiting:
            # A policy with a sort_key has the waiting list in its order already (kept so: long queues, no sort).
            self._schedule_waiting(out, budget, now, list(self.waiting) if self.policy.sort_key is not None else
                                   self.policy.admission_order(self.waiting, self.running, self.max_num_seqs, now))
        out.num_tokens = sum(s.num_new for s in out.seqs)
        self.cap.size = len(out.seqs)
        return out

    def _preempt_for_slot(self, out: SchedulerOutput, now: float):
        """Every slot is taken and the policy gives a waiting request a running one's slot: the running one yields
        it and recomputes later. Returns (waiting, preempted) or None."""
        if len(self.running) < self.max_num_seqs or not self.waiting:
            return None
        chosen = self.policy.slot_preemption(self.waiting, self.running, self.max_num_seqs, now)
        if chosen is not None:
            self._preempt(chosen[1], out)
            self.slot_preemptions += 1
        return chosen

    def batch_cap(self, now: float) -> int:
        """The most sequences this step may carry (module docstring: deadline-aware batching)."""
        if not self.policy.uses_deadlines:
            return self.max_num_seqs
        joining = self.waiting if len(self.running) < self.max_num_seqs else []  # deadline requests join at once
        return self.cap.update(now, [r for r in (*self.running, *joining) if r.deadline_s is not None])

    def _schedule_running(self, out: SchedulerOutput, budget: int, now: float, cap: int) -> int:
        queue = self.policy.order(self.running, now)
        if cap < len(queue):  # deadline requests first, earliest deadline first; then prompts not yet through; the
            # others in the policy's order
            queue.sort(key=lambda r: (r.deadline_s is None, r.deadline_s or 0.0, r.num_computed >= r.num_prompt))
        while queue and budget > 0 and len(out.seqs) < cap:
            req = queue.pop(0)
            num_new = min(req.num_tokens - req.num_computed, budget)
            while not self.kv.allocate(req, req.num_computed + num_new):
                victim = self.policy.victim(queue + [req], now)
                self._preempt(victim, out)
                if victim is req:
                    break
                queue.remove(victim)
            else:
                out.seqs.append(ScheduledSeq(req, req.num_computed, num_new,
                                             req.num_computed + num_new == req.num_tokens))
                budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float, order: list) -> None:
        if self.lora is not None:
            order = self._resident_first(order, now)
        slots_open = True
        for req in order:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if req.adapter and req.lora_slot is None:
                if not slots_open and self.lora.slot_of(req.adapter) is None:
                    continue
                req.lora_slot = self.lora.claim(req.adapter)
                if req.lora_slot is None:
                    slots_open = False  # the next free slot is this request's
                    continue
            if req.pooled is not None and self.before_admit is not None:
                self.before_admit(req)  # blocks from the mesh's KV pool join the prefix cache now, when there is room
            prefix = self.kv.cached_prefix(req)
            num_cached = len(prefix) * self.kv.block_size
            num_new = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate(req, num_cached + num_new, prefix):
                self.unpin(req)
                break
            if req.num_preemptions == 0:
                req.num_cached_prompt = num_cached
                self.started += 1
                self.queue_wait_s += max(now - req.arrival_s, 0.0)
                self.policy.charge(req.tenant, req.weight, input_tokens=req.num_prompt - num_cached)
            self._dequeue(req)
            req.num_computed, req.status = num_cached, Status.RUNNING
            self.running.append(req)
            out.seqs.append(ScheduledSeq(req, num_cached, num_new, num_cached + num_new == req.num_tokens))
            budget -= num_new

    def _resident_first(self, order: list, now: float) -> list:
        fit = self.cap.step_cost  # a decode step of the batch as it stands, by the engine's fit
        step_s = fit.step_s(max(len(self.running), 1)) if fit is not None else 0.0
        bypass_s = ADAPTER_BYPASS_STEPS * step_s if step_s > 0 else ADAPTER_BYPASS_S

        def needs_slot(req: Request) -> bool:
            return (bool(req.adapter) and req.lora_slot is None and self.lora.slot_of(req.adapter) is None
                    and now - req.arrival_s < bypass_s)

        return sorted(order, key=needs_slot)  # stable: the policy's order within each part

    def unpin(self, req: Request) -> None:
        """Let go of the request's adapter slot (it left the batch)."""
        if req.lora_slot is not None:
            self.lora.release(req.lora_slot)
            req.lora_slot = None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.unpin(req)
        self.kv.free(req)
        self.running.remove(req)
        req.num_computed, req.status = 0, Status.WAITING
        req.num_preemptions += 1
        self._enqueue(req)
        out.preempted.append(req)

    def update(self, out: SchedulerOutput) -> None:
        """Advance computed counts after the forward pass and register newly full blocks."""
        for s in out.seqs:
            s.request.num_computed = s.num_computed + s.num_new
            self.kv.commit(s.request)

    def finish(self, req: Request, reason: str) -> None:
        """End a request (finished or aborted): its blocks are freed at once."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self._dequeue(req)
        self.unpin(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        self.kv.forget(req)


class BatchCap:
    """Deadline-aware batching's cap on the sequences in a step (module docstring), pure: the clock is passed in."""

    def __init__(self, max_num_seqs: int, floor: int, step_cost=None, budget: int = 1):
        self.max, self.floor, self.step_cost, self.budget = max_num_seqs, min(floor, max_num_seqs), step_cost, budget
        self.cap = float(max_num_seqs)
        self.need = math.inf  # the step time the tightest deadline request needs
        self.size = 0  # sequences in the latest step
        self.interval = 0.0  # measured: time from one step to the next while busy (EWMA)
        self.floor_interval = 0.0  # ... of steps that carried at most the floor
        self._last = None  # when the latest step was scheduled

    def stepped(self, now: float) -> None:
        """A step is being scheduled now: learn the time since the previous one (when that one ran something and
        the engine did not idle in between)."""
        if self._last is not None and self.size and now - self._last < 1.0:
            dt = now - self._last
            self.interval = dt if not self.interval else 0.7 * self.interval + 0.3 * dt
            if self.size <= self.floor:
                self.floor_interval = dt if not self.floor_interval else 0.9 * self.floor_interval + 0.1 * dt
        self._last = now

    @property
    def floor_step_s(self) -> float:
        """A step at the floor: measured, or else the fit's prediction (0 = unknown)."""
        if self.floor_interval:
            return self.floor_interval
        return self.step_cost.step_s(self.floor) if self.step_cost is not None else 0.0

    def needed_step_s(self, r, now: float) -> float:
        """The step time request r needs from now on to finish SAFETY-early (inf when it has no steps left)."""
        steps = r.params.max_tokens - r.num_output + math.ceil(max(r.num_prompt - r.num_computed, 0) / self.budget)
        return (r.deadline_s - now) * SAFETY / steps if steps > 0 else math.inf

    def update(self, now: float, deadline_requests: list) -> int:
        floor_step = self.floor_step_s
        needs = [n for n in (self.needed_step_s(r, now) for r in deadline_requests)
                 if n >= floor_step * LOST and math.isfinite(n)]  # those not clearly lost
        if not needs:
            self.cap = float(self.max)
            return self.max
        need = self.need = min(needs)
        if self.cap >= self.max:  # a deadline request arrived: start at the floor, safe, and widen while ahead
            self.cap = float(self.floor)
        elif self.interval > need:
            self.cap = min(self.cap, self.size or self.cap) * need / self.interval
        elif self.interval < 0.8 * need:
            self.cap += 1
        self.cap = min(max(self.cap, float(self.floor)), float(self.max))
        return int(self.cap)

    def token_budget(self, cap: int) -> int:
        """Tokens a capped step may carry: its sequences' decode tokens and the prompt tokens that fit in the step
        time left over (by the fit; at least an eighth of the budget, so prompts still go in)."""
        prompt = self.budget // 8
        fit = self.step_cost
        if fit is not None and fit.prefill_s_per_token > 0 and math.isfinite(self.need):
            prompt = max(prompt, int((self.need - fit.step_s(cap)) / fit.prefill_s_per_token))
        return min(cap + prompt, self.budget)
