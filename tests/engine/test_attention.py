"""The compiled paged decode kernel and the PyTorch attention path agree, on random pools and tables."""

import os

import pytest
import torch

from services.engine.layers.attention import SeqLayout, TorchAttention
from services.engine.layers.kernels import paged_attention
from tests.support.kernel_checks import (
    PROMPT_STEP,
    SHAPES,
    check_kernel_against_pytorch,
    check_prompt_kernel,
    fused_qkv,
    prompt_case,
    prompt_kernel,
    random_case,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kv_heads,heads,d", SHAPES)
def test_kernel_matches_pytorch_attention(kv_heads, heads, d, dtype):
    kernel = paged_attention()
    if os.environ.get("MESHSERVE_KERNELS") == "0":
        pytest.skip("kernels disabled by MESHSERVE_KERNELS=0")
    assert kernel is not None, "the paged attention kernel failed to build (see the logged warning)"
    check_kernel_against_pytorch(kernel, kv_heads, heads, d, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_step_of_decodes_only_reads_the_fused_projection_in_place_and_matches_pytorch(dtype):
    """Every token a decode (most busy steps): the kernel takes the strided query rows of the fused qkv output in
    the model's dtype and its result is the layer's output, equal to the PyTorch path's; bfloat16 rows give what
    the float32 query widened from them gives, rounded once."""
    kernel = paged_attention()
    if kernel is None:
        pytest.skip("kernels disabled or unavailable")
    g = torch.Generator().manual_seed(5)
    bs, kv_heads, heads, d = 16, 3, 9, 64
    perm = torch.randperm(64, generator=g).tolist()
    seqs = []
    for computed in (0, 15, 16, 40, 70, 3):
        blocks = -(-(computed + 1) // bs)
        seqs.append(SeqLayout(computed, 1, perm[:blocks]))
        perm = perm[blocks:]
    q, k, v = fused_qkv(*(torch.randn(len(seqs), n, d, generator=g).to(dtype) for n in (heads, kv_heads, kv_heads)))
    assert not q.is_contiguous()
    k_pool, v_pool = (torch.randn(64 * bs, kv_heads, d, generator=g).to(dtype) for _ in range(2))
    fast = TorchAttention(heads, kv_heads, d, block_size=bs, kernel=kernel)
    plain = TorchAttention(heads, kv_heads, d, block_size=bs)
    meta = fast.build_metadata(seqs)
    assert meta.decode.rows == slice(0, len(seqs)) and not meta.groups and not meta.fresh
    fk, fv, pk, pv = k_pool.clone(), v_pool.clone(), k_pool.clone(), v_pool.clone()
    out_fast = fast.forward(q, k, v, fk, fv, meta)
    out_plain = plain.forward(q, k, v, pk, pv, plain.build_metadata(seqs))
    assert torch.equal(fk, pk) and torch.equal(fv, pv), "the new K/V went to other slots"
    assert out_fast.dtype == dtype and out_fast.shape == (len(seqs), heads * d)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out_fast, out_plain, rtol=tol, atol=tol)
    d_ = meta.decode
    wide = kernel.paged_decode(q.float().contiguous(), fk, fv, d_.tables, d_.lens, bs, d ** -0.5)
    assert torch.equal(out_fast, wide.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_kernel_writes_new_keys_and_values_where_index_copy_would(dtype):
    kernel = paged_attention()
    if kernel is None:
        pytest.skip("kernels disabled or unavailable")
    g = torch.Generator().manual_seed(6)
    q, k, v = fused_qkv(*(torch.randn(200, n, 64, generator=g).to(dtype) for n in (9, 3, 3)))
    slots = torch.randperm(1024, generator=g)[:200]
    pools = [torch.zeros(1024, 3, 64, dtype=dtype) for _ in range(4)]
    kernel.write_kv(k, v, pools[0], pools[1], slots)
    pools[2].index_copy_(0, slots, k)
    pools[3].index_copy_(0, slots, v)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernel.write_kv(k, v, pools[0], pools[1], slots + 1024)


@pytest.mark.parametrize("lens", [(1, 5, 17, 4, 30, 9), (0, 0, 12, 0, 0, 7)],
                         ids=["continuing", "with chunks that start their sequence"])
def test_pytorch_attention_equals_naive_reference(lens):
    seqs, q, k, v, k_pool, v_pool, d = random_case(3, 2, 4, lens=lens)
    attn = TorchAttention(4, 2, d, block_size=4)
    meta = attn.build_metadata(seqs)
    assert len(meta.fresh) == sum(1 for s in seqs if s.num_computed == 0 and s.num_new > 1)
    out = attn.forward(q, k, v, k_pool, v_pool, meta)
    row = 0
    for s in seqs:
        slots = [s.block_table[p // 4] * 4 + p % 4 for p in range(s.num_computed + s.num_new)]
        keys, values = k_pool[slots], v_pool[slots]
        for j in range(s.num_new):
            n = s.num_computed + j + 1
            for h in range(4):
                w = torch.softmax(keys[:n, h // 2] @ q[row, h] / d ** 0.5, dim=0)
                torch.testing.assert_close(out[row, h * d:(h + 1) * d], w @ values[:n, h // 2], rtol=1e-5, atol=1e-5)
            row += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_prompt_kernel_matches_the_pytorch_path_on_fresh_and_continuing_chunks(dtype):
    check_prompt_kernel(prompt_kernel(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_prompt_kernel_refuses_chunks_and_blocks_out_of_range(dtype):
    kernel = prompt_kernel(dtype)
    seqs, q, k, v, k_pool, v_pool = prompt_case(8, [(0, 40), (10, 20)], dtype=dtype)
    meta = TorchAttention(9, 3, 64, block_size=16, kernel=kernel, dtype=dtype).build_metadata(seqs)
    p = meta.prompts
    out = torch.empty(60, 9 * 64, dtype=dtype)
    with pytest.raises(RuntimeError, match="chunk out of range"):
        kernel.paged_prefill(q, k_pool, v_pool, p.starts + 30, p.num_new, p.computed, p.tables, 16, 0.125, out)
    with pytest.raises(RuntimeError, match="block out of range"):
        kernel.paged_prefill(q, k_pool, v_pool, p.starts, p.num_new, p.computed, p.tables + 256, 16, 0.125, out)
    with pytest.raises(RuntimeError, match="block table too short"):
        kernel.paged_prefill(q, k_pool, v_pool, p.starts, p.num_new, p.computed + 64, p.tables, 16, 0.125, out)
    with pytest.raises(RuntimeError, match="all of one type"):
        kernel.paged_prefill(q.half(), k_pool, v_pool, p.starts, p.num_new, p.computed, p.tables, 16, 0.125, out)


class _PromptKernelStub:
    """Stands for the compiled module on any host: says the prompt kernel runs, records what it is given."""

    def __init__(self):
        self.calls = []

    def prefill_ready(self, bfloat16):
        return True

    def write_kv(self, k, v, k_pool, v_pool, slots):
        k_pool.index_copy_(0, slots, k)
        v_pool.index_copy_(0, slots, v)

    def paged_decode(self, q, *args):
        return torch.zeros(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype)

    def paged_prefill(self, q, k_pool, v_pool, starts, num_new, computed, tables, block_size, scale, out):
        self.calls.append((starts.tolist(), num_new.tolist(), computed.tolist(), tables.clone()))


def test_every_prefill_chunk_and_only_those_goes_to_the_prompt_kernel_where_it_runs():
    stub = _PromptKernelStub()
    seqs, q, k, v, k_pool, v_pool = prompt_case(9, PROMPT_STEP)
    attn = TorchAttention(9, 3, 64, block_size=16, kernel=stub, dtype=torch.bfloat16)
    meta = attn.build_metadata(seqs)
    attn.forward(q, k, v, k_pool, v_pool, meta)
    (starts, num_new, computed, tables), = stub.calls
    chunks = [(i, s) for i, s in enumerate(seqs) if s.num_new > 1]
    offsets = [sum(s.num_new for s in seqs[:i]) for i, _ in chunks]
    assert starts == offsets and num_new == [s.num_new for _, s in chunks]
    assert computed == [s.num_computed for _, s in chunks]
    for row, (_, s) in zip(tables, chunks):
        assert row[:len(s.block_table)].tolist() == s.block_table
    assert len(meta.decode.q_index) == 3 and not meta.fresh and not meta.groups
    for dtype, d in ((torch.float16, 64), (torch.bfloat16, 32)):  # elsewhere: torch's flash SDPA, as before
        assert not TorchAttention(9, 3, d, block_size=16, kernel=stub, dtype=dtype).prompt_kernel
