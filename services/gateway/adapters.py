"""The mesh's LoRA adapters as the gateway sees them, and the admin calls that change them.

Workers are the source of truth: each registers adapters (the config's lora_dir and lora_modules, and
loads at run time) and reports them in its heartbeat; the gateway reads them through the router's
ListWorkers, every second and at once when a request names an adapter it does not know. A name no
worker knows is NOT_FOUND.

load() registers a PEFT folder on every live worker, all or none: if one refuses (a malformed adapter:
each worker validates it and names what is wrong), the workers that took it unload it again and the
refusal is the caller's error. Adapters loaded at run time are remembered and loaded again on a worker
that lacks them (one started or restarted since), so scaling out does not lose them. unload() lets requests
already accepted finish with the adapter.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.common import rpc
from services.common.errors import InvalidRequest, MeshError, NotFound, Unavailable
from services.common.pb import meshserve_pb2 as pb

log = logging.getLogger("meshserve.gateway")
MAX_PATH_BYTES = 4096


class AdapterCatalog:
    def __init__(self, list_workers, worker_stub, base_model: str):
        """list_workers: async () -> [pb.WorkerLoad]; worker_stub: address -> WorkerStub."""
        self.list_workers, self.worker_stub, self.base_model = list_workers, worker_stub, base_model
        self.workers: list = []  # the latest ListWorkers
        self.runtime: dict[str, str] = {}  # adapters loaded through this gateway: name -> folder
        self.gone: set = set()  # unloaded through this gateway, until the heartbeats stop listing them
        self._lock = asyncio.Lock()  # one admin change at a time

    @property
    def known(self) -> set:
        """Adapters some worker serves: its heartbeats say so, or this gateway just loaded it (heartbeats lag)."""
        return ({a for w in self.workers for a in w.known_adapters} - self.gone) | set(self.runtime)

    async def refresh(self) -> None:
        self.workers = list(await self.list_workers())
        self.gone &= {a for w in self.workers for a in w.known_adapters}

    async def check(self, name: str) -> None:
        """NotFound unless some worker serves the adapter (refreshing once before saying so)."""
        if name in self.known:
            return
        try:
            await self.refresh()
        except MeshError as e:
            log.warning("adapter %r: could not refresh the worker list: %s", name, e)
        if name not in self.known:
            raise NotFound(f"adapter {name!r} is not loaded (load it with LoadAdapter or POST /v1/load_lora_adapter)")

    async def load(self, name: str, path: str) -> pb.AdapterList:
        if not name or not path:
            raise InvalidRequest("lora_name and lora_path are required")
        if len(path.encode()) > MAX_PATH_BYTES:
            raise InvalidRequest(f"lora_path is over {MAX_PATH_BYTES} bytes")
        async with self._lock:
            await self.refresh()
            workers = self.workers
            if not workers:
                raise Unavailable("no worker is registered to load the adapter on")
            results = await asyncio.gather(*(self._call(w.address, "LoadAdapter", pb.LoadAdapterRequest(
                name=name, path=path)) for w in workers), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                loaded = [w for w, r in zip(workers, results) if not isinstance(r, BaseException)]
                await asyncio.gather(*(self._call(w.address, "UnloadAdapter", pb.UnloadAdapterRequest(name=name))
                                       for w in loaded), return_exceptions=True)
                raise failed[0]
            self.runtime[name] = path
            self.gone.discard(name)
            await self.refresh()
        return await self.listing()

    async def unload(self, name: str) -> pb.AdapterList:
        async with self._lock:
            await self.refresh()
            having = [w for w in self.workers if name in w.known_adapters]
            if not having:
                raise NotFound(f"adapter {name!r} is not loaded")
            results = await asyncio.gather(*(self._call(w.address, "UnloadAdapter", pb.UnloadAdapterRequest(
                name=name)) for w in having), return_exceptions=True)
            self.runtime.pop(name, None)
            self.gone.add(name)
            errors = [r for r in results if isinstance(r, BaseException) and getattr(r, "code", "") != "NOT_FOUND"]
            if errors:
                raise errors[0]
            await self.refresh()
        return await self.listing()

    async def listing(self) -> pb.AdapterList:
        """Every adapter with where it is resident (the workers' last heartbeats) and its rank and targets (from
        one worker that has it)."""
        out = {}
        for w in self.workers:
            for name in w.known_adapters:
                info = out.setdefault(name, pb.AdapterInfo(name=name))
                if name in w.adapters:
                    info.slot_workers.append(w.worker_id)
                elif name in w.host_adapters:
                    info.host_workers.append(w.worker_id)
        details = {}
        for w in self.workers:
            if set(out) <= set(details):
                break
            try:
                reply = await self._call(w.address, "ListAdapters", pb.ListAdaptersRequest())
            except MeshError:
                continue
            for a in reply.adapters:
                details.setdefault(a.name, a)
        for name, info in out.items():
            if name in details:
                d = details[name]
                info.path, info.rank = d.path, d.rank
                info.targets.extend(d.targets)
        return pb.AdapterList(adapters=[out[n] for n in sorted(out)], base_model=self.base_model)

    async def reconcile(self) -> int:
        """Load the run-time adapters on workers that lack them; returns how many loads were sent."""
        sent = 0
        for w in self.workers:
            for name, path in list(self.runtime.items()):
                if name in w.known_adapters:
                    continue
                try:
                    await self._call(w.address, "LoadAdapter", pb.LoadAdapterRequest(name=name, path=path))
                    log.info("adapter %s loaded on %s, which lacked it", name, w.worker_id)
                    sent += 1
                except MeshError as e:
                    log.warning("adapter %s: loading it on %s failed: %s", name, w.worker_id, e)
        return sent

    async def run(self, period_s: float = 1.0) -> None:
        """Refresh (and reconcile) every period_s."""
        while True:
            try:
                await self.refresh()
                if self.runtime:
                    await self.reconcile()
            except MeshError as e:
                log.debug("adapter catalog refresh failed: %s", e)
            await asyncio.sleep(period_s)

    async def _call(self, address: str, method: str, request):
        try:
            return await getattr(self.worker_stub(address), method)(request, timeout=30.0)
        except grpc.aio.AioRpcError as e:
            raise rpc.forward_rpc_error(e, address) from None
