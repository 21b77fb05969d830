"""Helpers of the tests that start a mesh: its start and supervision, calls to its gateway, what its workers and
kvstore still hold."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import Mesh, MeshSpec, client_channel

ENGINE = ["--kv-cache-gb", "0.05", "--max-num-batched-tokens", "64"]


def supervised(spec: MeshSpec, log_dir: str):
    """Start a mesh and supervise it (restart what exits) on a thread until the generator is closed: a module
    fixture's body (`yield from supervised(...)`)."""
    m = Mesh(spec, log_dir=log_dir).start()
    stop = threading.Event()
    supervisor = threading.Thread(target=lambda: [m.supervise(lambda line: None) for _ in iter(lambda: stop.wait(0.1),
                                                                                               True)])
    supervisor.start()
    try:
        yield m
    finally:
        stop.set()
        supervisor.join()
        m.stop()


def start_mesh(model, tmp_path_factory, mode, **kw):
    spec = MeshSpec(str(model), mode=mode, engine_args=ENGINE, **kw)
    return Mesh(spec, log_dir=str(tmp_path_factory.mktemp(f"mesh-{mode}"))).start()


def worker_stats(address: str) -> pb.WorkerStats:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=5)


def kvstore_stats(address: str) -> pb.KVStoreStats:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.KVStoreStub(ch).Stats(pb.StatsRequest(), timeout=5)


NEW = 16


def generate_request(ids, max_tokens=NEW, **sampling):
    s = pb.Sampling(**{"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **sampling})
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=s)


async def stream_all(address, prompts):
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)

        async def one(ids):
            tokens, reason = [], None
            async for r in stub.Generate(generate_request(ids), timeout=120):
                tokens += list(r.token_ids)
                reason = r.finish_reason or reason
            assert reason == "length"
            return tokens

        return await asyncio.gather(*(one(p) for p in prompts))


def assert_idle(mesh, roles):
    """Every worker holds zero used KV blocks and the kvstore holds no transfer (polled: releases are async)."""
    deadline = time.monotonic() + 15
    while True:
        used = {p.name: worker_stats(p.address).blocks_used for r in roles for p in mesh.workers(r)}
        transfers = kvstore_stats(mesh.kvstore).transfers
        if not any(used.values()) and transfers == 0:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"not idle: used blocks {used}, kvstore transfers {transfers}")
        time.sleep(0.1)


def stats(mesh, address: str, stub, request):
    with client_channel(address, mesh.tls_dir) as ch:
        return stub(ch).Stats(request, timeout=5)


def idle(mesh) -> dict:
    """What is still held: blocks and sequences per worker, transfers in the kvstore (empty when idle)."""
    held = {}
    for p in mesh.workers("prefill") + mesh.workers("decode"):
        s = stats(mesh, p.address, pb_grpc.WorkerStub, pb.StatsRequest())
        if s.blocks_used or s.running or s.waiting:
            held[p.name] = (s.blocks_used, s.running, s.waiting)
    transfers = stats(mesh, mesh.kvstore, pb_grpc.KVStoreStub, pb.StatsRequest()).transfers
    if transfers:
        held["kvstore transfers"] = transfers
    return held
