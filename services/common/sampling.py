"""Sampling parameters of a request: one definition, validated at the edge and used by the engine."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from services.common.errors import InvalidRequest

GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_GUIDED_SPEC = 256 * 1024  # bytes of a schema, regex or grammar
MAX_TOP_LOGPROBS = 20  # alternatives per token, as vLLM's default limit


@dataclass(frozen=True)
class Guided:
    """A constraint on the output (structured outputs): the engine's grammar masks the tokens each step allows.

    kind: json (spec: a JSON Schema, as JSON text) | json_object (any JSON object; no spec) | regex (spec: the
    pattern the whole output matches) | choice (spec: a JSON list of the strings the output may be) | grammar
    (spec: a Lark grammar, or GBNF as llama.cpp writes it)."""

    kind: str
    spec: str = ""

    def validate(self) -> None:
        _check(self.kind in GUIDED_KINDS,
               f"guided decoding kind must be one of {list(GUIDED_KINDS)}, got {self.kind!r}")
        _check(isinstance(self.spec, str) and len(self.spec.encode()) <= MAX_GUIDED_SPEC,
               f"the {self.kind} constraint is over {MAX_GUIDED_SPEC} bytes")
        _check(bool(self.spec) == (self.kind != "json_object"),
               "json_object takes no spec" if self.kind == "json_object" else f"the {self.kind} constraint is empty")
        if self.kind in ("json", "choice"):
            try:
                value = json.loads(self.spec)
            except (json.JSONDecodeError, RecursionError) as e:
                raise InvalidRequest(f"the {self.kind} constraint is not valid JSON: {e}") from None
            if self.kind == "json":
                _check(isinstance(value, (dict, bool)), "a JSON Schema must be a JSON object (or true/false)")
            else:
                _check(isinstance(value, list) and value and all(isinstance(c, str) and c for c in value),
                       "guided choice must be a non-empty list of non-empty strings")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # new tokens to generate at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    min_p: float = 0.0  # keep tokens at least this fraction as likely as the most likely; 0 = off
    seed: int | None = None  # per-request seed: same seed, same tokens, whatever the batch
    stop: tuple = ()  # stop strings (not included in the output text)
    stop_token_ids: tuple = ()  # token ids that end generation besides EOS
    ignore_eos: bool = False  # keep generating past EOS
    logprobs: bool = False  # report the log-probability of each sampled token
    min_tokens: int = 0  # EOS, stop tokens and stop strings cannot end generation before this many tokens
    top_logprobs: int = 0  # also report this many most likely tokens and their logprobs at each step
    guided: Guided | None = None  # structured outputs: the output follows this constraint

    def validate(self) -> None:
        _check(isinstance(self.max_tokens, int) and self.max_tokens > 0,
               f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _check(_finite(self.temperature) and self.temperature >= 0,
               f"temperature must be >= 0, got {self.temperature!r}")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be integers >= 0")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        _check(isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
               f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.guided is not None:
            self.guided.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def wants_logprobs(self) -> bool:
        """The sampled token's logprob is reported (asked for alone, or with alternatives)."""
        return self.logprobs or self.top_logprobs > 0


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)


PARAM_FIELDS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int,
                 "ignore_eos": bool, "logprobs": bool, "min_tokens": int, "top_logprobs": int}


def parse_params(obj: dict) -> SamplingParams:
    """SamplingParams from a JSON object, with type errors as InvalidRequest."""
    kw = {}
    for name, kind in PARAM_FIELDS.items():
        if obj.get(name) is None:
            continue
        value = obj[name]
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise InvalidRequest(f"field {name!r} must be {kind.__name__}, got {value!r}")
        kw[name] = value
    if obj.get("guided") is not None:
        kw["guided"] = guided_from(obj["guided"])
    kw["stop"] = tuple(_string_list(obj, "stop"))
    kw["stop_token_ids"] = tuple(_int_list(obj, "stop_token_ids"))
    return SamplingParams(**kw)


def guided_from(value) -> Guided:
    """A JSONL line's "guided": {"kind": ..., "spec": ...}; a spec that is not a string (a schema, a list of choices)
    is taken as its JSON text."""
    if not isinstance(value, dict) or not isinstance(value.get("kind"), str):
        raise InvalidRequest('field "guided" must be an object {"kind": ..., "spec": ...}')
    spec = value.get("spec", "")
    return Guided(value["kind"], spec if isinstance(spec, str) else json.dumps(spec))


def _string_list(obj: dict, name: str) -> list:
    value = obj.get(name) or []
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidRequest(f"field {name!r} must be a string or a list of strings")
    return value


def _int_list(obj: dict, name: str) -> list:
    value = obj.get(name) or []
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequest(f"field {name!r} must be a list of integers")
    return value
