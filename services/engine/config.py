"""Frozen configuration of the engine's parts; the composition root (LLMEngine) sees them all.

Values found at run time (the KV pool's size, the EOS ids) live in runtime objects, never
written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0  # base of the rotary frequencies
    kind: str = "default"  # "default" or "llama3"
    factor: float = 1.0  # llama3: how much the context was stretched
    low_freq_factor: float = 1.0  # llama3: wavelengths above orig/low are scaled fully
    high_freq_factor: float = 4.0  # llama3: wavelengths below orig/high are left alone
    original_max_positions: int = 8192  # llama3: the context the model was trained on


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int  # rows of the embedding and logits
    hidden_size: int  # width of the residual stream
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when fewer than num_heads)
    head_dim: int  # width of one head
    intermediate_size: int  # SwiGLU hidden width
    max_positions: int  # longest context the model accepts
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    rope: RopeConfig = field(default_factory=RopeConfig)  # rotary embedding parameters
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    o_bias: bool = False  # output projection carries a bias (Llama attention_bias)
    mlp_bias: bool = False  # gate/up/down projections carry a bias
    tie_embeddings: bool = False  # lm_head shares the embedding matrix
    model_type: str = "llama"  # the Hugging Face model_type it came from


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV pool size; None = derive from kv_cache_bytes
    kv_cache_bytes: int = 2 * 1024**3  # memory for the pool when num_blocks is None
    enable_prefix_caching: bool = True  # reuse cached full blocks across requests


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # sequences in one batch
    max_num_batched_tokens: int = 2048  # token budget per iteration; also the prefill chunk size
    policy: str = "fair-deadline"  # slot arbitration policy name (services.common.arbitration)


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str  # Hugging Face model folder
    dtype: str = "float32"  # float32 or bfloat16
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None  # torch intra-op threads; None = torch's default
    seed: int = 0  # seed for unseeded sampling
