"""`meshserve sim study NAME`: the at-scale studies of docs/SIMULATION.md, each a JSON result and a PNG.

Every study uses the cost model given (--cost; default sim-cost.json, else built-in figures), unified or
disaggregated workers of 64 sequences and a 2,048-token budget, and first measures one worker's capacity for
its request mix in the simulator (a burst of 400 requests at once on one worker: requests/s), so that loads
are fractions of what the cluster can serve. Studies:

- batching: iteration-level vs request-level batching (a batch forms only when the last one has drained), 512
  workers, 1M requests (prompts 32-512, outputs 16-256), Poisson at 50% of the iteration-level capacity:
  utilisation (time stepping), batch occupancy (sequences per step over the slots), throughput, latency.
- routing: round robin vs least-outstanding vs prefix-aware, prefix-aware with and without the KV pool, 512 workers in
  cells of 16, 1M requests sharing 512 system prompts (256-768 tokens, Zipf 1.1) plus 32-128 own tokens,
  outputs 16-128, each worker's KV holding about 12 system prompts, Poisson at 70% of capacity: prefill tokens
  computed, prefix hit rate, TTFT, throughput.
- disaggregation: unified vs disaggregated at P:D 1:1, 1:3 and 1:7, 512 workers in all, 1M requests, at one
  load (70% of the unified capacity; --loads for several): goodput (requests meeting TTFT <= 1 s and TPOT <=
  25 ms, per second) and attainment, and goodput over a grid of TTFT and TPOT SLOs.
- autoscale: the token policy vs the CPU-utilisation and request-rate baselines and a fixed size, on a
  day-long trace (1M requests over 24 hours: a diurnal rate, +-70%, with a 3x burst of 10 minutes every 2
  hours), 2-minute start-ups: SLO attainment, worker-seconds, peak workers. So that the day's peak needs
  --workers workers, every worker is slowed by one factor (a model that much costlier per step; the TTFT SLO
  and the gateway's queue bound scale with it, start-ups do not); one gateway replica per 16 workers shares the
  admission work. The fixed baseline is sized for the peak (its rate over 85% of a worker's capacity), not searched for
  the smallest size that meets the SLO.

Every system of a study sees the same trace. Systems whose cells are independent (no gateway queue, no
autoscaler) run one after another, each with its cells spread over --processes (default one per core); the
others run side by side, --processes at once.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

from sim.cluster import AutoscaleSpec, Cluster, ClusterSpec
from sim.cost import CostModel
from sim.run import pool, splittable
from sim.trace import Synthetic, synthetic
from sim.worker import WorkerSpec

STUDIES = ("batching", "routing", "disaggregation", "autoscale")
WORKER = WorkerSpec(num_blocks=8192, max_num_seqs=64, max_num_batched_tokens=2048, slot_policy="fcfs")
UNIQUE = replace(WORKER, prefix_caching=False)  # for mixes with no shared prefix: nothing to cache, nothing to hash


def log(msg: str) -> None:
    import sys

    print(f"[sim study] {msg}", file=sys.stderr, flush=True)


def _burst(cost: CostModel, mix: Synthetic, worker: WorkerSpec, n: int) -> tuple[list, float]:
    """A burst of n requests of the mix at once on one worker: (the trace, the makespan)."""
    trace = synthetic(replace(mix, requests=n, rate=1e6), seed=12345)
    cluster = Cluster(ClusterSpec(workers=1, worker=worker, admission="none"), cost)
    cluster.run(trace)
    return trace, max(r.last_s for r in cluster.done) - trace[0].arrival_s


def capacity(cost: CostModel, mix: Synthetic, worker: WorkerSpec = WORKER, n: int = 400) -> float:
    """One worker's requests/s for a mix: a burst of n requests at once, n / makespan."""
    _, span = _burst(cost, mix, worker, n)
    return n / span


def token_rates(cost: CostModel, mix: Synthetic, worker: WorkerSpec = WORKER, n: int = 400) -> tuple[float, float]:
    """One worker's prompt tokens/s (a burst of the mix's prompts with one output token each) and output tokens/s
    (a burst of 16-token prompts with 256 outputs): what the token policy is configured with, measured as the
    burst-autoscale benchmark measures it on a real worker."""
    trace, span = _burst(cost, replace(mix, output=(1, 1)), worker, n)
    prefill = sum(t.prompt_tokens for t in trace) / span
    trace, span = _burst(cost, replace(mix, prompt=(16, 16), output=(256, 256)), worker, n)
    return prefill, sum(t.output_tokens for t in trace) / span


