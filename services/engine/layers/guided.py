"""Structured outputs: each constrained request's grammar, as a token mask at every step it samples (llguidance).

A constraint (services.common.sampling.Guided: a JSON Schema, any JSON object, a regex, a choice of strings, a
Lark or GBNF grammar) is compiled once into an llguidance matcher and cached by (kind, spec); each request gets a
copy of the compiled matcher (microseconds). Each step, masks() brings every constrained row's matcher up to its
request's outputs and fills one bitmask row per constrained row (bit v set: token v may be sampled), in parallel
over the batch; the sampler kernel applies it in its one pass, so constrained and free rows share a step. After
sampling, accept() feeds the token to the matcher: the request ends ("stop") when the grammar is complete.

Why llguidance rather than xgrammar: both compute masks in native code, but xgrammar's wheel depends on torch,
transformers and triton (a second, GPU-only stack beside ours), llguidance's on nothing; measured on SmolLM2's
vocabulary (docs/BENCHMARKS.md, structured outputs), a JSON Schema compiles in about a millisecond and a mask of
64 rows is filled in one or two.

The matcher follows a request's outputs, not its steps: outputs an earlier attempt streamed (a resumed request's
prompt tail) and the first token a prefill worker sampled are fed to it before its first mask here. A matcher
that rejects a token (a resumed output the grammar does not allow) ends its request with "abort".
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from services.common.errors import InvalidRequest
from services.common.sampling import Guided
from services.engine.request import Request

log = logging.getLogger("meshserve.engine.guided")

# Whitespace a JSON constraint allows between its tokens: none, one space, or a line break and an indent (compact,
# spaced and pretty-printed JSON all pass), but no runs: a model (a random one readily) could otherwise spend its
# max_tokens on whitespace inside an object that never closes.
JSON_WHITESPACE = r"(?:\n[\x20\x09]{0,20}|\x20?)"
CACHE_SIZE = 256  # compiled constraints kept


def grammar_of(guided: Guided) -> str:
    """The constraint as an llguidance grammar (not yet checked: the matcher reports errors)."""
    import llguidance as llg

    kind, spec = guided.kind, guided.spec
    if kind in ("json", "json_object"):
        schema = json.loads(spec) if kind == "json" else {"type": "object"}
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_pattern": JSON_WHITESPACE})
        except ValueError as e:
            raise InvalidRequest(f"the JSON Schema is not usable: {e}") from None
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                     for c in json.loads(spec)))
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return llg.LLMatcher.grammar_from_lark(any_to_lark(spec))  # Lark as it is; GBNF (::=) translated
    except Exception as e:  # the translator's own error type, or a parse error in it
        raise InvalidRequest(f"the grammar does not parse: {e}") from None


class Grammars:
    """Compiled constraints (an LRU cache) and the per-step work on the requests that carry one."""

    def __init__(self, tokenizer_path: str | Path | None, vocab_size: int, eos_token_ids: tuple, threads: int = 1):
        self.tokenizer_path, self.vocab_size = tokenizer_path, vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.threads = max(1, threads)
        self.words = (vocab_size + 31) // 32  # int32 words per mask row
        self._tokenizer = None
        self._executor = None
        self._compiled: OrderedDict = OrderedDict()
        self.spent_s = 0.0  # time in masks() and accept() with constrained rows, since start (StepStats.grammar_s)

    def _lltokenizer(self):
        if self._tokenizer is None:
            import llguidance as llg

            if self.tokenizer_path is None or not Path(self.tokenizer_path).exists():
                raise InvalidRequest("structured outputs need the model's tokenizer.json, which this model lacks")
            self._tokenizer = llg.LLTokenizer(Path(self.tokenizer_path).read_text(), n_vocab=self.vocab_size,
                                              eos_token=list(self.eos_token_ids) or None)
            self._executor = llg.LLExecutor(num_threads=self.threads)
        return self._tokenizer

    def start(self, req: Request) -> None:
        """Give a constrained request its matcher (InvalidRequest when the constraint does not compile)."""
        guided = req.params.guided
        if guided is None:
            return
        key = (guided.kind, guided.spec)
        matcher = self._compiled.get(key)
        if matcher is None:
            import llguidance as llg

            matcher = llg.LLMatcher(self._lltokenizer(), grammar_of(guided), log_level=0)
            if matcher.is_error():
                raise InvalidRequest(f"the {guided.kind} constraint does not compile: {matcher.get_error()}")
            self._compiled[key] = matcher
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        req.grammar, req.grammar_fed = matcher.deep_copy(), 0

    def masks(self, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(allow_rows [B] int64, allow [M, words] int32) for the sampler, or None when no row is constrained."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        t0 = time.perf_counter()
        allow = np.zeros((len(rows), self.words), dtype=np.int32)
        bits = allow.view(np.uint32)
        live = []
        for m, i in enumerate(rows):
            req = reqs[i]
            self._catch_up(req)
            if req.grammar.is_error() or req.grammar.is_stopped():
                for eos in self.eos_token_ids:  # it ends at this token (accept() says how)
                    bits[m, eos >> 5] |= np.uint32(1 << (eos & 31))
            else:
                live.append((req.grammar, m))
        if len(live) == 1:
            live[0][0].unsafe_compute_mask_ptr(allow[live[0][1]].ctypes.data, self.words * 4)
        elif live:
            from llguidance.numpy import fill_next_token_bitmask_par

            fill_next_token_bitmask_par(self._executor, live, allow)
        allow_rows = torch.full((len(reqs),), -1, dtype=torch.int64)
        allow_rows[rows] = torch.arange(len(rows))
        self.spent_s += time.perf_counter() - t0
        return allow_rows, torch.from_numpy(allow)

    @staticmethod
    def _catch_up(req: Request) -> None:
        """Feed the matcher the outputs it has not seen (a resume's streamed outputs, a prefill worker's token)."""
        first = req.num_prompt - req.resumed_outputs + req.grammar_fed
        if first < len(req.tokens):
            if not req.grammar.is_error():
                req.grammar.consume_tokens(req.tokens[first:])
            req.grammar_fed += len(req.tokens) - first

    def accept(self, req: Request, token: int) -> str | None:
        """Feed the sampled token (already appended to req.tokens): "stop" when the grammar is complete, "abort"
        when the matcher is in error, else None."""
        t0 = time.perf_counter()
        matcher = req.grammar
        if not matcher.is_error() and not matcher.is_stopped():
            matcher.consume_token(token)
            req.grammar_fed += 1
        self.spent_s += time.perf_counter() - t0
        if matcher.is_error():
            log.error("request %s: its constraint rejected its output: %s", req.req_id, matcher.get_error())
            return "abort"
        return "stop" if matcher.is_stopped() else None
