"""`meshserve sim claims NAME`: the seed's cluster claims (issue 62), each against its baseline across loads, in the
simulator at --workers workers (default 1,000). bench/cluster_claims.py runs the same workloads on the mock mesh
at 64 workers; docs/CLUSTER.md has both.

Every claim uses one step-time model (--profile, default the h100-llama8b preset: stated as an assumption, never
measured here), workers of 4 sequences, 1,024 KV blocks of 16 tokens and a 512-token step budget, the mesh's
default admission and slot policy (fair-deadline), one router per 64 workers and one gateway per 64 workers, workers
beating to their router every 100 ms (routing.heartbeat_ms: 100; the default 1 s is set for CPU step times, and at
an H100's a request lives ~0.1-0.3 s: routing on a view five lifetimes old halves what least-outstanding gains, see
docs/CLUSTER.md). A load
is a fraction of the cluster's capacity for the claim's mix: one worker's requests/s for a burst of the mix
(sim.studies.capacity), times the workers (and their mean speed). Small batches and short outputs are a choice of
scale, stated: what a claim needs is many request lifetimes per run (48 requests a worker: ~12 lifetimes at 4 slots),
and what the mock mesh can carry on this machine is ~1,000 streamed tokens a second of real time, so every request
is kept short and each worker's batch small. Claims:

- routing (04): round robin vs least-outstanding vs power-of-two; outputs heavy-tailed (lognormal, median 8,
  sigma 1.2: mean ~16, p99 ~130, at most 256), prompts 32-512, workers of two speeds (every other one at half
  speed). Target: TTFT p99 at most 0.5x round robin's at every load from 0.85 up.
- prefix-8, prefix-64 (05): round robin vs least-outstanding vs prefix-aware; 8 or 64 shared system prompts (1,024-
  1,900 tokens, Zipf; a prompt stays within the 2,048 positions of the test model the mock mesh reads) before
  32-128 own tokens, outputs 8-32. Targets: prefill tokens computed at most 0.2x round
  robin's, TTFT p50 at most 0.5x, no worker busier than 1.3x the mean.
- tenants (07): FCFS vs fair-deadline vs fair admission; ten tenants of equal weight, nine light ones at 5% of the
  capacity each, the heavy one offering the rest of the load (so it is over its share from 0.5 up, and the cluster
  is overloaded past 1.0: loads 0.7 to 2.0); prompts 64-512, outputs 8-64. Targets: Jain's index of service over
  the weighted max-min fair shares
  (bench/tenants_overload.py's measure) at least 0.95, and every light tenant's TTFT p99 at most 3x its figure
  without the heavy tenant (the nine light tenants alone on the same cluster: their solo figure, within a cluster
  that size).
- pd-long, pd-chat (06): unified vs disaggregated at equal worker counts, P:D 1:3, 1:1 and 3:1; goodput (requests
  per second meeting both SLOs, DistServe's measure). SLOs as DistServe sets them, from the unloaded latencies: TPOT
  2x an unloaded decode step (12 ms), TTFT 4x the longest prompt's unloaded time to first token. long: prompts
  1,024-1,900, outputs 16-64, TTFT <= 400 ms; chat: prompts 32-512, outputs 16-64, TTFT <= 100 ms. Target: the best
  ratio's goodput at least 1.5x unified's on the long-prompt workload.

- lora (10): least-outstanding vs lora-aware routing, with and without the router's adapter placement (the mesh's
  default: routing.lora_placement), over 500 LoRA adapters of Zipf popularity (s = 1); workers of 16 sequences, 8
  compute slots and 32 adapters in host memory (at 4 sequences a worker holding an adapter is full most of the time
  at 0.85, and the gateway's credits send its requests elsewhere: docs/CLUSTER.md), reads and slot copies as the
  step-time model says (h100-llama8b: 40 ms a read from storage, 3.4 ms a copy into a slot); prompts 32-512,
  outputs 8-64, 96 requests a worker (so that most adapters are past their first touch: a cold read per adapter in
  use is every system's floor). A load is a fraction of the base model's capacity (no adapters). Targets: adapter
  loads (copies into compute slots; reads from storage beside them) at most 1/3 of least-outstanding's, output
  throughput at least 0.95x.

- placement (09): the mesh's group placement against first fit on 1,000 hosts (--workers) in racks of 40, with no
  request trace: sim/placement_claim.py. Loads are the fraction of devices the groups take.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from services.engine.cost_model import cost_model
from services.policy.arbitration import max_min_shares
from sim.cluster import ClusterSpec
from sim.trace import Synthetic, TenantSpec, synthetic
from sim.worker import WorkerSpec

WORKER = WorkerSpec(num_blocks=1024, max_num_seqs=4, max_num_batched_tokens=512, slot_policy="fair-deadline")
CELL = 64  # workers per router, and per gateway
LOADS = (0.5, 0.7, 0.85, 0.95)
PROFILE = "h100-llama8b"
HEARTBEAT_S = 0.1  # the router's view of the workers: refreshed this often (routing.heartbeat_ms: 100)


def log(msg: str) -> None:
    print(f"[claims] {msg}", file=sys.stderr, flush=True)


@dataclass
class Claim:
    name: str
    title: str
    mix: Synthetic
    systems: dict  # name -> ClusterSpec field overrides
    metrics: tuple  # what the plot shows against load, per system
    baseline: str
    loads: tuple = LOADS
    speeds: tuple = ()  # heterogeneous workers (ClusterSpec.worker_speeds)
    worker: WorkerSpec = field(default_factory=lambda: WORKER)
    slo: dict = field(default_factory=dict)  # ttft_slo_ms, tpot_slo_ms
    requests_per_worker: int = 48  # ~12 request lifetimes at a worker's 4 slots (the mock mesh runs as many)

    def spec(self, system: str, workers: int, heartbeat_s: float = HEARTBEAT_S) -> ClusterSpec:
        over = dict(self.systems[system])
        prefill = 0
        if over.get("mode") == "disaggregated":
            p, d = over.pop("ratio")
            prefill = max(1, round(workers * p / (p + d)))
            workers -= prefill
        weights = {t.name: t.weight for t in self.mix.tenants}
        base = ClusterSpec(workers=workers, prefill=prefill, worker=self.worker, admission="fair-deadline",
                           routing="least-outstanding", heartbeat_s=heartbeat_s, cell_size=CELL,
                           gateways=max(1, (workers + prefill) // CELL), worker_speeds=self.speeds,
                           tenant_weights=weights, **self.slo)
        return replace(base, **over)

    def capacity(self, cost) -> float:
        """One worker's requests/s for this mix (a burst, sim.studies.capacity), times the workers' mean speed; with
        LoRA adapters, the base model's (what reads and slot copies take is what the policies differ in)."""
        from sim.studies import capacity

        speed = sum(self.speeds) / len(self.speeds) if self.speeds else 1.0
        return capacity(cost, replace(self.mix, tenants=[], adapters=0), replace(self.worker, max_loras=0)) * speed

    def trace(self, load: float, workers: int, per_worker_rps: float, seed: int, requests: int = 0) -> list:
        rate = load * per_worker_rps * workers
        mix = self.mix
        if mix.tenants:  # the light tenants' rate is fixed; the heavy one takes the rest of the load
            light = sum(t.rate_share for t in mix.tenants[1:])
            mix = replace(mix, tenants=[replace(mix.tenants[0], rate_share=max(load - light, 0.0))] + mix.tenants[1:])
            rate = sum(t.rate_share for t in mix.tenants) * per_worker_rps * workers
        n = requests or self.requests_per_worker * workers
        return synthetic(replace(mix, requests=n, rate=rate), seed=seed)


