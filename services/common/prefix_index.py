"""The mesh's prefix index in Redis: which worker holds which KV block (by chained block hash).

Layout (Redis >= 6.2: no hash-field expiry, no Functions):
    ms:b:<16-byte hash> SET of members holding that block; a member is "<worker_id>#<epoch>"
    ms:live:<member>    "1" with EX live_ttl_s (10 s), refreshed by the worker every couple of seconds

A worker's epoch is fresh at every start and at every full republish, so a restarted worker's old
entries never match its new member; a dead worker's entries stop counting once its live key expires (<= live_ttl_s).
Block sets carry a long TTL refreshed on every store, so abandoned members are garbage-collected
eventually; the lookup script also drops members whose live key is gone.

Workers (IndexPublisher) send batches of stored/evicted events in one pipeline, never a round
trip per block. A keep-alive is `SET live 1 EX ttl GET`: when the key was missing (Redis
restarted, or we were away longer than the TTL) the worker republishes its whole state.

The router (PrefixIndex) asks for a prompt's longest cached prefix per member in one round trip:
a Lua script takes the live members holding the first block and binary-searches each one's
longest held prefix (holdings are prefix-closed; see LONGEST_PREFIX_LUA). Both sides back off and retry while Redis is
unreachable; the router then routes by load alone and reports the degradation.
"""

from __future__ import annotations

import logging
import re
import time

import redis
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.common.members import new_member

log = logging.getLogger("meshserve.prefix_index")

BLOCK_PREFIX = b"ms:b:"
LIVE_PREFIX = "ms:live:"
LIVE_TTL_S = 10
BLOCK_TTL_S = 3600

# ARGV[1]: the live-key prefix; ARGV[2]: the block-key prefix; ARGV[3]: the prompt's 16-byte block
# hashes, concatenated in order (one argument rather than a key per block: packing hundreds of
# arguments costs the client more than the lookup costs Redis; a single-node index, not Cluster).
# Returns a flat list: member, number of leading blocks it holds, member, ... (live members only).
# A worker's holdings of one chain are prefix-closed (its pool evicts least recently used blocks,
# a prefix's blocks are always used together from the first, and a sequence releases its tail
# first), so per member a binary search over the prompt's blocks finds the longest held prefix:
# about log2(blocks) SISMEMBER per member instead of one SMEMBERS per block.
LONGEST_PREFIX_LUA = """
local live_prefix, block_prefix, blob = ARGV[1], ARGV[2], ARGV[3]
local n = #blob / 16
local function key(i) return block_prefix .. string.sub(blob, (i - 1) * 16 + 1, i * 16) end
local out = {}
local first = key(1)
for _, m in ipairs(redis.call('SMEMBERS', first)) do
  if redis.call('EXISTS', live_prefix .. m) == 1 then
    local lo, hi = 1, n
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if redis.call('SISMEMBER', key(mid), m) == 1 then lo = mid else hi = mid - 1 end
    end
    out[#out + 1] = m
    out[#out + 1] = lo
  else
    redis.call('SREM', first, m)
  end
end
return out
"""


def block_key(block_hash: bytes) -> bytes:
    if len(block_hash) != 16:
        raise ValueError(f"block hashes are 16 bytes, got {len(block_hash)}")
    return BLOCK_PREFIX + block_hash


def redacted(url: str) -> str:
    """A Redis URL fit for a log: its password (redis://:PASSWORD@ or redis://USER:PASSWORD@) masked."""
    return re.sub(r"(//[^:/@]*:)[^@]*@", r"\1***@", url)


def connect(url: str, timeout_s: float = 0.5) -> aioredis.Redis:
    """The workers' (asyncio) client."""
    return aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                   retry_on_timeout=False)


def connect_lookup(url: str, timeout_s: float = 0.05) -> redis.Redis:
    """The router's lookup client: synchronous, with a tight timeout (see PrefixIndex)."""
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry_on_timeout=False)


class Backoff:
    """Exponential retry delay, pure: the clock is injected."""

    def __init__(self, clock=time.monotonic, first_s: float = 0.1, max_s: float = 5.0):
        self.clock, self.first_s, self.max_s = clock, first_s, max_s
        self.delay_s, self.next_try_s = 0.0, 0.0

    def ready(self) -> bool:
        return self.clock() >= self.next_try_s

    def failed(self) -> None:
        self.delay_s = min(self.max_s, self.delay_s * 2 if self.delay_s else self.first_s)
        self.next_try_s = self.clock() + self.delay_s

    def succeeded(self) -> None:
        self.delay_s, self.next_try_s = 0.0, 0.0


