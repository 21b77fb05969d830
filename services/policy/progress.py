"""Progress, not connection, as a stream's sign of life (issue 65). Pure: the clock is injected, no I/O.

A worker that is alive but makes no progress (a stopped process, a stuck kernel, a swapped-out host, a partition
that leaves the TCP connection open) keeps its streams open for as long as it hangs. The gateway holds every stream
it reads to a bound on the time to its next event, from the worker's own step times (its heartbeats, as the router
lists them):

    bound = floor_s + factor x expected

where `expected` is one step: the worker's longest recent step (a step it was paused in left out), or a decode step
plus its token budget of prompt at its prompt cost, whichever is longer. A stream's first event also waits for its
prompt (and, on a prefill worker, the prompts queued ahead of it) at the worker's prompt cost. A worker whose step
times are not measured yet gets `unmeasured_s`. A stream whose worker the router's listing has dropped for
`confirm_s` (its heartbeats stopped) is stalled too. A stream past its bound whose worker still steps (another of
its streams had an event within the worker's bound) is not stalled: it waits in the worker's queue, for a batch
slot, or on a KV handoff (the caller asks the kvstore then). A stalled stream is resumed elsewhere, and its worker is
a suspect (new work avoids it) for `suspect_s`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Pace:
    """A worker's step times, as its heartbeats report them (0 = not measured yet)."""

    decode_s: float = 0.0  # a decode step (decode_s_per_step)
    prefill_s_per_token: float = 0.0
    longest_step_s: float = 0.0  # its longest recent step (wall time)
    chunk_tokens: int = 0  # prompt tokens a step takes at most (max_num_batched_tokens)
    queued_tokens: int = 0  # tokens it holds (outstanding): on a prefill worker, prompts ahead of a new one

    @staticmethod
    def of(view) -> Pace:
        """From a router's WorkerLoad (or anything with its field names)."""
        return Pace(view.decode_s_per_step, view.prefill_s_per_token, getattr(view, "longest_step_s", 0.0),
                    getattr(view, "max_num_batched_tokens", 0), view.outstanding_tokens)

    @property
    def measured(self) -> bool:
        return self.decode_s > 0 or self.prefill_s_per_token > 0 or self.longest_step_s > 0

    def step_s(self, prompt_tokens: int | None = None) -> float:
        """One step, at most: its longest recent one, or a decode step plus a chunk of prompt (a full chunk, or with
        prompt_tokens given, as much of them as one step takes)."""
        chunk = self.chunk_tokens if prompt_tokens is None else min(prompt_tokens, self.chunk_tokens or prompt_tokens)
        return max(self.longest_step_s, self.decode_s + chunk * self.prefill_s_per_token)


@dataclass(eq=False)
class Watched:
    """One stream the gateway reads: its worker, what it does there, and when its next event is due."""

    address: str
    role: str  # prefill | decode | unified: what "made no progress" names
    due_s: float
    last_s: float  # when it opened or was last read again
    bound_s: float  # its bound then
    handle: object = None  # the caller's (the call to cancel)
    handoff: bool = False  # it waits on a KV handoff (through the kvstore), not only on its worker's steps
    events: int = 0
    prompt_tokens: int = 0  # its prompt, pending on its worker until its first event
    reason: str = ""  # why it stalled ("" = it has not)
    kvstore: bool = False  # the kvstore, not the worker, stalled it


