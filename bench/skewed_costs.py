"""Workload skewed-costs: least-outstanding vs round robin on unequal workers and heavy-tailed outputs.

Output lengths are log-normal with median 32 and p99 1,024 (sigma = ln(32)/2.326), capped at
2,048; prompts uniform 32-512 tokens (greedy, EOS ignored: max_tokens is the true output length,
as the router sees it). 2 unified workers, bench preset, one torch thread each, of two instance
sizes: unified-0 with a 0.128 GB KV pool and 32 sequences, unified-1 with half of each and half the
CPU (a quota: stopped for half of every 20 ms, bench/sweep.py Slowdown), so counting requests and
counting tokens differ (a request's cost spans 30x, and a worker's speed 2x).

A ramp on least-outstanding finds the sustainable rate (bench/sweep.py); then each policy, on a fresh
mesh, gets the same Poisson arrivals at each load of --loads. The `+slowed` systems run each policy once
more at --slow-load with unified-0 too slowed to half speed halfway through the arrivals (another
tenant's noise on its host), and report the share of requests it started before and after.
"""

from __future__ import annotations

import math
import random
from contextlib import contextmanager
from pathlib import Path

from bench import sweep
from bench.common import default_model, log, machine, print_table, write_result
from bench.latency import percentile, poisson_arrivals
from bench.plot import plot_path, plot_sweep
from services.mesh.launcher import Mesh, MeshSpec

POLICIES = ("round-robin", "least-outstanding")
SLOWED = "+slowed"
BIG = ["--kv-cache-gb", "0.128", "--max-num-seqs", "32"]
SMALL = ["--kv-cache-gb", "0.064", "--max-num-seqs", "16"]
SMALL_CPU = 0.5  # the small instance's share of a core
RAMP_POOL = 2000  # distinct requests the ramp draws from (repeating one would hit the prefix cache)


def add_flags(p) -> None:
    g = p.add_argument_group("skewed-costs")
    g.add_argument("--slow-load", type=float, default=0.7,
                   help="the load of the +slowed runs (0: none), as a fraction of the sustainable rate")


def workload(n: int, seed: int, vocab: int = 32000) -> list:
    rng = random.Random(seed)
    sigma = math.log(32) / 2.326
    reqs = []
    for i in range(n):
        out = min(2048, max(1, round(rng.lognormvariate(math.log(32), sigma))))
        reqs.append({"id": f"req-{i}", "prompt_token_ids": [rng.randrange(3, vocab)
                                                                 for _ in range(rng.randint(32, 512))],
                     "max_tokens": out, "temperature": 0.0, "ignore_eos": True})
    return reqs


def run(args) -> int:
    model_dir = Path(args.model) if args.model else default_model("bench")
    loads, seconds = sweep.loads_of(args), sweep.load_seconds(args)

    @contextmanager
    def mesh(policy):
        with Mesh(MeshSpec(str(model_dir), mode="unified", unified=2, engine_args=["--max-num-batched-tokens", "512"],
                           worker_args={"unified-0": BIG, "unified-1": SMALL}, policy=policy)) as m:
            quota = sweep.Slowdown(m.workers("unified")[1].popen, stopped=1 - SMALL_CPU).start()
            try:
                yield m
            finally:
                quota.close()

    with mesh("least-outstanding") as m:
        rate, ramp = sweep.find_sustainable(m, workload(RAMP_POOL, args.seed + 1), args.seed, args.quick)
    log(f"sustainable: {rate:.2f} req/s")
    runs = sweep.sweep(mesh, lambda n: workload(n, args.seed), POLICIES, loads, rate, seconds, args.seed)
    systems = {policy: sweep.system_of(points) for policy, points in runs.items()}
    if args.slow_load:
        offered = args.slow_load * rate
        n = max(8, round(offered * seconds))
        reqs, arrivals = workload(n, args.seed), poisson_arrivals(n, offered, args.seed + 7)
        for policy in POLICIES:
            log(f"{policy}{SLOWED}: load {args.slow_load:.2f}, unified-0 at half speed from {arrivals[-1] / 2:.0f} s")
            with mesh(policy) as m:
                figures = sweep.run_point(m, reqs, arrivals, slow_at=arrivals[-1] / 2)
            systems[policy + SLOWED] = sweep.system_of([{"load": args.slow_load, "offered_req_per_s": round(offered, 3),
                                                         **figures}])
            log(f"  share of requests on unified-0: {figures.get('slowed_worker_share_before')} before, "
                f"{figures.get('slowed_worker_share_after')} after")
    ratios = sweep.ratios_by_load(systems, "least-outstanding", "round-robin", ("ttft_ms_p99", "e2e_ms_p99"))
    if args.slow_load:
        ratios.update(sweep.ratios_by_load(systems, "least-outstanding" + SLOWED, "round-robin" + SLOWED,
                                           ("ttft_ms_p99", "e2e_ms_p99")))
    outs = [r["max_tokens"] for r in workload(200, args.seed)]
    result = {"workload": "skewed-costs", "command": args.command_line, "machine": machine(),
              "config": {"loads": loads, "seconds_per_load": seconds, **ramp, "slow_load": args.slow_load,
                         "workers": {"unified-0": BIG, "unified-1": SMALL}, "threads_per_worker": 1,
                         "cpu_share": {"unified-0": 1.0, "unified-1": SMALL_CPU},
                         "output_tokens_median": percentile(outs, 0.5), "output_tokens_p99": percentile(outs, 0.99),
                         "model": str(model_dir)},
              "systems": systems, "ratios": ratios}
    write_result(result, args.out)
    if plot := plot_path(args):
        plot_sweep(result, plot)
    print_table(result)
    return 0
