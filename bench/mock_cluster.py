"""Workload mock-cluster: the real mesh with mock workers (engine.backend mock) at 8 to 64 workers on this machine,
against the simulator on the same trace and the same step-time model. THE ENGINE IS MOCKED: every figure here is the
control plane's (gateway, router, admission, scheduler, KV bookkeeping) over a modelled step time, not a model's.

For each worker count: the mesh starts with that many unified mock workers (the step-time profile --profile, every
step --time-scale times slower in real time, and the offered load as much slower: the control plane's own CPU keeps
up, and its latencies shrink relative to the work by that factor); requests (prompts 32-512, outputs 16-128, the
mesh-mixed shape) arrive by Poisson at --offered x the cluster's saturation throughput (the simulator's, for a burst
of the same requests). The gateway records the trace; the simulator replays it on a cluster of the same shape
(workers, KV blocks, batch limits, routing and admission policies, heartbeat period in mock time), with the same
step-time model and the mock mesh's hop time as measured on lone requests before the load (real / scale). Reported
in mock time (real / scale): TTFT and TPOT p50/p99 and output tokens/s for both, sim / mock - 1 per metric, within
5% (p50s, throughput) and 10% (p99s); and from the mock mesh: each process's proportional set size (PSS: shared
pages split between the processes sharing them) per mock worker and in total, and the CPU of everything but the mock
engine cores (gateway, router, kvstore, Redis, servicers, the load's client) in cores, at the load.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from bench.common import default_model, log, machine, print_table, random_requests, write_result
from bench.latency import poisson_arrivals
from bench.proc_cpu import descendants
from bench.sim_validate import METRICS, _run_real
from services.engine.cost_model import cost_model
from services.engine.hf_config import parse_config, read_json
from services.mesh.launcher import Mesh, MeshSpec
from sim.cluster import GATEWAY_POLL_S, ClusterSpec
from sim.report import latency_summary
from sim.run import simulate
from sim.worker import WorkerSpec

BOUNDS = {"p99": 0.10, "other": 0.05}
MAX_SEQS, BATCH_TOKENS, BLOCKS = 32, 512, 1024
PROBES = 7  # lone requests that measure the mesh's hop time (recorded in the trace before the workload)


def add_flags(p) -> None:
    g = p.add_argument_group("mock-cluster")
    g.add_argument("--mock-workers", default="8,64", help="worker counts, comma-separated")
    g.add_argument("--profile", default="h100-llama8b", help="the step-time model (a preset or a calibration file)")
    g.add_argument("--time-scale", type=float, default=0.0, help="real seconds per mock second (default: enough "
                   "that the mesh streams about --real-tokens-per-s)")
    g.add_argument("--real-tokens-per-s", type=float, default=1200.0, help="what this machine's control plane "
                   "streams comfortably (sizes the default time scale)")
    g.add_argument("--offered", type=float, default=0.7, help="offered load, a fraction of the saturation throughput")
    g.add_argument("--requests-per-worker", type=int, default=8)


def workload(n: int, vocab: int, seed: int) -> list:
    return random_requests(n, (32, 512), (16, 128), vocab=vocab, seed=seed)


def cluster(workers: int, scale: float) -> ClusterSpec:
    """The mock mesh's shape in the simulator, its periods in mock time: heartbeats every 1 s and the gateway's
    view polled every 0.25 s of real time."""
    return ClusterSpec(mode="unified", workers=workers, worker=WorkerSpec(
        num_blocks=BLOCKS, max_num_seqs=MAX_SEQS, max_num_batched_tokens=BATCH_TOKENS, slot_policy="fair-deadline"),
        routing="least-outstanding", admission="fair-deadline", heartbeat_s=1.0 / scale,
        gateway_poll_s=GATEWAY_POLL_S / scale)


def saturation(spec: ClusterSpec, cost, reqs: list) -> tuple[float, float]:
    """(requests/s, output tokens/s) of a burst of reqs in the simulator (mock time)."""
    from sim.trace import TraceRequest

    trace = [TraceRequest(arrival_s=0.0, prompt_tokens=len(r["prompt_token_ids"]), output_tokens=r["max_tokens"],
                          id=str(i)) for i, r in enumerate(reqs)]
    s = simulate(spec, cost, trace)["summary"]
    span = sum(r["max_tokens"] for r in reqs) / s["output_tokens_per_s"]
    return len(reqs) / span, s["output_tokens_per_s"]


def hop_s(mesh: Mesh, cost, scale: float, vocab: int) -> float:
    """The mesh's own time around a request's steps, in mock time: lone requests' TTFT (real, one at a time) less
    their one prompt step's modelled time, the median over PROBES of them, divided by the scale. The simulator's
    hop_s for the comparison: measured on the mock mesh before the load, not fitted to the result."""
    import asyncio
    import statistics

    from bench.online import drive

    reqs = random_requests(PROBES, (32, 64), (2, 2), vocab=vocab, seed=7)
    timings = asyncio.run(drive(mesh.gateway, reqs, None))
    hops = [(t.first_s - t.arrival_s) - scale * cost.step_s(1, len(r["prompt_token_ids"]) - 1)
            for t, r in zip(timings, reqs)]
    return max(statistics.median(hops), 0.0) / scale


def pss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def memory(mesh: Mesh) -> dict:
    """PSS per process tree of the mesh: per mock worker (servicer + engine core), the rest, and the total."""
    workers, rest = [], {}
    for p in mesh.procs:
        mb = sum(pss_mb(pid) for pid in {p.popen.pid} | descendants(p.popen.pid))
        if p.pool in ("unified", "prefill", "decode"):
            workers.append(mb)
        else:
            rest[p.name] = round(mb, 1)
    total = sum(workers) + sum(rest.values())
    return {"per_worker_mb_mean": round(sum(workers) / len(workers), 1), "per_worker_mb_max": round(max(workers), 1),
            "workers_mb": round(sum(workers), 1), "services_mb": rest, "total_mb": round(total, 1)}


def scaled(served: list, scale: float) -> list:
    return [replace(s, arrival_s=s.arrival_s / scale, first_s=s.first_s and s.first_s / scale,
                    last_s=s.last_s and s.last_s / scale) for s in served]


def compare(mock: dict, sim: dict) -> tuple[dict, dict]:
    errors, within = {}, {}
    for m in METRICS:
        a, b = mock.get(m), sim.get(m)
        errors[m] = round(b / a - 1, 4) if a and b is not None else None
        bound = BOUNDS["p99"] if m.endswith("p99") else BOUNDS["other"]
        within[m] = errors[m] is not None and abs(errors[m]) <= bound
    return errors, within


def one(model_dir: Path, workers: int, args, vocab: int) -> dict:
    cost = cost_model(args.profile)
    n = workers * args.requests_per_worker
    reqs = workload(n, vocab, args.seed)
    sat_rps, sat_tps = saturation(cluster(workers, 1.0), cost, workload(n, vocab, args.seed + 1))
    rate = args.offered * sat_rps
    scale = args.time_scale or max(1.0, math.ceil(args.offered * sat_tps / args.real_tokens_per_s))
    log(f"{workers} mock workers: saturation {sat_rps:.1f} req/s ({sat_tps:.0f} tok/s) in mock time; offered "
        f"{rate:.1f} req/s; time scale {scale:g}")
    arrivals = [a * scale for a in poisson_arrivals(n, rate, args.seed)]
    engine = ["--backend", "mock", "--mock-profile", args.profile, "--mock-time-scale", str(scale), "--num-blocks",
              str(BLOCKS), "--max-num-seqs", str(MAX_SEQS), "--max-num-batched-tokens", str(BATCH_TOKENS)]
    spec = MeshSpec(str(model_dir), mode="unified", unified=workers, engine_args=engine)
    held: dict = {}
    real, trace, _, served = _run_real(
        model_dir, spec, reqs, arrivals, before=lambda mesh: held.update(hop_s=hop_s(mesh, cost, scale, vocab)),
        after=lambda mesh: held.update(memory=memory(mesh)))
    mock = latency_summary(scaled(served, scale))
    trace = trace[PROBES:]  # the hop probes came first
    t0 = trace[0].arrival_s  # the workload's first arrival is the simulation's 0, as the mock side's summary has it
    for r in trace:
        r.arrival_s = (r.arrival_s - t0) / scale
    sim = simulate(cluster(workers, scale), replace(cost, hop_s=held["hop_s"]), trace)["summary"]
    errors, within = compare(mock, sim)
    log(f"{workers} workers: " + ", ".join(f"{m} mock {mock.get(m)} sim {sim.get(m)} ({errors[m]:+.1%})"
                                          if errors[m] is not None else f"{m} n/a" for m in METRICS))
    return {"workers": workers, "requests": n, "time_scale": scale, "offered_req_per_s": round(rate, 3),
            "saturation_req_per_s": round(sat_rps, 3), "mock": {k: mock.get(k) for k in (*METRICS, "completed")},
            "sim": {k: sim.get(k) for k in (*METRICS, "completed")}, "error": errors, "within": within,
            "memory": held.get("memory"), "hop_ms": round(held["hop_s"] * 1e3, 3),
            "control_plane_cores": real.get("host_cores"), "real_seconds": real.get("seconds")}


def run(args) -> int:
    model_dir = Path(args.model) if args.model else default_model("tiny")
    vocab = parse_config(read_json(model_dir / "config.json"), model_dir / "config.json").vocab_size
    systems = {}
    for w in (int(x) for x in args.mock_workers.split(",")):
        systems[f"{w}-workers"] = one(model_dir, w, args, vocab)
    result = {"workload": "mock-cluster", "command": args.command_line, "machine": machine(), "engine": "MOCKED",
              "config": {"profile": args.profile, "offered": args.offered, "bounds": BOUNDS, "max_num_seqs": MAX_SEQS,
                         "num_blocks": BLOCKS, "max_num_batched_tokens": BATCH_TOKENS},
              "systems": systems,
              "within_bounds": {k: all(s["within"].values()) for k, s in systems.items()}}
    write_result(result, args.out)
    print_table({"workload": "mock-cluster (sim / mock - 1)", "systems": {k: s["error"] for k, s in systems.items()}})
    return 0
