"""The engine core: one LLMEngine stepping in a process of its own, beside the worker's gRPC servicer.

The servicer's process runs asyncio, gRPC and metrics; the core's runs only the engine loop, so the
two never share a GIL (vLLM's EngineCore split, for the same reason). They talk over a
multiprocessing pipe in pickled tuples:

  servicer -> core   ("add", seq, spec, export_kv)   a request; export_kv: stream its KV out (prefill role)
                     ("end_import", seq, req_id, kwargs)
                     ("call", seq, method, args)     any other LLMEngine method (load, begin_import, ...), or
                                                     core_stats: the core's counters and load now
                     ("abort", req_id)
  core -> servicer   ("ready", None)                 the engine is built
                     ("reply", seq, result, error)   a command's result or exception
                     ("step", outputs, kv, stats)    ONE message per step: every request's new tokens
                                                     (StepOutput), KV chunks to send, counters, load
                     ("fatal", message)              the engine could not be built

Commands run between steps, in order. The core never waits on the servicer: it polls the pipe
between steps and blocks only while idle. It dies with the worker (parent-death signal) and exits
when the pipe closes; the servicer fails every live stream with UNAVAILABLE when the core dies and
exits non-zero so that its supervisor starts the worker again (services/worker/__main__.py).
"""

from __future__ import annotations

import logging
import pickle
import signal
import time
from dataclasses import dataclass

from services.common.errors import MeshError

log = logging.getLogger("meshserve.core")


@dataclass(frozen=True, slots=True)
class StepOutput:
    """A request's part of one step, as the servicer needs it (no engine objects cross the pipe)."""

    req_id: str
    new_token_ids: list
    new_logprobs: list | None
    finished: bool
    finish_reason: str | None
    num_prompt: int
    num_cached_prompt: int
    num_output: int
    arrival_s: float  # on the core's clock (time.monotonic: the same on both sides of the pipe)


@dataclass(frozen=True, slots=True)
class KVPiece:
    """Part of a prefill request's KV for the kvstore: blocks (index >= 0) or the final metadata (last)."""

    req_id: str
    index: int  # message index of a block chunk; -1 for the metadata
    data: bytes
    meta: dict | None  # KVMeta fields, with last
    last: bool


@dataclass(frozen=True, slots=True)
class CoreStats:
    busy_s: float  # time spent in steps, since start
    tokens_out: int  # tokens sampled, since start
    aborted: int  # requests aborted before they finished, since start
    prefill_s_per_token: float
    decode_s_per_step: float
    load: object  # EngineLoad after the step


class KVExport:
    """Per-step KV export of one prefill request (the old engine-thread hook): every newly full block goes out in
    one piece per step; once its first token is sampled, the rest and the metadata follow and the request leaves
    this engine."""

    def __init__(self, req_id: str):
        self.req_id, self.sent, self.chunks_sent = req_id, 0, 0

    def __call__(self, engine) -> tuple[list, bool]:
        """(pieces, done)."""
        progress = engine.running_progress(self.req_id)
        if progress is None:
            return [], False  # still queued (or preempted): nothing computed to send yet
        sampled, full = progress
        if sampled >= 1:
            kv = engine.export_kv(self.req_id, first_block=self.sent)
            pieces = self._blocks(kv.blocks)
            meta = {"token_ids": kv.token_ids, "num_prompt": kv.num_prompt, "num_computed": kv.num_computed,
                    "block_size": kv.block_size, "dtype": kv.dtype, "num_blocks": self.sent,
                    "sample_seed": kv.sample_seed}
            engine.abort(self.req_id)
            return pieces + [KVPiece(self.req_id, -1, b"", meta, True)], True
        if full > self.sent:
            return self._blocks(engine.kv_blocks(self.req_id, self.sent, full)), False
        return [], False

    def _blocks(self, blocks: list) -> list:
        if not blocks:
            return []
        piece = KVPiece(self.req_id, self.chunks_sent, b"".join(blocks), None, False)
        self.chunks_sent += 1
        self.sent += len(blocks)
        return [piece]


