"""Paged attention over a flat mixed batch, and the KV storage it reads and writes.

A batch is a flat run of tokens: a prefill chunk of any length or one decode token per
sequence. Each step, build_metadata() turns the per-sequence layout into index tensors once;
every layer then (1) writes its new K/V into the paged pool at their slots and (2) attends.

Decode tokens go to the compiled paged kernel (services.engine.layers.kernels) when it is available:
it reads keys and values in place from the pool. With head size 64, every prefill chunk, new or continuing, goes
to the compiled prompt kernel where it runs (prompt_kernel_runs: float32 on AVX-512, bfloat16 on AMX tiles), which
also reads the pool in place. Otherwise a prefill chunk that starts a sequence (nothing
cached before it) attends only to its own keys, which are at hand: one causal
scaled_dot_product_attention over them (torch's flash kernel, GQA without a repeat), no gather,
no mask. Otherwise, and for prefill chunks that continue a sequence,
TorchAttention (CPU) attends group by group, with no Python loop per sequence: sequences are
sorted by context length and cut into groups of similar length; a group's keys are gathered
from the pool through its block tables into a padded [B, L] tensor and attended with one
masked scaled_dot_product_attention call, GQA handled by folding the query-head group into
the query axis (no K/V repeat). A FlashInfer backend for CUDA can implement the same two
methods over the same pool layout.

Sliding-window layers (Gemma 3): a query at position p attends keys p - window < k <= p. A backend built with a window
builds a second metadata for those layers (AttentionMetadata.local) only in a step where some sequence is longer than
the window; such sequences then go to the grouped path with the window in their mask, the rest (shorter than the
window: the window changes nothing) to the same code as in the global layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from services.common import envs


def prompt_kernel_runs(kernel, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether prefill chunks go to the compiled prompt kernel: head size 64, float32 or bfloat16, a build from the
    avx2 level up (its path per level: csrc/prompt_attention.h); elsewhere torch's flash SDPA."""
    return not _why_no_prompt_kernel(kernel, dtype, head_dim)


def _why_no_prompt_kernel(kernel, dtype: torch.dtype, head_dim: int) -> str:
    """Why prefill chunks take torch's SDPA instead of the prompt kernel ("" where they do not)."""
    if kernel is None:
        return "no compiled kernel"
    if dtype not in (torch.float32, torch.bfloat16) or head_dim != 64:
        return f"the kernel takes float32 or bfloat16 with head size 64, not {str(dtype)[6:]} with {head_dim}"
    if envs.PROMPT_KERNEL.is_off():
        return "MESHSERVE_PROMPT_KERNEL=0"
    return "" if kernel.prefill_ready(dtype == torch.bfloat16) else "a generic build (no vector ISA)"


