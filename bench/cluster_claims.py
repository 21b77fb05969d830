"""Workload cluster-claims: the seed's cluster claims (sim/claims.py) on the real mesh with 64 mock workers. THE ENGINE
IS MOCKED: every figure is the control plane's decisions (gateway admission, routing, the engines' schedulers and
prefix caches) over the step-time model of the claim (--profile), not a model's.

For each claim and each of its systems, a mesh of --mock-workers unified mock workers starts with the system's
routing, admission and slot policies (tenants: one API key per tenant); each load's trace is the simulator's own for
that claim at this worker count (sim/claims.py: Claim.trace), sent through the gateway at its arrival times, every
time and the mock engine's steps --claim-time-scale times slower (default: enough that the mesh streams at most about
--claim-real-tokens-per-s and admits at most --claim-real-requests-per-s at the claim's highest load, from the
simulator's figures for the same trace). Reported in mock
time (real / scale): the claim's metrics per system and load, and beside them the simulator on the same trace and
cluster ("sim 64"). The workers beat to the router every 100 ms of mock time as in the simulator (routing.heartbeat_ms
set to 100 ms x the scale, the router's worker TTL three beats), and the simulator's gateway queue bound is the
mesh's 30 s of real time in mock time. Heterogeneous
speeds (the routing claim) are per-worker time scales. Prefix claims start a fresh mesh for every load (cold caches,
as every simulation starts); the others serve their loads in turn on one mesh. Tenants: the light tenants' solo figure
is their trace without the heavy tenant, on the fair-deadline mesh.
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import yaml

from bench.common import default_model, log, machine, worker_lora_stats, write_result
from bench.online import drive
from bench.sim_validate import Served
from bench.tenants_overload import tenant_config
from services.engine.cost_model import cost_model
from services.engine.hf_config import parse_config, read_json
from services.mesh.launcher import Mesh, MeshSpec
from sim import claims as sc
from sim.cluster import GATEWAY_POLL_S
from sim.report import latency_summary, percentile

MOCK_CLAIMS = ("routing", "prefix-8", "prefix-64", "tenants", "lora")


def add_flags(p) -> None:
    g = p.add_argument_group("cluster-claims")
    g.add_argument("--claims", default=",".join(MOCK_CLAIMS), help="comma-separated: " + ", ".join(MOCK_CLAIMS))
    g.add_argument("--claim-loads", help="fractions of capacity, comma-separated (default: the claim's)")
    g.add_argument("--claim-workers", type=int, default=64, help="mock workers")
    g.add_argument("--claim-requests-per-worker", type=int, default=24)
    g.add_argument("--claim-time-scale", type=float, default=0.0, help="real seconds per mock second (default: "
                   "from --claim-real-tokens-per-s)")
    g.add_argument("--claim-real-tokens-per-s", type=float, default=900.0)
    g.add_argument("--claim-real-requests-per-s", type=float, default=20.0, help="what this machine's gateway and "
                   "router admit and route comfortably beside the streams (also sizes the default time scale)")
    g.add_argument("--claim-profile", default=sc.PROFILE)
    g.add_argument("--claim-out-dir", default="docs/results/issue62/claims")
    g.add_argument("--claim-sim-only", action="store_true", help="only the simulator's side, against the mock run on "
                   "file in --claim-out-dir (its time scale): after a change to the simulator")


def requests_of(trace: list, vocab: int) -> list:
    """The trace's requests as the gateway takes them: the simulator's token ids folded into the vocabulary (shared
    prefixes stay shared, block for block), greedy, EOS ignored, each tenant's name beside it."""
    return [{"id": t.id, "prompt_token_ids": [3 + x % (vocab - 3) for x in t.tokens()], "max_tokens": t.output_tokens,
             "temperature": 0.0, "ignore_eos": True, "tenant": t.tenant, "adapter": t.adapter} for t in trace]


