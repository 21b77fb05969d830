"""The seeded default models: `meshserve model init DIR --preset tiny|bench|smollm2-shape`.

Writes a standard Hugging Face folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json) that transformers, vLLM and our loader read.
Weights are drawn from a seeded torch generator in a fixed order; the byte-level BPE tokenizer
is trained on a synthetic corpus generated from the same seed. Nothing is downloaded, and the
same seed gives the same bytes on any machine.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL = ["<|pad|>", "<s>", "</s>"]  # ids 0, 1, 2
BOS, EOS = 1, 2


@dataclass(frozen=True)
class Preset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int  # model vocabulary (the tokenizer uses the first tokenizer_vocab ids)
    max_positions: int
    tie_embeddings: bool
    init_std: float  # weights ~ N(0, std): large enough that greedy logits rarely tie
    tokenizer_vocab: int = 4096


PRESETS = {
    "tiny": Preset(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=172, vocab=8192, max_positions=2048,
                   tie_embeddings=False, init_std=0.08),
    "bench": Preset(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=688, vocab=32000, max_positions=4096,
                    tie_embeddings=False, init_std=0.02),
    # SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49,152, tied embeddings)
    # with random weights: engine speed on a real model's shape before the real model is here.
    "smollm2-shape": Preset(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152,
                            max_positions=8192, tie_embeddings=True, init_std=0.02),
}

_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "te", "vo", "zi", "an", "el", "or", "un", "is", "ta", "be",
              "co", "di", "fu", "ga", "he", "jo", "pe", "qu", "wi", "xe", "yo"]


def synthetic_corpus(seed: int, lines: int = 3000) -> list[str]:
    """Seeded pseudo-text: Zipf-ish words of syllables, punctuation, digits and some code-like lines."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(1500)]
    weights = [1.0 / (i + 1) for i in range(len(words))]
    out = []
    for i in range(lines):
        n = rng.randint(4, 24)
        sent = " ".join(rng.choices(words, weights, k=n))
        if i % 7 == 0:
            sent = f"def {rng.choice(words)}(x{rng.randint(0, 9)}): return {rng.randint(0, 999)}"
        out.append(sent.capitalize() + rng.choice([".", "!", "?", ",", ";"]))
    return out


def build_tokenizer(seed: int, vocab_size: int) -> Tokenizer:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", BOS)])
    return tk


def random_weights(p: Preset, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    head_dim = p.hidden // p.heads

    def normal(*shape):
        return torch.randn(*shape, generator=g) * p.init_std

    w = {"model.embed_tokens.weight": normal(p.vocab, p.hidden)}
    for i in range(p.layers):
        pre = f"model.layers.{i}."
        w[pre + "self_attn.q_proj.weight"] = normal(p.heads * head_dim, p.hidden)
        w[pre + "self_attn.k_proj.weight"] = normal(p.kv_heads * head_dim, p.hidden)
        w[pre + "self_attn.v_proj.weight"] = normal(p.kv_heads * head_dim, p.hidden)
        w[pre + "self_attn.o_proj.weight"] = normal(p.hidden, p.heads * head_dim)
        w[pre + "mlp.gate_proj.weight"] = normal(p.intermediate, p.hidden)
        w[pre + "mlp.up_proj.weight"] = normal(p.intermediate, p.hidden)
        w[pre + "mlp.down_proj.weight"] = normal(p.hidden, p.intermediate)
        w[pre + "input_layernorm.weight"] = torch.ones(p.hidden)
        w[pre + "post_attention_layernorm.weight"] = torch.ones(p.hidden)
    w["model.norm.weight"] = torch.ones(p.hidden)
    if not p.tie_embeddings:
        w["lm_head.weight"] = normal(p.vocab, p.hidden)
    return w


def hf_config(p: Preset) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": p.hidden,
        "num_hidden_layers": p.layers, "num_attention_heads": p.heads, "num_key_value_heads": p.kv_heads,
        "head_dim": p.hidden // p.heads, "intermediate_size": p.intermediate, "vocab_size": p.vocab,
        "max_position_embeddings": p.max_positions, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": p.tie_embeddings, "attention_bias": False,
        "mlp_bias": False, "bos_token_id": BOS, "eos_token_id": EOS, "torch_dtype": "float32",
        "initializer_range": p.init_std,
    }


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def write_model(model_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write the preset's folder (see module doc); returns its path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    p, out = PRESETS[preset], Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    _dump(out / "config.json", hf_config(p))
    _dump(out / "generation_config.json", {"bos_token_id": BOS, "eos_token_id": EOS})
    _dump(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<|pad|>", "model_max_length": p.max_positions, "chat_template": CHAT_TEMPLATE})
    build_tokenizer(seed, p.tokenizer_vocab).save(str(out / "tokenizer.json"))
    save_file(random_weights(p, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
