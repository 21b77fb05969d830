"""The engine core: one LLMEngine stepping in a process of its own, beside the worker's gRPC servicer.

The servicer's process runs asyncio, gRPC and metrics; the core's runs only the engine loop, so the
two never share a GIL (vLLM's EngineCore split, for the same reason). They talk over a
multiprocessing pipe, one typed message each way (services/worker/protocol.py: the messages, and the
methods the servicer may call).

Commands run between steps, in order. The core never waits on the servicer: it polls the pipe
between steps and blocks only while idle. It dies with the worker (parent-death signal) and exits
when the pipe closes; the servicer fails every live stream with UNAVAILABLE when the core dies and
exits non-zero so that its supervisor starts the worker again (services/worker/__main__.py).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import pickle
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from services.common import envs
from services.common.errors import MeshError, RankDied
from services.worker.protocol import Abort, Add, EndImport, Stop, command, message

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
    new_top_logprobs: list | None = None  # per new token: (token ids, logprobs), when asked


@dataclass(frozen=True, slots=True)
class KVPiece:
    """Part of a request's KV for the kvstore: consecutive blocks (written in place in shared memory, or as data),
    or the end (last; with the metadata when the request is handed off)."""

    req_id: str
    first: int  # the first block's index in the transfer
    checksums: list  # checksum (XXH3-64) per block (its count is the piece's)
    data: bytes  # gRPC path: the blocks' bytes; b"" when written in place
    meta: dict | None  # KVMeta fields, with last (handoff)
    last: bool


@dataclass(frozen=True, slots=True)
class ExportPlan:
    """Where a request's KV goes, from the kvstore's reservation of its transfer."""

    handoff: bool  # prefill: after the first token the rest and the metadata follow and the request leaves;
    #                False: push the prompt's full blocks to the pool and keep running (unified)
    num_blocks: int  # blocks reserved
    present: tuple  # per block: the pool holds it already (not written)
    slots: tuple = ()  # shm: the arena slot per block ("" generation: the gRPC path, bytes in the pieces)
    generation: str = ""


@dataclass(frozen=True, slots=True)
class PooledPrefix:
    """A prompt's blocks leased from the pool: hashes[start:start + len(checksums)], in the arena's slots (shm) or
    in data (gRPC). The core copies them out with the request (the lease then ends); the engine imports them into
    its prefix cache when the request is admitted."""

    hashes: tuple  # the prompt's full-block hashes from block 0
    start: int
    checksums: tuple
    slots: tuple = ()
    generation: str = ""
    data: bytes = b""


class KVTransferFailed(MeshError):
    """Transferred KV failed its checksum (or its arena is gone): the receiver recomputes instead."""

    code = "DATA_LOSS"


def verified(blocks: list, checksums, first: int) -> list:
    """The blocks, after checking each one's checksum (XXH3-64)."""
    from services.common.arena import checksum

    for i, (buf, crc) in enumerate(zip(blocks, checksums)):
        if checksum(buf) != crc:
            raise KVTransferFailed(f"KV block {first + i} failed its checksum (corrupt or truncated)")
    return blocks


@dataclass(frozen=True, slots=True)
class CoreStats:
    busy_s: float  # time spent in steps, since start
    tokens_out: int  # tokens sampled, since start
    aborted: int  # requests aborted before they finished, since start
    prefill_s_per_token: float
    decode_s_per_step: float
    load: object  # EngineLoad after the step
    lora_load_s: tuple = ()  # seconds of each adapter read finished since the previous stats
    floor_step_s: float = 0.0  # predicted decode step at the smallest batch deadline-aware batching runs
    longest_step_s: float = 0.0  # its longest recent step, wall time (recent_longest)


RECENT_STEPS, RECENT_SKIP = 32, 2


def recent_longest(steps) -> float:
    """The longest of the recent steps but the RECENT_SKIP longest: a step the process was paused in (SIGSTOP, a
    swapped-out host) does not hold the gateway's progress bound up for the steps after it (0 with none)."""
    ranked = sorted(steps, reverse=True)
    return ranked[min(RECENT_SKIP, len(ranked) - 1)] if ranked else 0.0


