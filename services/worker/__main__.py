"""python -m services.worker --role prefill|decode|unified: an engine worker of the mesh."""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.common import envs, rpc
from services.common.errors import ModelLoadError
from services.common.host import topology
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.common.telemetry import POOL_ATTRIBUTE, add_metrics_flag, setup_telemetry
from services.config.flags import add_config_flag, add_section_flags, announce, config_from_args
from services.engine.tools.model_fetch import local_model
from services.worker.core_client import EngineCoreClient
from services.worker.metrics import WorkerMetrics
from services.worker.server import WorkerServicer, heartbeat_loop, index_loop

ROLES = ("prefill", "decode", "unified")


async def serve(args) -> int:
    """Serve until stopped (0) or until the engine core dies (1: the supervisor starts the worker again)."""
    config = args.engine.to_engine_config(args.model)
    try:
        place = topology()  # rack/node/domain, for the router's tie-break between close and far workers
    except ValueError as e:
        raise SystemExit(f"{args.role} worker: {e}") from None
    loop = asyncio.get_running_loop()
    server = rpc.Server(["Worker"], args.port, args.host)
    # unique per replica: on every interface (a container) its hostname names it, replicas sharing a port
    worker_id = args.worker_id or (f"{args.role}-{server.address.replace(':', '-')}" if args.host in rpc.ANY_HOST
                                   else f"{args.role}-{server.port}")
    died: list = []

    def on_dead(why: str) -> None:
        died.append(why)
        server.stopping.set()  # deregister, let the failed calls end, exit non-zero

    runner = EngineCoreClient(config, loop, WorkerMetrics(args.role, worker_id), threads=args.engine.threads or 1,
                          on_dead=on_dead, omp_wait_policy=args.engine.omp_wait_policy)
    try:
        await runner.ready()
    except ModelLoadError as e:
        runner.stop()
        raise SystemExit(f"{args.role} worker: {e}") from None
    if args.startup_delay_s > 0:  # benchmarks: a model that loads this much slower (the autoscaler's horizon)
        await asyncio.sleep(args.startup_delay_s)
    servicer = await WorkerServicer(runner, args.role, worker_id, kv_transport=args.kv_transport,
                                    kv_pool=args.kv_pool, metrics=runner.metrics).start()
    pb_grpc.add_WorkerServicer_to_server(servicer, server.server)
    publisher = publishing = None
    if args.redis_url and args.role in ("prefill", "unified") and config.cache.enable_prefix_caching:
        from services.common.prefix_index import IndexPublisher, connect
        publisher = IndexPublisher(connect(args.redis_url), worker_id)
        publishing = asyncio.create_task(index_loop(runner, publisher))
    routers = args.router.split(",")  # every router hears every heartbeat: none holds state the others lack
    beats = [asyncio.create_task(heartbeat_loop(runner, router, worker_id, server.address, args.role,
                                                on_first=lambda: server.set_serving(True), publisher=publisher,
                                                kv_pool=args.kv_pool, topology=place))
             for router in routers]

    async def deregister(router: str) -> None:
        try:
            await pb_grpc.RouterStub(rpc.channel(router)).Deregister(pb.WorkerId(worker_id=worker_id), timeout=1)
        except Exception:
            pass  # the router drops silent workers anyway

    async def on_stop():
        servicer.close_credits()
        for beat in beats:
            beat.cancel()
        if publishing is not None:
            publishing.cancel()
            await publisher.withdraw()
        await asyncio.gather(*(deregister(r) for r in routers))

    print(f"{args.role} worker {worker_id} listening on {server.address} (engine core pid {runner.process.pid})",
          flush=True)
    await server.run(grace_s=0.5 if died else args.grace_s, on_stop=on_stop)
    runner.stop()
    if died:
        print(f"{args.role} worker {worker_id}: {died[0]}; exiting", flush=True)
        return 1
    return 0


def parser(role: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"python -m services.{role or 'worker'}", description=__doc__)
    if role is None:
        ap.add_argument("--role", required=True, choices=ROLES)
    ap.add_argument("--model", default=envs.MODEL.get(),
                    help="the model folder, or a fetched known model's name (config mesh.model; env MESHSERVE_MODEL)")
    ap.add_argument("--router", default=envs.ROUTER_ADDR.get(default=f"127.0.0.1:{rpc.DEFAULT_PORTS['router']}"),
                    help="router address, or several separated by commas (heartbeats go to each)")
    rpc.add_server_flags(ap, envs.WORKER_PORT, grace_s=10.0)
    ap.add_argument("--worker-id")
    ap.add_argument("--redis-url", default=envs.REDIS_URL.get(),
                    help="publish KV block events to the prefix index here (prefill and unified roles; env REDIS_URL)")
    ap.add_argument("--kv-transport", choices=("auto", "grpc", "shm"), default=envs.KV_TRANSPORT.get(),
                    help="KV blocks to and from the kvstore: auto = shared memory on its host, else gRPC; grpc or shm "
                         "forces one (shm fails where the kvstore is on another host; config kv.transport; env "
                         "KV_TRANSPORT)")
    ap.add_argument("--kv-pool", action=argparse.BooleanOptionalAction,
                    default=envs.KV_POOL.get() or None,
                    help="take a prompt's blocks from the kvstore's pool when it holds more of them than this engine "
                         "caches, and (unified role) push computed prompt blocks there (config kv.pool; env KV_POOL)")
    ap.add_argument("--pool", default=envs.POOL.get(),
                    help="the pool it belongs to, for the autoscaler (its metrics carry the resource attribute "
                         "meshserve.pool): a named group of workers such as one adapter group's; default: its role")
    ap.add_argument("--startup-delay-s", type=float, default=envs.STARTUP_DELAY_S.get(),
                    help="wait this long after the model loads before serving: emulates a slow load (benchmarks of "
                         "the autoscaler; env MESHSERVE_STARTUP_DELAY_S)")
    add_config_flag(ap)
    add_section_flags(ap, "engine")
    add_metrics_flag(ap)
    return ap


def main(role: str | None = None) -> None:
    ap = parser(role)
    args = ap.parse_args()
    if role:
        args.role = role
    cfg = config_from_args(ap, args, "engine", own={"kv.transport": args.kv_transport, "kv.pool": args.kv_pool,
                                                    "mesh.model": args.model})
    if not cfg.mesh.model:
        ap.error("no model: give --model, MESHSERVE_MODEL or mesh.model in the config file")
    try:
        args.model = local_model(cfg.mesh.model)
    except ModelLoadError as e:
        ap.error(str(e))
    args.engine, args.kv_transport, args.kv_pool = cfg.engine, cfg.kv.transport, cfg.kv.pool
    announce(f"{args.role} worker", cfg, "engine", "kv.transport", "kv.pool", "mesh.model")
    setup_telemetry(args.role, args.metrics_port, args.host, log_name=f"{args.role}-worker",
                    attributes={POOL_ATTRIBUTE: args.pool or args.role})
    sys.exit(asyncio.run(serve(args)))


if __name__ == "__main__":
    main()
