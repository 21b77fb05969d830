"""Weight-only quantized linear layers over GGUF's blocks: Q4_0, Q4_1 and Q8_0 kept as the file stores them; Q5_0,
Q4_K, Q5_K and Q6_K repacked at load into blocks of 32 the kernel runs (REPACKED), each weight the same float.

`meshserve model import-gguf` (and `model fetch`) write the GGUF's blocks of those types beside the dequantized
float32 weights, in `quantized.st`: one uint8 tensor [rows, row bytes] per weight, named as in
`model.safetensors`, the Q and K rows of llama files already unpermuted, and the GGML type of each in the file's
metadata. With `engine.quantization: gguf` the loader reads those instead of their float32 copies; a
QuantizedWeight stands where the model expects a weight matrix: projections call it, the embedding looks up its
rows. Activations stay float32, so the results are float32 arithmetic over the very weights the float32 folder
holds (each weight d * q + m rounded once where gguf's dequantize rounds twice).

The compute is the quant_linear kernel (csrc/quant_linear.cpp). Where it cannot build, `auto` serves the float32
weights and an explicit `gguf` is an error that says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.errors import ModelLoadError
from services.engine.layers.kernels import quant_linear

# A safetensors file, named so that loaders that take every *.safetensors of a folder (vLLM) skip it.
QUANTIZED_FILE = "quantized.st"
# The kernel's block formats (csrc/quant_linear.cpp) and their bytes per 32 weights: GGUF's own three, and three with
# float32 scales that other GGUF types are repacked into.
KERNEL_KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_1F": 3, "Q8_1F": 4, "Q8_16F": 5}
KERNEL_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_1F": 24, "Q8_1F": 40, "Q8_16F": 40}
# GGUF types kept quantized -> the kernel's format that runs them. Q5_0's 5-bit values become Q8_0's int8 (w = d * (q
# - 16)); a K-quant's 256-weight super-block becomes 8 blocks of 32 with float32 scales: Q4_K -> Q4_1F (d * sc, -dmin
# * min), Q5_K -> Q8_1F, Q6_K -> Q8_16F (a scale per 16). Exact: each product of a float16 and a 6- or 8-bit scale is
# exact in float32, and w = fma(q, d, m) rounds once, as gguf's dequantize does (its d * q is exact).
KINDS = {"Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q8_0": "Q8_0", "Q5_0": "Q8_0", "Q4_K": "Q4_1F", "Q5_K": "Q8_1F",
         "Q6_K": "Q8_16F"}

QUANTIZATIONS = ("auto", "none", "gguf")


@dataclass(frozen=True)
class QuantizedWeight:
    """A [out_features, in_features] weight as packed GGUF blocks (see module doc)."""
    packed: torch.Tensor  # uint8 [ceil(out_features / 16), 16 * in_features / 32 * KERNEL_BLOCK_BYTES[format]]: the
    # kernel's groups of 16 rows (csrc/quant_linear.cpp)
    kind: str  # the file's type (a KINDS key; "Q5_0+Q8_0" where projections of two types were fused)
    in_features: int
    out_features: int
    format: str = ""  # the kernel's format (a KERNEL_KINDS key); "" = KINDS[kind]

    def __post_init__(self):
        if not self.format:
            object.__setattr__(self, "format", KINDS[self.kind])

    dtype = torch.float32  # what it computes in (the model reads its dtype off the embedding)

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, kind: str, in_features: int) -> QuantizedWeight:
        """From GGUF's rows of blocks (uint8 [rows, row bytes]) of type kind (repacked where KINDS says)."""
        _check(blocks, kind, in_features)
        rows = repack(blocks, kind) if KINDS[kind] != kind else blocks
        return cls.from_kernel_blocks(rows, KINDS[kind], in_features, kind)

    @classmethod
    def from_kernel_blocks(cls, blocks: torch.Tensor, fmt: str, in_features: int, kind: str) -> QuantizedWeight:
        """From rows of blocks in the kernel's format fmt."""
        packed = _kernel().pack(blocks.contiguous(), KERNEL_KINDS[fmt], in_features)
        return cls(packed, kind, in_features, blocks.shape[0], fmt)

    @property
    def shape(self) -> tuple:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """What it holds in memory (the last group's padding rows included)."""
        return self.packed.numel()

    @property
    def data_bytes(self) -> int:
        """Its rows' bytes in the kernel's format (the file's, for Q4_0, Q4_1 and Q8_0)."""
        return self.out_features * self.in_features // 32 * KERNEL_BLOCK_BYTES[self.format]

    @property
    def _code(self) -> int:
        return KERNEL_KINDS[self.format]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in_features] (float32) @ W.T + bias."""
        lead = x.shape[:-1]
        y = _kernel().linear(x.reshape(-1, self.in_features), self.packed, self._code, self.in_features,
                             self.out_features, bias)
        return y.view(*lead, self.out_features)  # -1 cannot size a step with no rows (a chunk needing no logits)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows ids of W (an embedding lookup)."""
        return _kernel().rows(self.packed, self._code, self.in_features, self.out_features,
                              ids.reshape(-1).long()).view(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))


    def blocks(self) -> torch.Tensor:
        """The rows of blocks again, in the kernel's format (uint8 [out_features, row bytes]): GGUF's own for Q4_0,
        Q4_1 and Q8_0."""
        return _kernel().unpack(self.packed, self._code, self.in_features, self.out_features)