def adapter_dir(n: int) -> str:
    """A folder of n PEFT adapters named as the simulator's traces name them (adapter0 ...), each only its
    adapter_config.json: the mock engine reads no weights (a read takes the step-time model's lora_read_s)."""
    root = Path(tempfile.mkdtemp(prefix="meshserve-claims-adapters-"))
    for i in range(n):
        (root / f"adapter{i}").mkdir()
        (root / f"adapter{i}" / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": 16, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj",
                                                                                "o_proj", "gate_proj", "up_proj",
                                                                                "down_proj"]}))
    return str(root)


def mesh_spec(claim: sc.Claim, system: str, workers: int, scale: float, profile: str, model_dir: Path,
              config_file: str | None, steps: Path, adapters: str = "") -> MeshSpec:
    spec = claim.spec(system, workers)
    w = spec.worker
    engine = ["--backend", "mock", "--mock-profile", profile, "--mock-time-scale", f"{scale:g}", "--num-blocks",
              str(w.num_blocks), "--block-size", str(w.block_size), "--max-num-seqs", str(w.max_num_seqs),
              "--max-num-batched-tokens", str(w.max_num_batched_tokens), "--slot-policy", w.slot_policy,
              "--max-loras", str(w.max_loras)]
    if w.max_loras:
        engine += ["--max-cpu-loras", str(w.max_cpu_loras), "--lora-dir", adapters]
    per_worker = {}
    if claim.speeds:  # a worker at speed v steps 1/v times slower: its own time scale
        per_worker = {f"unified-{i}": ["--mock-time-scale", f"{scale / claim.speeds[i % len(claim.speeds)]:g}"]
                      for i in range(workers)}
    return MeshSpec(str(model_dir), mode="unified", unified=workers, engine_args=engine, worker_args=per_worker,
                    policy=spec.routing, gateway_args=["--admission-policy", spec.admission],
                    config_file=config_file, env={"MESHSERVE_STEP_LOG": str(steps)})


def served_of(timings: list, trace: list, scale: float) -> list:
    t0 = min(t.arrival_s for t in timings)

    def mock(x):
        return None if x is None else (x - t0) / scale

    return [Served(r, mock(t.arrival_s), mock(t.first_s), mock(t.last_s), t.tokens, t.cached_tokens, t.error)
            for t, r in zip(timings, trace)]


def sim_bound(scale: float) -> dict:
    """The simulator's gateway in a mock run's time: the mesh's 30 s queue bound and its 0.25 s poll of the router's
    view, both of real time."""
    return {"starvation_s": 30.0 / scale, "gateway_poll_s": GATEWAY_POLL_S / scale}


def lora_counters(mesh: Mesh, workers: int) -> dict:
    """The unified workers' LoRA counters, summed, under the simulator's names (adapter reads are lora_reads)."""
    s = worker_lora_stats(mesh, workers)
    return {"lora_reads": s["lora_loads"], "lora_slot_loads": s["lora_slot_loads"], "lora_hits": s["lora_hits"],
            "lora_misses": s["lora_misses"]}


def busy_max_over_mean(folder: Path, since: float, until: float) -> float | None:
    """From the engines' step logs: the busiest worker's stepping time over the mean, for steps in [since, until]."""
    busy = []
    for f in folder.glob("steps-*.jsonl"):
        lines = f.read_text().splitlines()
        if not lines:
            continue  # a core that never stepped (not a worker of the run: one start of a mesh left 63 such files)
        total = 0.0
        for line in lines:
            s = json.loads(line)
            if since <= s["start"] <= until:
                total += s["step_s"]
        busy.append(total)
    mean = sum(busy) / len(busy) if busy else 0.0
    return round(max(busy) / mean, 3) if mean > 0 else None


