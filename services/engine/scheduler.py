"""Iteration-level scheduling: the batch is rebuilt before every forward pass.

One token budget, no phases (as vLLM v1): each request tracks computed vs known tokens, and
schedule() hands out num_new tokens per request under max_num_batched_tokens and max_num_seqs.
Running requests come first (decodes take one token, partial prefills the rest of the budget),
then waiting requests in the arbitration policy's order, their prompts chunked to the budget
left and reusing cached prefix blocks. When blocks run out, the policy's victim among the
requests not yet scheduled this step is preempted: its blocks are freed and it recomputes
later (its sampled tokens are kept, so its output is unchanged). When every slot is taken and a
waiting request ranks before the policy's victim among the running, the victim yields its slot
the same way. A step that preempted admits nobody new. The policy learns of service through charge(): prompt tokens computed when a
request is first admitted (the engine charges output tokens as they are sampled), and of a
tenant becoming backlogged through activate().

With LoRA (lora: services.engine.lora.AdapterResidency), a request is admitted only with a slot pinned
for its adapter, held until it leaves the batch, so a batch never has more adapters than slots. Waiting
requests whose adapter is in a slot (or none) go before those that would need one, unless these have
waited ADAPTER_BYPASS_S; slots are taken in that order (once one request cannot get a slot, nobody behind
it takes one this step), and a request whose adapter is still being read is passed over meanwhile.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.common.arbitration import ArbitrationPolicy, cost
from services.engine.kv_manager import KVCacheManager
from services.engine.request import Request, Status

ADAPTER_BYPASS_S = 1.0  # how long a request needing an adapter slot may be overtaken by ones whose adapter sits in one


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


class Scheduler:
    def __init__(self, kv: KVCacheManager, policy: ArbitrationPolicy, max_num_seqs: int,
                 max_num_batched_tokens: int, clock=time.monotonic, lora=None):
        self.kv, self.policy, self.clock, self.lora = kv, policy, clock, lora
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.before_admit = None  # called with a waiting request that carries pooled blocks, before admitting it

    def add(self, req: Request) -> None:
        backlogged = {r.tenant for r in self.waiting}
        if req.tenant not in backlogged:
            self.policy.activate(req.tenant, backlogged)
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """Join a request whose KV is already in place (an import) to the running batch."""
        self.running.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        now = self.clock()
        self._preempt_for_slot(out, now)
        budget = self._schedule_running(out, self.budget, now)
        if not out.preempted:
            self._schedule_waiting(out, budget, now)
        out.num_tokens = sum(s.num_new for s in out.seqs)
        return out

    def _preempt_for_slot(self, out: SchedulerOutput, now: float) -> None:
        """Every slot is taken and the policy says the best waiting request should have the victim's slot
        (a more urgent class; a tenant further below the victim's counter than the waiting request's own
        whole cost, so that serving it cannot lift it past the victim and the two never swap back and
        forth): the victim yields it and recomputes later. FCFS and deadline order never preempt for slots."""
        if len(self.running) < self.max_num_seqs or not self.waiting:
            return
        best, victim = self.policy.pick(self.waiting, now), self.policy.victim(self.running, now)
        margin = cost(best.num_prompt, best.params.max_tokens, best.weight)
        if self.policy.should_preempt(best, victim, now, margin):
            self._preempt(victim, out)

    def _schedule_running(self, out: SchedulerOutput, budget: int, now: float) -> int:
        queue = self.policy.order(self.running, now)
        while queue and budget > 0:
            req = queue.pop(0)
            num_new = min(req.num_tokens - req.num_computed, budget)
            while not self.kv.allocate(req, req.num_computed + num_new):
                victim = self.policy.victim(queue + [req], now)
                self._preempt(victim, out)
                if victim is req:
                    break
                queue.remove(victim)
            else:
                out.seqs.append(ScheduledSeq(req, req.num_computed, num_new, req.num_computed + num_new == req.num_tokens))
                budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        order = self.policy.order(self.waiting, now)
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
                self.policy.charge(req.tenant, req.weight, input_tokens=req.num_prompt - num_cached)
            req.num_computed, req.status = num_cached, Status.RUNNING
            self.waiting.remove(req)
            self.running.append(req)
            out.seqs.append(ScheduledSeq(req, num_cached, num_new, num_cached + num_new == req.num_tokens))
            budget -= num_new

    def _resident_first(self, order: list, now: float) -> list:
        def needs_slot(req: Request) -> bool:
            return (bool(req.adapter) and req.lora_slot is None and self.lora.slot_of(req.adapter) is None
                    and now - req.arrival_s < ADAPTER_BYPASS_S)

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
        self.waiting.append(req)
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
            self.waiting.remove(req)
        self.unpin(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        self.kv.forget(req)
