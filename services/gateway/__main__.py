"""python -m services.gateway: the public gRPC API of the mesh (see server.py)."""

from __future__ import annotations

import argparse
import asyncio
import os

import grpc

from services.common import rpc
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.common.telemetry import setup_tracing
from services.common.tokenizer import Tokenizer
from services.gateway.server import GatewayServicer, ModelInfo, add_to_server


async def readiness(server: rpc.Server, router: str, mode: str) -> None:
    """SERVING while the router answers and has the workers this mode needs."""
    chan = rpc.channel(router)  # held for the loop's lifetime
    stub = pb_grpc.RouterStub(chan)
    need = {"unified"} if mode == "unified" else {"prefill", "decode"}
    while True:
        try:
            roles = {w.role for w in (await stub.ListWorkers(pb.ListWorkersRequest(), timeout=1)).workers}
            await server.set_serving(need <= roles)
        except grpc.aio.AioRpcError:
            await server.set_serving(False)
        await asyncio.sleep(0.5)


async def serve(args) -> None:
    servicer = GatewayServicer(ModelInfo.from_dir(args.model), Tokenizer(args.model), args.router, args.kvstore)
    server = rpc.Server(["Generation"], args.port, args.host)
    add_to_server(servicer, server.server)
    task = asyncio.create_task(readiness(server, args.router, args.mode))
    print(f"gateway listening on {server.address}", flush=True)
    await server.run(grace_s=args.grace_s)
    task.cancel()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    ap.add_argument("--model", default=os.environ.get("MESHSERVE_MODEL"), required="MESHSERVE_MODEL" not in os.environ,
                    help="the served model folder (config.json and tokenizer.json are read here)")
    ap.add_argument("--router", default=os.environ.get("ROUTER_ADDR", "127.0.0.1:50051"))
    ap.add_argument("--kvstore", default=os.environ.get("KVSTORE_ADDR", "127.0.0.1:50052"))
    ap.add_argument("--mode", default=os.environ.get("ROUTER_MODE", "disaggregated"),
                    choices=["disaggregated", "unified"], help="which workers readiness waits for")
    rpc.add_server_flags(ap, "GATEWAY_PORT", grace_s=10.0)
    args = ap.parse_args()
    rpc.setup_logging("gateway")
    setup_tracing("gateway")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
