"""The model architectures the engine runs, built from services/engine/layers/: llama.py (Llama, Mistral, Qwen2 and
Qwen3: RMSNorm, rotary attention with grouped KV heads, SwiGLU; tied or untied embeddings, QKV biases, per-head
query/key norms) and gemma3.py (Gemma 3's text model: four norms a layer, GELU gates, sliding-window layers).
build_model picks the class by the config's model_type."""

from __future__ import annotations

from services.config.engine import ModelConfig


def build_model(config: ModelConfig, weights: dict):
    """The model of config.model_type over weights (Hugging Face names; a tensor-parallel rank's shard)."""
    if config.model_type == "gemma3_text":
        from services.engine.models.gemma3 import Gemma3Model

        return Gemma3Model(config, weights)
    from services.engine.models.llama import LlamaModel

    return LlamaModel(config, weights)
