"""The kvstore's service: the KVStore servicer over the block store and the arena, its metrics, and the loop that
publishes the pool's blocks to the prefix index. `python -m services.kvstore` (__main__.py) runs it."""

from __future__ import annotations

import asyncio
import logging
import time

from opentelemetry import metrics, trace

from services.common import envs, rpc
from services.common.arena import Arena, StaleArena
from services.common.errors import InvalidRequest, MeshError
from services.common.host import host_id
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.kvstore.store import BlockStore

log = logging.getLogger("meshserve.kvstore")
TRANSPORTS = ("auto", "grpc", "shm")
MAX_DATA_PER_MESSAGE = 4 << 20  # Get over gRPC: block bytes per message at most
MAX_SLOTS_PER_MESSAGE = 4096  # Get over shared memory: slots per message at most


def _hashes(hashes) -> list:
    """Block hashes as the engines make them (services/common/block_hash.py): 16 bytes each."""
    bad = next((len(h) for h in hashes if len(h) != 16), None)
    if bad is not None:
        raise InvalidRequest(f"block hashes are 16 bytes, got one of {bad}")
    return list(hashes)


def _transfer_id(tid: str) -> str:
    if not tid or len(tid) > 256:
        raise InvalidRequest("a transfer id must be 1 to 256 characters")
    return tid


