"""Workload prefix-shared: round robin vs least-outstanding vs prefix-aware routing.

8 system prompts of 1,024-2,048 tokens with Zipf(1.0) popularity; each of 400 requests is a
system prompt + 32-128 unique tokens, output 32-64 tokens (greedy, EOS ignored). 4 unified
workers, bench preset, one torch thread each; each worker's KV pool holds about 2 of the 8
system prompts (2 x their mean length, plus one request's own tail), so no worker can keep them
all. A ramp on least-outstanding finds the sustainable rate (bench/sweep.py); then each policy, on a
fresh mesh (cold caches), gets the same Poisson arrivals at each load of --loads. "+pool" (only
with --policies): the workers also take a prompt's blocks from the kvstore's content-addressed pool
when it holds more of them than they cache, and push the blocks they compute there (the prefix-aware
router counts a pool-resident prefix as a cheaper-than-compute hit). Per policy and load: prefill
tokens actually computed, prefix hit rate (cached / prompt tokens), TTFT, e2e, output tokens/s, the
busiest worker's busy time over the mean, per-worker queueing delay, and the old imbalance (max/mean
of the workers' outstanding tokens, sampled every 100 ms while the mean is > 0).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from bench import sweep
from bench.common import default_model, log, machine, print_table, write_result
from bench.plot import plot_path, plot_sweep
from services.mesh.launcher import Mesh, MeshSpec

POLICIES = ("round-robin", "least-outstanding", "prefix-aware", "round-robin+pool", "prefix-aware+pool")
DEFAULT_POLICIES = POLICIES[:3]
POOL = "+pool"  # the workers take prompts' blocks from the kvstore's pool and push theirs there
BLOCK = 16
RAMP_POOL = 600  # requests the ramp draws from (every one's system prompt is one of the 8 all the same)


def add_flags(p) -> None:
    g = p.add_argument_group("prefix-shared")
    g.add_argument("--policies", default="", help=f"comma-separated subset of {', '.join(POLICIES)} (default: "
                                                  f"{', '.join(DEFAULT_POLICIES)})")


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
    loads, seconds = sweep.loads_of(args), sweep.load_seconds(args)
    systems, _ = workload(RAMP_POOL, args.seed)
    mean_sys = sum(map(len, systems)) / len(systems)
    num_blocks = math.ceil((2 * mean_sys + 128 + 64) / BLOCK)
    engine = ["--num-blocks", str(num_blocks), "--block-size", str(BLOCK), "--max-num-batched-tokens", "512"]
    log(f"8 system prompts, mean {mean_sys:.0f} tokens; KV pool {num_blocks} blocks ({num_blocks * BLOCK} tokens) "
        f"per worker")

    def mesh(policy):
        return Mesh(MeshSpec(str(model_dir), mode="unified", unified=4, engine_args=engine,
                             policy=policy.removesuffix(POOL), kv_pool=policy.endswith(POOL)))

    wanted = args.policies.split(",") if args.policies else DEFAULT_POLICIES
    policies = [p for p in POLICIES if p in wanted]
    with mesh("least-outstanding") as m:
        _, ramp_reqs = workload(RAMP_POOL, args.seed + 1)
        rate, ramp = sweep.find_sustainable(m, ramp_reqs, args.seed, args.quick)
    log(f"sustainable: {rate:.2f} req/s")
    runs = sweep.sweep(mesh, lambda n: workload(n, args.seed)[1], policies, loads, rate, seconds, args.seed)
    systems_out = {}
    for policy, points in runs.items():
        for point in points:
            prompt, cached = point["prompt_tokens"], point["cached_prompt_tokens"]
            point["prefill_tokens_computed"] = prompt - cached
            point["prefix_hit_rate"] = round(cached / prompt, 4) if prompt else None
        systems_out[policy] = sweep.system_of(points)
    ratios = {}
    if "round-robin" in systems_out:
        for name in systems_out:
            if name not in ("round-robin", "least-outstanding"):
                ratios.update(sweep.ratios_by_load(systems_out, name, "round-robin",
                                                   ("prefill_tokens_computed", "ttft_ms_p50")))
    result = {"workload": "prefix-shared", "command": args.command_line, "machine": machine(),
              "config": {"loads": loads, "seconds_per_load": seconds, **ramp, "workers": 4, "threads_per_worker": 1,
                         "engine_args": engine, "system_prompt_tokens": [len(x) for x in systems],
                         "model": str(model_dir)},
              "systems": systems_out, "ratios": ratios}
    write_result(result, args.out)
    if plot := plot_path(args):
        plot_sweep(result, plot)
    print_table(result)
    return 0
