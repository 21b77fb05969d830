"""How the gateway holds and reads a request's streams: a request held while no worker can take it (Held), and a
token stream detokenized incrementally with its stop strings (TextStream)."""

from __future__ import annotations

import asyncio
import logging
import time

from services.common.errors import DeadlineExceeded, NoWorker
from services.common.tokenizer import Tokenizer, cut_at_stop

log = logging.getLogger("meshserve.gateway")
NO_WORKER_RETRY_MS = 5000  # the Retry-After of a request no worker took within the grace: a killed worker is back
# within ~5 s under `meshserve up`, and a pool scaled from zero serves 4-6 s after its first request (SmolLM2)


class Held:
    """A request held while the router has no live worker for it: routed again after a short backoff (0.05 s
    doubling to 0.5 s), until a worker appears, its deadline comes, or grace_s pass with none (a mesh without
    workers for that long fails its requests with UNAVAILABLE naming the wait). A worker that is restarting or
    still loading its model, or busy past its heartbeats, costs a wait, not the request."""

    def __init__(self, grace_s: float, waiting: dict | None = None):
        """waiting: pool -> requests held because that pool has no worker at all (shared by the gateway's
        requests, exported for the autoscaler); this request counts in it while it waits for such a pool."""
        self.grace_s, self.since, self.delay = grace_s, None, 0.05
        self.waiting, self.pool = waiting if waiting is not None else {}, ""

    def leave(self) -> None:
        if self.pool:
            self.waiting[self.pool] -= 1
            self.pool = ""

    async def wait(self, e: NoWorker, request_id: str, deadline_s: float | None) -> None:
        if e.empty_role != self.pool:
            self.leave()
            if e.empty_role:
                self.pool = e.empty_role
                self.waiting[self.pool] = self.waiting.get(self.pool, 0) + 1
        now = time.monotonic()
        if self.since is None:
            self.since, self.delay = now, 0.05
            log.info("request %s: %s; holding it until one is live (at most %g s)", request_id, e, self.grace_s)
        if now - self.since >= self.grace_s:
            err = NoWorker(f"{e} for {now - self.since:.0f} s (the gateway holds a request at most "
                           f"admission.no_worker_grace_s = {self.grace_s:g} s for a worker)",
                           retry_after_ms=NO_WORKER_RETRY_MS)
            err.peer = e.peer
            raise err
        if deadline_s is not None and now + self.delay >= deadline_s:
            raise DeadlineExceeded(f"the deadline passed while waiting for a worker ({e})")
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, 0.5)


async def drain_events(events) -> None:
    async for _ in events:
        pass


class TextStream:
    """Incremental detokenization (as vLLM's: each push decodes only the tokens since the last text
    boundary, never the whole output again); the text is cut before the first stop string, and a
    trailing incomplete UTF-8 sequence is held back until the next token completes it."""

    def __init__(self, tokenizer: Tokenizer, stops):
        self.tokenizer, self.stops = tokenizer, stops
        self.longest_stop = max((len(x) for x in stops), default=0)
        self.tokens: list = []
        self.prefix_offset = self.read_offset = 0  # tokens[prefix:read] were decoded into the text already
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of text already returned
        self.stopped = False

    def push(self, token_ids, final: bool) -> str:
        if self.stopped:
            return ""
        self.tokens.extend(token_ids)
        decode = self.tokenizer.decode
        before = decode(self.tokens[self.prefix_offset:self.read_offset])
        now = decode(self.tokens[self.prefix_offset:])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self.text += now[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        end = len(self.text)
        if self.stops:  # a stop string can only end in the new text (or straddle its start)
            cut, found = cut_at_stop(self.text[max(self.sent - self.longest_stop, 0):], self.stops)
            if found:
                end, self.stopped = max(self.sent - self.longest_stop, 0) + len(cut), True
            elif not final:
                end = max(self.sent, len(self.text) - self.longest_stop + 1)  # may still become a stop
        delta = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return delta
