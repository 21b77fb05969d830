"""Prefixes the router has just sent somewhere, before the prefix index can show them.

A worker publishes a block once it has computed it, so for the first moments after a routing
decision (longer while the request queues) the index does not yet show that the chosen worker is
about to hold the prompt. Without this overlay a burst of requests sharing a new system prompt
would scatter and each worker would prefill it. For each (first block, worker) the overlay keeps
the latest routed prompt's block hashes for ttl_s (by then the index has caught up, or the
worker never kept the blocks); memory is bounded by max_entries. Recording is O(1); a lookup
compares the prompt with the recorded prompts that start like it. Pure: the clock is injected.
"""

from __future__ import annotations

from collections import OrderedDict


class RecentRoutes:
    def __init__(self, clock, ttl_s: float = 10.0, max_entries: int = 50_000):
        self.clock, self.ttl_s, self.max_entries = clock, ttl_s, max_entries
        self.entries: OrderedDict[tuple[bytes, str], tuple[float, list]] = OrderedDict()  # -> (expiry, hashes)
        self.by_first: dict[bytes, set[str]] = {}  # first block hash -> workers with an entry

    def record(self, hashes: list[bytes], worker_id: str) -> None:
        if not hashes:
            return
        now, key = self.clock(), (hashes[0], worker_id)
        self.entries.pop(key, None)
        self.entries[key] = (now + self.ttl_s, hashes)
        self.by_first.setdefault(hashes[0], set()).add(worker_id)
        self._prune(now)

    def longest(self, hashes: list[bytes]) -> dict[str, int]:
        """worker_id -> leading blocks of `hashes` it was recently sent (not expired)."""
        if not hashes:
            return {}
        now, held = self.clock(), {}
        for w in self.by_first.get(hashes[0], ()):
            expiry, recorded = self.entries[(hashes[0], w)]
            if expiry > now:
                held[w] = _common_prefix(hashes, recorded)
        return held

    def _prune(self, now: float) -> None:
        while self.entries:
            key, (expiry, _) = next(iter(self.entries.items()))
            if len(self.entries) <= self.max_entries and expiry > now:
                return
            del self.entries[key]
            workers = self.by_first[key[0]]
            workers.discard(key[1])
            if not workers:
                del self.by_first[key[0]]


def _common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
