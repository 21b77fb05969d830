"""Load a Hugging Face model folder: config.json, safetensors weights, tokenizer.json, EOS ids.

Supported: model_type llama, mistral (no sliding window shorter than the context) and qwen2;
float32 and bfloat16, and GGUF's quantized blocks where import-gguf kept them (quantization "gguf":
services.engine.layers.quant). Anything else is a ModelLoadError naming the file and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.errors import ModelLoadError
from services.config.engine import ModelConfig
from services.engine.hf_config import eos_ids, parse_config, read_json  # noqa: F401 (read_json: API)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig  # the parsed architecture
    weights: dict  # Hugging Face tensor name -> tensor in the requested dtype, or QuantizedWeight
    eos_token_ids: tuple  # ids that end generation (generation_config.json, else config.json)
    bos_token_id: int | None  # from config.json


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
        from services.engine.layers.quant import load_quantized

        if dtype != "float32":
            raise ModelLoadError(f"quantized weights compute in float32, not {dtype}")
        quantized = load_quantized(model_dir)
    elif quantization != "none":
        raise ModelLoadError(f"unknown quantization {quantization!r} (supported: none, gguf)")
    weights = load_weights(model_dir, DTYPES[dtype], skip=quantized.keys())
    return LoadedModel(config=config, weights={**weights, **quantized},
                       eos_token_ids=eos_ids(model_dir, raw), bos_token_id=raw.get("bos_token_id"))
