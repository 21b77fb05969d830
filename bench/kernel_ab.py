"""The paged decode kernel against another version of its source, side by side in one process (this VM's drift
moves separate runs by more than most kernel changes): median milliseconds per call over interleaved repeats, on
random block tables, SmolLM2's heads (9 query, 3 KV, head size 64), block size 16, float32 and bfloat16 pools.

    git show REV:services/engine/layers/csrc/paged_attention.cpp > /tmp/old.cpp
    python -m bench.kernel_ab /tmp/old.cpp [SEQS CONTEXT ...]     (default: 64 400  64 100  16 800)

Contexts are drawn uniformly from CONTEXT/2 to CONTEXT per sequence.
"""

from __future__ import annotations

import sys
import tempfile

import torch

from bench.kernel_probe import seconds_per_call
from services.engine.layers.kernels import CSRC, ISA_CFLAGS, host_isa, paged_attention


def compare(old, new, seqs: int, context: int, dtype, heads=9, kv_heads=3, d=64, bs=16, repeats=5) -> str:
    per_seq = -(-context // bs)
    k_pool, v_pool = (torch.randn(2 * seqs * per_seq * bs, kv_heads, d).to(dtype) for _ in range(2))
    tables = torch.randperm(2 * seqs * per_seq)[: seqs * per_seq].view(seqs, per_seq).contiguous()
    lens = torch.randint(context // 2, context + 1, (seqs,))
    q = torch.randn(seqs, heads, d).to(torch.bfloat16).float()  # a bfloat16 model's query
    times = {"old": [], "new": []}
    for _ in range(repeats):
        for name, kernel in (("old", old), ("new", new)):
            times[name].append(seconds_per_call(lambda: kernel.paged_decode(q, k_pool, v_pool, tables, lens, bs,
                                                                            d ** -0.5)))
    a, b = (k.paged_decode(q, k_pool, v_pool, tables, lens, bs, d ** -0.5) for k in (old, new))
    t_old, t_new = (sorted(times[n])[repeats // 2] * 1e3 for n in ("old", "new"))
    return (f"{str(dtype).removeprefix('torch.'):8s} {seqs} x ~{context}: old {t_old:.3f} ms, new {t_new:.3f} ms, "
            f"{t_old / t_new:.2f}x, largest difference {(a - b).abs().max().item():.1e}")


def main() -> None:
    from torch.utils.cpp_extension import load

    source, rest = sys.argv[1], [int(a) for a in sys.argv[2:]] or [64, 400, 64, 100, 16, 800]
    isa = host_isa()
    flags = ["-O3", "-ffast-math", "-fopenmp", *ISA_CFLAGS[isa]]
    old = load(name="paged_attention_ab_old", sources=[source], extra_cflags=flags, extra_include_paths=[str(CSRC)],
               build_directory=tempfile.mkdtemp(prefix="kernel-ab-"), verbose=False)
    new = paged_attention()
    print(f"kernel isa {isa}, torch threads {torch.get_num_threads()}")
    for seqs, context in zip(rest[::2], rest[1::2]):
        for dtype in (torch.float32, torch.bfloat16):
            print(compare(old, new, seqs, context, dtype), flush=True)


if __name__ == "__main__":
    main()
