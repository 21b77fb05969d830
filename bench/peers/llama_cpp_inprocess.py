"""llama.cpp through its Python API, in process, on bench/peers/single_stream.py's prompts and method: what
llama.cpp itself does per token, without its HTTP server's overhead. Run with llama-cpp-python's interpreter.

    LLAMA_VENV/bin/python bench/peers/llama_cpp_inprocess.py GGUF_FILE OUT.json [--prompts 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.peers.single_stream import END_TOKENS, prompt  # noqa: E402


def main() -> None:
    from llama_cpp import Llama

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = Llama(args.gguf, n_threads=args.threads, n_ctx=2048, verbose=False)
    bias = {t: -100.0 for t in END_TOKENS}
    for i in range(2):
        model(prompt(1000 + i, 0), max_tokens=8, temperature=0.0)
    ttft, tpot = [], []
    for i in range(args.prompts):
        t = time.perf_counter()
        model(prompt(i, 0), max_tokens=1, temperature=0.0)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        out = model(prompt(i, 1), max_tokens=args.output_tokens, temperature=0.0, logit_bias=bias)
        tn = time.perf_counter() - t
        if out["usage"]["completion_tokens"] != args.output_tokens:
            raise SystemExit(f"prompt {i}: {out['usage']['completion_tokens']} tokens, not {args.output_tokens}")
        ttft.append(t1 * 1e3)
        tpot.append((tn - t1) / (args.output_tokens - 1) * 1e3)
    result = {"label": "llama.cpp-in-process", "prompts": args.prompts, "output_tokens": args.output_tokens,
              "ttft_ms": ttft, "tpot_ms": tpot, "ttft_p50_ms": statistics.median(ttft),
              "tpot_p50_ms": statistics.median(tpot)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"llama.cpp in process: TTFT p50 {result['ttft_p50_ms']:.1f} ms, TPOT p50 {result['tpot_p50_ms']:.2f} ms")


if __name__ == "__main__":
    main()
