"""The paged decode kernel alone against a plain read of the same pool: is it memory-bound?

    python -m bench.kernel_probe [--isa amx|avx512_bf16|avx512|avx2|generic]

Random block tables (blocks anywhere in the pool, as in a running engine), block size 16, every
sequence the same length; prints the kernel's time per call, the KV bytes it reads per second, and
the rate at which torch sums the same two pools (an upper bound on what reading them costs).
"""

from __future__ import annotations

import argparse
import time

import torch

from services.engine.layers.kernels import host_isa, paged_attention

SHAPES = ((4, 2, 128, 340), (9, 3, 128, 340), (4, 2, 16, 2000))  # heads, KV heads, sequences, context


def seconds_per_call(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def probe(kernel, heads: int, kv_heads: int, seqs: int, length: int, d: int = 64, bs: int = 16) -> str:
    per_seq = -(-length // bs)
    blocks = seqs * per_seq + 8
    k_pool, v_pool = torch.randn(blocks * bs, kv_heads, d), torch.randn(blocks * bs, kv_heads, d)
    tables = torch.randperm(blocks)[: seqs * per_seq].view(seqs, per_seq).contiguous()
    lens, q = torch.full((seqs,), length, dtype=torch.long), torch.randn(seqs, heads, d)
    t = seconds_per_call(lambda: kernel.paged_decode(q, k_pool, v_pool, tables, lens, bs, d ** -0.5))
    t_sum = seconds_per_call(lambda: (k_pool.sum(), v_pool.sum()))
    kv_bytes = seqs * length * 2 * kv_heads * d * 4
    return (f"{heads} heads / {kv_heads} KV heads, {seqs} x {length} tokens: kernel {t * 1e3:.2f} ms = "
            f"{kv_bytes / t / 1e9:.1f} GB/s of KV; torch sum of both pools {k_pool.numel() * 8 / t_sum / 1e9:.1f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.kernel_probe", description=__doc__)
    ap.add_argument("--isa", help="kernel level (default: what the dispatcher picks)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    isa = args.isa or host_isa()
    kernel = paged_attention(isa)
    if kernel is None:
        raise SystemExit("the paged attention kernel did not build (see the warning above)")
    print(f"paged decode kernel, {isa}, {args.threads} threads")
    for shape in SHAPES:
        print(probe(kernel, *shape))


if __name__ == "__main__":
    main()
