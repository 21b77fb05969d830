"""EngineRunner: drives a synchronous LLMEngine in its own thread for an asyncio server.

Calls into the engine are queued as commands and run between steps, in the engine thread (the
engine is never touched from two threads). Each request's outputs flow back to its asyncio
queue; an optional per-request hook runs in the engine thread after every step (the prefill
role uses it to export KV blocks as chunks finish). Aborting frees the request's blocks before
the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from services.common.request import RequestSpec
from services.engine.engine import LLMEngine
from services.worker.measure import StepCostFit
from services.worker.metrics import WorkerMetrics

log = logging.getLogger("meshserve.runner")


class EngineRunner:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop, metrics: WorkerMetrics | None = None):
        self.engine, self.loop, self.metrics = engine, loop, metrics
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.streams: dict[str, asyncio.Queue] = {}
        self.hooks: dict[str, object] = {}
        self.running = True
        self.busy_s = 0.0  # time spent in engine steps (read by the heartbeat for the decode rate)
        self.tokens_out = 0  # tokens sampled by those steps
        self.aborted = 0  # requests aborted before they finished
        self.cost = StepCostFit()  # step time model, reported in heartbeats for the gateway's predictions
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.thread.start()

    def call(self, fn) -> asyncio.Future:
        """Run fn(engine) in the engine thread; the future gets its result or exception."""
        fut = self.loop.create_future()
        self.commands.put((fn, fut))
        self.wake.set()
        return fut

    async def add(self, spec: RequestSpec, hook=None) -> asyncio.Queue:
        """Add a request; returns the queue its RequestOutputs arrive on."""
        q: asyncio.Queue = asyncio.Queue()
        req_id = spec.request_id

        def add(engine):
            req = engine.add(spec)
            self.streams[req_id] = q
            if hook:
                self.hooks[req_id] = hook
            return req

        await self.call(add)
        return q

    async def end_import(self, req_id: str, **kwargs) -> asyncio.Queue:
        """Finish a staged KV import (engine.end_import kwargs); returns the request's output queue."""
        q: asyncio.Queue = asyncio.Queue()

        def end(engine):
            req = engine.end_import(req_id, **kwargs)
            self.streams[req_id] = q
            return req

        await self.call(end)
        return q

    def abort(self, req_id: str) -> None:
        """Abort if still live (safe to call from the event loop at any time)."""
        def abort(engine):
            self.forget(req_id)
            aborted = engine.abort(req_id)
            self.aborted += aborted
            return aborted
        self.call(abort)

    def forget(self, req_id: str) -> None:
        """Stop routing outputs and hooks to a request (call from the engine thread)."""
        self.streams.pop(req_id, None)
        self.hooks.pop(req_id, None)
        if self.metrics is not None:
            self.metrics.forget(req_id)

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the loop and wait for it: a daemon thread left inside a torch call while the interpreter
        shuts down can abort the process ("terminate called without an active exception")."""
        self.running = False
        self.wake.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout_s)

    def _loop(self) -> None:
        while self.running:
            self._run_commands()
            if not self.engine.has_unfinished():
                if self.metrics is not None:
                    self.metrics.load = self.engine.load()
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:
                log.exception("engine step failed; aborting its requests")
                self._fail_all()
                continue
            last = self.engine.last_step
            if last is not None:
                self.busy_s += last.step_s
                self.cost.update(last.num_running, last.num_tokens, last.step_s)
            self.tokens_out += sum(len(out.new_token_ids) for out in outputs)
            if self.metrics is not None:
                self.metrics.on_step(outputs, self.engine.load(), self.engine.clock())
            for out in outputs:
                q = self.streams.get(out.req_id)
                if q is not None:
                    self.loop.call_soon_threadsafe(q.put_nowait, out)
                if out.finished:
                    self.forget(out.req_id)
            for req_id, hook in list(self.hooks.items()):
                self._run_hook(req_id, hook)

    def _run_hook(self, req_id: str, hook) -> None:
        try:
            hook(self.engine, req_id)
        except Exception as e:
            log.exception("hook of request %s failed; aborting it", req_id)
            q = self.streams.get(req_id)
            self.engine.abort(req_id)
            self.forget(req_id)
            if q is not None:
                self.loop.call_soon_threadsafe(q.put_nowait, e)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self.commands.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn(self.engine)
                self.loop.call_soon_threadsafe(_settle, fut, result, None)
            except Exception as e:
                self.loop.call_soon_threadsafe(_settle, fut, None, e)

    def _fail_all(self) -> None:
        for req_id in list(self.streams):
            q = self.streams[req_id]
            self.engine.abort(req_id)
            self.forget(req_id)
            self.loop.call_soon_threadsafe(q.put_nowait, RuntimeError("engine step failed"))


def _settle(fut: asyncio.Future, result, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
