"""LoRA adapter placement by measured demand: a pure policy (no I/O; the clock is passed in).

The router observes the adapter of every request it routes; plan() turns the last window_s of them into
homes (which workers of a pool serve each adapter) and prefetch orders (worker, adapter):

- replicas: one per slot's worth of the traffic, replicas(a) = min(workers, ceil(share(a) * workers * slots)),
  so an adapter that would keep a compute slot busy on more than one worker is served by that many;
- homes: adapters in order of demand, each to the workers with the least demand homed so far (one that holds
  it already, in a slot or in memory, is favoured by STICKY of a worker's fair share of the demand, so homes
  stay put unless the imbalance is larger: moving a home costs a read); the demand is balanced across
  workers, and each worker sees only its share of the adapters, so fewer of them contend for its slots and
  host memory;
- orders: a replicated adapter's home that does not hold it is told to read it into memory (and a free slot)
  before the adapter's next request there; at most max_orders per worker per plan, none repeated for
  reorder_s (the heartbeat shows the adapter once read). A single home reads its adapter on demand.

The router's adapter scorer prefers an adapter's homes (services/policy/routing/scoring.py); load still decides
between them, and against them when they are far busier.
"""

from __future__ import annotations

import math
from collections import Counter, deque

from services.policy.routing.views import WorkerView

STICKY = 0.1  # a worker holding an adapter counts this fraction of a worker's fair share less when homing it


class AdapterPlacement:
    def __init__(self, window_s: float = 60.0, max_orders: int = 2, reorder_s: float = 10.0):
        self.window_s, self.max_orders, self.reorder_s = window_s, max_orders, reorder_s
        self.seen: deque = deque()  # (time, adapter) of routed requests with an adapter
        self.counts: Counter = Counter()
        self.routed: deque = deque()  # times of every routed request
        self.ordered: dict = {}  # (worker_id, adapter) -> when it was ordered
        self.homes: dict = {}  # (role, adapter) -> frozenset of worker ids, from the latest plan

    def observe(self, adapter: str, now: float) -> None:
        """One routed request (adapter "" for the base model)."""
        self.routed.append(now)
        if adapter:
            self.seen.append((now, adapter))
            self.counts[adapter] += 1
        self._expire(now)

    def _expire(self, now: float) -> None:
        edge = now - self.window_s
        while self.seen and self.seen[0][0] < edge:
            adapter = self.seen.popleft()[1]
            self.counts[adapter] -= 1
            if not self.counts[adapter]:
                del self.counts[adapter]
        while self.routed and self.routed[0] < edge:
            self.routed.popleft()

    def replicas(self, adapter: str, workers: list[WorkerView]) -> int:
        slots = max((w.lora_slots for w in workers), default=0)
        if not self.routed or not slots or not self.counts[adapter]:
            return 0
        share = self.counts[adapter] / len(self.routed)
        return min(len(workers), math.ceil(share * len(workers) * slots))

    def home(self, role: str, adapter: str) -> frozenset:
        """The workers of a role that the latest plan homed the adapter on (empty: not planned yet)."""
        return self.homes.get((role, adapter), frozenset())

    def plan(self, workers: list[WorkerView], now: float) -> list[tuple[WorkerView, str]]:
        """Homes for one pool of workers (one role; see module doc); returns the prefetch orders."""
        self._expire(now)
        self.ordered = {k: t for k, t in self.ordered.items() if now - t < self.reorder_s}
        pool = [w for w in workers if w.lora_slots]
        if not pool:
            return []
        role = pool[0].role
        self.homes = {k: v for k, v in self.homes.items() if k[0] != role}
        homed: Counter = Counter()  # demand homed on each worker so far
        orders: list = []
        given: Counter = Counter()
        stick = STICKY * sum(self.counts.values()) / len(pool)
        known = {w.worker_id: frozenset(w.known_adapters) for w in pool}  # once: hundreds of adapters a worker
        for adapter, count in sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0])):
            can = [w for w in pool if adapter in known[w.worker_id]]
            want = self.replicas(adapter, can)
            if not want:
                continue

            def holds(w: WorkerView) -> bool:
                return adapter in w.adapters or adapter in w.host_adapters or (w.worker_id, adapter) in self.ordered

            chosen = sorted(can, key=lambda w: (homed[w.worker_id] - (stick if holds(w) else 0.0), w.worker_id))[:want]
            for w in chosen:
                homed[w.worker_id] += count / want
                if want > 1 and not holds(w) and given[w.worker_id] < self.max_orders:
                    orders.append((w, adapter))
                    given[w.worker_id] += 1
                    self.ordered[(w.worker_id, adapter)] = now
            self.homes[(role, adapter)] = frozenset(w.worker_id for w in chosen)
        return orders
