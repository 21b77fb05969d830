"""The Redis prefix index against a real Redis: publish, evict, liveness, restart, one-round-trip lookup."""

import asyncio

import pytest

from services.common.block_hash import extra_keys, hash_blocks
from services.common.members import worker_of
from services.common.prefix_index import LIVE_TTL_S, IndexPublisher, PrefixIndex, connect, connect_lookup
from services.engine.block_pool import BlockPool
from tests.support.redis_server import RedisServer

BS = 4


@pytest.fixture
def server():
    s = RedisServer().start()
    yield s
    s.kill()


def hashes(tokens, salt=""):
    return hash_blocks(tokens, BS, extra_keys("", salt))


class Holder:
    """A worker's pool of content hashes, fed to a publisher as its block pool would."""

    def __init__(self, client, worker_id):
        self.pool = BlockPool(64)
        self.pool.track_events()
        self.pub = IndexPublisher(client, worker_id)

    def store(self, hs):
        blocks = self.pool.allocate(len(hs))
        for b, h in zip(blocks, hs):
            self.pool.register(b, h)
        self.pool.release(blocks)  # cached: still held, evictable

    async def snapshot(self):
        return self.pool.hashes()

    async def publish(self):
        self.pub.add(*self.pool.drain_events())
        assert await self.pub.flush(self.snapshot)


def run(coro):
    return asyncio.run(coro)


def test_entries_appear_on_store_and_vanish_on_evict(server):
    async def go():
        client = connect(server.url)
        a, b = Holder(client, "a"), Holder(client, "b")
        index = PrefixIndex(connect_lookup(server.url))
        prompt = list(range(100, 132))  # 8 blocks
        hs = hashes(prompt)
        a.store(hs[:6])
        b.store(hs[:2])
        await a.publish()
        await b.publish()
        found = index.longest_prefix(hs)
        assert {worker_of(m): n for m, n in found.items()} == {"a": 6, "b": 2}
        # a different isolation salt shares nothing
        assert index.longest_prefix(hashes(prompt, salt="tenant-x")) == {}
        # evict everything a holds: its blocks are reused for other content
        a.pool.allocate(64)
        await a.publish()
        found = index.longest_prefix(hs)
        assert {worker_of(m): n for m, n in found.items()} == {"b": 2}
        await client.aclose()
    run(go())


@pytest.mark.parametrize("held", [0, 1, 2, 5, 9, 10])
def test_longest_prefix_at_every_depth(server, held):
    async def go():
        client = connect(server.url)
        a = Holder(client, "a")
        hs = hashes(list(range(40)))  # 10 blocks
        a.store(hs[:held])
        await a.publish()
        found = PrefixIndex(connect_lookup(server.url)).longest_prefix(hs)
        assert {worker_of(m): n for m, n in found.items()} == ({"a": held} if held else {})
        await client.aclose()
    run(go())


def test_dead_worker_stops_counting_when_its_live_key_expires(server):
    async def go():
        client = connect(server.url)
        a = Holder(client, "a")
        hs = hashes(list(range(16)))
        a.store(hs)
        await a.publish()
        ttl = await client.ttl(a.pub.live_key)
        assert 0 < ttl <= LIVE_TTL_S <= 10  # Redis drops the key within the bound unless refreshed
        assert PrefixIndex(connect_lookup(server.url)).longest_prefix(hs)
        await client.delete(a.pub.live_key)  # what expiry does once the worker stops refreshing
        assert PrefixIndex(connect_lookup(server.url)).longest_prefix(hs) == {}
        await client.aclose()
    run(go())


def test_withdraw_on_clean_stop_and_a_restart_gets_a_new_epoch(server):
    async def go():
        client = connect(server.url)
        a = Holder(client, "a")
        hs = hashes(list(range(16)))
        a.store(hs)
        await a.publish()
        await a.pub.withdraw()
        assert PrefixIndex(connect_lookup(server.url)).longest_prefix(hs) == {}
        restarted = Holder(client, "a")  # same worker id, empty cache
        await restarted.publish()
        assert restarted.pub.member != a.pub.member
        assert PrefixIndex(connect_lookup(server.url)).longest_prefix(hs) == {}
        await client.aclose()
    run(go())


