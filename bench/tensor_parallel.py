"""Workload tensor-parallel: one engine split over two ranks against the same engine whole (issue 40).

    meshserve bench tensor-parallel --model ~/.cache/meshserve/models/smollm2-135m-instruct [--dtype bfloat16]

The engine alone (no mesh), on every core: TP=1 with 2 threads against TP=2 with 1 thread per rank (the same
cores). Both engines are built once in this process and run alternately, three times each (torch's thread count
set before each run: it is per process); the median of each kept, every run reported.
1. Single stream: one request (128 random prompt tokens, 128 outputs, greedy); TPOT is the median decode step.
2. Mixed batch: engine-mixed's requests (--num-requests, default 128: prompts uniform 32-512 random tokens,
   outputs uniform 16-256, greedy, seed 0), every run with an empty prefix cache.
3. The collectives: time inside them per step on rank 0 (TP=2 runs: the two all-reduces per layer and the logits'
   gather, waits for the slower rank included), and their own latency alone: two processes doing nothing else
   (`all_reduce` of [rows, hidden] in the run's dtype, 2,000 calls after 200 warm-up), at 1 and 256 rows.
Metrics: tpot_ms and output_tokens_per_s per configuration, the TP=2/TP=1 ratios, collective ms per step.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from pathlib import Path

import torch

from bench.common import default_model, log, machine, print_table, random_requests, write_result

CONFIGS = {"tp1-2threads": (1, 2), "tp2-1thread": (2, 1)}  # name -> (ranks, threads per rank)


def add_flags(p) -> None:
    g = p.add_argument_group("tensor-parallel")
    g.add_argument("--tp-runs", type=int, default=3, help="tensor-parallel: alternating runs per configuration")


def _engine(model_dir: Path, args, ranks: int, threads: int):
    from services.config.engine import CacheConfig, EngineConfig, SchedulerConfig
    from services.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(
        str(model_dir), dtype=args.dtype, quantization="none", num_threads=threads, tensor_parallel_size=ranks,
        cache=CacheConfig(kv_cache_bytes=int(args.kv_cache_gb * 1024**3)),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)))


def run(args) -> int:
    model_dir = Path(args.model) if args.model else default_model("bench")
    engines = {}
    for name, (ranks, threads) in CONFIGS.items():
        log(f"{name}: starting")
        engines[name] = _engine(model_dir, args, ranks, threads)
    vocab = engines["tp1-2threads"].info.vocab_size
    n = args.num_requests or (16 if args.quick else 128)
    reqs = random_requests(n, (32, 512), (16, 256), vocab=vocab, seed=args.seed)
    stream = random_requests(1, (128, 128), (128, 128), vocab=vocab, seed=args.seed + 7)
    runs = {name: {"tpot": [], "mixed": [], "collective_ms_per_step": []} for name in CONFIGS}
    for name, engine in engines.items():
        torch.set_num_threads(CONFIGS[name][1])
        _run(engine, random_requests(16, (32, 256), (16, 16), vocab=vocab, seed=args.seed + 1000), "w")  # warm-up
    for rep in range(1 if args.quick else args.tp_runs):
        for name, engine in engines.items():
            torch.set_num_threads(CONFIGS[name][1])
            runs[name]["tpot"].append(_run(engine, stream, f"s{rep}")["tpot_ms"])
            mixed = _run(engine, reqs, f"m{rep}")
            runs[name]["mixed"].append(mixed)
            log(f"{name} run {rep}: TPOT {runs[name]['tpot'][-1]:.2f} ms, mixed {mixed['output_tokens_per_s']} tok/s")
    systems = {}
    for name, r in runs.items():
        mixed = sorted(r["mixed"], key=lambda m: m["output_tokens_per_s"])[len(r["mixed"]) // 2]
        systems[name] = {"tpot_ms": round(statistics.median(r["tpot"]), 2),
                         "tpot_ms_runs": [round(t, 2) for t in r["tpot"]],
                         "output_tokens_per_s": mixed["output_tokens_per_s"],
                         "output_tokens_per_s_runs": [m["output_tokens_per_s"] for m in r["mixed"]],
                         "collective_ms_per_step": mixed["collective_ms_per_step"],
                         "collective_share_of_step": mixed["collective_share_of_step"],
                         "steps": mixed["steps"], "wall_s": mixed["wall_s"]}
    for engine in engines.values():
        engine.close()
    mc = engines["tp1-2threads"].model_config
    dtype = getattr(torch, args.dtype)
    systems["allreduce-alone"] = {f"rows_{rows}_us": _probe_allreduce(rows, mc.hidden_size, dtype) for rows in (1, 256)}
    a, b = systems["tp2-1thread"], systems["tp1-2threads"]
    ratios = {"tp2/tp1:output_tokens_per_s": round(a["output_tokens_per_s"] / b["output_tokens_per_s"], 3),
              "tp2/tp1:tpot_ms": round(a["tpot_ms"] / b["tpot_ms"], 3)}
    config = {"requests": n, "prompt_tokens": [32, 512], "output_tokens": [16, 256], "seed": args.seed,
              "single_stream": {"prompt_tokens": 128, "output_tokens": 128}, "model": str(model_dir),
              "dtype": args.dtype, "configs": {k: {"ranks": r, "threads_per_rank": t} for k, (r, t) in CONFIGS.items()},
              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              "kv_cache_gb": args.kv_cache_gb, "collectives_per_step": 2 * mc.num_layers + 1}
    result = {"workload": "tensor-parallel", "command": args.command_line, "machine": machine(), "config": config,
              "systems": systems, "ratios": ratios}
    write_result(result, args.out)
    print_table(result)
    return 0


def _run(engine, reqs: list, tag: str) -> dict:
    from services.common.sampling import SamplingParams

    engine.kv.pool.reset_prefix_cache()
    for r in reqs:
        engine.add_request(f"{tag}-{r['id']}", r["prompt_token_ids"], SamplingParams(
            max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True))
    group = engine.group
    spent0 = group.collectives.spent_s if group else 0.0
    steps, decode_steps, n_out = 0, [], 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        if engine.last_step is not None and engine.last_step.num_tokens == engine.last_step.num_running:
            decode_steps.append(time.perf_counter() - t)
        steps += 1
        n_out += sum(len(o.new_token_ids) for o in outs)
    wall = time.perf_counter() - t0
    spent = (group.collectives.spent_s - spent0) if group else 0.0
    return {"output_tokens_per_s": round(n_out / wall, 1), "wall_s": round(wall, 3), "steps": steps,
            "tpot_ms": statistics.median(decode_steps) * 1e3 if decode_steps else 0.0,
            "collective_ms_per_step": round(spent / steps * 1e3, 3) if steps else 0.0,
            "collective_share_of_step": round(spent / wall, 4)}


def _probe_peer(setup: tuple) -> None:
    path, nbytes, cap, rows, hidden, dtype, iters = setup
    from services.engine.parallel import SharedMemory, ShmCollectives

    torch.set_num_threads(1)
    coll = ShmCollectives(SharedMemory(nbytes, "probe", path), 1, 2, cap, [1, 1])
    x = torch.ones(rows, hidden, dtype=dtype)
    for _ in range(iters):
        coll.all_reduce(x)


def _probe_allreduce(rows: int, hidden: int, dtype: torch.dtype, iters: int = 2000, warm: int = 200) -> float:
    """Microseconds per all-reduce of [rows, hidden] between two processes that do nothing else."""
    from services.engine.parallel import SharedMemory, ShmCollectives, allreduce_region_bytes

    cap = -(-rows * hidden * 4 // 4096) * 4096
    nbytes = allreduce_region_bytes(2, cap)
    region = SharedMemory(nbytes, "probe")
    peer = multiprocessing.get_context("spawn").Process(
        target=_probe_peer, args=((region.path, nbytes, cap, rows, hidden, dtype, warm + iters),), daemon=True)
    peer.start()
    coll = ShmCollectives(region, 0, 2, cap, [1, 1])
    x = torch.ones(rows, hidden, dtype=dtype)
    for _ in range(warm):
        coll.all_reduce(x)
    t0 = time.perf_counter()
    for _ in range(iters):
        coll.all_reduce(x)
    us = (time.perf_counter() - t0) / iters * 1e6
    peer.join(10)
    region.close()
    return round(us, 2)
