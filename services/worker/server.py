"""The worker servicer: roles prefill, decode and unified over one EngineRunner.

prefill: runs chunked prefill; after every step the request's newly full blocks are queued to
  the kvstore (a client-streaming Put), so transfer overlaps the next chunk's compute; once the
  first token is sampled, the rest of the KV and the metadata follow, the request leaves this
  engine (its blocks are freed) and the first token is returned.
decode: streams the transfer from the kvstore as blocks land, imports them into its paged
  cache, joins the request to the running batch and streams the following tokens.
unified: prefill and decode in one engine.
A cancelled or expired call aborts its request in the engine, freeing its blocks at once, at
whatever point it is cancelled: also while its registration (add, or a decode's KV reservation) is
still queued for the engine thread (see WorkerServicer._registered).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from services.common import rpc
from services.common.convert import spec_from_work
from services.common.errors import CapacityExhausted, InvalidRequest, MeshError
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.worker.measure import DecodeRate
from services.worker.runner import EngineRunner

log = logging.getLogger("meshserve.worker")


def _event(out) -> pb.TokenEvent:
    return _events_of([out])


def _events_of(outs: list) -> pb.TokenEvent:
    """One message for a request's outputs of one or more steps (in order; only the last may be finished)."""
    last = outs[-1]
    ev = pb.TokenEvent(finish_reason=last.finish_reason or "", prompt_tokens=last.num_prompt,
                       cached_prompt_tokens=last.num_cached_prompt)
    for out in outs:
        ev.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            ev.logprobs.extend(out.new_logprobs)
    return ev


def _checked(out):
    if isinstance(out, MeshError):
        raise out
    if isinstance(out, Exception):
        raise MeshError(str(out))
    return out


async def kv_chunks(kv: asyncio.Queue, transfer_id: str):
    """A prefill request's KV pieces from the engine core (one per step: every block it finished, then the
    metadata) as the kvstore's Put stream."""
    while True:
        piece = _checked(await kv.get())
        if piece.last:
            yield pb.KVChunk(transfer_id=transfer_id, index=-1, meta=pb.KVMeta(**piece.meta), last=True)
            return
        yield pb.KVChunk(transfer_id=transfer_id, index=piece.index, data=piece.data)


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, runner: EngineRunner, role: str, worker_id: str):
        self.runner, self.role, self.worker_id = runner, role, worker_id
        self.channels = rpc.ChannelPool()

    def _check_role(self, *roles: str) -> None:
        if self.role not in roles:
            raise InvalidRequest(f"this worker's role is {self.role}, not {' or '.join(roles)}")

    async def _registered(self, req_id: str, registering):
        """Await a call that registers req_id in the engine. Cancelled while it waits, the call is still
        queued for the engine thread and runs anyway: the abort queued behind it frees what it takes
        (without this, requests cancelled within milliseconds of sending held their slots forever)."""
        try:
            return await registering
        except asyncio.CancelledError:
            self.runner.abort(req_id)
            raise

    @rpc.mapped
    async def Generate(self, request, context):
        rpc.require_peer(context, "gateway")
        self._check_role("unified")
        q = await self._registered(request.request_id, self.runner.add(spec_from_work(request, self.runner.clock)))
        async with contextlib.aclosing(self._stream(request.request_id, q)) as events:  # a cancel aborts at once
            async for ev in events:
                yield ev

    @rpc.mapped
    async def Prefill(self, request, context):
        rpc.require_peer(context, "gateway")
        self._check_role("prefill", "unified")
        kv: asyncio.Queue = asyncio.Queue()
        q = await self._registered(request.request_id,
                                   self.runner.add(spec_from_work(request, self.runner.clock), kv=kv))
        put = pb_grpc.KVStoreStub(self.channels.get(request.kvstore)).Put(kv_chunks(kv, request.transfer_id))
        try:
            first = await self._next(q)
            yield _event(first)  # the first token goes out at once; the KV tail may still be in flight
            if not first.finished:
                await rpc.finish_client_stream(put, f"the kvstore at {request.kvstore}")
        finally:
            self.runner.abort(request.request_id)
            if not put.done():
                put.cancel()

    @rpc.mapped
    async def Decode(self, request, context):
        rpc.require_peer(context, "gateway")
        self._check_role("decode", "unified")
        req_id = request.request_id
        await self._begin_import(request)
        try:
            q = await self._pull(request)
        except BaseException:
            self.runner.abort(req_id)
            raise
        async with contextlib.aclosing(self._stream(req_id, q)) as events:
            async for ev in events:
                yield ev

    async def _begin_import(self, request) -> None:
        """Reserve blocks for the prompt's KV, waiting while the pool or the batch is full."""
        spec = spec_from_work(request, self.runner.clock)
        delay = 0.01
        while True:
            try:
                await self._registered(spec.request_id, self.runner.call("begin_import", spec))
                return
            except CapacityExhausted:
                await asyncio.sleep(delay)  # the call's deadline bounds the wait
                delay = min(delay * 2, 0.2)

    async def _pull(self, request) -> asyncio.Queue:
        """Import blocks into the paged cache as they land in the kvstore; then join the batch."""
        req_id, stub = request.request_id, pb_grpc.KVStoreStub(self.channels.get(request.kvstore))
        written = 0
        async for chunk in stub.Get(pb.GetRequest(transfer_id=request.transfer_id, wait_ms=60000)):
            if chunk.last:
                m = chunk.meta
                await stub.Release(pb.ReleaseRequest(transfer_id=request.transfer_id))
                return await self.runner.end_import(
                    req_id, token_ids=list(m.token_ids), num_prompt=m.num_prompt, num_computed=m.num_computed,
                    num_blocks=m.num_blocks, sample_seed=m.sample_seed)
            first = written
            written += await self.runner.call("import_blocks", req_id, first, chunk.data)
        raise InvalidRequest(f"transfer {request.transfer_id} ended without its metadata")

    async def _next(self, q: asyncio.Queue):
        return _checked(await q.get())

    async def _stream(self, req_id: str, q: asyncio.Queue):
        finished = False
        try:
            while not finished:
                outs = [await self._next(q)]
                while not outs[-1].finished and not q.empty():  # steps queued while this stream was writing:
                    outs.append(_checked(q.get_nowait()))  # one message for all of them
                finished = outs[-1].finished
                yield _events_of(outs)
        finally:
            if not finished:
                self.runner.abort(req_id)

    @rpc.mapped
    async def Stats(self, request, context):
        rpc.require_peer(context, "gateway", "client")
        stats = await self.runner.call("core_stats")
        load = stats.load
        return pb.WorkerStats(worker_id=self.worker_id, role=self.role, blocks_used=load.blocks_used,
                              blocks_cached=load.blocks_cached,
                              blocks_free=load.blocks_total - load.blocks_used - load.blocks_cached,
                              blocks_total=load.blocks_total, running=load.running, waiting=load.waiting,
                              outstanding_tokens=load.outstanding_tokens, aborted=stats.aborted)


