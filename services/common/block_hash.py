"""Chained content hashes of KV blocks: one pure, versioned function used by engine, router and kvstore.

hash_block(parent, tokens, extra) = BLAKE2b-128 keyed with a fixed versioned seed over
(parent digest, token ids as little-endian uint32, extra keys). The chain makes a block's
hash depend on the whole prefix before it, so equal hashes mean equal prefixes. `extra`
carries the adapter id and the isolation salt: by default each tenant hashes with its own
salt, so two tenants never share a block (closing the cache-timing side channel).

Never Python's hash(): it is salted per process and would silently break prefix matching
across the mesh. No torch import here: the router and kvstore use this module too.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

HASH_VERSION = 1
_KEY = b"meshserve-block-hash-v%d" % HASH_VERSION
ROOT = b"\x00" * 16  # the parent of a sequence's first block
_NATIVE_U32_LE = array("I").itemsize == 4 and sys.byteorder == "little"


def extra_keys(adapter: str = "", salt: str = "") -> bytes:
    """Encode the keys that separate otherwise equal blocks: LoRA adapter and isolation domain."""
    return b"a=" + adapter.encode() + b"\x00s=" + salt.encode()


_KEYED = hashlib.blake2b(digest_size=16, key=_KEY)  # copied per block: cheaper than keying anew


def hash_block(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """Digest of one full block given its parent's digest (ROOT for the first block)."""
    h = _KEYED.copy()
    h.update(parent)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(_pack(tokens))
    h.update(extra)
    return h.digest()


def _pack(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32."""
    if _NATIVE_U32_LE:
        return array("I", tokens).tobytes()
    return b"".join(t.to_bytes(4, "little") for t in tokens)


def hash_blocks(tokens: Sequence[int], block_size: int, extra: bytes = b"",
                parent: bytes = ROOT, start: int = 0) -> list[bytes]:
    """Chained digests of every full block of tokens[start:], continuing from `parent`."""
    n = (len(tokens) - start) // block_size
    return hash_packed(_pack(tokens[start:start + n * block_size]), block_size, extra, parent)


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32: how prompts travel to the router for hashing."""
    return _pack(tokens)


def hash_packed(packed: bytes, block_size: int, extra: bytes = b"", parent: bytes = ROOT) -> list[bytes]:
    """hash_blocks over tokens already packed by pack_tokens (no per-token work in Python)."""
    width = 4 * block_size
    n = len(packed) // width
    count, out = block_size.to_bytes(4, "little"), []
    copy = _KEYED.copy
    for i in range(n):
        h = copy()
        h.update(b"".join((parent, count, packed[i * width:(i + 1) * width], extra)))
        parent = h.digest()
        out.append(parent)
    return out


def prompt_hashes(packed: bytes, block_size: int, adapter: str = "", salt: str = "") -> list[bytes]:
    """The block hashes a prompt (packed by pack_tokens) is routed by: every full block of all but its last token
    (that one is always computed, its logits are needed, as in the engine)."""
    return hash_packed(packed[:-4], block_size, extra_keys(adapter, salt))
