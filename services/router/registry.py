"""The live set of workers, from heartbeats. Pure: the clock is injected.

A worker that has not beaten for `ttl_s` (default 3 s: three missed 1 s beats) stops receiving
work and is forgotten.
"""

from __future__ import annotations

from services.common.errors import NoWorker
from services.policy.routing.filters import Need, candidates
from services.policy.routing.views import WorkerView

BEAT_FIELDS = ("block_size", "index_member", "decode_tps", "adapters", "max_num_seqs", "prefill_s_per_token",
               "decode_s_per_step", "running", "waiting", "host", "kv_pool", "host_adapters", "known_adapters",
               "pinned_adapters", "lora_slots", "free_lora_slots", "topology",
               "decode_s_floor", "tensor_parallel_size", "cores", "max_num_batched_tokens",
               "longest_step_s")  # what a heartbeat may set beyond the first five


class Registry:
    def __init__(self, clock, ttl_s: float = 3.0, on_forget=None):
        """on_forget(worker, silent_s): called for each worker forgotten for its silence (the router logs it)."""
        self.clock, self.ttl_s, self.on_forget = clock, ttl_s, on_forget
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
        w.routed_adapters = set()
        for name, value in extra.items():
            setattr(w, name, value)

    def remove(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def prune(self) -> list[WorkerView]:
        """Forget workers silent for longer than ttl_s; returns the live ones."""
        now = self.clock()
        for wid in [k for k, w in self.workers.items() if now - w.last_seen_s > self.ttl_s]:
            w = self.workers.pop(wid)
            if self.on_forget is not None:
                self.on_forget(w, now - w.last_seen_s)
        return list(self.workers.values())

    def beat_view(self, fields: dict) -> None:
        """Record a heartbeat given as WorkerView attributes (services.common.convert.load_from_pb)."""
        f = dict(fields)
        self.beat(f.pop("worker_id"), f.pop("address"), f.pop("role"), f.pop("outstanding_tokens"),
                  f.pop("capacity_tokens"), **f)

    def live(self, need: Need | str) -> list[WorkerView]:
        """The live workers that pass every filter (filters.py) for a Need or a role; UNAVAILABLE naming
        the filter that left none."""
        need = Need(need) if isinstance(need, str) else need
        out, emptied_by = candidates(self.prune(), need)
        if not out:
            detail = "" if emptied_by == "role" else f" passing the {emptied_by} filter ({need})"
            raise NoWorker(f"no live {need.role} worker{detail}", need.role if emptied_by == "role" else "")
        return out
