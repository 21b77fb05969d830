"""KV in and out of one engine: exports for a handoff, staged imports, the mesh's KV pool, the prefix index's events.

A sequence prefilled in one engine continues decoding in another with identical output: export_kv() gives a
running request's computed KV (kv_blocks() and read_blocks_into() give its blocks in pieces as they fill), and
the receiving engine imports it whole (import_whole(), through LLMEngine.add(spec, kv=...)) or staged:
begin_import() reserves the blocks, import_blocks() writes them as they land, end_import() checks the result
and joins the request to the running batch. Blocks from the mesh's KV pool (the kvstore) join the prefix cache
when their request is admitted (admit_pooled(), the scheduler's before_admit hook; import_cached()), so that
the request finds them as its prefix. The prefix index (Redis) learns what the cache holds from
block_events() and cached_hashes().

The engine owns the requests, the scheduler and the caches; this part reads and writes them through their own
methods and keeps no state of its own but the count of pooled blocks imported.
"""

from __future__ import annotations

from services.common.errors import CapacityExhausted, InvalidRequest, NotFound
from services.common.request import RequestSpec
from services.engine.kv_export import KVExport
from services.engine.kv_manager import KVCacheManager
from services.engine.request import Request, Status


class KVTransfer:
    def __init__(self, requests: dict, scheduler, kv: KVCacheManager, blocks, dtype: str, block_bytes: int, lora,
                 new_request):
        """requests: the engine's live requests by id (shared, not copied); blocks: the KV blocks' bytes (read(b) ->
        bytes, read_into(b, writable buffer), write(b, buffer); attention.TensorBlocks, or the mock engine's);
        dtype: the name of the KV's element type; lora: its AdapterResidency or None; new_request(spec): the engine's
        validated Request for a spec."""
        self.requests, self.scheduler, self.kv, self.blocks = requests, scheduler, kv, blocks
        self.dtype, self.block_bytes, self.lora, self.new_request = dtype, block_bytes, lora, new_request
        self.pooled_blocks = 0  # blocks imported from the mesh's KV pool, since start

    # ---- out: a running request's KV ----------------------------------------------------------

    def export_kv(self, req_id: str, first_block: int = 0) -> KVExport:
        """The computed KV of a running request from first_block on, with what is needed to continue it."""
        req = self._running(req_id)
        return KVExport(
            token_ids=list(req.tokens), num_prompt=req.num_prompt, num_computed=req.num_computed,
            block_size=self.kv.block_size, dtype=self.dtype,
            blocks=self.kv_blocks(req_id, first_block, -(-req.num_computed // self.kv.block_size)),
            sample_seed=req.sample_seed)

    def kv_blocks(self, req_id: str, start: int, end: int) -> list[bytes]:
        """Raw bytes of blocks [start, end) of a running request's table."""
        table = self.kv.block_table(self._running(req_id))
        return [self.blocks.read(b) for b in table[start:end]]

    def read_blocks_into(self, req_id: str, start: int, outs: list) -> None:
        """Blocks [start, start + len(outs)) of a running request's table, each copied into a writable buffer of
        its size (an arena slot)."""
        table = self.kv.block_table(self._running(req_id))
        for block, out in zip(table[start:start + len(outs)], outs):
            self.blocks.read_into(block, out)

    def running_progress(self, req_id: str) -> tuple[int, int] | None:
        """(tokens sampled, full computed blocks) of a running request; None while queued, preempted or gone."""
        req = self.requests.get(req_id)
        if req is None or req.status is not Status.RUNNING:
            return None
        return req.num_output, req.num_computed // self.kv.block_size

    # ---- in: imports, whole or staged -----------------------------------------------------------

    def kv_geometry(self) -> tuple[int, int]:
        """(tokens per block, bytes per block)."""
        return self.kv.block_size, self.block_bytes

    def split_blocks(self, data) -> list:
        """Consecutive raw blocks as one per block (InvalidRequest unless whole blocks)."""
        size = self.block_bytes
        if len(data) % size:
            raise InvalidRequest(f"imported KV data of {len(data)} bytes is not a whole number of {size}-byte blocks")
        return [data[i:i + size] for i in range(0, len(data), size)]

    def import_whole(self, req: Request, kv: KVExport) -> None:
        """Import a whole export at once into a new request: begin, write every block, end."""
        if kv.block_size != self.kv.block_size:
            raise InvalidRequest(f"KV block size {kv.block_size} differs from this engine's {self.kv.block_size}")
        self._begin(req, kv.num_computed)
        try:
            self._write_blocks(req, 0, kv.blocks)
            self._end(req, kv.token_ids, kv.num_prompt, kv.num_computed, len(kv.blocks), kv.sample_seed)
        except InvalidRequest:
            self.scheduler.unpin(req)
            self.kv.forget(req)
            raise

    def begin_import(self, spec: RequestSpec) -> Request:
        """Reserve blocks for a prompt whose KV will arrive block by block (import_blocks, then end_import)."""
        req = self.new_request(spec)
        self._begin(req, req.num_prompt)
        self.requests[req.req_id] = req
        return req

    def import_blocks(self, req_id: str, first: int, data) -> int:
        """Write consecutive raw blocks (one buffer, or a list of one per block) from index `first`; returns how
        many were written."""
        req = self._receiving(req_id)
        blocks = data if isinstance(data, list) else self.split_blocks(data)
        self._write_blocks(req, first, blocks)
        return len(blocks)

    def end_import(self, req_id: str, token_ids: list, num_prompt: int, num_computed: int, num_blocks: int,
                   sample_seed: int) -> Request:
        """Check the finished import and join the request to the running batch (sampling on with sample_seed)."""
        req = self._receiving(req_id)
        self._end(req, token_ids, num_prompt, num_computed, num_blocks, sample_seed)
        return req

    def _begin(self, req: Request, num_tokens: int) -> None:
        live = len(self.scheduler.running) + sum(r.status is Status.RECEIVING for r in self.requests.values())
        if live >= self.scheduler.max_num_seqs:
            raise CapacityExhausted("no free sequence slot for imported KV", retry_after_ms=50)
        if req.adapter:
            req.lora_slot = self.lora.claim(req.adapter)
            if req.lora_slot is None:
                raise CapacityExhausted(f"adapter {req.adapter!r} is not in a slot yet (being read, or every slot is "
                                        f"in use)", retry_after_ms=50)
        if not self.kv.allocate(req, num_tokens):
            self.scheduler.unpin(req)
            raise CapacityExhausted("not enough free KV blocks for imported KV", retry_after_ms=50)
        req.status = Status.RECEIVING

    def _write_blocks(self, req: Request, first: int, blocks: list) -> None:
        table = self.kv.block_table(req)
        if first + len(blocks) > len(table):
            raise InvalidRequest(f"imported KV has more blocks than its {len(table)} reserved")
        try:
            for block, data in zip(table[first:], blocks):
                self.blocks.write(block, data)
        except (RuntimeError, ValueError) as e:
            raise InvalidRequest(f"imported KV block is malformed: {e}") from None

    def _end(self, req: Request, token_ids: list, num_prompt: int, num_computed: int, num_blocks: int,
             sample_seed: int) -> None:
        if list(token_ids[:num_prompt]) != req.prompt_token_ids or not num_prompt <= num_computed < len(token_ids):
            raise InvalidRequest("imported KV belongs to a different prompt")
        if num_blocks != len(self.kv.block_table(req)) or -(-num_computed // self.kv.block_size) != num_blocks:
            raise InvalidRequest(f"imported KV has {num_blocks} blocks for {num_computed} tokens")
        req.tokens, req.sample_seed = list(token_ids), sample_seed
        req.num_computed, req.status = num_computed, Status.RUNNING
        self.kv.commit(req)
        self.scheduler.add_running(req)

    def _running(self, req_id: str) -> Request:
        return self._in_state(req_id, Status.RUNNING, "running")

    def _receiving(self, req_id: str) -> Request:
        return self._in_state(req_id, Status.RECEIVING, "importing KV")

    def _in_state(self, req_id: str, status: Status, doing: str) -> Request:
        req = self.requests.get(req_id)
        if req is None or req.status is not status:
            raise NotFound(f"request {req_id!r} is not {doing} here")
        return req

    # ---- the mesh's KV pool into the prefix cache -------------------------------------------------

    def cached_blocks(self, hashes: list) -> int:
        """How many of the leading hashes the prefix cache holds here."""
        pool = self.kv.pool
        n = 0
        while n < len(hashes) and self.kv.prefix_caching and pool.lookup(hashes[n]) is not None:
            n += 1
        return n

    def admit_pooled(self, req: Request) -> None:
        """The scheduler's before_admit hook: import a waiting request's pooled blocks; done once they are in (or
        no longer useful). Short of room, they wait for the next try (the request could not be admitted then
        either)."""
        hashes, start, blocks = req.pooled
        have = self.cached_blocks(hashes)
        if not self.kv.prefix_caching or have < start or have >= start + len(blocks):
            req.pooled = None
            return
        imported = self.import_cached(hashes, start, blocks)
        self.pooled_blocks += imported
        if have + imported >= start + len(blocks):
            req.pooled = None

    def import_cached(self, hashes: list, start: int, blocks: list) -> int:
        """Put raw blocks for hashes[start:start + len(blocks)] into the prefix cache (from the mesh's KV pool),
        behind hashes[:start], which this cache must hold (else nothing happens: a chain with a gap serves no
        prefix). Blocks it holds already are skipped. The imported blocks are cached, not used: the request added
        next finds them as its prefix. Short of room, the leading blocks that fit are imported. Returns how many
        were imported."""
        if not self.kv.prefix_caching:
            return 0
        have = self.cached_blocks(hashes[:start + len(blocks)])
        if have < start or have >= start + len(blocks):
            return 0
        pool = self.kv.pool
        held = [pool.lookup(h) for h in hashes[:have]]
        todo = list(zip(hashes[have:start + len(blocks)], blocks[have - start:]))
        revived = sum(1 for b in held if pool.ref_count[b] == 0)
        todo = todo[:max(pool.num_available - revived, 0)]
        if not todo:
            return 0
        for b in held:
            pool.acquire(b)  # so that allocating the new blocks cannot evict the chain they extend
        new = pool.allocate(len(todo))
        try:
            for block, (h, data) in zip(new, todo):
                self.blocks.write(block, data)
                pool.register(block, h)
        finally:
            pool.release(held + new)  # the tail is the first to evict, as for a finished request
        return len(todo)

    # ---- the prefix cache's content, for the prefix index --------------------------------------

    def track_block_events(self) -> None:
        """Start recording stored/evicted block hashes (drained by block_events)."""
        self.kv.pool.track_events()

    def block_events(self) -> tuple[list[tuple[str, bytes]], bool]:
        """The ("stored" | "evicted", hash) events since the last call, and whether some were dropped."""
        return self.kv.pool.drain_events()

    def cached_hashes(self) -> list[bytes]:
        """Every block hash the KV pool holds now (for a full republish)."""
        return self.kv.pool.hashes()
