"""One request at a time against an OpenAI-compatible server, with text prompts: the method of
../shared/peers/llama_cpp/README.md, so llama.cpp's server (text prompts only, no ignore_eos, one request at a time)
is measured as vLLM's and ours are.

For each of N prompts of about 200 tokens (seeded English words), greedy:
  TTFT = the wall time of a request for 1 token;
  TPOT = (the wall time of a request for 128 tokens - that TTFT) / 127, its prompt differing from the first at its
         first word, so that no server answers it from a prefix cache.
Requests carry ignore_eos; for llama.cpp, which ignores it, --ban-end-tokens bans the end tokens with logit_bias
instead (meshserve refuses logit_bias). Every answer's completion_tokens is checked. Warm-up: two requests first,
not counted.

    python -m bench.peers.single_stream --base-url http://127.0.0.1:PORT --model NAME --label LABEL --out FILE.json
    python -m bench.peers.single_stream --in-process MODEL_DIR [--quantization gguf] --label LABEL --out FILE.json

--in-process runs meshserve's engine in this process instead (LLMEngine, 2 threads), as
bench/peers/llama_cpp_inprocess.py runs llama.cpp's: what each engine does per token without a server.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request

WORDS = ("the of and to in is was for on that with as by at from his her an were which are this be had have not "
         "but they their one all been has more its when who after first two new time year other also some city "
         "river house people world state music school family water light mountain village market story morning "
         "winter garden letter window history science language summer island forest church bridge station").split()
FIRST = ("Alpha", "Bravo")  # two first words: the TTFT and the TPOT request never share a prefix
END_TOKENS = (0, 2)  # SmolLM2's <|endoftext|> and <|im_end|> (--end-tokens for another model: Gemma 3's 1,106)


def prompt(i: int, variant: int, words: int = 150) -> str:
    rng = random.Random(i)
    return FIRST[variant] + " " + " ".join(rng.choice(WORDS) for _ in range(words))


def complete(base_url: str, model: str, text: str, max_tokens: int, ban) -> tuple[float, int]:
    """ban: the end tokens to ban with logit_bias (a server that ignores ignore_eos), or ()."""
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if ban:
        body["logit_bias"] = {str(t): -100 for t in ban}
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        answer = json.loads(r.read())
    return time.perf_counter() - t, int(answer["usage"]["completion_tokens"])


def in_process(model_dir: str, quantization: str):
    """complete() over an LLMEngine in this process."""
    from services.common.sampling import SamplingParams
    from services.config.engine import EngineConfig
    from services.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model_dir, quantization=quantization, num_threads=2))
    seq = iter(range(1 << 30))

    def complete_here(base_url, model, text, max_tokens, ban):
        t = time.perf_counter()
        req = engine.add_request(f"r{next(seq)}", prompt=text,
                                 params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t, len(req.output_token_ids)
    return complete_here


def run(base_url: str, model: str, n: int, out_tokens: int, ban: bool, complete=complete) -> dict:
    for i in range(2):
        complete(base_url, model, prompt(1000 + i, 0), 8, ban)
    ttft, tpot = [], []
    for i in range(n):
        t1, k1 = complete(base_url, model, prompt(i, 0), 1, ban)
        tn, kn = complete(base_url, model, prompt(i, 1), out_tokens, ban)
        if (k1, kn) != (1, out_tokens):
            raise SystemExit(f"prompt {i}: {k1} and {kn} tokens came back, not 1 and {out_tokens}")
        ttft.append(t1 * 1e3)
        tpot.append((tn - t1) / (out_tokens - 1) * 1e3)
        print(f"  prompt {i}: TTFT {ttft[-1]:.1f} ms, TPOT {tpot[-1]:.2f} ms", flush=True)
    return {"prompts": n, "output_tokens": out_tokens, "ttft_ms": ttft, "tpot_ms": tpot,
            "ttft_p50_ms": statistics.median(ttft), "tpot_p50_ms": statistics.median(tpot)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url")
    ap.add_argument("--model", help="the name the server serves")
    ap.add_argument("--in-process", metavar="MODEL_DIR", help="meshserve's engine in this process, no server")
    ap.add_argument("--quantization", default="none", help="with --in-process: none, gguf or auto")
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--ban-end-tokens", action="store_true", help="logit_bias -100 on the end tokens (llama.cpp)")
    ap.add_argument("--end-tokens", default=",".join(map(str, END_TOKENS)),
                    help="the model's end tokens, for --ban-end-tokens (default: SmolLM2's)")
    args = ap.parse_args()
    if not (args.in_process or (args.base_url and args.model)):
        ap.error("give --base-url and --model, or --in-process MODEL_DIR")
    how = in_process(args.in_process, args.quantization) if args.in_process else complete
    ban = tuple(int(t) for t in args.end_tokens.split(",")) if args.ban_end_tokens else ()
    result = {"label": args.label, **run(args.base_url, args.model, args.prompts, args.output_tokens, ban, how)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{args.label}: TTFT p50 {result['ttft_p50_ms']:.1f} ms, TPOT p50 {result['tpot_p50_ms']:.2f} ms")


if __name__ == "__main__":
    main()
