import os, sys, time, json, random
tp = int(sys.argv[2]); dtype = sys.argv[3]
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "2"
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0-1" if tp == 1 else "0|1"
from vllm import LLM, SamplingParams, TokensPrompt
def reqs(n, pr, orr, vocab, seed):
    rng = random.Random(seed); out = []
    for i in range(n):
        p = rng.randint(*pr); out.append(([rng.randrange(3, vocab) for _ in range(p)], rng.randint(*orr)))
    return out
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], tensor_parallel_size=tp, dtype=dtype, max_model_len=2048, max_num_seqs=256,
              max_num_batched_tokens=2048, enable_prefix_caching=False,
              distributed_executor_backend="mp" if tp > 1 else None)
    vocab = 32000
    def run(rs):
        ps = [TokensPrompt(prompt_token_ids=p) for p, _ in rs]
        sp = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in rs]
        t = time.perf_counter(); outs = llm.generate(ps, sp, use_tqdm=False); w = time.perf_counter() - t
        return w, sum(len(o.outputs[0].token_ids) for o in outs)
    run(reqs(16, (32, 256), (16, 16), vocab, 1000))
    res = {"tp": tp, "dtype": dtype, "tpot_ms": [], "mixed": []}
    for rep in range(3):
        w, n = run(reqs(1, (128, 128), (128, 128), vocab, 7)); res["tpot_ms"].append(round(w / n * 1e3, 2))
        w, n = run(reqs(128, (32, 512), (16, 256), vocab, 0)); res["mixed"].append(round(n / w, 1))
    print("RESULT", json.dumps(res), flush=True)
