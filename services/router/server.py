"""The router's servicer: heartbeats in, routing decisions out.

Route hashes the prompt's full blocks (services.common.block_hash, the engine's function and
salt rules) and asks the Redis prefix index for each worker's longest cached prefix in one round
trip (only for policies that use it, and only for the role that computes the prompt); the decision
itself, the overlay of what was routed in the last seconds included, is pick.py's I/O-free core,
which the simulator runs too. With Redis
away, prefix lookups return nothing at once and routing goes on by load; the degradation shows
in health (service "prefix-index" NOT_SERVING), ListWorkers, a metric and the log.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from opentelemetry import metrics, trace

from services.common import rpc
from services.common.block_hash import pack_tokens, prompt_hashes
from services.common.convert import load_from_pb, load_to_pb
from services.common.errors import InvalidRequest
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.policy.routing.filters import Need
from services.policy.routing.pick import Prompt, RouteDecider
from services.policy.routing.recent import RecentRoutes
from services.router.registry import Registry

log = logging.getLogger("meshserve.router")


class RouterMetrics:
    """Decision latency, prefix hit tokens per decision, outstanding tokens per worker, index health."""

    def __init__(self, registry: Registry, meter: metrics.Meter | None = None):
        meter = meter or metrics.get_meter("meshserve.router")
        self.registry, self.degraded = registry, 0
        self.decision_ms = meter.create_histogram("meshserve.router.decision", unit="ms",
                                                  description="routing decision latency, Redis round trip included")
        self.prefix_hit = meter.create_histogram("meshserve.router.prefix_hit_tokens", unit="{token}",
                                                 description="cached prompt tokens on the chosen worker, per decision")
        meter.create_observable_gauge("meshserve.router.worker_outstanding_tokens", [self._outstanding],
                                      unit="{token}", description="outstanding tokens per worker, in-flight included")
        meter.create_observable_gauge("meshserve.router.prefix_index_degraded", [self._degraded],
                                      description="1 while Redis is unreachable and routing is by load only")

    def _outstanding(self, options):
        return [metrics.Observation(w.tokens, {"worker_id": w.worker_id, "role": w.role})
                for w in self.registry.workers.values()]

    def _degraded(self, options):
        return [metrics.Observation(self.degraded)]


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, registry: Registry, policy_factory, mode: str, beat_ms: int, index=None,
                 recent: RecentRoutes | None = None, meter=None, placement=None):
        """placement: an AdapterPlacement (services/policy/routing/adapter_placement.py) that sees every routed
        request's adapter; place() acts on its plan."""
        self.registry, self.mode, self.beat_ms, self.index = registry, mode, beat_ms, index
        self.placement, self.channels = placement, rpc.ChannelPool()
        self.prefetches: set = set()  # prefetch calls in flight (held here so that none is collected mid-call)
        self.recent = recent or RecentRoutes(registry.clock)
        self.pickers = {role: RouteDecider(role, policy_factory(), self.recent) for role in ("prefill", "decode",
                                                                                            "unified")}
        self.metrics = RouterMetrics(registry, meter)

    @rpc.mapped
    async def Heartbeat(self, request, context):
        rpc.require_peer(context, "worker")
        self.registry.beat_view(load_from_pb(request))
        return pb.HeartbeatReply(interval_ms=self.beat_ms)

    @rpc.mapped
    async def Deregister(self, request, context):
        rpc.require_peer(context, "worker")
        self.registry.remove(request.worker_id)
        return pb.HeartbeatReply(interval_ms=self.beat_ms)

    @rpc.mapped
    async def Route(self, request, context):
        rpc.require_peer(context, "gateway")
        t0 = time.perf_counter()
        if self.placement is not None:
            self.placement.observe(request.adapter, self.registry.clock())
        mode = request.mode or self.mode
        if mode == "unified":
            worker, why, cached = await self._pick("unified", request.prompt_tokens + request.max_tokens, request)
            decision = pb.RouteDecision(decode_worker=worker.address, mode=mode, reason=str(why))
        else:
            prefill, why_p, cached = await self._pick("prefill", request.prompt_tokens, request)
            decode, why_d, _ = await self._pick("decode", request.max_tokens, request, block_size=prefill.block_size,
                                                near=prefill.topology)
            decision = pb.RouteDecision(prefill_worker=prefill.address, decode_worker=decode.address,
                                        mode="disaggregated", reason=f"prefill[{why_p}] decode[{why_d}]")
        decision.decision_ms = (time.perf_counter() - t0) * 1e3
        decision.cached_prefix_tokens = cached
        self.metrics.decision_ms.record(decision.decision_ms, {"mode": decision.mode})
        self.metrics.prefix_hit.record(cached)
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attribute("meshserve.route.reason", decision.reason)
            span.set_attribute("meshserve.route.cached_prefix_tokens", cached)
        return decision

    async def _pick(self, role: str, cost: int, request, block_size: int = 0, near: str = ""):
        """The live workers, the prompt's hashes and what the index holds of them (the I/O), then the core's
        decision (pick.py); returns (worker, why, cached prompt tokens on it per the index). near: the topology the
        request's KV comes from (equally good workers nearer it go first)."""
        picker = self.pickers[role]
        workers = self.registry.live(Need(role, block_size, request.adapter, frozenset(request.avoid)))
        prompt = None
        if picker.wants_prompt and (request.prompt_u32 or request.prompt_token_ids or request.block_hashes):
            hashes = self._hashes(workers[0].block_size, request)
            prompt = Prompt(hashes, self.index.longest_prefix(hashes) if self.index is not None else {})
        homes = self.placement.home(role, request.adapter) if request.adapter and self.placement is not None \
            else frozenset()
        pick = picker.pick(workers, cost, request.adapter, prompt, homes, near)
        return pick.worker, pick.why, pick.cached_tokens

    @staticmethod
    def _hashes(bs: int, request) -> list:
        if request.block_hashes and request.hash_block_size == bs:  # hashed once, by the gateway
            blob = request.block_hashes
            if len(blob) % 16:
                raise InvalidRequest("block_hashes must hold whole 16-byte hashes")
            return [blob[i:i + 16] for i in range(0, len(blob), 16)]
        packed = request.prompt_u32 or pack_tokens(request.prompt_token_ids)
        if len(packed) % 4:
            raise InvalidRequest("prompt_u32 must hold whole uint32 token ids")
        return prompt_hashes(packed, bs, request.adapter, request.cache_salt)

    async def place(self) -> int:
        """One round of LoRA placement: the plan's prefetch orders, sent to the workers (without waiting for the
        reads); returns how many were sent."""
        now, live, sent = self.registry.clock(), self.registry.prune(), 0
        for role in ("prefill", "decode", "unified"):
            for worker, adapter in self.placement.plan([w for w in live if w.role == role], now):
                task = asyncio.get_running_loop().create_task(self._prefetch(worker, adapter))
                self.prefetches.add(task)
                task.add_done_callback(self.prefetches.discard)
                sent += 1
        return sent

    async def _prefetch(self, worker, adapter: str) -> None:
        try:
            await pb_grpc.WorkerStub(self.channels.get(worker.address)).LoadAdapter(
                pb.LoadAdapterRequest(name=adapter, prefetch=True), timeout=5.0)
            log.info("placement: %s prefetches adapter %s", worker.worker_id, adapter)
        except grpc.aio.AioRpcError as e:
            log.warning("placement: prefetching adapter %s on %s failed: %s", adapter, worker.worker_id, e.details())

    @rpc.mapped
    async def ListWorkers(self, request, context):
        rpc.require_peer(context, "gateway", "client")
        return pb.ListWorkersResponse(
            workers=[load_to_pb(w) for w in self.registry.prune()],
            prefix_index_degraded=bool(self.index is not None and self.index.degraded))

    def set_degraded(self, degraded: bool) -> None:
        self.metrics.degraded = int(degraded)
