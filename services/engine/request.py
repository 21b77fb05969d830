"""A generation request as the engine tracks it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from services.common.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute
    RUNNING = "running"  # holds KV blocks and is scheduled each step
    RECEIVING = "receiving"  # holds KV blocks that an import is filling; not scheduled yet
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    req_id: str  # caller's id, unique among live requests
    prompt_token_ids: list  # the prompt as given
    params: SamplingParams
    arrival_s: float  # engine clock at add_request
    seq_no: int  # admission order, the arbitration tie-break
    priority: int = 0  # 0 most urgent
    band: int = 1  # services.policy.bands: 0 critical, 1 standard, 2 sheddable (strict, before any policy)
    adapter: str = ""  # LoRA adapter name ("" = base model)
    cache_salt: str = ""  # isolation domain for prefix hashing
    tenant: str = ""  # who asked (slot arbitration; "" = the default tenant)
    weight: float = 1.0  # the tenant's share
    deadline_s: float | None = None  # absolute, engine clock; None = none
    predicted_s: float = 0.0  # predicted service time, for slack
    tokens: list = field(default_factory=list)  # prompt + output so far
    num_computed: int = 0  # tokens whose KV is in the cache
    num_cached_prompt: int = 0  # prompt tokens served from the prefix cache at first schedule
    status: Status = Status.WAITING
    finish_reason: str | None = None  # stop | length | abort
    sample_seed: int | None = None  # keys the sampling noise: params.seed, else drawn at admission
    logprobs: list = field(default_factory=list)  # per output token, when asked
    top_logprobs: list = field(default_factory=list)  # per output token: (token ids, logprobs), when asked
    num_preemptions: int = 0
    resumed_outputs: int = 0  # the prompt ends with this many outputs of an earlier attempt (a resume)
    lora_slot: int | None = None  # the adapter slot it pins while in the batch (or receiving)
    pooled: tuple | None = None  # (hashes, start, blocks) from the mesh's KV pool, imported when it is admitted
    grammar: object | None = None  # its constraint's llguidance matcher (guided.py), when params.guided is set
    grammar_fed: int = 0  # outputs (a resume's streamed ones included) the matcher has consumed

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_token_ids)
        if self.sample_seed is None:
            self.sample_seed = self.params.seed or 0

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
