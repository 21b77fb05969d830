"""Weight-only quantized linear layers: GGUF's Q4_0, Q4_1 and Q8_0 blocks, kept as the file stores them.

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
KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # the GGML types kept quantized, as the kernel numbers them
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # per 32 weights
QUANTIZATIONS = ("auto", "none", "gguf")


@dataclass(frozen=True)
class QuantizedWeight:
    """A [out_features, in_features] weight as packed GGUF blocks (see module doc)."""
    packed: torch.Tensor  # uint8 [ceil(out_features / 16), 16 * in_features / 32 * BLOCK_BYTES[kind]]: the kernel's
    # groups of 16 rows (csrc/quant_linear.cpp)
    kind: str  # Q4_0, Q4_1 or Q8_0
    in_features: int
    out_features: int

    dtype = torch.float32  # what it computes in (the model reads its dtype off the embedding)

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, kind: str, in_features: int) -> QuantizedWeight:
        """From GGUF's rows of blocks (uint8 [rows, row bytes])."""
        _check(blocks, kind, in_features)
        return cls(_kernel().pack(blocks.contiguous(), KINDS[kind], in_features), kind, in_features, blocks.shape[0])

    @property
    def shape(self) -> tuple:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """What it holds in memory (the last group's padding rows included)."""
        return self.packed.numel()

    @property
    def data_bytes(self) -> int:
        """Its rows' bytes in the GGUF file."""
        return self.out_features * self.in_features // 32 * BLOCK_BYTES[self.kind]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in_features] (float32) @ W.T + bias."""
        lead = x.shape[:-1]
        y = _kernel().linear(x.reshape(-1, self.in_features), self.packed, KINDS[self.kind], self.in_features,
                             self.out_features, bias)
        return y.view(*lead, self.out_features)  # -1 cannot size a step with no rows (a chunk needing no logits)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows ids of W (an embedding lookup)."""
        return _kernel().rows(self.packed, KINDS[self.kind], self.in_features, self.out_features,
                              ids.reshape(-1).long()).view(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))


    def blocks(self) -> torch.Tensor:
        """GGUF's rows of blocks again (uint8 [out_features, row bytes])."""
        return _kernel().unpack(self.packed, KINDS[self.kind], self.in_features, self.out_features)


def fusable(parts: list) -> bool:
    """Whether parts can be one quantized weight of their rows: all quantized, of one kind and width."""
    first = parts[0]
    return all(isinstance(p, QuantizedWeight) and (p.kind, p.in_features) == (first.kind, first.in_features)
               for p in parts)


def concat(parts: list) -> QuantizedWeight:
    """One weight of the rows of parts (the fused q/k/v and gate/up projections); see fusable()."""
    if not fusable(parts):
        raise ValueError("fusing quantized weights of different kinds or widths")
    first = parts[0]
    if all(p.out_features % 16 == 0 for p in parts[:-1]):  # whole groups: the packed bytes follow one another
        return QuantizedWeight(torch.cat([p.packed for p in parts]), first.kind, first.in_features,
                               sum(p.out_features for p in parts))
    return QuantizedWeight.from_blocks(torch.cat([p.blocks() for p in parts]), first.kind, first.in_features)


def _check(blocks: torch.Tensor, kind: str, in_features: int) -> None:
    if kind not in KINDS:
        raise ModelLoadError(f"quantized weights: type {kind} is not kept quantized (kept: {', '.join(KINDS)})")
    if in_features % 32 or blocks.dim() != 2 or blocks.dtype != torch.uint8 or \
            blocks.shape[1] != in_features // 32 * BLOCK_BYTES[kind]:
        raise ModelLoadError(f"quantized weights: a {kind} tensor of shape {tuple(blocks.shape)} does not hold rows of "
                             f"{in_features} weights")


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
