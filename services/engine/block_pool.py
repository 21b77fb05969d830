"""The pool of KV block ids: reference counts, content hashes, and LRU eviction of cached blocks.

A block is *used* while its ref count is > 0; *cached* at ref count 0 with a content hash
(reusable by a later request with the same prefix until evicted, least recently freed first);
*free* otherwise. used + cached + free = total, always. allocate() returns None when short:
shortage is the scheduler's to resolve, not an error.

With events on (track_events()), the pool records ("stored", hash) when a block's content hash
is registered and ("evicted", hash) when a hashed block is reused or dropped: the feed workers
publish to the mesh's prefix index. A backlog beyond max_events is dropped and flagged, and the
consumer republishes the whole state (hashes()) instead.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.cached: OrderedDict[int, None] = OrderedDict()  # ref 0 with a hash, oldest first
        self.events: list[tuple[str, bytes]] | None = None  # None: not recording
        self.max_events = 0
        self.events_overflowed = False

    def track_events(self, max_events: int = 100_000) -> None:
        self.events, self.max_events = [], max_events

    def drain_events(self) -> tuple[list[tuple[str, bytes]], bool]:
        """The events since the last drain, and whether some were dropped (then republish hashes())."""
        out, overflowed = self.events or [], self.events_overflowed
        self.events, self.events_overflowed = ([] if self.events is not None else None), False
        return out, overflowed

    def hashes(self) -> list[bytes]:
        """Every content hash the pool holds now (used or cached)."""
        return list(self.by_hash)

    def _event(self, kind: str, block_hash: bytes) -> None:
        if self.events is None:
            return
        if len(self.events) >= self.max_events:
            self.events.clear()
            self.events_overflowed = True
        self.events.append((kind, block_hash))

    @property
    def num_available(self) -> int:
        """Blocks allocate() can hand out now (free plus evictable cached)."""
        return len(self.free_ids) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def allocate(self, n: int) -> list[int] | None:
        """n blocks with ref count 1, or None if fewer are available (nothing changes then)."""
        if n > self.num_available:
            return None
        out = [self._take() for _ in range(n)]
        for b in out:
            self.ref_count[b] = 1
        return out

    def _take(self) -> int:
        if self.free_ids:
            return self.free_ids.pop()
        block, _ = self.cached.popitem(last=False)
        del self.by_hash[self.block_hash[block]]
        self._event("evicted", self.block_hash[block])
        self.block_hash[block] = None
        return block

    def lookup(self, block_hash: bytes) -> int | None:
        return self.by_hash.get(block_hash)

    def acquire(self, block: int) -> None:
        """Take one more reference to a block found by lookup()."""
        if self.ref_count[block] == 0:
            del self.cached[block]
        self.ref_count[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each; the last blocks of a sequence become the first to evict."""
        for b in reversed(blocks):
            self.ref_count[b] -= 1
            if self.ref_count[b] < 0:
                raise AssertionError(f"block {b} released more often than acquired")
            if self.ref_count[b] == 0:
                if self.block_hash[b] is None:
                    self.free_ids.append(b)
                else:
                    self.cached[b] = None

    def register(self, block: int, block_hash: bytes) -> None:
        """Record a full block's content hash so later requests can reuse it (first holder wins)."""
        if self.block_hash[block] is None and block_hash not in self.by_hash:
            self.block_hash[block] = block_hash
            self.by_hash[block_hash] = block
            self._event("stored", block_hash)

    def counts(self) -> dict:
        free = len(self.free_ids)
        cached = len(self.cached)
        return {"used": self.num_blocks - free - cached, "cached": cached, "free": free, "total": self.num_blocks}

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (they become free); used blocks keep their hashes."""
        for b in self.cached:
            del self.by_hash[self.block_hash[b]]
            self._event("evicted", self.block_hash[b])
            self.block_hash[b] = None
            self.free_ids.append(b)
        self.cached.clear()
