"""The prompt kernel alone against what the engine ran before it: a step's worth of prompts, each attended by its
own causal `scaled_dot_product_attention` (torch's flash kernel, GQA without a repeat).

    python -m bench.prompt_probe [--dtype bfloat16|float32] [--isa LEVEL]

SmolLM2's heads (9 query, 3 KV, size 64), block size 16, blocks anywhere in the pool; each row is one step's
prompts (up to 2,048 tokens), all starting their sequence. Prints ms per step for both and the ratio; each is
timed twice (20 calls after 3 of warm-up) and the better kept. A probe, not a benchmark of record.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.kernel_probe import seconds_per_call
from services.engine.layers.kernels import ISA_LEVELS, host_isa, paged_attention

STEPS = ((64, 32), (16, 128), (7, 272), (4, 512), (2, 1024), (1, 2048))  # prompts x tokens
HEADS, KV_HEADS, D, BS = 9, 3, 64, 16


def probe(kernel, prompts: int, length: int, dtype: torch.dtype) -> str:
    blocks = -(-length // BS)
    k_pool, v_pool = (torch.randn(prompts * blocks * BS + BS, KV_HEADS, D).to(dtype) for _ in range(2))
    order = torch.randperm(prompts * blocks + 1)[:prompts * blocks].view(prompts, blocks).contiguous()
    t = prompts * length
    qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * D).to(dtype)  # as the model hands it over: one fused projection
    q, k, v = (x.view(t, -1, D) for x in qkv.split((HEADS * D, KV_HEADS * D, KV_HEADS * D), dim=1))
    starts = torch.arange(prompts) * length
    for i in range(prompts):  # the prompt's K/V where the engine writes them before attending
        slots = (order[i, :, None] * BS + torch.arange(BS)).flatten()[:length]
        k_pool[slots], v_pool[slots] = k[i * length:(i + 1) * length], v[i * length:(i + 1) * length]
    out = torch.empty(t, HEADS * D, dtype=dtype)
    lens, computed = torch.full((prompts,), length), torch.zeros(prompts, dtype=torch.long)

    def ours():
        kernel.paged_prefill(q, k_pool, v_pool, starts, lens, computed, order, BS, D ** -0.5, out)

    def sdpa():
        for s in range(0, t, length):
            qh, kh, vh = (x[s:s + length].transpose(0, 1)[None] for x in (q, k, v))
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=D ** -0.5, enable_gqa=True)
            out[s:s + length] = o[0].transpose(0, 1).reshape(length, -1)

    a, b = (min(seconds_per_call(f) for _ in range(2)) * 1e3 for f in (ours, sdpa))
    flops = prompts * 2 * 2 * HEADS * D * length * (length + 1) / 2
    return (f"{prompts:3d} x {length:5d}: ours {a:7.3f} ms ({flops / a / 1e6:4.0f} GFLOP/s), "
            f"SDPA {b:7.3f} ms ({flops / b / 1e6:4.0f}), {b / a:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--isa", choices=ISA_LEVELS, help="kernel level (default: what the dispatcher picks)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    isa = args.isa or host_isa()
    kernel = paged_attention(isa)
    if kernel is None or not kernel.prefill_ready(dtype == torch.bfloat16):
        raise SystemExit(f"the prompt kernel does not run here in {args.dtype} at {isa} (a build from avx2 up)")
    print(f"{args.dtype}, level {isa}: {kernel.prefill_path(dtype == torch.bfloat16)}; {torch.get_num_threads()} "
          f"threads, {HEADS} heads / {KV_HEADS} KV heads, D {D}")
    for prompts, length in STEPS:
        print(probe(kernel, prompts, length, dtype), flush=True)


if __name__ == "__main__":
    main()