@dataclass
class ProgressWatch:
    factor: float = 4.0
    floor_s: float = 2.0
    unmeasured_s: float = 30.0  # the bound on a worker whose step times are not known yet (it may be loading)
    suspect_s: float = 10.0
    confirm_s: float = 1.5  # absent from the router's listing this long: forgotten (a router that just woke from a
    # pause lists nobody for a moment)
    paces: dict = field(default_factory=dict)  # address -> Pace
    streams: set = field(default_factory=set)  # Watched
    last_event: dict = field(default_factory=dict)  # address -> when any stream from it last had an event
    pending: dict = field(default_factory=dict)  # address -> prompt tokens of its watched streams before their first
    absent_since: dict = field(default_factory=dict)  # address with a stream -> when a listing first lacked it
    forgotten: set = field(default_factory=set)  # addresses the router has dropped
    suspects: dict = field(default_factory=dict)  # address -> until when new work avoids it

    # ---- what the router lists ----

    def update(self, workers, now: float) -> None:
        """A fresh listing of the live workers (ListWorkers' WorkerLoads)."""
        listed = set()
        for w in workers:
            self.paces[w.address] = Pace.of(w)
            listed.add(w.address)
        for address in listed:
            self.absent_since.pop(address, None)
            self.forgotten.discard(address)
        for address in {s.address for s in self.streams} - listed:
            since = self.absent_since.setdefault(address, now)
            if now - since >= self.confirm_s:
                self.forgotten.add(address)

    # ---- bounds ----

    def next_s(self, address: str) -> float:
        """The bound on the time to a stream's next event from this worker: a step with the prompts it holds (as it
        last reported them, and those this gateway sent it since that have no first token yet), a chunk at most."""
        pace = self.paces.get(address)
        if pace is None or not pace.measured:
            return self.unmeasured_s
        return self.floor_s + self.factor * pace.step_s(pace.queued_tokens + self.pending.get(address, 0))

    def first_s(self, address: str, role: str, prompt_tokens: int) -> float:
        """The bound on the time to a stream's first event: its prompt too (and on a prefill worker the prompts
        queued ahead of it)."""
        pace = self.paces.get(address)
        if pace is None or not pace.measured:
            return self.unmeasured_s
        pending = prompt_tokens + (pace.queued_tokens if role == "prefill" else 0)
        first_step = pace.step_s(pending)  # the step that takes the prompt's last chunk
        rest = max(pending - (pace.chunk_tokens or pending), 0) * pace.prefill_s_per_token  # the chunks before it
        return self.floor_s + self.factor * (first_step + rest)

    # ---- streams ----

    def open(self, address: str, role: str, bound_s: float, now: float, handle: object = None,
             handoff: bool = False, prompt_tokens: int = 0) -> Watched:
        watched = Watched(address, role, now + bound_s, now, bound_s, handle, handoff, prompt_tokens=prompt_tokens)
        self.streams.add(watched)
        self.pending[address] = self.pending.get(address, 0) + prompt_tokens
        return watched

    def event(self, watched: Watched, now: float) -> None:
        """An event came; nothing is due until the caller waits again (a slow reader is no stalled worker)."""
        if not watched.events:
            self._computed(watched)
        watched.events += 1
        watched.due_s = math.inf
        self.last_event[watched.address] = now

    def _computed(self, watched: Watched) -> None:
        """Its prompt is no longer pending on its worker (its first event came, or it ended)."""
        left = self.pending.get(watched.address, 0) - watched.prompt_tokens
        if left > 0:
            self.pending[watched.address] = left
        else:
            self.pending.pop(watched.address, None)
        watched.prompt_tokens = 0

    def waiting(self, watched: Watched, bound_s: float, now: float) -> None:
        """The caller waits for the next event: due within bound_s."""
        watched.due_s, watched.last_s, watched.bound_s = now + bound_s, now, bound_s

    def close(self, watched: Watched) -> None:
        self.streams.discard(watched)
        self._computed(watched)

    def alive(self, address: str, now: float) -> bool:
        """Some stream from the worker had an event within the bound of one of its steps (its prompt estimates left
        out: a worker that steps emits tokens): it steps, and a stream of it past its own bound waits in its queue,
        or on the kvstore."""
        pace = self.paces.get(address)
        window = self.floor_s + self.factor * pace.step_s(0) if pace is not None and pace.measured else \
            self.unmeasured_s
        return now - self.last_event.get(address, -math.inf) <= window

    def stalled(self, now: float) -> tuple[list[Watched], list[Watched]]:
        """(stalled, overdue handoffs). Stalled: streams past their bound whose worker made no progress on any
        stream within its own bound, or whose worker the router forgot; each marked with its reason, taken off the
        watch, its worker made a suspect: the caller cancels them and resumes their requests. A stream past its
        bound on a worker that steps waits in its queue: its bound starts again. Overdue handoffs: such streams
        that wait on a KV handoff; the caller asks the kvstore (stall_on_kvstore() if it is silent)."""
        stalled, overdue = [], []
        for s in list(self.streams):
            if s.address in self.forgotten:
                s.reason = "its heartbeats stopped (the router dropped it)"
            elif now <= s.due_s:
                continue
            elif self.alive(s.address, now):
                if s.handoff:
                    overdue.append(s)
                else:
                    s.due_s = now + self.next_s(s.address)
                continue
            else:
                s.reason = (f"no event from it for {now - max(s.last_s, self.last_event.get(s.address, 0)):.1f} s "
                            f"(this stream's bound {s.bound_s:.1f} s, from {self.paces.get(s.address, Pace())})")
            self.streams.discard(s)
            self.suspects[s.address] = now + self.suspect_s
            stalled.append(s)
        return stalled, overdue

    def stall_on_kvstore(self, streams: list[Watched], why: str) -> list[Watched]:
        """Handoffs the kvstore does not serve (it did not answer): stalled, their workers not suspected."""
        out = []
        for s in streams:
            if s in self.streams:
                s.reason, s.kvstore = why, True
                self.streams.discard(s)
                out.append(s)
        return out

    def extend(self, streams: list[Watched], now: float) -> None:
        """Handoffs whose kvstore answered: their bounds start again."""
        for s in streams:
            s.due_s = now + self.next_s(s.address)

    def absolve(self, address: str) -> None:
        """Not the worker's fault after all (the kvstore was what hung)."""
        self.suspects.pop(address, None)

    def avoid(self, now: float) -> list[str]:
        """Workers new work should not go to: those that stalled a stream within suspect_s."""
        for address in [a for a, until in self.suspects.items() if until <= now]:
            del self.suspects[address]
        return sorted(self.suspects)