def summary_of(served: list, trace: list, solo: dict | None) -> dict:
    s = latency_summary(served)
    s["prefill_tokens_computed"] = s["prompt_tokens"] - s["cached_prompt_tokens"]
    ttft: dict = {}
    for r in served:
        if not r.error and r.first_s is not None:
            ttft.setdefault(r.trace.tenant or "default", []).append((r.first_s - r.arrival_s) * 1e3)
    s["tenants"] = {t: round(percentile(v, 0.99), 2) for t, v in sorted(ttft.items())}
    if solo is not None:
        window = trace[-1].arrival_s
        done: dict = {}
        for r in served:
            if not r.error and r.last_s is not None and r.last_s <= window:
                done[r.trace.tenant] = done.get(r.trace.tenant, 0.0) + sc.service(r.trace.prompt_tokens, r.tokens_out)
        s.update(sc.tenant_metrics(trace, done, s["tenants"], solo, window))
    return s


def drive_load(mesh: Mesh, reqs: list, trace: list, scale: float, keys: dict | None) -> tuple:
    """(what was served, the window on the monotonic clock the engines' step logs use)."""
    arrivals = [t.arrival_s * scale for t in trace]
    since = time.monotonic()
    timings = asyncio.run(drive(mesh.gateway, reqs, arrivals, keys=keys))
    return served_of(timings, trace, scale), (since, time.monotonic())


def warm(mesh: Mesh, workers: int, vocab: int, keys: dict | None) -> None:
    """A lone short request per worker's worth, so every engine has stepped before the clock starts."""
    from bench.common import random_requests

    reqs = random_requests(workers, (16, 32), (2, 2), vocab, seed=99)
    tenant = next(iter(keys)) if keys else ""
    for r in reqs:
        r["tenant"] = tenant
    asyncio.run(drive(mesh.gateway, reqs, [i * 0.01 for i in range(len(reqs))], keys=keys))


