"""`meshserve model import-gguf`: GGUF files written as llama.cpp writes them come back as the model they
were made from (weights, tokenizer, chat template, EOS), and every bad file is one clear error that
leaves nothing behind."""

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from services.common.errors import ModelLoadError
from services.engine.tools.gguf_import import import_gguf
from tests.support.gguf_files import write_gguf
from tests.support.kernel_checks import K_SCALES
from tests.support.reference import assert_matches, greedy, hf_greedy, make_engine, random_prompts, run_all

STRINGS = ["Kalo mine tevo.", "  two  spaces\tand a tab\n\nnewlines", "def f(x1): return 42", "héllo wörld ✓ 🤖",
           "<s>inline special</s>", "", "1234567890", "mixed CASE and punctuation?!;"]


def weights(folder) -> dict:
    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def f32_import(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return import_gguf(write_gguf(tiny_model, root / "tiny.gguf", "F32"), root / "out", progress=False)


def test_f32_round_trip_gives_back_the_same_weights_and_greedy_tokens(tiny_model, f32_import):
    want, got = weights(tiny_model), weights(f32_import)
    assert set(got) == set(want)
    for name in want:  # Q and K rows were permuted as llama.cpp does: exact equality means it was undone
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    prompts = random_prompts(6, seed=3, hi=40, vocab=4096)
    refs = hf_greedy(tiny_model, prompts, 8)
    assert_matches(run_all(make_engine(f32_import), prompts, greedy(8)), refs)


def test_config_tokenizer_template_and_eos_come_from_the_metadata(tiny_model, f32_import):
    want = json.loads((tiny_model / "config.json").read_text())
    got = json.loads((f32_import / "config.json").read_text())
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                "rope_theta", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert got[key] == want[key], key
    ours, theirs = Tokenizer.from_file(str(f32_import / "tokenizer.json")), Tokenizer.from_file(
        str(tiny_model / "tokenizer.json"))
    for s in STRINGS:
        assert ours.encode(s).ids == theirs.encode(s).ids, s
        assert ours.decode(ours.encode(s).ids) == theirs.decode(theirs.encode(s).ids), s
    tc = json.loads((f32_import / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == json.loads((tiny_model / "tokenizer_config.json").read_text())["chat_template"]
    assert (tc["bos_token"], tc["eos_token"]) == ("<s>", "</s>")
    assert json.loads((f32_import / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.parametrize("qtype, tolerance", [("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 1e-2), ("Q4_0", 0.15),
                                              ("Q4_1", 0.1), ("Q5_0", 0.08), ("Q5_1", 0.05)])
def test_quantized_files_dequantize_to_the_original_within_their_precision(tiny_model, tmp_path, qtype, tolerance):
    out = import_gguf(write_gguf(tiny_model, tmp_path / "m.gguf", qtype), tmp_path / "out", progress=False)
    want, got = weights(tiny_model), weights(out)
    for name in want:
        err = np.abs(got[name] - want[name]).max() / np.abs(want[name]).max()
        assert err < tolerance, (name, err)


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    from services.engine.tools.model_init import write_model

    return write_model(tmp_path_factory.mktemp("bench") / "bench", "bench")  # hidden 256: whole K blocks


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quant_tensors_are_read_with_their_block_layout(tmp_path, bench_model, qtype):
    """gguf's numpy code cannot quantize K types; a tensor of random K blocks (finite scales) must import
    to exactly what gguf dequantizes, in the right shape, with the right name."""
    model = bench_model
    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = 688, 256  # layer 0's gate_proj
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    for at in K_SCALES[qtype]:  # the f16 scales of each block
        raw[:, at:at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    path = write_gguf(model, tmp_path / "m.gguf", "F32", raw_tensors={"blk.0.ffn_gate.weight": (raw, kind)})
    got = weights(import_gguf(path, tmp_path / "out", progress=False))["model.layers.0.mlp.gate_proj.weight"]
    np.testing.assert_array_equal(got, gguf.quants.dequantize(raw, kind).reshape(rows, cols))


def _unsupported_type(tmp_path, tiny_model):
    kind = gguf.GGMLQuantizationType.IQ4_NL
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = np.zeros((8192, 64 // block * size), dtype=np.uint8)
    return write_gguf(tiny_model, tmp_path / "bad.gguf", "F32", raw_tensors={"token_embd.weight": (raw, kind)})


def _truncated(tmp_path, tiny_model):
    data = write_gguf(tiny_model, tmp_path / "full.gguf", "Q8_0").read_bytes()
    (tmp_path / "bad.gguf").write_bytes(data[: len(data) // 2])
    return tmp_path / "bad.gguf"


def _not_gguf(tmp_path, tiny_model):
    (tmp_path / "bad.gguf").write_bytes(b"PK\x03\x04" + bytes(100))  # a zip, say
    return tmp_path / "bad.gguf"


BAD_FILES = {
    "truncated": (_truncated, "truncated"),
    "unknown architecture": (lambda t, m: write_gguf(m, t / "bad.gguf", "F32", arch="mamba"),
                             "unsupported architecture 'mamba'"),
    "unsupported type": (_unsupported_type, "token_embd.weight has unsupported type IQ4_NL"),
    "not a GGUF": (_not_gguf, "not a GGUF file"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_file_is_one_line_naming_it_and_nothing_is_written(tmp_path, tiny_model, case):
    make, says = BAD_FILES[case]
    path = make(tmp_path, tiny_model)
    out = subprocess.run([sys.executable, "-m", "services.cli", "model", "import-gguf", str(path),
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and says in lines[0], out.stderr
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left


def test_an_existing_folder_is_not_overwritten(tmp_path, tiny_model):
    path = write_gguf(tiny_model, tmp_path / "m.gguf", "F32")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ModelLoadError, match="already exists"):
        import_gguf(path, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_qwen2_biases_and_unpermuted_rows_round_trip(tiny_model, tmp_path):
    import shutil

    from tests.support.reference import save_hf_model

    model = save_hf_model(tmp_path / "qwen2", "qkv_bias")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # metadata only: the test model has no tokenizer
        shutil.copy(tiny_model / name, model / name)
    out = import_gguf(write_gguf(model, tmp_path / "q.gguf", "F32"), tmp_path / "out", progress=False)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    want, got = weights(model), weights(out)
    assert {n for n in got if n.endswith("bias")} == {n for n in want if n.endswith("bias")} != set()
    prompts = random_prompts(4, seed=5, hi=30)
    assert_matches(run_all(make_engine(out), prompts, greedy(8)), hf_greedy(model, prompts, 8))


def test_bfloat16_import_writes_bfloat16_weights(tiny_model, tmp_path):
    from safetensors import safe_open

    out = import_gguf(write_gguf(tiny_model, tmp_path / "m.gguf", "BF16"), tmp_path / "out", "bfloat16",
                      progress=False)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as st:
        assert {str(st.get_tensor(n).dtype) for n in st.keys()} == {"torch.bfloat16"}
    with pytest.raises(ModelLoadError, match="unsupported dtype 'float16'"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out16", "float16")


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_qwen3_and_gemma3_files_import_to_the_model_they_were_made_from(name, tmp_path):
    """Written as llama.cpp's converter writes them (Gemma's norms stored as 1 + weight, its pre-MLP norm named
    ffn_norm, per-head q/k norms): the folder has the original's config and weights and gives its greedy tokens. The
    scores' scale of a Gemma 3 file is head_dim ** -0.5 (llama.cpp's rule; the file does not carry it)."""
    from tests.support.reference import save_hf_model

    model = save_hf_model(tmp_path / name, name, **({"query_pre_attn_scalar": 64} if name == "gemma3" else {}))
    out = import_gguf(write_gguf(model, tmp_path / "m.gguf", "F32"), tmp_path / "out", progress=False)
    want_cfg, got_cfg = (json.loads((m / "config.json").read_text()) for m in (model, out))
    gemma = ("sliding_window", "layer_types", "query_pre_attn_scalar") if name == "gemma3" else ()
    for key in ("model_type", "head_dim", "num_key_value_heads", "tie_word_embeddings", *gemma):
        assert got_cfg[key] == want_cfg[key], key
    want, got = weights(model), weights(out)
    assert set(got) == set(want) and any("q_norm" in n for n in got)
    for n in want:  # exact but for Gemma's norms, which went through + 1 and - 1 in float32
        np.testing.assert_allclose(got[n], want[n], rtol=0, atol=1e-6 if "norm" in n else 0, err_msg=n)
    prompts = random_prompts(6, seed=5, lo=10, hi=60)
    assert_matches(run_all(make_engine(out), prompts, greedy(8)), hf_greedy(model, prompts, 8))


def sentencepiece_vocabulary() -> dict:
    """A GGUF tokenizer dict as Gemma files hold one: control tokens, the 256 byte tokens, pieces in merge order
    with scores that do not follow it, a whitespace token spelled with real spaces, no merges."""
    pieces = ["\u2581", "e", "t", "h", "l", "o", "\u2581t", "he", "\u2581the", "ll", "\u2581he", "llo", "\u2581hello",
              "w", "r", "d", "or", "\u2581w", "ld", "orld", "\u2581world", "a", "n", "an", "\u2581an", "\u2581a", "s",
              "\u2581s", "i", "in", "\u2581in", "g", "ing", "  ", "x", "y", "\u2581x"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens += [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3] * 6 + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (6 + 256) + [float((7 * i) % len(pieces)) for i in range(len(pieces))]
    return {"model": "llama", "tokens": tokens, "token_type": types, "scores": scores, "bos_token_id": 2,
            "eos_token_id": 1, "unknown_token_id": 3, "padding_token_id": 0, "add_bos_token": True,
            "add_space_prefix": False}


def test_a_gemma_sentencepiece_vocabulary_tokenizes_as_transformers_builds_it():
    """The outside reference: transformers' own GGUF tokenizer builder over the same metadata."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    from services.engine.tools.gguf_import import sentencepiece_json

    tk = sentencepiece_vocabulary()
    ours = sentencepiece_json(tk, "gemma3")
    theirs, _ = convert_gguf_tokenizer("gemma3", {
        "tokenizer_type": "llama", "tokens": tk["tokens"], "scores": tk["scores"], "token_type": tk["token_type"],
        "bos_token_id": 2, "eos_token_id": 1, "unk_token_id": 3, "pad_token_id": 0, "add_prefix_space": False})
    texts = ["hello world", "the hello  in the world", " leading space", "two  spaces and a tab\there",
             "bytes: é ✓ 🤖 ZZZ", "<start_of_turn>user\nhello<end_of_turn>", "singing in the rain", "", "x y xy"]
    for text in texts:
        want = theirs.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False).ids == want, text
        assert ours.decode(want, skip_special_tokens=False) == theirs.decode(want, skip_special_tokens=False), text
    assert ours.encode("hello").ids[0] == 2  # BOS added, as the file says
