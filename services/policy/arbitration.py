"""Slot arbitration: who gets the next slot, and who is preempted when KV blocks run short.

One set of pure policy objects (no I/O, no torch; the clock is passed in) used in two places:
the gateway's admission queue (who is dispatched into the mesh next) and every engine's
scheduler (who gets the next batch slot; the last in serving order is the preemption victim).
A claim carries its band, its tenant, the tenant's weight, its deadline and its predicted service time
from the gateway through prefill and decode.

Bands (services.policy.bands: critical, standard, sheddable) come before every policy's order: a
claim of a more urgent band is served first, preempted last, and takes a running claim's slot
from a less urgent band whenever every slot is taken (slot_preemption, under every policy). Each
policy below orders the claims inside a band.

- fcfs: arrival order (ties by sequence number).
- priority: the claim's priority class first (0 is most urgent), then arrival.
- deadline: least slack first; slack = deadline - now - predicted service time (no deadline:
  infinite slack, arrival order among those).
- fair: weighted fair sharing by tokens served, as the Virtual Token Counter of "Fairness in
  Serving Large Language Models" (OSDI'24): each tenant has a counter that grows by
  (input tokens x 1 + output tokens x 2) / weight as it is served; the tenant with the lowest
  counter goes next; a tenant becoming active is lifted to the lowest counter among the
  backlogged tenants (or, when none is backlogged, to the counter of the last service
  charged), so idling earns no credit. Light tenants first (where the caller reports arrivals,
  arrived(): the gateway's queue does, the engines do not): a tenant offering at most
  LIGHT_FACTOR times its max-min fair share of the service the mesh delivers (demand and
  service measured as decayed rates, DEMAND_TAU_S) goes ahead of every heavy tenant, VTC inside
  each class, as long as every heavy tenant still receives HEAVY_FLOOR of its own share. VTC
  alone serves a tenant offering exactly its share like a queue at load 1 (issue 39: the light
  tenant of tenants-overload queued 4.4 s at the median and 23.7 s at p99 behind a tenant
  offering five times its share); by demand, the heavy tenant's backlog is what waits. This
  departs from VTC's guarantee on purpose: while a light and a heavy tenant are both backlogged,
  the light one may be served more than VTC's 2U bound ahead; the floor bounds the heavy tenant's
  loss to half its share (FairPolicy(by_demand=False) is VTC alone, with the bound).
  Slots in reserve (the gateway's queue, by demand only): while some tenant offers at most
  WITHIN_FACTOR times its share, RESERVE_FRACTION of the mesh's slots are kept for such tenants:
  the others' requests are dispatched only while more slots than that are free (trunk
  reservation, as telephone exchanges keep circuits for priority calls). Light-first order alone
  still makes a tenant within its share wait for the next slot to free, and at 2x overload on
  the smollm2 shape that is the whole of its queueing (about one departure a second: p99 of one
  wait is 5 s, issue 39); with a slot in reserve its request can start at once. Not yet shown to
  help: in tenants-overload's run 7 the light tenant offered exactly its share, measured against
  the service the overloaded mesh delivered it looked over 1.25x, and its queue wait did not
  change (docs/BENCHMARKS.md).
- vtc: fair without light tenants first (VTC's order alone).
- fair-deadline (the default): (1) a claim that has waited the starvation bound goes next
  (oldest first); (2) otherwise light tenants first, then the tenant with the lowest counter;
  (3) within it, least slack.

Policies with state (the fair ones) learn of service through charge() and of a tenant
becoming backlogged through activate(); the others ignore both.

Slots by weighted share (the fair ones): when every batch slot is taken, slot_preemption()
gives a waiting claim of a tenant holding fewer slots than its weighted share of them (among
the tenants with work there) the slot of the tenant furthest over its share, provided that
tenant stays at or above its share after losing it, so the preempted claim is never under
share in turn and the two cannot swap back and forth. The other policies preempt for slots
only for a more urgent priority class.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from operator import attrgetter
from typing import Protocol

INPUT_WEIGHT, OUTPUT_WEIGHT = 1.0, 2.0  # the cost of a token served, by kind (the paper's w_p, w_q)
DEFAULT_STARVATION_S = 30.0
DEMAND_TAU_S = 60.0  # time constant of the demand and service rates the fair policies measure
LIGHT_FACTOR = 2.0  # light: offering at most this multiple of its max-min share (2: a Poisson stream at its share,
# measured over a minute, seldom looks heavy)
HEAVY_FLOOR = 0.5  # light tenants go first only while every heavy tenant receives this fraction of its share
CLASSIFY_EVERY_S = 1.0  # how often the light tenants are worked out again
WITHIN_FACTOR = 1.25  # within its share: offering at most this multiple of its max-min share (the reserve's holders)
RESERVE_FRACTION = 0.1  # of the gateway's slots, kept free for tenants within their share (module docstring)


class SlotClaim(Protocol):
    """What a policy may read of a request."""

    arrival_s: float  # when the request arrived (the caller's clock)
    band: int  # services.policy.bands: 0 critical, 1 standard, 2 sheddable; strict before everything else
    priority: int  # 0 is most urgent; larger numbers wait
    seq_no: int  # admission order, unique per queue: the final tie-break
    tenant: str  # who asked
    weight: float  # the tenant's share
    deadline_s: float | None  # absolute, same clock; None = none
    predicted_s: float  # predicted service time (0 when unknown)


def slack(claim: SlotClaim, now: float) -> float:
    """Time to spare: deadline - now - predicted service time (inf without a deadline)."""
    if claim.deadline_s is None:
        return math.inf
    return claim.deadline_s - now - claim.predicted_s


def weighted_shares(slots: float, weights: dict) -> dict:
    """Each tenant's share of `slots` in proportion to its weight ({tenant: weight} of the tenants with work)."""
    total = sum(weights.values())
    return {t: slots * w / total for t, w in weights.items()} if total > 0 else {}


