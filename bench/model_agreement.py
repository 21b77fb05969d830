"""A real model's greedy output against transformers on the same GGUF file: `python -m bench.model_agreement
--gguf FILE --model FOLDER [--prompts 32] [--tokens 32] [--quantization none,gguf] [--out F.json]`.

transformers reads the GGUF itself (`from_pretrained(dir, gguf_file=...)`, dequantized to float32, eager attention)
and generates greedily, one prompt at a time, EOS ignored, keeping each step's top-2 logit gap; our engine
(services.engine.engine.LLMEngine over FOLDER, `meshserve model import-gguf`'s folder of the same file) runs every
prompt in one batch. Prompts are the texts below, tokenized by transformers' tokenizer of the file (our tokenizer
must give the same ids: counted). Every difference is reported with the reference's top-2 gap at that step: a
difference at a near-tie (gap under TIE_GAP) is rounding; anything else is a bug. Takes minutes (transformers loads
a 262k-vocabulary GGUF in about 1.5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import log, machine, write_result

TIE_GAP = 1e-3  # float32 logits of a 262k vocabulary summed in another order move by ~1e-5; a gap this small is a tie
PROMPTS = [
    "The quick brown fox", "Once upon a time, in a small village,", "def fibonacci(n):\n    ",
    "The three laws of thermodynamics are", "import numpy as np\n\nx = np.", "Paris is the capital of",
    "In 1969, astronauts", "Dear hiring manager,\n\n", "The recipe calls for two cups of",
    "SELECT name FROM users WHERE",
    "Machine learning is", "Le chat est", "1, 1, 2, 3, 5, 8,", "<html>\n  <body>\n", "The mitochondria is",
    "  indented text with   irregular   spaces", "What is the capital of France?", "Name three primary colors.",
    "How many legs does a spider have?", "Write a haiku about autumn.", "What is 12 times 7?",
    "Translate 'good morning' into Spanish.", "Explain photosynthesis in one sentence.", "Who wrote Romeo and Juliet?",
    "Give me a Python function that reverses a string.", "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet turtle.", "Why is the sky blue?", "List two uses of a paperclip.",
    "What does CPU stand for?", "Summarize the plot of Cinderella in two sentences.",
    "Is a tomato a fruit or a vegetable?",
]


def reference(gguf: Path, prompts: list, tokens: int) -> tuple[list, list]:
    """transformers' ids of each prompt and its greedy continuation with the top-2 gap at each step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids, refs = [tok(p)["input_ids"] for p in prompts], []
    for i, p in enumerate(ids):
        out = model.generate(torch.tensor([p]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        tops = [s[0].float().topk(2).values for s in out.scores]
        refs.append((out.sequences[0, len(p):].tolist(), [float(t[0] - t[1]) for t in tops]))
        log(f"reference {i + 1}/{len(ids)}")
    return ids, refs


def ours(folder: Path, ids: list, tokens: int, quantization: str) -> list:
    from services.common.sampling import SamplingParams
    from services.config.engine import CacheConfig, EngineConfig
    from services.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(str(folder), quantization=quantization, cache=CacheConfig(num_blocks=512)))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(f"p{i}", p, params) for i, p in enumerate(ids)]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True, help="the folder import-gguf made of the same file")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--quantization", default="none,gguf",
                    help="the engine's weights, each compared in turn: none (the float32 import), gguf (the file's "
                         "blocks kept where the engine runs them)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    from tokenizers import Tokenizer

    prompts = PROMPTS[:a.prompts]
    t0 = time.perf_counter()
    ids, refs = reference(a.gguf.resolve(), prompts, a.tokens)
    t_ref = time.perf_counter() - t0
    mine = Tokenizer.from_file(str(a.model / "tokenizer.json"))
    same_ids = sum(mine.encode(p).ids == i for p, i in zip(prompts, ids))
    result = {"machine": machine(), "gguf": str(a.gguf), "prompts": len(prompts), "tokens": a.tokens,
              "tokenizer_same_ids": same_ids, "reference_s": round(t_ref, 1)}
    for quantization in a.quantization.split(","):
        t0 = time.perf_counter()
        got = ours(a.model, ids, a.tokens, quantization)
        t_ours = time.perf_counter() - t0
        diffs = []
        for n, (g, (want, gaps)) in enumerate(zip(got, refs)):
            at = next((i for i, (x, y) in enumerate(zip(g, want)) if x != y), None)
            if at is not None:
                diffs.append({"prompt": n, "step": at, "gap": gaps[at], "near_tie": gaps[at] < TIE_GAP})
        result[quantization] = {
            "identical": len(prompts) - len(diffs), "differences": diffs,
            "differences_not_at_near_tie": sum(not d["near_tie"] for d in diffs),
            "tokens_before_first_difference": sum(d["step"] for d in diffs) + a.tokens * (len(prompts) - len(diffs)),
            "ours_s": round(t_ours, 1)}
    write_result(result, a.out)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
