"""The exported KV of one sequence, as raw bytes per block: what travels between engines.

A block's bytes are its tensor [layers, 2 (K, V), block_size, kv_heads, head_dim] in the
engine's dtype, row-major, with no per-element encoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVExport:
    token_ids: list  # prompt + output so far
    num_prompt: int  # how many of token_ids are the prompt
    num_computed: int  # tokens whose KV is in `blocks`
    block_size: int  # tokens per block
    dtype: str  # torch dtype name of the block bytes
    blocks: list  # bytes per block, in sequence order
    sample_seed: int  # the request's sampling seed: decoding continues its noise stream


def encode_block(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def decode_block(data, dtype: torch.dtype) -> torch.Tensor:
    """Raw bytes back to a flat tensor; write_block() reshapes by broadcasting into the pool. A writable buffer
    (a view of shared memory) is used in place; immutable bytes are copied first (torch wants writable memory)."""
    if isinstance(data, memoryview) and not data.readonly:
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
