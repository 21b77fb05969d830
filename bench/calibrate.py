"""`meshserve sim calibrate`: measure a model's step costs on this machine, in a real worker, and write the fit.

One unified worker of a real mesh (bench preset unless --model; one torch thread, the benchmarks' engine flags)
logs every step it runs (MESHSERVE_STEP_LOG) while the calibration load runs through the gateway:
1. solo requests, one at a time (prompts 32-2048 tokens, 16 outputs): single-sequence prefill steps, decode
   steps over contexts from tens to thousands of tokens, and the hop time: each request's TTFT at the client
   minus what the logged steps that computed its prompt took;
2. bursts of 2, 4, 8, 16 and 32 requests at once with short prompts (16-64 tokens, 32-96 outputs): batch size
   with little context; bursts of 4, 8, 16 and 32 with mid prompts (256-1,024 tokens, 32-96 outputs): both at
   once; and bursts of 2, 4 and 8 with long prompts (1,024-2,048 tokens, 32-64 outputs): context at small batch
   sizes; then prompts behind a cached prefix (one shared 1,024-2,048-token prefix, 32-128 tokens of their
   own), one at a time and all at once: short prompt chunks over long context. Sizes and context vary apart
   and together, so the fit can tell their costs apart over the range serving sees.
The step log is fitted (sim/cost.py: least squares over each step's interval to the next), and the fit's
relative error on the steps, the machine and the load are written beside the terms.
3. How workers share this machine's cores: a mesh of one worker per core, every worker busy at once (two
   bursts of 12 requests per worker), its own step log. Its decode steps take f times what the one-worker fit
   predicts; the simulator's processor sharing (a step runs (busy workers + the rest of the mesh's load) / cores
   times slower) then uses cores = (workers + that load over these bursts) / f, at most the machine's.
4. The rest of the mesh's CPU (gateway, router, servicers, Redis and this load's client: every process of the
   mesh but the engine cores, read from /proc, and this process's own): per second, per request and per token
   streamed, fitted over the phases above (the simulator adds it to the sharing where workers share cores).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import tempfile
import time
from pathlib import Path

from bench.common import default_model, log, machine
from bench.latency import percentile
from bench.online import drive
from services.mesh.launcher import Mesh, MeshSpec
from sim.cost import CostModel, fit, intervals, nonneg_lstsq

ENGINE_ARGS = ["--max-num-batched-tokens", "512", "--kv-cache-gb", "1.0"]
BURSTS = (2, 4, 8, 16, 32)


def _requests(rng: random.Random, n: int, prompt: tuple, output: tuple, tag: str) -> list[dict]:
    return [{"id": f"cal-{tag}-{i}", "prompt_token_ids": [rng.randrange(3, 32000) for _ in range(rng.randint(*prompt))],
             "max_tokens": rng.randint(*output), "temperature": 0.0, "ignore_eos": True} for i in range(n)]


def calibrate(model_dir: Path, quick: bool = False, seed: int = 0, engine_args: list | None = None) -> CostModel:
    rng = random.Random(seed + 7919)  # not any workload's seed: calibration never sees the validation prompts
    engine_args = engine_args or ENGINE_ARGS
    folder = Path(tempfile.mkdtemp(prefix="meshserve-steps-"))
    solo = _requests(rng, 8 if quick else 24, (32, 2048), (16, 16), "solo")
    bursts = [_requests(rng, n, (16, 64), (32, 96), f"short{n}") for n in (BURSTS[:3] if quick else BURSTS)]
    bursts += [_requests(rng, n, (256, 1024), (32, 96), f"mid{n}") for n in ((4, 8) if quick else (4, 8, 16, 32))]
    bursts += [_requests(rng, n, (1024, 2048), (32, 64), f"long{n}") for n in ((2, 4) if quick else (2, 4, 8))]
    # Prompts behind a cached prefix: one shared 1,024-2,048-token prefix, 32-128 tokens of their own; one at a
    # time, then all at once: short prompt chunks over long context, as prefix caching makes them.
    prefix = _requests(rng, 1, (1024, 2048), (1, 1), "prefix")[0]["prompt_token_ids"]
    cached = [_requests(rng, 4 if quick else 12, (32, 128), (16, 48), f"cached{i}") for i in range(2)]
    for r in cached[0] + cached[1]:
        r["prompt_token_ids"] = prefix + r["prompt_token_ids"]
    solo_timings, phases = [], []
    with Mesh(MeshSpec(str(model_dir), mode="unified", engine_args=engine_args,
                       env={"MESHSERVE_STEP_LOG": str(folder)})) as mesh:
        warm = _requests(rng, 4, (32, 64), (4, 4), "warm")
        asyncio.run(drive(mesh.gateway, warm, None))
        log(f"calibration: {len(solo)} solo requests")
        solo_timings = _phase(mesh, folder, solo, None, phases)
        for b in bursts:
            log(f"calibration: a burst of {len(b)}")
            _phase(mesh, folder, b, [0.0] * len(b), phases)
        log(f"calibration: {len(cached[0])} prompts behind a cached prefix one at a time, "
            f"then {len(cached[1])} at once")
        _phase(mesh, folder, cached[0], None, phases)
        _phase(mesh, folder, cached[1], [0.0] * len(cached[1]), phases)
    rows = intervals(_steps(folder))
    terms, quality = fit(rows)
    model = CostModel(**terms)
    cores = os.cpu_count() or 1
    model.cores, sharing = cores, None
    if cores > 1:
        shared = Path(tempfile.mkdtemp(prefix="meshserve-steps-shared-"))
        with Mesh(MeshSpec(str(model_dir), mode="unified", unified=cores, engine_args=engine_args,
                           env={"MESHSERVE_STEP_LOG": str(shared)})) as mesh:
            asyncio.run(drive(mesh.gateway, _requests(rng, 2 * cores, (32, 64), (4, 4), "warm2"), None))
            for i in range(2):
                log(f"calibration: {cores} workers busy at once ({i + 1}/2)")
                burst = _requests(rng, 12 * cores, (32, 512), (64, 128), f"shared{i}")
                _phase(mesh, shared, burst, [0.0] * len(burst), phases)
        ratios = sorted(t / model.step_s(s, 0, c) for s, p, c, _, t in intervals(_steps(shared)) if p == 0 and s > 1)
        if ratios:
            sharing = ratios[len(ratios) // 2]
        host = _host_fit(phases)
        if host:
            model.host_cpu_s_per_s, model.host_cpu_s_per_request, model.host_cpu_s_per_token = host
        # Busy workers and the rest of the mesh (its CPU over those bursts) on `cores` cores ran `sharing` times
        # slower than one worker alone: the cores they really had.
        load = cores + (sum(p["cpu_s"] for p in phases[-2:]) / sum(p["seconds"] for p in phases[-2:])
                        if host and len(phases) >= 2 else 0.0)
        if sharing:
            model.cores = round(min(cores, load / sharing), 3)
    # The hop: a solo request's TTFT beyond the steps that computed its prompt, as the worker logged them (its clock
    # is this process's: both monotonic), or as the fit prices its chunks where the log shows none.
    budget = int(engine_args[engine_args.index("--max-num-batched-tokens") + 1]) \
        if "--max-num-batched-tokens" in engine_args else 2048
    logged = sorted(_steps(folder), key=lambda s: s["start"])
    spans = [(s["start"], s["start"] + s["step_s"], row[4]) for s, row in zip(logged, intervals(logged))]
    hops = []
    for r, t in zip(solo, solo_timings):
        if t.first_s is None:
            continue
        took = sum(cost for start, end, cost in spans if start >= t.arrival_s and end <= t.first_s)
        n, done = len(r["prompt_token_ids"]), 0
        while not took and done < n:
            chunk = min(budget, n - done)
            took += model.step_s(1, chunk - 1, done, chunk * done if chunk > 1 else 0)
            done += chunk
        hops.append((t.first_s - t.arrival_s) - took)
    model.hop_s = round(max(percentile(hops, 0.5) or 0.0, 0.0), 6)
    model.kv_bytes_per_token = _kv_bytes_per_token(model_dir)
    model.source = {"cpu_count": cores, "shared_step_ratio": None if sharing is None else round(sharing, 4),
                    "machine": machine(), "model": str(model_dir), "engine_args": engine_args,
                    "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **quality,
                    "hop_ms_samples": len(hops), "hop_ms_quartiles": [round(x * 1e3, 3) for x in (
                        percentile(hops, 0.25) or 0.0, percentile(hops, 0.5) or 0.0, percentile(hops, 0.75) or 0.0)],
                    "host_phases": phases}
    return model


def _phase(mesh: Mesh, folder: Path, reqs: list, arrivals: list | None, phases: list) -> list:
    """Drive one phase of the calibration load, noting the rest of the mesh's CPU over it (measured_drive)."""
    timings, phase = measured_drive(mesh, folder, reqs, arrivals)
    if phase is not None:
        phases.append(phase)
    return timings


