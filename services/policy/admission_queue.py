"""The gateway's admission queue, pure: the clock is passed in, no I/O.

Requests enter when the mesh is at capacity (the gateway decides that from the router's view of
worker load) and leave in the arbitration policy's order (services.policy.arbitration) as
capacity frees. The queue adds what only it can know:

- the starvation bound as a promise: every queued request must start within `starvation_s` of
  arrival. Waits are predicted from work, as list scheduling bounds them: with `slots`
  requests served at once, a request starts no later than (remaining predicted work of the
  running requests + predicted work of those dispatched before it) / slots from now. That bound
  holds only when slots are what holds requests back; when something else does (the workers'
  credits or KV room, one prefill worker behind many decode slots), requests leave far slower
  than `slots` says, and a 30 s promise measured 65-108 s waits (issue 36's soak). So the queue
  also measures how fast it actually drains while backlogged (DrainRate: predicted work
  dispatched per second of backlog, decayed over half a minute) and predicts no shorter a wait
  than the work ahead divided by that rate. Under the non-fair policies, whenever
  dispatching the policy's choice out of arrival order would push some request past its
  start-by time (arrival + bound), the oldest goes next instead. The fair policies keep the
  bound by refusal only (below): under sustained overload the over-share tenant's backlog
  always holds a request near its start-by time, so the oldest-first rule fired on nearly every
  dispatch and the fair order became FCFS (issue 39: the light tenant's TTFT p99 28.8 s on
  tenants-overload, as long as the heavy one's). Under the fair policies a
  tenant's queue is bounded first, by its own share: a newcomer whose tenant's queued work would
  take longer than half the bound at the tenant's weighted share of the slots (among the tenants
  with work; the other half is headroom, so the oldest-first rule seldom overrides the fair
  order) is rejected with RESOURCE_EXHAUSTED and a retry-after hint, so a tenant offering more
  than its share is turned away at its own door and the others' requests never queue behind its
  backlog. When the work queued would still make a newcomer wait past the bound in arrival
  order, the policy's victim is rejected: the newcomer itself under FCFS, the newest request of
  the most over-served tenant under the fair policies (push-out); so is a request that would
  overflow its tenant's queue. With `queue_bursts` (the gateway's default) a request whose tenant
  is alone on the mesh (no other tenant has sent a request within the bound) is never turned away
  by the bound (a deadline, if it has one, still ends its wait): shedding it would
  serve nobody else, and a burst is queued and served in order as `vllm serve` queues it (issue
  36); its tenant's queue limit still applies, and the bound (and push-out) applies again as soon
  as another tenant has work.
- the bound kept: a request held to the bound that has still not been dispatched when it has waited
  `starvation_s` (the predictions let it in, and were wrong) leaves the queue then (timed_out()),
  refused with RESOURCE_EXHAUSTED and a retry-after, rather than served later than promised.
- deadlines: with a deadline-aware policy, a request is rejected at arrival with
  DEADLINE_EXCEEDED and its predicted finish in the message, rather than served late, when it
  cannot finish in time even served as soon as its place in the policy's order allows: its
  predicted finish (predicted_finish(): the wait for its tenant's queued requests with less
  slack, at the tenant's share, or for a heavy tenant served after the light ones (the fair
  policies by demand) its work and p's own at the rate it has been served, when that is longer;
  then its service time scaled by what deadline requests have actually taken) is past its
  deadline. One whose slack runs out while queued is dropped the same way (expired()).
  Predictions reject only once they are trusted (`trust_predictions`: the cost model has
  measured enough completed requests itself). Under any policy a request
  whose own deadline has passed is dropped, and so, once predictions are trusted, is one that
  cannot finish in time even if served at once (its service time alone is longer than what is
  left), at arrival or while queued: dispatched, it would be cut at its deadline, every token
  of it wasted (issue 39: plain fair spent 12% more of the mesh on cut requests than FCFS).
- service accounting: a dispatch charges the tenant's counter prompt x 1 + max_tokens x 2
  (the reservation), finished() refunds output tokens not generated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from services.common.errors import CapacityExhausted, DeadlineExceeded
from services.policy.arbitration import ArbitrationPolicy, FairPolicy, cost, slack, weighted_shares
from services.policy.bands import SHEDDABLE


@dataclass(eq=False)
class Pending:
    """A queued request (a SlotClaim for the policies)."""

    req_id: str
    tenant: str
    weight: float
    arrival_s: float
    seq_no: int
    input_tokens: int
    max_tokens: int
    priority: int = 0
    band: int = 1  # services.policy.bands: 0 critical, 1 standard, 2 sheddable
    deadline_s: float | None = None
    predicted_s: float = 0.0
    max_queued: int | None = None  # the tenant's queue limit
    dispatched_s: float | None = None
    routed: bool = False  # sent to a worker (the gateway uses a credit of its then)
    predicted_first_s: float = 0.0  # of predicted_s, the part until the first token (the prompt)
    bounded: bool = True  # held to the starvation bound (False: queued as a lone tenant's burst, which waits its turn)
    dropped: str = ""  # why the queue let it go undispatched: "deadline" or "bound" (timed_out())
    slo_ttft_s: float | None = None  # the client's targets (None = none): time to first token ...
    slo_tpot_s: float | None = None  # ... and time per output token after it


TENANT_HEADROOM = 0.5  # a tenant's queue holds at most this fraction of the starvation bound at its share: its
# requests start well before the bound, so the bound's oldest-first rule seldom overrides the fair order
PREFILL_S_PER_TOKEN_RANGE = (1e-6, 1e-2)  # what a prompt token can plausibly cost, from a GPU to a slow CPU
DECODE_S_PER_STEP_RANGE = (1e-4, 2.0)  # and a decode step
MIN_MEASURED = 8  # completions measured before the model trusts its own fit (and predictions may reject)


def _clamp(x: float, bounds: tuple) -> float:
    return min(max(x, bounds[0]), bounds[1])


def _median(xs: list) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


@dataclass
class ServiceTimeModel:
    """Predicted service time = prompt x prefill_s_per_token + max_tokens x decode_s_per_step.

    Two sources, the second preferred: the workers' own step-cost fits from their heartbeats
    (update(): the median of what the workers of each role report, so one worker cannot move it
    past the honest ones, clamped to plausible ranges), and what this gateway measures of the
    requests it served (observe(): time to first token per prompt token, time per later token,
    exponentially weighted). After MIN_MEASURED completions the measured fit is used and
    `trusted` is true; before that the reported one, which a deadline alone must not act on."""

    prefill_s_per_token: float = 2e-4  # the reported (or default) costs
    decode_s_per_step: float = 0.02
    floor_step_s: float = 0.0  # reported: a decode step at deadline-aware batching's smallest batch (0 = unknown)
    measured_prefill_s_per_token: float = 0.0  # this gateway's own fit (0 = none yet)
    measured_decode_s_per_step: float = 0.0
    measured: int = 0  # completions measured so far
    alpha: float = 0.1

    @property
    def trusted(self) -> bool:
        return self.measured >= MIN_MEASURED

    def predict(self, prompt_tokens: int, max_tokens: int) -> float:
        if self.trusted:
            return prompt_tokens * self.measured_prefill_s_per_token + max_tokens * self.measured_decode_s_per_step
        return prompt_tokens * self.prefill_s_per_token + max_tokens * self.decode_s_per_step

    def predict_first(self, prompt_tokens: int) -> float:
        """The part of a prioritized prediction until the first token (the prompt, at the workers' reported cost)."""
        return prompt_tokens * self.prefill_s_per_token

    def predict_prioritized(self, prompt_tokens: int, max_tokens: int) -> float:
        """Service time of a request with a deadline, which deadline-aware batching runs in a batch no larger than
        needed: the workers' reported prompt cost and their decode step at the smallest batch, once trusted no more
        than this gateway's own fit predicts (reports alone cannot inflate it: issue 19); the queue scales it by
        what such requests actually took."""
        step = self.floor_step_s or self.decode_s_per_step
        by_reports = prompt_tokens * self.prefill_s_per_token + max_tokens * step
        return min(by_reports, self.predict(prompt_tokens, max_tokens)) if self.trusted else by_reports

    def update(self, prefill_s_per_token: list | float, decode_s_per_step: list | float,
               floor_step_s: list | float = ()) -> None:
        """Workers' reports (one value or one per worker; 0 or less = not reported)."""
        prefill, decode, floor = map(reported, (prefill_s_per_token, decode_s_per_step, floor_step_s))
        if prefill:
            self.prefill_s_per_token = _clamp(prefill, PREFILL_S_PER_TOKEN_RANGE)
        if decode:
            self.decode_s_per_step = _clamp(decode, DECODE_S_PER_STEP_RANGE)
        if floor:
            self.floor_step_s = _clamp(floor, DECODE_S_PER_STEP_RANGE)

    def observe(self, prompt_tokens: int, output_tokens: int, first_token_s: float, decode_s: float) -> None:
        """A served request: seconds from dispatch to its first token, and from there to its last."""
        if prompt_tokens <= 0 or output_tokens <= 0 or first_token_s < 0 or decode_s < 0:
            return
        prefill = _clamp(first_token_s / prompt_tokens, PREFILL_S_PER_TOKEN_RANGE)
        self.measured_prefill_s_per_token = self._ewma(self.measured_prefill_s_per_token, prefill)
        if output_tokens > 1:
            step = _clamp(decode_s / (output_tokens - 1), DECODE_S_PER_STEP_RANGE)
            self.measured_decode_s_per_step = self._ewma(self.measured_decode_s_per_step, step)
        elif not self.measured_decode_s_per_step:
            self.measured_decode_s_per_step = self.decode_s_per_step
        self.measured += 1

    def _ewma(self, old: float, new: float) -> float:
        return new if old == 0 else (1 - self.alpha) * old + self.alpha * new


def under_share(tenant: str, weights: dict, running: dict, slots: int, queue: list, now: float,
                starvation_s: float) -> bool:
    """May `tenant` go in although the mesh is full (the fair policies' bypass)? Yes when it holds fewer slots than
    its weighted share among the tenants with work (`weights`: tenant -> weight, the tenant included; `running`:
    tenant -> requests it holds) while another tenant holds more than its own: the engines' schedulers then
    preempt the most over-share tenant's request for it, instead of the newcomer waiting for a long request to
    finish. Suspended while any queued request has waited half the starvation bound, so the bypass cannot starve
    the queue."""
    if not slots or any(now - q.arrival_s >= starvation_s / 2 for q in queue):
        return False
    share = weighted_shares(slots, weights)
    return (running.get(tenant, 0) < share[tenant]
            and any(running.get(t, 0) > share[t] for t in weights))


def _listed(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def reported(values: list | float) -> float:
    """What ServiceTimeModel.update takes from workers' reports (one value or one per worker): their median, the
    unreported (0 or less, not finite) left out; 0 when none reported."""
    xs = [x for x in _listed(values) if x > 0 and math.isfinite(x)]
    return _median(xs) if xs else 0.0


class _Dispatched:
    """The running requests' predicted service times and dispatch times, in arrays: the list-scheduling bound's sum
    over them (predicted_wait, at every arrival) is then one vector operation however many run (thousands, at the
    scale of a simulated cluster's gateway). A free row holds (0, -inf), which adds nothing."""

    def __init__(self):
        self.predicted, self.dispatched = np.zeros(0), np.zeros(0)
        self.rows: dict[int, int] = {}
        self.free: list[int] = []

    def add(self, key: int, predicted_s: float, dispatched_s: float) -> None:
        if not self.free:
            n = len(self.predicted)
            grow = max(n, 16)
            self.predicted = np.concatenate([self.predicted, np.zeros(grow)])
            self.dispatched = np.concatenate([self.dispatched, np.full(grow, -np.inf)])
            self.free = list(range(n + grow - 1, n - 1, -1))
        row = self.rows[key] = self.free.pop()
        self.predicted[row], self.dispatched[row] = predicted_s, dispatched_s

    def remove(self, key: int) -> None:
        row = self.rows.pop(key, None)
        if row is not None:
            self.predicted[row], self.dispatched[row] = 0.0, -np.inf
            self.free.append(row)

    def remaining(self, now: float, calibration: float) -> float:
        """Sum over the running requests of their predicted time left (none below zero)."""
        if not self.rows:
            return 0.0
        return float(np.maximum(self.predicted * calibration - (now - self.dispatched), 0.0).sum())


class DrainRate:
    """How fast the queue empties while it is backlogged: predicted work (seconds) of the requests that waited and
    were dispatched, per second during which some request was queued, both decayed with time constant tau_s. Only
    requests that waited count (one dispatched at its arrival says nothing about capacity), and the rate is known
    only after min_backlog_s of backlog with a dispatch in it: an idle or briefly busy mesh keeps the slot bound."""

    def __init__(self, tau_s: float = 30.0, min_backlog_s: float = 5.0):
        self.tau_s, self.min_backlog_s = tau_s, min_backlog_s
        self.work = self.backlog_s = 0.0
        self.last: float | None = None

    def advance(self, now: float, backlogged: bool) -> None:
        """Time passes up to now; backlogged: whether a request was queued all along since the last call."""
        if self.last is not None and now > self.last:
            dt = now - self.last
            decay = math.exp(-dt / self.tau_s)
            self.work *= decay
            self.backlog_s = self.backlog_s * decay + (dt if backlogged else 0.0)
        self.last = now if self.last is None else max(self.last, now)

    def dispatched(self, predicted_s: float) -> None:
        self.work += predicted_s

    def rate(self) -> float | None:
        """Predicted work dispatched per second of backlog (None until measured)."""
        if self.backlog_s < self.min_backlog_s or self.work <= 0:
            return None
        return self.work / self.backlog_s


@dataclass
class AdmissionQueue:
    policy: ArbitrationPolicy
    starvation_s: float = 30.0
    slots: int = 1  # requests the mesh serves at once (the caller keeps this current)
    queue: list = field(default_factory=list)
    running: dict = field(default_factory=dict)  # dispatched, not finished: id(p) -> p
    calibration: float = 1.0  # EWMA of actual / predicted service time of finished requests
    deadline_calibration: float = 1.0  # of requests with a deadline: actual / predicted time after the first token
    deadline_first_extra_s: float = 0.0  # ... and how much later than predicted their first token came (EWMA)
    deadline_margin: float = 0.9  # a deadline request is admitted when predicted to finish within this much of it
    trust_predictions: bool = True  # may a predicted service time alone reject a request with a deadline?
    queue_bursts: bool = False  # a lone tenant's request without a deadline is queued past the bound (module doc)
    _seq: int = 0
    _seen: dict = field(default_factory=dict, repr=False)  # tenant -> when it last offered a request
    _dispatched: _Dispatched = field(default_factory=_Dispatched, repr=False, compare=False)
    drain: DrainRate = field(default_factory=DrainRate, repr=False, compare=False)

    def backlogged(self) -> set[str]:
        return {p.tenant for p in self.queue}

    def queued(self, tenant: str) -> int:
        return sum(1 for p in self.queue if p.tenant == tenant)

    def offer(self, p: Pending, now: float) -> list[Pending]:
        """Queue p, or raise DEADLINE_EXCEEDED / RESOURCE_EXHAUSTED (see the module docstring).

        When the queue holds more work than the bound allows, something goes: under FCFS (and the
        other unfair orders) the newcomer itself; under the fair policies the newest request of the
        tenant with the most queued work per unit of weight (push-out from the longest weighted
        queue, as fair queueing manages its buffer), which is the newcomer only if its own tenant
        is that one. Returns the requests pushed out, for the caller to reject."""
        self.drain.advance(now, bool(self.queue))
        self.policy.arrived(p.tenant, p.weight, p.input_tokens, p.max_tokens, now)
        if p.deadline_s is not None:
            if p.deadline_s <= now:
                raise DeadlineExceeded("the deadline has already passed")
            if self._predicts_deadlines():
                finish = self.predicted_finish(p, now)
                if finish > now + (p.deadline_s - now) * self.deadline_margin:
                    raise DeadlineExceeded(
                        f"the deadline cannot be met: predicted to finish in {(finish - now) * 1e3:.0f} ms "
                        f"(service {self.deadline_service_s(p) * 1e3:.0f} ms), deadline in "
                        f"{(p.deadline_s - now) * 1e3:.0f} ms")
            elif self._late(p, now):
                raise DeadlineExceeded(
                    f"the deadline cannot be met even served at once: service predicted "
                    f"{self.deadline_service_s(p) * 1e3:.0f} ms, deadline in {(p.deadline_s - now) * 1e3:.0f} ms")
        if p.max_queued is not None and self.queued(p.tenant) >= p.max_queued:
            raise CapacityExhausted(f"tenant {p.tenant!r} already has {p.max_queued} requests queued (its limit)",
                                    retry_after_ms=math.ceil(self.predicted_wait(now, self.queue) * 1000) or 100)
        burst = self._burst(p, now)
        self._seen[p.tenant] = now
        if burst:
            p.bounded = False
            self._enter(p)
            self.queue.append(p)
            return []
        if isinstance(self.policy, FairPolicy):
            wait, limit = self.tenant_wait(p.tenant, [q for q in self.queue if q.tenant == p.tenant], p.weight), \
                self.starvation_s * TENANT_HEADROOM
            if wait > limit:
                raise CapacityExhausted(
                    f"tenant {p.tenant!r} is over its share of the mesh: its queued work would wait {wait:.1f} s at "
                    f"its weighted share, over {limit:g} s (half the {self.starvation_s:g} s bound)",
                    retry_after_ms=math.ceil((wait - limit) * 1000))
        self._enter(p)
        pushed = []
        while (wait := self.last_wait(now, p)) > self.starvation_s:
            victim = self._push_out_victim(p, now)
            if victim is p:
                for q in pushed:  # nothing gained: put them back
                    self.queue.append(q)
                self.queue.sort(key=lambda q: q.seq_no)
                raise CapacityExhausted(
                    f"the mesh is overloaded: predicted queue wait {wait:.1f} s exceeds the {self.starvation_s:g} s "
                    "bound", retry_after_ms=math.ceil((wait - self.starvation_s) * 1000))
            self.queue.remove(victim)
            pushed.append(victim)
        self.queue.append(p)
        return pushed

    def _burst(self, p: Pending, now: float) -> bool:
        """queue_bursts: p is not sheddable and its tenant is alone on the mesh (nobody else has
        sent a request within the starvation bound, so nobody else is queued or running either), so turning it away
        buys nobody anything: it waits its turn, as `vllm serve` queues a burst (issue 36). A tenant that is only
        between two requests of a steady stream is not gone: the burst would queue ahead of its next one. A deadline
        (a gRPC client's timeout is one) does not make it a shorter wait: the deadline was predicted to be met
        above, and if it passes first it ends the wait itself."""
        return (self.queue_bursts and p.band < SHEDDABLE
                and all(now - seen >= self.starvation_s for t, seen in self._seen.items() if t != p.tenant)
                and all(q.tenant == p.tenant for q in (*self.queue, *self.running.values())))

    def _enter(self, p: Pending) -> None:
        """Number p and let the policy see its tenant arrive (before p joins the queue)."""
        if self.policy.tracks_activation:
            backlogged = self.backlogged()
            if p.tenant not in backlogged:
                self.policy.activate(p.tenant, backlogged)
        p.seq_no, self._seq = self._seq, self._seq + 1

    def _predicts_deadlines(self) -> bool:
        return self.policy.uses_deadlines and self.trust_predictions

    def tenant_share(self, tenant: str, weight: float) -> float:
        """The slots a tenant is owed now: its weighted share among the tenants with queued or running requests."""
        weights = {q.tenant: q.weight for q in (*self.queue, *self.running.values())}
        weights[tenant] = weight
        return weighted_shares(max(self.slots, 1), weights)[tenant]

    def tenant_wait(self, tenant: str, ahead: list, weight: float) -> float:
        """How long `ahead` (requests of `tenant`) take at the tenant's share of the slots, or at its share of the
        measured drain rate when that is slower."""
        work, share = sum(q.predicted_s for q in ahead), self.tenant_share(tenant, weight)
        wait = work * self.calibration / share
        rate = self.drain.rate()
        if rate is not None:
            wait = max(wait, work / (rate * share / max(self.slots, 1)))
        return wait

    def deadline_service_s(self, p: Pending) -> float:
        """p's service time as deadline requests have actually been served: until the first token as predicted plus
        how much later they came, then the rest scaled by how far it was off."""
        return (p.predicted_first_s + self.deadline_first_extra_s
                + (p.predicted_s - p.predicted_first_s) * self.deadline_calibration)

    def predicted_finish(self, p: Pending, now: float) -> float:
        """When p would finish served as early as the policy's order lets it (module docstring)."""
        service = self.deadline_service_s(p)
        if isinstance(self.policy, FairPolicy):
            ahead = [q for q in self.queue if q.tenant == p.tenant and slack(q, now) <= slack(p, now)]
            wait = self.tenant_wait(p.tenant, ahead, p.weight) if ahead else 0.0
            rate = self.policy.heavy_rate(p.tenant, now)
            if rate is not None:  # served after the light tenants: its work (p's too) drains at the rate it gets
                wait = max(wait, sum(cost(q.input_tokens, q.max_tokens, 1.0) for q in (*ahead, p)) / rate)
            return now + wait + service
        ahead = [q for q in self.queue if self.policy.rank(q, now) < self.policy.rank(p, now)]
        return now + (self.predicted_wait(now, ahead) if ahead else 0.0) + service

    def _push_out_victim(self, p: Pending, now: float) -> Pending:
        """Who goes when the queue (p included) holds more work than the bound: the newest request of the least
        urgent band when that band is less urgent than p's (sheddable first, then standard for a critical p);
        within p's own band, p under the unfair orders, the fair policies' victim under the fair ones."""
        worst = max((q.band for q in self.queue), default=p.band)
        if worst > p.band:
            return max((q for q in self.queue if q.band == worst), key=lambda q: (q.arrival_s, q.seq_no))
        if not isinstance(self.policy, FairPolicy):
            return p
        candidates = [q for q in self.queue if now - q.arrival_s < self.starvation_s and q.band == p.band] + [p]
        work: dict[str, float] = {}
        for q in candidates:
            work[q.tenant] = work.get(q.tenant, 0.0) + q.predicted_s / q.weight
        longest = max(work, key=lambda t: (work[t], t == p.tenant))
        return max((q for q in candidates if q.tenant == longest), key=lambda q: (q.arrival_s, q.seq_no))

    def last_wait(self, now: float, p: Pending) -> float:
        """The predicted wait of the request served last of the queue and p (the newest of the least urgent band;
        p itself when no queued request is of a less urgent band than p's)."""
        everyone = [*self.queue, p]
        last = max(everyone, key=lambda q: (q.band, q.seq_no))
        return self.predicted_wait(now, [q for q in everyone if q is not last])

    def predicted_wait(self, now: float, ahead: list) -> float:
        """Latest start, from now, of a request dispatched after `ahead` (list-scheduling bound), with
        predictions scaled by how long dispatched requests have actually taken (calibration)."""
        remaining, work = self._dispatched.remaining(now, self.calibration), sum(p.predicted_s for p in ahead)
        wait = (remaining + work * self.calibration) / max(self.slots, 1)
        rate = self.drain.rate()
        return wait if rate is None else max(wait, work / rate)

    def next(self, now: float, can_run=lambda p: True) -> Pending | None:
        """Remove and return the request to dispatch now (None if none may run)."""
        self.drain.advance(now, bool(self.queue))
        runnable = [p for p in self.queue if can_run(p)]
        if not runnable:
            return None
        choice = self.policy.pick(runnable, now)  # of the most urgent band that can run (bands are strict)
        oldest = sorted((p for p in runnable if p.band == choice.band), key=lambda p: (p.arrival_s, p.seq_no))
        if not isinstance(self.policy, FairPolicy) and choice is not oldest[0] and self._would_starve(oldest, choice,
                                                                                                      now):
            choice = oldest[0]
        self.queue.remove(choice)
        if now > choice.arrival_s:
            self.drain.dispatched(choice.predicted_s)
        choice.dispatched_s = now
        self.running[id(choice)] = choice
        self._dispatched.add(id(choice), choice.predicted_s, now)
        self.policy.charge(choice.tenant, choice.weight, choice.input_tokens, choice.max_tokens, now=now)
        return choice

    def _would_starve(self, oldest: list, choice: Pending, now: float) -> bool:
        """Would dispatching `choice` first push some request past arrival + bound?"""
        c = self.calibration
        ahead = self._dispatched.remaining(now, c) + choice.predicted_s * c
        for p in oldest:
            if p is choice:
                continue
            if now + ahead / max(self.slots, 1) > p.arrival_s + self.starvation_s:
                return True
            ahead += p.predicted_s * c
        return False

    def _learn_deadline(self, p: Pending, output_tokens: int, now: float, first_s: float | None) -> None:
        """The deadline figures from a request with a deadline that completed, or was cut at its deadline (how far
        it got is a measure of its speed: without it, the orders that ignore deadlines never learned that theirs ran
        slower than predicted, and kept dispatching requests that were then cut, 56 under fair in issue 39's run 7).
        A cut before its first token says the first token comes at least that late."""
        first_at = first_s if first_s is not None else now
        extra = (first_at - p.dispatched_s) - p.predicted_first_s
        if first_s is not None or extra > self.deadline_first_extra_s:
            self.deadline_first_extra_s = 0.8 * self.deadline_first_extra_s + 0.2 * max(extra, 0.0)
        decode_s = p.predicted_s - p.predicted_first_s
        if first_s is None or decode_s <= 0 or output_tokens < 2:
            return
        part = 1.0 if output_tokens >= p.max_tokens else (output_tokens - 1) / max(p.max_tokens - 1, 1)
        ratio = min(max((now - first_s) / (decode_s * part), 0.25), 4.0)
        if part == 1.0 and now <= p.deadline_s:  # met: slowed to fit its deadline (deadline-aware batching runs the
            ratio = min(ratio, self.deadline_calibration)  # largest batch that does), so it bounds the time from above
        self.deadline_calibration = 0.8 * self.deadline_calibration + 0.2 * ratio

    def expired(self, now: float) -> list[Pending]:
        """Remove and return requests that can no longer meet their deadline."""
        self.drain.advance(now, bool(self.queue))
        out = [p for p in self.queue if p.deadline_s is not None and (p.deadline_s <= now or self._late(p, now))]
        for p in out:
            self.queue.remove(p)
            p.dropped = "deadline"
        return out

    def timed_out(self, now: float) -> list[Pending]:
        """Remove and return the requests that have waited the starvation bound without a slot (those held to it):
        the bound is a promise, so a request the predictions let in that would wait longer is answered now, with
        a retry-after, rather than served later than promised (the gateway's tick calls this every 50 ms)."""
        out = [p for p in self.queue if p.bounded and now - p.arrival_s >= self.starvation_s]
        for p in out:
            self.queue.remove(p)
            p.dropped = "bound"
        return out

    def _late(self, p: Pending, now: float) -> bool:
        """Predicted to miss its deadline even if served at once (trusted predictions only; any policy: dispatching
        it would only spend the mesh on tokens cut off at the deadline)."""
        return self.trust_predictions and p.deadline_s - now < self.deadline_service_s(p)

    def cancel(self, p: Pending) -> bool:
        """Take a queued request out (its caller went away); whether it was queued."""
        if p in self.queue:
            self.queue.remove(p)
            return True
        return False

    def finished(self, p: Pending, output_tokens: int, now: float | None = None, first_s: float | None = None) -> None:
        """A dispatched request ended: refund the reserved output tokens it did not generate; with `now`, learn how
        far its predicted service time was off (from a request that ran to its max_tokens). A request with a
        deadline teaches the deadline figures instead (deadline-aware batching serves those faster), with the time
        of its first token (`first_s`) splitting the start from the rest, also when it was cut at its deadline
        (_learn_deadline()); one that met its deadline can only lower the calibration: the engines ran the largest
        batch that still met it, so its time says how slow it was allowed to be, not how fast it could go (issue
        39: learning it as a speed raised the calibration until every deadline request was refused at arrival, and
        none was admitted to show otherwise)."""
        self.running.pop(id(p), None)
        self._dispatched.remove(id(p))
        if now is not None and p.predicted_s > 0 and p.dispatched_s is not None:
            if p.deadline_s is not None:
                if output_tokens >= p.max_tokens or now >= p.deadline_s:
                    self._learn_deadline(p, output_tokens, now, first_s)
            elif output_tokens >= p.max_tokens:
                ratio = min(max((now - p.dispatched_s) / p.predicted_s, 0.1), 10.0)
                self.calibration = 0.9 * self.calibration + 0.1 * ratio
        unused = p.max_tokens - output_tokens
        if unused > 0:
            self.policy.charge(p.tenant, p.weight, 0, -unused, now=now)
