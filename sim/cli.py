"""`meshserve sim`: run the cluster simulator (run), fit its cost model here (calibrate), write a synthetic trace
(trace), or run one of the at-scale studies (study). docs/SIMULATION.md has the details."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sim.cluster import AutoscaleSpec, ClusterSpec
from sim.cost import CostModel
from sim.run import DEFAULT_COST, log, simulate
from sim.trace import Synthetic, TenantSpec, read_jsonl, synthetic, write_jsonl
from sim.worker import WorkerSpec


def _pair(text: str, cast=int) -> tuple:
    try:
        a, b = text.split(",")
        return cast(a), cast(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two numbers separated by a comma, got {text!r}") from None


def _tenants(text: str) -> list:
    """NAME:RATE_SHARE:WEIGHT,... (weight optional)"""
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        try:
            out.append(TenantSpec(parts[0], float(parts[1]) if len(parts) > 1 else 1.0,
                                  float(parts[2]) if len(parts) > 2 else 1.0))
        except (ValueError, IndexError):
            raise argparse.ArgumentTypeError(f"a tenant is NAME[:RATE_SHARE[:WEIGHT]], got {item!r}") from None
    return out


def _weights(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        try:
            name, weight = item.split(":")
            out[name] = float(weight)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a tenant weight is NAME:WEIGHT, got {item!r}") from None
    return out


def add_trace_flags(p) -> None:
    g = p.add_argument_group("synthetic trace (when no --trace is given)")
    g.add_argument("--requests", type=int, default=1000)
    g.add_argument("--rate", type=float, default=10.0, help="mean arrivals per second")
    g.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson")
    g.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation of the gaps")
    g.add_argument("--prompt", type=_pair, default=(32, 512), help="prompt lengths: MIN,MAX (uniform)")
    g.add_argument("--output", type=_pair, default=(16, 256), help="output lengths: MIN,MAX (uniform)")
    g.add_argument("--system-prompts", type=int, default=0, help="shared prefixes, Zipf-popular (0 = none)")
    g.add_argument("--system-tokens", type=_pair, default=(1024, 2048))
    g.add_argument("--tenants", type=_tenants, default=[], help="NAME:RATE_SHARE:WEIGHT,...")
    g.add_argument("--adapters", type=int, default=0, help="LoRA adapters, Zipf-popular")
    g.add_argument("--deadline-fraction", type=float, default=0.0)
    g.add_argument("--deadline-ms", type=lambda s: _pair(s, float), default=(2000.0, 8000.0))
    g.add_argument("--burst-every-s", type=float, default=0.0)
    g.add_argument("--burst-s", type=float, default=0.0)
    g.add_argument("--burst-factor", type=float, default=1.0)
    g.add_argument("--diurnal-period-s", type=float, default=0.0)
    g.add_argument("--diurnal-amplitude", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)


def synthetic_of(args) -> Synthetic:
    return Synthetic(requests=args.requests, rate=args.rate, arrival=args.arrival, cv=args.cv, prompt=args.prompt,
                     output=args.output, system_prompts=args.system_prompts, system_tokens=args.system_tokens,
                     tenants=args.tenants, adapters=args.adapters, deadline_fraction=args.deadline_fraction,
                     deadline_ms=args.deadline_ms, burst_every_s=args.burst_every_s, burst_s=args.burst_s,
                     burst_factor=args.burst_factor, diurnal_period_s=args.diurnal_period_s,
                     diurnal_amplitude=args.diurnal_amplitude)


def add_cluster_flags(p) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--mode", choices=["unified", "disaggregated"], default="unified")
    g.add_argument("--workers", type=int, default=4, help="unified workers (decode workers when disaggregated)")
    g.add_argument("--prefill", type=int, default=1, help="prefill workers (disaggregated)")
    g.add_argument("--max-num-seqs", type=int, default=32)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per worker")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--batching", choices=["iteration", "request"], default="iteration")
    g.add_argument("--max-loras", type=int, default=0, help="LoRA compute slots per worker: model adapter residency "
                   "(reads and slot copies at the cost model's lora_read_s, lora_slot_s); 0 = adapters only route")
    g.add_argument("--max-cpu-loras", type=int, default=32, help="LoRA adapters a worker holds in host memory")
    g.add_argument("--no-lora-placement", dest="lora_placement", action="store_false",
                   help="no router adapter placement (routing.lora_placement: false)")
    g.add_argument("--routing", default="least-outstanding",
                   help="round-robin | least-outstanding | prefix-aware | lora-aware")
    g.add_argument("--admission", default="fcfs", help="the gateway's policy: fcfs | priority | deadline | fair | "
                                                       "fair-deadline")
    g.add_argument("--slot-policy", default="fcfs", help="every engine's slot policy (same names)")
    g.add_argument("--tenant-weights", type=_weights, default={}, help="NAME:WEIGHT,... (a tenant's fair share; "
                   "--tenants' weights otherwise)")
    g.add_argument("--heartbeat-s", type=float, default=1.0)
    g.add_argument("--cell-size", type=int, default=0, help="workers per router (0 = one router for all)")
    g.add_argument("--cost", help=f"the cost model JSON (`meshserve sim calibrate`; default: {DEFAULT_COST} when "
                                  "present, else built-in figures)")
    g.add_argument("--autoscale", choices=["token", "cpu", "rate"], help="scale the serving pool by this policy")
    g.add_argument("--startup-s", type=float, default=120.0, help="a new worker's start-up time")
    g.add_argument("--max-replicas", type=int, default=64)
    g.add_argument("--ttft-slo-ms", type=float)
    g.add_argument("--tpot-slo-ms", type=float)


def cost_of(args) -> CostModel:
    path = args.cost or (DEFAULT_COST if Path(DEFAULT_COST).exists() else None)
    if path is None:
        log("no cost model given and no sim-cost.json here: built-in figures (run `meshserve sim calibrate`)")
        return CostModel()
    return CostModel.load(path)


def spec_of(args) -> ClusterSpec:
    worker = WorkerSpec(num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, slot_policy=args.slot_policy,
                        batching=args.batching, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras)
    weights = {**{t.name: t.weight for t in getattr(args, "tenants", [])}, **args.tenant_weights}
    autoscale = None
    if args.autoscale:
        autoscale = AutoscaleSpec(args.autoscale, startup_s=args.startup_s, max_replicas=args.max_replicas,
                                  ttft_slo_s=(args.ttft_slo_ms or 1000.0) / 1e3)
    return ClusterSpec(mode=args.mode, workers=args.workers, prefill=args.prefill if args.mode != "unified" else 0,
                       worker=worker, routing=args.routing, admission=args.admission, tenant_weights=weights,
                       heartbeat_s=args.heartbeat_s, cell_size=args.cell_size, autoscale=autoscale,
                       ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms, lora_placement=args.lora_placement)


def cmd_run(args) -> int:
    from dataclasses import asdict

    from sim.report import plot

    try:
        trace = read_jsonl(args.trace) if args.trace else synthetic(synthetic_of(args), args.seed)
        spec, cost = spec_of(args), cost_of(args)
    except ValueError as e:
        print(f"meshserve sim: {e}", file=sys.stderr)
        return 2
    log(f"{len(trace)} requests over {trace[-1].arrival_s if trace else 0:.1f} s; {spec.mode}, "
        f"{spec.workers} worker(s), routing {spec.routing}, admission {spec.admission}")
    result = simulate(spec, cost, trace, progress=True)
    result = {"command": "meshserve " + " ".join(sys.argv[1:]), "trace": args.trace or asdict(synthetic_of(args)),
              "spec": _jsonable(asdict(spec)), "cost": asdict(cost), **result}
    text = json.dumps(result, indent=1, sort_keys=True) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        log(f"wrote {args.out}")
    if args.plot:
        plot(result, args.plot)
        log(f"wrote {args.plot}")
    s = result["summary"]
    for k in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "output_tokens_per_s", "completed",
              "failed_by_status", "utilisation", "slo_attainment", "goodput_req_per_s", "max_workers"):
        if k in s:
            print(f"{k:24} {s[k]}")
    return 0


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


def cmd_trace(args) -> int:
    trace = synthetic(synthetic_of(args), args.seed)
    write_jsonl(trace, args.out)
    log(f"wrote {len(trace)} requests to {args.out}")
    return 0


def cmd_study(args) -> int:
    from sim import studies

    return studies.run(args)


def add_parser(sub, func) -> None:
    sim = sub.add_parser("sim", help="the cluster simulator: run, calibrate, trace, study, claims").add_subparsers(
        dest="sim_command", required=True)
    run = sim.add_parser("run", help="simulate a cluster on a trace (JSONL, or synthetic from the flags)")
    run.add_argument("--trace", help="a JSONL trace (services/common/workload_trace.py; `meshserve up --record-trace` "
                                     "writes one)")
    run.add_argument("--out", help="write the result JSON here")
    run.add_argument("--plot", help="write a PNG of the result here")
    add_trace_flags(run)
    add_cluster_flags(run)
    run.set_defaults(func=func, sim_func=cmd_run)
    tr = sim.add_parser("trace", help="write a synthetic trace (JSONL)")
    tr.add_argument("--out", required=True)
    add_trace_flags(tr)
    tr.set_defaults(func=func, sim_func=cmd_trace)
    from sim import studies

    studies.add_parser(sim)
    sim.choices["study"].set_defaults(func=func, sim_func=cmd_study)
    from sim import claims

    claims.add_parser(sim)
    sim.choices["claims"].set_defaults(func=func, sim_func=claims.run)
    return sim
