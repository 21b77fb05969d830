"""The gateway's side of credit-based dispatch: one Credits stream per serving worker.

Each worker pushes the credits it grants this gateway the moment a slot frees (services/policy/credit_ledger.py);
the gateway dispatches from its admission queue only while it holds an unused credit, sends each request
to a worker it holds one of, and names the credit in the request. Streams follow the workers the router
lists (sync()); a broken stream is opened again (a fresh subscription: the worker dropped the old one's
unused credits) after a short backoff, and its worker counts as holding none meanwhile. A request that
named a credit and ended early gives the credit back (give_back): it may never have reached the worker.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field

import grpc

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc

log = logging.getLogger("meshserve.gateway.credits")

GIVE_BACK_TIMEOUT_S = 5.0


@dataclass
class Subscription:
    address: str
    id: str = ""  # the current stream's subscriber id
    granted: int = 0  # by the worker, on this stream
    used: int = 0  # requests sent against them
    task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def unused(self) -> int:
        return self.granted - self.used if self.id else 0


class CreditPool:
    def __init__(self, channels, on_grant, retry_s: float = 0.5):
        """channels: the gateway's ChannelPool; on_grant(): called whenever a worker grants credits."""
        self.channels, self.on_grant, self.retry_s = channels, on_grant, retry_s
        self.subs: dict[str, Subscription] = {}
        self.giving_back: set[asyncio.Task] = set()

    @property
    def known(self) -> bool:
        """Some worker's stream is open: dispatch is by credits (until then, by the router's view of load)."""
        return any(s.id for s in self.subs.values())

    def total(self) -> int:
        return sum(s.unused for s in self.subs.values())

    def without(self) -> list[str]:
        """Workers holding no unused credit of this gateway's (the router is asked to avoid them)."""
        return sorted(a for a, s in self.subs.items() if s.unused <= 0)

    def take(self, address: str) -> str:
        """Use a credit of the worker at address: the subscriber id to name in the request ("" when none is held:
        the request goes uncredited)."""
        s = self.subs.get(address)
        if s is None or s.unused <= 0:
            return ""
        s.used += 1
        return s.id

    def give_back(self, address: str, sub_id: str, request_id: str) -> None:
        """The request `request_id`, sent to the worker at address with a credit of subscription sub_id, ended
        early (cancelled, failed): tell the worker, which counts the credit used unless the request used it (a
        call cancelled in flight never reaches the worker's handler, and its credit would be lost for good).
        Fire and forget: a worker that cannot be told has ended the subscription, or soon will."""
        s = self.subs.get(address)
        if not sub_id or s is None or s.id != sub_id:
            return  # that subscription ended: the worker dropped its credits with it
        task = asyncio.ensure_future(self._give_back(address, sub_id, request_id))
        self.giving_back.add(task)
        task.add_done_callback(self.giving_back.discard)

    async def _give_back(self, address: str, sub_id: str, request_id: str) -> None:
        try:
            await pb_grpc.WorkerStub(self.channels.get(address)).GiveBackCredit(
                pb.GiveBackCreditRequest(subscriber=sub_id, request_id=request_id), timeout=GIVE_BACK_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.info("could not give a credit back to %s: %s", address, e.code().name)

    def sync(self, addresses) -> None:
        """Follow exactly these workers."""
        wanted = set(addresses)
        for address in [a for a in self.subs if a not in wanted]:
            self.subs.pop(address).task.cancel()
        for address in wanted - set(self.subs):
            sub = self.subs[address] = Subscription(address)
            sub.task = asyncio.ensure_future(self._follow(sub))

    def close(self) -> None:
        self.sync(())

    async def _follow(self, sub: Subscription) -> None:
        stub = pb_grpc.WorkerStub(self.channels.get(sub.address))
        while True:
            sub.id, sub.granted, sub.used = uuid.uuid4().hex, 0, 0
            try:
                async for grant in stub.Credits(pb.CreditsRequest(subscriber=sub.id)):
                    sub.granted = grant.granted
                    self.on_grant()
            except grpc.aio.AioRpcError as e:
                log.info("credit stream of %s ended: %s", sub.address, e.code().name)
            sub.id = ""  # holds none until the next stream grants them
            await asyncio.sleep(self.retry_s)