def measured_drive(mesh: Mesh, folder: Path, reqs: list, arrivals: list | None, keys: dict | None = None):
    """Drive requests through the mesh's gateway (bench.online.drive): (their timings, and {seconds, requests,
    streamed tokens, cpu_s: the rest of the mesh's CPU meanwhile} or None where /proc cannot tell). `folder`: the
    workers' step logs, named by their engine cores' pids (which are not the rest of the mesh)."""
    engines = {int(f.stem.split("-")[1]) for f in folder.glob("steps-*.jsonl")}
    cpu, t = host_cpu_s(mesh, engines), time.perf_counter()
    timings = asyncio.run(drive(mesh.gateway, reqs, arrivals, keys=keys))
    took, after = time.perf_counter() - t, host_cpu_s(mesh, engines)
    if cpu is None or after is None:
        return timings, None
    return timings, {"seconds": round(took, 4), "requests": len(reqs), "tokens": sum(x.tokens for x in timings),
                     "cpu_s": round(after - cpu, 4)}


def host_cpu_s(mesh: Mesh, engines: set) -> float | None:
    """CPU seconds so far of every process of the mesh but its engine cores (the pids in `engines`), and of this
    process (the load's client); None where /proc cannot tell (not Linux)."""
    sessions = {p.popen.pid for p in mesh.procs}  # each service runs in a session of its own
    ticks, total = os.sysconf("SC_CLK_TCK"), 0
    try:
        entries = [d for d in Path("/proc").iterdir() if d.name.isdigit() and int(d.name) not in engines]
    except OSError:
        return None
    for d in entries:
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[3]) in sessions:  # after the name: state ppid pgrp session ... utime(11) stime(12)
            total += int(fields[11]) + int(fields[12])
    own = resource.getrusage(resource.RUSAGE_SELF)
    return total / ticks + own.ru_utime + own.ru_stime


