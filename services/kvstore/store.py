"""The KV transfer store: blocks keyed by transfer id, a byte budget with LRU eviction, a TTL.

A prefill worker puts a transfer's blocks as chunks finish; a decode worker gets them as they
land (get() waits on the transfer's condition) and releases the transfer once imported.
Eviction under the byte budget takes the least recently used *complete* transfers first; a
transfer never claimed is dropped after ttl_s. A released transfer id is remembered for ttl_s
(at most MAX_RELEASED ids): a Put or Get that arrives after the release (the straggler of a request
cancelled while its calls were in flight) is refused with NotFound instead of creating the transfer
again, where it would have held bytes until its TTL. Pure apart from asyncio conditions; the clock is
injected.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

from services.common.errors import CapacityExhausted, NotFound


@dataclass
class Transfer:
    created_s: float
    blocks: dict = field(default_factory=dict)  # index -> bytes
    meta: object = None  # the KVMeta message, set with the last chunk
    done: bool = False
    nbytes: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


MAX_RELEASED = 1_000_000  # released ids remembered at most (~100 MB at worst; the oldest are forgotten first)


class KVStore:
    def __init__(self, byte_budget: int, ttl_s: float, clock):
        self.byte_budget, self.ttl_s, self.clock = byte_budget, ttl_s, clock
        self.transfers: OrderedDict[str, Transfer] = OrderedDict()
        self.released: OrderedDict[str, float] = OrderedDict()  # transfer id -> when it was released
        self.nbytes = self.evicted = self.expired = 0

    def _get_or_create(self, transfer_id: str) -> Transfer:
        if transfer_id in self.released:
            raise NotFound(f"transfer {transfer_id!r} was released")
        t = self.transfers.get(transfer_id)
        if t is None:
            t = self.transfers[transfer_id] = Transfer(self.clock())
        self.transfers.move_to_end(transfer_id)
        return t

    async def put(self, transfer_id: str, index: int, data: bytes, meta=None, last: bool = False) -> None:
        t = self._get_or_create(transfer_id)
        if data:
            self._make_room(len(data), transfer_id)
            old = t.blocks.get(index)
            t.blocks[index] = data
            delta = len(data) - (len(old) if old else 0)
            t.nbytes += delta
            self.nbytes += delta
        if last:
            t.meta, t.done = meta, True
        async with t.changed:
            t.changed.notify_all()

    def _make_room(self, need: int, keep: str) -> None:
        for tid in list(self.transfers):
            if self.nbytes + need <= self.byte_budget:
                return
            if tid != keep and self.transfers[tid].done:
                self._drop(tid)
                self.evicted += 1
        if self.nbytes + need > self.byte_budget:
            raise CapacityExhausted(f"kvstore byte budget ({self.byte_budget} bytes) is full", retry_after_ms=100)

    async def get(self, transfer_id: str, timeout_s: float):
        """Yield (index, data) as blocks land, then (-1, meta) once the transfer is complete."""
        t = self._get_or_create(transfer_id)
        sent = 0
        while True:
            async with t.changed:
                await asyncio.wait_for(t.changed.wait_for(lambda: t.done or len(t.blocks) > sent or
                                                          transfer_id not in self.transfers), timeout_s)
            if transfer_id not in self.transfers:
                raise NotFound(f"transfer {transfer_id!r} was released or evicted")
            while sent in t.blocks:
                yield sent, t.blocks[sent]
                sent += 1
            if t.done and sent >= len(t.blocks):
                yield -1, t.meta
                return

    async def release(self, transfer_id: str) -> bool:
        """Drop the transfer (if held) and refuse it from now on; False if nothing was held."""
        self.released[transfer_id] = self.clock()
        self.released.move_to_end(transfer_id)
        while len(self.released) > MAX_RELEASED:
            self.released.popitem(last=False)
        t = self.transfers.get(transfer_id)
        if t is None:
            return False
        self._drop(transfer_id)
        async with t.changed:
            t.changed.notify_all()
        return True

    def _drop(self, transfer_id: str) -> None:
        t = self.transfers.pop(transfer_id)
        self.nbytes -= t.nbytes

    def expire(self) -> int:
        """Drop transfers older than ttl_s (never claimed) and forget older releases; returns how many transfers."""
        now = self.clock()
        old = [tid for tid, t in self.transfers.items() if now - t.created_s > self.ttl_s]
        for tid in old:
            self._drop(tid)
        self.expired += len(old)
        while self.released and now - next(iter(self.released.values())) > self.ttl_s:
            self.released.popitem(last=False)
        return len(old)
