"""Shared test fakes: an injectable clock, and a scheduler over a real block pool with no model."""

from __future__ import annotations

from services.common.sampling import SamplingParams
from services.engine.block_pool import BlockPool
from services.engine.kv_manager import KVCacheManager
from services.engine.request import Request
from services.engine.scheduler import Scheduler
from services.policy.arbitration import make_arbitration_policy


class Clock:
    """A clock that moves only when told: clock.now = ..., or clock.advance(s)."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_scheduler(*, num_blocks: int = 64, block_size: int = 16, max_num_seqs: int = 8, budget: int = 64,
                   policy: str = "fcfs", prefix_caching: bool = True, clock=None) -> Scheduler:
    """The engine's scheduler and KV manager over a block pool, without a model or KV tensors."""
    kv = KVCacheManager(BlockPool(num_blocks), block_size, prefix_caching)
    return Scheduler(kv, make_arbitration_policy(policy), max_num_seqs, budget, clock=clock or Clock())


def make_request(i: int, prompt_len: int = 20, max_tokens: int = 4, **kw) -> Request:
    prompt = [3 + (i * 7 + j) % 500 for j in range(prompt_len)]
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_s=0.0, seq_no=i,
                   **kw)