class KVCache:
    """The paged K/V pool: per layer one K and one V tensor of [num_blocks * block_size, kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype):
        self.block_size = block_size
        shape = (num_blocks * block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]

    @classmethod
    def over(cls, storage: torch.Tensor, block_size: int) -> KVCache:
        """A pool in given memory: storage [layers, 2, slots, kv_heads, head_dim] (a tensor-parallel rank's shard
        of shared memory)."""
        cache = cls.__new__(cls)
        cache.block_size = block_size
        cache.k = [storage[layer, 0] for layer in range(storage.shape[0])]
        cache.v = [storage[layer, 1] for layer in range(storage.shape[0])]
        return cache

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def read_block(self, block: int) -> torch.Tensor:
        """One block of every layer: [layers, 2, block_size, kv_heads, head_dim] (a copy)."""
        s = slice(block * self.block_size, (block + 1) * self.block_size)
        return torch.stack([torch.stack((k[s], v[s])) for k, v in zip(self.k, self.v)])

    def read_block_into(self, block: int, out: torch.Tensor) -> None:
        """read_block() straight into `out` (flat bytes, e.g. a view of shared memory): one copy, no staging."""
        dest = out.view(self.k[0].dtype).view(len(self.k), 2, self.block_size, *self.k[0].shape[1:])
        s = slice(block * self.block_size, (block + 1) * self.block_size)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            dest[layer, 0].copy_(k[s])
            dest[layer, 1].copy_(v[s])

    def write_block(self, block: int, data: torch.Tensor) -> None:
        """Inverse of read_block; data may be flat."""
        data = data.view(len(self.k), 2, self.block_size, *self.k[0].shape[1:])
        s = slice(block * self.block_size, (block + 1) * self.block_size)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k[s].copy_(data[layer, 0])
            v[s].copy_(data[layer, 1])


class TensorBlocks:
    """A KVCache's blocks as raw bytes, for KV transfer (services.engine.kv_transfer): a block's bytes are its
    [layers, 2 (K, V), block_size, kv_heads, head_dim] in the cache's dtype, row-major, no per-element encoding."""

    def __init__(self, cache: KVCache, dtype: torch.dtype):
        self.cache, self.dtype = cache, dtype

    def read(self, block: int) -> bytes:
        return self.cache.read_block(block).contiguous().view(torch.uint8).numpy().tobytes()

    def read_into(self, block: int, out) -> None:
        """Into a writable buffer of a block's size (a view of shared memory): one copy, no staging."""
        self.cache.read_block_into(block, torch.frombuffer(out, dtype=torch.uint8))

    def write(self, block: int, data) -> None:
        """A writable buffer (a view of shared memory) is read in place; immutable bytes are copied first (torch
        wants writable memory)."""
        if not (isinstance(data, memoryview) and not data.readonly):
            data = bytearray(data)
        self.cache.write_block(block, torch.frombuffer(data, dtype=torch.uint8).view(self.dtype))


class ShardedKVCache(KVCache):
    """The pool of a tensor-parallel group as rank 0 sees it (services.engine.parallel): k and v are its own heads,
    which its forward writes and reads; whole blocks (every KV head once, in head order: the layout of an engine
    without tensor parallelism) are read and written across all the shards, for KV export, import and the pool.
    Where KV heads are replicated over ranks (more ranks than KV heads), a block is read from the first rank holding
    each head and written to every rank holding it."""

    def __init__(self, shards: list, block_size: int, heads: list | None = None):
        own = KVCache.over(shards[0], block_size)
        self.block_size, self.k, self.v = block_size, own.k, own.v
        self.shards = shards  # per rank: [layers, 2, slots, its KV heads, head_dim]
        if heads is None:  # each rank's [lo, hi) of the KV heads: consecutive, by default
            heads, lo = [], 0
            for shard in shards:
                heads.append((lo, lo + shard.shape[3]))
                lo += shard.shape[3]
        self.bounds = [tuple(b) for b in heads]
        self.kv_heads = max(hi for _, hi in self.bounds)
        seen = set()  # the rank each head range is read from: its first holder
        self.readers = [i for i, b in enumerate(self.bounds) if not (b in seen or seen.add(b))]

    def read_block(self, block: int) -> torch.Tensor:
        s = slice(block * self.block_size, (block + 1) * self.block_size)
        return torch.cat([self.shards[i][:, :, s] for i in self.readers], dim=3)

    def read_block_into(self, block: int, out: torch.Tensor) -> None:
        first = self.shards[0]
        dest = out.view(first.dtype).view(first.shape[0], 2, self.block_size, self.kv_heads, first.shape[4])
        s = slice(block * self.block_size, (block + 1) * self.block_size)
        for i in self.readers:
            lo, hi = self.bounds[i]
            dest[:, :, :, lo:hi].copy_(self.shards[i][:, :, s])

    def write_block(self, block: int, data: torch.Tensor) -> None:
        first = self.shards[0]
        data = data.view(first.shape[0], 2, self.block_size, self.kv_heads, first.shape[4])
        s = slice(block * self.block_size, (block + 1) * self.block_size)
        for shard, (lo, hi) in zip(self.shards, self.bounds):
            shard[:, :, s].copy_(data[:, :, :, lo:hi])


@dataclass(frozen=True)
class SeqLayout:
    """One sequence's share of a batch."""

    num_computed: int  # tokens already in the KV cache before this step
    num_new: int  # tokens of this sequence in the batch
    block_table: list  # KV block ids covering num_computed + num_new tokens


