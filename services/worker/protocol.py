"""The pipe between a worker's servicer and its engine core (core.py), typed: one NamedTuple per message, the
kind its first field (they pickle as the plain tuples they are), parsed and checked where they arrive, and the
explicit list of methods the servicer may call in the core.

  servicer -> core   Add(seq, spec, export, pooled)     a request; export (core.ExportPlan): stream its KV out
                                                        (prefill: hand it off; unified: push it to the pool);
                                                        pooled (core.PooledPrefix): blocks leased from the pool
                     EndImport(seq, req_id, kwargs)     finish a staged KV import (KVTransfer.end_import's kwargs)
                     Call(seq, method, args)            one of ENGINE_CALLS (the engine's: load, its KV transfer
                                                        part, its adapters) or CORE_CALLS (the core's own:
                                                        counters, the kvstore's arena, verified imports), each
                                                        bound by name in core.calls()
                     Abort(req_id)
                     Stop()                             exit the loop (closing the pipe alone does not reach a core
                                                        whose reader thread is blocked on it)
  core -> servicer   Ready(load, rank_pids)             the engine is built (its EngineLoad, empty; TP ranks' pids)
                     Reply(seq, result, error)          a command's result or exception
                     Step(outputs, stats)               ONE message per step: every request's new tokens
                                                        (core.StepOutput), counters, load
                     KV(pieces)                         then the step's KV pieces (core.KVPiece), if any
                     Failed(req_ids, message)           requests the core dropped (a failed KV import)
                     Fatal(message)                     the engine could not be built
"""

from __future__ import annotations

from typing import Any, NamedTuple

ENGINE_CALLS = frozenset({  # what the servicer calls of the engine between steps (core.calls() binds them)
    "load", "kv_geometry", "begin_import", "cached_hashes", "track_block_events", "block_events",
    "load_adapter", "prefetch_adapter", "unload_adapter", "adapters"})
CORE_CALLS = frozenset({"core_stats", "map_arena", "import_slots", "import_data"})  # EngineCore's own


class Add(NamedTuple):
    kind: str
    seq: int
    spec: Any  # RequestSpec
    plan: Any  # ExportPlan | None
    pooled: Any  # PooledPrefix | None


class EndImport(NamedTuple):
    kind: str
    seq: int
    req_id: str
    kwargs: dict


class Call(NamedTuple):
    kind: str
    seq: int
    method: str
    args: tuple


class Abort(NamedTuple):
    kind: str
    req_id: str


class Stop(NamedTuple):
    kind: str


class Ready(NamedTuple):
    kind: str
    load: Any
    rank_pids: tuple = ()  # the engine's other tensor-parallel ranks (their CPU counts as the worker's)


class Reply(NamedTuple):
    kind: str
    seq: int
    result: Any
    error: Exception | None


class Step(NamedTuple):
    kind: str
    outputs: list
    stats: Any  # CoreStats


class KV(NamedTuple):
    kind: str
    pieces: list


class Failed(NamedTuple):
    kind: str
    req_ids: list
    message: str


class Fatal(NamedTuple):
    kind: str
    message: str


COMMANDS = {"add": Add, "end_import": EndImport, "call": Call, "abort": Abort, "stop": Stop}
EVENTS = {"ready": Ready, "reply": Reply, "step": Step, "kv": KV, "failed": Failed, "fatal": Fatal}


def message(kind: str, *fields):
    """A message of `kind` (ValueError for an unknown kind or the wrong fields)."""
    return _parse((kind, *fields), {**COMMANDS, **EVENTS})


def command(msg: tuple):
    """A servicer -> core message, checked: its kind, its fields, and for a Call that the method is callable."""
    msg = _parse(msg, COMMANDS)
    if isinstance(msg, Call):
        check_call(msg.method)
    return msg


def event(msg: tuple):
    """A core -> servicer message, checked."""
    return _parse(msg, EVENTS)


def check_call(method: str) -> None:
    if method not in ENGINE_CALLS and method not in CORE_CALLS:
        raise ValueError(f"the engine core does not serve {method!r} (known: "
                         f"{', '.join(sorted(ENGINE_CALLS | CORE_CALLS))})")


def _parse(msg: tuple, kinds: dict):
    if not isinstance(msg, tuple) or not msg or msg[0] not in kinds:
        raise ValueError(f"not a core message: {str(msg)[:80]}")
    kind = kinds[msg[0]]
    if len(msg) != len(kind._fields):
        raise ValueError(f"a {msg[0]!r} message has {len(kind._fields) - 1} field(s), got {len(msg) - 1}")
    return msg if type(msg) is kind else kind._make(msg)