def test_republish_after_redis_restart(server):
    async def go():
        client = connect(server.url)
        a = Holder(client, "a")
        hs = hashes(list(range(16)))
        a.store(hs)
        await a.publish()
        index = PrefixIndex(connect_lookup(server.url))
        assert index.longest_prefix(hs)
        server.kill()
        assert await a.pub.keepalive(a.snapshot) is False
        assert index.longest_prefix(hs) == {} and index.degraded
        server.start()  # same port, empty
        a.pub.backoff.succeeded()  # skip the wait: the retry is due
        index.backoff.succeeded()
        assert await a.pub.keepalive(a.snapshot)
        assert a.pub.published_blocks == len(hs)
        found = index.longest_prefix(hs)
        assert not index.degraded and {worker_of(m): n for m, n in found.items()} == {"a": len(hs)}
        await client.aclose()
    run(go())


def test_keepalive_notices_a_lost_live_key_and_republishes(server):
    async def go():
        client = connect(server.url)
        a = Holder(client, "a")
        hs = hashes(list(range(16)))
        a.store(hs)
        await a.publish()
        await client.flushall()  # Redis lost its data without the connection breaking
        assert await a.pub.keepalive(a.snapshot)
        found = PrefixIndex(connect_lookup(server.url)).longest_prefix(hs)
        assert {worker_of(m): n for m, n in found.items()} == {"a": len(hs)}
        await client.aclose()
    run(go())


def test_events_are_pipelined_not_one_round_trip_each(server):
    async def go():
        client = connect(server.url)
        a = Holder(client, "a")
        await a.publish()  # the initial (empty) republish
        before = int((await client.info("stats"))["total_connections_received"])
        calls = []
        original = client.pipeline

        def counting_pipeline(*args, **kw):
            calls.append(1)
            return original(*args, **kw)

        client.pipeline = counting_pipeline
        hs = hashes(list(range(4 * 60)))
        a.store(hs)
        await a.publish()
        assert len(calls) == 1  # 60 stored blocks: one pipeline
        assert int((await client.info("stats"))["total_connections_received"]) - before <= 1
        await client.aclose()
    run(go())


def test_event_backlog_overflow_asks_for_a_full_republish():
    pool = BlockPool(8)
    pool.track_events(max_events=4)
    blocks = pool.allocate(8)
    for i, b in enumerate(blocks):
        pool.register(b, bytes([i]) * 16)
    events, overflowed = pool.drain_events()
    assert overflowed and len(events) <= 4
    assert pool.drain_events() == ([], False)
    assert sorted(pool.hashes()) == sorted(bytes([i]) * 16 for i in range(8))


def test_the_index_works_over_tls_with_mesh_certificates(server, tmp_path):
    """A `rediss://` URL with the mesh's CA and a client certificate (redis-py's ssl_* query parameters) is all the
    services need to reach a Redis that speaks TLS; a plaintext client of that port gets nothing."""
    import redis

    from services.common.certs import make_certs
    from tests.support.tls_proxy import TLSProxy

    certs = make_certs(tmp_path / "tls")
    proxy = TLSProxy(server.port, str(certs / "ca.pem"), str(certs / "kvstore.pem"), str(certs / "kvstore-key.pem"))
    proxy.start()
    url = (f"rediss://127.0.0.1:{proxy.port}/0?ssl_ca_certs={certs / 'ca.pem'}&ssl_certfile={certs / 'worker.pem'}"
           f"&ssl_keyfile={certs / 'worker-key.pem'}&ssl_cert_reqs=required")
    try:
        async def go():
            client = connect(url, timeout_s=5)
            a = Holder(client, "a")
            hs = hashes(list(range(100, 132)))
            a.store(hs[:5])
            await a.publish()
            await client.aclose()
            return PrefixIndex(connect_lookup(url, timeout_s=5)).longest_prefix(hs)
        assert {worker_of(m): n for m, n in run(go()).items()} == {"a": 5}
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=proxy.port, socket_timeout=2, socket_connect_timeout=2).ping()
    finally:
        proxy.stop()
