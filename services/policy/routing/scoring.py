"""Routing as Filter -> Scorer -> Picker (the llm-d shape), pure and torch-free.

Scorers map each candidate to 0..1 (higher is better); the picker sums them with weights and
takes the best, ties going to the worker nearer the request's KV (views.closeness), then to the lower worker id. The
load guard (SGLang's cache-aware imbalance rule) lets load win outright when the spread of loads is large:
    max_load - min_load > abs_threshold  and  max_load > rel_threshold * min_load
then only the load scorer counts. Loads are as views.loads() defines them.

- LoadScorer: 1 - load / max_load over the candidates (all idle: 1 for all).
- PrefixScorer: the fraction of the prompt's full blocks the worker already caches; blocks beyond those that
  its host's KV pool holds (and it takes from there) count POOL_CREDIT each: far cheaper than computing them,
  a little dearer than a local hit (they are copied in).
- AdapterScorer: the LoRA affinity of the request's adapter (llm-d's tiers, and one more): 1 in a compute slot,
  0.8 in host memory, 0.6 with a free slot (one read from disk), 0.3 where another adapter's idle slot must go,
  0 where every slot is held by other adapters' running requests (it would wait for one to finish). Where the
  placement homed the adapter (adapter_placement.py), half the score is being one of its homes, half the residency.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.policy.routing.views import RouteContext, Why, WorkerView, closeness, loads


class LoadScorer:
    name = "load"

    def score(self, workers: list[WorkerView], ctx: RouteContext) -> list[float]:
        ls = loads(workers)
        top = max(ls)
        return [1.0 if top <= 0 else 1.0 - x / top for x in ls]


# A pooled block is copied into the worker's cache (~10 us per 64 KiB block over shared memory) where computing
# it costs ~1 ms (16 tokens of prefill at ~0.06 ms each, bench preset): nearly a local hit, so load decides
# between a worker that holds the prefix and one whose host's pool does; a local hit still scores highest.
POOL_CREDIT = 0.9


def effective_blocks(worker: WorkerView, ctx: RouteContext) -> float:
    """Blocks of the prompt the worker need not compute: its own, plus POOL_CREDIT per block more in its pool."""
    local = ctx.cached_blocks.get(worker.worker_id, 0)
    pooled = ctx.pooled_blocks.get(worker.worker_id, 0)
    return min(local + POOL_CREDIT * max(pooled - local, 0), ctx.prompt_blocks)


class PrefixScorer:
    name = "prefix"

    def score(self, workers: list[WorkerView], ctx: RouteContext) -> list[float]:
        if ctx.prompt_blocks <= 0:
            return [0.0] * len(workers)
        return [effective_blocks(w, ctx) / ctx.prompt_blocks for w in workers]


AFFINITY = {"slot": 1.0, "host": 0.8, "free-slot": 0.6, "evict": 0.3, "blocked": 0.0}


def residency(worker: WorkerView, adapter: str) -> str:
    """Where an adapter stands on a worker: slot (in a compute slot), host (in memory, a slot to be had), free-slot
    (one read from disk into a free slot), evict (another adapter's idle slot must go), blocked (every slot is held
    by other adapters' running requests, by its last heartbeat and what was routed there since: the request would
    wait for one of them to finish)."""
    if adapter in worker.adapters:
        return "slot"
    held = set(worker.pinned_adapters) | worker.routed_adapters
    if worker.lora_slots and len(held - {adapter}) >= worker.lora_slots:
        return "blocked"
    if adapter in worker.host_adapters:
        return "host"
    return "free-slot" if worker.free_lora_slots > 0 else "evict"


class AdapterScorer:
    name = "adapter"

    def score(self, workers: list[WorkerView], ctx: RouteContext) -> list[float]:
        if not ctx.adapter:
            return [0.0] * len(workers)
        scores = [AFFINITY[residency(w, ctx.adapter)] for w in workers]
        if ctx.homes:  # a home of the adapter's counts half, residency the other half; never below residency alone
            scores = [max(s, 0.5 * s + 0.5) if w.worker_id in ctx.homes else s for s, w in zip(scores, workers)]
        return scores


SCORERS = {s.name: s for s in (LoadScorer, PrefixScorer, AdapterScorer)}


@dataclass(frozen=True)
class LoadGuard:
    abs_threshold: float = 1.0  # load units (see views.loads): a whole KV pool of outstanding work
    rel_threshold: float = 2.0  # max over min

    def imbalanced(self, workers: list[WorkerView]) -> bool:
        ls = loads(workers)
        hi, lo = max(ls), min(ls)
        return hi - lo > self.abs_threshold and hi > self.rel_threshold * lo


@dataclass
class WeightedPicker:
    scorers: list  # (scorer, weight) pairs
    guard: LoadGuard | None = None

    def pick(self, workers: list[WorkerView], ctx: RouteContext) -> tuple[WorkerView, Why]:
        """The best worker and why (weighted total and each score per worker, formatted when read)."""
        active = self.scorers
        guarded = self.guard is not None and self.guard.imbalanced(workers)
        if guarded:
            active = [(s, w) for s, w in self.scorers if s.name == "load"] or [(LoadScorer(), 1.0)]
        columns = [(s.name, weight, s.score(workers, ctx)) for s, weight in active]
        totals = [sum(weight * col[i] for _, weight, col in columns) for i in range(len(workers))]
        best = min(range(len(workers)), key=lambda i: (-totals[i], closeness(workers[i], ctx), workers[i].worker_id))
        return workers[best], Why(_scores_why, workers, totals, columns, guarded)


def _scores_why(workers: list[WorkerView], totals: list[float], columns: list, guarded: bool) -> str:
    why = "; ".join(f"{w.worker_id}={totals[i]:.3f}(" + ",".join(f"{n}={c[i]:.2f}" for n, _, c in columns) + ")"
                    for i, w in enumerate(workers))
    return ("load guard: " if guarded else "") + why
