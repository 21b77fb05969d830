"""The trace format: one JSONL line per request, what the gateway records (`--record-trace`) and the simulator
replays (`meshserve sim run --trace`; synthetic traces: sim/trace.py).

A line: {"id", "arrival_s" (from the trace's start), "prompt_tokens", "output_tokens" (what it generates),
"prefix" (optional: [[segment, tokens], ...], the shared segments the prompt starts with, in order; requests
naming the same segments share those tokens), "tenant", "adapter", "deadline_ms" (end to end, from arrival),
"priority"}. Only arrival_s, prompt_tokens and output_tokens are required.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    id: str = ""
    prefix: list = field(default_factory=list)  # [[segment id, tokens], ...] leading shared segments
    tenant: str = ""
    adapter: str = ""
    deadline_ms: float | None = None
    priority: int = 0

    def validate(self, where: str) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"{where}: {msg}")

        check(math.isfinite(self.arrival_s) and self.arrival_s >= 0, f"arrival_s must be >= 0, got {self.arrival_s!r}")
        check(isinstance(self.prompt_tokens, int) and self.prompt_tokens > 0,
              f"prompt_tokens must be a positive integer, got {self.prompt_tokens!r}")
        check(isinstance(self.output_tokens, int) and self.output_tokens > 0,
              f"output_tokens must be a positive integer, got {self.output_tokens!r}")
        shared = sum(n for _, n in self.prefix)
        check(all(isinstance(n, int) and n > 0 for _, n in self.prefix), "prefix segments need a positive length")
        check(shared <= self.prompt_tokens, f"prefix segments ({shared} tokens) exceed prompt_tokens")
        check(self.deadline_ms is None or self.deadline_ms > 0, f"deadline_ms must be > 0, got {self.deadline_ms!r}")

    def tokens(self) -> list[int]:
        """The prompt as token ids: each shared segment's tokens derive from its id alone (so requests naming
        it share them, block for block), the rest from the request's id."""
        out: list[int] = []
        for seg, n in self.prefix:
            out += [zlib.crc32(str(seg).encode())] * n
        own = [zlib.crc32(("r:" + self.id).encode()), zlib.crc32(("q:" + self.id).encode())]  # 64 bits: no collisions
        n = self.prompt_tokens - len(out)
        return out + (own * (n // 2 + 1))[:n]


def read_jsonl(path: str | Path) -> list[TraceRequest]:
    """A trace file, validated; errors name the line. Requests come back in arrival order."""
    out = []
    known = set(TraceRequest.__dataclass_fields__)
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(d, dict):
                raise ValueError(f"{where}: a line must be a JSON object")
            unknown = set(d) - known
            if unknown:
                raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
            missing = {"arrival_s", "prompt_tokens", "output_tokens"} - set(d)
            if missing:
                raise ValueError(f"{where}: missing {sorted(missing)}")
            r = TraceRequest(**d)
            r.prefix = [list(s) for s in r.prefix]
            r.id = r.id or f"r{n}"
            r.validate(where)
            out.append(r)
    out.sort(key=lambda r: r.arrival_s)
    return out


def write_jsonl(reqs: list[TraceRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in reqs:
            f.write(line_of(r) + "\n")


def line_of(r: TraceRequest) -> str:
    d = {k: v for k, v in asdict(r).items() if v not in (None, "", [], 0) or k in ("arrival_s",)}
    d["arrival_s"] = round(r.arrival_s, 6)
    return json.dumps(d, separators=(",", ":"))
