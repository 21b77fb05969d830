"""A generation request as the engine tracks it, and its sampling parameters (validated at the edge)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

import torch

from services.common.errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # new tokens to generate at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    seed: int | None = None  # per-request seed: same seed, same tokens, whatever the batch
    stop: tuple = ()  # stop strings (not included in the output text)
    stop_token_ids: tuple = ()  # token ids that end generation besides EOS
    ignore_eos: bool = False  # keep generating past EOS
    logprobs: bool = False  # report the log-probability of each sampled token

    def validate(self) -> None:
        _check(isinstance(self.max_tokens, int) and self.max_tokens > 0, f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _check(_finite(self.temperature) and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63), f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be integers >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)


class Status(Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute
    RUNNING = "running"  # holds KV blocks and is scheduled each step
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    req_id: str  # caller's id, unique among live requests
    prompt_token_ids: list  # the prompt as given
    params: SamplingParams
    arrival_s: float  # engine clock at add_request
    seq_no: int  # admission order, the arbitration tie-break
    priority: int = 0  # 0 most urgent
    adapter: str = ""  # LoRA adapter name ("" = base model)
    cache_salt: str = ""  # isolation domain for prefix hashing
    tokens: list = field(default_factory=list)  # prompt + output so far
    num_computed: int = 0  # tokens whose KV is in the cache
    num_cached_prompt: int = 0  # prompt tokens served from the prefix cache at first schedule
    status: Status = Status.WAITING
    finish_reason: str | None = None  # stop | length | abort
    generator: torch.Generator | None = None  # per-request RNG when seeded
    logprobs: list = field(default_factory=list)  # per output token, when asked
    num_preemptions: int = 0

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_token_ids)
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list:
        return self.tokens[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)
