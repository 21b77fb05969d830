"""Workload structured: what structured outputs cost the engine (issue 41).

    meshserve bench structured --model ~/.cache/meshserve/models/smollm2-135m-instruct [--dtype bfloat16]

Two measurements, one process on every core, the engine alone (no mesh):
1. The grammar's cost per step at batch 1 and batch 64: requests constrained by SCHEMA (a JSON array of
   objects), greedy, every step's time in the grammar engine (masks filled + tokens fed: StepStats.grammar_s)
   beside the step's own time.
2. Throughput of a mixed batch: 128 requests (prompts uniform 32-512 random tokens, outputs uniform 16-256,
   greedy, seed 0) with every fourth one constrained by SCHEMA, against the same requests all free, run
   alternately three times each (free, mixed, free, ...), the median of each kept (every run reported). Every
   run starts with an empty prefix cache (the runs repeat the same prompts).
   SCHEMA's array needs more items than any output holds, so a constrained request runs to its max_tokens like
   a free one (EOS ignored) and both runs make the same tokens (the grammar's work per token is that of any
   array of objects).
Engine limits, --dtype and --num-requests: engine-mixed's flags. Metrics: output_tokens_per_s per run, the
mixed/free ratio (target >= 0.9), grammar ms per step and its share of the step.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from bench.common import default_model, log, machine, print_table, random_requests, write_result
from bench.engine_mixed import engine_for

SCHEMA = {"type": "array", "minItems": 10_000, "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "score": {"type": "integer", "minimum": 0, "maximum": 100},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "score", "tags"], "additionalProperties": False}}


def add_flags(p) -> None:
    g = p.add_argument_group("structured")
    g.add_argument("--constrained-share", type=float, default=0.25,
                   help="structured: share of constrained requests in the mixed run (default 0.25)")


def run(args) -> int:
    threads = args.threads or os.cpu_count()
    torch.set_num_threads(threads)
    model_dir = Path(args.model) if args.model else default_model("bench")
    engine = engine_for(model_dir, args)
    if engine.tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer.json: structured outputs need one")
    vocab = engine.info.vocab_size
    n = args.num_requests or (32 if args.quick else 128)
    reqs = random_requests(n, (32, 512), (16, 256), vocab=vocab, seed=args.seed)
    every = max(1, round(1 / args.constrained_share)) if args.constrained_share > 0 else 0
    log("warm-up")
    _run(engine, random_requests(16, (32, 256), (16, 16), vocab=vocab, seed=args.seed + 1000), every=2, tag="w")
    systems = {}
    for batch in (1, 64):
        out = _run(engine, random_requests(batch, (64, 64), (128, 128), vocab=vocab, seed=args.seed + batch),
                   every=1, tag=f"b{batch}")
        systems[f"constrained-batch-{batch}"] = out
    runs = {"free": [], "mixed": []}
    for rep in range(1 if args.quick else 3):
        for kind in ("free", "mixed"):
            runs[kind].append(_run(engine, reqs, every=every if kind == "mixed" else 0, tag=f"{kind}{rep}"))
    for kind, results in runs.items():
        systems[kind] = sorted(results, key=lambda r: r["output_tokens_per_s"])[len(results) // 2]
        systems[kind]["runs_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in results]
    config = {"requests": n, "prompt_tokens": [32, 512], "output_tokens": [16, 256], "seed": args.seed,
              "constrained_every": every, "schema": SCHEMA, "model": str(model_dir), "dtype": args.dtype,
              "threads": threads, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_gb": args.kv_cache_gb}
    ratios = {"mixed/free:output_tokens_per_s": round(systems["mixed"]["output_tokens_per_s"]
                                                      / systems["free"]["output_tokens_per_s"], 3)}
    result = {"workload": "structured", "command": args.command_line, "machine": machine(), "config": config,
              "systems": systems, "ratios": ratios}
    write_result(result, args.out)
    print_table(result)
    return 0


def _run(engine, reqs: list, every: int, tag: str) -> dict:
    """Run reqs to the end (every `every`-th one constrained by SCHEMA; 0: none); throughput and grammar time."""
    from services.common.sampling import Guided, SamplingParams

    guided = Guided("json", json.dumps(SCHEMA))
    engine.kv.pool.reset_prefix_cache()  # each run starts cold: no run reads prompts an earlier one left cached
    for i, r in enumerate(reqs):
        constrained = every and i % every == 0
        engine.add_request(tag + r["id"], r["prompt_token_ids"], SamplingParams(
            max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True, guided=guided if constrained else None))
    n_out, steps, grammar_s, step_s, finished = 0, 0, 0.0, 0.0, {}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        s = engine.last_step
        n_out += sum(len(o.new_token_ids) for o in outs)
        finished.update({o.req_id: o.finish_reason for o in outs if o.finished})
        steps, grammar_s, step_s = steps + 1, grammar_s + s.grammar_s, step_s + s.step_s
    wall = time.perf_counter() - t0
    reasons = {r: sum(1 for x in finished.values() if x == r) for r in set(finished.values())}
    log(f"{tag}: {len(reqs)} requests ({sum(1 for i in range(len(reqs)) if every and i % every == 0)} constrained), "
        f"{n_out} tokens in {wall:.2f} s, {steps} steps, grammar {grammar_s * 1e3 / max(steps, 1):.3f} ms/step")
    return {"output_tokens_per_s": round(n_out / wall, 1), "output_tokens": n_out, "wall_s": round(wall, 3),
            "steps": steps, "grammar_ms_per_step": round(grammar_s * 1e3 / max(steps, 1), 4),
            "grammar_share_of_step": round(grammar_s / step_s, 4) if step_s else None, "finish_reasons": reasons}
