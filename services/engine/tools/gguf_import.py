"""`meshserve model import-gguf FILE OUT_DIR`: a GGUF file as a Hugging Face model folder.

Reads the file with the `gguf` package (llama.cpp's own reader), dequantizes every tensor with
`gguf.quants.dequantize`, undoes the row permutation llama.cpp's converter applies to the Q and K
projections of llama models (it interleaves the two rotary halves of each head; qwen2, qwen3 and gemma3 files are
not permuted), subtracts the 1 llama.cpp's converter adds to Gemma's norm weights, and writes what our loader,
transformers and vLLM read: `config.json`, `model.safetensors`, `tokenizer.json` (rebuilt with the `tokenizers`
library: a byte-level BPE from the file's vocabulary and merges, or a SentencePiece BPE with byte fallback from its
vocabulary, merges recovered from the tokens' order or scores as transformers does; control tokens become special
tokens), `tokenizer_config.json`
(chat template, special tokens) and `generation_config.json` (EOS). The blocks of the weights whose type the
engine runs quantized (services.engine.layers.quant: Q4_0, Q4_1, Q8_0) are also written as they are, in
`quantized.st`, for `engine.quantization: gguf`.

Supported: architectures llama, qwen2, qwen3 and gemma3 (its text model); tensor types in QUANT_TYPES; tokenizer
models gpt2 (byte-level BPE) and llama (SentencePiece BPE). Anything else is a ModelLoadError naming the file and
what is wrong, raised before anything is written; the folder is built under a temporary name beside OUT_DIR and renamed
into place at the end, so OUT_DIR is either complete or absent.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from services.common.errors import ModelLoadError
from services.engine.layers.quant import KINDS as QUANT_KINDS
from services.engine.layers.quant import QUANTIZED_FILE

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM"}
MODEL_TYPES = {"gemma3": "gemma3_text"}  # config.json's model_type where it is not the GGUF architecture's name
TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE, SentencePiece BPE
# Every type gguf.quants dequantizes that quantized llama/qwen2 files commonly use.
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
               "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# llama.cpp tensor names (per block: blk.N.<name>) -> Hugging Face names.
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
}
GEMMA_BLOCK_NAMES = {**BLOCK_NAMES, "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                     "post_attention_norm.weight": "post_attention_layernorm.weight",
                     "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
GEMMA_SWA_PATTERN = 6  # Gemma 3: five sliding-window layers, then a global one (llama.cpp and transformers alike)
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4  # llama.cpp's token_type values

# Pre-tokenizer splits for the `tokenizer.ggml.pre` values whose merges were learned on a split other
# than GPT-2's (the default, which `smollm` and `gpt2` files use), as transformers maps them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
              "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


@dataclass(frozen=True)
class GGUFModel:
    """What one GGUF file holds, validated: everything the folder is written from."""
    path: Path
    arch: str  # general.architecture: one of ARCHITECTURES
    config: dict  # config.json
    tensors: list  # gguf ReaderTensor, in file order
    tokenizer: dict  # tokenizer.ggml.* fields and tokenizer.chat_template, by short name


def import_gguf(path: str | Path, out_dir: str | Path, dtype: str = "float32", progress: bool = True) -> Path:
    """Write the Hugging Face folder for the GGUF file at path to out_dir (see the module doc)."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ModelLoadError(f"{out_dir}: already exists and is not an empty folder")
    model = read_gguf(path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        _write_folder(model, staging, dtype, progress)
        _readable(staging)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _readable(folder: Path) -> None:
    """The mode a plain mkdir and open would have given (mkdtemp makes the folder private)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def read_gguf(path: str | Path) -> GGUFModel:
    """Open and validate a GGUF file: architecture, tensor types and extents, tokenizer."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct or numpy errors past the end of the data
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file (the reader stopped: {e})") from None
    fields = {name: _value(field) for name, field in reader.fields.items()}
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    _check_tensors(path, arch, reader.tensors)
    tokenizer = {k.removeprefix("tokenizer.ggml.").removeprefix("tokenizer."): v
                 for k, v in fields.items() if k.startswith("tokenizer.")}
    if tokenizer.get("model") not in TOKENIZER_MODELS:
        raise ModelLoadError(f"{path}: unsupported tokenizer model {tokenizer.get('model')!r} "
                             "(supported: gpt2, byte-level BPE; llama, SentencePiece BPE)")
    names = {t.name for t in reader.tensors}
    return GGUFModel(path, arch, _config(path, arch, fields, names), list(reader.tensors), tokenizer)


def _value(field):
    try:
        return field.contents()
    except Exception:  # a field of an unusual type: left out, never needed by what we read
        return None


def _check_tensors(path: Path, arch: str, tensors) -> None:
    size = path.stat().st_size
    for t in tensors:
        kind = t.tensor_type.name
        if kind not in QUANT_TYPES:
            raise ModelLoadError(f"{path}: tensor {t.name} has unsupported type {kind} "
                                 f"(supported: {', '.join(QUANT_TYPES)})")
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelLoadError(f"{path}: truncated: tensor {t.name} ends at byte {end:,} but the file has {size:,}")
        if _hf_name(t.name, arch) is None and t.name != "rope_freqs.weight":
            raise ModelLoadError(f"{path}: unexpected tensor {t.name} for this architecture")
    if "rope_freqs.weight" in {t.name for t in tensors}:
        raise ModelLoadError(f"{path}: llama3-style rope scaling (rope_freqs.weight) is not supported")


def _hf_name(name: str, arch: str) -> str | None:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts, names = name.split(".", 2), GEMMA_BLOCK_NAMES if arch == "gemma3" else BLOCK_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


def _config(path: Path, arch: str, fields: dict, tensor_names: set) -> dict:
    def need(key):
        value = fields.get(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: missing metadata {arch}.{key}")
        return value

    scaling = fields.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise ModelLoadError(f"{path}: unsupported rope scaling {scaling!r} (supported: none, linear)")
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tokens = fields.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{path}: missing metadata tokenizer.ggml.tokens")
    cfg = {
        "architectures": [ARCHITECTURES[arch]], "model_type": MODEL_TYPES.get(arch, arch),
        "vocab_size": int(fields.get(f"{arch}.vocab_size") or len(tokens)),
        "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(fields.get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": int(fields.get(f"{arch}.attention.key_length") or hidden // heads),
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(fields.get(f"{arch}.rope.freq_base") or 10000.0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
    }
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": _f32(need("rope.scaling.factor"))}
    if arch == "gemma3":
        layers = cfg["num_hidden_layers"]
        # llama.cpp's rule: the scores' scale is head_dim ** -0.5, but hidden / heads on the 27B model (62 layers)
        scalar = hidden // heads if layers == 62 else cfg["head_dim"]
        # which layers slide: the file's sliding_window_pattern (a period, or one flag per layer) where it has one
        pattern = fields.get(f"{arch}.attention.sliding_window_pattern") or GEMMA_SWA_PATTERN
        sliding = ([bool(x) for x in pattern] if isinstance(pattern, list) else
                   [bool((i + 1) % int(pattern)) for i in range(layers)])
        if len(sliding) != layers:
            raise ModelLoadError(f"{path}: {arch}.attention.sliding_window_pattern names {len(sliding)} layers, "
                                 f"not {layers}")
        cfg.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
                   sliding_window=int(need("attention.sliding_window")), rope_local_base_freq=10000.0,
                   layer_types=["sliding_attention" if s else "full_attention" for s in sliding])
    elif arch == "llama":
        cfg.update(hidden_act="silu", attention_bias=False, mlp_bias=False)
    else:
        cfg.update(hidden_act="silu", use_sliding_window=False, attention_bias=False)
    return cfg


def _f32(value) -> float:
    """A float32 metadata value as the shortest decimal that reads back to it (9.99999974e-06 -> 1e-05)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


# ---- writing ---------------------------------------------------------------------------------

def _write_folder(model: GGUFModel, out: Path, dtype: str, progress: bool) -> None:
    cfg = dict(model.config, torch_dtype=dtype)
    weights, blocks = _weights(model, DTYPES[dtype], progress)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    if blocks:
        save_file({name: b for name, (b, _) in blocks.items()}, str(out / QUANTIZED_FILE),
                  metadata={name: meta for name, (_, meta) in blocks.items()})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tk = model.tokenizer
    (tokenizer_json(tk) if tk["model"] == "gpt2" else sentencepiece_json(tk, model.arch)).save(
        str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tk, cfg), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(tk, cfg), indent=2) + "\n")


def _weights(model: GGUFModel, dtype: torch.dtype, progress: bool) -> tuple[dict, dict]:
    """({name: dequantized tensor}, {name: (uint8 blocks, "TYPE:IN_FEATURES")} for the types kept quantized)."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    out, blocks = {}, {}
    for t in tqdm(model.tensors, desc=f"dequantizing {model.path.name}", unit="tensor", disable=not progress):
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        array = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)  # a writable copy
        if model.arch == "gemma3" and t.name.endswith("norm.weight"):
            array -= 1  # llama.cpp's converter stores Gemma's norms as 1 + weight
        name = _hf_name(t.name, model.arch)
        out[name] = torch.from_numpy(np.ascontiguousarray(_unpermuted(model, t.name, array))).to(dtype)
        if t.tensor_type.name in QUANT_KINDS and len(shape) == 2:
            rows = np.array(t.data, dtype=np.uint8).reshape(shape[0], -1)
            blocks[name] = (torch.from_numpy(np.ascontiguousarray(_unpermuted(model, t.name, rows))),
                                        f"{t.tensor_type.name}:{shape[1]}")
    return out, blocks


def _unpermuted(model: GGUFModel, name: str, rows: np.ndarray) -> np.ndarray:
    """The tensor's rows in Hugging Face's order (rows: weights, or a quantized tensor's rows of blocks)."""
    if model.arch == "llama" and name.endswith("attn_q.weight"):
        return unpermute(rows, model.config["num_attention_heads"])
    if model.arch == "llama" and name.endswith("attn_k.weight"):
        return unpermute(rows, model.config["num_key_value_heads"])
    return rows


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permute: per head, rows (half, pair) -> (pair, half)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_json(tk: dict):
    """A `tokenizers` byte-level BPE from the file's vocabulary, merges, pre-tokenizer and token types."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens, types = list(tk["tokens"]), list(tk.get("token_type") or [])
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token if set(token) <= alphabet else _respell(token), i)
    merges = [tuple(m.split(" ", 1)) for m in tk.get("merges") or ()]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    split = PRE_SPLITS.get(tk.get("pre"))
    tokenizer.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True) if split is None else
                               pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                        pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                 use_regex=False)]))
    tokenizer.decoder = decoders.ByteLevel()
    bos = tk.get("bos_token_id")
    if tk.get("add_bos_token") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [t for t, kind in zip(tokens, types) if kind == TOKEN_CONTROL and set(t) <= alphabet]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    user = [t for t, kind in zip(tokens, types) if kind == TOKEN_USER_DEFINED and t in vocab]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tokenizer


def sentencepiece_json(tk: dict, arch: str):
    """A `tokenizers` SentencePiece BPE (byte fallback, spaces as U+2581) from the file's vocabulary, as
    transformers builds it from the same file. The file lists no merges: they are recovered from the vocabulary,
    each token cut into pairs of tokens, best first by the token's score, or for Gemma by its place in the file (its
    scores do not follow its merge order); Gemma files spell whitespace-only tokens with real spaces, respelled
    here as the U+2581 the normalizer writes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    tokens, types = list(tk["tokens"]), list(tk.get("token_type") or [])
    if arch == "gemma3":
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        rank = {t: -i for i, t in enumerate(tokens)}
    else:
        rank = dict(zip(tokens, tk.get("scores") or [-i for i in range(len(tokens))]))
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    unk = tk.get("unknown_token_id")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_recovered_merges(vocab, rank), byte_fallback=True,
                                     fuse_unk=True, unk_token=tokens[unk] if unk is not None else None))
    prefix = bool(tk.get("add_space_prefix"))
    tokenizer.normalizer = normalizers.Sequence([*([normalizers.Prepend("\u2581")] if prefix else []),
                                                 normalizers.Replace(" ", "\u2581")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    bos = tk.get("bos_token_id")
    if tk.get("add_bos_token", True) and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == TOKEN_CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == TOKEN_USER_DEFINED])
    return tokenizer


