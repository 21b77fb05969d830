"""LLMEngine: the composition root of the engine, and its public API.

add(spec) validates a RequestSpec (services/common/request.py) and queues it (add_request() is the
same for offline callers, with the prompt as ids or text); step() runs one iteration (schedule ->
forward -> sample -> update) and returns per-request deltas; abort() ends a request and frees its
blocks at once. load() is a snapshot of what the engine holds. Two parts hang off it, each with its
own surface: `transfer` (transfer.py: KV exports, staged imports, the mesh's KV pool, the prefix
index's events; add(spec, kv=...) imports a whole export) and `adapters` (lora_adapters.py: LoRA
adapters registered from the config or at run time; a request names one in spec.adapter, and a step's
batch may mix any of them with the base model).
"""

from __future__ import annotations

import collections
import itertools
import logging
import random
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from services.common.errors import InvalidRequest, NotFound, OutOfRange, RankDied
from services.common.request import RequestSpec
from services.common.tokenizer import Tokenizer, cut_at_stop
from services.engine.allocator import keep_large_buffers
from services.engine.attention import KVCache, SeqLayout, ShardedKVCache, TorchAttention
from services.engine.block_pool import BlockPool
from services.engine.config import EngineConfig
from services.engine.guided import Grammars
from services.engine.kernels import lora as lora_kernel
from services.engine.kernels import paged_attention, sampler
from services.engine.kernels import summary as kernel_summary
from services.engine.kv_manager import KVCacheManager
from services.engine.kv_transfer import KVExport
from services.engine.loader import load_model
from services.engine.lora import AdapterResidency, LoRABatch, LoRASlots, LoRASnapshot
from services.engine.lora_adapters import LoRAAdapters, configured
from services.engine.model import LlamaModel
from services.engine.parallel import TensorParallelGroup, local_config, shard_adapter, shard_weights
from services.engine.quant import resolve as resolve_quantization
from services.engine.request import Request, SamplingParams, Status
from services.engine.sampler import Sampler
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.engine.step_cost import StepCostFit
from services.engine.transfer import KVTransfer
from services.policy.arbitration import make_policy
from services.policy.bands import BANDS

log = logging.getLogger("meshserve.engine")


@dataclass
class RequestOutput:
    req_id: str
    new_token_ids: list  # tokens sampled this step (zero or one)
    new_logprobs: list | None  # their logprobs, when asked
    finished: bool
    finish_reason: str | None  # stop | length | abort, once finished
    request: Request  # the engine's record (read only)
    new_top_logprobs: list | None = None  # per new token: (token ids, logprobs) most likely first, when asked


@dataclass
class StepStats:
    num_running: int  # sequences in the batch
    num_tokens: int  # tokens in the batch
    forward_s: float  # model call, embeddings to logits
    step_s: float  # the whole step
    kv_slots_allocated: int  # token slots in blocks held by running requests
    kv_slots_filled: int  # of which hold computed tokens
    context_tokens: int = 0  # tokens already in the KV cache of the batch's sequences (attention reads them)
    prefill_context: int = 0  # over prompt chunks: chunk tokens x the tokens before the chunk (their attention)
    grammar_s: float = 0.0  # structured outputs: masks filled and tokens fed to the grammars this step


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds now: a snapshot for heartbeats, metrics and stats (read it anywhere)."""

    running: int  # sequences in the batch
    waiting: int  # queued, or preempted and waiting to recompute
    receiving: int  # requests whose KV an import is filling
    blocks_used: int  # KV blocks held by live requests
    blocks_cached: int  # unreferenced blocks kept for prefix reuse
    blocks_total: int  # the KV pool
    block_size: int  # tokens per block
    outstanding_tokens: int  # prompt tokens still to compute + output tokens still expected
    queued_prefill_tokens: int  # prompt tokens not yet computed, over running and waiting requests
    max_num_seqs: int  # sequence slots
    lora: LoRASnapshot | None = None  # adapters and their residency (None: no LoRA slots)
    running_adapters: tuple = ()  # adapters of the running batch
    waiting_adapters: tuple = ()  # adapters of waiting requests
    slot_preemptions: int = 0  # running requests that yielded their slot to another's, since start
    started: int = 0  # requests first scheduled, since start
    queue_wait_s: float = 0.0  # their waits from arrival to first scheduled, summed

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV pool held by live requests, 0..1 (vLLM's kv_cache_usage_perc)."""
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0


