"""python -m services.router: the live worker registry and Route (see policies.py, registry.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time

from services.common import rpc
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.common.telemetry import setup_tracing
from services.router.policies import make_policy
from services.router.registry import Registry

log = logging.getLogger("meshserve.router")


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, registry: Registry, policy_name: str, mode: str, beat_ms: int):
        self.registry, self.mode, self.beat_ms = registry, mode, beat_ms
        self.policies = {role: make_policy(policy_name) for role in ("prefill", "decode", "unified")}

    @rpc.mapped
    async def Heartbeat(self, request, context):
        self.registry.beat(request.worker_id, request.address, request.role, request.outstanding_tokens,
                           request.kv_capacity_tokens)
        return pb.HeartbeatReply(interval_ms=self.beat_ms)

    @rpc.mapped
    async def Deregister(self, request, context):
        self.registry.remove(request.worker_id)
        return pb.HeartbeatReply(interval_ms=self.beat_ms)

    @rpc.mapped
    async def Route(self, request, context):
        mode = request.mode or self.mode
        cost = request.prompt_tokens + request.max_tokens
        if mode == "unified":
            worker, why = self._pick("unified", cost)
            return pb.RouteDecision(decode_worker=worker.address, mode=mode, reason=why)
        prefill, why_p = self._pick("prefill", request.prompt_tokens)
        decode, why_d = self._pick("decode", request.max_tokens)
        return pb.RouteDecision(prefill_worker=prefill.address, decode_worker=decode.address, mode="disaggregated",
                                reason=f"prefill[{why_p}] decode[{why_d}]")

    def _pick(self, role: str, cost: int):
        policy = self.policies[role]
        worker, why = policy.select(self.registry.live(role), cost)
        policy.on_routed(worker, cost)
        return worker, why

    @rpc.mapped
    async def ListWorkers(self, request, context):
        return pb.ListWorkersResponse(workers=[
            pb.WorkerLoad(worker_id=w.worker_id, address=w.address, role=w.role,
                          outstanding_tokens=w.outstanding_tokens, kv_capacity_tokens=w.capacity_tokens)
            for w in self.registry.prune()])


async def serve(args) -> None:
    registry = Registry(time.monotonic, ttl_s=args.worker_ttl_s)
    server = rpc.Server(["Router"], args.port, args.host)
    pb_grpc.add_RouterServicer_to_server(RouterServicer(registry, args.policy, args.mode, args.heartbeat_ms),
                                         server.server)
    await server.set_serving(True)
    print(f"router listening on {server.address} (policy {args.policy}, mode {args.mode})", flush=True)
    await server.run(grace_s=args.grace_s)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m services.router", description=__doc__)
    rpc.add_server_flags(ap, "ROUTER_PORT", grace_s=2.0)
    ap.add_argument("--policy", default=os.environ.get("ROUTER_POLICY", "least-outstanding"))
    ap.add_argument("--mode", default=os.environ.get("ROUTER_MODE", "disaggregated"),
                    choices=["disaggregated", "unified"])
    ap.add_argument("--heartbeat-ms", type=int, default=1000)
    ap.add_argument("--worker-ttl-s", type=float, default=3.0, help="drop a worker silent this long")
    args = ap.parse_args()
    make_policy(args.policy)
    rpc.setup_logging("router")
    setup_tracing("router")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
