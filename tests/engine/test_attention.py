"""The compiled paged decode kernel and the PyTorch attention path agree, on random pools and tables."""

import os

import pytest
import torch

from services.engine.attention import SeqLayout, TorchAttention
from services.engine.kernels import paged_attention


def random_case(seed, kv_heads, heads, block_size=4, num_blocks=64, lens=(1, 5, 17, 4, 30, 9), d=16):
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(num_blocks * block_size, kv_heads, d, generator=g)
    v_pool = torch.randn(num_blocks * block_size, kv_heads, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    seqs = []
    for i, computed in enumerate(lens):
        n_new = 1 if i % 2 == 0 else 3  # decodes and short prefill chunks mixed
        blocks = -(-(computed + n_new) // block_size)
        seqs.append(SeqLayout(computed, n_new, perm[:blocks]))
        perm = perm[blocks:]
    t = sum(s.num_new for s in seqs)
    q = torch.randn(t, heads, d, generator=g)
    k = torch.randn(t, kv_heads, d, generator=g)
    v = torch.randn(t, kv_heads, d, generator=g)
    return seqs, q, k, v, k_pool, v_pool, d


# head dims 16 (the kernel's plain loops) and 64 / 128 (its AVX-512 paths: 1 to 8 heads per KV head)
SHAPES = [(2, 4, 16), (4, 4, 16), (1, 8, 16), (3, 9, 64), (2, 4, 64), (4, 4, 64), (1, 8, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kv_heads,heads,d", SHAPES)
def test_kernel_matches_pytorch_attention(kv_heads, heads, d, dtype):
    kernel = paged_attention()
    if os.environ.get("MESHSERVE_KERNELS") == "0":
        pytest.skip("kernels disabled by MESHSERVE_KERNELS=0")
    assert kernel is not None, "the paged attention kernel failed to build (see the logged warning)"
    check_kernel_against_pytorch(kernel, kv_heads, heads, d, dtype)


def check_kernel_against_pytorch(kernel, kv_heads: int, heads: int, d: int = 16, dtype=torch.float32) -> None:
    """Block size 16 (a whole AVX-512 row of scores per block) with contexts that end mid-block.

    bfloat16: the kernel reads the bf16 pool and sums in float32, so its raw result equals, to float32
    rounding, the float32 kernel's on the same values widened; the layer's output (rounded to bf16) is
    compared with PyTorch's bf16 attention within bf16's precision."""
    seqs, q, k, v, k_pool, v_pool, d = random_case(kv_heads * 10 + heads, kv_heads, heads, block_size=16,
                                                   lens=(1, 40, 17, 4, 70, 9), d=d)
    q, k, v, k_pool, v_pool = (x.to(dtype) for x in (q, k, v, k_pool, v_pool))
    plain = TorchAttention(heads, kv_heads, d, block_size=16)
    fast = TorchAttention(heads, kv_heads, d, block_size=16, kernel=kernel)
    meta_fast = fast.build_metadata(seqs)
    assert meta_fast.decode is not None and len(meta_fast.decode.q_index) == 3
    out_plain = plain.forward(q, k, v, k_pool.clone(), v_pool.clone(), plain.build_metadata(seqs))
    written_k, written_v = k_pool.clone(), v_pool.clone()
    out_fast = fast.forward(q, k, v, written_k, written_v, meta_fast)
    assert out_fast.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out_fast, out_plain, rtol=tol, atol=tol)
    if dtype != torch.float32:
        dec = meta_fast.decode
        args = (q[dec.q_index].float().contiguous(),)
        raw = kernel.paged_decode(*args, written_k, written_v, dec.tables, dec.lens, 16, d ** -0.5)
        wide = kernel.paged_decode(*args, written_k.float(), written_v.float(), dec.tables, dec.lens, 16, d ** -0.5)
        torch.testing.assert_close(raw, wide, rtol=1e-5, atol=1e-5)


def fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """q, k, v as the model hands them over: views of one [T, (H + 2 KVH) * D] projection, rows strided."""
    t, d = q.shape[0], q.shape[2]
    qkv = torch.cat([x.reshape(t, -1) for x in (q, k, v)], dim=1)
    q_w, kv_w = q.shape[1] * d, k.shape[1] * d
    return tuple(x.view(t, -1, d) for x in qkv.split((q_w, kv_w, kv_w), dim=1))


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


def prompt_case(seed: int, layout: list, bs: int = 16, kv_heads: int = 3, heads: int = 9, d: int = 64,
                dtype: torch.dtype = torch.bfloat16):
    """Prefill chunks (num_computed, num_new) and decodes mixed in one step, q/k/v views of one fused projection,
    blocks scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(256, generator=g).tolist()
    seqs = []
    for computed, new in layout:
        blocks = -(-(computed + new) // bs)
        seqs.append(SeqLayout(computed, new, perm[:blocks]))
        perm = perm[blocks:]
    t = sum(new for _, new in layout)
    q, k, v = fused_qkv(*(torch.randn(t, n, d, generator=g).to(dtype) for n in (heads, kv_heads, kv_heads)))
    k_pool, v_pool = (torch.randn(256 * bs, kv_heads, d, generator=g).to(dtype) for _ in range(2))
    return seqs, q, k, v, k_pool, v_pool


def prompt_kernel(dtype: torch.dtype):
    kernel = paged_attention()
    if kernel is None:
        pytest.skip("kernels disabled or unavailable")
    if not kernel.prefill_ready(dtype == torch.bfloat16):
        pytest.skip("the prompt kernel needs a build from the avx2 level up (this one is generic)")
    return kernel


# decodes first (as the scheduler orders a step), then chunks that start their sequence and chunks that continue one,
# lengths on and off the kernel's 16-query and 32-key steps
PROMPT_STEP = [(30, 1), (0, 1), (70, 1), (0, 37), (0, 2), (20, 50), (100, 17), (0, 300), (31, 33), (64, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_prompt_kernel_matches_the_pytorch_path_on_fresh_and_continuing_chunks(dtype):
    check_prompt_kernel(prompt_kernel(dtype), dtype)


def check_prompt_kernel(kernel, dtype: torch.dtype) -> None:
    """Every prefill chunk of the step, new or continuing, read from the pool in place, on whichever path the
    kernel's level takes (prefill_path): the layer's output equals the PyTorch path's, to float32 rounding, or within
    bfloat16's precision (on the tiles and vdpbf16ps the weights are rounded to bfloat16 before the value product, as
    torch's flash kernel does; widened, they stay float32); and equals a float32 softmax computed here from the same
    values."""
    seqs, q, k, v, k_pool, v_pool = prompt_case(7, PROMPT_STEP, dtype=dtype)
    fast = TorchAttention(9, 3, 64, block_size=16, kernel=kernel, dtype=dtype)
    plain = TorchAttention(9, 3, 64, block_size=16)
    assert fast.prompt_kernel
    meta = fast.build_metadata(seqs)
    assert meta.prompts is not None and len(meta.prompts.starts) == 7 and not meta.fresh and not meta.groups
    fk, fv, pk, pv = k_pool.clone(), v_pool.clone(), k_pool.clone(), v_pool.clone()
    out_fast = fast.forward(q, k, v, fk, fv, meta)
    out_plain = plain.forward(q, k, v, pk, pv, plain.build_metadata(seqs))
    assert torch.equal(fk, pk) and torch.equal(fv, pv)
    assert out_fast.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out_fast.float(), out_plain.float(), rtol=tol, atol=tol)
    row, bs = 0, 16
    for s in seqs:
        slots = [s.block_table[p // bs] * bs + p % bs for p in range(s.num_computed + s.num_new)]
        keys, values = fk[slots].float(), fv[slots].float()
        for j in range(s.num_new):
            n = s.num_computed + j + 1
            for h in (0, 4, 8):
                w = torch.softmax(keys[:n, h // 3] @ q[row, h].float() / 8, dim=0)
                torch.testing.assert_close(out_fast[row, h * 64:(h + 1) * 64].float(), w @ values[:n, h // 3],
                                           rtol=tol, atol=tol)
            row += 1


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
