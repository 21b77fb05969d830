"""The exported KV of one sequence, as raw bytes per block: what travels between engines.

A block's bytes are its tensor [layers, 2 (K, V), block_size, kv_heads, head_dim] in the
engine's dtype, row-major, with no per-element encoding.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVExport:
    token_ids: list  # prompt + output so far
    num_prompt: int  # how many of token_ids are the prompt
    num_computed: int  # tokens whose KV is in `blocks`
    block_size: int  # tokens per block
    dtype: str  # the element type's name (a torch dtype's) of the block bytes
    blocks: list  # bytes per block, in sequence order
    sample_seed: int  # the request's sampling seed: decoding continues its noise stream
