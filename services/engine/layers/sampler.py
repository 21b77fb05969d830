"""Token sampling for the rows of a batch: greedy, temperature, min-p, top-k, top-p, per-request seeds.

Random rows sample by Gumbel-max: argmax over tokens of x / T + g, g = -log(-log u), which draws
from softmax(x / T). The uniform u of token v is counter-based: SplitMix64 of a row key made from
the request's seed and its output position, and of v (csrc/sampler.cpp says how). No generator
holds state, so a request draws the same tokens alone or in any batch, in any worker, across a
preemption or a KV export/import. Unseeded requests get a seed drawn at admission (the engine).

Masks are thresholds on the scaled logits, applied in vLLM's order: min-p (keep p >= min_p * p_max),
top-k (keep values >= the k-th largest), then top-p over what is left (keep the fewest top values
holding at least top_p of its mass; tokens within e^-40 of nothing are ignored). Greedy rows take
the argmax. A request short of its min_tokens cannot sample EOS or its stop tokens; a constrained request
(structured outputs) only the tokens its grammar's bitmask allows (services/engine/layers/guided.py), applied in
the same pass. Logprobs, when asked, are of the model's raw distribution (before any mask) at the
sampled token; top logprobs, the most likely tokens of that distribution, from one log-softmax of the
rows that ask (which also gives those rows' sampled-token logprob, so the two always agree).

The compiled kernel (services.engine.layers.kernels.sampler) does all of it in one parallel pass, on float32 or
bfloat16 logits (a bfloat16 model's logits are widened row by row inside it, exactly);
sample_torch() is the PyTorch fallback, which computes the same noise bit for bit and so gives the
same tokens for the same seeds (to float rounding of the top-p mass at its exact boundary).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.engine.request import Request

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
# Cephes' logf polynomial, highest degree first, as the exact floats csrc/sampler.cpp uses.
LOG_POLY = tuple(float.fromhex(h) for h in (
    "0x1.204376p-4", "-0x1.d7a370p-4", "0x1.de4a34p-4", "-0x1.fcba9ep-4", "0x1.23d37ep-3", "-0x1.555ca0p-3",
    "0x1.999d58p-3", "-0x1.fffff8p-3", "0x1.555554p-2"))
SQRT2, LN2 = float.fromhex("0x1.6a09e6p+0"), float.fromhex("0x1.62e430p-1")
TAIL_SPAN = 40.0  # top-p ignores tokens more than this below the max
ROW_BLOCK = 16  # rows per block in the PyTorch fallback's noise


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as the tensors the kernel takes, in its argument order."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    log_min_p: torch.Tensor  # [B] float32, log(min_p); -inf = off
    seeds: torch.Tensor  # [B] int64, the request's sampling seed
    positions: torch.Tensor  # [B] int64, the output index being sampled (the noise counter)
    ban_offsets: torch.Tensor  # [B + 1] int64: row b may not sample ban_ids[ban_offsets[b]:ban_offsets[b + 1]]
    ban_ids: torch.Tensor  # int64
    want_logprobs: torch.Tensor  # [B] bool
    allow_rows: torch.Tensor | None = None  # [B] int64: row b samples only what allow[allow_rows[b]] sets (-1: any)
    allow: torch.Tensor | None = None  # [M, ceil(V / 32)] int32 bitmasks (bit v: token v allowed)

    @classmethod
    def of(cls, reqs: list[Request], eos_token_ids: tuple = (), allow: tuple | None = None) -> SamplingBatch:
        offsets, bans = [0], []
        for r in reqs:
            if r.num_output < r.params.min_tokens:
                bans += list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else list(eos_token_ids))
            offsets.append(len(bans))
        p = [r.params for r in reqs]
        return cls(
            temperature=torch.tensor([x.temperature for x in p], dtype=torch.float32),
            top_k=torch.tensor([x.top_k for x in p], dtype=torch.int64),
            top_p=torch.tensor([x.top_p for x in p], dtype=torch.float32),
            log_min_p=torch.tensor([math.log(x.min_p) if x.min_p > 0 else -math.inf for x in p], dtype=torch.float32),
            seeds=torch.tensor([r.sample_seed for r in reqs], dtype=torch.int64),
            positions=torch.tensor([r.resumed_outputs + r.num_output for r in reqs], dtype=torch.int64),
            ban_offsets=torch.tensor(offsets, dtype=torch.int64), ban_ids=torch.tensor(bans, dtype=torch.int64),
            want_logprobs=torch.tensor([x.wants_logprobs for x in p], dtype=torch.bool),
            allow_rows=allow[0] if allow else None, allow=allow[1] if allow else None)

    def tensors(self) -> tuple:
        rows = len(self.temperature)
        allow_rows = self.allow_rows if self.allow_rows is not None else torch.full((rows,), -1, dtype=torch.int64)
        allow = self.allow if self.allow is not None else torch.empty((0, 0), dtype=torch.int32)
        return (self.temperature, self.top_k, self.top_p, self.log_min_p, self.seeds, self.positions,
                self.ban_offsets, self.ban_ids, self.want_logprobs, allow_rows, allow)


@dataclass
class Sampled:
    tokens: list  # per row
    logprobs: list | None  # per row (NaN where not asked), or None when no row asked
    top: list | None  # per row: (token ids, logprobs), most likely first, or None; None when no row asked


class Sampler:
    def __init__(self, eos_token_ids: tuple = (), kernel=None):
        self.eos_token_ids = tuple(eos_token_ids)
        self.kernel = kernel  # services.engine.layers.kernels.sampler() module, or None for sample_torch

    def __call__(self, logits: torch.Tensor, reqs: list[Request], allow: tuple | None = None) -> Sampled:
        """Sampled token per row, and logprobs (and top logprobs) per row when any request asked. allow: the
        grammars' (allow_rows, allow) bitmasks (services/engine/layers/guided.py)."""
        batch = SamplingBatch.of(reqs, self.eos_token_ids, allow)
        if self.kernel is not None:  # float32 or bfloat16 logits, each row widened as it is sampled
            keep = logits.dtype in (torch.float32, torch.bfloat16)
            tokens, logprobs = self.kernel.sample((logits if keep else logits.float()).contiguous(), *batch.tensors())
        else:
            tokens, logprobs = sample_torch(logits.float().contiguous(), batch)
        top = _top_logprobs(logits, reqs, tokens, logprobs)
        return Sampled(tokens.tolist(), logprobs.tolist() if batch.want_logprobs.any() else None, top)


