"""python -m services.kvstore: the KV transfer service (see services/kvstore/store.py)."""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from opentelemetry import metrics

from services.common import rpc
from services.common.errors import MeshError
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.common.telemetry import add_metrics_flag, setup_telemetry
from services.kvstore.store import KVStore


class KVStoreMetrics:
    """KV transfer bytes and stream seconds by direction (put, get), and what the store holds."""

    def __init__(self, store: KVStore, meter: metrics.Meter | None = None):
        meter = meter or metrics.get_meter("meshserve.kvstore")
        self.bytes = meter.create_counter("meshserve.kv_transfer.bytes", unit="By", description="KV bytes moved")
        self.seconds = meter.create_histogram("meshserve.kv_transfer.seconds", unit="s",
                                              description="duration of one Put or Get stream")
        meter.create_observable_gauge("meshserve.kvstore.stored_bytes", [lambda o: [metrics.Observation(store.nbytes)]],
                                      unit="By", description="bytes held")
        meter.create_observable_gauge("meshserve.kvstore.transfers", [lambda o: [metrics.Observation(len(store.transfers))]],
                                      description="transfers held")

    def record(self, direction: str, nbytes: int, seconds: float) -> None:
        self.bytes.add(nbytes, {"direction": direction})
        self.seconds.record(seconds, {"direction": direction})


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(self, store: KVStore):
        self.store = store
        self.metrics = KVStoreMetrics(store)

    @rpc.mapped
    async def Put(self, request_iterator, context):
        rpc.require_peer(context, "worker")
        blocks = nbytes = 0
        t0 = time.monotonic()
        failure = None
        async for chunk in request_iterator:
            if failure is not None:
                continue  # read to the end: see below
            try:
                await self.store.put(chunk.transfer_id, chunk.index, chunk.data,
                                     chunk.meta if chunk.last else None, chunk.last)
            except MeshError as e:
                failure = e
                continue
            blocks += bool(chunk.data)
            nbytes += len(chunk.data)
        if failure is not None:
            # Raised only once the sender has half-closed: a client-streaming call the server ends while the client
            # still writes reaches an asyncio client as INTERNAL "Internal error from Core" instead of this status
            # when a write races the trailers (grpc/grpc#36066). The rest of the stream (one prompt's blocks) is read
            # and dropped.
            raise failure
        self.metrics.record("put", nbytes, time.monotonic() - t0)
        return pb.PutReply(blocks=blocks, bytes=nbytes)

    @rpc.mapped
    async def Get(self, request, context):
        rpc.require_peer(context, "worker")
        timeout = (request.wait_ms or 30000) / 1000
        nbytes, t0 = 0, time.monotonic()
        async for index, data in self.store.get(request.transfer_id, timeout):
            if index < 0:
                self.metrics.record("get", nbytes, time.monotonic() - t0)
                yield pb.KVChunk(transfer_id=request.transfer_id, index=-1, meta=data, last=True)
            else:
                nbytes += len(data)
                yield pb.KVChunk(transfer_id=request.transfer_id, index=index, data=data)

    @rpc.mapped
    async def Release(self, request, context):
        rpc.require_peer(context, "gateway", "worker")
        return pb.ReleaseReply(released=await self.store.release(request.transfer_id))

    @rpc.mapped
    async def Stats(self, request, context):
        rpc.require_peer(context, "client")
        s = self.store
        return pb.KVStoreStats(transfers=len(s.transfers), bytes=s.nbytes, byte_budget=s.byte_budget,
                               evicted=s.evicted, expired=s.expired)


async def serve(args) -> None:
    store = KVStore(int(args.byte_budget_gb * 1e9), args.ttl_s, time.monotonic)
    server = rpc.Server(["KVStore"], args.port, args.host)
    pb_grpc.add_KVStoreServicer_to_server(KVStoreServicer(store), server.server)
    await server.set_serving(True)

    async def expire_loop():
        while True:
            await asyncio.sleep(1.0)
            store.expire()

    task = asyncio.create_task(expire_loop())
    print(f"kvstore listening on {server.address}", flush=True)
    await server.run(grace_s=args.grace_s)
    task.cancel()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m services.kvstore", description=__doc__)
    rpc.add_server_flags(ap, "KVSTORE_PORT", grace_s=5.0, default_port=rpc.DEFAULT_PORTS["kvstore"])
    ap.add_argument("--byte-budget-gb", type=float, default=float(os.environ.get("KVSTORE_BUDGET_GB", "4")))
    ap.add_argument("--ttl-s", type=float, default=60.0, help="drop transfers never claimed after this long")
    add_metrics_flag(ap)
    args = ap.parse_args()
    setup_telemetry("kvstore", args.metrics_port, args.host)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
