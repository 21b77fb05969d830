"""A worker's batch slots as credits granted to gateways, pure (no I/O).

Work is pulled, not pushed: a gateway sends a request to a worker only against a credit that
worker granted it, so the gateway's admission queue is the one place where requests wait and
an engine's own queue holds no more than its slots. Each subscription (one gateway's stream) is
granted credits cumulatively; a request that names the subscription uses one up. The worker
grants no more than its free slots: slots - requests it serves - credits granted and not yet
used, and a freed slot goes to the subscription holding the fewest unused credits. A request
sent without a credit (a direct client, or a gateway's under-share bypass that the engine
answers by preemption) is served all the same and counts as live; no credit is granted until
live work drops below the slots again.
"""

from __future__ import annotations


class CreditLedger:
    def __init__(self, slots: int):
        self.slots = slots
        self.live = 0  # requests being served
        self.max_live = 0  # the most at once, since start
        self.uncredited = 0  # requests that came without a credit to use, since start
        self.granted: dict[str, int] = {}  # per subscription, cumulative
        self.used: dict[str, int] = {}

    def unused(self, sub: str) -> int:
        return self.granted.get(sub, 0) - self.used.get(sub, 0)

    @property
    def free(self) -> int:
        """Slots neither serving a request nor promised by an unused credit."""
        return self.slots - self.live - sum(self.unused(s) for s in self.granted)

    def subscribe(self, sub: str) -> None:
        self.granted.setdefault(sub, 0)
        self.used.setdefault(sub, 0)

    def unsubscribe(self, sub: str) -> None:
        """The subscription ended: its unused credits return to the free slots."""
        self.granted.pop(sub, None)
        self.used.pop(sub, None)

    def accept(self, sub: str = "") -> bool:
        """A request arrived, naming the subscription whose credit it uses; False when it had none to use."""
        self.live += 1
        self.max_live = max(self.max_live, self.live)
        if self.unused(sub) > 0:
            self.used[sub] += 1
            return True
        self.uncredited += 1
        return False

    def release(self) -> None:
        """A request ended."""
        self.live -= 1

    def grant(self) -> set[str]:
        """Hand the free slots out, one at a time to the subscription with the fewest unused credits; returns the
        subscriptions whose grant grew."""
        changed, free = set(), self.free
        while free > 0 and self.granted:
            sub = min(self.granted, key=lambda s: (self.unused(s), s))
            self.granted[sub] += 1
            changed.add(sub)
            free -= 1
        return changed