def _top_logprobs(logits: torch.Tensor, reqs: list[Request], tokens: torch.Tensor, logprobs: torch.Tensor):
    """Each asking row's top_logprobs most likely tokens, and its sampled token's logprob from the same log-softmax
    (written into logprobs); None when no row asks."""
    rows = [i for i, r in enumerate(reqs) if r.params.top_logprobs]
    if not rows:
        return None
    lsm = torch.log_softmax(logits[rows].float(), dim=-1)
    values, ids = lsm.topk(max(reqs[i].params.top_logprobs for i in rows), dim=-1)
    logprobs[rows] = lsm.gather(1, tokens[rows, None]).squeeze(1)
    top = [None] * len(reqs)
    for j, i in enumerate(rows):
        n = reqs[i].params.top_logprobs
        top[i] = (ids[j, :n].tolist(), values[j, :n].tolist())
    return top


# ---- the PyTorch fallback: the kernel's arithmetic, operation for operation --------------------------

def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def row_key(seed: int, position: int) -> int:
    return _mix64((_mix64(seed & MASK64) + (position + 1) * GOLDEN) & MASK64)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 lanes holding uint64 bits."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def uniforms(keys: list[int], vocab: int) -> torch.Tensor:
    """u of every token of each row: [len(keys), vocab] float32 in (0, 1), as uniform() in the kernel."""
    v = torch.arange(1, vocab + 1, dtype=torch.int64)
    z = torch.tensor([_signed(k) for k in keys], dtype=torch.int64)[:, None] + v[None, :] * _signed(GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(MIX1)
    z = (z ^ _shr(z, 27)) * _signed(MIX2)
    z = z ^ _shr(z, 31)
    return (_shr(z, 41).to(torch.float32) + 0.5) * 2.0 ** -23


def log_poly(x: torch.Tensor) -> torch.Tensor:
    """log(x) for normal x > 0, exactly as log_poly() in the kernel."""
    bits = x.view(torch.int32)
    e = ((bits >> 23) - 127).to(torch.float32)
    m = ((bits & 0x007FFFFF) | 0x3F800000).view(torch.float32)
    big = m > SQRT2
    m, e = torch.where(big, m * 0.5, m), torch.where(big, e + 1.0, e)
    f = m - 1.0
    z = f * f
    y = torch.full_like(f, LOG_POLY[0])
    for c in LOG_POLY[1:]:
        y = y * f + c
    y = y * f * z
    y = y - 0.5 * z
    return f + y + e * LN2


def gumbel_scores(xs: torch.Tensor, keys: list[int]) -> torch.Tensor:
    return xs - log_poly(-log_poly(uniforms(keys, xs.shape[-1])))


def _top_k_threshold(xs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = xs.shape[-1]
    on = (top_k > 0) & (top_k < vocab)
    if not on.any():
        return torch.full((xs.shape[0],), -math.inf)
    k = torch.where(on, top_k, 1)
    kth = xs.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None]).squeeze(1)
    return torch.where(on, kth, -math.inf)


