"""Workload sim-validate: the simulator against the real mesh on this machine, same trace, three workloads.

First the cost model: fitted here and now (`meshserve sim calibrate`'s procedure: one worker's logged steps
under a calibration load of its own prompts, none of the workloads'), unless --sim-cost names a calibration.
Then, for each workload, the real mesh serves it with its gateway recording the trace (--record-trace: arrival
times, lengths, prompt block hashes, tenants, deadlines), and the simulator replays that recorded trace on a
cluster of the same shape and policies. Both sides are summarised by the same code (sim/report.py
latency_summary): TTFT p50/p99, TPOT p50/p99 over the completed requests, output tokens/s from the first
arrival to the last token.

- mesh-mixed: 1 unified worker, mesh-mixed's requests (prompts 32-512, outputs 16-256, 128 of them), Poisson
  at 50% of the worker's saturation throughput (measured first, by a burst of other prompts), default
  admission and slot policies (fair-deadline), the mesh-mixed engine flags.
- prefix-shared: 4 unified workers, prefix-aware routing, prefix-shared's requests (8 system prompts of
  1,024-2,048 tokens, Zipf(1.0), 32-128 own tokens, outputs 32-64; 200 of them) and its KV pool size,
  Poisson at 50% of the saturation throughput of a burst.
- tenants-overload: 2 unified workers, 16 sequences each, the fair policy at the gateway and in the engines,
  tenants A:B:C weighted 1:1:2 offering 1.25 : 0.25 : 0.5 x the capacity C (a burst's rate) for 60 s; 30% of
  requests carry a deadline of 1.5-4 x their solo latency as the cost model predicts it.

Each system's `real` and `sim` metrics, `error` (sim / real - 1 per metric) and `within` (|error| <= 15% for
p50s and throughput, 25% for p99s). Beside them `sim_speed_corrected`: the same simulation with every step
cost scaled by how much slower the real run's workers stepped than the calibration predicts (the median over
their own logged decode steps, so contention is inside the factor and not simulated again): on a shared VM
whose speed drifts by 20-40% between runs minutes apart, it separates the simulator's dynamics (queueing,
batching, routing, admission) from the machine's drift. Not in CI: it runs the real mesh for several minutes.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from bench import mesh_mixed, prefix_shared, tenants_overload
from bench.calibrate import calibrate, measured_drive
from bench.common import default_model, log, machine, print_table, random_requests, write_result
from bench.latency import poisson_arrivals
from bench.online import drive
from services.mesh.launcher import Mesh, MeshSpec
from services.policy.tenants import hash_key
from sim.cluster import AutoscaleSpec, ClusterSpec
from sim.cost import CostModel, intervals
from sim.report import latency_summary
from sim.run import simulate
from sim.trace import read_jsonl, write_jsonl
from sim.worker import WorkerSpec

WORKLOADS = ("mesh-mixed", "prefix-shared", "tenants-overload")
METRICS = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "output_tokens_per_s")
WARM = 4  # warm-up requests each mesh serves before the workload (recorded too; dropped from the trace)


def add_flags(p) -> None:
    g = p.add_argument_group("sim-validate")
    g.add_argument("--sim-cost", help="a cost model from `meshserve sim calibrate` (default: calibrate first)")
    g.add_argument("--validate", default=",".join(WORKLOADS), help="the workloads to validate, comma-separated")
    g.add_argument("--keep", metavar="DIR", help="also write each real run (its summary, recorded trace, step logs, "
                   "cluster and cost model) under DIR, for --replay")
    g.add_argument("--repeat", type=int, default=1, help="real runs of each workload (the same requests at the same "
                   "times, each on a fresh mesh): the figures compared are each metric's median over them, beside "
                   "how far apart the real runs came out")
    g.add_argument("--replay", metavar="DIR", help="no real runs: simulate the real runs kept under DIR by --keep "
                   "(their cost model too) and compare with their figures")


@dataclass
class Served:
    """A real request as the client saw it, in the simulator's terms (for latency_summary)."""
    trace: object
    arrival_s: float
    first_s: float | None = None
    last_s: float | None = None
    tokens_out: int = 0
    cached_tokens: int = 0
    error: str = ""


@dataclass
class _Len:
    prompt_tokens: int
    tenant: str = ""


