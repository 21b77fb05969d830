"""GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them, from a Hugging Face folder.

The importer's tests read these back: Q and K rows permuted as llama.cpp does for llama models,
1-D tensors (norms, biases) kept in F32 and matrices whose rows do not split into whole blocks
stored as F16, as llama.cpp falls back; the tokenizer's vocabulary, merges and control tokens as
`tokenizer.ggml.*` metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

HF_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
LAYER_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
}
GEMMA_TO_GGUF = {**LAYER_TO_GGUF, "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                 "post_attention_layernorm.weight": "post_attention_norm.weight",
                 "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
ARCHES = {"gemma3_text": "gemma3"}  # GGUF architecture of a model_type, where the names differ


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: rotary halves of each head interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{(GEMMA_TO_GGUF if arch == 'gemma3' else LAYER_TO_GGUF)[rest]}"


def write_gguf(model_dir: Path, path: Path, qtype: str = "F32", arch: str | None = None,
               raw_tensors: dict | None = None) -> Path:
    """A GGUF of the folder's weights in qtype (F32, F16, BF16 or a type gguf.quants quantizes);
    raw_tensors: GGUF name -> (uint8 blocks, GGMLQuantizationType) written instead of that weight."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = arch or ARCHES.get(cfg["model_type"], cfg["model_type"])
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, cfg)
    if (model_dir / "tokenizer.json").exists():
        _tokenizer(w, model_dir)
    else:  # a seeded model without a tokenizer: a placeholder vocabulary of its size
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(cfg["vocab_size"])])
    for name, array in load_file(str(model_dir / "model.safetensors")).items():
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + 1  # convert_hf_to_gguf.py stores Gemma's norms as 1 + weight
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, cfg["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, cfg["num_key_value_heads"])
        if gguf_name(name, arch) in (raw_tensors or {}):
            blocks, kind = raw_tensors[gguf_name(name, arch)]
            w.add_tensor(gguf_name(name, arch), blocks, raw_dtype=kind)
        else:
            _add(w, gguf_name(name, arch), array.astype(np.float32), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _metadata(w, cfg: dict) -> None:
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(cfg.get("rope_theta") or (rope.get("full_attention") or rope).get("rope_theta", 10000.0))
    w.add_vocab_size(cfg["vocab_size"])
    if "head_dim" in cfg:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if cfg.get("sliding_window") and cfg["model_type"] == "gemma3_text":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])


def _tokenizer(w, model_dir: Path) -> None:
    tk = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = sorted(tk["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tk["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tk["model"]["merges"]])
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    ids = dict(vocab)
    w.add_bos_token_id(ids[tc["bos_token"]])
    w.add_eos_token_id(ids[tc["eos_token"]])
    w.add_add_bos_token(True)
    w.add_chat_template(tc["chat_template"])


def _add(w, name: str, array: np.ndarray, qtype: str) -> None:
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    if array.ndim == 1 or qtype == "F32":
        w.add_tensor(name, array)
    elif qtype == "F16" or array.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
        w.add_tensor(name, array.astype(np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