LIGHT = [TenantSpec(f"light{i}", 0.05) for i in range(1, 10)]
ROUTERS = {"round-robin": {"routing": "round-robin"}, "least-outstanding": {"routing": "least-outstanding"}}
CLAIMS = {c.name: c for c in (
    Claim("routing", "04 routing: heavy-tailed outputs, workers of two speeds",
          Synthetic(prompt=(32, 512), output=(8, 1.2), output_lengths="lognormal", max_output=256),
          {**ROUTERS, "power-of-two": {"routing": "power-of-two"}}, ("ttft_ms_p99", "ttft_ms_p50", "tpot_ms_p99",
                                                                     "output_tokens_per_s_per_worker"),
          "round-robin", speeds=(1.0, 0.5)),
    *(Claim(f"prefix-{k}", f"05 prefix-aware routing: {k} shared system prompts",
            Synthetic(prompt=(32, 128), output=(8, 32), system_prompts=k, system_tokens=(1024, 1900)),
            {**ROUTERS, "prefix-aware": {"routing": "prefix-aware"}},
            ("prefill_tokens_per_request", "ttft_ms_p50", "busy_max_over_mean", "output_tokens_per_s_per_worker"),
            "round-robin")
      for k in (8, 64)),
    Claim("tenants", "07 tenants at scale: ten tenants, one heavy",
          Synthetic(prompt=(64, 512), output=(8, 64), tenants=[TenantSpec("heavy", 0.0)] + LIGHT),
          {"fcfs": {"admission": "fcfs", "worker": replace(WORKER, slot_policy="fcfs")},
           "fair-deadline": {}, "fair": {"admission": "fair", "worker": replace(WORKER, slot_policy="fair")}},
          ("jain_index", "light_ttft_p99_ratio", "ttft_ms_p99", "output_tokens_per_s_per_worker"), "fcfs",
          loads=(0.7, 0.95, 1.5, 2.0)),
    *(Claim(f"pd-{name}", f"06 P/D disaggregation vs unified: {name} workload", mix,
            {"unified": {}, **{f"pd-{p}:{d}": {"mode": "disaggregated", "ratio": (p, d)}
                               for p, d in ((1, 3), (1, 1), (3, 1))}},
            ("goodput_req_per_s", "slo_attainment", "ttft_ms_p99", "tpot_ms_p99"), "unified", slo=slo,
            worker=replace(WORKER, max_num_seqs=32, num_blocks=4096), requests_per_worker=256)
      for name, mix, slo in (
          ("long", Synthetic(prompt=(1024, 1900), output=(16, 64)), {"ttft_slo_ms": 400.0, "tpot_slo_ms": 12.0}),
          ("chat", Synthetic(prompt=(32, 512), output=(16, 64)), {"ttft_slo_ms": 100.0, "tpot_slo_ms": 12.0}))),
    Claim("lora", "10 LoRA residency: 500 adapters, Zipf", Synthetic(prompt=(32, 512), output=(8, 64), adapters=500),
          {"least-outstanding": {"routing": "least-outstanding", "lora_placement": False, "credits": True},
           "lora-aware": {"routing": "lora-aware", "lora_placement": False, "credits": True},
           "lora-aware+placement": {"routing": "lora-aware", "lora_placement": True, "credits": True}},
          ("lora_slot_loads_per_request", "lora_reads_per_request", "ttft_ms_p50", "output_tokens_per_s_per_worker"),
          "least-outstanding", worker=replace(WORKER, max_num_seqs=16, max_loras=8, max_cpu_loras=32),
          requests_per_worker=96),
)}