async def heartbeat_loop(runner: EngineRunner, router: str, worker_id: str, address: str, role: str,
                         on_first=None, publisher=None) -> None:
    """Beat every interval the router asks for (1 s by default); retry quietly while it is away."""
    chan = rpc.channel(router)  # held for the loop's lifetime
    stub = pb_grpc.RouterStub(chan)
    interval, first, rate = 1.0, True, DecodeRate()
    while True:
        try:
            load = await runner.call("load")
            reply = await stub.Heartbeat(pb.WorkerLoad(
                worker_id=worker_id, address=address, role=role, outstanding_tokens=load.outstanding_tokens,
                kv_capacity_tokens=load.blocks_total * load.block_size,
                kv_used_tokens=load.blocks_used * load.block_size, running=load.running, waiting=load.waiting,
                block_size=load.block_size,
                index_member=publisher.member if publisher is not None and publisher.connected else "",
                decode_tokens_per_s=rate.update(runner.busy_s, runner.tokens_out),
                max_num_seqs=load.max_num_seqs,
                prefill_s_per_token=runner.cost.prefill_s_per_token,
                decode_s_per_step=runner.cost.decode_s_per_step), timeout=2.0)
            interval = max(reply.interval_ms, 50) / 1000
            if first and on_first:
                await on_first()
            first = False
        except grpc.aio.AioRpcError as e:
            log.warning("heartbeat to router %s failed: %s", router, e.code().name)
        await asyncio.sleep(interval)


async def index_loop(runner: EngineRunner, publisher, period_s: float = 0.05, keepalive_s: float = 2.0) -> None:
    """Publish the block pool's stored/evicted events to the prefix index, batched every period_s."""
    async def snapshot():
        return await runner.call("cached_hashes")

    await runner.call("track_block_events")
    loop = asyncio.get_running_loop()
    next_keepalive = 0.0
    while True:
        events, overflowed = await runner.call("block_events")
        publisher.add(events, overflowed)
        await publisher.flush(snapshot)
        if loop.time() >= next_keepalive:
            await publisher.keepalive(snapshot)
            next_keepalive = loop.time() + keepalive_s
        await asyncio.sleep(period_s)
