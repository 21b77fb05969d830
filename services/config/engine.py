"""Frozen configuration of the engine's parts; the composition root (LLMEngine) sees them all.

Values found at run time (the KV pool's size, the EOS ids) live in runtime objects, never
written back here. EngineSection is the engine section of the mesh file and the engine flags of
every command that runs an engine (services/config/flags.py generates them from it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt


def _arbitration_policy(name: str) -> str:
    from services.policy.arbitration import make_arbitration_policy

    make_arbitration_policy(name)  # ValueError naming the known policies
    return name


ArbitrationPolicyName = Annotated[str, AfterValidator(_arbitration_policy)]  # fcfs, priority, deadline, fair, ...


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0  # base of the rotary frequencies
    kind: str = "default"  # "default", "linear" (positions divided by factor) or "llama3"
    factor: float = 1.0  # linear, llama3: how much the context was stretched
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
    intermediate_size: int  # the gated MLP's hidden width
    max_positions: int  # longest context the model accepts
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    rope: RopeConfig = field(default_factory=RopeConfig)  # rotary embedding parameters
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    o_bias: bool = False  # output projection carries a bias (Llama attention_bias)
    mlp_bias: bool = False  # gate/up/down projections carry a bias
    tie_embeddings: bool = False  # lm_head shares the embedding matrix
    model_type: str = "llama"  # the Hugging Face model_type it came from (services.engine.models: its forward)
    hidden_act: str = "silu"  # the gated MLP's activation: silu, or gelu_pytorch_tanh (Gemma)
    qk_norm: bool = False  # an RMSNorm over each query and key head before rotary (Qwen3, Gemma 3)
    attn_scale: float | None = None  # scores' scale; None = head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)
    embed_scale: float = 1.0  # embeddings multiplied by it (Gemma: sqrt(hidden_size))
    layer_windows: tuple = ()  # per layer, its sliding window in tokens (0: attends the whole context); () = none
    local_rope: RopeConfig | None = None  # rotary of the sliding-window layers where it differs (Gemma 3)

    def window(self, layer: int) -> int:
        """The layer's sliding window (0: global)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def max_window(self) -> int:
        """The window every windowed layer fits in (0 where no layer has one)."""
        return max(self.layer_windows, default=0)


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
    policy: str = "fair-deadline"  # slot arbitration policy name (services.policy.arbitration)
    deadline_min_batch: int = 4  # deadline-aware batching never steps fewer sequences than this (when it has them)


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 8  # compute slots: distinct adapters one batch can hold
    max_cpu_loras: int = 32  # adapters kept in host memory (slot ones included)
    max_lora_rank: int = 64  # the largest rank accepted
    lora_dir: str | None = None  # every subfolder with an adapter_config.json is an adapter, named by the folder
    modules: tuple = ()  # (name, path) pairs registered at start


@dataclass(frozen=True)
class MockConfig:
    profile: str = "cpu-smollm2"  # step-time model: a preset of services.engine.cost_model or a calibration file
    time_scale: float = 1.0  # every step takes this many times its modelled time (the mesh runs slower, together)
    kv: str = "bytes"  # bytes: KV blocks of the model's real size travel; metadata: 64 bytes a block (stated)


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str  # Hugging Face model folder
    dtype: str = "float32"  # float32 or bfloat16
    quantization: str = "none"  # none, gguf or auto (services.engine.layers.quant.resolve)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    num_threads: int | None = None  # torch intra-op threads (per tensor-parallel rank); None = torch's default
    seed: int = 0  # seeds the sampling seeds drawn for requests that bring none
    tensor_parallel_size: int = 1  # ranks (processes) the model is split over (services.engine.parallel)
    tensor_parallel_backend: str = "shm"  # their all-reduce: shm (one host) or gloo (TCP)
    backend: str = "torch"  # torch: the model's forward pass; mock: a step-time model instead (services.engine.mock)
    mock: MockConfig = field(default_factory=MockConfig)


