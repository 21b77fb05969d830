"""The worker servicer: roles prefill, decode and unified over one EngineCoreClient.

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
import functools
import logging

import grpc

from services.common import rpc
from services.common.arena import StaleArena
from services.common.convert import spec_from_work, top_logprobs_to_pb
from services.common.errors import CapacityExhausted, InvalidRequest, MeshError, NotFound, Unavailable
from services.common.host import host_id
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.policy.credit_ledger import CreditLedger
from services.worker.core import KVTransferFailed
from services.worker.core_client import EngineCoreClient
from services.worker.kvlink import KVLink, KVLinks
from services.worker.measure import DecodeRate

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
        ev.top_logprobs.extend(top_logprobs_to_pb(out.new_top_logprobs))
    return ev


def _checked(out):
    if isinstance(out, MeshError):
        raise out
    if isinstance(out, Exception):
        raise MeshError(str(out))
    return out


END = object()  # put on a push's KV queue when its request ends: the push ends there too


async def kv_chunks(kv: asyncio.Queue, transfer_id: str):
    """A request's KV pieces from the engine core (per step: the blocks it finished, written in place or as
    bytes; then the end, with the metadata of a handoff) as the kvstore's Put stream."""
    index = 0
    while True:
        piece = await kv.get()
        if piece is END:
            return
        piece = _checked(piece)
        if piece.last:
            meta = pb.KVMeta(**piece.meta) if piece.meta else None
            yield pb.KVChunk(transfer_id=transfer_id, index=-1, meta=meta, last=True)
            return
        yield pb.KVChunk(transfer_id=transfer_id, index=index, first_block=piece.first, checksums=piece.checksums,
                         data=piece.data)
        index += 1


