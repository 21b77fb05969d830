"""Routing as Filter -> Scorer -> Picker (the llm-d shape), pure and torch-free.

Scorers map each candidate to 0..1 (higher is better); the picker sums them with weights and
takes the best, ties going to the lower worker id. The load guard (SGLang's cache-aware
imbalance rule) lets load win outright when the spread of loads is large:
    max_load - min_load > abs_threshold  and  max_load > rel_threshold * min_load
then only the load scorer counts. Loads are outstanding tokens over KV token capacity.

- LoadScorer: 1 - load / max_load over the candidates (all idle: 1 for all).
- PrefixScorer: the fraction of the prompt's full blocks the worker already caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.router.policies import WorkerView


@dataclass(frozen=True)
class RouteContext:
    prompt_blocks: int  # full blocks in the prompt
    cached_blocks: dict = field(default_factory=dict)  # worker_id -> longest cached prefix, in blocks


class LoadScorer:
    name = "load"

    def score(self, workers: list[WorkerView], ctx: RouteContext) -> list[float]:
        top = max(w.load for w in workers)
        return [1.0 if top <= 0 else 1.0 - w.load / top for w in workers]


class PrefixScorer:
    name = "prefix"

    def score(self, workers: list[WorkerView], ctx: RouteContext) -> list[float]:
        if ctx.prompt_blocks <= 0:
            return [0.0] * len(workers)
        return [min(ctx.cached_blocks.get(w.worker_id, 0), ctx.prompt_blocks) / ctx.prompt_blocks for w in workers]


@dataclass(frozen=True)
class LoadGuard:
    abs_threshold: float = 0.25  # load units (outstanding tokens / KV capacity)
    rel_threshold: float = 1.5  # max over min

    def imbalanced(self, workers: list[WorkerView]) -> bool:
        loads = [w.load for w in workers]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.abs_threshold and hi > self.rel_threshold * lo


@dataclass
class WeightedPicker:
    scorers: list  # (scorer, weight) pairs
    guard: LoadGuard | None = None

    def pick(self, workers: list[WorkerView], ctx: RouteContext) -> tuple[WorkerView, str]:
        """The best worker and why (weighted total and each score per worker)."""
        active = self.scorers
        guarded = self.guard is not None and self.guard.imbalanced(workers)
        if guarded:
            active = [(s, w) for s, w in self.scorers if s.name == "load"]
        columns = [(s.name, weight, s.score(workers, ctx)) for s, weight in active]
        totals = [sum(weight * col[i] for _, weight, col in columns) for i in range(len(workers))]
        best = min(range(len(workers)), key=lambda i: (-totals[i], workers[i].worker_id))
        why = "; ".join(f"{w.worker_id}={totals[i]:.3f}(" + ",".join(f"{n}={c[i]:.2f}" for n, _, c in columns) + ")"
                        for i, w in enumerate(workers))
        return workers[best], ("load guard: " if guarded else "") + why


class PrefixAware:
    """Prefix-aware routing guarded by load: weights prefix 1.0, load 0.5 by default."""

    name = "prefix-aware"

    def __init__(self, prefix_weight: float = 1.0, load_weight: float = 0.5, guard: LoadGuard | None = None):
        self.picker = WeightedPicker([(PrefixScorer(), prefix_weight), (LoadScorer(), load_weight)],
                                     guard or LoadGuard())

    def select(self, workers: list[WorkerView], cost: int, ctx: RouteContext | None = None):
        return self.picker.pick(sorted(workers, key=lambda w: w.worker_id), ctx or RouteContext(0))

    def on_routed(self, worker: WorkerView, cost: int) -> None:
        worker.routed_since_beat += cost