class EngineSection(BaseModel):
    """The engine's settings as users give them (mesh file, MESHSERVE_ENGINE__* variables, flags)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["float32", "bfloat16"] = Field("float32", description="weights and KV dtype")
    quantization: Literal["auto", "none", "gguf"] = Field(
        "auto", description="weights: gguf runs the GGUF's Q4_0/Q4_1/Q8_0 blocks as import-gguf kept them (float32 "
                            "activations); none the float weights of dtype; auto takes gguf where the folder has "
                            "them and dtype is float32")
    block_size: PositiveInt = Field(16, description="tokens per KV block")
    num_blocks: PositiveInt | None = Field(None, description="KV pool size in blocks (default: from kv_cache_gb)")
    kv_cache_gb: PositiveFloat = Field(2.0, description="KV pool memory when num_blocks is not given")
    max_num_seqs: PositiveInt = Field(256, description="sequences per batch")
    max_num_batched_tokens: PositiveInt = Field(2048, description="token budget per iteration, also the prefill chunk")
    prefix_caching: bool = Field(True, description="reuse cached full blocks across requests")
    slot_policy: ArbitrationPolicyName = Field("fair-deadline", description="slot arbitration: fcfs | priority | "
                                                                            "deadline | fair | vtc | fair-deadline")
    deadline_min_batch: PositiveInt = Field(
        4, description="deadline-aware batching (deadline-aware slot policies): the fewest sequences a step carries "
                       "when it caps the batch for requests with deadlines; the throughput floor of the others")
    threads: PositiveInt | None = Field(None, description="torch threads, per tensor-parallel rank (default: torch's "
                                                          "choice)")
    tensor_parallel_size: PositiveInt = Field(
        1, description="split the model over this many ranks, one process each (heads by KV head, MLP by columns; "
                       "at most the model's KV heads); the worker is one replica of N ranks")
    tensor_parallel_backend: Literal["shm", "gloo"] = Field(
        "shm", description="the ranks' all-reduce: shm (shared memory, one host) or gloo (torch.distributed over TCP)")
    omp_wait_policy: Literal["spin", "passive", "active"] = Field(
        "spin", description="a worker's engine core: OpenMP threads spin briefly then sleep between parallel regions "
                            "(spin: GOMP_SPINCOUNT 20000, unless set), sleep at once (passive) or spin (active). On 2 "
                            "cores shared with the servicer and gateway passive measured 8-12 percent more output "
                            "online than active; spin matches passive under load and decodes one sequence of "
                            "SmolLM2 1.6x as fast (a step has ~250 parallel regions; docs/BENCHMARKS.md)")
    seed: int = Field(0, description="seeds the sampling seeds drawn for requests that bring none")
    backend: Literal["torch", "mock"] = Field(
        "torch", description="torch runs the model; mock replaces only its forward pass by a step-time model (the "
                             "scheduler, KV cache, prefix cache and KV transfer stay real; no weights are loaded; "
                             "tokens come from a hash of the prompt and position): the mesh at scale without a model")
    mock_profile: str = Field("cpu-smollm2", description="mock backend: its step-time model, a preset (cpu-smollm2, "
                                                         "h100-llama8b, l4-llama1b: assumptions, see docs/CLUSTER.md) "
                                                         "or a calibration file of `meshserve sim calibrate`")
    mock_time_scale: PositiveFloat = Field(1.0, description="mock backend: every step takes this many times its "
                                                            "modelled time (run the offered load this much slower too "
                                                            "and divide the measured times by it)")
    mock_kv: Literal["bytes", "metadata"] = Field("bytes", description="mock backend: KV blocks travel at the "
                                                                       "model's real size (bytes) or as 64 bytes "
                                                                       "each (metadata)")
    lora_dir: str | None = Field(None, description="LoRA adapters: every subfolder holding a PEFT adapter "
                                                   "(adapter_config.json) is one, named by the folder")
    lora_modules: dict[str, str] = Field(default_factory=dict, description="LoRA adapters by name: {name: PEFT "
                                                                          "folder}, as vLLM's --lora-modules")
    max_loras: NonNegativeInt = Field(8, description="LoRA compute slots: distinct adapters in one batch (0 = no "
                                                     "adapters)")
    max_cpu_loras: PositiveInt = Field(32, description="LoRA adapters kept in host memory, slot ones included")
    max_lora_rank: PositiveInt = Field(64, description="the largest LoRA rank accepted")

    def to_engine_config(self, model_dir: str) -> EngineConfig:
        return EngineConfig(
            model_dir=str(model_dir), dtype=self.dtype, quantization=self.quantization, num_threads=self.threads,
            seed=self.seed, tensor_parallel_size=self.tensor_parallel_size,
            tensor_parallel_backend=self.tensor_parallel_backend, backend=self.backend,
            mock=MockConfig(profile=self.mock_profile, time_scale=self.mock_time_scale, kv=self.mock_kv),
            cache=CacheConfig(block_size=self.block_size, num_blocks=self.num_blocks,
                              kv_cache_bytes=int(self.kv_cache_gb * 1024**3),
                              enable_prefix_caching=self.prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      policy=self.slot_policy, deadline_min_batch=self.deadline_min_batch),
            lora=LoRAConfig(max_loras=self.max_loras, max_cpu_loras=self.max_cpu_loras,
                            max_lora_rank=self.max_lora_rank, lora_dir=self.lora_dir,
                            modules=tuple(sorted(self.lora_modules.items()))))