def credited(handler):
    """A request served by the handler holds one of the worker's slots (services.policy.credit_ledger) until its stream
    ends, and uses up the credit it names."""
    @functools.wraps(handler)
    async def serve(self, request, context):
        self.credits.accept(request.credit_from, request.request_id)
        try:
            async for ev in handler(self, request, context):
                yield ev
        finally:
            self.credits.release()
            self._grant()
    return serve


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, runner: EngineCoreClient, role: str, worker_id: str, kv_transport: str = "auto",
                 kv_pool: bool = False, metrics=None):
        """kv_pool: take a prompt's blocks from the kvstore's pool when it holds more than this engine caches, and
        (unified) push computed prompt blocks there."""
        self.runner, self.role, self.worker_id = runner, role, worker_id
        self.channels = rpc.ChannelPool()
        self.kv_transport, self.kv_pool, self.metrics = kv_transport, kv_pool, metrics
        self.links: KVLinks | None = None  # once the engine's block geometry is known (start())
        self.credits = CreditLedger(runner.config.scheduler.max_num_seqs)
        self.credit_events: dict[str, asyncio.Event] = {}  # per credit subscription: its grant grew
        self.credits_closed = False  # draining: no more credits, and the streams end

    async def start(self) -> WorkerServicer:
        block_size, block_bytes = await self.runner.call("kv_geometry")
        self.links = KVLinks(self.runner, self.channels, block_size, block_bytes, self.kv_transport)
        return self

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

    def _grant(self) -> None:
        if self.credits_closed:
            return
        for sub in self.credits.grant():
            self.credit_events[sub].set()

    def close_credits(self) -> None:
        """The worker is stopping: grant nothing more and end every credit stream (a server's graceful stop would
        otherwise wait its whole grace for these never-ending calls)."""
        self.credits_closed = True
        for event in self.credit_events.values():
            event.set()

    @rpc.mapped
    async def Credits(self, request, context):
        rpc.require_peer(context, "gateway")
        sub = request.subscriber
        if not sub or sub in self.credit_events:
            raise InvalidRequest("a credit subscription needs a fresh, non-empty subscriber id")
        if self.credits_closed:
            raise Unavailable("this worker is stopping: it grants no credits")
        event = self.credit_events[sub] = asyncio.Event()
        self.credits.subscribe(sub)
        self._grant()
        try:
            while not self.credits_closed:
                event.clear()
                yield pb.CreditGrant(granted=self.credits.granted[sub], slots=self.credits.slots,
                                     live=self.credits.live)
                await event.wait()
        finally:
            self.credits.unsubscribe(sub)
            del self.credit_events[sub]
            self._grant()

    @rpc.mapped
    async def GiveBackCredit(self, request, context):
        rpc.require_peer(context, "gateway")
        lost = self.credits.give_back(request.subscriber, request.request_id)
        if lost:
            self._grant()
        return pb.GiveBackCreditReply(lost=lost)

    @rpc.mapped
    @credited
    async def Generate(self, request, context):
        rpc.require_peer(context, "gateway")
        self._check_role("unified")
        spec = spec_from_work(request, self.runner.clock)
        plan = kv = None
        if not (self.kv_pool and request.kvstore):
            q = await self._registered(request.request_id, self.runner.add(spec))
        else:
            link = self.links.get(request.kvstore)
            push_id = "push-" + request.request_id
            hashes = link.hashes(request)
            (lease_id, pooled), plan = await asyncio.gather(self._lease(link, request, hashes), self._reserve(
                link, request, push_id, hashes, handoff=False))
            if plan is not None and all(plan.present):  # the pool has every block already
                link.release_soon(push_id)
                plan = None
            kv: asyncio.Queue = asyncio.Queue()
            try:
                q = await self._registered(request.request_id, self.runner.add(spec, kv=kv if plan else None,
                                                                               plan=plan, pooled=pooled))
            except BaseException:
                if plan is not None:
                    link.release_soon(push_id)
                raise
            finally:
                if lease_id:
                    link.release_soon(lease_id)
            if plan is not None:
                asyncio.ensure_future(self._push(link, kv, push_id))
        try:
            async with contextlib.aclosing(self._stream(request.request_id, q)) as events:  # a cancel aborts at once
                async for ev in events:
                    yield ev
        finally:
            if plan is not None:
                kv.put_nowait(END)

    async def _push(self, link: KVLink, kv: asyncio.Queue, push_id: str) -> None:
        """A unified request's prompt blocks into the pool (best effort), then the push's pins released."""
        try:
            await link.put(kv_chunks(kv, push_id))
        except (grpc.aio.AioRpcError, MeshError) as e:
            log.warning("pushing KV %s to the pool failed: %s", push_id, e)
        finally:
            link.release_soon(push_id)

    async def _lease(self, link: KVLink, request, hashes: list) -> tuple[str, object]:
        """The pool's blocks of the prompt (see KVLink.lease); on any kvstore failure, none (the engine computes)."""
        try:
            return await link.lease(len(request.prompt_token_ids), hashes)
        except (grpc.aio.AioRpcError, MeshError) as e:
            log.warning("pool lease for %s failed: %s; computing the prompt", request.request_id, e)
            return "", None

    async def _reserve(self, link: KVLink, request, transfer_id: str, hashes: list, handoff: bool):
        """The transfer's export plan; None for a push (not handoff) that cannot be reserved, and for a handoff its
        reader released already."""
        try:
            return await link.reserve(transfer_id, len(request.prompt_token_ids), hashes, handoff)
        except grpc.aio.AioRpcError as e:
            if not handoff:
                return None
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise rpc.forward_rpc_error(e, link.address) from None
            # The decode side gave up on the transfer and released it first (its pull failed: the kvstore restarted
            # under it): it computes the prompt itself, and the first token is still ours to send.
            log.info("transfer %s: %s; the first token goes out without its KV", transfer_id, e.details())
            return None

    @rpc.mapped
    @credited
    async def Prefill(self, request, context):
        rpc.require_peer(context, "gateway")
        self._check_role("prefill", "unified")
        link = self.links.get(request.kvstore)
        hashes = link.hashes(request)
        leasing = asyncio.ensure_future(self._lease(link, request, hashes) if self.kv_pool else _nothing())
        try:
            plan = await self._reserve(link, request, request.transfer_id, hashes, handoff=True)
        except BaseException:
            lease_id, _ = await leasing
            if lease_id:
                link.release_soon(lease_id)
            raise
        lease_id, pooled = await leasing
        kv: asyncio.Queue | None = asyncio.Queue() if plan is not None else None
        try:
            q = await self._registered(request.request_id,
                                       self.runner.add(spec_from_work(request, self.runner.clock), kv=kv, plan=plan,
                                                       pooled=pooled))
        finally:
            if lease_id:
                link.release_soon(lease_id)
        put = link.stub.Put(kv_chunks(kv, request.transfer_id)) if kv is not None else None
        try:
            first = await self._next(q)
            yield _event(first)  # the first token goes out at once; the KV tail may still be in flight
            if put is not None and not first.finished:
                await rpc.finish_client_stream(put, f"the kvstore at {request.kvstore}")
        finally:
            self.runner.abort(request.request_id)
            if put is not None and not put.done():
                put.cancel()

    @rpc.mapped
    @credited
    async def Decode(self, request, context):
        """Import the prefilled KV and decode; when the transfer fails (the kvstore died, the prefill side gave up,
        a block failed its checksum), compute the prompt here instead: the first token, already streamed by the
        prefill side, is computed again (greedy and seeded sampling repeat it) and not sent twice. Without a
        transfer id, no prefill side ran: the prompt is computed here and every token sent."""
        rpc.require_peer(context, "gateway")
        self._check_role("decode", "unified")
        req_id = request.request_id
        if not request.transfer_id:  # no handoff (the gateway found the kvstore silent): the whole prompt here
            q = await self._registered(req_id, self.runner.add(spec_from_work(request, self.runner.clock)))
            async with contextlib.aclosing(self._stream(req_id, q, 0)) as events:
                async for ev in events:
                    yield ev
            return
        link = self.links.get(request.kvstore)
        await self._begin_import(request)
        skip = 0
        try:
            q = await self._pull(request, link)
        except (grpc.aio.AioRpcError, KVTransferFailed, StaleArena) as e:
            self.runner.abort(req_id)
            why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
            log.warning("request %s: KV transfer failed (%s); computing its prompt here", req_id, why)
            if self.metrics is not None:
                self.metrics.kv_recomputes.add(1)
            q = await self._registered(req_id, self.runner.add(spec_from_work(request, self.runner.clock)))
            skip = 1
        except BaseException:
            self.runner.abort(req_id)
            raise
        async with contextlib.aclosing(self._stream(req_id, q, skip)) as events:
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

    async def _pull(self, request, link: KVLink) -> asyncio.Queue:
        """Import blocks into the paged cache as they land in the kvstore; then join the batch.

        The transfer is released only once every import has run: the core reads the arena slots when it runs the
        import, between two steps, and a transfer released before that lets the kvstore give its slots to the next
        prefill, whose writes then race the read (a block failing its checksum, or worse, overwritten between its
        checksum and its copy: silently wrong KV and wrong tokens, seen once in eight prefill kills)."""
        try:
            m, imports = await link.pull(request)
        except BaseException:
            link.release_soon(request.transfer_id)
            raise
        ending = asyncio.ensure_future(self.runner.end_import(
            request.request_id, token_ids=list(m.token_ids), num_prompt=m.num_prompt, num_computed=m.num_computed,
            num_blocks=m.num_blocks, sample_seed=m.sample_seed))
        try:
            await asyncio.gather(*imports)  # a failed import's error, rather than what it makes end_import say
        except BaseException:
            ending.cancel()
            with contextlib.suppress(BaseException):
                await ending
            raise
        finally:
            link.release_soon(request.transfer_id)
        return await ending

    async def _next(self, q: asyncio.Queue):
        return _checked(await q.get())

    async def _stream(self, req_id: str, q: asyncio.Queue, skip: int = 0):
        """The request's events; the first `skip` tokens are not sent (they were, by another worker)."""
        finished = False
        try:
            while not finished:
                outs = [await self._next(q)]
                while not outs[-1].finished and not q.empty():  # steps queued while this stream was writing:
                    outs.append(_checked(q.get_nowait()))  # one message for all of them
                finished = outs[-1].finished
                ev = _events_of(outs)
                if skip:
                    dropped = min(skip, len(ev.token_ids))
                    del ev.token_ids[:dropped]
                    del ev.logprobs[:dropped]
                    del ev.top_logprobs[:dropped]
                    skip -= dropped
                    if not ev.token_ids and not finished:
                        continue
                yield ev
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
                              outstanding_tokens=load.outstanding_tokens, aborted=stats.aborted,
                              slot_preemptions=load.slot_preemptions, uncredited=self.credits.uncredited,
                              max_live=self.credits.max_live, credit_subscribers=len(self.credit_events),
                              credits_out=sum(self.credits.unused(s) for s in self.credits.granted),
                              credits_lost=self.credits.lost, busy_s=stats.busy_s, started=load.started,
                              queue_wait_s=load.queue_wait_s,
                              **lora_stats(load.lora))


    # ---- LoRA adapters (the gateway's admin calls, the router's placement) ----------------------------

    @rpc.mapped
    async def LoadAdapter(self, request, context):
        rpc.require_peer(context, "gateway", "router")  # the gateway checked the admin key; the router prefetches
        if request.path:
            await self.runner.call("load_adapter", request.name, request.path, request.prefetch)
        elif not request.prefetch:
            raise InvalidRequest("path is required (or prefetch, for an adapter registered already)")
        elif not await self.runner.call("prefetch_adapter", request.name):
            raise NotFound(f"adapter {request.name!r} is not loaded on {self.worker_id}")
        return await self._adapters()

    @rpc.mapped
    async def UnloadAdapter(self, request, context):
        rpc.require_peer(context, "gateway")
        await self.runner.call("unload_adapter", request.name)
        return await self._adapters()

    @rpc.mapped
    async def ListAdapters(self, request, context):
        rpc.require_peer(context, "gateway", "router", "client")
        return await self._adapters()

    async def _adapters(self) -> pb.AdapterList:
        return pb.AdapterList(adapters=[pb.AdapterInfo(name=a["name"], path=a["path"], rank=a["rank"],
                                                       targets=a["targets"], residency=a["residency"])
                                        for a in await self.runner.call("adapters")])


