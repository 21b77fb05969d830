"""LoRA adapter placement by measured demand: a pure policy (no I/O; the clock is passed in).

The router observes the adapter of every request it routes; plan() turns the last window_s of them into
prefetch orders (worker, adapter): an adapter gets one replica per slot's worth of the traffic,
    replicas(a) = min(workers, ceil(share(a) * workers * slots per worker)),
so one that would keep a compute slot busy on more than one worker is read into memory (and a free slot)
on that many workers before its requests arrive there, and the router's affinity scorer can then spread
it by load instead of queueing it behind one worker's slots. A worker holds an adapter when it is in its
slots or host memory (its heartbeat says which); new replicas go to the workers with the most free slots,
then the fewest adapters in memory, then the lowest id. Cold adapters (one replica) are left to routing
and the workers' own LRU. An order is not repeated for reorder_s (the heartbeat shows it after a read),
and a worker gets at most max_orders per plan.
"""

from __future__ import annotations

import math
from collections import Counter, deque

from services.router.views import WorkerView


class AdapterPlacement:
    def __init__(self, window_s: float = 60.0, max_orders: int = 2, reorder_s: float = 10.0):
        self.window_s, self.max_orders, self.reorder_s = window_s, max_orders, reorder_s
        self.seen: deque = deque()  # (time, adapter) of routed requests with an adapter
        self.counts: Counter = Counter()
        self.total = 0  # requests routed in the window, adapter or not
        self.routed: deque = deque()
        self.ordered: dict = {}  # (worker_id, adapter) -> when it was ordered

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
            self.counts[self.seen.popleft()[1]] -= 1
        while self.routed and self.routed[0] < edge:
            self.routed.popleft()

    def replicas(self, adapter: str, workers: list[WorkerView]) -> int:
        slots = max((w.lora_slots for w in workers), default=0)
        if not self.routed or not slots or not self.counts[adapter]:
            return 0
        share = self.counts[adapter] / len(self.routed)
        return min(len(workers), math.ceil(share * len(workers) * slots))

    def plan(self, workers: list[WorkerView], now: float) -> list[tuple[WorkerView, str]]:
        """Prefetch orders for one pool of workers (one role) that should hold more replicas (module doc)."""
        self._expire(now)
        self.ordered = {k: t for k, t in self.ordered.items() if now - t < self.reorder_s}
        orders: list = []
        given: Counter = Counter()
        for adapter, _ in self.counts.most_common():
            can = [w for w in workers if adapter in w.known_adapters and w.lora_slots]
            want = self.replicas(adapter, can)
            holders = [w for w in can if adapter in w.adapters or adapter in w.host_adapters
                       or (w.worker_id, adapter) in self.ordered]
            if want < 2 or len(holders) >= want:
                continue
            spare = sorted((w for w in can if w not in holders and given[w.worker_id] < self.max_orders),
                           key=lambda w: (-w.free_lora_slots, len(w.host_adapters), w.worker_id))
            for w in spare[:want - len(holders)]:
                orders.append((w, adapter))
                given[w.worker_id] += 1
                self.ordered[(w.worker_id, adapter)] = now
        return orders