def _served(timings: list, reqs: list) -> list:
    t0 = min(t.arrival_s for t in timings)
    out = []
    for t, r in zip(timings, reqs):
        def rel(x, t0=t0):
            return None if x is None else x - t0
        out.append(Served(_Len(len(r["prompt_token_ids"]), r.get("tenant", "")), t.arrival_s - t0, rel(t.first_s),
                          rel(t.last_s), t.tokens, t.cached_tokens, t.error))
    return out


def _recorded(path: Path) -> list:
    trace = read_jsonl(path)[WARM:]
    t0 = trace[0].arrival_s
    for r in trace:
        r.arrival_s -= t0
    return trace


def _kv_blocks(cost: CostModel, gb: float, block_size: int = 16) -> int:
    return max(1, int(gb * 1024**3) // (cost.kv_bytes_per_token * block_size))


def _run_real(model_dir: Path, spec: MeshSpec, reqs: list, arrivals: list, keys: dict | None = None,
              before=None, after=None):
    """before(mesh), after(mesh): called once the mesh is warm (requests it sends are recorded in the trace before the
    workload's: the caller drops them), and once the workload is served, before the mesh stops."""
    folder = Path(tempfile.mkdtemp(prefix="meshserve-simval-"))
    trace_path, steps = folder / "trace.jsonl", folder / "steps"
    steps.mkdir()
    spec.gateway_args = [*spec.gateway_args, "--record-trace", str(trace_path)]
    spec.env = {**spec.env, "MESHSERVE_STEP_LOG": str(steps)}
    with Mesh(spec) as mesh:
        warm = random_requests(WARM, (32, 64), (4, 4), 32000, seed=99)
        for w in warm:
            w["tenant"] = reqs[0].get("tenant", "")
        asyncio.run(drive(mesh.gateway, warm, None, keys=keys))
        if before is not None:
            before(mesh)
        timings, phase = measured_drive(mesh, steps, reqs, arrivals, keys)
        if after is not None:
            after(mesh)
        log(f"real: {len(reqs)} requests" + (f" in {phase['seconds']:.1f} s" if phase else ""))
    logged = [[json.loads(line) for line in f.read_text().splitlines()] for f in sorted(steps.glob("steps-*.jsonl"))]
    served = _served(timings, reqs)
    summary = latency_summary(served)
    if phase is not None:  # the rest of the mesh's CPU over the run (bench/calibrate.py)
        summary["host_cores"], summary["seconds"] = round(phase["cpu_s"] / phase["seconds"], 4), phase["seconds"]
    return summary, _recorded(trace_path), logged, served


def _saturation(model_dir: Path, spec: MeshSpec, burst: list, keys: dict | None = None) -> float:
    with Mesh(spec) as mesh:
        asyncio.run(drive(mesh.gateway, burst[:4], None, keys=keys))
        t = time.perf_counter()
        asyncio.run(drive(mesh.gateway, burst, [0.0] * len(burst), keys=keys))
        return len(burst) / (time.perf_counter() - t)


def mesh_mixed_case(model_dir: Path, cost: CostModel, args) -> tuple:
    n = 32 if args.quick else 128
    reqs = random_requests(n, (32, 512), (16, 256), vocab=32000, seed=args.seed)
    spec = lambda: MeshSpec(str(model_dir), mode="unified", engine_args=mesh_mixed.ENGINE_ARGS)  # noqa: E731
    sat = _saturation(model_dir, spec(), random_requests(n, (32, 512), (16, 256), vocab=32000, seed=args.seed + 1))
    rate = 0.5 * sat
    log(f"mesh-mixed: saturation {sat:.2f} req/s, offered {rate:.2f} req/s")
    arrivals = poisson_arrivals(n, rate, args.seed)
    cluster = ClusterSpec(mode="unified", workers=1, worker=WorkerSpec(
        num_blocks=_kv_blocks(cost, 1.0), max_num_seqs=256, max_num_batched_tokens=512, slot_policy="fair-deadline"),
        routing="least-outstanding", admission="fair-deadline")
    return lambda: _run_real(model_dir, spec(), reqs, arrivals), cluster, {"offered_req_per_s": round(rate, 3),
                                                                           "requests": n}


def prefix_shared_case(model_dir: Path, cost: CostModel, args) -> tuple:
    n = 60 if args.quick else 200
    systems, reqs = prefix_shared.workload(n, args.seed)
    mean_sys = sum(map(len, systems)) / len(systems)
    blocks = math.ceil((2 * mean_sys + 128 + 64) / prefix_shared.BLOCK)
    engine = ["--num-blocks", str(blocks), "--block-size", str(prefix_shared.BLOCK), "--max-num-batched-tokens", "512"]
    spec = lambda: MeshSpec(str(model_dir), mode="unified", unified=4, engine_args=engine,  # noqa: E731
                            policy="prefix-aware")
    _, burst = prefix_shared.workload(64 if not args.quick else 24, args.seed + 1)
    sat = _saturation(model_dir, spec(), burst)
    rate = 0.5 * sat
    log(f"prefix-shared: saturation {sat:.2f} req/s, offered {rate:.2f} req/s")
    arrivals = poisson_arrivals(n, rate, args.seed)
    cluster = ClusterSpec(mode="unified", workers=4, worker=WorkerSpec(
        num_blocks=blocks, block_size=prefix_shared.BLOCK, max_num_seqs=256, max_num_batched_tokens=512,
        slot_policy="fair-deadline"), routing="prefix-aware", admission="fair-deadline")
    return lambda: _run_real(model_dir, spec(), reqs, arrivals), cluster, {
        "offered_req_per_s": round(rate, 3), "requests": n, "kv_blocks_per_worker": blocks}


def tenants_case(model_dir: Path, cost: CostModel, args) -> tuple:
    duration = 20.0 if args.quick else 60.0
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="meshserve-simval-tenants-"))
    keys = {t: f"bench-key-{t}" for t in tenants_overload.TENANTS}
    cfg = {"tenants": [{"name": t, "api_key_hashes": [hash_key(keys[t])], "weight": w}
                       for t, (w, _) in tenants_overload.TENANTS.items()]}
    (workdir / "mesh.yaml").write_text(yaml.safe_dump(cfg))
    engine = tenants_overload.ENGINE + ["--slot-policy", "fair"]
    spec = lambda: MeshSpec(str(model_dir), mode="unified", unified=2, engine_args=engine,  # noqa: E731
                            config_file=str(workdir / "mesh.yaml"), gateway_args=["--admission-policy", "fair"])
    burst = [tenants_overload._request(rng, i, "C") for i in range(24 if args.quick else 48)]
    cap = _saturation(model_dir, spec(), burst, keys)
    solo = lambda r: (cost.hop_s + cost.step_s(1, len(r["prompt_token_ids"]) - 1)  # noqa: E731 (one chunk, roughly)
                      + r["max_tokens"] * cost.step_s(1, 0, len(r["prompt_token_ids"]))) * 1e3
    schedule = []
    for t, (_, mult) in tenants_overload.TENANTS.items():
        rate = mult * cap
        for i, at in enumerate(a for a in poisson_arrivals(int(rate * duration * 1.5) + 10, rate,
                                                           rng.randrange(1 << 30)) if a < duration):
            r = tenants_overload._request(rng, i, t)
            if rng.random() < 0.3:
                r["deadline_ms"] = int(max(solo(r), 1.0) * rng.uniform(1.5, 4.0))
            schedule.append((at, r))
    schedule.sort(key=lambda e: e[0])
    log(f"tenants-overload: capacity {cap:.2f} req/s; {len(schedule)} requests over {duration:.0f} s")
    reqs, arrivals = [r for _, r in schedule], [at for at, _ in schedule]
    cluster = ClusterSpec(mode="unified", workers=2, worker=WorkerSpec(
        num_blocks=_kv_blocks(cost, 0.25), max_num_seqs=16, max_num_batched_tokens=512, slot_policy="fair"),
        routing="least-outstanding", admission="fair",
        tenant_weights={t: w for t, (w, _) in tenants_overload.TENANTS.items()})
    return lambda: _run_real(model_dir, spec(), reqs, arrivals, keys), cluster, {
        "capacity_req_per_s": round(cap, 3), "requests": len(reqs), "duration_s": duration}


