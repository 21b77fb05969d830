"""MockEngine: the engine with its forward pass replaced by a step-time model, for the mesh at scale.

Everything but the model is the real engine's: the Scheduler (slot arbitration, chunked prefill, preemption,
deadline-aware batch caps), the KVCacheManager over a BlockPool (prefix caching, block events for the prefix
index), the request book and finish rules (base.py), KV export and staged import (kv_transfer.py), the online step
cost fit the router's estimates read. What replaces the model:

- a step takes the time the step-time model gives it (services.engine.cost_model: a preset, stated as an
  assumption, or a calibration file; the simulator's terms) for what the scheduler put in it, times time_scale,
  by sleeping: the engine holds no weights and a step costs microseconds of CPU. When the loop went straight on,
  the next step starts where the last one was due to end, so the core's own time between steps is inside the
  modelled time, not added to it; a step that could not start on time (a starved CPU) is counted in lag_s;
- the token at position p of a request is a hash of its prompt, p and (when sampling) its seed: the same request
  gives the same tokens on every worker, so a P/D handoff or a resumed stream continues the same text; EOS and
  stop ids are never drawn, so a request runs to max_tokens;
- KV blocks are bytes of the model's real size (kv "bytes": the kvstore and its links carry the real load) or 64
  bytes each (kv "metadata"), filled with a pattern that checksums check end to end.

- LoRA adapters: the real residency (services.engine.lora_residency: registered, host memory, compute slots,
  least recently used out, a running request pinning its slot) over slots that hold nothing; an adapter is a PEFT
  folder whose adapter_config.json is read and validated (no weights), its read from storage takes the step-time
  model's lora_read_s (times the time scale) on the loader thread, and each copy into a slot adds lora_slot_s to the
  step that makes it. The adapters' own arithmetic in a step is not modelled (S-LoRA and Punica put it at a few
  percent of a step).

Not modelled (refused with a clear error): structured outputs, logprobs.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path

from services.common.errors import InvalidRequest
from services.config.engine import EngineConfig
from services.engine.base import EngineBase, RequestOutput, RuntimeInfo
from services.engine.block_pool import BlockPool
from services.engine.cost_model import cost_model
from services.engine.hf_config import eos_ids, parse_config, read_json
from services.engine.kv_manager import KVCacheManager
from services.engine.kv_transfer import KVTransfer
from services.engine.lora_adapters import LoRAAdapters, configured
from services.engine.lora_residency import TARGETS, AdapterInfo, AdapterResidency, EmptySlots, read_adapter_config
from services.engine.request import Request
from services.engine.scheduler import Scheduler
from services.engine.step_cost import StepCostFit
from services.policy.arbitration import make_arbitration_policy

log = logging.getLogger("meshserve.engine")

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2}
METADATA_BLOCK_BYTES = 64
MASK64 = (1 << 64) - 1
LAG_REPORT_S = 30.0  # say how late steps ran at most this often


def mix64(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class PatternBlocks:
    """KV blocks with no memory behind them: a block reads as an 8-byte word repeated to the block's size, the
    word written last (an import) or one derived from the block's number (computed here)."""

    def __init__(self, block_bytes: int):
        self.block_bytes = block_bytes
        self.words: dict[int, bytes] = {}

    def _word(self, block: int) -> bytes:
        return self.words.get(block) or mix64(block).to_bytes(8, "little")

    def read(self, block: int) -> bytes:
        return self._word(block) * (self.block_bytes // 8)

    def read_into(self, block: int, out) -> None:
        out[:] = self.read(block)

    def write(self, block: int, data) -> None:
        if len(data) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got {len(data)}")
        self.words[block] = bytes(data[:8])


class NoGrammars:
    """The mock engine runs no structured outputs: a request with a constraint is refused."""

    spent_s = 0.0

    def start(self, req: Request) -> None:
        if req.params.guided is not None:
            raise InvalidRequest("the mock engine runs no structured outputs (engine.backend mock)")


def inspect_config(name: str, path: str, max_rank: int) -> AdapterInfo:
    """An adapter from its PEFT config alone (validated as the model engine validates it; no weights read)."""
    cfg = read_adapter_config(name, path, max_rank)
    targets = tuple(t for t in TARGETS if cfg.listed is None or t in cfg.listed)
    return AdapterInfo(name, str(cfg.folder), cfg.rank, cfg.alpha, cfg.scale, targets, 0)


class Sampled:
    def __init__(self, tokens: list):
        self.tokens, self.logprobs, self.top = tokens, None, None


class MockEngine(EngineBase):
    def __init__(self, config: EngineConfig, clock=time.monotonic, sleep=time.sleep):
        self.config, self.clock, self.sleep = config, clock, sleep
        mc = config.mock
        try:
            self.cost = cost_model(mc.profile)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        self.time_scale = mc.time_scale
        path = Path(config.model_dir) / "config.json"
        raw = read_json(path)
        self.model_config = m = parse_config(raw, path)
        cc, sc = config.cache, config.scheduler
        model_block_bytes = 2 * m.num_layers * cc.block_size * m.num_kv_heads * m.head_dim * ELEMENT_BYTES[
            config.dtype]
        num_blocks = cc.num_blocks or max(1, cc.kv_cache_bytes // model_block_bytes)
        block_bytes = model_block_bytes if mc.kv == "bytes" else METADATA_BLOCK_BYTES
        self.info = RuntimeInfo(num_blocks, eos_ids(Path(config.model_dir), raw), m.vocab_size,
                                min(m.max_positions, num_blocks * cc.block_size))
        self.kv = KVCacheManager(BlockPool(num_blocks), cc.block_size, cc.enable_prefix_caching)
        self.tokenizer, self.group = None, None
        self.grammars = NoGrammars()
        lc = config.lora
        self.lora = AdapterResidency(lc.max_loras, lc.max_cpu_loras, EmptySlots(),
                                     partial(inspect_config, max_rank=lc.max_lora_rank), self._read_adapter,
                                     in_use=self._adapter_in_use, clock=clock) if lc.max_loras else None
        self.step_cost = StepCostFit()
        self.scheduler = Scheduler(self.kv, make_arbitration_policy(sc.policy), sc.max_num_seqs,
                                   sc.max_num_batched_tokens, clock=clock, lora=self.lora, step_cost=self.step_cost,
                                   deadline_min_batch=sc.deadline_min_batch, before_admit=self._admit_pooled)
        self.init_book()
        self.transfer = KVTransfer(self.requests, self.scheduler, self.kv, PatternBlocks(block_bytes), config.dtype,
                                   block_bytes, self.lora, self._new_request)
        self.adapters = LoRAAdapters(self.lora)
        for name, folder in configured(lc):
            self.adapters.load(name, folder)
        self._keys: dict[str, int] = {}  # request id -> its prompt's hash
        self._eos = frozenset(self.info.eos_token_ids)
        self._end = None  # when the last step was due to end, while the engine had work left after it
        self.lag_s, self._lag_said, self._lag_at = 0.0, 0.0, clock()
        log.info("mock engine: %s (%s), time scale %g, KV %s (%d bytes a block), %d blocks; no weights, no forward "
                 "pass", mc.profile, self.cost.source.get("preset") or "calibration file", self.time_scale, mc.kv,
                 block_bytes, num_blocks)

    def _new_request(self, spec) -> Request:
        p = spec.sampling
        if p.wants_logprobs or p.top_logprobs:
            raise InvalidRequest("the mock engine computes no logprobs (engine.backend mock)")
        return super()._new_request(spec)

    def _read_adapter(self, info: AdapterInfo) -> dict:
        """An adapter's read from storage, as long as the step-time model says (on the loader thread)."""
        self.sleep(self.cost.lora_read_s * self.time_scale)
        return {}

    def step(self) -> list[RequestOutput]:
        slot_loads = self.lora.slot_loads if self.lora is not None else 0
        failed = self._end_failed_adapters() if self.lora is not None else []
        out = self.scheduler.schedule()
        if out.empty:
            if self.lora is not None and not failed:
                self.lora.wait(0.01)  # nothing to run but an adapter being read: wait for it, do not spin
            return failed
        seqs = out.seqs
        context = sum(s.num_computed for s in seqs)
        prefill_context = sum(s.num_new * s.num_computed for s in seqs if s.num_new > 1)
        modelled = self.cost.step_s(len(seqs), out.num_tokens - len(seqs), context, prefill_context)
        if self.lora is not None:  # adapters copied into slots for this step (admissions and read-ahead)
            modelled += (self.lora.slot_loads - slot_loads) * self.cost.lora_slot_s
        duration = modelled * self.time_scale
        now = self.clock()
        start = now
        if self._end is not None:  # went straight on: start where the last step was due to end, unless too late
            late = now - self._end
            if late <= duration:
                start = min(now, self._end)
            else:
                self.lag_s += late
        if start + duration > now:
            self.sleep(start + duration - now)
        sampling = [s.request for s in seqs if s.sample]
        tokens = [self._token(req) for req in sampling]
        self.scheduler.update(out)
        results = self._postprocess(sampling, Sampled(tokens)) if sampling else []
        for r in results:
            if r.finished:
                self._keys.pop(r.req_id, None)
        self._record(out, duration, duration, 0.0)
        self._end = start + duration if self.scheduler.has_work else None
        self._say_lag()
        return failed + results

    def _token(self, req: Request) -> int:
        key = self._keys.get(req.req_id)
        if key is None:
            key = self._keys[req.req_id] = hash(tuple(req.prompt_token_ids)) & MASK64
        salt = 0 if req.params.greedy else req.sample_seed
        tok = mix64(key ^ mix64(len(req.tokens) ^ (salt << 20))) % self.info.vocab_size
        stop = req.params.stop_token_ids
        while tok in self._eos or (stop and tok in stop):
            tok = (tok + 1) % self.info.vocab_size
        return tok

    def abort(self, req_id: str) -> bool:
        self._keys.pop(req_id, None)
        return super().abort(req_id)

    def _say_lag(self) -> None:
        now = self.clock()
        if now - self._lag_at >= LAG_REPORT_S:
            if self.lag_s > self._lag_said:
                log.warning("mock engine: steps started %.2f s late in the last %.0f s (the CPU could not keep up: "
                            "raise engine.mock_time_scale)", self.lag_s - self._lag_said, now - self._lag_at)
            self._lag_said, self._lag_at = self.lag_s, now

    def close(self) -> None:
        pass