def _run(name: str, spec: ClusterSpec, cost: CostModel, trace: list, processes: int) -> dict:
    from sim.run import simulate

    t = time.perf_counter()
    r = simulate(spec, cost, trace, processes=processes)
    s = r["summary"]
    log(f"{name}: {len(trace):,} requests, {r['run']['events']:,} events in {time.perf_counter() - t:.0f} s "
        f"({r['run']['events_per_s']:,} events/s); ttft p50 {s['ttft_ms_p50']} ms, tpot p50 {s['tpot_ms_p50']} ms, "
        f"{s['output_tokens_per_s']:,} tok/s")
    return {**s, "events": r["run"]["events"], "sim_wall_s": r["run"]["wall_s"],
            "events_per_s": r["run"]["events_per_s"], "timeline": r["timeline"],
            "throughput_timeline": r["throughput_timeline"]}


_TRACE: list = []  # the study's trace, in each pool process (handed over once per process, not once per job)
_ONLY: set = set()  # --systems: the systems to run (empty: all)


def _keep_trace(trace: list) -> None:
    global _TRACE
    _TRACE = trace


def _child(job: tuple) -> tuple:
    name, spec, cost = job
    return name, _run(name, spec, cost, _TRACE, 1)


def _run_all(jobs: list, cost: CostModel, trace: list, processes: int) -> dict:
    """Each (name, spec) on the trace. Systems whose cells are independent run one after the other, each with its
    cells spread over the processes (sim/run.py: the same result as one process); the others run side by
    side, as many at once as processes (each process is handed the trace once)."""
    if _ONLY:
        jobs = [(name, spec) for name, spec in jobs if name in _ONLY]
    if not jobs:
        return {}
    if processes <= 1 or len(jobs) == 1 or all(splittable(spec) for _, spec in jobs):
        return {name: _run(name, spec, cost, trace, processes) for name, spec in jobs}
    with pool(min(processes, len(jobs)), _keep_trace, (trace,)) as workers:
        done = dict(workers.map(_child, [(name, spec, cost) for name, spec in jobs]))
    return {name: done[name] for name, _ in jobs}


def batching(cost, n, workers, processes) -> dict:
    mix = Synthetic(prompt=(32, 512), output=(16, 256))
    cap = capacity(cost, mix)
    rate = 0.5 * cap * workers
    trace = synthetic(replace(mix, requests=n, rate=rate), seed=1)
    base = ClusterSpec(workers=workers, worker=UNIQUE, cell_size=16, admission="none", routing="least-outstanding")
    systems = _run_all([(b, replace(base, worker=replace(UNIQUE, batching=b))) for b in ("iteration", "request")],
                       cost, trace, processes)
    return {"config": {"workers": workers, "requests": n, "rate_req_per_s": round(rate, 2),
                       "capacity_per_worker_req_per_s": round(cap, 3), "mix": asdict(mix)}, "systems": systems}