# ---- the claims' own metrics -------------------------------------------------------------------------------------

def service(prompt: int, output: int) -> float:
    """The fairness unit (bench/tenants_overload.py): prompt tokens + 2 x output tokens."""
    return prompt + 2 * output


def jain(served: dict, demand: dict, weights: dict) -> float | None:
    """Jain's index of each tenant's service over its weighted max-min fair share of what was served."""
    shares = max_min_shares(sum(served.values()), demand, weights)
    xs = [served[t] / shares[t] for t in demand if shares[t] > 0]
    return round(sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)), 4) if xs else None


def tenant_metrics(trace: list, served: dict, ttft_p99: dict, solo_p99: dict, window_s: float) -> dict:
    """served: tenant -> service finished within the window; ttft_p99 / solo_p99: tenant -> ms."""
    demand: dict = {}
    for r in trace:
        if r.arrival_s <= window_s:
            demand[r.tenant] = demand.get(r.tenant, 0.0) + service(r.prompt_tokens, r.output_tokens)
    weights = {t: 1.0 for t in demand}
    ratios = {t: round(ttft_p99[t] / solo_p99[t], 3) for t in solo_p99 if ttft_p99.get(t) and solo_p99[t]}
    return {"jain_index": jain({t: served.get(t, 0.0) for t in demand}, demand, weights),
            "light_ttft_p99_ratio": max(ratios.values()) if ratios else None, "light_ttft_p99_ratios": ratios}


