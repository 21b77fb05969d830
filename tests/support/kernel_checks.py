"""The compiled kernels' checks against PyTorch and gguf, each run at the host's ISA level (tests/engine) and at
every level pinned (tests/engine/test_kernel_isa.py)."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch

from services.engine.layers.attention import SeqLayout, TorchAttention
from services.engine.layers.kernels import paged_attention
from services.engine.layers.sampler import SamplingBatch, sample_torch


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


def check_kernel_against_fallback(kernel, scale: float) -> None:
    g = torch.Generator().manual_seed(int(scale * 10))
    rows, vocab = 96, 5000
    logits = torch.randn(rows, vocab, generator=g) * scale
    cycle = lambda *vals: torch.tensor([vals[i % len(vals)] for i in range(rows)])  # noqa: E731
    batch = SamplingBatch(
        temperature=cycle(1.0, 0.7, 0.0, 1.0, 1.5, 1.0).float(), top_k=cycle(0, 0, 0, 40, 0, 1, 0, 4999),
        top_p=cycle(1.0, 0.95, 1.0, 1.0, 0.8).float(),
        log_min_p=cycle(-math.inf, -math.inf, math.log(0.05), -math.inf, -math.inf, -math.inf, -math.inf).float(),
        seeds=torch.randint(0, 2**62, (rows,), generator=g), positions=torch.randint(0, 4096, (rows,), generator=g),
        ban_offsets=torch.arange(rows + 1) * 2, ban_ids=logits.topk(2, dim=-1).indices.flatten(),
        want_logprobs=cycle(True, False))
    fast, fast_lp = kernel.sample(logits, *batch.tensors())
    slow, slow_lp = sample_torch(logits, batch)
    assert fast.tolist() == slow.tolist()
    asked = batch.want_logprobs
    assert torch.allclose(fast_lp[asked], slow_lp[asked], atol=1e-5) and fast_lp[~asked].isnan().all()


K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # where a K-quant block's float16 scales lie


def width_for(kind: str, k: int) -> int:
    """k rounded up to whole blocks of kind (256 weights for the K-quants, 32 for the others)."""
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
    return -(-k // block) * block


def blocks_of(weights: np.ndarray, kind: str) -> np.ndarray:
    """gguf's own quantization of weights [N, K]: uint8 rows of blocks. gguf's numpy code cannot quantize the
    K-quants: for those, seeded random blocks (every value, scale and min drawn) with float16 scales of the
    weights' magnitude over the block's range."""
    qtype = gguf.GGMLQuantizationType[kind]
    if kind not in K_SCALES:
        return gguf.quants.quantize(weights, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(weights.shape[0] * 1000 + weights.shape[1])
    raw = rng.integers(0, 256, (weights.shape[0], weights.shape[1] // block * size), dtype=np.uint8)
    scale = float(np.abs(weights).mean()) / (16 * 32 if kind == "Q6_K" else 8 * 32)
    for b in range(weights.shape[1] // block):
        for at in K_SCALES[kind]:
            d = (scale * rng.uniform(0.5, 2.0, weights.shape[0])).astype(np.float16)
            raw[:, b * size + at:b * size + at + 2] = d.reshape(-1, 1).view(np.uint8)
    return raw


def reference(blocks: np.ndarray, kind: str, k: int) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]),
                                     dtype=np.float32).reshape(-1, k))


def _collective_peer(path: str, nbytes: int, cap: int, data: list, out) -> None:
    from services.engine.parallel import SharedMemory, ShmCollectives

    coll = ShmCollectives(SharedMemory(nbytes, "test", path), 1, 2, cap, [3, 5])
    results = [coll.all_reduce(x.clone()) for x in data]
    coll.gather_logits(torch.full((4, 5), 7.0))
    out.put([r.view(torch.int16 if r.dtype == torch.bfloat16 else torch.int32).tolist() for r in results])


def check_collectives(dtype: torch.dtype) -> None:
    """The all-reduce is one float32 sum per element, rounded once to the dtype (bfloat16: to nearest even), the
    same bits on both ranks, for lengths off the vector width and tensors larger than the buffer (several rounds);
    the gather lays each rank's columns side by side on rank 0."""
    import multiprocessing

    from services.engine.parallel import SharedMemory, ShmCollectives, allreduce_region_bytes

    g = torch.Generator().manual_seed(0)
    mine = [torch.randn(n, generator=g).to(dtype) * 100 for n in (1, 17, 1000, 5000)]
    theirs = [torch.randn(n, generator=g).to(dtype) * 100 for n in (1, 17, 1000, 5000)]
    cap = 4096
    nbytes = allreduce_region_bytes(2, cap)
    region = SharedMemory(nbytes, "test")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    peer = ctx.Process(target=_collective_peer, args=(region.path, nbytes, cap, theirs, out), daemon=True)
    peer.start()
    coll = ShmCollectives(region, 0, 2, cap, [3, 5])
    got = [coll.all_reduce(x.clone()) for x in mine]
    logits = coll.gather_logits(torch.full((4, 3), 1.0))
    peer_got = out.get(timeout=60)
    peer.join(10)
    for a, b, r, pr in zip(mine, theirs, got, peer_got):
        want = (a.float() + b.float()).to(dtype)
        assert torch.equal(r, want)
        assert r.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).tolist() == pr
    assert torch.equal(logits, torch.cat([torch.full((4, 3), 1.0), torch.full((4, 5), 7.0)], dim=1))
