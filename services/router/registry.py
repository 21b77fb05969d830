"""The live set of workers, from heartbeats. Pure: the clock is injected.

A worker that has not beaten for `ttl_s` (default 3 s: three missed 1 s beats) stops receiving
work and is forgotten.
"""

from __future__ import annotations

from services.common.errors import Unavailable as NoWorker
from services.router.views import WorkerView

BEAT_FIELDS = ("block_size", "index_member", "decode_tps", "adapters", "max_num_seqs", "prefill_s_per_token",
               "decode_s_per_step", "running", "waiting")


class Registry:
    def __init__(self, clock, ttl_s: float = 3.0):
        self.clock, self.ttl_s = clock, ttl_s
        self.workers: dict[str, WorkerView] = {}

    def beat(self, worker_id: str, address: str, role: str, outstanding: int, capacity: int, **extra) -> None:
        """Record a heartbeat; extra: any of BEAT_FIELDS."""
        unknown = set(extra) - set(BEAT_FIELDS)
        if unknown:
            raise TypeError(f"unknown heartbeat field(s) {sorted(unknown)}")
        w = self.workers.get(worker_id)
        if w is None or w.address != address or w.role != role:
            w = self.workers[worker_id] = WorkerView(worker_id, address, role)
        w.outstanding_tokens, w.capacity_tokens = outstanding, max(capacity, 1)
        w.routed_since_beat, w.routed_requests, w.last_seen_s = 0, 0, self.clock()
        for name, value in extra.items():
            setattr(w, name, value)

    def remove(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def prune(self) -> list[WorkerView]:
        """Forget workers silent for longer than ttl_s; returns the live ones."""
        now = self.clock()
        for wid in [k for k, w in self.workers.items() if now - w.last_seen_s > self.ttl_s]:
            del self.workers[wid]
        return list(self.workers.values())

    def live(self, role: str) -> list[WorkerView]:
        out = [w for w in self.prune() if w.role == role]
        if not out:
            raise NoWorker(f"no live {role} worker")
        return out