def fusable(parts: list) -> bool:
    """Whether parts can be one quantized weight of their rows: all quantized, in one kernel format and width (Gemma's
    Q5_0 q and k with its Q8_0 v: all Q8_0 blocks)."""
    first = parts[0]
    return all(isinstance(p, QuantizedWeight) and (p.format, p.in_features) == (first.format, first.in_features)
               for p in parts)


def concat(parts: list) -> QuantizedWeight:
    """One weight of the rows of parts (the fused q/k/v and gate/up projections); see fusable()."""
    if not fusable(parts):
        raise ValueError("fusing quantized weights of different formats or widths")
    first = parts[0]
    kind = "+".join(dict.fromkeys(p.kind for p in parts))
    if all(p.out_features % 16 == 0 for p in parts[:-1]):  # whole groups: the packed bytes follow one another
        return QuantizedWeight(torch.cat([p.packed for p in parts]), kind, first.in_features,
                               sum(p.out_features for p in parts), first.format)
    return QuantizedWeight.from_kernel_blocks(torch.cat([p.blocks() for p in parts]), first.format, first.in_features,
                                              kind)


def repack(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """GGUF rows of kind's blocks (uint8 [rows, row bytes]) as rows of the kernel format KINDS[kind] (see KINDS)."""
    import numpy as np

    rows = blocks.shape[0]
    b = blocks.contiguous().numpy().reshape(-1, file_block(kind)[1])
    n = b.shape[0]
    if kind == "Q5_0":  # d, 32 high bits, 16 bytes of low nibbles -> d, int8 (q - 16)
        high = (b[:, 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        low = np.concatenate([b[:, 6:22] & 15, b[:, 6:22] >> 4], axis=1)
        q = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
        out = np.concatenate([b[:, :2], q.view(np.uint8)], axis=1)
        return torch.from_numpy(np.ascontiguousarray(out).reshape(rows, -1))
    if kind == "Q6_K":  # ql[128], qh[64], int8 scales[16], d -> per 32: d * sc (first 16), d * sc (last 16), q - 32
        d = b[:, 208:210].copy().view(np.float16).astype(np.float32)
        scale = (d * b[:, 192:208].copy().view(np.int8).astype(np.float32)).reshape(n, 8, 2)
        ql = (b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
        qh = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        q = (ql.reshape(n, 8, 32) | (qh.reshape(n, 8, 32) << 4)).astype(np.int8) - np.int8(32)
        return _blocks_f32(rows, scale[:, :, 0], scale[:, :, 1], q.view(np.uint8))
    # Q4_K and Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of high bits), 128 bytes of nibbles
    d, dmin = (b[:, i:i + 2].copy().view(np.float16).astype(np.float32) for i in (0, 2))
    sc, mn = _scale_min(b[:, 4:16])
    scale, offset = d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))
    qs = b[:, 48:] if kind == "Q5_K" else b[:, 16:]
    q = ((qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(n, 8, 32)
    if kind == "Q5_K":
        high = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        return _blocks_f32(rows, scale, offset, (q | (high << 4)).astype(np.uint8))
    return _blocks_f32(rows, scale, offset, q[:, :, :16] | (q[:, :, 16:] << 4))  # Q4_1's nibble order


def _scale_min(packed):
    """The 8 six-bit scales and mins of a K-quant super-block (llama.cpp's get_scale_min_k4)."""
    import numpy as np

    s = packed.reshape(-1, 3, 4)
    lo, hi, mixed = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 63, (mixed & 15) | ((lo >> 2) & 48)], axis=1)
    mn = np.concatenate([hi & 63, (mixed >> 4) | ((hi >> 2) & 48)], axis=1)
    return sc, mn


def _blocks_f32(rows: int, first, second, values) -> torch.Tensor:
    """Blocks of 32 with two float32 scales each ([n, 8] each) then their value bytes ([n, 8, 16 or 32])."""
    import numpy as np

    n = values.shape[0]
    out = np.concatenate([first.astype(np.float32).reshape(n, 8, 1).view(np.uint8),
                          second.astype(np.float32).reshape(n, 8, 1).view(np.uint8), values], axis=2)
    return torch.from_numpy(np.ascontiguousarray(out).reshape(rows, -1))


def _check(blocks: torch.Tensor, kind: str, in_features: int) -> None:
    if kind not in KINDS:
        raise ModelLoadError(f"quantized weights: type {kind} is not kept quantized (kept: {', '.join(KINDS)})")
    weights, size = file_block(kind)
    if in_features % weights or blocks.dim() != 2 or blocks.dtype != torch.uint8 or \
            blocks.shape[1] != in_features // weights * size:
        raise ModelLoadError(f"quantized weights: a {kind} tensor of shape {tuple(blocks.shape)} does not hold rows of "
                             f"{in_features} weights")


def file_block(kind: str) -> tuple[int, int]:
    """A GGUF type's block: (weights, bytes), from the gguf package's own table."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]


def _kernel():
    k = quant_linear()
    if k is None:
        raise ModelLoadError("quantized weights need the quant_linear kernel, which did not build (see the log)")
    return k


def available(model_dir: str | Path) -> bool:
    """Whether a model folder holds quantized weights (written by import-gguf)."""
    return (Path(model_dir) / QUANTIZED_FILE).is_file()


def resolve(quantization: str, model_dir: str | Path, dtype: str, tensor_parallel_size: int = 1) -> str:
    """The weights' form a worker runs: none (float tensors of dtype) or gguf. auto takes gguf where the folder has
    quantized weights, the dtype is float32, the kernel builds and the model is not split over ranks (tensor
    parallelism shards float weights); an explicit gguf that cannot run is an error."""
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {quantization!r} (choose from {', '.join(QUANTIZATIONS)})")
    if quantization == "none":
        return "none"
    why_not = ("the folder has no quantized weights (import a GGUF file with `meshserve model import-gguf`)"
               if not available(model_dir) else
               f"quantized weights compute in float32, not {dtype}" if dtype != "float32" else
               f"tensor parallelism ({tensor_parallel_size} ranks) shards float weights only"
               if tensor_parallel_size > 1 else
               "the quant_linear kernel did not build" if quant_linear() is None else "")
    if quantization == "gguf" and why_not:
        raise ModelLoadError(f"{model_dir}: quantization gguf: {why_not}")
    return "none" if why_not else "gguf"


def load_quantized(model_dir: str | Path) -> dict:
    """{weight name: QuantizedWeight} from the folder's quantized.st."""
    from safetensors import safe_open

    path = Path(model_dir) / QUANTIZED_FILE
    out = {}
    with safe_open(str(path), framework="pt") as st:
        meta = st.metadata() or {}
        for name in st.keys():
            kind, width = _kind_and_width(meta, name, path)
            out[name] = QuantizedWeight.from_blocks(st.get_tensor(name), kind, width)
    return out


def _kind_and_width(meta: dict, name: str, path: Path) -> tuple[str, int]:
    value = meta.get(name, "")
    kind, _, width = value.partition(":")
    if kind not in KINDS or not width.isdigit():
        raise ModelLoadError(f"{path}: metadata for {name} is {value!r}, not TYPE:IN_FEATURES")
    return kind, int(width)


def dequantized(weights: dict) -> dict:
    """weights with every QuantizedWeight replaced by its float32 tensor."""
    return {k: v.dequantize() if isinstance(v, QuantizedWeight) else v for k, v in weights.items()}
