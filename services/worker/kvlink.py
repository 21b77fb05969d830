"""A worker's link to a kvstore: the transport it negotiated, and the calls of a transfer and of the pool.

Attach (once per kvstore, again whenever the kvstore answers from another arena generation, i.e. it
restarted) says shm (same host: the engine core maps the arena the kvstore named, and block bytes move in
place) or grpc (bytes in messages). The servicer uses:
  reserve()  slots for a transfer of a prompt's KV, and which blocks the pool holds already (the plan);
  lease()    the pool's blocks of a prompt (PooledPrefix), for the engine to import those it lacks;
  pull()     a transfer's blocks into the engine as they land (the decode side);
and release() ends a transfer or lease. Block hashes are computed here, as the engine and router do.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from services.common.arena import StaleArena
from services.common.block_hash import extra_keys, hash_blocks
from services.common.errors import InvalidRequest
from services.common.host import host_id
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.worker.core import ExportPlan, PooledPrefix

log = logging.getLogger("meshserve.kvlink")


class KVLink:
    def __init__(self, runner, channel, address: str, block_size: int, block_bytes: int, transport: str = "auto"):
        self.runner, self.address, self.transport_wanted = runner, address, transport
        self.stub = pb_grpc.KVStoreStub(channel)
        self.block_size, self.block_bytes = block_size, block_bytes
        self.transport = self.generation = ""
        self._lock = asyncio.Lock()

    @property
    def shm(self) -> bool:
        return self.transport == "shm"

    async def attach(self, stale: str = "") -> None:
        """Negotiate (again, when the arena we know is `stale` or none is known)."""
        async with self._lock:
            if self.generation and self.generation != stale:
                return  # attached meanwhile
            reply = await self.stub.Attach(pb.AttachRequest(host=host_id(), block_bytes=self.block_bytes,
                                                            transport=self.transport_wanted), timeout=10)
            transport, reason = reply.transport, reply.reason
            if transport == "shm":
                try:
                    await self.runner.call("map_arena", reply.segment, reply.generation, reply.slot_bytes, reply.slots)
                except Exception as e:  # e.g. another /dev/shm than the kvstore's (a container without it shared)
                    if self.transport_wanted == "shm":
                        raise
                    transport, reason = "grpc", f"cannot map {reply.segment}: {e}"
            if (transport, reply.generation) != (self.transport, self.generation):
                log.info("kvstore %s: transport %s (%s), arena %s", self.address, transport, reason, reply.generation)
            self.transport, self.generation = transport, reply.generation

    async def ready(self) -> KVLink:
        if not self.generation:
            await self.attach()
        return self

    def hashes(self, request) -> list[bytes]:
        """Chained hashes of the prompt's full blocks (the engine's, byte for byte): computed once per request,
        for its reservation and its lease alike."""
        return hash_blocks(request.prompt_token_ids, self.block_size, extra_keys(request.adapter, request.cache_salt))

    async def reserve(self, transfer_id: str, num_tokens: int, hashes: list, handoff: bool) -> ExportPlan:
        """The plan of a transfer of a prompt of num_tokens (hashes: its full blocks'): a handoff carries every
        block of the prompt (a partial last one too); a push to the pool only its full blocks."""
        await self.ready()
        num_blocks = -(-num_tokens // self.block_size) if handoff else len(hashes)
        reply = await self.stub.Reserve(pb.ReserveRequest(transfer_id=transfer_id, hashes=hashes,
                                                          num_blocks=num_blocks, block_bytes=self.block_bytes))
        if self.shm and reply.generation != self.generation:
            await self.attach(stale=self.generation)
        shm = self.shm and reply.generation == self.generation
        return ExportPlan(handoff, num_blocks, tuple(reply.present), tuple(reply.slots) if shm else (),
                          reply.generation if shm else "")

    async def lease(self, num_tokens: int, hashes: list) -> tuple[str, PooledPrefix | None]:
        """(lease id, the pool's blocks of a prompt of num_tokens whose full blocks hash to `hashes`), or ("",
        None) when it holds none. The last prompt token is always computed, as in the engine, so a block-aligned
        prompt's last block is not asked for."""
        await self.ready()
        hashes = hashes[:(num_tokens - 1) // self.block_size]
        if not hashes:
            return "", None
        lease_id = "lease-" + uuid.uuid4().hex
        got = await self.stub.Acquire(pb.AcquireRequest(transfer_id=lease_id, hashes=hashes,
                                                        block_bytes=self.block_bytes))
        if not got.blocks:
            return "", None
        try:
            slots, checksums, data = [], [], []
            generation = self.generation if self.shm else ""
            async for chunk in self.stub.Get(pb.GetRequest(transfer_id=lease_id, wait_ms=5000, shm=self.shm,
                                                           generation=generation)):
                if chunk.last:
                    break
                checksums.extend(chunk.checksums)
                slots.extend(chunk.slots)
                data.append(chunk.data)
            held = tuple(hashes[:len(checksums)])
            return lease_id, PooledPrefix(held, 0, tuple(checksums), tuple(slots), generation, b"".join(data))
        except BaseException:
            self.release_soon(lease_id)
            raise

    async def pull(self, request) -> tuple[pb.KVMeta, list]:
        """Import a transfer's blocks into the engine (its reservation begun) as they land: (the metadata, the
        import commands' futures). The imports are sent without waiting for each (the core runs queued commands
        together between two steps), so the caller's end_import, sent next, lands in the same gap when the last
        blocks and the metadata arrive together; the caller awaits the futures after sending it."""
        await self.ready()
        runner, req_id, written, stale, pending = self.runner, request.request_id, 0, False, []
        generation = self.generation if self.shm else ""
        try:
            async for chunk in self.stub.Get(pb.GetRequest(transfer_id=request.transfer_id, wait_ms=60000,
                                                           shm=self.shm, generation=generation)):
                if chunk.last:
                    return chunk.meta, pending
                if chunk.first_block != written:
                    raise InvalidRequest(f"transfer {request.transfer_id} skipped from block {written} to "
                                         f"{chunk.first_block}")
                if chunk.slots:
                    pending.append(runner.call("import_slots", req_id, written, generation, list(chunk.slots),
                                               list(chunk.checksums)))
                else:
                    pending.append(runner.call("import_data", req_id, written, chunk.data, list(chunk.checksums)))
                written += len(chunk.checksums)
        except grpc.aio.AioRpcError as e:
            stale = e.code() == grpc.StatusCode.FAILED_PRECONDITION and "arena" in (e.details() or "")
            if not stale:
                raise
        if stale:
            await self.attach(stale=generation)
            raise StaleArena("the kvstore restarted during the transfer")
        raise InvalidRequest(f"transfer {request.transfer_id} ended without its metadata")

    async def put(self, chunks) -> None:
        await self.stub.Put(chunks)

    def release_soon(self, transfer_id: str) -> None:
        """Release in the background (the caller does not wait on it; the kvstore's TTL is the backstop)."""
        async def release():
            try:
                await self.stub.Release(pb.ReleaseRequest(transfer_id=transfer_id), timeout=5)
            except grpc.aio.AioRpcError:
                pass
        asyncio.ensure_future(release())


class KVLinks:
    """One KVLink per kvstore address."""

    def __init__(self, runner, channels, block_size: int, block_bytes: int, transport: str = "auto"):
        self.runner, self.channels, self.transport = runner, channels, transport
        self.block_size, self.block_bytes = block_size, block_bytes
        self.links: dict[str, KVLink] = {}

    def get(self, address: str) -> KVLink:
        if not address:
            raise InvalidRequest("the request names no kvstore")
        link = self.links.get(address)
        if link is None:
            link = self.links[address] = KVLink(self.runner, self.channels.get(address), address, self.block_size,
                                                self.block_bytes, self.transport)
        return link
