"""python -m services.gateway: the public gRPC API of the mesh (see server.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from pathlib import Path

import grpc

from services.common import envs, rpc
from services.common.errors import ModelLoadError
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.common.telemetry import add_metrics_flag, setup_telemetry
from services.common.tokenizer import Tokenizer
from services.config.flags import add_config_flag, add_section_flags, announce, config_from_args
from services.config.sections import MeshConfig
from services.gateway.admission import Admission
from services.gateway.credits import CreditPool
from services.gateway.requests import ModelInfo, SizeBounds
from services.gateway.server import GatewayServicer, add_to_server
from services.policy.progress import ProgressWatch
from services.policy.tenants import Authenticator, cache_secret

log = logging.getLogger("meshserve.gateway")


async def watch_mesh(server: rpc.Server, routers: list, mode: str, admission: Admission,
                     period_s: float = 0.25, from_zero: frozenset = frozenset(),
                     progress: ProgressWatch | None = None) -> None:
    """Poll the routers' view of the workers (the first that answers): readiness (SERVING while a router answers
    and has the workers this mode needs) and the admission queue's capacity and cost model. Roles in from_zero
    (configured to start with no worker: the autoscaler starts one when a request waits for it) are not needed:
    the gateway must take that request and hold it."""
    stubs = [pb_grpc.RouterStub(rpc.channel(r)) for r in routers]  # channels held for the loop's lifetime
    need = ({"unified"} if mode == "unified" else {"prefill", "decode"}) - from_zero
    while True:
        for stub in stubs:
            try:
                workers = (await stub.ListWorkers(pb.ListWorkersRequest(), timeout=1)).workers
            except grpc.aio.AioRpcError:
                continue
            admission.update_view(workers, "unified" if mode == "unified" else "decode")  # a view before SERVING
            if progress is not None:  # the workers' step times bound their streams' progress
                progress.update(workers, time.monotonic())
            await server.set_serving(need <= {w.role for w in workers})
            break
        else:
            await server.set_serving(False)
        await asyncio.sleep(period_s)


async def serve(args, config: MeshConfig) -> None:
    tenants, adm = config.tenant_objects(), config.admission
    admission = Admission(adm.policy, adm.starvation_s, queue_bursts=adm.queue_bursts,
                          share_preemption=adm.share_preemption)
    model = ModelInfo.from_dir(args.model, args.served_model_name or ())
    secret, given = cache_secret(envs.CACHE_SECRET.get())
    if tenants and not given:
        log.warning("%s is not set: tenants' prefix caches are salted with a secret of this process only (lost on "
                    "restart, not shared with other gateways)", envs.CACHE_SECRET.name)
    routers = args.router.split(",")
    servicer = GatewayServicer(model, Tokenizer(args.model), routers, args.kvstore, Authenticator(tenants),
                               admission, SizeBounds.for_model(model.max_model_len, adm.max_prompt_bytes), secret,
                               no_worker_grace_s=adm.no_worker_grace_s,
                               progress=ProgressWatch(adm.progress_factor, adm.progress_floor_s,
                                                      suspect_s=adm.progress_suspect_s))
    admission.credits = CreditPool(servicer.channels, admission.pump)  # follows the workers watch_mesh finds
    if args.record_trace:
        from services.gateway.record import TraceRecorder

        servicer.recorder = TraceRecorder(args.record_trace)
    tls = (args.tls_key, args.tls_cert) if args.tls_cert else None
    public_tls = tuple(Path(f).read_bytes() for f in tls) if tls else None
    server = rpc.Server(["Generation"], args.port, args.host, public=True, public_tls=public_tls)
    add_to_server(servicer, server.server)
    from_zero = frozenset(r for r in ("prefill", "decode", "unified") if getattr(config.mesh, r) == 0)
    tasks = [asyncio.create_task(watch_mesh(server, routers, args.mode, admission, from_zero=from_zero,
                                            progress=servicer.progress)),
             asyncio.create_task(admission.tick()),
             asyncio.create_task(servicer.adapters.run())]
    http = None
    if args.http_port is not None:
        from services.gateway.http import HttpFront
        from services.gateway.http_server import http_server
        http, sock = http_server(HttpFront(servicer, args.model), args.host, args.http_port, tls)
        tasks.append(asyncio.create_task(http.serve(sockets=[sock])))
        scheme = "https" if tls else "http"
        print(f"gateway HTTP (OpenAI-compatible) on {scheme}://{args.host}:{sock.getsockname()[1]}", flush=True)
    print(f"gateway listening on {server.address}; " + (f"{len(tenants)} tenant(s)" if tenants else
          "no tenants configured: one open default tenant (no API key needed)") +
          f"; admission {admission.queue.policy.name}, starvation bound {admission.queue.starvation_s:g} s", flush=True)

    async def stop_http():
        if http is not None:
            http.should_exit = True  # stop accepting; in-flight responses finish within the grace period

    await server.run(grace_s=args.grace_s, on_stop=stop_http)
    for t in tasks:
        t.cancel()
    if servicer.recorder is not None:
        servicer.recorder.close()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    ap.add_argument("--model", default=envs.MODEL.get(),
                    help="the served model folder, config.json and tokenizer.json are read here (config mesh.model; "
                         "env MESHSERVE_MODEL)")
    ap.add_argument("--served-model-name", nargs="+", metavar="NAME",
                    help="the model name(s) requests use (the first is reported; default: the folder's name; config "
                         "mesh.served_model_name)")
    ap.add_argument("--router", default=envs.ROUTER_ADDR.get(default=f"127.0.0.1:{rpc.DEFAULT_PORTS['router']}"),
                    help="router address, or several separated by commas (Route calls spread over them and fail over)")
    ap.add_argument("--kvstore", default=envs.KVSTORE_ADDR.get(default=f"127.0.0.1:{rpc.DEFAULT_PORTS['kvstore']}"))
    ap.add_argument("--mode", default=envs.ROUTER_MODE.get(), choices=["disaggregated", "unified"],
                    help="which workers readiness waits for (config mesh.mode; env ROUTER_MODE)")
    add_config_flag(ap)
    add_section_flags(ap, "admission", prefix="admission-")
    ap.add_argument("--record-trace", default=envs.RECORD_TRACE.get(), metavar="FILE",
                    help="append one line per request answered to this JSONL trace (the simulator's format: "
                         "`meshserve sim --trace FILE` replays it)")
    ap.add_argument("--http-port", type=int, default=envs.GATEWAY_HTTP_PORT.get(),
                    help="serve the OpenAI-compatible HTTP API on this port (0 = any free port; default: off)")
    ap.add_argument("--tls-cert", default=envs.GATEWAY_TLS_CERT.get(),
                    help="serve the public gRPC and HTTP ports over TLS with this PEM certificate (chain) ...")
    ap.add_argument("--tls-key", default=envs.GATEWAY_TLS_KEY.get(), help="... and this PEM private key")
    rpc.add_server_flags(ap, envs.GATEWAY_PORT, grace_s=10.0, default_port=rpc.DEFAULT_PORTS["gateway"])
    add_metrics_flag(ap)
    args = ap.parse_args()
    if bool(args.tls_cert) != bool(args.tls_key):
        ap.error("--tls-cert and --tls-key go together")
    config = config_from_args(ap, args, "admission", own={
        "mesh.mode": args.mode, "mesh.model": args.model, "mesh.served_model_name": args.served_model_name})
    if not config.mesh.model:
        ap.error("no model: give --model, MESHSERVE_MODEL or mesh.model in the config file")
    args.model, args.mode = config.mesh.model, config.mesh.mode
    if not Path(args.model).is_dir():  # a known model's name: its folder in the cache (engine code, loaded lazily)
        from services.engine.tools.model_fetch import local_model
        try:
            args.model = local_model(args.model)
        except ModelLoadError as e:
            ap.error(str(e))
    args.served_model_name = config.mesh.served_model_name
    setup_telemetry("gateway", args.metrics_port, args.host)
    announce("gateway", config, "admission", "tenants", "mesh.mode", "mesh.model", "mesh.served_model_name")
    asyncio.run(serve(args, config))


if __name__ == "__main__":
    main()