@dataclass
class AttentionGroup:
    """Sequences of similar context length attended together."""

    q_index: torch.Tensor  # [B, Q] flat token index of each query (padding -> 0)
    kv_blocks: torch.Tensor  # [B * n] pool block of each of a sequence's first n blocks (padding -> 0)
    mask: torch.Tensor  # [B, 1, Q, L] True where the query may attend the key
    out_rows: torch.Tensor  # rows of the [B*Q] result that are real queries
    out_tokens: torch.Tensor  # flat token index of each row in out_rows


@dataclass
class DecodeBatch:
    """Single-token sequences for the compiled paged kernel (no padding, no gather)."""

    q_index: torch.Tensor  # [B] flat token index of each sequence's query
    tables: torch.Tensor  # [B, max_blocks] int64 block tables (padding -> 0)
    lens: torch.Tensor  # [B] int64 context length including the new token
    rows: slice | None = None  # the same tokens as q_index where they are one run of the flat batch (no gather)


@dataclass
class PromptBatch:
    """Prefill chunks (more than one new token) for the compiled prompt kernel: keys read in place from the pool."""

    starts: torch.Tensor  # [S] int64 flat token index of each chunk's first query
    num_new: torch.Tensor  # [S] int64 the chunk's length
    computed: torch.Tensor  # [S] int64 tokens of its sequence cached before it
    tables: torch.Tensor  # [S, max_blocks] int64 block tables (padding -> 0)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] pool slot where each new token's K/V is written
    groups: list  # AttentionGroup, covering every token not in `decode` or `fresh`
    decode: DecodeBatch | None  # decode tokens handled by the compiled kernel, if any
    num_tokens: int  # T
    fresh: list = ()  # (first flat token, length) of each prefill chunk that starts its sequence
    prompts: PromptBatch | None = None  # every prefill chunk, where the prompt kernel runs (then fresh is empty)
    local: AttentionMetadata | None = None  # the sliding-window layers' metadata, where it differs (module doc)

    def for_layer(self, window: int) -> AttentionMetadata:
        """The metadata of a layer with this window (0: a global layer)."""
        return self.local if window and self.local is not None else self


