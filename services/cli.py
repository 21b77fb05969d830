"""The `meshserve` command: model init, offline generate, bench (see shared/INTERFACES.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from services.common.errors import MeshError


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by generate, bench and the workers."""
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-blocks", type=int, help="KV pool size in blocks (default: from --kv-cache-gb)")
    g.add_argument("--kv-cache-gb", type=float, default=2.0, help="KV pool memory when --num-blocks is not given")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences per batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget per iteration, also the prefill chunk size")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--policy", default="fair-deadline",
                   help="slot arbitration policy: fcfs, priority, deadline, fair, fair-deadline (the default)")
    g.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")


def engine_config(args: argparse.Namespace, model_dir: str):
    from services.engine.config import CacheConfig, EngineConfig, SchedulerConfig

    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    return EngineConfig(
        model_dir=model_dir, dtype=args.dtype, num_threads=args.threads,
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          kv_cache_bytes=int(args.kv_cache_gb * 1024**3),
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  policy=args.policy))


def cmd_model_init(args) -> int:
    from services.engine.model_init import write_model

    path = write_model(args.dir, args.preset, args.seed)
    print(f"wrote the {args.preset} model (seed {args.seed}) to {path}")
    return 0


def cmd_generate(args) -> int:
    from services.engine.engine import LLMEngine
    from services.engine.jsonl import generate_file

    engine = LLMEngine(engine_config(args, args.model))
    summary = generate_file(engine, args.input, args.output)
    print(json.dumps(summary), file=sys.stderr)
    return 0


def cmd_tenant_key(args) -> int:
    from services.common.tenants import new_key

    key, stored = new_key()
    print(f"API key (give it to the tenant; it is not stored anywhere): {key}")
    print(f"for the mesh config file, under the tenant's api_key_hashes: {stored}")
    return 0


def cmd_bench(args) -> int:
    from bench.runner import run_workload

    return run_workload(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="meshserve", description="LLM serving as a mesh of gRPC microservices")
    sub = ap.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model folders").add_subparsers(dest="model_command", required=True)
    init = model.add_parser("init", help="write a seeded default model folder")
    init.add_argument("dir")
    init.add_argument("--preset", default="tiny", choices=["tiny", "bench"])
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(func=cmd_model_init)

    gen = sub.add_parser("generate", help="offline generation over JSONL with the in-process engine")
    gen.add_argument("--model", required=True, help="Hugging Face model folder")
    gen.add_argument("--input", required=True)
    gen.add_argument("--output", required=True)
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)

    tenant = sub.add_parser("tenant", help="tenant helpers").add_subparsers(dest="tenant_command", required=True)
    tenant.add_parser("key", help="make a new API key and the salted hash the config file stores").set_defaults(
        func=cmd_tenant_key)

    from bench.runner import add_bench_parser
    from services.up import add_parsers
    add_bench_parser(sub, cmd_bench)
    add_parsers(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MeshError as e:
        print(f"meshserve: {e.code}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
