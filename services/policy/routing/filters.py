"""The Filter stage of routing (Filter -> Scorer -> Picker): which live workers may take a request.

Each filter keeps a subset of the candidates for one Need (role, block size, adapter); the router
applies them in order and answers UNAVAILABLE naming the filter that left nobody.

- RoleFilter: workers of the role this hop needs (prefill, decode or unified).
- BlockSizeFilter: when the request's KV comes from elsewhere (the decode hop after a prefill),
  workers with that block size: KV blocks move as whole blocks and are not re-blocked.
- AvoidFilter: a resumed request (its worker failed mid-stream) avoids the workers that failed it while
  another can take it (the failed one may still look live until its heartbeats are missed).
- AdapterFilter: with a LoRA adapter asked for, the workers where it is registered (they load it on
  demand; where it sits in memory is the adapter scorer's business).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.policy.routing.views import WorkerView


@dataclass(frozen=True)
class Need:
    role: str  # prefill | decode | unified
    block_size: int = 0  # the block size the KV arrives in (0 = any)
    adapter: str = ""  # the request's LoRA adapter ("" = base model)
    avoid: frozenset = frozenset()  # addresses that failed this request (kept only when nobody else is left)


class RoleFilter:
    name = "role"

    def keep(self, workers: list[WorkerView], need: Need) -> list[WorkerView]:
        return [w for w in workers if w.role == need.role]


class BlockSizeFilter:
    name = "block-size"

    def keep(self, workers: list[WorkerView], need: Need) -> list[WorkerView]:
        return workers if not need.block_size else [w for w in workers if w.block_size == need.block_size]


class AdapterFilter:
    name = "adapter"

    def keep(self, workers: list[WorkerView], need: Need) -> list[WorkerView]:
        if not need.adapter:
            return workers
        return [w for w in workers if need.adapter in w.known_adapters]


class AvoidFilter:
    name = "avoid"

    def keep(self, workers: list[WorkerView], need: Need) -> list[WorkerView]:
        return [w for w in workers if w.address not in need.avoid] or workers


FILTERS = (RoleFilter(), BlockSizeFilter(), AvoidFilter(), AdapterFilter())


def candidates(workers: list[WorkerView], need: Need, filters=FILTERS) -> tuple[list[WorkerView], str]:
    """The workers every filter keeps, and the name of the filter that emptied the set ("" if none did)."""
    for f in filters:
        workers = f.keep(workers, need)
        if not workers:
            return [], f.name
    return workers, ""
