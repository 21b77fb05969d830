"""Token sampling for the rows of a batch: greedy, temperature, top-k, top-p, per-request seeds.

Random rows sample by the exponential race: argmax(p / q) with q ~ Exp(1), which draws from p.
A seeded request draws its q from its own generator, so the same seed gives the same tokens
alone or inside any batch; unseeded rows share the engine's generator. All-greedy batches take
one argmax. Logprobs, when asked, are of the model's raw distribution at the sampled token.
A request short of its min_tokens cannot sample EOS or its stop tokens (their logits are masked).
"""

from __future__ import annotations

import torch

from services.engine.request import Request


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: tuple = ()):
        self.generator = torch.Generator().manual_seed(seed)
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[float] | None]:
        """Sampled token per row, and logprobs per row when any request asked (else None)."""
        raw = logits
        logits = self._ban_early_stops(logits, reqs)
        if all(r.params.greedy for r in reqs):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, reqs)
        logprobs = None
        if any(r.params.logprobs for r in reqs):
            logprobs = torch.log_softmax(raw, dim=-1).gather(1, tokens[:, None]).squeeze(1).tolist()
        return tokens.tolist(), logprobs

    def _ban_early_stops(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows = [(i, r) for i, r in enumerate(reqs) if r.num_output < r.params.min_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        for i, r in rows:
            banned = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else list(self.eos_token_ids))
            if banned:
                logits[i, banned] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature or 1.0 for r in reqs], dtype=logits.dtype)
        scaled = logits / temps[:, None]
        scaled = _filter_top_k_top_p(scaled, reqs)
        probs = torch.softmax(scaled, dim=-1)
        q = torch.empty_like(probs)
        for i, r in enumerate(reqs):
            q[i].exponential_(generator=r.generator or self.generator)
        sampled = (probs / q).argmax(dim=-1)
        greedy = torch.tensor([r.params.greedy for r in reqs])
        return torch.where(greedy, logits.argmax(dim=-1), sampled)


def _filter_top_k_top_p(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    top_k = [r.params.top_k for r in reqs]
    top_p = [r.params.top_p for r in reqs]
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([min(k, vocab) if k else vocab for k in top_k])
    drop = torch.arange(vocab)[None, :] >= ks[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
    drop |= before >= torch.tensor(top_p, dtype=logits.dtype)[:, None]
    drop[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
