"""Workload prefix-shared: round robin vs least-outstanding vs prefix-aware routing.

8 system prompts of 1,024-2,048 tokens with Zipf(1.0) popularity; each of 400 requests is a
system prompt + 32-128 unique tokens, output 32-64 tokens (greedy, EOS ignored). 4 unified
workers, bench preset, one torch thread each; each worker's KV pool holds about 2 of the 8
system prompts (2 x their mean length, plus one request's own tail), so no worker can keep them
all. Saturation is measured first with least-outstanding (a burst of the first 100 requests at
once); then each policy, on a fresh mesh (cold caches), gets the same Poisson arrivals at 70% of
it. "+pool": the workers also take a prompt's blocks from the kvstore's content-addressed pool when it holds
more of them than they cache, and push the blocks they compute there (the prefix-aware router counts a
pool-resident prefix as a cheaper-than-compute hit). Per policy: prefill tokens actually computed, prefix hit rate (cached ÷ prompt tokens), TTFT,
output tokens/s, and load imbalance (max/mean of the workers' outstanding tokens, sampled every
100 ms while the mean is > 0).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from bench.common import default_model, log, machine, print_table, write_result
from bench.latency import summarize
from bench.online import compare_policies
from services.launcher import Mesh, MeshSpec

POLICIES = ("round-robin", "least-outstanding", "prefix-aware", "round-robin+pool", "prefix-aware+pool")
POOL = "+pool"  # the workers take prompts' blocks from the kvstore's pool and push theirs there
BLOCK = 16


def add_flags(p) -> None:
    g = p.add_argument_group("prefix-shared")
    g.add_argument("--prefix-load", type=float, default=0.7, help="arrival rate as a fraction of saturation")
    g.add_argument("--policies", default="", help=f"comma-separated subset of {', '.join(POLICIES)} (default: all)")


def workload(n: int, seed: int, vocab: int = 32000) -> tuple[list, list]:
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(rng.randint(1024, 2048))] for _ in range(8)]
    weights = [1 / (k + 1) for k in range(8)]  # Zipf(1.0)
    reqs = []
    for i in range(n):
        s = rng.choices(range(8), weights)[0]
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(32, 128))]
        reqs.append({"id": f"req-{i}", "system": s, "prompt_token_ids": systems[s] + tail,
                     "max_tokens": rng.randint(32, 64), "temperature": 0.0, "ignore_eos": True})
    return systems, reqs


def run(args) -> int:
    model_dir = Path(args.model) if args.model else default_model("bench")
    n, n_sat = (80, 32) if args.quick else (400, 100)
    systems, reqs = workload(n, args.seed)
    mean_sys = sum(map(len, systems)) / len(systems)
    num_blocks = math.ceil((2 * mean_sys + 128 + 64) / BLOCK)
    engine = ["--num-blocks", str(num_blocks), "--block-size", str(BLOCK), "--max-num-batched-tokens", "512"]
    log(f"8 system prompts, mean {mean_sys:.0f} tokens; KV pool {num_blocks} blocks ({num_blocks * BLOCK} tokens) "
        f"per worker")

    def mesh(policy):
        return Mesh(MeshSpec(str(model_dir), mode="unified", unified=4, engine_args=engine,
                             policy=policy.removesuffix(POOL), kv_pool=policy.endswith(POOL)))

    policies = [p for p in POLICIES if not args.policies or p in args.policies.split(",")]
    runs, rates = compare_policies(mesh, reqs, n_sat, args.prefix_load, policies, args.seed)
    systems_out = {}
    for policy, (timings, wall, sampler) in runs.items():
        prompt = sum(t.prompt_tokens for t in timings)
        cached = sum(t.cached_tokens for t in timings)
        systems_out[policy] = {"prefill_tokens_computed": prompt - cached,
                               "prefix_hit_rate": round(cached / prompt, 4), **summarize(timings, wall),
                               "imbalance_max_over_mean": sampler.imbalance(),
                               "imbalance_busy_max_over_mean": sampler.imbalance(busy=True)}
        log(f"{policy}: {systems_out[policy]}")
    ratios = {}
    rr = systems_out.get("round-robin")
    for name, system in systems_out.items():
        if rr is not None and name != "round-robin" and name != "least-outstanding":
            ratios[f"{name}/round-robin:prefill_tokens_computed"] = round(
                system["prefill_tokens_computed"] / rr["prefill_tokens_computed"], 3)
            ratios[f"{name}/round-robin:ttft_ms_p50"] = round(system["ttft_ms_p50"] / rr["ttft_ms_p50"], 3)
    result = {"workload": "prefix-shared", "command": args.command_line, "machine": machine(),
              "config": {"requests": n, "saturation_requests": n_sat, "load": args.prefix_load, **rates,
                         "workers": 4, "threads_per_worker": 1, "engine_args": engine,
                         "system_prompt_tokens": [len(x) for x in systems], "model": str(model_dir)},
              "systems": systems_out, "ratios": ratios}
    write_result(result, args.out)
    print_table(result)
    return 0