@dataclass(frozen=True)
class RuntimeInfo:
    num_blocks: int  # KV pool size
    eos_token_ids: tuple  # ids that end generation unless ignore_eos
    vocab_size: int  # model vocabulary
    max_model_len: int  # longest prompt + output


def _adapters_of(requests) -> tuple:
    return tuple(sorted({r.adapter for r in requests if r.adapter}))


class LLMEngine:
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
        self.model = LlamaModel(local, weights)
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
        self.kv_cache = (ShardedKVCache(self.group.kv_shards, cc.block_size) if self.group else
                         KVCache(mc.num_layers, num_blocks, cc.block_size, mc.num_kv_heads, mc.head_dim,
                                 self.model.dtype))
        self.kv = KVCacheManager(BlockPool(num_blocks), cc.block_size, cc.enable_prefix_caching)
        lc = config.lora
        slots = LoRASlots(local, lc.max_loras, self.model.dtype, shard=partial(shard_adapter, mc=mc,
                                                                               shard=self.group.shard),
                          mirror=self.group.mirror_lora) if self.group and lc.max_loras else None
        self.lora = AdapterResidency(mc, self.model.dtype, lc.max_loras, lc.max_cpu_loras, lc.max_lora_rank,
                                     in_use=self._adapter_in_use, clock=clock, slots=slots) if lc.max_loras else None
        self._lora_kernel = None
        self.step_cost = StepCostFit()  # what its steps take: heartbeats report it, the scheduler caps batches by it
        self.scheduler = Scheduler(self.kv, make_policy(sc.policy), sc.max_num_seqs, sc.max_num_batched_tokens,
                                   clock=clock, lora=self.lora, step_cost=self.step_cost,
                                   deadline_min_batch=sc.deadline_min_batch, before_admit=self._admit_pooled)
        kernel = paged_attention() if self.model.dtype in (torch.float32, torch.bfloat16) else None
        self.attention = TorchAttention(local.num_heads, local.num_kv_heads, mc.head_dim, cc.block_size,
                                        kernel=kernel, dtype=self.model.dtype)
        self.sampler = Sampler(loaded.eos_token_ids, kernel=sampler())
        log.info("%s", kernel_summary())
        log.info("attention (%s): %s", self.model.dtype, self.attention.describe())
        self._seeds = random.Random(config.seed)  # a sampling seed for each request that brings none
        self.requests: dict[str, Request] = {}
        self._seq = itertools.count()
        self.last_step: StepStats | None = None
        self.transfer = KVTransfer(self.requests, self.scheduler, self.kv, self.kv_cache, self.model.dtype,
                                   block_bytes, self.lora, self._new_request)
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

    # ---- requests -------------------------------------------------------------------------

    def add(self, spec: RequestSpec, kv: KVExport | None = None, pooled: tuple | None = None) -> Request:
        """Validate and queue a request (see module doc for kv). Raises a typed MeshError on bad input.

        The spec's tenant, weight, deadline_s (absolute, this engine's clock) and predicted_s feed
        slot arbitration. pooled: (hashes, start, blocks) of its prompt from the mesh's KV pool, imported into
        the prefix cache when the request is admitted (import_cached): then there is room for them."""
        req = self._new_request(spec)
        req.pooled = pooled if pooled and pooled[2] else None
        if kv is not None:
            self.transfer.import_whole(req, kv)
        else:
            self.scheduler.add(req)
        self.requests[req.req_id] = req
        return req

    def add_request(self, req_id: str, prompt_token_ids: list[int] | None = None, params: SamplingParams | None = None,
                    *, prompt: str | None = None, kv: KVExport | None = None, **spec_fields) -> Request:
        """add() for offline callers and tests: the prompt as ids or text, the other RequestSpec fields by name."""
        ids = self._prompt_ids(prompt_token_ids, prompt)
        return self.add(RequestSpec(req_id, tuple(ids), params or SamplingParams(), **spec_fields), kv)

    def _new_request(self, spec: RequestSpec) -> Request:
        ids = list(spec.prompt_token_ids)
        self._validate(spec.request_id, ids, spec.sampling, spec.adapter)
        if not spec.weight > 0:
            raise InvalidRequest(f"weight must be > 0, got {spec.weight}")
        if spec.band not in BANDS:
            raise InvalidRequest(f"band must be one of {list(BANDS)}, got {spec.band}")
        req = Request(spec.request_id, ids, spec.sampling, arrival_s=self.clock(), seq_no=next(self._seq),
                      priority=spec.priority, band=spec.band, adapter=spec.adapter, cache_salt=spec.cache_salt,
                      tenant=spec.tenant, weight=spec.weight, deadline_s=spec.deadline_s, predicted_s=spec.predicted_s,
                      sample_seed=self._sample_seed(spec.sampling), resumed_outputs=spec.resumed_outputs)
        self.grammars.start(req)  # a constraint that does not compile is refused here, before anything is held
        return req

    def _sample_seed(self, params: SamplingParams) -> int:
        return params.seed if params.seed is not None else self._seeds.getrandbits(63)

    def _prompt_ids(self, ids, prompt) -> list[int]:
        if (ids is None) == (prompt is None):
            raise InvalidRequest("give exactly one of prompt or prompt_token_ids")
        if prompt is not None:
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer.json: send prompt_token_ids")
            ids = self.tokenizer.encode(prompt)
        return list(ids)

    def _validate(self, req_id: str, ids: list, params: SamplingParams, adapter: str) -> None:
        if not isinstance(req_id, str) or not req_id:
            raise InvalidRequest("request id must be a non-empty string")
        if req_id in self.requests:
            raise InvalidRequest(f"request id {req_id!r} is already in use")
        if not ids:
            raise InvalidRequest("prompt is empty")
        vocab = self.info.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})")
        params.validate()
        if adapter and (self.lora is None or not self.lora.serves(adapter)):
            raise NotFound(f"adapter {adapter!r} is not loaded here")
        total = len(ids) + params.max_tokens
        if total > self.info.max_model_len:
            raise OutOfRange(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                             f"the maximum of {self.info.max_model_len} tokens (model context and KV pool)")

    def abort(self, req_id: str) -> bool:
        """End a request now and free its KV blocks; False if it is unknown or already finished."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return False
        self.scheduler.finish(req, "abort")
        if self.lora is not None and self.lora.retired:
            self.lora.sweep()
        return True

    def has_unfinished(self) -> bool:
        """Requests to run, or adapter reads to join (step() does both)."""
        return self.scheduler.has_work or bool(self.lora is not None and self.lora.loading)

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

    def _postprocess(self, reqs: list[Request], sampled) -> list[RequestOutput]:
        results = []
        for i, (req, tok) in enumerate(zip(reqs, sampled.tokens)):
            req.tokens.append(tok)
            self.scheduler.policy.charge(req.tenant, req.weight, output_tokens=1)
            lp = None
            if req.params.wants_logprobs:
                lp = [sampled.logprobs[i]]
                req.logprobs.append(sampled.logprobs[i])
            top = [sampled.top[i]] if req.params.top_logprobs else None
            if top:
                req.top_logprobs.append(top[0])
            reason = self.grammars.accept(req, tok) if req.grammar is not None else None
            reason = reason or self._finish_reason(req, tok)
            if reason:
                self.scheduler.finish(req, reason)
                self.requests.pop(req.req_id, None)
            results.append(RequestOutput(req.req_id, [tok], lp, reason is not None, reason, req, top))
        return results

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.info.eos_token_ids):
            return "stop"
        if req.num_output < p.min_tokens:
            return "length" if req.num_output >= p.max_tokens else None
        if p.stop and self.tokenizer and cut_at_stop(self.tokenizer.decode(req.output_token_ids), p.stop)[1]:
            return "stop"
        if req.num_output >= p.max_tokens:
            return "length"
        return None

    def _record(self, out: SchedulerOutput, forward_s: float, step_s: float, grammar_s: float) -> None:
        bs = self.kv.block_size
        running = self.scheduler.running
        self.last_step = StepStats(
            num_running=len(out.seqs), num_tokens=out.num_tokens, forward_s=forward_s, step_s=step_s,
            kv_slots_allocated=sum(len(self.kv.block_table(r)) for r in running) * bs,
            kv_slots_filled=sum(r.num_computed for r in running),
            context_tokens=sum(s.num_computed for s in out.seqs),
            prefill_context=sum(s.num_new * s.num_computed for s in out.seqs if s.num_new > 1), grammar_s=grammar_s)
        self.step_cost.update(len(out.seqs), out.num_tokens, step_s)

    def _admit_pooled(self, req: Request) -> None:
        self.transfer.admit_pooled(req)  # the scheduler is built before the transfer part it calls

    def close(self) -> None:
        """Stop the engine's other processes (tensor-parallel ranks) now; they also die with this one."""
        if self.group:
            self.group.close()

    # ---- introspection ------------------------------------------------------------------------

    def load(self) -> EngineLoad:
        outstanding = prefill = receiving = 0
        for req in self.requests.values():
            left = max(req.num_tokens - req.num_computed, 0)
            outstanding += left + req.params.max_tokens - req.num_output
            receiving += req.status is Status.RECEIVING
            prefill += 0 if req.status is Status.RECEIVING else max(req.num_prompt - req.num_computed, 0)
        c = self.kv.pool.counts()
        return EngineLoad(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting), receiving=receiving,
                          blocks_used=c["used"], blocks_cached=c["cached"], blocks_total=c["total"],
                          block_size=self.kv.block_size, outstanding_tokens=outstanding,
                          queued_prefill_tokens=prefill, max_num_seqs=self.scheduler.max_num_seqs,
                          lora=self.lora.snapshot() if self.lora is not None else None,
                          running_adapters=_adapters_of(self.scheduler.running) if self.lora is not None else (),
                          waiting_adapters=_adapters_of(self.scheduler.waiting) if self.lora is not None else (),
                          slot_preemptions=self.scheduler.slot_preemptions, started=self.scheduler.started,
                          queue_wait_s=self.scheduler.queue_wait_s)

    # ---- LoRA adapters ------------------------------------------------------------------------

    def _adapter_in_use(self, name: str) -> bool:
        return any(r.adapter == name for r in self.requests.values())

    def _end_failed_adapters(self) -> list[RequestOutput]:
        """Join finished adapter reads; a request waiting on an adapter whose read failed ends (abort)."""
        failed = []
        for name, why in self.adapters.failed_reads():
            for req in [r for r in self.scheduler.waiting if r.adapter == name]:
                log.error("request %s: %s", req.req_id, why)
                self.scheduler.finish(req, "abort")
                self.requests.pop(req.req_id, None)
                failed.append(RequestOutput(req.req_id, [], None, True, "abort", req))
        return failed

    def output_text(self, req: Request) -> str:
        """Decoded output, cut before the first stop string."""
        if self.tokenizer is None:
            return ""
        return cut_at_stop(self.tokenizer.decode(req.output_token_ids), req.params.stop)[0]