def speed_factor(cost: CostModel, steps: list) -> float:
    """How much slower the real run's workers stepped than the calibration predicts, on their own logged decode
    steps (`steps`: one list per worker; the median ratio, contention between the workers included): what the
    time of day and the neighbours did to this machine since the calibration."""
    rows = sorted(t / cost.step_s(s, 0, c) for worker in steps for s, p, c, _, t in intervals(worker) if p == 0)
    return rows[len(rows) // 2] if rows else 1.0


# Each case sizes its workload on the real mesh and returns (run, cluster, config): run() serves the workload on a
# fresh mesh (the same requests at the same offsets each call) and returns (summary, recorded trace, step logs).
CASES = {"mesh-mixed": mesh_mixed_case, "prefix-shared": prefix_shared_case, "tenants-overload": tenants_case}


def compare(real: dict, sim: dict) -> tuple[dict, dict]:
    errors, within = {}, {}
    for m in METRICS:
        a, b = real.get(m), sim.get(m)
        errors[m] = round(b / a - 1, 4) if a and b is not None else None
        bound = 0.25 if m.endswith("p99") else 0.15
        within[m] = errors[m] is not None and abs(errors[m]) <= bound
    return errors, within


def _run_dir(folder: Path, name: str, i: int) -> Path:
    """Where --keep writes a workload's real run i (0 = the first; a repeat goes beside it)."""
    return folder / (name if i == 0 else f"{name}.{i + 1}")


def _keep(d: Path, real: dict, trace: list, cluster: ClusterSpec, steps: list, cfg: dict, served: list) -> None:
    from dataclasses import asdict

    (d / "steps").mkdir(parents=True, exist_ok=True)
    # every request as the client saw it (seconds from the first arrival), for looking into a figure
    (d / "served.jsonl").write_text("".join(json.dumps({
        "tenant": s.trace.tenant, "prompt_tokens": s.trace.prompt_tokens, "arrival_s": round(s.arrival_s, 6),
        "first_s": s.first_s and round(s.first_s, 6), "last_s": s.last_s and round(s.last_s, 6),
        "tokens": s.tokens_out, "cached_tokens": s.cached_tokens, "error": s.error}) + "\n" for s in served))
    write_jsonl(trace, d / "trace.jsonl")
    for i, worker in enumerate(steps):
        (d / "steps" / f"worker-{i}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in worker))
    (d / "run.json").write_text(json.dumps({"real": real, "cluster": asdict(cluster), "config": cfg}, indent=1) + "\n")


def _kept(folder: Path, name: str) -> tuple[list, ClusterSpec, dict]:
    """A workload's kept real runs: ([(summary, trace, step logs) per run], cluster, config)."""
    runs, cluster, cfg = [], None, {}
    while (d := _run_dir(folder, name, len(runs))).joinpath("run.json").exists():
        run = json.loads((d / "run.json").read_text())
        c, cfg = run["cluster"], run["config"]
        cluster = ClusterSpec(**{**c, "worker": WorkerSpec(**c["worker"]),
                                 "prefill_worker": c["prefill_worker"] and WorkerSpec(**c["prefill_worker"]),
                                 "autoscale": c["autoscale"] and AutoscaleSpec(**c["autoscale"])})
        steps = [[json.loads(line) for line in f.read_text().splitlines() if line.strip()]
                 for f in sorted((d / "steps").glob("worker-*.jsonl"))]
        runs.append((run["real"], read_jsonl(d / "trace.jsonl"), steps))
    if not runs:
        raise ValueError(f"--replay: no kept run of {name} in {folder} (write one with --keep)")
    return runs, cluster, cfg


def _median_summary(summaries: list) -> dict:
    """Each figure's median over repeated runs (per status for the failure counts); one run is itself."""
    if len(summaries) == 1:
        return summaries[0]
    out = {}
    for k, v in summaries[0].items():
        if isinstance(v, dict):
            codes = {c for s in summaries for c in s.get(k, {})}
            out[k] = {c: statistics.median(s.get(k, {}).get(c, 0) for s in summaries) for c in sorted(codes)}
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            xs = [s[k] for s in summaries if s.get(k) is not None]
            out[k] = round(statistics.median(xs), 4) if xs else None
        else:
            out[k] = v
    return out


def _spread(summaries: list) -> dict:
    """How far apart repeated runs of one workload came out: max / min - 1 per metric."""
    out = {}
    for m in METRICS:
        xs = [s[m] for s in summaries if s.get(m)]
        out[m] = round(max(xs) / min(xs) - 1, 4) if len(xs) > 1 else None
    return out


def run(args) -> int:
    if args.repeat < 1:
        raise ValueError(f"--repeat must be 1 or more, got {args.repeat}")
    model_dir = Path(args.model) if args.model else default_model("bench")
    keep = Path(args.keep) if args.keep else None
    replay = Path(args.replay) if args.replay else None
    if replay:
        cost = CostModel.load(replay / "cost.json")
        log(f"replaying the real runs kept in {replay}")
    elif args.sim_cost:
        cost = CostModel.load(args.sim_cost)
        log(f"cost model from {args.sim_cost}")
    else:
        log("calibrating the cost model (one worker's steps under a calibration load)")
        cost = calibrate(model_dir, args.quick, args.seed)
    if keep:
        cost.save(keep / "cost.json")
    systems, config = {}, {}
    fields = (*METRICS, "e2e_ms_p50", "e2e_ms_p99", "completed", "requests", "failed_by_status", "cached_prompt_tokens",
            "prompt_tokens")
    for name in [w for w in WORKLOADS if w in args.validate.split(",")]:
        if replay:
            runs, cluster, cfg = _kept(replay, name)
        else:
            serve, cluster, cfg = CASES[name](model_dir, cost, args)
            runs = []
            for i in range(args.repeat):
                if args.repeat > 1:
                    log(f"{name}: real run {i + 1} of {args.repeat}")
                real, trace, steps, served = serve()
                runs.append((real, trace, steps))
                if keep:
                    _keep(_run_dir(keep, name, i), real, trace, cluster, steps, cfg, served)
        reals, sims, correcteds, factors = [], [], [], []
        for real, trace, steps in runs:  # each real run against the simulation of its own recorded trace
            factor = speed_factor(cost, steps)
            reals.append(real)
            sims.append(simulate(cluster, cost, trace)["summary"])
            correcteds.append(simulate(cluster, replace(
                cost, cores=0, base_s=cost.base_s * factor, per_seq_s=cost.per_seq_s * factor,
                per_context_s=cost.per_context_s * factor, prefill_s_per_token=cost.prefill_s_per_token * factor,
                prefill_context_s=cost.prefill_context_s * factor), trace)["summary"])
            factors.append(factor)
        real, sim, corrected = _median_summary(reals), _median_summary(sims), _median_summary(correcteds)
        errors, within = compare(real, sim)
        errors2, within2 = compare(real, corrected)
        systems[name] = {"real": {k: real.get(k) for k in fields}, "sim": {k: sim.get(k) for k in fields},
                         "error": errors, "within": within,
                         "sim_speed_corrected": {k: corrected.get(k) for k in fields}, "error_speed_corrected": errors2,
                         "within_speed_corrected": within2}
        config[name] = {**cfg, "speed_factor": round(statistics.median(factors), 4)}
        if len(runs) > 1:  # the real figures' own spread, beside the simulator's error
            systems[name].update(
                runs=len(runs), real_spread=_spread(reals), sim_spread=_spread(sims),
                per_run=[{"real": {m: r.get(m) for m in METRICS}, "sim": {m: s.get(m) for m in METRICS},
                          "error": compare(r, s)[0], "speed_factor": round(f, 4)}
                         for r, s, f in zip(reals, sims, factors)])
        hosted = [r for r in reals if r.get("host_cores") is not None]
        if hosted:  # the rest of the mesh's CPU: measured, and as the model has it
            real_cores = statistics.median(r["host_cores"] for r in hosted)
            model_cores = statistics.median(cost.host_cores(r["requests"] / r["seconds"], r["output_tokens_per_s"])
                                            for r in hosted)
            config[name]["host_cores"] = {"real": round(real_cores, 4), "model": round(model_cores, 4)}
        log(f"{name}: " + ", ".join(f"{m} real {real.get(m)} sim {sim.get(m)} ({errors[m]:+.1%})"
                                    if errors[m] is not None else f"{m} n/a" for m in METRICS))
    from dataclasses import asdict

    result = {"workload": "sim-validate", "command": args.command_line, "machine": machine(),
              "config": {**config, "cost_model": asdict(cost), "model": str(model_dir), "threads_per_worker": 1},
              "systems": systems,
              "ratios": {f"{w}:sim/real:{m}": round(1 + e, 4) for w, s in systems.items()
                         for m, e in s["error"].items() if e is not None},
              "within_bounds": {w: all(s["within"].values()) for w, s in systems.items()}}
    write_result(result, args.out)
    for w, s in systems.items():
        print(f"{w:18}" + "".join(f"{m}: {s['real'].get(m)} vs {s['sim'].get(m)}  " for m in METRICS))
    print_table({"workload": "sim-validate", "systems": {w: {m: s['error'][m] for m in METRICS}
                                                         for w, s in systems.items()}})
    return 0
