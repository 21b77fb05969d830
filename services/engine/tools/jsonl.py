"""Offline generation over JSONL (docs/INTERFACES.md): one request per line in, one result per line out.

A line that fails validation gets {"id", "error": {"code", "message"}}; the others still run.
deadline_ms is relative to the run's start: a request not finished by then is aborted with
DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

from tqdm import tqdm

from services.common.errors import InvalidRequest, MeshError, error_dict
from services.common.sampling import PARAM_FIELDS, parse_params
from services.engine.engine import LLMEngine
from services.engine.request import Request

_LINE_FIELDS = {"id", "prompt", "prompt_token_ids", "stop", "stop_token_ids", "priority", "deadline_ms", "adapter",
                "guided", *PARAM_FIELDS}


@dataclass
class Line:
    index: int  # 0-based input line number
    req_id: str  # the caller's id, or a generated one
    result: dict | None = None  # the output object once done
    request: Request | None = None
    deadline_s: float | None = None  # engine clock


def submit(engine: LLMEngine, line: Line, text: str | bytes) -> None:
    """Parse one input line and add it to the engine; failures become the line's error result."""
    try:
        if isinstance(text, bytes):
            text = _utf8(text)
        obj = json.loads(text)
        if not isinstance(obj, dict):
            raise InvalidRequest("each line must be a JSON object")
        line.req_id = str(obj.get("id", line.req_id))
        unknown = set(obj) - _LINE_FIELDS
        if unknown:
            raise InvalidRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
        priority = obj.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool) or priority < 0:
            raise InvalidRequest(f"field 'priority' must be an integer >= 0, got {priority!r}")
        deadline = obj.get("deadline_ms")
        if deadline is not None and (not isinstance(deadline, (int, float)) or isinstance(deadline, bool)
                                     or deadline <= 0):
            raise InvalidRequest(f"field 'deadline_ms' must be a positive number, got {deadline!r}")
        line.request = engine.add_request(line.req_id, obj.get("prompt_token_ids"), parse_params(obj),
                                          prompt=obj.get("prompt"), priority=priority,
                                          adapter=obj.get("adapter") or "")
        line.deadline_s = None if deadline is None else engine.clock() + deadline / 1000
    except json.JSONDecodeError as e:
        line.result = {"id": line.req_id, "error": {"code": "INVALID_ARGUMENT", "message": f"not valid JSON: {e}"}}
    except MeshError as e:
        line.result = {"id": line.req_id, "error": error_dict(e)}


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"line is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def result_of(engine: LLMEngine, req: Request) -> dict:
    out = {"id": req.req_id, "token_ids": req.output_token_ids, "text": engine.output_text(req),
           "finish_reason": req.finish_reason, "prompt_tokens": req.num_prompt,
           "cached_prompt_tokens": req.num_cached_prompt}
    if req.params.wants_logprobs:
        out["logprobs"] = req.logprobs
    if req.params.top_logprobs:
        out["top_logprobs"] = [{"token_ids": ids, "logprobs": lps} for ids, lps in req.top_logprobs]
    return out


def run_lines(engine: LLMEngine, texts: list, progress: bool | None = None) -> list[dict]:
    """Run every line through the engine; results in input order."""
    lines = [Line(i, f"line-{i + 1}") for i in range(len(texts))]
    for line, text in zip(lines, texts):
        submit(engine, line, text)
    live = {ln.request.req_id: ln for ln in lines if ln.result is None}
    bar = tqdm(total=len(live), unit="req", disable=not progress if progress is not None else not sys.stderr.isatty())
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                live.pop(out.req_id).result = result_of(engine, out.request)
                bar.update()
        _expire(engine, live, bar)
    bar.close()
    return [ln.result for ln in lines]


def _expire(engine: LLMEngine, live: dict, bar) -> None:
    now = engine.clock()
    for req_id in [k for k, ln in live.items() if ln.deadline_s is not None and now > ln.deadline_s]:
        engine.abort(req_id)
        line = live.pop(req_id)
        line.result = {"id": req_id, "error": {"code": "DEADLINE_EXCEEDED",
                                               "message": f"deadline passed after {line.request.num_output} tokens"}}
        bar.update()


def generate_file(engine: LLMEngine, input_path: str, output_path: str, progress: bool | None = None) -> dict:
    with open(input_path, "rb") as f:
        texts = [t for t in f.read().splitlines() if t.strip()]
    t0 = time.perf_counter()
    results = run_lines(engine, texts, progress)
    wall = time.perf_counter() - t0
    with open(output_path, "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    n_out = sum(len(r.get("token_ids", [])) for r in results)
    return {"requests": len(results), "errors": sum("error" in r for r in results), "output_tokens": n_out,
            "wall_s": round(wall, 3), "output_tokens_per_s": round(n_out / wall, 1) if wall else None}
