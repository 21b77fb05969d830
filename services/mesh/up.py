"""`meshserve up` and `meshserve client`: run the mesh on loopback, and send it JSONL requests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
from pathlib import Path

import grpc

from services.common import envs, rpc
from services.common.convert import request_from_line
from services.common.errors import MeshError
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.common.prefix_index import redacted
from services.config.loader import ConfigError, load_mesh_config
from services.config.sections import MeshConfig

TINY_MODEL = Path("models/tiny")  # `--model tiny`, and the fallback when the default cannot be fetched
MESH_KV_CACHE_GB = 0.25  # per worker, when the file does not say: three workers fit a small machine
DEFAULT_PORTS = {**rpc.DEFAULT_PORTS, "http": 8000, "autoscaler": 50054,
                 "supervisor": 50055}  # docs/INTERFACES.md; supervisor: ours


# What, set in the config (file or environment), leaves the machine's defaults (services.policy.machine) unused
TOPOLOGY_KEYS = frozenset({"mode", "prefill", "decode", "unified", "hosts", "worker_pools"})
WEIGHT_FORM_KEYS = frozenset({"dtype", "quantization"})


def machine_defaults(cfg: MeshConfig, level: str, cores: int, worker_kv_gb: float) -> tuple[MeshConfig, dict, list]:
    """cfg with the machine's serving defaults where it leaves them open, the engine settings so chosen (the workers
    read the config file themselves: `up` passes these as flags), and a line per default taken: the weight form
    where neither engine.dtype nor engine.quantization is set; the topology where no mesh key of it is, nor the
    autoscaler (whose pools name the roles), nor tensor parallelism. A unified worker taken so gets the KV memory
    the three workers of the split would have had (worker_kv_gb each), unless the config sizes it."""
    from services.policy.machine import serving_defaults

    d = serving_defaults(level, cores)
    engine, mesh, lines = {}, {}, []
    why = dict(d.reasons)
    if not WEIGHT_FORM_KEYS & cfg.engine.model_fields_set:
        engine.update(dtype=d.dtype, quantization=d.quantization)
        lines.append(f"engine.dtype {d.dtype}, quantization {d.quantization}: {why[f'engine.dtype {d.dtype}']}")
    if not (TOPOLOGY_KEYS & cfg.mesh.model_fields_set or cfg.autoscaler.enabled or cfg.engine.tensor_parallel_size > 1):
        mesh["mode"] = d.mode
        if d.mode == "unified" and "threads" not in cfg.engine.model_fields_set:
            engine["threads"] = d.unified_threads
        if d.mode == "unified" and not {"kv_cache_gb", "num_blocks"} & cfg.engine.model_fields_set:
            engine["kv_cache_gb"] = round(3 * worker_kv_gb, 2)
        lines.append(f"mesh.mode {d.mode}" + (f", 1 worker of {d.unified_threads} threads" if d.mode == "unified"
                                              else "") + f": {why[f'mesh.mode {d.mode}']}")
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update=engine),
                                 "mesh": cfg.mesh.model_copy(update=mesh)})
    return cfg, engine, lines


def mesh_spec(cfg: MeshConfig, model: Path, args, chosen: dict | None = None):
    """The processes `meshserve up` starts, from the validated config and the command's ports. Every
    service also reads the config file itself; the flags here carry what `up` decides beyond it: the engine
    settings it chose for the machine (chosen: machine_defaults'; threads go by MeshSpec.threads), a default KV
    pool."""
    from services.mesh.launcher import MeshSpec

    set_keys = cfg.engine.model_fields_set
    engine_args = [] if {"kv_cache_gb", "num_blocks"} & set_keys else ["--kv-cache-gb", str(default_kv_gb(model))]
    for key, value in (chosen or {}).items():
        if key != "threads":
            engine_args += [f"--{key.replace('_', '-')}", str(value)]
    m = cfg.mesh
    names = args.served_model_name or m.served_model_name
    return MeshSpec(str(model), mode=m.mode, prefill=m.prefill, decode=m.decode, unified=m.unified,
                    routers=m.router, engine_args=engine_args, policy=cfg.routing.policy,
                    routing=cfg.routing.model_dump(include={"weights", "guard"}), threads=cfg.engine.threads or 1,
                    gateway_port=args.port, http_port=args.http_port, router_port=args.router_port,
                    kvstore_port=args.kvstore_port, config_file=args.config, tls=m.tls, public_tls=m.public_tls,
                    gateway_args=["--served-model-name", *names] if names else [], kv_transport=cfg.kv.transport,
                    kv_pool=cfg.kv.pool, kvstore_budget_gb=cfg.kv.budget_gb,
                    worker_pools={name: group.model_dump() for name, group in m.worker_pools.items()},
                    tensor_parallel_size=cfg.engine.tensor_parallel_size,
                    hosts=[h.host() for h in m.hosts], control_address=m.control_address)


def default_kv_gb(model: Path) -> float:
    """A worker's KV pool when the config does not size it: MESH_KV_CACHE_GB, or more where one request
    of the model's whole context (float32 K and V, every layer) would not fit in that."""
    try:
        cfg = json.loads((model / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * 4
        need = per_token * cfg["max_position_embeddings"] * 1.02 / 1024**3  # + room for block rounding
    except (OSError, ValueError, KeyError, TypeError):
        return MESH_KV_CACHE_GB  # the workers load the folder and report what is wrong with it
    return max(MESH_KV_CACHE_GB, round(need + 0.005, 2))


def resolve_model(name: str | None) -> Path:
    """The folder to serve: a folder as given; a GGUF file, imported into the cache once; `tiny` (written if
    absent); a known model name, fetched and cached. With no name, the default real model; if it cannot be fetched,
    the tiny one, said loudly."""
    from services.engine.tools.model_fetch import DEFAULT_MODEL, KNOWN_MODELS, fetch, from_gguf_file
    from services.engine.tools.model_init import write_model

    if name == "tiny":
        if not (TINY_MODEL / "config.json").exists():
            print(f"writing the seeded tiny model to {TINY_MODEL}", flush=True)
            write_model(TINY_MODEL, "tiny")
        return TINY_MODEL
    if name is not None and name.endswith(".gguf"):
        try:
            return from_gguf_file(name, log=lambda m: print(m, flush=True))
        except MeshError as e:
            raise SystemExit(f"meshserve: {e}") from None
    if name is not None and name not in KNOWN_MODELS:
        if not (Path(name) / "config.json").exists():
            raise SystemExit(f"{name}: no config.json (give a Hugging Face model folder, a GGUF file, tiny, or one "
                             f"of: {', '.join(KNOWN_MODELS)})")
        return Path(name)
    try:
        return fetch(name or DEFAULT_MODEL, log=lambda m: print(m, flush=True))
    except MeshError as e:
        if name is not None:
            raise SystemExit(f"meshserve: {e}") from None
        print(f"WARNING: could not fetch the default model {DEFAULT_MODEL} ({e}); serving the seeded tiny model "
              "instead, whose answers are random text. Fetch it later with: meshserve model fetch "
              f"{DEFAULT_MODEL}", file=sys.stderr, flush=True)
        return resolve_model("tiny")


def with_command_line(cfg: MeshConfig, args) -> MeshConfig:
    """cfg with what up's own flags set (--engine, --mode and the pools' worker counts) over the config file."""
    mesh = {k: getattr(args, k) for k in ("mode", "prefill", "decode", "unified") if getattr(args, k, None) is not None}
    engine = {"backend": args.engine} if getattr(args, "engine", None) else {}
    if engine.get("backend") == "mock" and getattr(args, "mock_profile", None):
        engine["mock_profile"] = args.mock_profile
    if not mesh and not engine:
        return cfg
    return cfg.model_copy(update={"mesh": cfg.mesh.model_copy(update=mesh),
                                  "engine": cfg.engine.model_copy(update=engine)})


def cmd_up(args) -> int:
    from services.mesh import supervisor
    from services.mesh.launcher import Mesh, RestartLimit

    try:
        cfg = load_mesh_config(args.config)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    model = resolve_model(args.model or cfg.mesh.model)
    print(f"serving {model}", flush=True)
    from services.engine.layers.kernels import host_isa

    cores = len(os.sched_getaffinity(0))
    cfg = with_command_line(cfg, args)
    if cfg.engine.backend == "mock":  # no model runs: nothing about this machine's CPU to choose by
        chosen = {k: getattr(cfg.engine, k) for k in ("backend", "mock_profile", "mock_time_scale", "mock_kv")}
        print(f"engine: mock (step times of {cfg.engine.mock_profile}, time scale {cfg.engine.mock_time_scale:g}; "
              "no weights are loaded, tokens are hashes: docs/CLUSTER.md)", flush=True)
    else:
        cfg, chosen, lines = machine_defaults(cfg, host_isa(), cores, default_kv_gb(model))
        for line in lines:
            print(f"default for this machine ({cores} cores, kernel level {host_isa()}): {line}", flush=True)
    spec = mesh_spec(cfg, model, args, chosen)
    scaling = cfg.autoscaler
    autoscaler_port = 0
    if scaling.enabled:
        from services.mesh.launcher import free_port

        if envs.OTLP_ENDPOINT.get() or envs.OTLP_METRICS_ENDPOINT.get():
            print("the autoscaler needs the workers' metrics: OTLP already goes elsewhere, so have your collector "
                  "send metrics to the autoscaler's port too", flush=True)
        else:
            autoscaler_port = args.autoscaler_port or free_port()
            spec.env.update({envs.OTLP_METRICS_ENDPOINT.name: f"http://127.0.0.1:{autoscaler_port}",
                             "OTEL_METRIC_EXPORT_INTERVAL": str(scaling.export_interval_ms)})
    mesh = Mesh(spec)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting the mesh ({spec.mode}); logs in {mesh.log_dir}", flush=True)
    lock, control = threading.Lock(), None

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    tenants = cfg.tenants
    print(f"{len(tenants)} tenant(s) from {args.config}" if tenants else
          "no tenants configured: one open default tenant (no API key needed)", flush=True)
    try:
        mesh.start()
        print(mesh.gateway, flush=True)
        print(mesh.http, flush=True)
        print(f"try: meshserve client --target {mesh.gateway} --input requests.jsonl --output out.jsonl", flush=True)
        print("metrics (Prometheus text): " + ", ".join(f"{p.name} {p.metrics_url}" for p in mesh.procs
                                                        if p.metrics_url),
              flush=True)
        redis = redacted(mesh.redis_url)
        if mesh.tls_dir:
            print(f"internal services speak mutual TLS (certificates in {mesh.tls_dir}; the gateway's public ports "
                  + ("use TLS too: clients trust ca.pem there)" if mesh.spec.public_tls else "are plain)"), flush=True)
        pools = mesh.pools()
        control, control_address = supervisor.serve(mesh, lock, pools, args.supervisor_port, say=say,
                                                    tls_dir=mesh.tls_dir)
        tls = f" --tls-dir {mesh.tls_dir}" if mesh.tls_dir else ""
        print(f"scaling: meshserve scale POOL N --supervisor {control_address}{tls} (pools: {', '.join(pools)})",
              flush=True)
        if scaling.enabled:
            with lock:
                scaler = mesh.start_autoscaler(autoscaler_port or args.autoscaler_port or free_port(), control_address,
                                               pools)
            print(f"autoscaler ({scaling.policy}) on {scaler.address}, scaling {', '.join(pools)}; its decisions in "
                  f"{scaler.log}", flush=True)
        print(f"meshserve is ready: gateway {mesh.gateway}, HTTP {mesh.http}, router {','.join(mesh.routers)}, "
              f"kvstore {mesh.kvstore}, redis {redis}", flush=True)
        while not stop.wait(0.2):
            try:
                with lock:
                    mesh.supervise(say)
                    mesh.check_health()
            except RestartLimit as e:
                print(f"stopping: {e}", file=sys.stderr, flush=True)
                return 1
        return 0
    finally:
        if control is not None:
            control.stop(0)
        print("stopping the mesh", flush=True)
        with lock:
            mesh.stop()
        print("stopped", flush=True)


async def _one(stub, obj: dict, metadata) -> dict:
    out = {"id": obj.get("id"), "token_ids": [], "text": ""}
    try:
        async for r in stub.Generate(request_from_line(obj), metadata=metadata):
            out["token_ids"] += list(r.token_ids)
            out["text"] += r.text
            out["prompt_tokens"], out["cached_prompt_tokens"] = r.prompt_tokens, r.cached_prompt_tokens
            if r.finish_reason:
                out["finish_reason"] = r.finish_reason
    except grpc.aio.AioRpcError as e:
        return {"id": obj.get("id"), "error": {"code": e.code().name, "message": e.details()}}
    return out


async def _client(args) -> int:
    lines = [json.loads(t) for t in Path(args.input).read_text().splitlines() if t.strip()]
    sem = asyncio.Semaphore(args.concurrency)
    metadata = (("x-api-key", args.api_key),) if args.api_key else None
    channel = (grpc.aio.secure_channel(args.target, grpc.ssl_channel_credentials(Path(args.ca).read_bytes()))
               if args.ca else grpc.aio.insecure_channel(args.target))
    async with channel as ch:
        stub = pb_grpc.GenerationStub(ch)

        async def bounded(obj):
            async with sem:
                return await _one(stub, obj, metadata)

        results = await asyncio.gather(*(bounded(o) for o in lines))
    Path(args.output).write_text("".join(json.dumps(r) + "\n" for r in results))
    print(json.dumps({"requests": len(results), "errors": sum("error" in r for r in results)}), file=sys.stderr)
    return 0


def cmd_client(args) -> int:
    return asyncio.run(_client(args))


def cmd_scale(args) -> int:
    from services.mesh.launcher import client_channel

    try:
        ch = client_channel(args.supervisor, args.tls_dir)  # as the operator (`client`) over the mesh's mutual TLS
    except OSError as e:
        print(f"meshserve scale: cannot read the mesh's certificates in {args.tls_dir}: {e}", file=sys.stderr)
        return 2
    with ch:
        try:
            state = pb_grpc.SupervisorStub(ch).Scale(pb.ScaleRequest(pool=args.pool, replicas=args.replicas,
                                                                     reason="meshserve scale"), timeout=30)
        except grpc.RpcError as e:
            hint = ""
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                hint = (" (is `meshserve up` running there? Its Supervisor speaks mutual TLS: pass --tls-dir, the "
                        "folder it printed)" if not args.tls_dir else " (is `meshserve up` running there, with these "
                        "certificates?)")
            print(f"meshserve scale: {e.code().name}: {e.details()}{hint}", file=sys.stderr)
            return 1
    print(f"{state.pool}: {state.ready} ready, {state.starting} starting, {state.draining} draining "
          f"({', '.join(state.workers)})")
    return 0


def add_parsers(sub) -> None:
    up = sub.add_parser("up", help="start every service as a process on loopback")
    up.add_argument("--model", help="model folder, tiny (the seeded tiny model, written to models/tiny) or a known "
                                    "model name (default: smollm2-135m-instruct, fetched and cached on first use)")
    up.add_argument("--served-model-name", nargs="+", metavar="NAME",
                    help="the name(s) requests use for the model (default: the folder's name)")
    up.add_argument("--config", help="mesh config file (YAML or TOML)")
    up.add_argument("--engine", choices=("torch", "mock"),
                    help="mock: workers with the real scheduler, KV cache and transfers and a step-time model in place "
                         "of the model's forward pass (no weights; the mesh at scale on one machine: docs/CLUSTER.md; "
                         "config engine.backend)")
    up.add_argument("--mock-profile", help="the mock engine's step-time model: a preset or a calibration file "
                                           "(config engine.mock_profile)")
    up.add_argument("--mode", choices=("disaggregated", "unified"), help="config mesh.mode")
    for pool in ("prefill", "decode", "unified"):
        up.add_argument(f"--{pool}", type=int, metavar="N", help=f"{pool} workers (config mesh.{pool})")
    up.add_argument("--port", type=int, default=DEFAULT_PORTS["gateway"], help="gateway gRPC port (0 = any free port)")
    up.add_argument("--http-port", type=int, default=DEFAULT_PORTS["http"],
                    help="the OpenAI-compatible HTTP port, also serving the gateway's /metrics (0 = any free port)")
    up.add_argument("--router-port", type=int, default=DEFAULT_PORTS["router"], help="(0 = any free port)")
    up.add_argument("--kvstore-port", type=int, default=DEFAULT_PORTS["kvstore"], help="(0 = any free port)")
    up.add_argument("--autoscaler-port", type=int, default=DEFAULT_PORTS["autoscaler"],
                    help="the autoscaler's OTLP port, when the config enables it (0 = any free port)")
    up.add_argument("--supervisor-port", type=int, default=DEFAULT_PORTS["supervisor"],
                    help="the Supervisor service (meshserve scale, the autoscaler's local actuator) on loopback "
                         "(0 = any free port)")
    up.set_defaults(func=cmd_up)
    scale = sub.add_parser("scale", help="set a pool's worker count in a running `meshserve up` (new workers start "
                                         "and register; surplus ones drain)")
    scale.add_argument("pool", help="prefill, decode or unified (the mode's), or a named group of mesh.worker_pools")
    scale.add_argument("replicas", type=int)
    scale.add_argument("--supervisor", default=f"127.0.0.1:{DEFAULT_PORTS['supervisor']}",
                       help="the Supervisor address `meshserve up` printed")
    scale.add_argument("--tls-dir", default=envs.TLS_DIR.get(default=""),
                       help="the mesh's certificates folder `meshserve up` printed (its Supervisor speaks mutual TLS; "
                            f"env {envs.TLS_DIR.name})")
    scale.set_defaults(func=cmd_scale)
    client = sub.add_parser("client", help="send JSONL requests through a running gateway")
    client.add_argument("--target", required=True, help="gateway HOST:PORT")
    client.add_argument("--input", required=True)
    client.add_argument("--output", required=True)
    client.add_argument("--concurrency", type=int, default=16)
    client.add_argument("--api-key")
    client.add_argument("--ca", help="speak TLS to the gateway, trusting this CA (PEM; a mesh with public_tls: "
                                     "ca.pem of its certificate folder)")
    client.set_defaults(func=cmd_client)
