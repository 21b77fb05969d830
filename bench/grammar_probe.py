"""llguidance against xgrammar on one model's vocabulary: what choosing the grammar engine rested on.

    python -m bench.grammar_probe --model ~/.cache/meshserve/models/smollm2-135m-instruct

Run it in an environment with both engines (xgrammar pulls torch, transformers and triton, so not the project's:
`pip install xgrammar==0.2.9 transformers llguidance==1.9.1` in a scratch venv). For bench.structured's
schema (an array of objects with a string, an integer and an enum array; without its minItems): compile time,
and the time to fill one token mask while following a valid instance token by token, for 1 and for 64 matchers
at once (each engine's own batch fill, on every core). Each figure is the better of two passes. A probe, not a
benchmark of record.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from bench.structured import SCHEMA as RUN_SCHEMA

SCHEMA = {k: v for k, v in RUN_SCHEMA.items() if k != "minItems"}  # bench.structured's, able to close
INSTANCE = [{"name": f"item number {i}", "score": (i * 37) % 101, "tags": ["a", "c"][: i % 3]} for i in range(12)]


def tokens_of(tokenizer_json: Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_json)).encode(json.dumps(INSTANCE), add_special_tokens=False).ids


def llguidance_probe(model_dir: Path, ids: list[int], vocab: int, eos: int, batch: int) -> tuple[float, float]:
    import llguidance as llg
    from llguidance.numpy import fill_next_token_bitmask_par

    tok = llg.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=eos)
    grammar = llg.LLMatcher.grammar_from_json_schema(SCHEMA)
    t0 = time.perf_counter()
    first = llg.LLMatcher(tok, grammar, log_level=0)
    compile_s = time.perf_counter() - t0
    matchers = [first.deep_copy() for _ in range(batch)]
    executor = llg.LLExecutor(num_threads=os.cpu_count())
    mask = np.zeros((batch, (vocab + 31) // 32), dtype=np.int32)
    spent = 0.0
    for t in ids:
        t0 = time.perf_counter()
        if batch == 1:
            matchers[0].unsafe_compute_mask_ptr(mask[0].ctypes.data, mask.shape[1] * 4)
        else:
            fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
        spent += time.perf_counter() - t0
        assert (mask[0, t >> 5] >> (t & 31)) & 1, "the instance left the grammar"
        for m in matchers:
            m.consume_token(t)
    return compile_s, spent / len(ids)


def xgrammar_probe(model_dir: Path, ids: list[int], vocab: int, batch: int) -> tuple[float, float]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    mask = xgr.allocate_token_bitmask(batch, vocab)
    batcher = xgr.BatchGrammarMatcher(max_threads=os.cpu_count()) if batch > 1 else None
    spent = 0.0
    for t in ids:
        t0 = time.perf_counter()
        if batcher is None:
            matchers[0].fill_next_token_bitmask(mask, 0)
        else:
            batcher.batch_fill_next_token_bitmask(matchers, mask)
        spent += time.perf_counter() - t0
        assert (int(mask[0, t >> 5]) >> (t & 31)) & 1, "the instance left the grammar"
        for m in matchers:
            m.accept_token(t)
    return compile_s, spent / len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    model_dir = Path(args.model).expanduser()
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab, eos = cfg["vocab_size"], cfg.get("eos_token_id", 0)
    eos = eos[0] if isinstance(eos, list) else eos
    ids = tokens_of(model_dir / "tokenizer.json")
    print(f"{model_dir.name}: vocabulary {vocab}, an instance of {len(ids)} tokens, {os.cpu_count()} cores")
    for name, probe in (("llguidance", lambda b: llguidance_probe(model_dir, ids, vocab, eos, b)),
                        ("xgrammar", lambda b: xgrammar_probe(model_dir, ids, vocab, b))):
        try:
            for batch in (1, 64):
                runs = [probe(batch) for _ in range(2)]
                compile_s, per_step = min(r[0] for r in runs), min(r[1] for r in runs)
                print(f"{name:10s} batch {batch:2d}: compile {compile_s * 1e3:7.2f} ms, mask per step "
                      f"{per_step * 1e3:7.3f} ms ({per_step * 1e6 / batch:6.1f} us per row)")
        except ImportError as e:
            print(f"{name:10s} not installed here ({e})")


if __name__ == "__main__":
    main()
