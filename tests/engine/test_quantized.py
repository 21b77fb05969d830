"""Quantized weights kept quantized (services.engine.layers.quant, csrc/quant_linear.cpp): the kernel against gguf's own
dequantize, and the engine on GGUF files written with Q8_0 and Q4_1 against transformers running the same
dequantized weights in float32."""

import gguf
import numpy as np
import pytest
import torch

from services.common.errors import ModelLoadError
from services.engine.layers import quant
from services.engine.layers.kernels import quant_linear
from services.engine.layers.quant import KINDS, QuantizedWeight
from services.engine.tools.gguf_import import import_gguf
from tests.support.gguf_files import write_gguf
from tests.support.kernel_checks import blocks_of, reference, width_for
from tests.support.reference import agreement, assert_matches, greedy, hf_greedy, make_engine, random_prompts, run_all

pytestmark = pytest.mark.skipif(quant_linear() is None, reason="the quant_linear kernel did not build")


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("n, k", [(1, 32), (17, 96), (40, 576)])
def test_the_kernel_computes_what_gguf_dequantizes_at_every_batch_size(kind, n, k):
    """Q4_0, Q4_1, Q8_0 as the file holds them; Q5_0 and the K-quants repacked (quant.KINDS): every weight is gguf's
    dequantized float (the K-quants' exactly), every product its sum (widths rounded up to a K-quant's 256)."""
    k = width_for(kind, k)
    rng = np.random.default_rng(n + k)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1))).astype(np.float32)
    blocks = blocks_of(w, kind)
    want_w = reference(blocks, kind, k)
    q = QuantizedWeight.from_blocks(torch.from_numpy(blocks), kind, k)
    torch.testing.assert_close(q.dequantize(), want_w, rtol=1e-6, atol=1e-7)  # w = d * q + m rounded once, not twice
    if quant.KINDS[kind] != kind:  # repacked: gguf's d * q (exact) + m rounds once too, so the very same floats
        assert torch.equal(q.dequantize(), want_w)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    for m in (1, 2, 5, 8, 9, 15, 64, 67):  # one row, small batches, every tile remainder, whole tiles, two panels
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        want = (x.double() @ want_w.double().T + bias.double()).float()
        torch.testing.assert_close(q(x, bias), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    ids = torch.tensor([[n - 1, 0], [0, n // 2]])
    torch.testing.assert_close(q.rows(ids), want_w[ids])
    assert q(torch.zeros(0, k)).shape == (0, n)  # a step whose prompt chunks need no logits


def test_rows_of_the_wrong_width_are_refused():
    blocks = torch.from_numpy(blocks_of(np.ones((4, 64), np.float32), "Q4_1"))
    with pytest.raises(ModelLoadError, match="rows of 96 weights"):
        QuantizedWeight.from_blocks(blocks, "Q4_1", 96)
    with pytest.raises(ModelLoadError, match="not kept quantized"):
        QuantizedWeight.from_blocks(blocks, "Q2_K", 64)
    with pytest.raises(ModelLoadError, match="rows of 64 weights"):  # a K-quant's rows are whole 256-weight blocks
        QuantizedWeight.from_blocks(blocks, "Q4_K", 64)
    q = QuantizedWeight.from_blocks(blocks, "Q4_1", 64)
    with pytest.raises(RuntimeError, match="float32"):
        q(torch.ones(2, 64, dtype=torch.bfloat16))


@pytest.fixture(scope="module", params=["Q8_0", "Q4_1"])
def quantized_import(request, tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    path = write_gguf(tiny_model, root / "tiny.gguf", request.param)
    return request.param, path, import_gguf(path, root / "out", progress=False)


def test_the_engine_on_quantized_weights_gives_transformers_greedy_tokens(quantized_import):
    """transformers reads the folder's float32 weights, which are gguf's dequantization of the very blocks the
    engine computes with: every difference must be at a float32 near-tie."""
    kind, _, folder = quantized_import
    engine = make_engine(folder, quantization="gguf")
    assert engine.weights_form == "gguf" and kind in engine.describe_weights()
    prompts = random_prompts(8, seed=5, hi=60, vocab=8192)
    refs = hf_greedy(folder, prompts, 16)
    outputs = run_all(engine, prompts, greedy(16))
    ties = assert_matches(outputs, refs)
    assert agreement(outputs, refs) >= 0.6, f"near-ties everywhere: {ties}"


def test_the_quantized_model_weighs_what_the_gguf_file_holds(quantized_import):
    kind, path, folder = quantized_import
    engine = make_engine(folder, quantization="gguf")
    weights = engine.model.weights()
    held = {w.kind: 0 for w in weights if isinstance(w, QuantizedWeight)}
    for w in weights:
        if isinstance(w, QuantizedWeight):
            held[w.kind] += w.data_bytes
            assert w.nbytes - w.data_bytes < 16 * w.data_bytes / w.out_features  # padding: under a group of rows
    assert [p.name for p in folder.glob("*.safetensors")] == ["model.safetensors"]  # vLLM loads every one there
    in_file = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if t.tensor_type.name == kind)
    assert set(held) == {kind} and held[kind] == in_file  # every block of the file, once, nothing dequantized
    f32 = make_engine(folder, quantization="none")
    assert all(not isinstance(w, QuantizedWeight) for w in f32.model.weights())


def test_auto_takes_the_quantized_weights_only_where_they_can_run(quantized_import, tiny_model):
    _, _, folder = quantized_import
    assert quant.resolve("auto", folder, "float32") == "gguf"
    assert quant.resolve("auto", folder, "bfloat16") == "none"
    assert quant.resolve("auto", tiny_model, "float32") == "none"
    assert quant.resolve("none", folder, "float32") == "none"
    with pytest.raises(ModelLoadError, match="no quantized weights"):
        quant.resolve("gguf", tiny_model, "float32")
    with pytest.raises(ModelLoadError, match="float32, not bfloat16"):
        quant.resolve("gguf", folder, "bfloat16")
    with pytest.raises(ModelLoadError, match="unknown quantization"):
        quant.resolve("int3", folder, "float32")
