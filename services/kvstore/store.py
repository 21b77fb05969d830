"""The KV pool: content-addressed blocks in arena slots, pinned by the transfers that use them.

A transfer is one request's KV on its way from a prefill engine to a decode engine (or from the pool
into any engine, a lease): an ordered list of blocks. reserve() gives each of its blocks a slot; a
block whose chained hash (adapter and isolation salt included, as in the engines' prefix caches) the
pool already holds is *present*: the transfer pins the held block and the writer skips it. The writer
then lands blocks (bytes written in place through shared memory, or handed over by the gRPC path)
with their checksum (XXH3-64); a landed hashed block enters the pool's index, where later transfers and leases
find it. get() yields a transfer's blocks in order as they land, then its metadata.

Reference counts: a block is pinned while any transfer holds it; release() unpins, and an unpinned
hashed block stays in the pool, least recently used first out (a transfer's tail before its head,
so what the pool holds of a chain stays a prefix of it), while an unhashed one (a partial last
block, or a duplicate of a block landed meanwhile) frees its slot at once. Eviction takes only
unpinned blocks: an in-flight transfer is never broken by memory pressure, and a reservation that
cannot be met is refused whole (RESOURCE_EXHAUSTED). A transfer never released is dropped after ttl_s;
a released id is remembered for ttl_s (MAX_RELEASED at most) so stragglers of a cancelled request do
not create it again. With events on, ("stored" | "evicted", hash) feed the mesh's prefix index.

Pure apart from asyncio conditions and the writes of the gRPC path into the arena; the clock is injected.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

from services.common.errors import CapacityExhausted, InvalidRequest, NotFound, Unavailable

MAX_RELEASED = 1_000_000  # released ids remembered at most (~100 MB at worst; the oldest are forgotten first)


@dataclass(eq=False)
class Block:
    slot: int
    hash: bytes | None  # None: not content-addressed (a partial block, or a duplicate)
    checksum: int = 0
    refs: int = 0
    landed: bool = False


@dataclass(eq=False)
class Transfer:
    created_s: float
    blocks: list | None  # Block per block index; None while a reader waits for the writer's reservation
    meta: object = None  # the KVMeta message, set with the last chunk
    done: bool = False
    failed: str = ""  # why the writer gave up
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    @property
    def landed(self) -> int:
        """Leading blocks that have landed."""
        n = 0
        for b in self.blocks or ():
            if not b.landed:
                break
            n += 1
        return n


class BlockStore:
    def __init__(self, slots: int, ttl_s: float, clock, arena=None):
        self.slots, self.ttl_s, self.clock, self.arena = slots, ttl_s, clock, arena
        self.free: list[int] = list(range(slots - 1, -1, -1))  # pop() hands out low slots first
        self.by_hash: dict[bytes, Block] = {}  # landed content-addressed blocks
        self.lru: OrderedDict[int, Block] = OrderedDict()  # unpinned hashed blocks by slot, oldest first
        self.transfers: dict[str, Transfer] = {}
        self.released: OrderedDict[str, float] = OrderedDict()  # transfer id -> when it was released
        self.evicted = self.expired = self.hits = 0
        self.events: list | None = None  # None: not recording

    # ---- accounting --------------------------------------------------------------------------------------

    @property
    def used_slots(self) -> int:
        return self.slots - len(self.free)

    @property
    def pinned_slots(self) -> int:
        return self.slots - len(self.free) - len(self.lru)

    def track_events(self) -> None:
        self.events = []

    def drain_events(self) -> tuple[list, bool]:
        out = self.events or []
        self.events = [] if self.events is not None else None
        return out, False

    def hashes(self) -> list[bytes]:
        return list(self.by_hash)

    def _event(self, kind: str, h: bytes) -> None:
        if self.events is not None:
            self.events.append((kind, h))

    # ---- writing -----------------------------------------------------------------------------------------

    def _new(self, transfer_id: str) -> Transfer:
        """A new transfer, or the one a reader is already waiting on (blocks None until reserved)."""
        if transfer_id in self.released:
            raise NotFound(f"transfer {transfer_id!r} was released")
        t = self.transfers.get(transfer_id)
        if t is not None and t.blocks is not None:
            raise InvalidRequest(f"transfer {transfer_id!r} is already reserved")
        return t or Transfer(self.clock(), None)

    def reserve(self, transfer_id: str, hashes: list, num_blocks: int) -> Transfer:
        """Slots for a transfer of num_blocks blocks, the first len(hashes) of them content-addressed; blocks the
        pool holds are pinned as they are (present). All or nothing."""
        if len(hashes) > num_blocks or num_blocks < 0:
            raise InvalidRequest(f"{len(hashes)} block hashes for a transfer of {num_blocks} blocks")
        if num_blocks > self.slots:
            raise CapacityExhausted(f"a transfer of {num_blocks} blocks exceeds the kvstore's {self.slots}",
                                    retry_after_ms=60_000)
        t = self._new(transfer_id)
        held = [self.by_hash.get(h) for h in hashes] + [None] * (num_blocks - len(hashes))
        need = sum(b is None for b in held)
        reusable = sum(1 for b in held if b is not None and b.refs == 0)
        if need > len(self.free) + len(self.lru) - reusable:
            raise CapacityExhausted(f"kvstore is full: {need} free blocks needed, {len(self.free) + len(self.lru)} "
                                    f"free or evictable of {self.slots} ({self.pinned_slots} pinned by transfers)",
                                    retry_after_ms=100)
        for b in held:
            if b is not None:
                self._pin(b)
        for i, b in enumerate(held):
            if b is None:
                held[i] = Block(self._take(), hashes[i] if i < len(hashes) else None, refs=1)
            else:
                self.hits += 1
        t.blocks = held
        self.transfers[transfer_id] = t
        self._notify_soon(t)
        return t

    @staticmethod
    def _notify_soon(t: Transfer) -> None:
        """Wake a reader waiting on t (from synchronous code: the notification runs on the loop next)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop, so no reader waiting
        loop.create_task(BlockStore._changed(t))

    def _pin(self, b: Block) -> None:
        if b.refs == 0 and b.hash is not None:
            del self.lru[b.slot]
        b.refs += 1

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        slot, b = self.lru.popitem(last=False)
        del self.by_hash[b.hash]
        self._event("evicted", b.hash)
        self.evicted += 1
        return slot

    def transfer(self, transfer_id: str) -> Transfer:
        t = self.transfers.get(transfer_id)
        if t is None or t.blocks is None:
            was = "released" if transfer_id in self.released else "never reserved"
            raise NotFound(f"transfer {transfer_id!r} was {was} (or it expired)")
        return t

    async def land(self, transfer_id: str, first: int, checksums: list, data: bytes | memoryview = b"") -> int:
        """Blocks [first, first + len(checksums)) are written: in place (shared memory; data empty) or given as
        data, copied here into their slots. Returns the bytes landed."""
        t = self.transfer(transfer_id)
        count = len(checksums)
        if first < 0 or first + count > len(t.blocks):
            raise InvalidRequest(f"blocks {first}..{first + count} outside transfer {transfer_id!r} of {len(t.blocks)}")
        size = self.arena.slot_bytes if self.arena is not None else 0
        if data and len(data) != count * size:
            raise InvalidRequest(f"{len(data)} bytes for {count} blocks of {size}")
        for i, crc in enumerate(checksums):
            b = t.blocks[first + i]
            if b.landed:
                continue  # present (or landed twice): the pool's copy stands
            if data:
                self.arena.slot(b.slot)[:] = data[i * size:(i + 1) * size]
            b.checksum, b.landed = crc, True
            if b.hash is not None:
                if b.hash in self.by_hash:
                    b.hash = None  # another transfer landed the same block first: this copy stays private
                else:
                    self.by_hash[b.hash] = b
                    self._event("stored", b.hash)
        await self._changed(t)
        return count * size

    async def finish(self, transfer_id: str, meta) -> None:
        t = self.transfer(transfer_id)
        t.meta, t.done = meta, True
        await self._changed(t)

    async def fail(self, transfer_id: str, why: str) -> None:
        """The writer gave up (its stream broke): readers hear it at once instead of waiting for their timeout."""
        t = self.transfers.get(transfer_id)
        if t is not None and not t.done:
            t.failed = why
            await self._changed(t)

    @staticmethod
    async def _changed(t: Transfer) -> None:
        async with t.changed:
            t.changed.notify_all()

    # ---- reading -----------------------------------------------------------------------------------------

    def acquire(self, lease_id: str, hashes: list, start: int) -> Transfer | None:
        """Pin the pool's blocks of hashes[start:] as far as it holds them without a gap, as a complete transfer
        (a lease) read with get() and ended with release(); None when it holds not even the first."""
        run = []
        for h in hashes[start:]:
            b = self.by_hash.get(h)
            if b is None:
                break
            run.append(b)
        if not run:
            return None
        t = self._new(lease_id)
        for b in run:
            self._pin(b)
        self.hits += len(run)
        t.blocks, t.done = run, True
        self.transfers[lease_id] = t
        return t

    async def get(self, transfer_id: str, timeout_s: float):
        """Yield (first, blocks) runs as they land, in order, then (-1, meta) once the transfer is complete. A
        transfer not reserved yet is waited for (the decode side may ask before the prefill side reserves)."""
        t = self.transfers.get(transfer_id)
        if t is None:
            t = self.transfers[transfer_id] = self._new(transfer_id)
        sent = 0
        while True:
            try:
                async with t.changed:
                    await asyncio.wait_for(t.changed.wait_for(
                        lambda: t.done or t.failed or t.landed > sent or transfer_id not in self.transfers), timeout_s)
            except TimeoutError:
                raise Unavailable(f"transfer {transfer_id!r}: nothing landed for {timeout_s:g} s") from None
            if transfer_id not in self.transfers:
                raise NotFound(f"transfer {transfer_id!r} was released or expired")
            if t.failed:
                raise Unavailable(f"transfer {transfer_id!r} failed: {t.failed}")
            landed = t.landed
            if landed > sent:
                yield sent, t.blocks[sent:landed]
                sent = landed
            if t.done and sent >= len(t.blocks or ()):
                yield -1, t.meta
                return

    # ---- ending ------------------------------------------------------------------------------------------

    async def abandon(self, transfer_id: str) -> bool:
        """The writer is gone: release the transfer (its readers hear NOT_FOUND at once, a later reader too) unless it
        is complete, whose reader may be copying its slots right now and releases it once done; False then."""
        t = self.transfers.get(transfer_id)
        if t is not None and t.done:
            return False
        return await self.release(transfer_id)

    async def release(self, transfer_id: str) -> bool:
        """Unpin the transfer's blocks (if held) and refuse its id from now on; False if nothing was held."""
        self.released[transfer_id] = self.clock()
        self.released.move_to_end(transfer_id)
        while len(self.released) > MAX_RELEASED:
            self.released.popitem(last=False)
        t = self.transfers.pop(transfer_id, None)
        if t is None:
            return False
        self._unpin(t)
        await self._changed(t)
        return True

    def _unpin(self, t: Transfer) -> None:
        for b in reversed(t.blocks or ()):  # the tail becomes the first to evict
            b.refs -= 1
            if b.refs:
                continue
            if b.hash is not None and b.landed:
                self.lru[b.slot] = b
            else:
                if b.hash is not None:
                    b.hash = None  # reserved, never landed: not in the index
                self.free.append(b.slot)

    def expire(self) -> int:
        """Drop transfers older than ttl_s (never released) and forget older releases; returns how many transfers."""
        now = self.clock()
        old = [tid for tid, t in self.transfers.items() if now - t.created_s > self.ttl_s]
        for tid in old:
            t = self.transfers.pop(tid)
            self._unpin(t)
            self._notify_soon(t)  # a reader still waiting hears NotFound now, not at its timeout
        self.expired += len(old)
        while self.released and now - next(iter(self.released.values())) > self.ttl_s:
            self.released.popitem(last=False)
        return len(old)

    def check_integrity(self) -> None:
        """Ref counts equal transfer references; every slot is free, unpinned in the pool, or pinned."""
        refs: dict[int, int] = {}
        for t in self.transfers.values():
            for b in t.blocks or ():
                refs[b.slot] = refs.get(b.slot, 0) + 1
        free, lru = set(self.free), set(self.lru)
        assert len(free) == len(self.free), "a slot is free twice"
        assert not free & lru and not free & set(refs) and not lru & set(refs), "a slot is in two states"
        assert len(free) + len(lru) + len(refs) == self.slots, "a slot is lost"
        for b in self.by_hash.values():
            assert b.landed and b.refs == refs.get(b.slot, 0), "an indexed block's count differs from its pins"