class IndexPublisher:
    """A prefill-capable worker's side: batched block events and liveness.

    add() takes the events drained from the block pool; flush(snapshot) sends them in one
    pipeline, or, when a full republish is due (first run, Redis restarted or unreachable for a
    while, events dropped), sends the whole state from `await snapshot()` under a fresh epoch,
    so nothing stale from before can count.
    """

    def __init__(self, client: aioredis.Redis, worker_id: str, live_ttl_s: int = LIVE_TTL_S):
        self.client, self.worker_id, self.live_ttl_s = client, worker_id, live_ttl_s
        self.member = new_member(worker_id)
        self.pending: list[tuple[str, bytes]] = []
        self.resync = True  # the first flush sends the whole state
        self.backoff = Backoff()
        self.connected = False
        self.published_blocks = 0  # blocks in the last full republish

    @property
    def live_key(self) -> str:
        return LIVE_PREFIX + self.member

    def add(self, events: list, overflowed: bool = False) -> None:
        if overflowed:
            self.resync = True
        if self.resync:
            return  # the republish will carry the state
        self.pending.extend(events)
        if len(self.pending) > 200_000:  # Redis has been away long: a full republish is cheaper
            self.pending.clear()
            self.resync = True

    async def flush(self, snapshot) -> bool:
        """Send what is pending (or the whole state when due); False while Redis is unreachable."""
        return await self._guarded(self._flush, snapshot)

    async def keepalive(self, snapshot) -> bool:
        """Refresh the live key; republish everything when it was gone (Redis restarted or we were away)."""
        return await self._guarded(self._keepalive, snapshot)

    async def _guarded(self, step, snapshot) -> bool:
        if not self.backoff.ready():
            return False
        try:
            await step(snapshot)
        except (RedisError, OSError) as e:
            self._down(e)
            return False
        self._up()
        return True

    async def _flush(self, snapshot) -> None:
        if self.resync:
            await self._republish(await snapshot())
        elif self.pending:
            await self._send(self.pending)
        self.pending = []

    async def _keepalive(self, snapshot) -> None:
        if not self.resync and await self.client.set(self.live_key, "1", ex=self.live_ttl_s, get=True) is None:
            log.info("prefix index: live key %s was missing; republishing the whole state", self.live_key)
            self.resync = True
        if self.resync:
            await self._republish(await snapshot())
            self.pending = []

    async def withdraw(self) -> None:
        """On a clean stop: our entries stop counting at once."""
        try:
            await self.client.delete(self.live_key)
        except (RedisError, OSError):
            pass

    async def _republish(self, hashes: list[bytes]) -> None:
        old, self.member = self.live_key, new_member(self.worker_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(old)
        for h in hashes:
            key = block_key(h)
            pipe.sadd(key, self.member)
            pipe.expire(key, BLOCK_TTL_S)
        pipe.set(self.live_key, "1", ex=self.live_ttl_s)
        await pipe.execute()
        self.published_blocks = len(hashes)
        self.resync = False

    async def _send(self, events: list) -> None:
        pipe = self.client.pipeline(transaction=False)
        for kind, h in events:
            key = block_key(h)
            if kind == "stored":
                pipe.sadd(key, self.member)
                pipe.expire(key, BLOCK_TTL_S)
            else:
                pipe.srem(key, self.member)
        await pipe.execute()

    def _up(self) -> None:
        if not self.connected:
            log.info("prefix index: publishing to Redis as %s", self.member)
        self.connected = True
        self.backoff.succeeded()

    def _down(self, e: Exception) -> None:
        if self.connected or self.backoff.delay_s == 0:
            log.warning("prefix index: Redis unreachable (%s); will republish everything once it is back", e)
        self.connected = False
        self.resync = True
        self.pending = []
        self.backoff.failed()


class PrefixIndex:
    """The router's side: the longest cached prefix of a prompt per worker, one round trip.

    The lookup is a synchronous call made from the router's event loop: the script runs in about
    0.3 ms, and an asyncio round trip inside a grpc.aio server costs more than that again
    (router-latency measured p50 1.5 -> 1.1 ms). The client's 50 ms socket timeout bounds how long
    a hung Redis can hold the loop, once: after a failure lookups return {} at once (no waiting on
    a dead socket) and are retried with backoff; `degraded` says so, and on_change(degraded) is
    called on every transition.
    """

    def __init__(self, client: redis.Redis, clock=time.monotonic, on_change=None):
        self.client = client
        self.script = client.register_script(LONGEST_PREFIX_LUA)
        self.backoff = Backoff(clock)
        self.degraded = False
        self.on_change = on_change

    def longest_prefix(self, hashes: list[bytes]) -> dict[str, int]:
        """member -> leading blocks of `hashes` it holds (live members holding at least one)."""
        if not hashes or not self.backoff.ready():
            return {}
        try:
            flat = self.script(args=[LIVE_PREFIX, BLOCK_PREFIX, b"".join(hashes)])
        except (RedisError, OSError) as e:
            self._set_degraded(True, e)
            self.backoff.failed()
            return {}
        self.backoff.succeeded()
        self._set_degraded(False)
        return {(m.decode() if isinstance(m, bytes) else m): int(n) for m, n in zip(flat[::2], flat[1::2])}

    def probe(self) -> bool:
        """Ping when a retry is due (the router calls this periodically, so recovery shows without traffic)."""
        if not self.backoff.ready():
            return not self.degraded
        try:
            self.client.ping()
        except (RedisError, OSError) as e:
            self._set_degraded(True, e)
            self.backoff.failed()
            return False
        self.backoff.succeeded()
        self._set_degraded(False)
        return True

    def _set_degraded(self, degraded: bool, error: Exception | None = None) -> None:
        if degraded == self.degraded:
            return
        self.degraded = degraded
        if degraded:
            log.warning("prefix index: Redis unreachable (%s); routing by load only until it returns", error)
        else:
            log.info("prefix index: Redis is back; prefix-aware routing resumes")
        if self.on_change:
            self.on_change(degraded)