def _sim_tenant_metrics(result: dict, trace: list, solo: dict) -> dict:
    window = trace[-1].arrival_s
    served: dict = {}
    for sim in result["_reqs"]:
        if not sim.error and sim.last_s is not None and sim.last_s <= window:
            t = sim.trace.tenant
            served[t] = served.get(t, 0.0) + service(sim.trace.prompt_tokens, sim.tokens_out)
    ttft = {t: v["ttft_ms_p99"] for t, v in result["tenants"].items()}
    return tenant_metrics(trace, served, ttft, solo, window)


# ---- running them ------------------------------------------------------------------------------------------------

def simulate_kept(spec: ClusterSpec, cost, trace: list) -> dict:
    """sim.cli.simulate's result, plus the finished requests (under _reqs) for the claims' own metrics."""
    from sim.cluster import Cluster
    from sim.report import result_of

    t = time.perf_counter()
    cluster = Cluster(spec, cost)
    cluster.run(trace)
    result = result_of(cluster, time.perf_counter() - t)
    result["_reqs"] = cluster.done
    return result


def summarise(name: str, system: str, workers: int, cost, trace: list, solo: dict | None, **spec_over) -> dict:
    """One system of a claim simulated on trace: the summary, prefill tokens computed, each tenant's TTFT p99 and,
    given the light tenants' solo figures, the tenant metrics. system "_solo": the light tenants alone, on the
    fair-deadline cluster. spec_over: ClusterSpec fields to change (a heartbeat, a queue bound)."""
    spec = replace(CLAIMS[name].spec("fair-deadline" if system == "_solo" else system, workers), **spec_over)
    r = simulate_kept(spec, cost, trace)
    s = dict(r["summary"])
    s.pop("slo_grid", None)
    s["prefill_tokens_computed"] = s["prompt_tokens"] - s["cached_prompt_tokens"]
    s["tenants"] = {t: v["ttft_ms_p99"] for t, v in r["tenants"].items()}
    if solo is not None:
        s.update(_sim_tenant_metrics(r, trace, solo))
    return s


def _job(job: tuple) -> tuple:
    claim, system, workers, heartbeat_s, cost, trace, solo = job
    t = time.perf_counter()
    s = summarise(claim, system, workers, cost, trace, solo, heartbeat_s=heartbeat_s)
    s["sim_wall_s"] = round(time.perf_counter() - t, 1)
    log(f"{claim} {system} ({workers} workers): ttft p50 {s['ttft_ms_p50']} p99 {s['ttft_ms_p99']} ms, tpot p99 "
        f"{s['tpot_ms_p99']} ms, {s['output_tokens_per_s']:,} tok/s, {s['sim_wall_s']} s")
    return system, s


def _map(jobs: list, processes: int) -> list:
    if processes <= 1 or len(jobs) == 1:
        return [_job(j) for j in jobs]
    from sim.run import pool

    with pool(min(processes, len(jobs)), None, ()) as workers:
        return list(workers.map(_job, jobs))


def measure(name: str, workers: int, loads: tuple | None = None, profile: str = PROFILE, processes: int = 1,
            requests_per_worker: int = 0, seed: int = 0, heartbeat_s: float = HEARTBEAT_S, partial=None) -> dict:
    """The claim at every load; partial(result so far), when given, after each load (a long run keeps what it has)."""
    claim = CLAIMS[name]
    cost = replace(cost_model(profile), cores=0)
    per_worker = claim.capacity(cost)
    loads = loads or claim.loads
    if requests_per_worker:
        claim = replace(claim, requests_per_worker=requests_per_worker)
    out = {}
    for load in loads:
        trace = claim.trace(load, workers, per_worker, seed)
        solo = None
        if claim.mix.tenants:  # the light tenants alone on the same cluster: their solo TTFT p99s
            lights = [r for r in trace if r.tenant != claim.mix.tenants[0].name]
            _, alone = _job((name, "_solo", workers, heartbeat_s, cost, lights, None))
            solo = alone["tenants"]
        jobs = [(name, system, workers, heartbeat_s, cost, trace, solo) for system in claim.systems]
        out[f"{load:g}"] = dict(_map(jobs, processes))
        if solo is not None:
            out[f"{load:g}"]["_solo"] = {"tenants": solo}
        log(f"{name} at load {load:g}: {len(trace)} requests over {trace[-1].arrival_s:.1f} s")
        if partial is not None:
            partial(_result(name, claim, workers, profile, cost, per_worker, loads, heartbeat_s, out))
    return _result(name, claim, workers, profile, cost, per_worker, loads, heartbeat_s, out)


