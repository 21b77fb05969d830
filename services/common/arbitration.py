"""Slot arbitration: who gets the next batch slot, and who is preempted when KV blocks run short.

A policy is a pure object (no I/O, no torch) that ranks claims: a lower rank is served first
and preempted last. The engine scheduler orders its waiting queue by rank and picks the
highest-ranked running request as the preemption victim; the gateway's admission queue (a
later issue) reuses the same classes. Policies:

- FcfsPolicy: arrival order (ties by admission sequence number).
- PriorityPolicy: the claim's priority class first (0 is most urgent), then arrival order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class SlotClaim(Protocol):
    """What a policy may read of a request."""

    arrival_s: float  # when the request arrived (engine clock)
    priority: int  # 0 is most urgent; larger numbers wait
    seq_no: int  # admission order, unique per engine: the final tie-break


class ArbitrationPolicy:
    """Base: subclasses define rank(); selection helpers are shared."""

    name = "base"

    def rank(self, claim: SlotClaim) -> tuple:
        raise TypeError(f"{type(self).__name__} must define rank()")

    def order(self, claims: Iterable[SlotClaim]) -> list:
        """Claims in serving order: first is served first."""
        return sorted(claims, key=self.rank)

    def victim(self, claims: Iterable[SlotClaim]):
        """The claim to preempt first: the last one in serving order (None when empty)."""
        return max(claims, key=self.rank, default=None)


class FcfsPolicy(ArbitrationPolicy):
    name = "fcfs"

    def rank(self, claim: SlotClaim) -> tuple:
        return (claim.arrival_s, claim.seq_no)


class PriorityPolicy(ArbitrationPolicy):
    name = "priority"

    def rank(self, claim: SlotClaim) -> tuple:
        return (claim.priority, claim.arrival_s, claim.seq_no)


POLICIES = {p.name: p for p in (FcfsPolicy, PriorityPolicy)}


def make_policy(name: str) -> ArbitrationPolicy:
    """A policy by its configured name; unknown names list the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown arbitration policy {name!r}; known: {sorted(POLICIES)}") from None