def lora_stats(lora) -> dict:
    """WorkerStats' LoRA counters from a LoRASnapshot (none without LoRA)."""
    if lora is None:
        return {}
    return dict(lora_loads=lora.loads, lora_load_s=lora.load_s, lora_slot_loads=lora.slot_loads, lora_hits=lora.hits,
                lora_misses=lora.misses)


def lora_fields(load) -> dict:
    """The heartbeat's LoRA fields from an EngineLoad."""
    lora = load.lora
    if lora is None:
        return {}
    return dict(adapters=lora.slots, host_adapters=lora.host, known_adapters=lora.known, pinned_adapters=lora.pinned,
                lora_slots=lora.max_loras, free_lora_slots=lora.free_slots)


async def _nothing() -> tuple[str, None]:
    return "", None


async def heartbeat_loop(runner: EngineCoreClient, router: str, worker_id: str, address: str, role: str,
                         on_first=None, publisher=None, kv_pool: bool = False, topology: str = "") -> None:
    """Beat every interval the router asks for (1 s by default); retry quietly while it is away. A beat never waits
    for the engine (see current_load): on the real model a step under load takes seconds."""
    chan = rpc.channel(router)  # held for the loop's lifetime
    stub = pb_grpc.RouterStub(chan)
    interval, first, rate = 1.0, True, DecodeRate()
    while True:
        try:
            load = await current_load(runner)
            reply = await stub.Heartbeat(pb.WorkerLoad(
                worker_id=worker_id, address=address, role=role, outstanding_tokens=load.outstanding_tokens,
                kv_capacity_tokens=load.blocks_total * load.block_size,
                kv_used_tokens=load.blocks_used * load.block_size, running=load.running, waiting=load.waiting,
                block_size=load.block_size,
                index_member=publisher.member if publisher is not None and publisher.connected else "",
                host=host_id(), kv_pool=kv_pool, topology=topology,
                decode_tokens_per_s=rate.update(runner.busy_s, runner.tokens_out),
                max_num_seqs=load.max_num_seqs,
                prefill_s_per_token=runner.cost.prefill_s_per_token,
                decode_s_per_step=runner.cost.decode_s_per_step, decode_s_floor=runner.cost.floor_step_s,
                tensor_parallel_size=runner.config.tensor_parallel_size,
                cores=runner.config.tensor_parallel_size * (runner.config.num_threads or 1),
                max_num_batched_tokens=runner.config.scheduler.max_num_batched_tokens,
                longest_step_s=runner.cost.longest_step_s,
                **lora_fields(load)), timeout=2.0)
            interval = max(reply.interval_ms, 50) / 1000
            if first and on_first:
                await on_first()
            first = False
        except grpc.aio.AioRpcError as e:
            log.warning("heartbeat to router %s failed: %s", router, e.code().name)
        except Exception:  # a bug here must not end the beats silently (the router would drop a serving worker)
            log.exception("heartbeat to router %s failed", router)
        await asyncio.sleep(interval)


async def current_load(runner: EngineCoreClient, wait_s: float = 0.2):
    """The engine's load for a heartbeat: a fresh reading when the core answers within wait_s (it does between steps,
    and at once when idle), else the one that came with its latest step. The core runs commands only between steps,
    and a step of SmolLM2 at full batch takes 2-4 s on 2 cores: a beat that awaited a fresh reading went out every
    3-5 s, and the router (3 s without a beat) dropped the busy worker (docs/BENCHMARKS.md, issue 36)."""
    fresh = runner.call("load")
    done, _ = await asyncio.wait({fresh}, timeout=wait_s)
    if done:
        return fresh.result()
    fresh.add_done_callback(_ignore_result)  # answered at the step's end; nobody waits for it then
    return runner.load


def _ignore_result(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: a core that died meanwhile logs no "exception never retrieved"


async def index_loop(runner: EngineCoreClient, publisher, period_s: float = 0.05, keepalive_s: float = 2.0) -> None:
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
