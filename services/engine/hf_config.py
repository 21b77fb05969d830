"""A Hugging Face model folder's config.json and generation_config.json, read into a ModelConfig and EOS ids
(no torch: the mock engine reads a model's shape from here without loading it).

Supported: model_type llama, mistral (no sliding window shorter than the context), qwen2, qwen3 and gemma3_text
(Gemma 3's text model: sliding-window and global layers, each with its own rotary). Anything else is a ModelLoadError
naming the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

from services.common.errors import ModelLoadError
from services.config.engine import ModelConfig, RopeConfig

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
ACTIVATIONS = {"llama": "silu", "mistral": "silu", "qwen2": "silu", "qwen3": "silu", "gemma3_text": "gelu_pytorch_tanh"}
GEMMA_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # transformers' Gemma 3 defaults


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


def _rope(cfg: dict, path: Path, params: dict | None = None, theta: float = 10000.0) -> RopeConfig:
    params = params if params is not None else cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", theta)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(params["factor"]))
    if kind != "llama3":
        raise ModelLoadError(f"{path}: unsupported rope_type {kind!r} (supported: default, linear, llama3)")
    return RopeConfig(theta=theta, kind="llama3", factor=float(params["factor"]),
                      low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                      high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                      original_max_positions=int(params["original_max_position_embeddings"]))


def parse_config(cfg: dict, path: Path) -> ModelConfig:
    """ModelConfig from a config.json dict; errors name the field."""
    mtype = _field(cfg, "model_type", path)
    if mtype not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{path}: unsupported model_type {mtype!r} (supported: {', '.join(SUPPORTED_TYPES)})")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or ACTIVATIONS[mtype]
    if act != ACTIVATIONS[mtype]:
        raise ModelLoadError(f"{path}: unsupported hidden_act {act!r} for {mtype} (supported: {ACTIVATIONS[mtype]})")
    max_pos = int(_field(cfg, "max_position_embeddings", path))
    window = cfg.get("sliding_window")
    if (mtype != "gemma3_text" and window is not None and cfg.get("use_sliding_window", mtype == "mistral")
            and window < max_pos):
        raise ModelLoadError(f"{path}: sliding_window={window} below max_position_embeddings is not supported "
                             f"for {mtype} (it is for gemma3_text)")
    hidden, heads = int(_field(cfg, "hidden_size", path)), int(_field(cfg, "num_attention_heads", path))
    attention_bias = bool(cfg.get("attention_bias", False))
    arch = (_gemma3(cfg, path, hidden) if mtype == "gemma3_text" else
            {"qk_norm": mtype == "qwen3", "rope": _rope(cfg, path)})
    return ModelConfig(
        **arch, vocab_size=int(_field(cfg, "vocab_size", path)), hidden_size=hidden,
        num_layers=int(_field(cfg, "num_hidden_layers", path)), num_heads=heads,
        num_kv_heads=int(_field(cfg, "num_key_value_heads", path, heads)),
        head_dim=int(_field(cfg, "head_dim", path, hidden // heads)),
        intermediate_size=int(_field(cfg, "intermediate_size", path)), max_positions=max_pos,
        rms_norm_eps=float(_field(cfg, "rms_norm_eps", path, 1e-6)),
        qkv_bias=mtype == "qwen2" or attention_bias, o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", mtype == "gemma3_text")), model_type=mtype,
        hidden_act=act)


def _gemma3(cfg: dict, path: Path, hidden: int) -> dict:
    """Gemma 3's own fields: its layer types (sliding or full), a rotary per type, the scores' and embeddings'
    scales. Logit soft-capping (Gemma 2) is refused."""
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(cap) is not None:
            raise ModelLoadError(f"{path}: {cap}={cfg[cap]} is not supported")
    layers = int(_field(cfg, "num_hidden_layers", path))
    pattern = int(cfg.get("sliding_window_pattern", 6))
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(layers)]
    if len(types) != layers or set(types) - set(GEMMA_THETA):
        raise ModelLoadError(f"{path}: layer_types must name {layers} layers, each one of {', '.join(GEMMA_THETA)}")
    window = int(_field(cfg, "sliding_window", path, 4096))
    params = cfg.get("rope_parameters") or {}
    per_type = params if set(params) <= set(GEMMA_THETA) and params else {}
    full = per_type.get("full_attention") or {**(cfg.get("rope_scaling") or {}),
                                              "rope_theta": cfg.get("rope_theta", GEMMA_THETA["full_attention"])}
    local = per_type.get("sliding_attention") or {
        "rope_theta": cfg.get("rope_local_base_freq", GEMMA_THETA["sliding_attention"])}
    return {"qk_norm": True, "rope": _rope(cfg, path, full), "local_rope": _rope(cfg, path, local),
            "attn_scale": float(_field(cfg, "query_pre_attn_scalar", path, 256)) ** -0.5,
            "embed_scale": hidden ** 0.5,
            "layer_windows": tuple(window if t == "sliding_attention" else 0 for t in types)}


def eos_ids(model_dir: Path, cfg: dict) -> tuple:
    gen = model_dir / "generation_config.json"
    value = read_json(gen).get("eos_token_id") if gen.exists() else None
    if value is None:
        value = cfg.get("eos_token_id")
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)
