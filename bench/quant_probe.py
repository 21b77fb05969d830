"""The quantized linear kernel against oneDNN's float32 GEMM over a GGUF's layer matrices, at several batch rows:
milliseconds for one pass over every quantized weight but the embedding (float32: the same weights dequantized and
packed as the engine packs them). A probe for kernel work, not a benchmark of the engine.

    python -m bench.quant_probe GGUF_FILE [ROWS ...]     (default rows: 1 4 16 64 256 1024)
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch


def main() -> None:
    import gguf

    from services.engine.layers.quant import KINDS, QuantizedWeight

    path, rows = sys.argv[1], [int(a) for a in sys.argv[2:]] or [1, 4, 16, 64, 256, 1024]
    weights = []
    for t in gguf.GGUFReader(path).tensors:
        if len(t.shape) == 2 and t.tensor_type.name in KINDS and t.name != "token_embd.weight":
            n, k = int(t.shape[1]), int(t.shape[0])
            blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(n, -1))
            weights.append((QuantizedWeight.from_blocks(blocks, t.tensor_type.name, k), k))
    dense = [(torch.ops.mkldnn._reorder_linear_weight(q.dequantize(), 256), k) for q, k in weights]
    print(f"{len(weights)} matrices, torch threads {torch.get_num_threads()}")
    for m in rows:
        xs = {k: torch.randn(m, k) for _, k in weights}
        runs = {"quantized": lambda: [q(xs[k]) for q, k in weights],
                "float32": lambda: [torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
                                    for w, k in dense]}
        out = []
        for name, f in runs.items():
            f()
            t = time.perf_counter()
            for _ in range(3):
                f()
            out.append(f"{name} {(time.perf_counter() - t) / 3 * 1e3:8.1f} ms")
        print(f"rows {m:5}: " + ", ".join(out))


if __name__ == "__main__":
    main()
