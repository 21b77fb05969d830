"""Routing policies: pure objects that pick a worker from a snapshot of the registry.

- round-robin: the next live worker of the role, in worker-id order.
- least-outstanding: the lowest load (views.loads: outstanding tokens over KV capacity and over speed, requests
  over slots, with the in-flight correction); ties go to the worker nearer the request's KV (a decode pick: the prefill
  worker's topology, views.closeness), then to the lower worker id.
- power-of-two: two workers drawn at random, the less loaded of them (the same load); the classic remedy for herding
  on stale loads, since a worker that looks idle to every router at once is only one of the two choices of each.
  The simulator seeds it (config `seed`), so a simulation is a function of its inputs; a router draws from the OS.
- prefix-aware: weighted scorers (prefix 1.0, load 0.5, adapter 0.0 by default) guarded by load
  (load wins outright past a gap of 1.0 load units and a ratio of 2 by default; scoring.py).
- lora-aware: prefix-aware with LoRA affinity (adapter 1.0, load 1.0): an adapter's requests go where it is
  resident unless that worker is much busier; the router's placement (adapter_placement.py) replicates hot adapters.

The candidates come from the Filter stage (filters.py). select(workers, cost, ctx) only decides
and says why; the router commits the decision through on_routed(worker, cost), the one commit
path: the in-flight correction (views.charge) and whatever state the policy keeps (the turn of
round-robin; the adapters it was sent, until its next heartbeat). `uses_prefix` tells the router whether to look the
prompt up in the prefix index.
"""

from __future__ import annotations

import random

from services.policy.routing.scoring import SCORERS, LoadGuard, WeightedPicker
from services.policy.routing.views import RouteContext, Why, WorkerView, charge, closeness, loads


class RoutingPolicy:
    """What every policy shares: the commit. Each subclass adds select(workers, cost, ctx) -> (worker, why): why is
    a str or a views.Why (formatted when read)."""

    name = ""
    uses_prefix = False

    def on_routed(self, worker: WorkerView, cost: int, adapter: str = "") -> None:
        charge(worker, cost, adapter)


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self):
        self.turn: dict[str, int] = {}

    def select(self, workers: list[WorkerView], cost: int, ctx: RouteContext | None = None):
        ordered = sorted(workers, key=lambda w: w.worker_id)
        pick = ordered[self.turn.get(ordered[0].role, 0) % len(ordered)]
        return pick, f"round-robin over {len(ordered)}"

    def on_routed(self, worker: WorkerView, cost: int, adapter: str = "") -> None:
        self.turn[worker.role] = self.turn.get(worker.role, 0) + 1
        super().on_routed(worker, cost, adapter)


class LeastOutstanding(RoutingPolicy):
    name = "least-outstanding"

    def select(self, workers: list[WorkerView], cost: int, ctx: RouteContext | None = None):
        ordered = sorted(workers, key=lambda w: w.worker_id)
        ls = loads(ordered)
        best = min(range(len(ordered)), key=lambda i: (ls[i], closeness(ordered[i], ctx), ordered[i].worker_id))
        return ordered[best], Why(_loads_why, ordered, ls)


class PowerOfTwo(RoutingPolicy):
    name = "power-of-two"

    def __init__(self, seed: int | None = None):
        self.rng = random.Random(seed)

    def select(self, workers: list[WorkerView], cost: int, ctx: RouteContext | None = None):
        ordered = sorted(workers, key=lambda w: w.worker_id)
        two = self.rng.sample(range(len(ordered)), 2) if len(ordered) > 1 else [0]
        ls = loads(ordered)
        best = min(two, key=lambda i: (ls[i], closeness(ordered[i], ctx), ordered[i].worker_id))
        return ordered[best], Why(_loads_why, [ordered[i] for i in two], [ls[i] for i in two])


def _loads_why(workers: list[WorkerView], ls: list[float]) -> str:
    return " ".join(f"{w.worker_id}={x:.3f}" for w, x in zip(workers, ls))


class PrefixAware(RoutingPolicy):
    name = "prefix-aware"
    uses_prefix = True
    DEFAULT_WEIGHTS = {"prefix": 1.0, "load": 0.5, "adapter": 0.0}

    def __init__(self, weights: dict | None = None, guard: LoadGuard | None = None):
        w = {**self.DEFAULT_WEIGHTS, **(weights or {})}
        unknown = set(w) - set(SCORERS)
        if unknown:
            raise ValueError(f"unknown scorer(s) {sorted(unknown)} in routing weights; known: {sorted(SCORERS)}")
        if any(not isinstance(v, (int, float)) or v < 0 for v in w.values()):
            raise ValueError(f"routing weights must be numbers >= 0, got {w}")
        self.picker = WeightedPicker([(SCORERS[name](), float(weight)) for name, weight in sorted(w.items())],
                                     guard or LoadGuard())

    def select(self, workers: list[WorkerView], cost: int, ctx: RouteContext | None = None):
        return self.picker.pick(sorted(workers, key=lambda w: w.worker_id), ctx or RouteContext())


class LoRAAware(PrefixAware):
    name = "lora-aware"
    DEFAULT_WEIGHTS = {"prefix": 1.0, "load": 1.0, "adapter": 1.0}


POLICIES = {p.name: p for p in (RoundRobin, LeastOutstanding, PowerOfTwo, PrefixAware, LoRAAware)}


def make_routing_policy(name: str, config: dict | None = None):
    """A policy by name; config (from the mesh file's routing section) sets weights and guard thresholds."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}")
    config = config or {}
    cls = POLICIES[name]
    if cls is PowerOfTwo:
        return cls(config.get("seed"))
    if not issubclass(cls, PrefixAware):
        return cls()
    guard = config.get("guard") or {}
    unknown = set(guard) - {"abs", "rel"}
    if unknown:
        raise ValueError(f"unknown load guard key(s) {sorted(unknown)}; known: abs, rel")
    default = LoadGuard()
    return cls(config.get("weights"), LoadGuard(float(guard.get("abs", default.abs_threshold)),
                                                        float(guard.get("rel", default.rel_threshold))))