def max_min_shares(total: float, demand: dict, weights: dict) -> dict:
    """Weighted max-min fair split of `total` given each tenant's demand (water-filling): a tenant asking less than
    its weighted part gets its demand, the rest is split again among the others by weight."""
    share, left, active = {t: 0.0 for t in demand}, total, set(demand)
    while active and left > 1e-9:
        per_weight = left / sum(weights[t] for t in active)
        capped = {t for t in active if demand[t] - share[t] <= per_weight * weights[t]}
        if not capped:
            for t in active:
                share[t] += per_weight * weights[t]
            break
        for t in capped:
            left -= demand[t] - share[t]
            share[t] = demand[t]
        active -= capped
    return share


class DecayedRate:
    """An amount per second, exponentially weighted with time constant tau_s: for a steady rate r since `since`,
    rate(now, since) is r (the decayed sum over the window it could have filled). `since` is when measuring began,
    so a tenant first seen later was idle, not unknown, before."""

    def __init__(self, tau_s: float = DEMAND_TAU_S):
        self.tau_s, self.total = tau_s, 0.0
        self.last: float | None = None

    def add(self, amount: float, now: float) -> None:
        self._advance(now)
        self.total += amount

    def rate(self, now: float, since: float) -> float:
        self._advance(now)
        window = self.tau_s * (1.0 - math.exp(-max(now - since, 1.0) / self.tau_s))
        return max(self.total, 0.0) / window

    def _advance(self, now: float) -> None:
        if self.last is None or now > self.last:
            if self.last is not None:
                self.total *= math.exp(-(now - self.last) / self.tau_s)
            self.last = now


def held(claims: Iterable[SlotClaim]) -> dict:
    """Claims per tenant."""
    out: dict = {}
    for c in claims:
        out[c.tenant] = out.get(c.tenant, 0) + 1
    return out


def cost(input_tokens: int, output_tokens: int, weight: float) -> float:
    """Weighted service of tokens to a tenant of this weight (the counters' unit)."""
    return (INPUT_WEIGHT * input_tokens + OUTPUT_WEIGHT * output_tokens) / weight


_ARRIVAL = attrgetter("band", "arrival_s", "seq_no")