def one_claim(name: str, model_dir: Path, vocab: int, args) -> tuple[dict, dict]:
    claim = replace(sc.CLAIMS[name], requests_per_worker=args.claim_requests_per_worker)
    workers, cost = args.claim_workers, replace(cost_model(args.claim_profile), cores=0)
    loads = tuple(float(x) for x in args.claim_loads.split(",")) if args.claim_loads else claim.loads
    per_worker = claim.capacity(cost)
    traces = {x: claim.trace(x, workers, per_worker, args.seed) for x in loads}
    tenants = [t.name for t in claim.mix.tenants]
    if args.claim_sim_only:
        on_file = json.loads((Path(args.claim_out_dir) / f"{name}-mock{workers}.json").read_text())
        for x, trace in traces.items():
            ran = next((v.get("requests") for k, v in on_file["by_load"].get(f"{x:g}", {}).items()
                        if not k.startswith("_")), None)
            if ran != len(trace):
                raise SystemExit(f"cluster-claims --claim-sim-only: the mock run on file has {ran} requests at load "
                                 f"{x:g}, these flags make {len(trace)}: give its --claim-loads and "
                                 f"--claim-requests-per-worker")
        return on_file, sim_side(name, claim, workers, cost, traces, on_file["time_scale"], on_file["systems"])
    # The time scale: the simulator's output tokens/s and the arrival rate for the highest load's trace, over what
    # the control plane carries (at 64 workers a short-output mix is bound by requests, not tokens).
    top_trace = traces[max(loads)]
    top = sc.simulate_kept(claim.spec(next(iter(claim.systems)), workers), cost, top_trace)["summary"]
    arrivals_per_s = len(top_trace) / max(top_trace[-1].arrival_s, 1e-9)
    scale = args.claim_time_scale or max(1.0, math.ceil(max(top["output_tokens_per_s"] / args.claim_real_tokens_per_s,
                                                            arrivals_per_s / args.claim_real_requests_per_s)))
    log(f"{name}: {workers} mock workers, capacity {per_worker:.2f} req/s a worker (mock time), loads {loads}, "
        f"{len(traces[loads[0]])} requests a load, time scale {scale:g}")
    keys, config = None, {}
    if tenants:
        keys, path = tenant_config("claims", {t: 1.0 for t in tenants})
        config = yaml.safe_load(Path(path).read_text())
    beat_s = sc.HEARTBEAT_S * scale  # the claim's heartbeat in mock time, in real seconds
    config["routing"] = {"heartbeat_ms": max(1, round(beat_s * 1000)), "worker_ttl_s": max(3.0, 3 * beat_s)}
    folder = Path(tempfile.mkdtemp(prefix="meshserve-claims-"))
    adapters = adapter_dir(claim.mix.adapters) if claim.mix.adapters else ""

    def config_of(system: str) -> str:
        """The mesh file for a system: the routing section above, and the system's LoRA placement."""
        path = folder / f"{system}.yaml"
        routing = {**config["routing"], "lora_placement": claim.spec(system, workers).lora_placement,
                   "lora_placement_period_s": scale}  # placement's 1 s clock, in mock time as the simulator's
        path.write_text(yaml.safe_dump({**config, "routing": routing}))
        return str(path)
    bound = sim_bound(scale)
    mock: dict = {f"{x:g}": {} for x in loads}
    sim: dict = {f"{x:g}": {} for x in loads}
    solo: dict = {}
    fresh_per_load = name.startswith("prefix") or bool(adapters)  # caches and residency start cold at each load
    systems = list(claim.systems)
    if tenants:  # fair-deadline first: its mesh measures the light tenants' solo figures the others are held to
        systems.sort(key=lambda s: s != "fair-deadline")
    for system in systems:
        for group in ([[x] for x in loads] if fresh_per_load else [list(loads)]):
            steps = Path(tempfile.mkdtemp(prefix="meshserve-claims-steps-"))
            spec = mesh_spec(claim, system, workers, scale, args.claim_profile, model_dir, config_of(system), steps,
                             adapters)
            t = time.perf_counter()
            windows: list = []
            with Mesh(spec) as mesh:
                log(f"{name} {system}: {workers} mock workers up in {time.perf_counter() - t:.0f} s")
                warm(mesh, workers, vocab, keys)
                for load in group:
                    trace = traces[load]
                    if tenants and system == "fair-deadline":  # the light tenants alone first: their solo figure
                        lights = [r for r in trace if r.tenant != tenants[0]]
                        served, _ = drive_load(mesh, requests_of(lights, vocab), lights, scale, keys)
                        solo[f"{load:g}"] = summary_of(served, lights, None)["tenants"]
                        ssolo = sc.summarise(name, "_solo", workers, cost, lights, None, **bound)["tenants"]
                        sim[f"{load:g}"]["_solo"] = {"tenants": ssolo}
                        mock[f"{load:g}"]["_solo"] = {"tenants": solo[f"{load:g}"]}
                    t = time.perf_counter()
                    before = lora_counters(mesh, workers) if adapters else {}
                    served, window = drive_load(mesh, requests_of(trace, vocab), trace, scale, keys)
                    windows.append((f"{load:g}", window))
                    m = mock[f"{load:g}"][system] = summary_of(served, trace, solo.get(f"{load:g}") if tenants
                                                               else None)
                    if adapters:  # as the simulator's summary names them
                        m.update({k: v - before[k] for k, v in lora_counters(mesh, workers).items()})
                    m["real_seconds"] = round(time.perf_counter() - t, 1)
                    sim[f"{load:g}"][system] = sc.summarise(name, system, workers, cost, trace,
                                                            sim[f"{load:g}"].get("_solo", {}).get("tenants")
                                                            if tenants else None, **bound)
                    log(f"{name} {system} @ {load:g}: mock ttft p50 {m['ttft_ms_p50']} p99 {m['ttft_ms_p99']} ms, "
                        f"{m['output_tokens_per_s']} tok/s, {m['completed']}/{m['requests']} in {m['real_seconds']} s "
                        f"real; sim ttft p50 {sim[f'{load:g}'][system]['ttft_ms_p50']} p99 "
                        f"{sim[f'{load:g}'][system]['ttft_ms_p99']} ms")
            for key, (since, until) in windows:  # the step logs are complete once the engines have stopped
                mock[key][system]["busy_max_over_mean"] = busy_max_over_mean(steps, since, until)
    common = {"claim": name, "title": claim.title, "profile": args.claim_profile, "loads": [f"{x:g}" for x in loads],
              "capacity_per_worker_req_per_s": round(per_worker, 4), "workers": workers, "time_scale": scale,
              "systems": systems, "baseline": claim.baseline, "engine": "MOCKED"}
    return ({**common, "label": f"mock {workers}", "by_load": mock, "targets": sc.targets(name, mock)},
            {**common, "label": f"sim {workers}", "heartbeat_s": sc.HEARTBEAT_S, "by_load": sim,
             "targets": sc.targets(name, sim)})


