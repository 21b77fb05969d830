"""Prefix-aware routing over the Redis index, with real processes: routing by cached prefix, Redis
killed mid-run and restarted, a killed worker's entries expiring within the bound."""

import asyncio
import os
import signal
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.block_hash import extra_keys, hash_blocks
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.common.prefix_index import LIVE_PREFIX, LIVE_TTL_S, PrefixIndex, connect, connect_lookup
from services.mesh.launcher import redis_command
from tests.support.mesh import generate_request, start_mesh
from tests.support.wait import wait_for

BS = 16  # the engine's default block size
P0 = list(range(200, 300))  # 6 full blocks
P1 = list(range(400, 500))


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    m = start_mesh(tiny_model, tmp_path_factory, "unified", unified=2, policy="prefix-aware")
    yield m
    m.stop()


def generate(address, ids, max_tokens=4):
    """Through the gateway; returns (tokens, cached prompt tokens)."""
    with grpc.insecure_channel(address) as ch:
        tokens, cached = [], 0
        for r in pb_grpc.GenerationStub(ch).Generate(generate_request(ids, max_tokens=max_tokens), timeout=60):
            tokens += list(r.token_ids)
            cached = max(cached, r.cached_prompt_tokens)
        return tokens, cached


def on_worker(address, ids):
    """Straight to a unified worker, bypassing the router: that worker alone caches the prompt."""
    with grpc.insecure_channel(address) as ch:
        req = pb.WorkRequest(request_id=f"direct-{ids[0]}-{time.monotonic_ns()}", prompt_token_ids=ids,
                             sampling=pb.Sampling(max_tokens=2, temperature=0.0, ignore_eos=True))
        list(pb_grpc.WorkerStub(ch).Generate(req, timeout=60))


def members(mesh) -> dict:
    with grpc.insecure_channel(mesh.router) as ch:
        workers = pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers
    return {w.worker_id: w.index_member for w in workers}


def indexed(mesh, ids) -> dict:
    """worker_id -> blocks of ids the Redis index says it holds (live members only)."""
    client = connect_lookup(mesh.redis_url, timeout_s=2)
    try:
        found = PrefixIndex(client).longest_prefix(hash_blocks(ids[:-1], BS, extra_keys()))
    finally:
        client.close()
    return {m.rsplit("#", 1)[0]: n for m, n in found.items()}


def index_health(router) -> int:
    with grpc.insecure_channel(router) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="prefix-index"),
                                                    timeout=2).status


def seed_and_route(mesh):
    """P0 cached on unified-0 and P1 on unified-1 only; the gateway then sends each to its holder."""
    w0, w1 = (p.address for p in mesh.workers("unified"))
    on_worker(w0, P0)
    on_worker(w1, P1)
    wait_for(lambda: indexed(mesh, P0).get("unified-0") == 6 and indexed(mesh, P1).get("unified-1") == 6, 10,
             "the index to show both prompts")
    wait_for(lambda: all(members(mesh).values()), 5, "both workers to report their index member")
    # Ties break to the lower worker id (unified-0), so P1 reaching a cache proves routing by prefix.
    for ids in (P1, P0, P1):
        assert generate(mesh.gateway, ids)[1] == 6 * BS


def test_routes_by_cached_prefix(mesh):
    seed_and_route(mesh)


def test_redis_killed_mid_run_then_restarted(mesh):
    redis = mesh.proc("redis")
    os.killpg(redis.popen.pid, signal.SIGKILL)
    redis.popen.wait()
    prompts = [list(range(600 + 37 * i, 640 + 37 * i)) for i in range(8)]

    async def all_complete():
        async with grpc.aio.insecure_channel(mesh.gateway) as ch:
            stub = pb_grpc.GenerationStub(ch)

            async def one(ids):
                n = 0
                async for r in stub.Generate(generate_request(ids, max_tokens=8), timeout=60):
                    n += len(r.token_ids)
                return n
            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(all_complete()) == [8] * len(prompts)  # no request fails because Redis is down
    wait_for(lambda: index_health(mesh.router) == health_pb2.HealthCheckResponse.NOT_SERVING, 5,
             "the router to report the degraded prefix index")
    port = int(mesh.redis_url.rsplit(":", 1)[1].split("/")[0])
    redis.popen = subprocess.Popen(redis_command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
    wait_for(lambda: index_health(mesh.router) == health_pb2.HealthCheckResponse.SERVING, 15,
             "the router to see Redis back")
    # The workers republish their whole state into the empty Redis; prefix routing is back.
    wait_for(lambda: indexed(mesh, P0).get("unified-0") == 6 and indexed(mesh, P1).get("unified-1") == 6, 15,
             "the workers to republish")
    wait_for(lambda: all(members(mesh).values()), 5, "fresh index members in the heartbeats")
    assert generate(mesh.gateway, P1)[1] == 6 * BS


def test_killed_workers_entries_stop_counting_within_the_bound(mesh):
    wait_for(lambda: indexed(mesh, P1).get("unified-1") == 6, 15, "unified-1's entries")
    member = members(mesh)["unified-1"]

    async def ttl():
        client = connect(mesh.redis_url)
        try:
            return await client.ttl(LIVE_PREFIX + member)
        finally:
            await client.aclose()

    assert 0 < asyncio.run(ttl()) <= LIVE_TTL_S <= 10
    worker = mesh.proc("unified-1")
    killed_at = time.monotonic()
    os.killpg(worker.popen.pid, signal.SIGKILL)
    worker.popen.wait()
    wait_for(lambda: "unified-1" not in indexed(mesh, P1), LIVE_TTL_S + 2, "the dead worker's entries to expire")
    assert time.monotonic() - killed_at <= LIVE_TTL_S + 1