def _result(name, claim, workers, profile, cost, per_worker, loads, heartbeat_s, out) -> dict:
    return {"claim": name, "title": claim.title, "workers": workers, "profile": profile, "cost": asdict(cost),
            "capacity_per_worker_req_per_s": round(per_worker, 4), "loads": [x for x in out],
            "mix": json.loads(json.dumps(asdict(claim.mix), default=str)), "systems": list(claim.systems),
            "baseline": claim.baseline, "speeds": list(claim.speeds), "slo": claim.slo,
            "worker": asdict(claim.worker), "heartbeat_s": heartbeat_s, "by_load": out,
            "targets": targets(name, out)}


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def targets(name: str, by_load: dict) -> dict:
    """Each claim's target, per load: the figure and whether it holds."""
    out = {}
    for load, systems in by_load.items():
        base = systems.get(CLAIMS[name].baseline, {})
        if name == "routing":
            cells = {s: _ratio(systems[s]["ttft_ms_p99"], base.get("ttft_ms_p99"))
                     for s in ("least-outstanding", "power-of-two") if s in systems}
            out[load] = {"ttft_p99_vs_round_robin": cells,
                         "met": {s: (v is not None and v <= 0.5) if float(load) >= 0.85 else None
                                 for s, v in cells.items()}}
        elif name.startswith("prefix"):
            p = systems.get("prefix-aware")
            if p:
                prefill = _ratio(p["prefill_tokens_computed"], base.get("prefill_tokens_computed"))
                ttft = _ratio(p["ttft_ms_p50"], base.get("ttft_ms_p50"))
                out[load] = {"prefill_vs_round_robin": prefill, "ttft_p50_vs_round_robin": ttft,
                             "busy_max_over_mean": p["busy_max_over_mean"],
                             "met": {"prefill": prefill is not None and prefill <= 0.2,
                                     "ttft_p50": ttft is not None and ttft <= 0.5,
                                     "balance": (p["busy_max_over_mean"] or 9) <= 1.3}}
        elif name == "tenants":
            out[load] = {s: {"jain_index": v.get("jain_index"), "light_ttft_p99_ratio": v.get("light_ttft_p99_ratio"),
                             "met": (v.get("jain_index") or 0) >= 0.95 and (v.get("light_ttft_p99_ratio") or 99) <= 3}
                         for s, v in systems.items() if not s.startswith("_")}
        elif name == "lora":
            out[load] = {}
            for s, v in systems.items():
                if s == CLAIMS[name].baseline:
                    continue
                slots = _ratio(v.get("lora_slot_loads"), base.get("lora_slot_loads"))
                reads = _ratio(v.get("lora_reads"), base.get("lora_reads"))
                tput = _ratio(v.get("output_tokens_per_s"), base.get("output_tokens_per_s"))
                out[load][s] = {"slot_loads_vs_least_outstanding": slots, "reads_vs_least_outstanding": reads,
                                "throughput_vs_least_outstanding": tput,
                                "met": slots is not None and slots <= 1 / 3 and (tput or 0) >= 0.95}
        elif name.startswith("pd"):
            best = max((s for s in systems if s.startswith("pd-")), key=lambda s: systems[s]["goodput_req_per_s"] or 0,
                       default=None)
            ratio = _ratio(systems[best]["goodput_req_per_s"], base.get("goodput_req_per_s")) if best else None
            out[load] = {"best": best, "goodput_vs_unified": ratio,
                         "met": (ratio is not None and ratio >= 1.5) if name == "pd-long" else None}
    return out


def _metric(summary: dict, name: str, workers: int):
    """A summary's figure by name; the per-request and per-worker ones compare across cluster sizes."""
    if name.endswith("_per_request"):
        done, key = summary.get("completed"), name.removesuffix("_per_request")
        total = summary.get("prefill_tokens_computed" if key == "prefill_tokens" else key)
        return total / done if done and total is not None else None
    if name.endswith("_per_worker"):
        total = summary.get(name.removesuffix("_per_worker"))
        return total / workers if total is not None else None
    return summary.get(name)


