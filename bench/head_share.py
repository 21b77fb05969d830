"""The LM head's and the sampler's share of a decode step, and a worker's resident memory, per model and weights'
form: `python -m bench.head_share MODEL_DIR [MODEL_DIR ...] [--out F.jsonl]` (issue 64: Gemma 3's 262k vocabulary
against SmolLM2's 49k).

One sequence (a 250-token prompt, 64 greedy tokens, three times) on the in-process engine with 2 threads, for
`quantization` gguf and none; each decode step is timed, and within it the LM head's linear (the model's
`_linear` on its lm_head, wrapped) and the sampler's call. Medians. RSS: /proc/self/status after the engine loaded
(a 64-block KV pool, the tokenizer and grammar set-up included), each row in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

from bench.common import machine


def rss_mb() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) // 1024


def measure(model_dir: str, quantization: str) -> dict:
    import services.engine.models.gemma3 as gemma3
    import services.engine.models.llama as llama
    from services.common.sampling import SamplingParams
    from services.config.engine import CacheConfig, EngineConfig
    from services.engine.engine import LLMEngine

    before = rss_mb()
    e = LLMEngine(EngineConfig(model_dir, quantization=quantization, num_threads=2, cache=CacheConfig(num_blocks=64)))
    loaded = rss_mb()
    head, sampled, steps = [], [], []
    real_linear, real_sampler = llama._linear, e.sampler

    def timed_linear(x, w, b):
        t = time.perf_counter()
        y = real_linear(x, w, b)
        if w is e.model.lm_head:
            head.append(time.perf_counter() - t)
        return y

    def timed_sampler(*a, **k):
        t = time.perf_counter()
        out = real_sampler(*a, **k)
        sampled.append(time.perf_counter() - t)
        return out

    llama._linear = gemma3._linear = timed_linear
    e.sampler = timed_sampler
    try:
        for rep in range(3):
            e.add_request(f"r{rep}", list(range(10, 260)), SamplingParams(max_tokens=64, temperature=0.0,
                                                                          ignore_eos=True))
            e.step()  # the prompt
            head.clear() if rep == 0 else None
            sampled.clear() if rep == 0 else None
            while e.has_unfinished():
                t = time.perf_counter()
                e.step()
                steps.append(time.perf_counter() - t)
    finally:
        llama._linear = gemma3._linear = real_linear

    def med(v):
        return round(statistics.median(v) * 1e3, 3)
    return {"model": model_dir, "quantization": quantization, "vocab": e.model_config.vocab_size,
            "weights": e.describe_weights(), "rss_mb": loaded, "rss_before_mb": before, "step_ms": med(steps),
            "head_ms": med(head), "sampler_ms": med(sampled),
            "head_share": round(statistics.median(head) / statistics.median(steps), 3),
            "sampler_share": round(statistics.median(sampled) / statistics.median(steps), 3)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # a fresh process each, so that one's freed memory is not another's resident set
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1) as pool:
        rows = [pool.submit(measure, m, q).result() for m in a.models for q in ("gguf", "none")]
    lines = [json.dumps({**r, "machine": machine()["cpu_model"]}) for r in rows]
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
