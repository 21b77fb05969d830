"""A Hugging Face model folder's config.json and generation_config.json, read into a ModelConfig and EOS ids
(no torch: the mock engine reads a model's shape from here without loading it).

Supported: model_type llama, mistral (no sliding window shorter than the context) and qwen2. Anything else is a
ModelLoadError naming the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

from services.common.errors import ModelLoadError
from services.config.engine import ModelConfig, RopeConfig

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


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


def eos_ids(model_dir: Path, cfg: dict) -> tuple:
    gen = model_dir / "generation_config.json"
    value = read_json(gen).get("eos_token_id") if gen.exists() else None
    if value is None:
        value = cfg.get("eos_token_id")
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)