class ExportJob:
    """Per-step KV export of one request (ExportPlan): every newly full block goes out in one piece per step,
    written into its arena slot (shm) or as bytes, skipping those the pool already holds. A handoff ends once its
    first token is sampled: the rest (a partial last block too) and the metadata follow, and the request leaves
    this engine; a push ends once the prompt's full blocks are out."""

    def __init__(self, req_id: str, plan: ExportPlan, arena=None):
        self.req_id, self.plan, self.arena, self.sent = req_id, plan, arena, 0

    def __call__(self, engine) -> tuple[list, bool]:
        """(pieces, done)."""
        progress = engine.transfer.running_progress(self.req_id)
        plan = self.plan
        if progress is None:
            if not plan.handoff and self.req_id not in engine.requests:  # finished (or aborted) before the push
                return [KVPiece(self.req_id, -1, [], b"", None, True)], True
            return [], False  # still queued (or preempted): nothing computed to send yet
        sampled, full = progress
        if not plan.handoff:
            upto = min(full, plan.num_blocks)
            pieces = self._blocks(engine, upto)
            if upto >= plan.num_blocks:
                return pieces + [KVPiece(self.req_id, -1, [], b"", None, True)], True
            return pieces, False
        if sampled >= 1:
            kv = engine.transfer.export_kv(self.req_id, first_block=plan.num_blocks)  # the metadata (no more blocks)
            total = -(-kv.num_computed // kv.block_size)
            if total != plan.num_blocks:
                raise KVTransferFailed(f"the request has {total} KV blocks, {plan.num_blocks} were reserved")
            pieces = self._blocks(engine, plan.num_blocks)
            meta = {"token_ids": kv.token_ids, "num_prompt": kv.num_prompt, "num_computed": kv.num_computed,
                    "block_size": kv.block_size, "dtype": kv.dtype, "num_blocks": plan.num_blocks,
                    "sample_seed": kv.sample_seed}
            engine.abort(self.req_id)
            return pieces + [KVPiece(self.req_id, -1, [], b"", meta, True)], True
        return self._blocks(engine, min(full, plan.num_blocks)), False

    def _blocks(self, engine, upto: int) -> list:
        """Pieces for blocks [sent, upto): runs of those the pool lacks."""
        from services.common.arena import checksum

        pieces, i, plan = [], self.sent, self.plan
        while i < upto:
            if plan.present[i]:
                i += 1
                continue
            j = i
            while j < upto and not plan.present[j]:
                j += 1
            if self.arena is not None:
                views = [self.arena.slot(plan.slots[k]) for k in range(i, j)]
                engine.transfer.read_blocks_into(self.req_id, i, views)
                pieces.append(KVPiece(self.req_id, i, [checksum(v) for v in views], b"", None, False))
            else:
                blocks = engine.transfer.kv_blocks(self.req_id, i, j)
                pieces.append(KVPiece(self.req_id, i, [checksum(b) for b in blocks], b"".join(blocks), None, False))
            i = j
        self.sent = max(self.sent, upto)
        return pieces


class StepLog:
    """One JSON line per step the engine ran (start on the monotonic clock, sequences, tokens, context tokens,
    prompt chunk tokens x their context, seconds), written when MESHSERVE_STEP_LOG names a folder: `meshserve sim
    calibrate` fits the simulator's cost
    model to the steps of a real worker under real load (its servicer and the other processes beside it)."""

    def __init__(self, path: Path):
        self.file = open(path, "a", buffering=1 << 16)

    @classmethod
    def from_env(cls) -> StepLog | None:
        folder = envs.STEP_LOG.get()
        return cls(Path(folder) / f"steps-{os.getpid()}.jsonl") if folder else None

    def record(self, step) -> None:
        now = time.monotonic()
        self.file.write(json.dumps({"start": round(now - step.step_s, 6), "seqs": step.num_running,
                                    "tokens": step.num_tokens, "context": step.context_tokens,
                                    "prefill_context": step.prefill_context,
                                    "step_s": round(step.step_s, 6)}) + "\n")

    def close(self) -> None:
        self.file.close()


def calls(engine, core) -> dict:
    """protocol.ENGINE_CALLS and CORE_CALLS by name, bound to the engine's parts and the core (an explicit table:
    a Call reaches these and nothing else of the engine)."""
    t, a = engine.transfer, engine.adapters
    return {"load": engine.load, "kv_geometry": t.kv_geometry, "begin_import": t.begin_import,
            "cached_hashes": t.cached_hashes, "track_block_events": t.track_block_events,
            "block_events": t.block_events, "load_adapter": a.load, "prefetch_adapter": a.prefetch,
            "unload_adapter": a.unload, "adapters": a.listing,
            "core_stats": core.core_stats, "map_arena": core.map_arena, "import_slots": core.import_slots,
            "import_data": core.import_data}


class EngineCore:
    """The loop of the core process (also usable in-process for tests: send is any callable)."""

    def __init__(self, engine, send):
        self.engine, self.send = engine, send
        self.live: set = set()  # requests whose outputs the servicer wants
        self.exports: dict[str, ExportJob] = {}
        self.arenas: dict = {}  # generation -> MappedArena of the kvstore
        self.failed_imports: set = set()  # requests one of whose KV imports failed (until aborted)
        self.busy_s, self.tokens_out, self.aborted = 0.0, 0, 0
        self.cost = engine.step_cost  # the engine fits its step costs (its scheduler caps batches by them)
        self.running = True
        self.step_log = StepLog.from_env()  # what the simulator's calibration fits (sim/cost.py)
        self.last_seen = None  # the engine's last StepStats counted
        self.recent_steps: collections.deque = collections.deque(maxlen=RECENT_STEPS)  # wall seconds, floor included
        # Tests and benchmarks: every step takes at least this long (a sleep: the step times of a model far larger
        # than the one loaded, without its CPU; MESHSERVE_STEP_FLOOR_S)
        self.step_floor_s = envs.STEP_FLOOR_S.get()
        self.calls = calls(engine, self)  # what a Call may reach: protocol.ENGINE_CALLS and CORE_CALLS, bound

    def handle(self, msg: tuple) -> None:
        try:
            msg = command(msg)
        except ValueError as e:  # a servicer of another version, or a bug: refused, the loop goes on
            log.error("refused a command: %s", e)
            if isinstance(msg, tuple) and len(msg) > 1 and isinstance(msg[1], int):
                self.send(message("reply", msg[1], None, MeshError(str(e))))
            return
        if isinstance(msg, Stop):
            self.running = False
            return
        if isinstance(msg, Abort):
            self.failed_imports.discard(msg.req_id)
            self._forget(msg.req_id)
            self.aborted += self.engine.abort(msg.req_id)
            return
        try:
            result = self._run(msg)
        except Exception as e:
            self.send(message("reply", msg.seq, None, _picklable(e)))
            return
        self.send(message("reply", msg.seq, result, None))

    def _run(self, msg):
        if isinstance(msg, Add):
            spec, plan, pooled = msg.spec, msg.plan, msg.pooled
            blocks = self._pooled_blocks(pooled) if pooled is not None else []
            self.engine.add(spec, pooled=(list(pooled.hashes), pooled.start, blocks) if blocks else None)
            self.live.add(spec.request_id)
            if plan is not None:
                self.exports[spec.request_id] = ExportJob(spec.request_id, plan, self._arena(plan.generation))
            return len(blocks)
        if isinstance(msg, EndImport):
            if msg.req_id in self.failed_imports:  # its blocks are not all there: never let it run
                raise KVTransferFailed(f"request {msg.req_id}'s KV import failed")
            self.engine.transfer.end_import(msg.req_id, **msg.kwargs)
            self.live.add(msg.req_id)
            return None
        result = self.calls[msg.method](*msg.args)  # command() checked the name
        return None if msg.method == "begin_import" else result  # the engine's Request stays here

    # ---- the kvstore's arena and imports (protocol.CORE_CALLS) -------------------------------------------

    def map_arena(self, path: str, generation: str, slot_bytes: int, slots: int) -> None:
        """Map the kvstore's segment (as its Attach told the servicer); the one it replaces (a restarted kvstore's
        predecessor) is unmapped once no export writes to it (retire_arenas)."""
        from services.common.arena import MappedArena

        if generation in self.arenas:
            return
        self.arenas[generation] = MappedArena(path, generation, slot_bytes, slots)
        self.retire_arenas()

    def retire_arenas(self) -> None:
        """Unmap every arena but the newest that no export still writes to. A mapping is populated whole, so each
        one left mapped kept a dead kvstore's segment resident: 1 GB more per worker after every kvstore restart
        (issue 36's soak). An import from one retired fails (KVTransferFailed) and is computed instead."""
        if len(self.arenas) < 2:
            return
        current = next(reversed(self.arenas))
        writing = {id(e.arena) for e in self.exports.values()}
        for generation in [g for g, a in self.arenas.items() if g != current and id(a) not in writing]:
            self.arenas.pop(generation).close()

    def _arena(self, generation: str):
        if not generation:
            return None
        arena = self.arenas.get(generation)
        if arena is None:
            raise KVTransferFailed(f"the kvstore's arena {generation} is not mapped here")
        return arena

    def import_slots(self, req_id: str, first: int, generation: str, slots: list, checksums: list) -> int:
        """Import blocks from arena slots (checked against their checksum, XXH3-64) into a request's reserved
        blocks."""
        try:
            arena = self._arena(generation)
            views = verified([arena.slot(s) for s in slots], checksums, first)
            return self.engine.transfer.import_blocks(req_id, first, views)
        except Exception:
            self.failed_imports.add(req_id)
            raise

    def import_data(self, req_id: str, first: int, data: bytes, checksums: list) -> int:
        """import_slots for blocks that came as bytes (the gRPC path)."""
        try:
            blocks = verified(self.engine.transfer.split_blocks(data), checksums, first)
            return self.engine.transfer.import_blocks(req_id, first, blocks)
        except Exception:
            self.failed_imports.add(req_id)
            raise

    def _pooled_blocks(self, p: PooledPrefix) -> list:
        """A lease's blocks, copied out of the arena (the lease ends when add() returns; the engine imports them
        when the request is admitted) up to the first that fails its checksum (the engine computes from there)."""
        from services.common.arena import checksum

        if p.generation:
            arena = self.arenas.get(p.generation)
            views = [arena.slot(s) for s in p.slots] if arena is not None else []
        else:
            views = self.engine.transfer.split_blocks(p.data)
        out = []
        for view, crc in zip(views, p.checksums):
            if checksum(view) != crc:
                log.warning("pooled KV block %d failed its checksum: computing from there", p.start + len(out))
                break
            out.append(bytes(view))
        return out

    def core_stats(self) -> CoreStats:
        return self.stats(drain=False)

    def _forget(self, req_id: str) -> None:
        self.live.discard(req_id)
        self.exports.pop(req_id, None)

    def step(self) -> None:
        engine = self.engine
        t0 = time.monotonic()
        try:
            outputs = engine.step()
            if self.step_floor_s:
                time.sleep(max(self.step_floor_s - (time.monotonic() - t0), 0))
        except RankDied:
            raise  # a tensor-parallel rank is gone: the core exits and the worker (the whole replica) goes down
        except Exception as e:
            log.exception("engine step failed; aborting its requests")
            failed = sorted(self.live)
            for req_id in failed:
                engine.abort(req_id)
                self._forget(req_id)
            self.send(message("failed", failed, f"engine step failed: {e}"))
            return
        last = engine.last_step
        if last is not None and last is not self.last_seen:  # a step that scheduled nothing leaves the last one
            self.last_seen = last
            self.busy_s += last.step_s
            self.recent_steps.append(time.monotonic() - t0)
            if self.step_log is not None:
                self.step_log.record(last)
        outs = []
        for out in outputs:
            self.tokens_out += len(out.new_token_ids)
            if out.req_id not in self.live:
                continue
            req = out.request
            outs.append(StepOutput(out.req_id, list(out.new_token_ids), out.new_logprobs, out.finished,
                                   out.finish_reason, req.num_prompt, req.num_cached_prompt, req.num_output,
                                   req.arrival_s, out.new_top_logprobs))
        self.send(message("step", outs, self.stats()))  # first: a first token must not wait for its KV to be copied out
        pieces = self._export()
        for out in outs:
            if out.finished:
                self._forget(out.req_id)
        self.retire_arenas()
        if pieces:
            self.send(message("kv", pieces))
        if not engine.has_unfinished():  # the last word before idling is the idle load (no step follows to say it)
            self.send(message("step", [], self.stats()))

    def _export(self) -> list:
        engine, pieces = self.engine, []
        for req_id, export in list(self.exports.items()):
            try:
                got, done = export(engine)
            except Exception as e:
                if not export.plan.handoff:  # a push is best effort: the request runs on, the pool lacks its blocks
                    log.warning("pushing request %s's KV to the pool failed: %s", req_id, e)
                    self.exports.pop(req_id, None)
                    pieces.append(KVPiece(req_id, -1, [], b"", None, True))
                    continue
                log.exception("KV export of request %s failed; aborting it", req_id)
                engine.abort(req_id)
                self._forget(req_id)
                self.send(message("failed", [req_id], f"KV export failed: {e}"))
                continue
            pieces += got
            if done:
                self.exports.pop(req_id, None)
        return pieces

    def stats(self, drain: bool = True) -> CoreStats:
        """drain: hand over the adapter read times since the previous stats (the step messages carry them)."""
        lora = self.engine.lora if drain else None
        return CoreStats(self.busy_s, self.tokens_out, self.aborted, self.cost.prefill_s_per_token,
                         self.cost.decode_s_per_step, self.engine.load(),
                         tuple(lora.drain_load_seconds()) if lora is not None else (),
                         self.engine.scheduler.cap.floor_step_s, recent_longest(self.recent_steps))

    def run(self, conn, idle_poll_s: float = 0.05) -> None:
        """Serve commands and step until the pipe closes."""
        engine = self.engine
        while self.running:
            busy, aborted = engine.has_unfinished(), False
            try:
                while conn.poll(0 if busy else idle_poll_s):
                    msg = conn.recv()
                    self.handle(msg)
                    busy, aborted = engine.has_unfinished(), aborted or msg[0] == "abort"
            except (EOFError, OSError):
                return  # the servicer is gone
            self.retire_arenas()  # an abort may have ended the last export into a superseded arena
            if busy:
                self.step()
            elif aborted:  # no step follows (an abort emptied the engine): the servicer's load would stay stale
                self.send(message("step", [], self.stats()))


def _picklable(e: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        err = MeshError(str(e))
        err.code = getattr(e, "code", "INTERNAL")
        return err


def make_engine(engine_config, threads: int | None):
    """The engine of the config's backend: the mock imports no torch (64 of them fit on one machine)."""
    if engine_config.backend == "mock":
        from services.engine.mock import MockEngine

        return MockEngine(engine_config)
    import torch

    torch.set_num_threads(threads or 1)
    from services.engine.engine import LLMEngine

    return LLMEngine(engine_config)


def core_main(conn, engine_config, parent_pid: int, threads: int | None) -> None:
    """Entry point of the core process (multiprocessing spawn)."""
    from services.common.die_with_parent import arm

    if not arm(parent_pid):
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the servicer decides when to stop (it closes the pipe)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s core %(levelname)s %(message)s")
    try:
        engine = make_engine(engine_config, threads)
    except Exception as e:
        conn.send(message("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(message("ready", engine.load(), tuple(engine.group.pids[1:]) if engine.group else ()))
    t0 = time.monotonic()
    core = EngineCore(engine, conn.send)
    try:
        core.run(conn)
    finally:
        engine.close()  # its tensor-parallel ranks, at once (they would also die with this process)
    if core.step_log is not None:
        core.step_log.close()
    log.info("engine core stopping after %.0f s", time.monotonic() - t0)