class EngineCore:
    """The loop of the core process (also usable in-process for tests: send is any callable)."""

    def __init__(self, engine, send):
        from services.worker.measure import StepCostFit

        self.engine, self.send = engine, send
        self.live: set = set()  # requests whose outputs the servicer wants
        self.exports: dict[str, KVExport] = {}
        self.busy_s, self.tokens_out, self.aborted = 0.0, 0, 0
        self.cost = StepCostFit()
        self.running = True

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "abort":
            self._forget(msg[1])
            self.aborted += self.engine.abort(msg[1])
            return
        seq = msg[1]
        try:
            if kind == "add":
                _, _, spec, export_kv = msg
                self.engine.add(spec)
                self.live.add(spec.request_id)
                if export_kv:
                    self.exports[spec.request_id] = KVExport(spec.request_id)
                result = None
            elif kind == "end_import":
                _, _, req_id, kwargs = msg
                self.engine.end_import(req_id, **kwargs)
                self.live.add(req_id)
                result = None
            elif kind == "call":
                _, _, method, args = msg
                result = self.stats() if method == "core_stats" else getattr(self.engine, method)(*args)
                if method == "begin_import":
                    result = None  # the engine's Request stays here
            else:
                raise ValueError(f"unknown core command {kind!r}")
        except Exception as e:
            self.send(("reply", seq, None, _picklable(e)))
            return
        self.send(("reply", seq, result, None))

    def _forget(self, req_id: str) -> None:
        self.live.discard(req_id)
        self.exports.pop(req_id, None)

    def step(self) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except Exception as e:
            log.exception("engine step failed; aborting its requests")
            failed = sorted(self.live)
            for req_id in failed:
                engine.abort(req_id)
                self._forget(req_id)
            self.send(("failed", failed, f"engine step failed: {e}"))
            return
        last = engine.last_step
        if last is not None:
            self.busy_s += last.step_s
            self.cost.update(last.num_running, last.num_tokens, last.step_s)
        outs = []
        for out in outputs:
            self.tokens_out += len(out.new_token_ids)
            if out.req_id not in self.live:
                continue
            req = out.request
            outs.append(StepOutput(out.req_id, list(out.new_token_ids), out.new_logprobs, out.finished,
                                   out.finish_reason, req.num_prompt, req.num_cached_prompt, req.num_output,
                                   req.arrival_s))
            if out.finished:
                self._forget(out.req_id)
        pieces = []
        for req_id, export in list(self.exports.items()):
            try:
                got, done = export(engine)
            except Exception as e:
                log.exception("KV export of request %s failed; aborting it", req_id)
                engine.abort(req_id)
                self._forget(req_id)
                self.send(("failed", [req_id], f"KV export failed: {e}"))
                continue
            pieces += got
            if done:
                self._forget(req_id)
        self.send(("step", outs, pieces, self.stats()))

    def stats(self) -> CoreStats:
        return CoreStats(self.busy_s, self.tokens_out, self.aborted, self.cost.prefill_s_per_token,
                         self.cost.decode_s_per_step, self.engine.load())

    def run(self, conn, idle_poll_s: float = 0.05) -> None:
        """Serve commands and step until the pipe closes."""
        engine = self.engine
        while self.running:
            busy = engine.has_unfinished()
            try:
                while conn.poll(0 if busy else idle_poll_s):
                    self.handle(conn.recv())
                    busy = engine.has_unfinished()
            except (EOFError, OSError):
                return  # the servicer is gone
            if busy:
                self.step()


def _picklable(e: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        err = MeshError(str(e))
        err.code = getattr(e, "code", "INTERNAL")
        return err


def core_main(conn, engine_config, parent_pid: int, threads: int | None) -> None:
    """Entry point of the core process (multiprocessing spawn)."""
    from services.common.die_with_parent import arm

    if not arm(parent_pid):
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the servicer decides when to stop (it closes the pipe)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s core %(levelname)s %(message)s")
    import torch

    torch.set_num_threads(threads or 1)
    from services.engine.engine import LLMEngine

    try:
        engine = LLMEngine(engine_config)
    except Exception as e:
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    t0 = time.monotonic()
    EngineCore(engine, conn.send).run(conn)
    log.info("engine core stopping after %.0f s", time.monotonic() - t0)
