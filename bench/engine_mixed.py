"""Workload engine-mixed: our engine vs transformers static batching (and vLLM-CPU on request).

256 requests, prompts uniform 32-512 tokens, outputs uniform 16-256, random token ids (seed 0),
greedy unless --temperature, EOS ignored, bench preset, float32 (--dtype bfloat16: weights, activations
and KV of every system in bfloat16), one process on every core.
With --temperature T > 0 the `meshserve` and `vllm-cpu` rows sample at T, and beside them run
`meshserve-greedy` (the same requests greedy) and `meshserve-top-p` / `vllm-cpu-top-p` (T with
--top-p, default 0.9); requests carry no seed (each system draws its own). Every system gets the
same requests and limits (max sequences, token budget, KV memory, threads) and an excluded
warm-up on other prompts. Metrics per system: output_tokens_per_s, total_tokens_per_s,
kv_waste_fraction (allocated-but-unfilled token slots / allocated, averaged over steps weighted
by step time), outside_forward_fraction (wall time outside the model call, over steps with at
least 32 running sequences).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.common import REPO, default_model, log, machine, print_table, random_requests, write_result

STATIC_BATCH = 16


def add_flags(p) -> None:
    g = p.add_argument_group("engine-mixed")
    g.add_argument("--peer-vllm", metavar="PYTHON", help="python of a vLLM-CPU venv: also run vLLM (never in CI)")
    g.add_argument("--peer-vllm-runner", default=str(REPO.parent / "shared" / "peers" / "vllm_cpu" / "run_jsonl.py"))
    g.add_argument("--num-requests", type=int, help="override the request count")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--kv-cache-gb", type=float, default=2.0)
    g.add_argument("--skip-transformers", action="store_true", help="leave out the static-batching baseline")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    g.add_argument("--top-p", type=float, default=0.9, help="top-p of the *-top-p rows when --temperature > 0")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights, activations and KV cache of every system (default float32)")
    g.add_argument("--with-quantized", action="store_true",
                   help="also run meshserve on the folder's GGUF blocks (engine.quantization gguf; float32 only)")


def run(args) -> int:
    threads = args.threads or os.cpu_count()
    torch.set_num_threads(threads)
    model_dir = Path(args.model) if args.model else default_model("bench")
    n = args.num_requests or (32 if args.quick else 256)
    reqs = random_requests(n, (32, 512), (16, 256), vocab=32000, seed=args.seed)
    warm = random_requests(16, (32, 256), (16, 16), vocab=32000, seed=args.seed + 1000)
    config = {"requests": n, "prompt_tokens": [32, 512], "output_tokens": [16, 256], "seed": args.seed,
              "temperature": args.temperature, "top_p_rows": args.top_p if args.temperature > 0 else None,
              "model": str(model_dir), "dtype": args.dtype, "threads": threads, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_gb": args.kv_cache_gb,
              "static_batch": STATIC_BATCH}
    sampled = with_sampling(reqs, args.temperature, 1.0)
    systems = {"meshserve": run_meshserve(model_dir, sampled, warm, args)}
    if args.with_quantized:
        systems["meshserve-gguf"] = run_meshserve(model_dir, sampled, warm, args, quantization="gguf")
    if args.temperature > 0:
        systems["meshserve-greedy"] = run_meshserve(model_dir, reqs, warm, args)
        systems["meshserve-top-p"] = run_meshserve(model_dir, with_sampling(reqs, args.temperature, args.top_p), warm,
                                                   args)
    if not args.skip_transformers:
        systems["transformers-static"] = run_static(model_dir, reqs, warm, getattr(torch, args.dtype))
    if args.peer_vllm:
        systems["vllm-cpu"] = run_vllm(model_dir, sampled, args)
        if args.temperature > 0:
            systems["vllm-cpu-top-p"] = run_vllm(model_dir, with_sampling(reqs, args.temperature, args.top_p), args)
    result = {"workload": "engine-mixed", "command": args.command_line, "machine": machine(), "config": config,
              "systems": systems, "ratios": ratios(systems)}
    write_result(result, args.out)
    print_table(result)
    return 0


def with_sampling(reqs: list, temperature: float, top_p: float) -> list:
    return [{**r, "temperature": temperature, "top_p": top_p} for r in reqs]


def ratios(systems: dict) -> dict:
    pairs = [("meshserve", other) for other in systems if other != "meshserve"]
    pairs += [("meshserve-gguf", "vllm-cpu")]
    pairs.append(("meshserve-top-p", "vllm-cpu-top-p"))
    out = {}
    for ours, other in pairs:
        if systems.get(ours) and (systems.get(other) or {}).get("output_tokens_per_s"):
            for m in ("output_tokens_per_s", "total_tokens_per_s"):
                out[f"{ours}/{other}:{m}"] = round(systems[ours][m] / systems[other][m], 3)
    return out


def engine_for(model_dir: Path, args, quantization: str = "none"):
    from services.config.engine import CacheConfig, EngineConfig, SchedulerConfig
    from services.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(
        str(model_dir), dtype=args.dtype, quantization=quantization,
        cache=CacheConfig(kv_cache_bytes=int(args.kv_cache_gb * 1024**3)),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)))


def run_meshserve(model_dir: Path, reqs: list, warm: list, args, quantization: str = "none") -> dict:
    from services.common.sampling import SamplingParams

    engine = engine_for(model_dir, args, quantization)
    log("meshserve: warm-up")
    _drain(engine, warm, "w")
    engine.kv.pool.reset_prefix_cache()
    log(f"meshserve: {len(reqs)} requests, temperature {reqs[0]['temperature']}, top_p {reqs[0].get('top_p', 1.0)}")
    for r in reqs:
        engine.add_request(r["id"], r["prompt_token_ids"], SamplingParams(
            max_tokens=r["max_tokens"], temperature=r["temperature"], top_p=r.get("top_p", 1.0), ignore_eos=True))
    steps, done, n_out = [], 0, 0
    t0 = t_prev = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        t = time.perf_counter()
        s = engine.last_step
        steps.append((t - t_prev, s.forward_s, s.num_running, s.kv_slots_allocated, s.kv_slots_filled))
        t_prev = t
        n_out += sum(len(o.new_token_ids) for o in outs)
        done += sum(o.finished for o in outs)
    wall = time.perf_counter() - t0
    n_prompt = sum(len(r["prompt_token_ids"]) for r in reqs)
    busy = [s for s in steps if s[2] >= 32]
    waste = sum(w * (1 - f / a) for w, _, _, a, f in steps if a) / sum(w for w, _, _, a, _ in steps if a)
    log(f"meshserve: {n_out} output tokens in {wall:.2f}s, {len(steps)} steps")
    return {"output_tokens_per_s": round(n_out / wall, 1), "total_tokens_per_s": round((n_out + n_prompt) / wall, 1),
            "kv_waste_fraction": round(waste, 4),
            "outside_forward_fraction": round(1 - sum(f for _, f, *_ in busy) / sum(w for w, *_ in busy), 4)
            if busy else None,
            "wall_s": round(wall, 3), "steps": len(steps), "output_tokens": n_out}


def _drain(engine, reqs: list, tag: str) -> None:
    from services.common.sampling import SamplingParams

    for r in reqs:
        engine.add_request(tag + r["id"], r["prompt_token_ids"], SamplingParams(max_tokens=r["max_tokens"],
                                                                                temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def run_static(model_dir: Path, reqs: list, warm: list, dtype: torch.dtype) -> dict:
    """transformers generate over left-padded batches of 16 in arrival order (request-level batching)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    log("transformers-static: warm-up")
    _static_batch(model, warm[:STATIC_BATCH])
    waste_num = waste_den = 0.0
    n_out = 0
    t0 = time.perf_counter()
    for i in range(0, len(reqs), STATIC_BATCH):
        batch = reqs[i:i + STATIC_BATCH]
        tb = time.perf_counter()
        _static_batch(model, batch)
        dt = time.perf_counter() - tb
        w = _static_waste(batch)
        waste_num += w * dt
        waste_den += dt
        n_out += sum(r["max_tokens"] for r in batch)
        log(f"transformers-static: batch {i // STATIC_BATCH + 1}/{-(-len(reqs) // STATIC_BATCH)} in {dt:.1f}s")
    wall = time.perf_counter() - t0
    n_prompt = sum(len(r["prompt_token_ids"]) for r in reqs)
    return {"output_tokens_per_s": round(n_out / wall, 1), "total_tokens_per_s": round((n_out + n_prompt) / wall, 1),
            "kv_waste_fraction": round(waste_num / waste_den, 4), "outside_forward_fraction": None,
            "wall_s": round(wall, 3), "output_tokens": n_out}