def routing(cost, n, workers, processes) -> dict:
    mix = Synthetic(prompt=(32, 128), output=(16, 128), system_prompts=512, system_tokens=(256, 768), zipf=1.1)
    worker = replace(WORKER, num_blocks=12 * 512 // 16 + 64 * 40)  # ~12 system prompts + the running requests' own
    cap = capacity(cost, mix, worker)
    rate = 0.7 * cap * workers
    trace = synthetic(replace(mix, requests=n, rate=rate), seed=2)
    base = ClusterSpec(workers=workers, worker=worker, cell_size=16, admission="none")
    jobs = [(policy + ("+pool" if pool else ""), replace(base, routing=policy, kv_pool=pool))
            for policy, pool in (("round-robin", False), ("least-outstanding", False), ("prefix-aware", False),
                                 ("prefix-aware", True))]
    systems = _run_all(jobs, cost, trace, processes)
    for s in systems.values():
        s["prefill_tokens_computed"] = s["prompt_tokens"] - s["cached_prompt_tokens"]
        s["prefix_hit_rate"] = round(s["cached_prompt_tokens"] / s["prompt_tokens"], 4) if s["prompt_tokens"] else None
    return {"config": {"workers": workers, "cell_size": 16, "requests": n, "rate_req_per_s": round(rate, 2),
                       "capacity_per_worker_req_per_s": round(cap, 3), "kv_blocks_per_worker": worker.num_blocks,
                       "mix": asdict(mix)}, "systems": systems}


def disaggregation(cost, n, workers, processes, loads=(0.7,)) -> dict:
    mix = Synthetic(prompt=(256, 1024), output=(32, 256))
    cap = capacity(cost, mix)
    slo = {"ttft_slo_ms": 1000.0, "tpot_slo_ms": 25.0}
    grid = [[ttft, tpot] for ttft in (250.0, 500.0, 1000.0, 2000.0) for tpot in (12.5, 15.0, 20.0, 25.0, 35.0)]
    base = ClusterSpec(worker=UNIQUE, cell_size=16, admission="none", routing="least-outstanding", slo_grid=grid,
                       **slo)
    systems, rates = {}, {}
    for load in loads:
        rate = rates[load] = load * cap * workers
        trace = synthetic(replace(mix, requests=n, rate=rate), seed=3)
        at = f"@{load:g}" if len(loads) > 1 else ""
        jobs = [("unified" + at, replace(base, workers=workers))]
        for p, d in ((1, 1), (1, 3), (1, 7)):
            pre = workers * p // (p + d)
            jobs.append((f"disaggregated-{p}:{d}{at}", replace(base, mode="disaggregated", prefill=pre,
                                                               workers=workers - pre, cell_size=16 * d // (p + d))))
        systems.update(_run_all(jobs, cost, trace, processes))
    return {"config": {"workers": workers, "requests": n, "loads": list(loads),
                       "rate_req_per_s": {f"{k:g}": round(v, 2) for k, v in rates.items()}, **slo,
                       "slo_grid": grid, "capacity_per_worker_req_per_s": round(cap, 3), "mix": asdict(mix),
                       "kv_link_gbytes_per_s": cost.kv_link_gbytes_per_s}, "systems": systems}


def autoscale(cost, n, workers, processes) -> dict:
    """The autoscale study on a whole day. The trace's mean rate is set so that n requests arrive over the day
    (bursts included). So that the day's peak needs `workers` workers, every worker runs slower than the cost
    model by one factor (WorkerSpec.speed): a model that costly per step, whose latencies scale by the same
    factor; the TTFT SLO is then 4x the largest prompt's unloaded time to first token at that speed."""
    mix = Synthetic(prompt=(32, 512), output=(16, 256))
    day, burst_every, burst_s, burst_factor, amplitude = 86400.0, 7200.0, 600.0, 3.0, 0.7
    mean_rate = n / day / (1 + (burst_factor - 1) * burst_s / burst_every)
    peak = mean_rate * (1 + amplitude) * burst_factor
    speed = min(1.0, peak / (0.85 * workers * capacity(cost, mix)))
    worker = replace(UNIQUE, speed=speed)
    cap = capacity(cost, mix, worker)
    spec_trace = replace(mix, requests=n, rate=mean_rate, diurnal_period_s=day, diurnal_amplitude=amplitude,
                         burst_every_s=burst_every, burst_s=burst_s, burst_factor=burst_factor)
    trace = synthetic(spec_trace, seed=4)
    slo_ms = round(4 * (cost.step_s(1, mix.prompt[1] - 1) / speed + cost.hop_s) * 1e3, -2)
    prefill_tps, decode_tps = token_rates(cost, mix, worker)
    one = AutoscaleSpec(startup_s=120.0, max_replicas=4 * workers, ttft_slo_s=slo_ms / 1e3, interval_s=10.0,
                        prefill_tokens_per_s=prefill_tps, decode_tokens_per_s=decode_tps,
                        requests_per_s_per_replica=cap * 0.7)
    # The gateway's queue bound scales with the model as the SLO does (30 s to a 2 s SLO at the preset's speed).
    base = ClusterSpec(worker=worker, admission="fcfs", routing="least-outstanding", ttft_slo_ms=slo_ms,
                       starvation_s=15 * slo_ms / 1e3,
                       workers=max(1, int(mean_rate * (1 - amplitude) / cap) + 1), cell_size=16,
                       gateways=max(1, workers // 16))
    fixed = max(1, int(peak / cap / 0.85) + 1)
    jobs = [(f"{policy}-policy", replace(base, autoscale=replace(one, policy=policy))) for policy in
            ("token", "cpu", "rate")] + [("peak-fixed", replace(base, workers=fixed))]
    systems = _run_all(jobs, cost, trace, processes)
    if "peak-fixed" in systems:
        systems["peak-fixed"]["workers"] = fixed
    return {"config": {"requests": n, "day_s": day, "trace_end_s": round(trace[-1].arrival_s, 1),
                       "mean_rate_req_per_s": round(mean_rate, 3), "peak_rate_req_per_s": round(peak, 3),
                       "worker_speed": round(speed, 5), "capacity_per_worker_req_per_s": round(cap, 4),
                       "startup_s": 120.0, "ttft_slo_ms": slo_ms, "initial_workers": base.workers,
                       "gateways": base.gateways, "queue_bound_s": base.starvation_s,
                       "prefill_tokens_per_s_per_worker": round(prefill_tps, 1),
                       "decode_tokens_per_s_per_worker": round(decode_tps, 1), "trace": asdict(spec_trace)},
            "systems": systems}


RUNNERS = {"batching": batching, "routing": routing, "disaggregation": disaggregation, "autoscale": autoscale}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = result["systems"]
    names = list(systems)
    study = result["study"]
    panels = {"batching": ("utilisation", "batch_occupancy", "ttft_ms_p99", "output_tokens_per_s"),
              "routing": ("prefill_tokens_computed", "prefix_hit_rate", "ttft_ms_p99", "output_tokens_per_s"),
              "disaggregation": ("goodput_req_per_s", "slo_attainment", "ttft_ms_p99", "tpot_ms_p99"),
              "autoscale": ("slo_attainment", "worker_seconds", "max_workers", "ttft_ms_p99")}[study]
    extra = study in ("autoscale", "disaggregation")
    fig, ax = plt.subplots(1, len(panels) + extra, figsize=(4.2 * (len(panels) + 1), 3.6))
    for a, metric in zip(ax, panels):
        a.bar(names, [systems[s].get(metric) or 0 for s in names])
        a.set_title(metric)
        a.tick_params(axis="x", labelrotation=30, labelsize=7)
    if study == "autoscale":
        a = ax[-1]
        end = max([result["config"].get("trace_end_s", 0.0)] + [x[0] for s in names for x in systems[s]["timeline"]])
        for s in names:
            tl = systems[s]["timeline"] + systems[s]["timeline"][-1:]  # held to the end (a fixed pool: one point)
            a.step([x[0] / 3600 for x in tl[:-1]] + [end / 3600], [x[1] + x[2] for x in tl], where="post", label=s)
        a.set(title="workers (serving + starting)", xlabel="hour")
        a.legend(fontsize=7)
    if study == "disaggregation":  # goodput against the TPOT SLO, TTFT <= 1 s
        a = ax[-1]
        for s in names:
            cells = [(g["slo"]["tpot_ms"], g["goodput_req_per_s"]) for g in systems[s].get("slo_grid", [])
                     if g["slo"]["ttft_ms"] == 1000.0]
            a.plot([x for x, _ in cells], [y or 0 for _, y in cells], marker="o", label=s)
        a.set(title="goodput (TTFT <= 1 s) vs TPOT SLO", xlabel="TPOT SLO ms", ylabel="req/s")
        a.legend(fontsize=6)
    fig.suptitle(f"sim study {study}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def add_parser(sub) -> None:
    p = sub.add_parser("study", help="one of the at-scale studies (docs/SIMULATION.md)")
    p.add_argument("name", choices=STUDIES)
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--workers", type=int, default=512)
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1,
                   help="systems simulated at once (one process each)")
    p.add_argument("--cost", help="the cost model JSON (default: sim-cost.json when present, else built-in figures)")
    p.add_argument("--systems", type=lambda t: set(filter(None, t.split(","))), default=set(),
                   help="run only these of the study's systems, by name (comma-separated; default all)")
    p.add_argument("--loads", type=lambda t: tuple(float(x) for x in t.split(",")),
                   help="disaggregation: loads as fractions of the unified capacity, e.g. 0.5,0.7,0.9 (default 0.7)")
    p.add_argument("--out", help="the result JSON (a PNG is written beside it)")


def run(args) -> int:
    from sim.run import DEFAULT_COST

    path = args.cost or (DEFAULT_COST if Path(DEFAULT_COST).exists() else None)
    cost = CostModel.load(path) if path else CostModel()
    cost = replace(cost, cores=0)  # at scale every worker has its own device
    t = time.perf_counter()
    global _ONLY
    _ONLY = args.systems
    extra = {"loads": args.loads} if args.name == "disaggregation" and args.loads else {}
    result = RUNNERS[args.name](cost, args.requests, args.workers, args.processes, **extra)
    if not result["systems"]:
        log(f"none of --systems {','.join(sorted(args.systems))} is a system of the {args.name} study")
        return 2
    result = {"study": args.name, "command": "meshserve sim study " + " ".join(_argv()), "cost": asdict(cost),
              **result, "wall_s": round(time.perf_counter() - t, 1)}
    for s in result["systems"].values():
        if args.name != "autoscale":
            s.pop("timeline", None)
        s["throughput_timeline"] = s["throughput_timeline"][::10]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        png = str(Path(args.out).with_suffix(".png"))
        plot(result, png)
        log(f"wrote {args.out} and {png}")
    for name, s in result["systems"].items():
        print(f"{name:26} " + " ".join(f"{k}={s.get(k)}" for k in (
            "utilisation", "batch_occupancy", "prefix_hit_rate", "goodput_req_per_s", "slo_attainment",
            "worker_seconds", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "output_tokens_per_s", "events_per_s")
            if s.get(k) is not None))
    return 0


def _argv() -> list:
    import sys

    return sys.argv[3:] if sys.argv[1:3] == ["sim", "study"] else sys.argv[1:]