def _recovered_merges(vocab: dict, rank: dict) -> list[tuple]:
    """Every (left, right) pair of vocabulary tokens that spells another token, best first by that token's rank
    (ties: the shorter left piece first), as transformers' generate_merges orders them."""
    merges = []
    for token, score in rank.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        merges += [(left, right, score) for left, right in sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _respell(token: str) -> str:
    from tokenizers import pre_tokenizers

    return "".join(s for s, _ in pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
                   .pre_tokenize_str(token))


def tokenizer_config(tk: dict, cfg: dict) -> dict:
    tokens = tk["tokens"]

    def name(key):
        i = tk.get(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    default_bos = tk.get("model") == "llama"  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say
    out = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": bool(tk.get("add_bos_token", default_bos)),
           "add_eos_token": bool(tk.get("add_eos_token")), "bos_token": name("bos_token_id"),
           "eos_token": name("eos_token_id"), "unk_token": name("unknown_token_id"),
           "pad_token": name("padding_token_id"), "model_max_length": cfg["max_position_embeddings"],
           "clean_up_tokenization_spaces": False}
    if tk.get("chat_template"):
        out["chat_template"] = tk["chat_template"]
    return {k: v for k, v in out.items() if v is not None}


def generation_config(tk: dict, cfg: dict) -> dict:
    """EOS: the file's eos token, and its end-of-turn token when it names another."""
    tokens = tk["tokens"]
    turn = tokens.index("<end_of_turn>") if "<end_of_turn>" in tokens else None  # Gemma's, as llama.cpp ends on it
    eos = [i for i in (tk.get("eos_token_id"), tk.get("eot_token_id"), turn) if i is not None]
    eos = list(dict.fromkeys(eos))
    out = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": eos[0] if len(eos) == 1 else eos,
           "pad_token_id": tk.get("padding_token_id")}
    return {k: v for k, v in out.items() if v not in (None, [])}
