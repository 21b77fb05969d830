"""The default models: same seed, same bytes; standard folders that transformers loads."""

import hashlib
import json
import subprocess
import sys

import pytest
import torch

from services.engine.tools.model_init import write_model


def digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("preset", ["tiny", "bench"])
def test_same_seed_gives_same_bytes_in_another_process(tmp_path, preset):
    a = write_model(tmp_path / "a", preset)
    code = f"from services.engine.tools.model_init import write_model; write_model({str(tmp_path / 'b')!r}, {preset!r})"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert digests(a) == digests(tmp_path / "b")
    assert set(digests(a)) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                               "tokenizer_config.json"}


def test_other_seed_gives_other_weights(tmp_path):
    a, b = write_model(tmp_path / "a", "tiny", seed=0), write_model(tmp_path / "b", "tiny", seed=1)
    assert digests(a)["model.safetensors"] != digests(b)["model.safetensors"]


def test_bench_preset_has_the_measured_shape(tmp_path):
    cfg = json.loads((write_model(tmp_path / "m", "bench") / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["vocab_size"], cfg["max_position_embeddings"]) == (
               256, 4, 4, 2, 688, 32000, 4096)


def test_transformers_loads_model_and_tokenizer(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok("Kalo mine rusa.").input_ids
    assert ids[0] == 1 and len(ids) > 2
    assert tok.decode(ids, skip_special_tokens=True) == "Kalo mine rusa."
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    assert 0.8e6 < n < 1.5e6, n
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("assistant\n")


def test_smollm2_shape_preset_matches_smollm2_135m():
    from services.engine.tools.model_init import PRESETS, hf_config

    c = hf_config(PRESETS["smollm2-shape"])
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
            c["head_dim"], c["intermediate_size"], c["vocab_size"], c["tie_word_embeddings"]) == (
        30, 576, 9, 3, 64, 1536, 49152, True)