def _host_fit(phases: list) -> tuple | None:
    """(per second, per request, per token) of the mesh's own CPU, by least squares over the phases, none negative."""
    import numpy as np

    if len(phases) < 3:
        return None
    a = np.array([[p["seconds"], p["requests"], p["tokens"]] for p in phases], dtype=float)
    terms = nonneg_lstsq(a, np.array([p["cpu_s"] for p in phases]), ("s", "request", "token"))
    return round(terms["s"], 6), round(terms["request"], 8), round(terms["token"], 8)


def _steps(folder: Path) -> list[dict]:
    steps = []
    for f in sorted(folder.glob("steps-*.jsonl")):
        steps += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    if not steps:
        raise RuntimeError(f"the worker logged no steps in {folder}")
    return steps


def _kv_bytes_per_token(model_dir: Path) -> int:
    from services.engine.loader import parse_config, read_json

    cfg = parse_config(read_json(Path(model_dir) / "config.json"), Path(model_dir) / "config.json")
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32 K and V, every layer


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure a model's step costs here, in a real worker, and write the fit")
    p.add_argument("--model", help="model folder (default: the bench preset)")
    p.add_argument("--out", default="sim-cost.json", help="where to write the cost model (JSON)")
    p.add_argument("--quick", action="store_true", help="fewer requests (a smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(sim_func=main)


def main(args) -> int:
    model_dir = Path(args.model) if args.model else default_model("bench")
    model = calibrate(model_dir, args.quick, args.seed)
    model.save(args.out)
    log(f"wrote {args.out}: step = {model.base_s * 1e3:.3f} ms + {model.per_seq_s * 1e3:.3f} ms/seq + "
        f"{model.per_context_s * 1e6:.3f} us/context token + {model.prefill_s_per_token * 1e6:.1f} us/prompt token; "
        f"hop {model.hop_s * 1e3:.2f} ms; {model.cores:g} cores for workers; "
        f"median error {model.source['median_rel_error']:.1%} over {model.source['steps']} steps")
    return 0
