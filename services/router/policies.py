"""Routing policies: pure objects that pick a worker from a snapshot of the registry.

- RoundRobin: the next live worker of the role, in worker-id order.
- LeastOutstanding: the worker with the fewest outstanding tokens (remaining prefill tokens +
  expected decode tokens, as its heartbeat says, plus what was routed to it since) divided by
  its KV token capacity; ties go to the lower worker id.

select() only decides; the router commits the decision through on_routed().
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkerView:
    worker_id: str  # unique id (the worker's address unless told otherwise)
    address: str  # host:port
    role: str  # prefill | decode | unified
    outstanding_tokens: int = 0  # from the last heartbeat
    capacity_tokens: int = 1  # KV pool token capacity
    routed_since_beat: int = 0  # tokens routed to it since its last heartbeat (in-flight correction)
    last_seen_s: float = 0.0  # clock of the last heartbeat

    @property
    def load(self) -> float:
        return (self.outstanding_tokens + self.routed_since_beat) / max(self.capacity_tokens, 1)


class RoundRobin:
    name = "round-robin"

    def __init__(self):
        self.turn: dict[str, int] = {}

    def select(self, workers: list[WorkerView], cost: int) -> tuple[WorkerView, str]:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        pick = ordered[self.turn.get(ordered[0].role, 0) % len(ordered)]
        return pick, f"round-robin over {len(ordered)}"

    def on_routed(self, worker: WorkerView, cost: int) -> None:
        self.turn[worker.role] = self.turn.get(worker.role, 0) + 1
        worker.routed_since_beat += cost


class LeastOutstanding:
    name = "least-outstanding"

    def select(self, workers: list[WorkerView], cost: int) -> tuple[WorkerView, str]:
        pick = min(workers, key=lambda w: (w.load, w.worker_id))
        return pick, " ".join(f"{w.worker_id}={w.load:.3f}" for w in sorted(workers, key=lambda w: w.worker_id))

    def on_routed(self, worker: WorkerView, cost: int) -> None:
        worker.routed_since_beat += cost


POLICIES = {p.name: p for p in (RoundRobin, LeastOutstanding)}


def make_policy(name: str):
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}") from None
