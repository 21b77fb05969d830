"""One routing decision, I/O-free: the core that the router's servicer and the simulator both run.

The servicer (server.py) does the I/O around it: the live set from heartbeats, the prompt's block hashes
from the request, the Redis prefix index's answer for them. The simulator (sim/cluster.py) feeds the
same core from its own heartbeat-stale views and its simulated index. Everything between is here, once:

1. the filters (filters.py: role, block size, avoid, adapter) over the live workers;
2. the context the scorers read (views.RouteContext): each worker's longest cached prefix, the larger of
   what the index holds for its member and what was routed to it in the last seconds (recent.py); the
   prefix its host's kvstore pool holds, where that is longer and the worker takes blocks from the pool;
   the adapter with the workers placement homed it on; the topology the KV comes from;
3. the policy's choice (policies.py), then the commit: the in-flight charge, less the prompt tokens the
   chosen worker has cached (work it will not do), and the prompt recorded as routed there.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from services.common.members import POOL_MEMBER, worker_of
from services.policy.routing.filters import Need, candidates
from services.policy.routing.recent import RecentRoutes
from services.policy.routing.scoring import effective_blocks
from services.policy.routing.views import RouteContext, WorkerView

PREFIX_ROLES = ("prefill", "unified")  # roles that compute the prompt, where a cached prefix saves work


@dataclass(frozen=True)
class Prompt:
    """What routing knows of a prompt: its full blocks' hashes at one block size and, per prefix-index member
    (a worker's index_member, or a kvstore pool's POOL_MEMBER + host), the leading blocks it holds."""

    hashes: list
    held: dict = field(default_factory=dict)
    block_size: int = 0  # of the hashes (0: the first candidate's)


@dataclass
class Pick:
    worker: WorkerView
    why: object  # views.Why: formatted only when read
    cached_tokens: int  # prompt tokens the index or the recent routes say the worker holds
    context: RouteContext | None


def context(workers: list[WorkerView], prompt: Prompt, recent: RecentRoutes, adapter: str = "") -> RouteContext:
    """The prefix part of the scorers' context for `prompt` over `workers` (those at another block size are not
    comparable and get nothing)."""
    bs = prompt.block_size or workers[0].block_size
    recently = recent.longest(prompt.hashes)
    pools: dict[str, int] = {}  # host -> the prefix its kvstore pool holds
    for member, n in prompt.held.items():
        if member.startswith(POOL_MEMBER):
            host = worker_of(member)[len(POOL_MEMBER):]
            pools[host] = max(pools.get(host, 0), n)
    cached, pooled = {}, {}
    for w in workers:
        if w.block_size != bs:
            continue
        n = max(prompt.held.get(w.index_member, 0) if w.index_member else 0, recently.get(w.worker_id, 0))
        if n:
            cached[w.worker_id] = n
        if w.kv_pool and pools.get(w.host, 0) > n:
            pooled[w.worker_id] = pools[w.host]
    return RouteContext(len(prompt.hashes), cached, adapter, pooled)


class RouteDecider:
    """The router's decision for one role: a policy (with its in-flight charges) and the recent routes it
    shares with the other roles."""

    def __init__(self, role: str, policy, recent: RecentRoutes):
        self.role, self.policy, self.recent = role, policy, recent

    @property
    def wants_prompt(self) -> bool:
        """Whether pick() reads a Prompt (the caller may skip hashing and the index lookup otherwise)."""
        return self.policy.uses_prefix and self.role in PREFIX_ROLES

    def candidates(self, workers: list[WorkerView], need: Need) -> tuple[list[WorkerView], str]:
        """The filters' survivors, and the filter that left none ("" if some are left)."""
        return candidates(workers, need)

    def pick(self, workers: list[WorkerView], cost: int, adapter: str = "", prompt: Prompt | None = None,
             homes: frozenset = frozenset(), near: str = "") -> Pick:
        """Decide among `workers` (the filters' survivors, non-empty) and commit. cost: the request's tokens for
        this role; homes: the workers placement homed the adapter on; near: the topology its KV comes from."""
        ctx = None
        if prompt is not None and prompt.hashes and self.wants_prompt:
            ctx = context(workers, prompt, self.recent, adapter)
        if adapter:  # the LoRA affinity scorer reads the adapter and where placement homed it
            ctx = replace(ctx, adapter=adapter, homes=homes) if ctx else RouteContext(adapter=adapter, homes=homes)
        if near:
            ctx = replace(ctx, near=near) if ctx else RouteContext(near=near)
        worker, why = self.policy.select(workers, cost, ctx)
        cached = ctx.cached_blocks.get(worker.worker_id, 0) * worker.block_size if ctx else 0
        spared = int(effective_blocks(worker, ctx) * worker.block_size) if ctx else 0
        self.policy.on_routed(worker, max(cost - spared, 1), adapter)
        if ctx is not None and ctx.prompt_blocks:
            self.recent.record(prompt.hashes, worker.worker_id)
        return Pick(worker, why, cached, ctx)
