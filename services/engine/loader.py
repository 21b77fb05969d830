"""Load a Hugging Face model folder: config.json, safetensors weights, tokenizer.json, EOS ids.

Supported: model_type llama, mistral (no sliding window shorter than the context) and qwen2;
float32 and bfloat16, and GGUF's quantized blocks where import-gguf kept them (quantization "gguf":
services.engine.quant). Anything else is a ModelLoadError naming the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.errors import ModelLoadError
from services.engine.config import ModelConfig, RopeConfig

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig  # the parsed architecture
    weights: dict  # Hugging Face tensor name -> tensor in the requested dtype, or QuantizedWeight
    eos_token_ids: tuple  # ids that end generation (generation_config.json, else config.json)
    bos_token_id: int | None  # from config.json


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None


def _field(cfg: dict, name: str, path: Path, default=...):
    if name in cfg and cfg[name] is not None:
        return cfg[name]
    if default is ...:
        raise ModelLoadError(f"{path}: missing field {name!r}")
    return default


def _rope(cfg: dict, path: Path) -> RopeConfig:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "llama3":
        raise ModelLoadError(f"{path}: unsupported rope_type {kind!r} (supported: default, llama3)")
    return RopeConfig(theta=theta, kind="llama3", factor=float(params["factor"]),
                      low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                      high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                      original_max_positions=int(params["original_max_position_embeddings"]))


def parse_config(cfg: dict, path: Path) -> ModelConfig:
    """ModelConfig from a config.json dict; errors name the field."""
    mtype = _field(cfg, "model_type", path)
    if mtype not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{path}: unsupported model_type {mtype!r} (supported: {', '.join(SUPPORTED_TYPES)})")
    if _field(cfg, "hidden_act", path, "silu") != "silu":
        raise ModelLoadError(f"{path}: unsupported hidden_act {cfg['hidden_act']!r} (supported: silu)")
    max_pos = int(_field(cfg, "max_position_embeddings", path))
    window = cfg.get("sliding_window")
    if window is not None and cfg.get("use_sliding_window", mtype == "mistral") and window < max_pos:
        raise ModelLoadError(f"{path}: sliding_window={window} below max_position_embeddings is not supported")
    hidden, heads = int(_field(cfg, "hidden_size", path)), int(_field(cfg, "num_attention_heads", path))
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        vocab_size=int(_field(cfg, "vocab_size", path)), hidden_size=hidden,
        num_layers=int(_field(cfg, "num_hidden_layers", path)), num_heads=heads,
        num_kv_heads=int(_field(cfg, "num_key_value_heads", path, heads)),
        head_dim=int(_field(cfg, "head_dim", path, hidden // heads)),
        intermediate_size=int(_field(cfg, "intermediate_size", path)), max_positions=max_pos,
        rms_norm_eps=float(_field(cfg, "rms_norm_eps", path, 1e-6)), rope=_rope(cfg, path),
        qkv_bias=mtype == "qwen2" or attention_bias, o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), model_type=mtype)


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a folder: one model.safetensors or the shards its index names."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        if not shards:
            raise ModelLoadError(f"{index}: field 'weight_map' is missing or empty")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise ModelLoadError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    return [single]


def load_weights(model_dir: Path, dtype: torch.dtype, skip=frozenset()) -> dict:
    """The folder's tensors in dtype, but for the names in skip."""
    weights = {}
    for f in weight_files(model_dir):
        if not f.exists():
            raise ModelLoadError(f"{f}: weight shard not found")
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name not in skip:
                    weights[name] = st.get_tensor(name).to(dtype)
    return weights


def eos_ids(model_dir: Path, cfg: dict) -> tuple:
    gen = model_dir / "generation_config.json"
    value = read_json(gen).get("eos_token_id") if gen.exists() else None
    if value is None:
        value = cfg.get("eos_token_id")
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def load_model(model_dir: str | Path, dtype: str = "float32", quantization: str = "none") -> LoadedModel:
    """Read a model folder into plain tensors, or with quantization "gguf" its quantized weights as QuantizedWeight
    (see module doc for what is supported)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model folder not found")
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    path = model_dir / "config.json"
    raw = read_json(path)
    config = parse_config(raw, path)
    quantized = {}
    if quantization == "gguf":
        from services.engine.quant import load_quantized

        if dtype != "float32":
            raise ModelLoadError(f"quantized weights compute in float32, not {dtype}")
        quantized = load_quantized(model_dir)
    elif quantization != "none":
        raise ModelLoadError(f"unknown quantization {quantization!r} (supported: none, gguf)")
    weights = load_weights(model_dir, DTYPES[dtype], skip=quantized.keys())
    return LoadedModel(config=config, weights={**weights, **quantized},
                       eos_token_ids=eos_ids(model_dir, raw), bos_token_id=raw.get("bos_token_id"))
