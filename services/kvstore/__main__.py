"""python -m services.kvstore: the KV transfer service and pool (services/kvstore/store.py, arena.py).

The arena is formatted by the first worker that attaches (its model's block size fixes the slot size: one
model per mesh); until then the kvstore holds nothing. Same-host workers map the arena and move bytes in
place; others (or all, with --transport grpc) send and receive them in gRPC messages. Each transfer's
transport shows in the metrics (meshserve.kv_transfer.bytes and .seconds by direction and transport).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from services.common import envs, rpc
from services.common.arena import check_instance, reclaim
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.common.telemetry import add_metrics_flag, setup_telemetry
from services.config.flags import add_config_flag, announce, config_from_args
from services.config.sections import KVSection
from services.kvstore.server import TRANSPORTS, KVStoreServicer, publish_loop

log = logging.getLogger("meshserve.kvstore")


async def serve(args, kv: KVSection) -> None:
    gone = reclaim(args.instance)
    if gone:
        log.info("reclaimed %d stale segment(s) of instance %s: %s", len(gone), args.instance, ", ".join(gone))
    servicer = KVStoreServicer(int(kv.budget_gb * 1e9), kv.transfer_ttl_s, args.instance, kv.transport)
    server = rpc.Server(["KVStore"], args.port, args.host)
    pb_grpc.add_KVStoreServicer_to_server(servicer, server.server)
    await server.set_serving(True)

    async def expire_loop():
        while True:
            await asyncio.sleep(1.0)
            if servicer.store is not None:
                servicer.store.expire()

    tasks = [asyncio.create_task(expire_loop())]
    if args.redis_url:
        tasks.append(asyncio.create_task(publish_loop(servicer, args.redis_url)))
    print(f"kvstore listening on {server.address} (instance {args.instance}, host {servicer.host})", flush=True)
    try:
        await server.run(grace_s=args.grace_s)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        servicer.close()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m services.kvstore", description=__doc__)
    rpc.add_server_flags(ap, envs.KVSTORE_PORT, grace_s=5.0, default_port=rpc.DEFAULT_PORTS["kvstore"])
    add_config_flag(ap)
    ap.add_argument("--byte-budget-gb", type=float, default=envs.KVSTORE_BUDGET_GB.get(),
                    help="bytes of KV the pool holds, reserved in shared memory when the arena is formatted (config "
                         "kv.budget_gb; env KVSTORE_BUDGET_GB)")
    ap.add_argument("--ttl-s", type=float, help="drop transfers never released after this long (config "
                                                "kv.transfer_ttl_s)")
    ap.add_argument("--instance", default=envs.KVSTORE_INSTANCE.get(),
                    help="names this kvstore's shared-memory segments, so that a restart reclaims its predecessor's "
                         "(default: port<PORT>)")
    ap.add_argument("--transport", choices=TRANSPORTS, default=envs.KVSTORE_TRANSPORT.get(),
                    help="grpc: never offer shared memory; shm/auto: offer it to workers on this host (config "
                         "kv.transport; env KVSTORE_TRANSPORT)")
    ap.add_argument("--redis-url", default=envs.REDIS_URL.get(),
                    help="publish the pool's blocks to the prefix index here (env REDIS_URL)")
    add_metrics_flag(ap)
    args = ap.parse_args()
    cfg = config_from_args(ap, args, own={"kv.budget_gb": args.byte_budget_gb, "kv.transfer_ttl_s": args.ttl_s,
                                          "kv.transport": args.transport})
    args.instance = check_instance(args.instance or f"port{args.port}")
    setup_telemetry("kvstore", args.metrics_port, args.host)
    announce("kvstore", cfg, "kv")
    asyncio.run(serve(args, cfg.kv))


if __name__ == "__main__":
    main()