def _top_p_threshold(xs: torch.Tensor, mx: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    out = torch.full((xs.shape[0],), -math.inf)
    on = (top_p < 1.0).nonzero().flatten()
    if len(on):
        lo = torch.maximum(floor[on], mx[on] - TAIL_SPAN)[:, None]
        values, _ = xs[on].sort(dim=-1, descending=True)
        mass = torch.where(values >= lo, torch.exp(values - mx[on, None]), 0.0)
        cum = mass.cumsum(dim=-1)
        first = (cum >= top_p[on, None] * cum[:, -1:]).int().argmax(dim=-1)  # the first top prefix holding p
        out[on] = values.gather(1, first[:, None]).squeeze(1)
    return out


def allowed_tokens(allow_rows: torch.Tensor, allow: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] bool: what each row may sample under its bitmask (every token where allow_rows < 0)."""
    out = torch.ones((len(allow_rows), vocab), dtype=torch.bool)
    rows = (allow_rows >= 0).nonzero().flatten()
    if len(rows):
        words = allow[allow_rows[rows]].long() & 0xFFFFFFFF
        bits = (words[:, :, None] >> torch.arange(32)) & 1  # [R, W, 32]: bit v of the row
        out[rows] = bits.flatten(1)[:, :vocab].bool()
    return out


def sample_torch(logits: torch.Tensor, b: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's sample() in PyTorch: (tokens [B] int64, logprobs [B] float32, NaN where not asked)."""
    rows = logits.shape[0]
    greedy = b.temperature <= 0
    xs = logits / torch.where(greedy, 1.0, b.temperature)[:, None]
    xs[torch.repeat_interleave(torch.arange(rows), b.ban_offsets.diff()), b.ban_ids] = -math.inf
    if b.allow_rows is not None:
        xs[~allowed_tokens(b.allow_rows, b.allow, xs.shape[-1])] = -math.inf
    mx = xs.max(dim=-1).values
    thr = torch.where(b.log_min_p > -math.inf, mx + b.log_min_p, -math.inf)
    thr = torch.maximum(thr, _top_k_threshold(xs, b.top_k))
    thr = torch.maximum(thr, _top_p_threshold(xs, mx, thr, b.top_p))
    tokens = xs.argmax(dim=-1)
    for block in (~greedy).nonzero().flatten().split(ROW_BLOCK):  # random rows, a cache-sized block at a time
        masked = torch.where(xs[block] >= thr[block, None], xs[block], -math.inf)
        keys = [row_key(int(b.seeds[r]), int(b.positions[r])) for r in block]
        tokens[block] = gumbel_scores(masked, keys).argmax(dim=-1)
    logprobs = torch.full((rows,), math.nan)
    asked = b.want_logprobs.nonzero().flatten()
    if len(asked):
        logprobs[asked] = torch.log_softmax(logits[asked], dim=-1).gather(1, tokens[asked, None]).squeeze(1)
    return tokens, logprobs
