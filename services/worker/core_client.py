"""EngineCoreClient: the servicer's side of the engine core process (services/worker/core.py).

It starts the core (multiprocessing spawn: a fresh interpreter, no inherited gRPC threads), sends it
commands and routes what comes back on the asyncio loop: each request's outputs to its queue, KV
pieces to the prefill request's KV queue, command results to their futures. One message per engine
step carries every request's new tokens; a thread reads the pipe and hands each message to the loop
in one call, and another writes commands (a large KV import never blocks the loop on the pipe).

If the core dies, every pending command and every live stream fails with UNAVAILABLE at once and
on_dead() is called (the worker then deregisters and exits non-zero, for its supervisor).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import queue
import threading
import time

from services.common.errors import MeshError, ModelLoadError, Unavailable
from services.common.request import RequestSpec
from services.worker.core import CoreStats, core_main
from services.worker.metrics import WorkerMetrics
from services.worker.protocol import KV, Failed, Fatal, Ready, Reply, Step, check_call, event, message

log = logging.getLogger("meshserve.runner")



SPIN_COUNT = "20000"  # libgomp busy-wait iterations before a thread sleeps: tens of microseconds


def set_omp_wait_policy(policy: str, env) -> None:
    """engine.omp_wait_policy as libgomp's variables: spin is PASSIVE with a short GOMP_SPINCOUNT (one the user set
    wins), so that the ~250 parallel regions of a step do not each wake sleeping threads, while threads idle
    between steps sleep and leave the cores to the servicer and gateway."""
    env["OMP_WAIT_POLICY"] = "ACTIVE" if policy == "active" else "PASSIVE"
    if policy == "spin":
        env.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)

class _Cost:
    prefill_s_per_token = 0.0
    decode_s_per_step = 0.0
    floor_step_s = 0.0  # a decode step at deadline-aware batching's smallest batch
    longest_step_s = 0.0  # its longest recent step (services.worker.core.recent_longest)


class EngineCoreClient:
    def __init__(self, engine_config, loop: asyncio.AbstractEventLoop, metrics: WorkerMetrics | None = None,
                 threads: int | None = None, on_dead=None, omp_wait_policy: str = "spin"):
        self.config, self.loop, self.metrics, self.on_dead = engine_config, loop, metrics, on_dead
        self.clock = time.monotonic  # the core's clock too (CLOCK_MONOTONIC is system-wide)
        self.streams: dict[str, asyncio.Queue] = {}
        self.kv: dict[str, asyncio.Queue] = {}
        self.pending: dict[int, asyncio.Future] = {}
        self._seq = itertools.count()
        self.busy_s, self.tokens_out, self.aborted = 0.0, 0, 0  # from the core's latest step
        self.cost = _Cost()
        self.load = None  # the core's EngineLoad after its latest step (at first: when it became ready)
        self.dead: str | None = None
        set_omp_wait_policy(omp_wait_policy, os.environ)  # read by the core's OpenMP runtime at its start
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=core_main, args=(child, engine_config, os.getpid(), threads),
                                   name="engine-core", daemon=True)
        self.process.start()
        if metrics is not None:
            metrics.watch_cpu([os.getpid(), self.process.pid], threads or 1)
        child.close()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: asyncio.Future = loop.create_future()
        threading.Thread(target=self._read, name="core-reader", daemon=True).start()
        threading.Thread(target=self._write, name="core-writer", daemon=True).start()

    async def ready(self) -> EngineCoreClient:
        """Wait until the core has built its engine (ModelLoadError if it could not)."""
        await self._ready
        return self

    # ---- commands ------------------------------------------------------------------------------

    def _command(self, kind: str, *args) -> asyncio.Future:
        fut = self.loop.create_future()
        if self.dead:
            fut.set_exception(Unavailable(self.dead))
            return fut
        seq = next(self._seq)
        msg = message(kind, seq, *args)  # ValueError here, at the boundary, for a malformed command
        self.pending[seq] = fut
        self.outbox.put(msg)
        return fut

    def call(self, method: str, *args) -> asyncio.Future:
        """Run method(*args) in the core, between steps: one of protocol.ENGINE_CALLS (the engine's) or CORE_CALLS
        (the core's own); ValueError at once for any other. The future gets its result or exception."""
        check_call(method)
        return self._command("call", method, args)

    async def add(self, spec: RequestSpec, kv: asyncio.Queue | None = None, plan=None, pooled=None) -> asyncio.Queue:
        """Add a request; returns the queue its outputs (StepOutput) arrive on. With kv and plan (core.ExportPlan),
        its KV pieces arrive on kv as they are computed; pooled (core.PooledPrefix) is imported into the prefix
        cache first."""
        q: asyncio.Queue = asyncio.Queue()
        self.streams[spec.request_id] = q
        if kv is not None:
            self.kv[spec.request_id] = kv
        try:
            await self._command("add", spec, plan if kv is not None else None, pooled)
        except BaseException:
            self.forget(spec.request_id)
            raise
        return q

    async def end_import(self, req_id: str, **kwargs) -> asyncio.Queue:
        """Finish a staged KV import (engine.end_import kwargs); returns the request's output queue."""
        q: asyncio.Queue = asyncio.Queue()
        self.streams[req_id] = q
        try:
            await self._command("end_import", req_id, kwargs)
        except BaseException:
            self.forget(req_id)
            raise
        return q

    def abort(self, req_id: str) -> None:
        """Abort if still live (safe to call at any time)."""
        self.forget(req_id)
        if not self.dead:
            self.outbox.put(message("abort", req_id))

    def forget(self, req_id: str) -> None:
        self.streams.pop(req_id, None)
        self.kv.pop(req_id, None)
        if self.metrics is not None:
            self.metrics.forget(req_id)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the pipe (the core exits when it sees that) and wait for the process."""
        self.dead = self.dead or "the worker is stopping"
        self.outbox.put(message("stop"))  # the pipe's close does not reach the core while our reader blocks on it
        self.outbox.put(None)
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    # ---- the pipe ------------------------------------------------------------------------------

    def _write(self) -> None:
        while (msg := self.outbox.get()) is not None:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):
                return
        try:
            self.conn.close()
        except OSError:
            pass

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            self.loop.call_soon_threadsafe(self._on_message, msg)
        self.process.join(5)
        try:
            self.loop.call_soon_threadsafe(self._core_exited, self.process.exitcode)
        except RuntimeError:
            pass  # the loop is closed: the worker has stopped

    def _on_message(self, msg: tuple) -> None:
        msg = event(msg)
        if isinstance(msg, Step):
            self._on_step(msg.outputs, msg.stats)
        elif isinstance(msg, KV):
            self._on_kv(msg.pieces)
        elif isinstance(msg, Reply):
            fut = self.pending.pop(msg.seq, None)
            if fut is not None and not fut.done():
                if msg.error is not None:
                    fut.set_exception(msg.error)
                else:
                    fut.set_result(msg.result)
        elif isinstance(msg, Failed):
            for req_id in msg.req_ids:
                self._fail(req_id, MeshError(msg.message))
        elif isinstance(msg, Ready):
            self.load = msg.load
            if self.metrics is not None:  # the gauges read 0 from the start, not nothing until the first step
                self.metrics.load = msg.load
                if msg.rank_pids:  # a tensor-parallel replica: its ranks' CPU and cores are the worker's too
                    ranks = len(msg.rank_pids) + 1
                    self.metrics.watch_cpu([os.getpid(), self.process.pid, *msg.rank_pids],
                                           ranks * self.metrics.cpu_cores)
            if not self._ready.done():
                self._ready.set_result(None)
        elif isinstance(msg, Fatal):
            self.dead = msg.message
            if not self._ready.done():
                self._ready.set_exception(ModelLoadError(msg.message))

    def _on_kv(self, pieces: list) -> None:
        for piece in pieces:
            kv = self.kv.get(piece.req_id)
            if kv is not None:
                kv.put_nowait(piece)
            if piece.last:
                self.kv.pop(piece.req_id, None)

    def _on_step(self, outputs: list, stats: CoreStats) -> None:
        self.busy_s, self.tokens_out, self.aborted = stats.busy_s, stats.tokens_out, stats.aborted
        self.cost.prefill_s_per_token, self.cost.decode_s_per_step = stats.prefill_s_per_token, stats.decode_s_per_step
        self.cost.floor_step_s, self.cost.longest_step_s = stats.floor_step_s, stats.longest_step_s
        self.load = stats.load
        if self.metrics is not None:  # first: forget() below drops a finished request's last token time
            self.metrics.on_step(outputs, stats.load, self.clock())
            self.metrics.on_adapter_reads(stats.lora_load_s)
        for out in outputs:
            q = self.streams.get(out.req_id)
            if q is not None:
                q.put_nowait(out)
            if out.finished:
                self.streams.pop(out.req_id, None)  # its KV queue stays until its last piece (the kv message next)
                if self.metrics is not None:
                    self.metrics.forget(out.req_id)

    def _fail(self, req_id: str, error: Exception) -> None:
        for table in (self.streams, self.kv):
            q = table.pop(req_id, None)
            if q is not None:
                q.put_nowait(error)

    def _core_exited(self, code) -> None:
        if self.dead is None:
            self.dead = f"the engine core process exited (code {code})"
            log.error("%s: failing %d stream(s)", self.dead, len(self.streams))
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(Unavailable(self.dead))
        self.pending.clear()
        for req_id in list(self.streams) + list(self.kv):
            self._fail(req_id, Unavailable(self.dead))
        if not self._ready.done():
            self._ready.set_exception(ModelLoadError(self.dead))
        if self.on_dead is not None and self.dead != "the worker is stopping":
            self.on_dead(self.dead)