class TorchAttention:
    """The CPU backend (see module doc). group_size bounds how many decode sequences share one padded group."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, group_size: int = 32,
                 kernel=None, dtype: torch.dtype = torch.float32, scale: float | None = None, window: int = 0):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.group_size = block_size, group_size
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.window = window  # the sliding-window layers' window (0: the model has none)
        self.kernel = kernel  # services.engine.layers.kernels.paged_attention() module, or None
        self.dtype = dtype
        self.prompt_kernel = prompt_kernel_runs(kernel, dtype, head_dim)

    @classmethod
    def for_model(cls, mc, block_size: int, kernel, dtype: torch.dtype) -> TorchAttention:
        """The backend of a model of config mc (services.config.engine.ModelConfig; a rank's under tensor
        parallelism): its heads, scale and sliding window."""
        return cls(mc.num_heads, mc.num_kv_heads, mc.head_dim, block_size, kernel=kernel, dtype=dtype,
                   scale=mc.attn_scale, window=mc.max_window)

    def describe(self) -> str:
        """The code decode tokens and prompts run here, for the start-up line."""
        bf16 = self.dtype == torch.bfloat16
        decode = f"compiled kernel, {self.kernel.decode_path(bf16)}" if self.kernel else "PyTorch (grouped SDPA)"
        prompts = (f"compiled kernel, {self.kernel.prefill_path(bf16)}" if self.prompt_kernel else
                   f"torch's SDPA ({_why_no_prompt_kernel(self.kernel, self.dtype, self.head_dim)})")
        return f"decode {decode}; prompts {prompts}"

    def build_metadata(self, seqs: list[SeqLayout]) -> AttentionMetadata:
        bs = self.block_size
        offsets, slots, starts = [], [], 0
        for s in seqs:
            offsets.append(starts)
            starts += s.num_new
            if s.num_new == 1:  # a decode token: one slot (most of a busy batch; no list to build)
                slots.append(s.block_table[s.num_computed // bs] * bs + s.num_computed % bs)
            else:
                slots.extend(self._slots(s))
        slot_mapping = torch.tensor(slots)
        meta = self._metadata(seqs, offsets, slot_mapping, starts)
        if self.window and any(s.num_computed + s.num_new > self.window for s in seqs):
            meta.local = self._metadata(seqs, offsets, slot_mapping, starts, self.window)
        return meta

    def _metadata(self, seqs: list[SeqLayout], offsets: list[int], slot_mapping: torch.Tensor, num_tokens: int,
                  window: int = 0) -> AttentionMetadata:
        """The step's metadata for layers with this window (0: global), over the step's token offsets and slots
        (shared by both): sequences longer than the window take the grouped path with the window in their mask."""
        short = [not window or s.num_computed + s.num_new <= window for s in seqs]
        decodes = [i for i in range(len(seqs)) if seqs[i].num_new == 1 and short[i]]
        windowed = [i for i in range(len(seqs)) if seqs[i].num_new == 1 and not short[i]]
        prefills = [[i] for i, s in enumerate(seqs) if s.num_new > 1 and not short[i]]
        prompts = None
        if self.prompt_kernel:
            chunks = [i for i, s in enumerate(seqs) if s.num_new > 1 and short[i]]
            prompts = self._prompt_batch([seqs[i] for i in chunks], [offsets[i] for i in chunks]) if chunks else None
            fresh = []
        else:
            fresh = [(offsets[i], s.num_new) for i, s in enumerate(seqs)
                     if s.num_new > 1 and s.num_computed == 0 and short[i]]
            prefills += [[i] for i, s in enumerate(seqs) if s.num_new > 1 and s.num_computed > 0 and short[i]]
        decode = None
        if self.kernel is not None and decodes:
            decode = self._decode_batch([seqs[i] for i in decodes], [offsets[i] for i in decodes])
            decodes = []
        decodes = sorted(decodes + windowed, key=lambda i: seqs[i].num_computed)
        cuts = [decodes[i:i + self.group_size] for i in range(0, len(decodes), self.group_size)] + prefills
        groups = [self._group([seqs[i] for i in idx], [offsets[i] for i in idx], window) for idx in cuts]
        return AttentionMetadata(slot_mapping=slot_mapping, groups=groups, decode=decode, num_tokens=num_tokens,
                                 fresh=fresh, prompts=prompts)

    def _slots(self, s: SeqLayout) -> list[int]:
        """Pool slots of the sequence's new tokens (plain ints: cheaper than tensor ops for a few tokens)."""
        bs, table = self.block_size, s.block_table
        return [table[p // bs] * bs + p % bs for p in range(s.num_computed, s.num_computed + s.num_new)]

    @staticmethod
    def _padded_tables(seqs: list[SeqLayout]) -> torch.Tensor:
        """The sequences' block tables padded with block 0, filled row by row in numpy (a nested list through
        torch.tensor cost ~0.35 ms a step at 256 sequences, 3x this)."""
        tables = np.zeros((len(seqs), max(len(s.block_table) for s in seqs)), dtype=np.int64)
        for row, s in zip(tables, seqs):
            row[:len(s.block_table)] = s.block_table
        return torch.from_numpy(tables)

    @classmethod
    def _decode_batch(cls, seqs: list[SeqLayout], offsets: list[int]) -> DecodeBatch:
        run = offsets[-1] - offsets[0] == len(offsets) - 1  # decode rows come first and in order (the scheduler)
        return DecodeBatch(q_index=torch.tensor(offsets), tables=cls._padded_tables(seqs),
                           lens=torch.tensor([s.num_computed + 1 for s in seqs], dtype=torch.long),
                           rows=slice(offsets[0], offsets[-1] + 1) if run else None)

    @classmethod
    def _prompt_batch(cls, seqs: list[SeqLayout], offsets: list[int]) -> PromptBatch:
        return PromptBatch(starts=torch.tensor(offsets, dtype=torch.long),
                           num_new=torch.tensor([s.num_new for s in seqs], dtype=torch.long),
                           computed=torch.tensor([s.num_computed for s in seqs], dtype=torch.long),
                           tables=cls._padded_tables(seqs))

    def _group(self, seqs: list[SeqLayout], offsets: list[int], window: int = 0) -> AttentionGroup:
        bs = self.block_size
        q_len = max(s.num_new for s in seqs)
        kv_len = max(s.num_computed + s.num_new for s in seqs)
        n_blocks = -(-kv_len // bs)
        tables = torch.tensor([s.block_table[:n_blocks] + [0] * (n_blocks - len(s.block_table[:n_blocks]))
                               for s in seqs], dtype=torch.long)
        key_pos = torch.arange(n_blocks * bs)
        computed = torch.tensor([s.num_computed for s in seqs])[:, None]
        num_new = torch.tensor([s.num_new for s in seqs])[:, None]
        q_off = torch.arange(q_len)[None, :]
        q_valid = q_off < num_new
        q_pos = computed + q_off
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]
        if window:
            mask &= key_pos[None, None, :] > q_pos[:, :, None] - window
        mask[:, :, 0] |= ~q_valid  # padding queries attend key 0 so softmax stays finite
        q_index = torch.where(q_valid, torch.tensor(offsets)[:, None] + q_off, 0)
        rows = q_valid.reshape(-1).nonzero().squeeze(1)
        return AttentionGroup(q_index=q_index, kv_blocks=tables.reshape(-1), mask=mask[:, None], out_rows=rows,
                              out_tokens=q_index.reshape(-1)[rows])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] (written into the pool first). Returns [T, H*D]."""
        if self.kernel is not None:
            self.kernel.write_kv(k, v, k_pool, v_pool, meta.slot_mapping)
        else:
            k_pool.index_copy_(0, meta.slot_mapping, k)
            v_pool.index_copy_(0, meta.slot_mapping, v)
        d = meta.decode
        if d is not None and d.rows == slice(0, meta.num_tokens):  # a step of decodes only: the kernel's output is all
            return self.kernel.paged_decode(q, k_pool, v_pool, d.tables, d.lens, self.block_size, self.scale)
        out = q.new_empty((meta.num_tokens, self.num_heads * self.head_dim))
        if d is not None:
            rows = d.q_index if d.rows is None else d.rows
            out[rows] = self.kernel.paged_decode(q[rows], k_pool, v_pool, d.tables, d.lens, self.block_size,
                                                 self.scale)
        if meta.prompts is not None:  # writes the chunks' rows of out in place
            p = meta.prompts
            self.kernel.paged_prefill(q, k_pool, v_pool, p.starts, p.num_new, p.computed, p.tables, self.block_size,
                                      self.scale, out)
        for g in meta.groups:
            out[g.out_tokens] = self._attend(q, k_pool, v_pool, g)[g.out_rows]
        for start, n in meta.fresh:
            rows = slice(start, start + n)
            # [1, heads, n, D]: with a batch axis torch takes its flash kernel (3-D inputs take the math path, 3x
            # slower)
            qh, kh, vh = (x[rows].transpose(0, 1)[None] for x in (q, k, v))
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True)
            out[rows] = o[0].transpose(0, 1).reshape(n, -1)
        return out

    def _attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        b, q_len = g.q_index.shape
        kvh, d = self.num_kv_heads, self.head_dim
        rep = self.num_heads // kvh
        # [B, Q, KVH, rep, D] -> [B, KVH, Q*rep, D]: the heads sharing a KV head ride the query axis.
        qg = q[g.q_index].view(b, q_len, kvh, rep, d).permute(0, 2, 1, 3, 4).reshape(b, kvh, q_len * rep, d)
        # Whole blocks are copied (bs * KVH * D contiguous values each), not single slots.
        blocks = (-1, self.block_size, kvh, d)
        keys = k_pool.view(blocks).index_select(0, g.kv_blocks).view(b, -1, kvh, d).permute(0, 2, 1, 3)
        values = v_pool.view(blocks).index_select(0, g.kv_blocks).view(b, -1, kvh, d).permute(0, 2, 1, 3)
        mask = g.mask if rep == 1 else g.mask[:, :, :, None, :].expand(-1, -1, -1, rep, -1).reshape(
            b, 1, q_len * rep, -1)
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=self.scale)
        return o.view(b, kvh, q_len, rep, d).permute(0, 2, 1, 3, 4).reshape(b * q_len, kvh * rep * d)
