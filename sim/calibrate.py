"""`meshserve sim calibrate`: measure a model's step costs on this machine, in a real worker, and write the fit.

One unified worker of a real mesh (bench preset unless --model; one torch thread, the benchmarks' engine flags)
logs every step it runs (MESHSERVE_STEP_LOG) while the calibration load runs through the gateway:
1. solo requests, one at a time (prompts 32-2048 tokens, 16 outputs): single-sequence prefill steps, decode
   steps over contexts from tens to thousands of tokens, and the hop time: each request's TTFT at the client
   minus what its steps took by the fit;
2. bursts of 2, 4, 8, 16 and 32 requests at once with short prompts (16-64 tokens, 32-96 outputs): batch size
   with little context; and bursts of 2, 4 and 8 with long prompts (1,024-2,048 tokens, 32-64 outputs): context
   at small batch sizes. Sizes and context vary apart, so the fit can tell their costs apart.
The step log is fitted (sim/cost.py: least squares over each step's interval to the next), and the fit's
relative error on the steps, the machine and the load are written beside the terms.
3. How workers share this machine's cores: a mesh of one worker per core, every worker busy at once (two
   bursts of 12 requests per worker), its own step log. Its decode steps take f times what the one-worker fit
   predicts; the simulator's processor sharing (a step runs busy workers / cores times slower) then uses
   cores = workers / f: the cores the workers really have once the gateway, router and client take theirs.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path

from bench.common import default_model, log, machine
from bench.latency import percentile
from bench.online import drive
from services.launcher import Mesh, MeshSpec
from sim.cost import CostModel, fit, intervals

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
    bursts += [_requests(rng, n, (1024, 2048), (32, 64), f"long{n}") for n in ((2, 4) if quick else (2, 4, 8))]
    solo_timings = []
    with Mesh(MeshSpec(str(model_dir), mode="unified", engine_args=engine_args,
                       env={"MESHSERVE_STEP_LOG": str(folder)})) as mesh:
        warm = _requests(rng, 4, (32, 64), (4, 4), "warm")
        asyncio.run(drive(mesh.gateway, warm, None))
        log(f"calibration: {len(solo)} solo requests")
        solo_timings = asyncio.run(drive(mesh.gateway, solo, None))
        for b in bursts:
            log(f"calibration: a burst of {len(b)}")
            asyncio.run(drive(mesh.gateway, b, [0.0] * len(b)))
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
                asyncio.run(drive(mesh.gateway, burst, [0.0] * len(burst)))
        ratios = sorted(t / model.step_s(s, 0, c) for s, p, c, _, t in intervals(_steps(shared)) if p == 0 and s > 1)
        if ratios:
            sharing = ratios[len(ratios) // 2]
            model.cores = round(min(cores, cores / sharing), 3) if sharing > 1 else cores
    # The hop: a solo request's TTFT beyond its prompt's steps (chunked by the budget) at the fitted cost.
    budget = int(engine_args[engine_args.index("--max-num-batched-tokens") + 1]) \
        if "--max-num-batched-tokens" in engine_args else 2048
    hops = []
    for r, t in zip(solo, solo_timings):
        if t.first_s is None:
            continue
        n, done, took = len(r["prompt_token_ids"]), 0, 0.0
        while done < n:
            chunk = min(budget, n - done)
            took += model.step_s(1, chunk - 1, done, chunk * done if chunk > 1 else 0)
            done += chunk
        hops.append((t.first_s - t.arrival_s) - took)
    model.hop_s = round(max(percentile(hops, 0.5) or 0.0, 0.0), 6)
    model.kv_bytes_per_token = _kv_bytes_per_token(model_dir)
    model.source = {"cpu_count": cores, "shared_step_ratio": None if sharing is None else round(sharing, 4),
                    "machine": machine(), "model": str(model_dir), "engine_args": engine_args,
                    "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **quality,
                    "hop_ms_samples": len(hops)}
    return model


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
        f"hop {model.hop_s * 1e3:.2f} ms; {model.cores:g} cores for workers; median error {model.source['median_rel_error']:.1%} over "
        f"{model.source['steps']} steps")
    return 0
