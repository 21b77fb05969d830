"""python -m services.router: the live worker registry and Route (see server.py, policies.py, registry.py)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import time

from grpc_health.v1 import health_pb2

from services.common import envs, rpc
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.common.prefix_index import PrefixIndex, connect_lookup, redacted
from services.common.telemetry import add_metrics_flag, setup_telemetry
from services.config.flags import add_config_flag, add_section_flags, announce, config_from_args
from services.config.sections import RoutingSection
from services.policy.routing.adapter_placement import AdapterPlacement
from services.policy.routing.policies import make_routing_policy
from services.router.registry import Registry
from services.router.server import RouterServicer

log = logging.getLogger("meshserve.router")
INDEX_HEALTH = "prefix-index"  # health service name: NOT_SERVING while Redis is unreachable


async def watch_index(index: PrefixIndex, server: rpc.Server, servicer: RouterServicer) -> None:
    """Probe Redis once a second (so the state shows without traffic) and mirror it in health and metrics."""
    while True:
        index.probe()
        servicer.set_degraded(index.degraded)
        health = health_pb2.HealthCheckResponse
        status = health.NOT_SERVING if index.degraded else health.SERVING
        await server.health.set(INDEX_HEALTH, status)
        await asyncio.sleep(1.0)


async def place_loop(servicer: RouterServicer, period_s: float = 1.0) -> None:
    """LoRA placement (services/policy/routing/adapter_placement.py) every period (routing.lora_placement_period_s)."""
    while True:
        await asyncio.sleep(period_s)
        await servicer.place()


async def serve(args, routing: RoutingSection, mode: str) -> None:
    registry = Registry(time.monotonic, ttl_s=routing.worker_ttl_s, on_forget=lambda w, silent_s: log.warning(
        "forgetting worker %s (%s): no heartbeat for %.1f s", w.worker_id, w.address, silent_s))
    index = PrefixIndex(connect_lookup(args.redis_url)) if args.redis_url else None
    server = rpc.Server(["Router"], args.port, args.host)
    policy = functools.partial(make_routing_policy, routing.policy, routing.model_dump(include={"weights", "guard"}))
    period = routing.lora_placement_period_s
    placement = AdapterPlacement(window_s=60 * period, reorder_s=10 * period) if routing.lora_placement else None
    servicer = RouterServicer(registry, policy, mode, routing.heartbeat_ms, index=index, placement=placement)
    pb_grpc.add_RouterServicer_to_server(servicer, server.server)
    gc.freeze()  # start-up objects leave the collector's view: shorter pauses on the routing path
    await server.set_serving(True)
    watch = asyncio.create_task(watch_index(index, server, servicer)) if index else None
    placing = asyncio.create_task(place_loop(servicer, period)) if placement is not None else None
    print(f"router listening on {server.address} (policy {routing.policy}, mode {args.mode}, "
          f"prefix index {'redis ' + redacted(args.redis_url) if index else 'off'})", flush=True)
    await server.run(grace_s=args.grace_s)
    for task in (watch, placing):
        if task:
            task.cancel()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m services.router", description=__doc__)
    rpc.add_server_flags(ap, envs.ROUTER_PORT, grace_s=2.0, default_port=rpc.DEFAULT_PORTS["router"])
    add_config_flag(ap)
    add_section_flags(ap, "routing")
    ap.add_argument("--mode", default=envs.ROUTER_MODE.get(), choices=["disaggregated", "unified"],
                    help="the mesh's mode (config mesh.mode; env ROUTER_MODE)")
    ap.add_argument("--redis-url", default=envs.REDIS_URL.get(),
                    help="the prefix index (env REDIS_URL); without it prefix-aware routes by load")
    add_metrics_flag(ap)
    args = ap.parse_args()
    cfg = config_from_args(ap, args, "routing", own={"mesh.mode": args.mode})
    setup_telemetry("router", args.metrics_port, args.host)
    announce("router", cfg, "routing", "mesh.mode")
    asyncio.run(serve(args, cfg.routing, cfg.mesh.mode))


if __name__ == "__main__":
    main()