def sim_side(name: str, claim: sc.Claim, workers: int, cost, traces: dict, scale: float, systems: list) -> dict:
    """The simulator on the mock run's traces, its gateway in that run's mock time (what one_claim computes beside
    the mock mesh)."""
    bound = sim_bound(scale)
    tenants = [t.name for t in claim.mix.tenants]
    sim: dict = {}
    for load, trace in traces.items():
        key = f"{load:g}"
        sim[key], solo = {}, None
        if tenants:
            lights = [r for r in trace if r.tenant != tenants[0]]
            solo = sc.summarise(name, "_solo", workers, cost, lights, None, **bound)["tenants"]
            sim[key]["_solo"] = {"tenants": solo}
        for system in systems:
            sim[key][system] = sc.summarise(name, system, workers, cost, trace, solo, **bound)
            log(f"{name} {system} @ {key}: sim ttft p50 {sim[key][system]['ttft_ms_p50']} p99 "
                f"{sim[key][system]['ttft_ms_p99']} ms")
    return {"claim": name, "title": claim.title, "profile": cost.source.get("preset", ""),
            "loads": [f"{x:g}" for x in traces], "workers": workers, "time_scale": scale, "systems": systems,
            "baseline": claim.baseline, "engine": "SIMULATED", "label": f"sim {workers}", "heartbeat_s": sc.HEARTBEAT_S,
            "by_load": sim, "targets": sc.targets(name, sim)}


def run(args) -> int:
    model_dir = Path(args.model) if args.model else default_model("tiny")
    vocab = parse_config(read_json(model_dir / "config.json"), model_dir / "config.json").vocab_size
    out = Path(args.claim_out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in filter(None, args.claims.split(",")):
        if name not in MOCK_CLAIMS:
            raise SystemExit(f"cluster-claims: {name!r} is not run on the mock mesh; known: {', '.join(MOCK_CLAIMS)}")
        mock, sim = one_claim(name, model_dir, vocab, args)
        for r in (mock, sim):
            r.update(command=args.command_line, machine=machine())
        if not args.claim_sim_only:
            (out / f"{name}-mock{mock['workers']}.json").write_text(json.dumps(mock, indent=1, sort_keys=True) + "\n")
        (out / f"{name}-sim{sim['workers']}.json").write_text(json.dumps(sim, indent=1, sort_keys=True) + "\n")
        results[name] = {"mock": mock["targets"], "sim": sim["targets"]}
        full = out / f"{name}-sim1000.json"
        series = ([json.loads(full.read_text())] if full.exists() else []) + [mock, sim]
        sc.plot(series, str(out / f"{name}.png"))
        log(f"wrote {out / name}-mock{mock['workers']}.json and {name}.png")
    write_result({"workload": "cluster-claims", "command": args.command_line, "machine": machine(),
                  "engine": "MOCKED", "targets": results}, args.out)
    return 0