def plot(results: list, path: str) -> None:
    """One row of panels per claim result: each metric against load, a line per system; results of the same claim
    (the simulator at 1,000 and the mock mesh at 64) share the panels, solid and dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    claim = CLAIMS.get(results[0]["claim"], PLACEMENT)
    fig, axes = plt.subplots(1, len(claim.metrics), figsize=(4.2 * len(claim.metrics), 3.6))
    colors = {s: f"C{i}" for i, s in enumerate(claim.systems)}
    for r, style in zip(results, ("-", "--", ":")):
        loads = [float(x) for x in r["loads"]]
        label = r.get("label") or f"sim {r['workers']}"
        for ax, metric in zip(axes, claim.metrics):
            for s in claim.systems:
                ys = [_metric(r["by_load"][f"{x:g}"].get(s, {}), metric, r["workers"]) for x in loads]
                ax.plot(loads, [y if y is not None else float("nan") for y in ys], style, marker="o", ms=3,
                        color=colors[s], label=f"{s} ({label})")
            ax.set(title=metric, xlabel="load (fraction of capacity)")
    axes[0].legend(fontsize=6)
    fig.suptitle(f"{claim.title} (engine mocked / simulated; {results[0]['profile']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


PLACEMENT = Claim("placement", "09 placement of P/D groups on 1,000 hosts in racks of 40", Synthetic(),
                  {"first-fit": {}, "meshserve": {}},
                  ("kv_cross_rack", "kv_cross_host", "fragmented_hosts", "whole_free_hosts"), "first-fit")


def placement(hosts: int, loads: tuple | None, seed: int) -> dict:
    from sim.placement_claim import measure as place_measure

    loads = loads or LOADS
    by_load = place_measure(hosts, loads, seed)
    out = {}
    for load, by in by_load.items():
        base, ours = by["first-fit"], by["meshserve"]
        out[load] = {"kv_cross_rack_vs_first_fit": _ratio(ours["kv_cross_rack"], base["kv_cross_rack"]),
                     "kv_cross_host_vs_first_fit": _ratio(ours["kv_cross_host"], base["kv_cross_host"]),
                     "fragmented_hosts": {"first-fit": base["fragmented_hosts"], "meshserve": ours["fragmented_hosts"]}}
    return {"claim": "placement", "title": PLACEMENT.title, "workers": hosts, "label": f"{hosts} hosts",
            "profile": "none (no step times)", "loads": [f"{x:g}" for x in loads],
            "systems": ["first-fit", "meshserve"],
            "baseline": "first-fit", "by_load": by_load, "targets": out}


def add_parser(sub) -> None:
    p = sub.add_parser("claims", help="the seed's cluster claims against their baselines across loads (issue 62)")
    p.add_argument("name", choices=sorted([*CLAIMS, "placement"]))
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--loads", type=lambda t: tuple(float(x) for x in t.split(",")),
                   help="fractions of capacity (default: the claim's)")
    p.add_argument("--profile", default=PROFILE, help="the step-time model: a preset or a calibration file")
    p.add_argument("--requests-per-worker", type=int, default=0, help="default: the claim's")
    p.add_argument("--heartbeat-s", type=float, default=HEARTBEAT_S,
                   help="how often workers beat to their router (the mesh's routing.heartbeat_ms)")
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="the result JSON (a PNG is written beside it)")


def run(args) -> int:
    t = time.perf_counter()
    def write(result: dict, done: bool = False) -> None:
        result["command"] = "meshserve sim claims " + " ".join(sys.argv[3:])
        result["wall_s"] = round(time.perf_counter() - t, 1)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
            if done:
                plot([result], str(Path(args.out).with_suffix(".png")))
            log(f"wrote {args.out}" + ("" if done else f" (loads {', '.join(result['loads'])} so far)"))

    if args.name == "placement":  # --workers: the hosts
        result = placement(args.workers, args.loads, args.seed)
    else:
        result = measure(args.name, args.workers, args.loads, args.profile, args.processes, args.requests_per_worker,
                         args.seed, args.heartbeat_s, partial=write)
    write(result, done=True)
    print(json.dumps(result["targets"], indent=1))
    return 0