@torch.inference_mode()
def _static_batch(model, batch: list) -> None:
    longest = max(len(r["prompt_token_ids"]) for r in batch)
    ids = torch.zeros((len(batch), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(batch):
        p = r["prompt_token_ids"]
        ids[row, longest - len(p):] = torch.tensor(p)
        mask[row, longest - len(p):] = 1
    new = max(r["max_tokens"] for r in batch)
    model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                   eos_token_id=None, pad_token_id=0)


def _static_waste(batch: list) -> float:
    """Padding + reserved slots of one static batch, averaged over its steps (equal time per step)."""
    longest = max(len(r["prompt_token_ids"]) for r in batch)
    steps = max(r["max_tokens"] for r in batch)
    fractions = []
    for t in range(steps + 1):
        allocated = len(batch) * (longest + t)
        filled = sum(len(r["prompt_token_ids"]) + min(t, r["max_tokens"]) for r in batch)
        fractions.append(1 - filled / allocated)
    return sum(fractions) / len(fractions)


def run_vllm(model_dir: Path, reqs: list, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        inp, out, stats = (Path(tmp) / n for n in ("in.jsonl", "out.jsonl", "stats.json"))
        inp.write_text("".join(json.dumps(r) + "\n" for r in reqs))
        cmd = [args.peer_vllm, args.peer_vllm_runner, "--model", str(model_dir), "--input", str(inp),
               "--output", str(out), "--stats", str(stats), "--dtype", args.dtype, "--max-num-seqs",
               str(args.max_num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(int(args.kv_cache_gb))}
        log("vllm-cpu: " + " ".join(cmd))
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        s = json.loads(stats.read_text())
    return {"output_tokens_per_s": s["output_tokens_per_s"], "total_tokens_per_s": s["total_tokens_per_s"],
            "kv_waste_fraction": None, "outside_forward_fraction": None, "wall_s": s["wall_s"],
            "output_tokens": s["output_tokens"], "version": s.get("vllm_version")}
