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

A credit named by a request that never reached the worker (the gateway's call was cancelled or failed
in flight: gRPC then never calls the handler) would stay unused here and used at the gateway, a slot lost
for good; so a gateway gives back the credit of every request of its that ended early (give_back), which
counts it used unless that request already used it, and a request arriving after its credit was given
back uses none. Both sides key on (subscription, request id), remembered for the last REMEMBERED requests.
"""

from __future__ import annotations

from collections import OrderedDict

REMEMBERED = 65536  # (subscription, request id) pairs kept to tell a given-back credit from a used one


class CreditLedger:
    def __init__(self, slots: int):
        self.slots = slots
        self.live = 0  # requests being served
        self.max_live = 0  # the most at once, since start
        self.uncredited = 0  # requests that came without a credit to use, since start
        self.granted: dict[str, int] = {}  # per subscription, cumulative
        self.used: dict[str, int] = {}
        self.spent: OrderedDict = OrderedDict()  # (sub, request id) that used a credit
        self.given_back: OrderedDict = OrderedDict()  # (sub, request id) whose credit was given back first
        self.lost = 0  # credits given back by a gateway whose request never used them, since start

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

    def accept(self, sub: str = "", request_id: str = "") -> bool:
        """A request arrived, naming the subscription whose credit it uses; False when it had none to use."""
        self.live += 1
        self.max_live = max(self.max_live, self.live)
        key = (sub, request_id)
        if sub and self.given_back.pop(key, None) is not None:
            return True  # its credit was counted used when the gateway gave it back
        if self.unused(sub) > 0:
            self.used[sub] += 1
            _remember(self.spent, key)
            return True
        self.uncredited += 1
        return False

    def give_back(self, sub: str, request_id: str) -> bool:
        """The gateway's request `request_id`, sent with a credit of `sub`, ended early: if it never used the
        credit here, count it used now (its slot is granted again); True when it did so."""
        key = (sub, request_id)
        if key in self.spent or key in self.given_back or self.unused(sub) <= 0:
            return False
        self.used[sub] += 1
        self.lost += 1
        _remember(self.given_back, key)
        return True

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


def _remember(keys: OrderedDict, key) -> None:
    keys[key] = True
    if len(keys) > REMEMBERED:
        keys.popitem(last=False)
