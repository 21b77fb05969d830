"""The gateway's trace recorder (`--record-trace FILE`): one JSONL line per request it answered, in the trace
format (services/common/workload_trace.py), so that `meshserve sim run --trace FILE` replays what the mesh was offered.

A line holds the arrival time (seconds from the first recorded request), the prompt's length and its full
blocks as shared segments (the prompt's chained block hashes at the workers' block size: requests with a common
prefix share its leading segments, and nothing of the prompt's content is written), the output tokens it
generated (its max_tokens when it did not complete: what it asked for), its tenant, adapter, deadline (ms from
arrival) and priority. Lines are written as requests end, so they are in finishing order; the reader sorts them.
"""

from __future__ import annotations

import threading

from services.common.block_hash import pack_tokens, prompt_hashes
from services.common.workload_trace import TraceRequest, line_of


class TraceRecorder:
    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)
        self.t0: float | None = None
        self.count = 0
        self.lock = threading.Lock()

    def record(self, arrival_s: float, ids: list, output_tokens: int, tenant: str, adapter: str,
               deadline_s: float | None, priority: int, block_size: int) -> None:
        if not ids:
            return
        with self.lock:
            if self.t0 is None:
                self.t0 = arrival_s
            self.count += 1
            n = self.count
        hashes = prompt_hashes(pack_tokens(ids), block_size, adapter, "") if block_size else []
        r = TraceRequest(arrival_s=max(arrival_s - self.t0, 0.0), prompt_tokens=len(ids),
                         output_tokens=max(output_tokens, 1), id=f"g{n}",
                         prefix=[[h.hex()[:20], block_size] for h in hashes], tenant=tenant, adapter=adapter,
                         deadline_ms=round((deadline_s - arrival_s) * 1e3, 1) if deadline_s is not None else None,
                         priority=priority)
        self.file.write(line_of(r) + "\n")

    def close(self) -> None:
        self.file.close()
