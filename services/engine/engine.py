"""LLMEngine: the composition root of the engine, and its public API.

add(spec) validates a RequestSpec (services/common/request.py) and queues it (add_request() is the
same for offline callers, with the prompt as ids or text); step() runs one iteration (schedule ->
forward -> sample -> update) and returns per-request deltas; abort() ends a request and frees its
blocks at once. load() is a snapshot of what the engine holds. Two parts hang off it, each with its
own surface: `transfer` (kv_transfer.py: KV exports, staged imports, the mesh's KV pool, the prefix
index's events; add(spec, kv=...) imports a whole export) and `adapters` (lora_adapters.py: LoRA
adapters registered from the config or at run time; a request names one in spec.adapter, and a step's
batch may mix any of them with the base model).
"""

from __future__ import annotations

import collections
import logging
import time
from functools import partial
from pathlib import Path

import torch

from services.common.errors import RankDied
from services.common.tokenizer import Tokenizer
from services.config.engine import EngineConfig
from services.engine.allocator import keep_large_buffers
from services.engine.base import EngineBase, EngineLoad, RequestOutput, RuntimeInfo, StepStats  # noqa: F401 (API)
from services.engine.block_pool import BlockPool
from services.engine.kv_manager import KVCacheManager
from services.engine.kv_transfer import KVTransfer
from services.engine.layers.attention import KVCache, SeqLayout, ShardedKVCache, TensorBlocks, TorchAttention
from services.engine.layers.guided import Grammars
from services.engine.layers.kernels import lora as lora_kernel
from services.engine.layers.kernels import paged_attention, sampler
from services.engine.layers.kernels import summary as kernel_summary
from services.engine.layers.quant import resolve as resolve_quantization
from services.engine.layers.sampler import Sampler
from services.engine.loader import load_model
from services.engine.lora import LoRABatch, LoRASlots, engine_residency
from services.engine.lora_adapters import LoRAAdapters, configured
from services.engine.models import build_model
from services.engine.parallel import TensorParallelGroup, local_config, shard_adapter, shard_weights
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.engine.step_cost import StepCostFit
from services.policy.arbitration import make_arbitration_policy

log = logging.getLogger("meshserve.engine")