class KVStoreMetrics:
    """KV transfer bytes and stream seconds by direction (put, get) and transport, and what the pool holds."""

    def __init__(self, servicer: KVStoreServicer, meter: metrics.Meter | None = None):
        meter = meter or metrics.get_meter("meshserve.kvstore")
        self.bytes = meter.create_counter("meshserve.kv_transfer.bytes", unit="By", description="KV bytes moved")
        self.seconds = meter.create_histogram("meshserve.kv_transfer.seconds", unit="s",
                                              description="duration of one Put or Get stream")

        def gauge(name, fn, unit="", description=""):
            meter.create_observable_gauge(name, [lambda o: [metrics.Observation(fn(servicer.store))]], unit=unit,
                                          description=description)

        gauge("meshserve.kvstore.stored_bytes", lambda s: s.used_slots * servicer.block_bytes if s else 0, "By",
              "bytes held (pinned and pooled)")
        gauge("meshserve.kvstore.transfers", lambda s: len(s.transfers) if s else 0, description="transfers held")
        gauge("meshserve.kvstore.pool_blocks", lambda s: len(s.by_hash) if s else 0,
              description="content-addressed blocks held")

    def record(self, direction: str, transport: str, nbytes: int, seconds: float) -> None:
        attrs = {"direction": direction, "transport": transport}
        self.bytes.add(nbytes, attrs)
        self.seconds.record(seconds, attrs)


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(self, byte_budget: int, ttl_s: float, instance: str, transport: str = "auto", host: str = "",
                 clock=time.monotonic):
        self.byte_budget, self.ttl_s, self.instance, self.transport = byte_budget, ttl_s, instance, transport
        self.host, self.clock = host or host_id(), clock
        self.store: BlockStore | None = None  # formatted by the first attach
        self.arena: Arena | None = None
        self.block_bytes = 0
        # A testing aid (env KVSTORE_HOLD_META_S): every Get holds its transfer's metadata back this long, so a test
        # can kill the kvstore while a transfer is surely in flight.
        self.hold_meta_s = envs.KVSTORE_HOLD_META_S.get()
        self.metrics = KVStoreMetrics(self)

    def format(self, block_bytes: int) -> BlockStore:
        """The store, formatted for block_bytes-sized blocks at the first call."""
        if block_bytes <= 0:
            raise InvalidRequest("block_bytes must be positive")
        if self.store is None:
            slots = self.byte_budget // block_bytes
            if slots < 1:  # every reservation will be refused (RESOURCE_EXHAUSTED), as the budget says
                log.warning("the budget (%d bytes) holds no %d-byte block", self.byte_budget, block_bytes)
                self.store = BlockStore(0, self.ttl_s, self.clock)
            else:
                self.arena = Arena(self.instance, block_bytes, slots, shared=self.transport != "grpc")
                self.store = BlockStore(slots, self.ttl_s, self.clock, self.arena)
                log.info("arena: %d slots of %d bytes, %s", slots, block_bytes, f"shared memory {self.arena.path}"
                         if self.arena.shared else f"private ({self.arena.why_not_shared})")
            self.block_bytes = block_bytes
        elif block_bytes != self.block_bytes:
            raise InvalidRequest(f"this kvstore holds {self.block_bytes}-byte KV blocks, not {block_bytes}: one "
                                 "model per kvstore")
        return self.store

    def _store(self) -> BlockStore:
        if self.store is None:
            raise InvalidRequest("no worker has attached to this kvstore yet: nothing is reserved")
        return self.store

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()

    @rpc.mapped
    async def Attach(self, request, context):
        rpc.require_peer(context, "worker")
        if request.transport not in ("", *TRANSPORTS):
            raise InvalidRequest(f"transport {request.transport!r}: one of {', '.join(TRANSPORTS)}")
        self.format(request.block_bytes)
        a, wanted = self.arena, request.transport or "auto"
        if wanted == "grpc":
            return self._attached("grpc", "forced by the worker's config")
        if a is None:
            reason = "the budget holds no block"
        elif not a.shared:
            reason = f"no shared memory: {a.why_not_shared}"
        elif request.host != self.host:
            reason = f"worker host {request.host!r} is not this kvstore's ({self.host!r})"
        else:
            return pb.AttachReply(transport="shm", segment=str(a.path), generation=a.generation,
                                  slot_bytes=a.slot_bytes, slots=a.slots, reason="same host")
        if wanted == "shm":
            raise InvalidRequest(f"shared-memory transport forced, but {reason}")
        return self._attached("grpc", reason)

    def _attached(self, transport: str, reason: str):
        return pb.AttachReply(transport=transport, generation=self.generation, slot_bytes=self.block_bytes,
                              slots=self.store.slots, reason=reason)

    @property
    def generation(self) -> str:
        return self.arena.generation if self.arena is not None else ""

    @rpc.mapped
    async def Reserve(self, request, context):
        rpc.require_peer(context, "worker")
        store = self.format(request.block_bytes)
        t = store.reserve(_transfer_id(request.transfer_id), _hashes(request.hashes), request.num_blocks)
        present = [b.landed for b in t.blocks]
        return pb.ReserveReply(slots=[b.slot for b in t.blocks], present=present, generation=self.generation)

    @rpc.mapped
    async def Acquire(self, request, context):
        rpc.require_peer(context, "worker")
        if self.store is None:
            return pb.AcquireReply(blocks=0)
        self.format(request.block_bytes)
        if request.start < 0:
            raise InvalidRequest(f"start must be >= 0 (got {request.start})")
        t = self.store.acquire(_transfer_id(request.transfer_id), _hashes(request.hashes), request.start)
        return pb.AcquireReply(blocks=len(t.blocks) if t else 0)

    @rpc.mapped
    async def Put(self, request_iterator, context):
        rpc.require_peer(context, "worker")
        blocks = nbytes = 0
        t0 = time.monotonic()
        failure, tid, transport = None, "", "shm"
        try:
            async for chunk in request_iterator:
                if failure is not None:
                    continue  # read to the end: see below
                tid = chunk.transfer_id
                try:
                    store = self._store()
                    if chunk.data:
                        transport = "grpc"
                    if chunk.checksums:
                        nbytes += await store.land(tid, chunk.first_block, list(chunk.checksums), chunk.data)
                        blocks += len(chunk.checksums)
                    if chunk.last:
                        await store.finish(tid, chunk.meta)
                except MeshError as e:
                    failure = e
        except BaseException:
            if tid and self.store is not None:  # the writer's stream broke: readers hear it at once
                await self.store.fail(tid, "the prefill worker's KV stream broke")
            raise
        if failure is not None:
            # Raised only once the sender has half-closed: a client-streaming call the server ends while the client
            # still writes reaches an asyncio client as INTERNAL "Internal error from Core" instead of this status
            # when a write races the trailers (grpc/grpc#36066). The rest of the stream (one prompt's blocks) is read
            # and dropped.
            if tid and self.store is not None:
                await self.store.fail(tid, str(failure))
            raise failure
        self.metrics.record("put", transport, nbytes, time.monotonic() - t0)
        trace.get_current_span().set_attribute("meshserve.kv.transport", transport)
        return pb.PutReply(blocks=blocks, bytes=nbytes)

    @rpc.mapped
    async def Get(self, request, context):
        rpc.require_peer(context, "worker")
        store = self._store()
        if request.shm and request.generation != self.generation:
            raise StaleArena(f"arena {request.generation or '(none)'} is gone (this kvstore's is "
                             f"{self.generation or 'none'}): attach again")
        timeout = (request.wait_ms or 30000) / 1000
        transport = "shm" if request.shm else "grpc"
        trace.get_current_span().set_attribute("meshserve.kv.transport", transport)
        nbytes, t0, size = 0, time.monotonic(), self.block_bytes
        async for first, blocks in store.get(request.transfer_id, timeout):
            if first < 0 and self.hold_meta_s:
                await asyncio.sleep(self.hold_meta_s)
            if first < 0:
                self.metrics.record("get", transport, nbytes, time.monotonic() - t0)
                yield pb.KVChunk(transfer_id=request.transfer_id, index=-1, meta=blocks, last=True)
                return
            nbytes += len(blocks) * size
            step = MAX_SLOTS_PER_MESSAGE if request.shm else max(1, MAX_DATA_PER_MESSAGE // max(size, 1))
            for i in range(0, len(blocks), step):
                part = blocks[i:i + step]
                chunk = pb.KVChunk(transfer_id=request.transfer_id, first_block=first + i,
                                   checksums=[b.checksum for b in part])
                if request.shm:
                    chunk.slots.extend(b.slot for b in part)
                else:
                    chunk.data = b"".join(self.arena.slot(b.slot) for b in part)
                yield chunk

    @rpc.mapped
    async def Release(self, request, context):
        rpc.require_peer(context, "gateway", "worker")
        if self.store is None:
            return pb.ReleaseReply(released=False)
        if request.abandoned:
            return pb.ReleaseReply(released=await self.store.abandon(request.transfer_id))
        return pb.ReleaseReply(released=await self.store.release(request.transfer_id))

    @rpc.mapped
    async def Stats(self, request, context):
        rpc.require_peer(context, "client")
        s, budget = self.store, self.byte_budget
        if s is None:
            return pb.KVStoreStats(byte_budget=budget)
        return pb.KVStoreStats(transfers=len(s.transfers), bytes=s.used_slots * self.block_bytes,
                               byte_budget=budget, evicted=s.evicted, expired=s.expired, pool_blocks=len(s.by_hash),
                               pinned_blocks=s.pinned_slots, hits=s.hits, block_bytes=self.block_bytes,
                               segment=str(self.arena.path) if self.arena is not None and self.arena.shared else "")


async def publish_loop(servicer: KVStoreServicer, redis_url: str, period_s: float = 0.05,
                       keepalive_s: float = 2.0) -> None:
    """Publish the pool's content-addressed blocks to the prefix index as a member of its own (pool@<host>):
    the router counts them as a cheaper-than-compute hit for every worker on this host."""
    from services.common.members import POOL_MEMBER
    from services.common.prefix_index import IndexPublisher, connect

    publisher = IndexPublisher(connect(redis_url), POOL_MEMBER + servicer.host)

    async def snapshot():
        return servicer.store.hashes() if servicer.store else []

    loop = asyncio.get_running_loop()
    next_keepalive = 0.0
    try:
        while True:
            if servicer.store is not None:
                if servicer.store.events is None:
                    servicer.store.track_events()
                publisher.add(*servicer.store.drain_events())
                await publisher.flush(snapshot)
                if loop.time() >= next_keepalive:
                    await publisher.keepalive(snapshot)
                    next_keepalive = loop.time() + keepalive_s
            await asyncio.sleep(period_s)
    finally:
        await publisher.withdraw()
