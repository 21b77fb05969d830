"""Outside references and factories shared by the tests: seeded transformers models and their greedy output."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.sampling import SamplingParams
from services.config.engine import CacheConfig, EngineConfig, SchedulerConfig
from services.engine.engine import LLMEngine

TIE_GAP = 1e-5  # a greedy mismatch is tolerated only where the reference's top-2 logits are this close
# bfloat16 keeps 8 significant bits: its logits are multiples of 2^-7 of their magnitude, and sums taken in
# another order move them by a unit or two. In bfloat16 a near-tie is a top-2 gap of at most 2 such units.
BF16_TIE_UNITS = 2


def tie_gap(top: float, dtype: torch.dtype) -> float:
    """The largest top-2 gap that counts as a near-tie for logits of magnitude `top` computed in dtype."""
    if dtype == torch.bfloat16:
        return BF16_TIE_UNITS * 2.0 ** (math.floor(math.log2(max(abs(top), 1e-30))) - 7)
    return TIE_GAP

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.15)

CONFIGS = {
    "gqa": ("llama", {}),
    "mha": ("llama", {"num_key_value_heads": 4}),
    "tied": ("llama", {"tie_word_embeddings": True}),
    "qkv_bias": ("qwen2", {}),
    "llama3_rope": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64}}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    # two layers: a sliding one (window 24, shorter than most prompts here) and a global one, each with its rotary;
    # one KV head, as Gemma 3 270M (tensor parallelism replicates it)
    "gemma3": ("gemma3", {"head_dim": 64, "num_key_value_heads": 1, "query_pre_attn_scalar": 24, "sliding_window": 24,
                          "layer_types": ["sliding_attention", "full_attention"],
                          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                              "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}),
}
# the norms' initial weights (ones; zeros for Gemma's 1 + weight) moved, so that a norm applied wrongly shows
NORM_NOISE = 0.3


def save_hf_model(out: Path, name: str, seed: int = 0, **overrides) -> Path:
    """A seeded random-weight transformers model of one CONFIGS entry (its fields changed by overrides), saved as a
    HF folder."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    kind, extra = CONFIGS[name]
    extra = {**extra, **overrides}
    torch.manual_seed(seed)
    if kind in ("qwen3", "gemma3"):
        cls, config = {"qwen3": (Qwen3ForCausalLM, Qwen3Config), "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig)}[kind]
        model = cls(config(**{**BASE, **extra}))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.add_(torch.randn_like(p) * NORM_NOISE)
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**{**BASE, **extra}))
        # Qwen2's init zeroes biases; give them values so the bias path is exercised.
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("proj.bias"):
                    p.normal_(0, 0.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**{**BASE, **extra}))
    model.save_pretrained(out)
    return out


@dataclass
class Reference:
    tokens: list  # greedy tokens
    gaps: list  # top-1 minus top-2 logit at each step
    ties: list  # the near-tie bound at each step (tie_gap of the top logit)


def hf_greedy(model_dir: Path, prompts: list, max_new: int, dtype: torch.dtype = torch.float32) -> list[Reference]:
    """transformers generate, one request at a time, eager attention, greedy, EOS ignored (float32 unless dtype)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=dtype).eval()
    refs = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        tops = [s[0].float().topk(2).values for s in out.scores]
        refs.append(Reference(out.sequences[0, len(p):].tolist(), [float(t[0] - t[1]) for t in tops],
                              [tie_gap(float(t[0]), dtype) for t in tops]))
    return refs


def random_prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 80, vocab: int = 512, prefix: list = ()) -> list:
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def make_engine(model_dir, *, num_blocks=256, block_size=16, budget=64, max_seqs=64, prefix_caching=True,
                policy="fcfs", dtype="float32", quantization="none", tensor_parallel_size=1,
                tensor_parallel_backend="shm", threads=None) -> LLMEngine:
    return LLMEngine(EngineConfig(str(model_dir), dtype=dtype, quantization=quantization, num_threads=threads,
                                  tensor_parallel_size=tensor_parallel_size,
                                  tensor_parallel_backend=tensor_parallel_backend,
                                  cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                                   enable_prefix_caching=prefix_caching),
                                  scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                                            policy=policy)))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_all(engine: LLMEngine, prompts: list, params: SamplingParams, check=None, adapters=None) -> list:
    """Add every prompt (with its LoRA adapter from adapters, if given), step until done; returns output tokens in
    prompt order. check() runs after each step."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, adapter=adapters[i] if adapters else "")
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.req_id] = o.request.output_token_ids
        if check:
            check(engine)
    return [done[f"r{i}"] for i in range(len(prompts))]


def assert_matches(outputs: list, refs: list[Reference], units: float = 1.0) -> list:
    """Token-identical, except at a reference near-tie (returned for reporting); units scales the near-tie bound
    (a computation with more roundings than the reference's, as a tensor-parallel one)."""
    ties = []
    for i, (got, ref) in enumerate(zip(outputs, refs)):
        for j, (a, b) in enumerate(zip(got, ref.tokens)):
            if a != b:
                assert ref.gaps[j] <= units * ref.ties[j], (
                    f"request {i} differs at token {j}: got {got} want {ref.tokens} (reference top-2 gap "
                    f"{ref.gaps[j]:.3g}, near-tie bound {units * ref.ties[j]:.3g})")
                ties.append((i, j, ref.gaps[j]))
                break
        else:
            assert len(got) == len(ref.tokens), f"request {i}: {len(got)} tokens, want {len(ref.tokens)}"
    return ties


def agreement(outputs: list, refs: list[Reference]) -> float:
    """The share of reference tokens our outputs reproduce before their first difference."""
    same = 0
    for got, ref in zip(outputs, refs):
        for a, b in zip(got, ref.tokens):
            if a != b:
                break
            same += 1
    return same / sum(len(ref.tokens) for ref in refs)
