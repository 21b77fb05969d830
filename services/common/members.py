"""Who holds a block in the prefix index: member names, shared by the index (Redis), the routing policy and the
kvstore, and free of Redis so that the I/O-free routing core can read them.

A worker's member is "<worker_id>#<epoch>", fresh at every start and every full republish; a kvstore pool's is
"pool@<host>#<epoch>" (its blocks serve that host's workers).
"""

from __future__ import annotations

import uuid

POOL_MEMBER = "pool@"  # the prefix of a kvstore pool's member names


def new_member(worker_id: str) -> str:
    """This incarnation's member name: the worker id and a fresh epoch."""
    return f"{worker_id}#{uuid.uuid4().hex[:12]}"


def worker_of(member: str) -> str:
    return member.rsplit("#", 1)[0]
