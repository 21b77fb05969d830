"""The kvstore's transfer store: streaming get, byte budget with LRU eviction, TTL."""

import asyncio

import pytest

from services.common.errors import CapacityExhausted, NotFound
from services.kvstore.store import KVStore
from tests.support.fakes import Clock


def test_get_streams_blocks_as_they_land():
    async def scenario():
        store = KVStore(10_000, 60, Clock())
        got = []

        async def reader():
            async for index, data in store.get("t", timeout_s=5):
                got.append((index, data))

        task = asyncio.create_task(reader())
        await store.put("t", 0, b"a" * 10)
        await asyncio.sleep(0)
        await store.put("t", 1, b"b" * 10)
        await store.put("t", -1, b"", meta="META", last=True)
        await task
        return got

    assert asyncio.run(scenario()) == [(0, b"a" * 10), (1, b"b" * 10), (-1, "META")]


def test_budget_evicts_complete_transfers_lru_and_refuses_when_full():
    async def scenario():
        store = KVStore(100, 60, Clock())
        await store.put("old", 0, b"x" * 60, meta="m", last=True)
        await store.put("new", 0, b"y" * 60)
        assert "old" not in store.transfers and store.evicted == 1
        with pytest.raises(CapacityExhausted):
            await store.put("new", 1, b"z" * 60)  # only incomplete transfers left: nothing to evict
        assert await store.release("new") and store.nbytes == 0

    asyncio.run(scenario())


def test_unclaimed_transfers_expire():
    async def scenario():
        clock = Clock()
        store = KVStore(1000, ttl_s=5, clock=clock)
        await store.put("t", 0, b"x")
        clock.now = 6
        assert store.expire() == 1 and store.nbytes == 0 and store.expired == 1

    asyncio.run(scenario())


def test_get_of_released_transfer_is_not_found():
    async def scenario():
        store = KVStore(1000, 60, Clock())
        await store.put("t", 0, b"x")

        async def read():
            return [x async for x in store.get("t", timeout_s=5)]

        task = asyncio.create_task(read())
        await asyncio.sleep(0.01)
        await store.release("t")
        with pytest.raises(NotFound):
            await task

    asyncio.run(scenario())


def test_a_released_transfer_is_not_created_again_by_stragglers():
    """A cancelled request's Get or Put that lands after the gateway released its transfer must not bring it
    back (it would hold its bytes until the TTL); the memory of releases itself expires with the TTL."""
    async def scenario():
        clock = Clock()
        store = KVStore(1000, ttl_s=5, clock=clock)
        assert not await store.release("t")  # released before anything arrived
        with pytest.raises(NotFound):
            await store.put("t", 0, b"x")
        with pytest.raises(NotFound):
            [x async for x in store.get("t", timeout_s=1)]
        assert "t" not in store.transfers and store.nbytes == 0
        clock.now = 6
        store.expire()
        assert not store.released
        await store.put("t", 0, b"x")  # long forgotten: an id is an id again

    asyncio.run(scenario())