def band_preemption(waiting: list, running: list, victim, in_order: bool = False):
    """Every slot is taken: (the most urgent waiting claim, the running claim to preempt for it) when a claim of a
    more urgent band waits than some running claim's band, else None. victim(claims): the policy's victim among
    the running claims of the least urgent band. in_order: `waiting` is sorted by band and arrival already."""
    if not waiting or not running:
        return None
    worst = max(c.band for c in running)
    if worst == 0:
        return None  # nothing runs that a band could preempt (the common case: no look through the queue)
    best = waiting[0] if in_order else min(waiting, key=_ARRIVAL)
    if best.band >= worst:
        return None
    return best, victim([c for c in running if c.band == worst])


class ArbitrationPolicy:
    """Base: subclasses define rank(); selection helpers and no-op hooks are shared."""

    name = "base"
    reserve_fraction = 0.0  # of the gateway's slots kept for reserve_holders() (0: none)
    uses_deadlines = False  # rejects claims that can no longer meet their deadline; engines cap their batch for them
    tracks_activation = False  # activate() does something (callers may skip working out who is backlogged)
    # A key giving rank()'s order from the claim alone (no clock, no state), for a policy whose admission order is
    # its serving order and that never preempts for a slot: a queue kept sorted by it needs no sorting (None: none).
    sort_key = None

    def rank(self, claim: SlotClaim, now: float) -> tuple:
        """The order inside a band (the callers put the band first)."""
        raise TypeError(f"{type(self).__name__} must define rank()")

    def order(self, claims: Iterable[SlotClaim], now: float = 0.0) -> list:
        """Claims in serving order: first is served first."""
        return sorted(claims, key=lambda c: (c.band, self.rank(c, now)))

    def pick(self, claims: Iterable[SlotClaim], now: float = 0.0):
        """The claim to serve next (None when empty)."""
        return min(claims, key=lambda c: (c.band, self.rank(c, now)), default=None)

    def victim(self, claims: Iterable[SlotClaim], now: float = 0.0):
        """The claim to preempt first: the last one in serving order (None when empty)."""
        return max(claims, key=lambda c: (c.band, self.rank(c, now)), default=None)

    def should_preempt(self, waiting: SlotClaim, running: SlotClaim, now: float) -> bool:
        """Every slot is taken: should `running` yield its slot to `waiting`? By default never (FCFS and deadline
        order do not preempt for slots)."""
        return False

    def admission_order(self, waiting: list, running: list, slots: int, now: float) -> list:
        """Waiting claims in the order they take free slots (by default the serving order)."""
        return self.order(waiting, now)

    def slot_preemption(self, waiting: list, running: list, slots: int, now: float):
        """Every slot is taken: (the waiting claim to admit, the running claim to preempt for it), or None. A more
        urgent band's claim first (band_preemption); else by default the policy's best waiting claim takes its
        victim's slot when should_preempt() says so."""
        if not waiting or not running:
            return None
        by_band = band_preemption(waiting, running, lambda cs: self.victim(cs, now))
        if by_band is not None:
            return by_band
        best, victim = self.pick(waiting, now), self.victim(running, now)
        return (best, victim) if self.should_preempt(best, victim, now) else None

    def activate(self, tenant: str, backlogged: Iterable[str]) -> None:
        """tenant had nothing queued and now has; `backlogged` are the tenants with queued claims."""

    def reserve_holders(self, now: float) -> frozenset:
        """The tenants the slots in reserve are kept for now (empty: no slot is held back)."""
        return frozenset()

    def charge(self, tenant: str, weight: float, input_tokens: int = 0, output_tokens: int = 0,
               now: float | None = None) -> None:
        """Record service (negative counts refund a reservation that was not used), at `now` when the caller knows."""

    def arrived(self, tenant: str, weight: float, input_tokens: int, output_tokens: int, now: float) -> None:
        """A request of the tenant's arrived (offered, before any decision on it): its demand."""