class LLMEngine(EngineBase):
    def __init__(self, config: EngineConfig, clock=time.monotonic):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        keep_large_buffers()
        self.config, self.clock = config, clock
        self.weights_form = resolve_quantization(config.quantization, config.model_dir, config.dtype,
                                                 config.tensor_parallel_size)
        loaded = load_model(config.model_dir, config.dtype, self.weights_form)
        mc = self.model_config = loaded.config
        cc, sc = config.cache, config.scheduler
        block_bytes = KVCache.bytes_per_block(mc.num_layers, cc.block_size, mc.num_kv_heads, mc.head_dim,
                                              getattr(torch, config.dtype))
        num_blocks = cc.num_blocks or max(1, cc.kv_cache_bytes // block_bytes)
        # tensor parallelism (parallel.py): the other ranks start loading beside this one; this engine is rank 0
        self.group = TensorParallelGroup(config, mc, num_blocks) if config.tensor_parallel_size > 1 else None
        local = local_config(mc, self.group.shard) if self.group else mc
        weights = shard_weights(loaded.weights, mc, self.group.shard) if self.group else loaded.weights
        self.model = build_model(local, weights)
        if self.group:
            self.group.await_ready()
            self.model.tp = self.group.collectives
        log.info("weights: %s", self.describe_weights())
        tokenizer_json = Path(config.model_dir) / "tokenizer.json"
        self.tokenizer = Tokenizer(config.model_dir) if tokenizer_json.exists() else None
        self.grammars = Grammars(tokenizer_json if self.tokenizer else None, mc.vocab_size, loaded.eos_token_ids,
                                 threads=torch.get_num_threads())  # structured outputs (guided.py)
        self.info = RuntimeInfo(num_blocks, loaded.eos_token_ids, mc.vocab_size,
                                min(mc.max_positions, num_blocks * cc.block_size))
        self.kv_cache = (ShardedKVCache(self.group.kv_shards, cc.block_size,
                                                [s.kv for s in self.group.shards]) if self.group else
                         KVCache(mc.num_layers, num_blocks, cc.block_size, mc.num_kv_heads, mc.head_dim,
                                 self.model.dtype))
        self.kv = KVCacheManager(BlockPool(num_blocks), cc.block_size, cc.enable_prefix_caching)
        lc = config.lora
        slots = LoRASlots(local, lc.max_loras, self.model.dtype, shard=partial(shard_adapter, mc=mc,
                                                                               shard=self.group.shard),
                          mirror=self.group.mirror_lora) if self.group and lc.max_loras else None
        self.lora = engine_residency(mc, self.model.dtype, lc, self._adapter_in_use, clock,
                                     slots) if lc.max_loras else None
        self._lora_kernel = None
        self.step_cost = StepCostFit()  # what its steps take: heartbeats report it, the scheduler caps batches by it
        self.scheduler = Scheduler(self.kv, make_arbitration_policy(sc.policy), sc.max_num_seqs,
                                   sc.max_num_batched_tokens, clock=clock, lora=self.lora, step_cost=self.step_cost,
                                   deadline_min_batch=sc.deadline_min_batch, before_admit=self._admit_pooled)
        kernel = paged_attention() if self.model.dtype in (torch.float32, torch.bfloat16) else None
        self.attention = TorchAttention.for_model(local, cc.block_size, kernel, self.model.dtype)
        self.sampler = Sampler(loaded.eos_token_ids, kernel=sampler())
        log.info("%s", kernel_summary())
        log.info("attention (%s): %s", self.model.dtype, self.attention.describe())
        self.init_book()
        blocks = TensorBlocks(self.kv_cache, self.model.dtype)
        self.transfer = KVTransfer(self.requests, self.scheduler, self.kv, blocks, config.dtype, block_bytes,
                                   self.lora, self._new_request)
        self.adapters = LoRAAdapters(self.lora)
        for name, path in configured(lc):
            self.adapters.load(name, path)

    def describe_weights(self) -> str:
        """The weights' form and size, as start-up logs print it: "gguf (Q4_1 x210, Q8_0 x1; 98 MB)"."""
        weights = self.model.weights()
        mb = sum(w.nbytes for w in weights) / 1e6
        if self.weights_form == "none":
            of = f" on rank 0 of {self.group.world}" if self.group else ""
            return f"{self.config.dtype} ({mb:.0f} MB{of})"
        kinds = collections.Counter(getattr(w, "kind", None) for w in weights)
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted((k, n) for k, n in kinds.items() if k))
        return f"gguf ({kinds}; {mb:.0f} MB)"

    # ---- the iteration ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration; returns a delta for every request that sampled or finished."""
        t0, grammar_s = time.perf_counter(), self.grammars.spent_s
        failed = self._end_failed_adapters() if self.lora is not None else []
        out = self.scheduler.schedule()
        if out.empty:
            if self.lora is not None and not failed:
                self.lora.wait(0.01)  # nothing to run but an adapter being read: wait for it, do not spin
            return failed
        ids, positions, layouts, logits_index, sampling, lora = self._build_batch(out)  # (sends it to the ranks)
        meta = self.attention.build_metadata(layouts)
        allow = self.grammars.masks(sampling)  # structured outputs: what each constrained row may sample
        t1 = time.perf_counter()
        try:
            logits = self.model.forward(ids, positions, self.attention, meta, self.kv_cache, logits_index, lora)
        except RankDied:
            raise
        except Exception as e:
            if self.group:  # the other ranks are inside this step's collectives: the group cannot go on
                raise RankDied(f"the forward failed on rank 0 ({type(e).__name__}: {e}); the tensor-parallel group "
                               f"is out of step") from e
            raise
        forward_s = time.perf_counter() - t1
        sampled = self.sampler(logits, sampling, allow) if sampling else None
        self.scheduler.update(out)
        results = self._postprocess(sampling, sampled) if sampled else []
        if self.lora is not None and self.lora.retired:
            self.lora.sweep()  # unloaded adapters whose last request just finished
        self._record(out, forward_s, time.perf_counter() - t0, self.grammars.spent_s - grammar_s)
        return failed + results

    def _build_batch(self, out: SchedulerOutput):
        ids, positions, layouts, logits_index, sampling = [], [], [], [], []
        adapted = any(s.request.lora_slot is not None for s in out.seqs)
        if adapted:  # each slot's rows contiguous (base rows first), for the segmented LoRA kernel
            out.seqs.sort(key=lambda s: -1 if s.request.lora_slot is None else s.request.lora_slot)
        segments = []
        for s in out.seqs:
            req = s.request
            end = s.num_computed + s.num_new
            ids.extend(req.tokens[s.num_computed:end])
            positions.extend(range(s.num_computed, end))
            layouts.append(SeqLayout(s.num_computed, s.num_new, self.kv.block_table(req)))
            if s.sample:
                logits_index.append(len(ids) - 1)
                sampling.append(req)
            if req.lora_slot is not None:
                first = len(ids) - s.num_new
                if segments and segments[-1][2] == req.lora_slot:
                    segments[-1][1] = len(ids)
                else:
                    segments.append([first, len(ids), req.lora_slot])
        if self.group:
            self.group.step(ids, positions, layouts, logits_index, segments if adapted else None)
        lora = LoRABatch(self.lora.slots, segments, self._kernel()) if adapted else None
        return (torch.tensor(ids), torch.tensor(positions), layouts, torch.tensor(logits_index, dtype=torch.long),
                sampling, lora)

    def _kernel(self):
        if self._lora_kernel is None:
            self._lora_kernel = lora_kernel() or False
        return self._lora_kernel or None

    def close(self) -> None:
        """Stop the engine's other processes (tensor-parallel ranks) now; they also die with this one."""
        if self.group:
            self.group.close()

