"""The gateway holds a request while no worker can take it (services/gateway/streams.py Held): until a worker
appears, its deadline, or the no-worker grace, each ending with a status that names it."""

import asyncio
import time

import pytest

from services.common.errors import DeadlineExceeded, NoWorker
from services.gateway.streams import Held


async def _hold_until_it_raises(held: Held, deadline_s=None) -> int:
    waits = 0
    while True:
        await held.wait(NoWorker("no live unified worker"), "r1", deadline_s)
        waits += 1


def test_the_grace_ends_the_wait_naming_it():
    with pytest.raises(NoWorker, match=r"no live unified worker for \d+ s .*no_worker_grace_s = 0.3 s"):
        asyncio.run(_hold_until_it_raises(Held(0.3)))


def test_a_deadline_before_the_grace_ends_the_wait_as_deadline_exceeded():
    with pytest.raises(DeadlineExceeded, match="while waiting for a worker"):
        asyncio.run(_hold_until_it_raises(Held(3600), deadline_s=time.monotonic() + 0.3))


def test_a_worker_found_meanwhile_starts_the_next_hold_afresh():
    held = Held(0.3)
    with pytest.raises(NoWorker):
        asyncio.run(_hold_until_it_raises(held))
    held.since = None  # what the gateway does when a worker was found (and failed the request otherwise)
    asyncio.run(held.wait(NoWorker("no live unified worker"), "r1", None))  # waits again instead of failing