class FcfsPolicy(ArbitrationPolicy):
    name = "fcfs"
    sort_key = _ARRIVAL

    def rank(self, claim: SlotClaim, now: float) -> tuple:
        return (claim.arrival_s, claim.seq_no)

    def order(self, claims: Iterable[SlotClaim], now: float = 0.0) -> list:
        return sorted(claims, key=_ARRIVAL)  # rank's order, without a Python call per claim (long queues)

    def slot_preemption(self, waiting: list, running: list, slots: int, now: float):
        """Only across bands: inside one, FCFS never preempts for a slot. The engine keeps `waiting` in sort_key
        order, so its first claim is the most urgent (no look through a long queue)."""
        return band_preemption(waiting, running, lambda cs: self.victim(cs, now), in_order=True)


class PriorityPolicy(ArbitrationPolicy):
    name = "priority"

    def rank(self, claim: SlotClaim, now: float) -> tuple:
        return (claim.priority, claim.arrival_s, claim.seq_no)

    def should_preempt(self, waiting: SlotClaim, running: SlotClaim, now: float) -> bool:
        return waiting.priority < running.priority


class DeadlinePolicy(ArbitrationPolicy):
    name = "deadline"
    uses_deadlines = True

    def rank(self, claim: SlotClaim, now: float) -> tuple:
        return (slack(claim, now), claim.arrival_s, claim.seq_no)


class FairPolicy(ArbitrationPolicy):
    """Virtual token counters per tenant (see the module docstring)."""

    name = "fair"
    tracks_activation = True

    def __init__(self, by_demand: bool = True):
        self.by_demand = by_demand  # light tenants first (module docstring); False: VTC's order alone
        self.counters: dict[str, float] = {}
        self.virtual = 0.0  # the counter at which the latest service was charged: the lift when nobody waits
        self.demand: dict[str, DecayedRate] = {}  # offered service per tenant (arrived())
        self.served: dict[str, DecayedRate] = {}  # service charged per tenant, at a known time
        self.weights: dict[str, float] = {}
        self.since: float | None = None  # the first arrival reported: when the rates began
        self.light: frozenset = frozenset()  # tenants served ahead of the heavy ones (module docstring)
        self.within: frozenset = frozenset()  # tenants offering at most WITHIN_FACTOR x their share
        self.reserve_fraction = RESERVE_FRACTION if by_demand else 0.0
        self._classified_s = -math.inf

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def rank(self, claim: SlotClaim, now: float) -> tuple:
        return (claim.tenant not in self.classify(now), self.counter(claim.tenant), claim.arrival_s, claim.seq_no)

    def classify(self, now: float) -> frozenset:
        """The light tenants now (module docstring), worked out again every CLASSIFY_EVERY_S; empty where no
        arrivals are reported (the engines), so the order there is VTC's alone."""
        if not self.demand or now - self._classified_s < CLASSIFY_EVERY_S:
            return self.light
        self._classified_s = now
        served = {t: r.rate(now, self.since) for t, r in self.served.items()}
        demand = {t: r.rate(now, self.since) for t, r in self.demand.items()}
        demand = {t: d for t, d in demand.items() if d > 0}
        total = sum(served.get(t, 0.0) for t in demand)
        self.light = self.within = frozenset()
        if total <= 0 or len(demand) < 2:
            return self.light
        shares = max_min_shares(total, demand, self.weights)
        light = frozenset(t for t in demand if demand[t] <= LIGHT_FACTOR * shares[t])
        starved = any(served.get(t, 0.0) < HEAVY_FLOOR * shares[t] for t in demand if t not in light)
        if not starved and len(light) < len(demand):
            self.light = light
            self.within = frozenset(t for t in light if demand[t] <= WITHIN_FACTOR * shares[t])
        return self.light

    def reserve_holders(self, now: float) -> frozenset:
        """The tenants within their share, while the light ones go first (classify())."""
        if not self.reserve_fraction:
            return frozenset()
        self.classify(now)
        return self.within

    def heavy_rate(self, tenant: str, now: float) -> float | None:
        """The service a heavy tenant has been getting (cost units a second, weight not divided out), or None for a
        light tenant or where nobody is served ahead (its wait then follows its share)."""
        light = self.classify(now)
        if not light or tenant in light or tenant not in self.served:
            return None
        rate = self.served[tenant].rate(now, self.since)
        return rate if rate > 0 else None

    def arrived(self, tenant: str, weight: float, input_tokens: int, output_tokens: int, now: float) -> None:
        if not self.by_demand:
            return
        self.demand.setdefault(tenant, DecayedRate()).add(cost(input_tokens, output_tokens, 1.0), now)
        self.weights[tenant] = weight
        self.since = now if self.since is None else self.since

    def admission_order(self, waiting: list, running: list, slots: int, now: float) -> list:
        """Claims of tenants under their weighted share of the slots first (so a freed slot goes where a
        preemption would otherwise send it), each part in serving order."""
        share, have = weighted_shares(slots, {c.tenant: c.weight for c in (*running, *waiting)}), held(running)
        return sorted(self.order(waiting, now), key=lambda c: (c.band, have.get(c.tenant, 0) >= share[c.tenant]))

    def slot_preemption(self, waiting: list, running: list, slots: int, now: float):
        """Slots by weighted share (module docstring): the best waiting claim of an under-share tenant, and the
        policy's victim among the claims of the tenant furthest over its share (one that keeps its share)."""
        if not waiting or not running:
            return None
        by_band = band_preemption(waiting, running, lambda cs: self.victim(cs, now))
        if by_band is not None:
            return by_band
        weights = {c.tenant: c.weight for c in (*running, *waiting)}
        share, have = weighted_shares(slots, weights), held(running)
        under = [c for c in waiting if have.get(c.tenant, 0) < share[c.tenant]]
        over = [t for t in have if have[t] - 1 >= share[t]]
        if not under or not over:
            return None
        donor = max(over, key=lambda t: ((have[t] - share[t]) / weights[t], t))
        return self.pick(under, now), self.victim([c for c in running if c.tenant == donor], now)

    def activate(self, tenant: str, backlogged: Iterable[str]) -> None:
        others = [self.counter(t) for t in set(backlogged) if t != tenant]
        self.counters[tenant] = max(self.counter(tenant), min(others) if others else self.virtual)

    def charge(self, tenant: str, weight: float, input_tokens: int = 0, output_tokens: int = 0,
               now: float | None = None) -> None:
        amount = cost(input_tokens, output_tokens, weight)
        if amount > 0:
            self.virtual = max(self.virtual, self.counter(tenant))
        self.counters[tenant] = self.counter(tenant) + amount
        if now is not None and self.demand:
            self.served.setdefault(tenant, DecayedRate()).add(amount * weight, now)


