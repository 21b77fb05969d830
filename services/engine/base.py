"""What every engine backend shares, with no torch: the request book (validation, add, abort, finish reasons),
the step's bookkeeping after sampling, and load(). LLMEngine (engine.py) runs a model's forward pass on it;
MockEngine (mock.py) a step-time model in its place, for the mesh at scale without a model.

A backend sets, in its __init__: config, clock, info (RuntimeInfo), kv (KVCacheManager), scheduler, step_cost,
lora (AdapterResidency or None), tokenizer (or None), grammars (structured outputs), transfer (KVTransfer),
adapters, requests, and calls init_book() for the request seeds and sequence numbers.
"""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.errors import InvalidRequest, NotFound, OutOfRange
from services.common.request import RequestSpec
from services.common.tokenizer import cut_at_stop
from services.engine.kv_export import KVExport
from services.engine.request import Request, SamplingParams, Status
from services.engine.scheduler import SchedulerOutput
from services.policy.bands import BANDS

log = logging.getLogger("meshserve.engine")

if TYPE_CHECKING:
    from services.engine.lora_residency import LoRASnapshot


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


def adapters_of(requests) -> tuple:
    return tuple(sorted({r.adapter for r in requests if r.adapter}))


class EngineBase:
    def init_book(self) -> None:
        self._seeds = random.Random(self.config.seed)  # a sampling seed for each request that brings none
        self.requests: dict[str, Request] = {}
        self._seq = itertools.count()
        self.last_step: StepStats | None = None

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
                          running_adapters=adapters_of(self.scheduler.running) if self.lora is not None else (),
                          waiting_adapters=adapters_of(self.scheduler.waiting) if self.lora is not None else (),
                          slot_preemptions=self.scheduler.slot_preemptions, started=self.scheduler.started,
                          queue_wait_s=self.scheduler.queue_wait_s)

    # ---- LoRA adapters ------------------------------------------------------------------------

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

    def _adapter_in_use(self, name: str) -> bool:
        return any(r.adapter == name for r in self.requests.values())

    def output_text(self, req: Request) -> str:
        """Decoded output, cut before the first stop string."""
        if self.tokenizer is None:
            return ""
        return cut_at_stop(self.tokenizer.decode(req.output_token_ids), req.params.stop)[0]
