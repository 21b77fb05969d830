"""Per-request block tables over the BlockPool, and prefix-cache lookup by chained block hashes.

Blocks are allocated as a sequence grows, never reserved for its maximum length. A full block
whose tokens are all computed is registered under hash(parent, tokens, adapter + salt), so a
later request with the same prefix in the same isolation domain reuses it.
"""

from __future__ import annotations

from services.common.block_hash import ROOT, extra_keys, hash_block
from services.engine.block_pool import BlockPool
from services.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = True):
        self.pool, self.block_size, self.prefix_caching = pool, block_size, enable_prefix_caching
        self.tables: dict[str, list[int]] = {}
        self.hashes: dict[str, list[bytes]] = {}  # chained hashes of the request's full blocks, as far as known
        self.registered: dict[str, int] = {}  # how many of the request's blocks are registered

    def block_table(self, req: Request) -> list[int]:
        return self.tables.get(req.req_id, [])

    def block_hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """The first num_blocks chained hashes of req's tokens (computed once, then extended)."""
        known = self.hashes.setdefault(req.req_id, [])
        bs, extra = self.block_size, extra_keys(req.adapter, req.cache_salt)
        while len(known) < num_blocks:
            i = len(known)
            known.append(hash_block(known[-1] if known else ROOT, req.tokens[i * bs:(i + 1) * bs], extra))
        return known[:num_blocks]

    def cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks matching req's leading full blocks; the last token is always left to compute."""
        if not self.prefix_caching:
            return []
        out = []
        for h in self.block_hashes(req, (req.num_tokens - 1) // self.block_size):
            block = self.pool.lookup(h)
            if block is None:
                break
            out.append(block)
        return out

    def allocate(self, req: Request, num_tokens: int, prefix: list[int] = ()) -> bool:
        """Grow req's table to cover num_tokens, taking `prefix` (cached blocks) first. False if short."""
        table = self.tables.get(req.req_id)
        if table is not None and not prefix and -(-num_tokens // self.block_size) <= len(table):
            return True  # covered already (most decode steps)
        table = self.tables.setdefault(req.req_id, [])
        need = -(-num_tokens // self.block_size) - len(table) - len(prefix)
        revived = sum(1 for b in prefix if self.pool.ref_count[b] == 0) if prefix else 0
        if need + revived > self.pool.num_available:
            if not table:
                del self.tables[req.req_id]
            return False
        for b in prefix:
            self.pool.acquire(b)
        table.extend(prefix)
        if need > 0:
            table.extend(self.pool.allocate(need))
        self.registered[req.req_id] = max(self.registered.get(req.req_id, 0), len(prefix))
        return True

    def commit(self, req: Request) -> None:
        """Register every block whose tokens are now all computed."""
        if not self.prefix_caching:
            return
        full = req.num_computed // self.block_size
        done = self.registered.get(req.req_id, 0)
        if full > done:
            table = self.tables[req.req_id]
            for i, h in enumerate(self.block_hashes(req, full)[done:], start=done):
                self.pool.register(table[i], h)
            self.registered[req.req_id] = full

    def free(self, req: Request) -> None:
        """Release req's blocks (hashed ones stay cached) and forget its table."""
        self.pool.release(self.tables.pop(req.req_id, []))
        self.registered.pop(req.req_id, None)

    def forget(self, req: Request) -> None:
        """Drop everything kept for a request that has ended."""
        self.free(req)
        self.hashes.pop(req.req_id, None)

    def check_integrity(self) -> None:
        """Ref counts equal block-table references; no block both free and referenced."""
        refs = [0] * self.pool.num_blocks
        for table in self.tables.values():
            for b in table:
                refs[b] += 1
        assert refs == self.pool.ref_count, "ref counts differ from block-table references"
        free, cached = set(self.pool.free_ids), set(self.pool.cached)
        assert len(free) == len(self.pool.free_ids), "a block is on the free list twice"
        assert not free & cached, "a block is both free and cached"
        assert all(refs[b] == 0 for b in free | cached), "a referenced block is free or cached"
        assert all(self.pool.block_hash[b] is not None for b in cached), "a cached block has no hash"
        c = self.pool.counts()
        assert c["used"] + c["cached"] + c["free"] == c["total"]
        assert c["used"] == sum(1 for r in refs if r > 0)