class VtcPolicy(FairPolicy):
    """VTC's order alone: the fair policy without light tenants first (the comparison, and VTC's 2U bound)."""

    name = "vtc"

    def __init__(self):
        super().__init__(by_demand=False)


class FairDeadlinePolicy(FairPolicy):
    name = "fair-deadline"
    uses_deadlines = True

    def __init__(self, starvation_s: float = DEFAULT_STARVATION_S, by_demand: bool = True):
        super().__init__(by_demand)
        self.starvation_s = starvation_s

    def rank(self, claim: SlotClaim, now: float) -> tuple:
        if now - claim.arrival_s >= self.starvation_s:
            return (0, False, claim.arrival_s, 0.0, claim.seq_no)
        return (1, claim.tenant not in self.classify(now), self.counter(claim.tenant), slack(claim, now),
                claim.arrival_s, claim.seq_no)


POLICIES = {p.name: p for p in (FcfsPolicy, PriorityPolicy, DeadlinePolicy, FairPolicy, VtcPolicy, FairDeadlinePolicy)}


def make_arbitration_policy(name: str, starvation_s: float = DEFAULT_STARVATION_S) -> ArbitrationPolicy:
    """A policy by its configured name; unknown names list the known ones."""
    if name not in POLICIES:
        raise ValueError(f"unknown arbitration policy {name!r}; known: {sorted(POLICIES)}")
    if name == FairDeadlinePolicy.name:
        return FairDeadlinePolicy(starvation_s)
    return POLICIES[name]()
