"""Workload skewed-costs: least-outstanding vs round robin on unequal workers and heavy-tailed outputs.

Output lengths are log-normal with median 32 and p99 1,024 (sigma = ln(32)/2.326), capped at
2,048; prompts uniform 32-512 tokens (greedy, EOS ignored: max_tokens is the true output length,
as the router sees it). 2 unified workers, bench preset, one torch thread each: unified-0 with
a 0.128 GB KV pool and 32 sequences, unified-1 with half of both. Saturation is measured with
least-outstanding (a burst of the first 96 requests at once); then each policy, on a fresh
mesh, gets the same Poisson arrivals at 70% of it.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from bench.common import default_model, log, machine, print_table, write_result
from bench.latency import percentile, summarize
from bench.online import compare_policies
from services.launcher import Mesh, MeshSpec

POLICIES = ("round-robin", "least-outstanding")
BIG = ["--kv-cache-gb", "0.128", "--max-num-seqs", "32"]
SMALL = ["--kv-cache-gb", "0.064", "--max-num-seqs", "16"]


def add_flags(p) -> None:
    g = p.add_argument_group("skewed-costs")
    g.add_argument("--skew-load", type=float, default=0.7, help="arrival rate as a fraction of saturation")


def workload(n: int, seed: int, vocab: int = 32000) -> list:
    rng = random.Random(seed)
    sigma = math.log(32) / 2.326
    reqs = []
    for i in range(n):
        out = min(2048, max(1, round(rng.lognormvariate(math.log(32), sigma))))
        reqs.append({"id": f"req-{i}", "prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(32, 512))],
                     "max_tokens": out, "temperature": 0.0, "ignore_eos": True})
    return reqs


def run(args) -> int:
    model_dir = Path(args.model) if args.model else default_model("bench")
    n, n_sat = (60, 32) if args.quick else (300, 96)
    reqs = workload(n, args.seed)
    outs = [r["max_tokens"] for r in reqs]
    log(f"outputs: median {percentile(outs, 0.5):.0f}, p99 {percentile(outs, 0.99):.0f}, max {max(outs)}")

    def mesh(policy):
        return Mesh(MeshSpec(str(model_dir), mode="unified", unified=2, engine_args=["--max-num-batched-tokens", "512"],
                             worker_args={"unified-0": BIG, "unified-1": SMALL}, policy=policy))

    runs, rates = compare_policies(mesh, reqs, n_sat, args.skew_load, POLICIES, args.seed)
    systems = {}
    for policy, (timings, wall, sampler) in runs.items():
        systems[policy] = {**summarize(timings, wall), "imbalance_max_over_mean": sampler.imbalance(),
                           "imbalance_busy_max_over_mean": sampler.imbalance(busy=True)}
        log(f"{policy}: {systems[policy]}")
    lo, rr = systems["least-outstanding"], systems["round-robin"]
    ratios = {f"least-outstanding/round-robin:{k}": round(lo[k] / rr[k], 3) for k in ("ttft_ms_p99", "e2e_ms_p99")}
    result = {"workload": "skewed-costs", "command": args.command_line, "machine": machine(),
              "config": {"requests": n, "saturation_requests": n_sat, "load": args.skew_load, **rates,
                         "workers": {"unified-0": BIG, "unified-1": SMALL}, "threads_per_worker": 1,
                         "output_tokens_median": percentile(outs, 0.5), "output_tokens_p99": percentile(outs, 0.99),
                         "model": str(model_dir)},
              "systems": systems, "ratios": ratios}
    write_result(result, args.out)
    print_table(result)
    return 0
