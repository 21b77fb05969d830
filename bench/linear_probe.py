"""torch's own linear against oneDNN's with a packed weight, on SmolLM2's layer shapes, at several batch rows:
milliseconds per call for F.linear and for the packed weight (as the engine packs it: services/engine/models/llama.py),
and the largest difference between them. A probe for choosing the engine's linear path, not a benchmark.

    python -m bench.linear_probe [--dtype float32|bfloat16] [ROWS ...]     (default rows: 1 16 64 256 1024)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.kernel_probe import seconds_per_call

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def ms_per_call(fn) -> float:
    return seconds_per_call(fn) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("rows", nargs="*", type=int, default=[1, 16, 64, 256, 1024])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"{args.dtype}, torch threads {torch.get_num_threads()}, "
          f"oneDNN native bf16: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    for rows in args.rows:
        cells = []
        for name, (out_features, in_features) in SHAPES.items():
            w = (torch.randn(out_features, in_features) * 0.05).to(dtype)
            x = torch.randn(rows, in_features).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 256)
            onednn = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
            plain = lambda: F.linear(x, w)  # noqa: E731
            diff = (onednn().float() - plain().float()).abs().max().item()
            cells.append(f"{name} {ms_per_call(plain):.3f} / {ms_per_call(onednn):.3f} (diff {diff:.1e})")
        print(f"{rows:5d} rows, F.linear / packed oneDNN ms: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
