"""The router's Route over a real Redis index: prefix routing, the load guard, degradation, metrics."""

import asyncio
import functools
import re

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services.common import envs
from services.common.block_hash import extra_keys, hash_blocks
from services.common.pb import meshserve_pb2 as pb
from services.common.prefix_index import IndexPublisher, PrefixIndex, connect, connect_lookup
from services.policy.routing.policies import make_routing_policy
from services.router.registry import Registry
from services.router.server import RouterServicer
from tests.support.fakes import Clock
from tests.support.metrics import metric_points
from tests.support.redis_server import RedisServer

BS = 16
PROMPT = list(range(1000, 1000 + 8 * BS + 5))  # 8 full blocks + a tail


@pytest.fixture
def server():
    s = RedisServer().start()
    yield s
    s.kill()


def make_router(redis_url, policy="prefix-aware", recent_ttl=None):
    reader = InMemoryMetricReader()
    clock = Clock()
    registry = Registry(clock)
    index = PrefixIndex(connect_lookup(redis_url))
    servicer = RouterServicer(registry, functools.partial(make_routing_policy, policy, {}), "unified", 1000,
                              index=index, meter=MeterProvider(metric_readers=[reader]).get_meter("test"))
    if recent_ttl is not None:
        servicer.recent.ttl_s = recent_ttl
    return servicer, reader, clock


async def beat(router, worker_id, member, outstanding=0, capacity=10_000, host="", kv_pool=False):
    await router.Heartbeat(pb.WorkerLoad(worker_id=worker_id, address=f"addr-{worker_id}", role="unified",
                                         outstanding_tokens=outstanding, kv_capacity_tokens=capacity,
                                         block_size=BS, index_member=member, host=host, kv_pool=kv_pool), None)


async def publish(client, worker_id, blocks):
    pub = IndexPublisher(client, worker_id)
    hs = hash_blocks(PROMPT, BS, extra_keys())[:blocks]

    async def snapshot():
        return hs
    assert await pub.flush(snapshot)
    return pub.member


async def route(router, prompt=PROMPT):
    return await router.Route(pb.RouteRequest(prompt_tokens=len(prompt), max_tokens=8, prompt_token_ids=prompt), None)


def test_prefix_aware_routes_to_the_worker_holding_the_prompt(server):
    async def go():
        client = connect(server.url)
        router, reader, _ = make_router(server.url, recent_ttl=0.0)
        members = {w: await publish(client, w, n) for w, n in (("w0", 2), ("w1", 8), ("w2", 0))}
        for w, m in members.items():
            await beat(router, w, m, outstanding=100)
        d = await route(router)
        assert d.decode_worker == "addr-w1"
        assert d.cached_prefix_tokens == 8 * BS
        assert "prefix=1.00" in d.reason and d.decision_ms > 0
        # load guard: w1 far busier than the others -> load wins over the cache
        await beat(router, "w1", members["w1"], outstanding=15_000)
        d = await route(router)
        assert d.decode_worker != "addr-w1" and d.reason.startswith("load guard")
        points = metric_points(reader)
        assert points["meshserve.router.decision"][0].count == 2
        assert points["meshserve.router.prefix_hit_tokens"][0].sum == 8 * BS + 2 * BS  # w1 then w0 (2 blocks)
        outstanding = {p.attributes["worker_id"]: p.value for p in points["meshserve.router.worker_outstanding_tokens"]}
        assert outstanding["w1"] == 15_000
        await client.aclose()
    asyncio.run(go())


class AbortingContext:
    """Stands in for a servicer context: abort() records the status and raises, as grpc.aio's does."""

    trailing = ()

    def set_trailing_metadata(self, metadata):
        self.trailing = tuple(metadata)

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise RuntimeError(details)


def test_block_hashes_from_the_gateway_route_as_the_prompt_would_and_a_mismatch_falls_back(server):
    """The gateway hashes a prompt once and sends the hashes: the router uses them when they were hashed with its
    workers' block size, and hashes the prompt itself otherwise."""
    from services.common.block_hash import pack_tokens, prompt_hashes

    async def go():
        client = connect(server.url)
        router, _, _ = make_router(server.url, recent_ttl=0.0)
        for w, n in (("w0", 2), ("w1", 8)):
            await beat(router, w, await publish(client, w, n), outstanding=100)
        packed = pack_tokens(PROMPT)
        hashed = b"".join(prompt_hashes(packed, BS))
        by_hashes = await router.Route(pb.RouteRequest(prompt_tokens=len(PROMPT), max_tokens=8, block_hashes=hashed,
                                                       hash_block_size=BS), None)
        assert (by_hashes.decode_worker, by_hashes.cached_prefix_tokens) == ("addr-w1", 8 * BS)
        wrong_size = b"".join(prompt_hashes(packed, 2 * BS))
        fallback = await router.Route(pb.RouteRequest(prompt_tokens=len(PROMPT), max_tokens=8, prompt_u32=packed,
                                                      block_hashes=wrong_size, hash_block_size=2 * BS), None)
        assert (fallback.decode_worker, fallback.cached_prefix_tokens) == ("addr-w1", 8 * BS)
        ctx = AbortingContext()
        with pytest.raises(RuntimeError):
            await router.Route(pb.RouteRequest(prompt_tokens=len(PROMPT), max_tokens=8, block_hashes=hashed[:-3],
                                               hash_block_size=BS), ctx)
        assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and "16-byte" in ctx.details
        await client.aclose()
    asyncio.run(go())


def test_a_burst_of_one_new_prompt_lands_together_before_the_index_shows_it(server):
    async def go():
        router, _, _ = make_router(server.url)
        for w in ("w0", "w1", "w2"):
            await beat(router, w, "", outstanding=0)
        picks = {(await route(router)).decode_worker for _ in range(3)}
        assert len(picks) == 1  # the router's recent-routes overlay keeps the prefix on one worker
    asyncio.run(go())


def test_round_robin_does_not_touch_redis(server):
    async def go():
        router, _, _ = make_router(server.url, policy="round-robin")
        for w in ("w0", "w1"):
            await beat(router, w, "")
        server.kill()
        picks = [(await route(router)).decode_worker for _ in range(4)]
        assert picks == ["addr-w0", "addr-w1"] * 2 and not router.index.degraded
    asyncio.run(go())


def test_redis_down_routes_by_load_and_recovers(server):
    async def go():
        client = connect(server.url)
        router, reader, _ = make_router(server.url, recent_ttl=0.0)
        m1 = await publish(client, "w1", 8)
        await beat(router, "w0", "", outstanding=0)
        await beat(router, "w1", m1, outstanding=500)
        assert (await route(router)).decode_worker == "addr-w1"
        server.kill()
        d = await route(router)  # no error: by load
        assert d.decode_worker == "addr-w0" and d.cached_prefix_tokens == 0
        assert router.index.degraded
        listed = await router.ListWorkers(pb.ListWorkersRequest(), None)
        assert listed.prefix_index_degraded
        router.set_degraded(router.index.degraded)
        assert metric_points(reader)["meshserve.router.prefix_index_degraded"][0].value == 1
        server.start()
        m1 = await publish(connect(server.url), "w1", 8)  # the worker republishes after the restart
        await beat(router, "w1", m1, outstanding=500)
        router.index.backoff.succeeded()  # the retry is due
        assert router.index.probe() and not router.index.degraded
        assert (await route(router)).decode_worker == "addr-w1"
    asyncio.run(go())


def test_a_pool_resident_prefix_counts_for_the_workers_of_its_host_that_take_from_the_pool(server):
    """The kvstore publishes its pool as pool@<host>: a worker of that host with --kv-pool scores its blocks at
    POOL_CREDIT of a local hit; a local hit still wins at equal load; another host's workers, and workers that do
    not take from the pool, get no credit."""
    from services.common.members import POOL_MEMBER
    from services.policy.routing.scoring import POOL_CREDIT

    async def go():
        client = connect(server.url)
        router, _, _ = make_router(server.url, recent_ttl=0.0)
        await publish(client, POOL_MEMBER + "h1", 8)
        local = await publish(client, "w0", 8)
        await beat(router, "w0", local, outstanding=100, host="h1", kv_pool=True)  # holds it itself
        await beat(router, "w1", "", outstanding=100, host="h1", kv_pool=True)  # its host's pool holds it
        await beat(router, "w2", "", outstanding=0, host="h1", kv_pool=False)  # idle, but does not take from the pool
        await beat(router, "w3", "", outstanding=100, host="h2", kv_pool=True)  # another host
        d = await route(router)
        assert d.decode_worker == "addr-w0"
        scores = {w: float(x) for w, x in re.findall(r"(w\d)=[\d.]+\([^)]*prefix=([\d.]+)", d.reason)}
        assert scores == {"w0": 1.0, "w1": POOL_CREDIT, "w2": 0.0, "w3": 0.0}, d.reason
        await beat(router, "w0", local, outstanding=9_000, host="h1", kv_pool=True)  # busy: the pooled peer wins
        assert (await route(router)).decode_worker == "addr-w1"
        await client.aclose()
    asyncio.run(go())


def test_lora_routes_by_placement_homes_and_prefetches_hot_adapters():
    """Route with an adapter: only workers that registered it; the hot one is homed on both (and prefetched where
    missing), a cold one on one worker, where its requests then go."""
    from services.policy.routing.adapter_placement import AdapterPlacement

    clock = Clock()
    registry = Registry(clock)
    servicer = RouterServicer(registry, functools.partial(make_routing_policy, "lora-aware", {}), "unified", 1000,
                              placement=AdapterPlacement(), meter=MeterProvider().get_meter("test"))
    sent = []

    async def prefetch(worker, adapter):
        sent.append((worker.worker_id, adapter))
    servicer._prefetch = prefetch

    async def beats():  # both idle again: what was routed since the last beat is forgotten
        for wid, held in (("w0", ("hot",)), ("w1", ())):
            await servicer.Heartbeat(pb.WorkerLoad(
                worker_id=wid, address=f"addr-{wid}", role="unified", kv_capacity_tokens=10_000, block_size=BS,
                known_adapters=["hot", "cold", "only0"] if wid == "w0" else ["hot", "cold"], adapters=held,
                host_adapters=held, lora_slots=2, free_lora_slots=2 - len(held)), None)

    async def scenario():
        await beats()
        picks = []
        for adapter in ["hot"] * 6 + ["cold", "only0"]:
            d = await servicer.Route(pb.RouteRequest(prompt_tokens=8, max_tokens=8, adapter=adapter,
                                                     prompt_token_ids=PROMPT[:8]), None)
            picks.append(d.decode_worker)
        assert picks[-1] == "addr-w0"  # only w0 registered it
        await servicer.place()
        await asyncio.sleep(0)
        homes = servicer.placement.home("unified", "cold")
        assert servicer.placement.home("unified", "hot") == {"w0", "w1"} and len(homes) == 1
        assert sent == [("w1", "hot")]  # the hot adapter's replica that lacks it; cold ones are read on demand
        await beats()
        d = await servicer.Route(pb.RouteRequest(prompt_tokens=8, max_tokens=8, adapter="cold",
                                                 prompt_token_ids=PROMPT[:8]), None)
        assert d.decode_worker == f"addr-{next(iter(homes))}"

    asyncio.run(scenario())


@pytest.mark.parametrize("policy", ["least-outstanding", "prefix-aware"])
def test_equally_loaded_decode_workers_go_nearest_the_prefill_worker_first(policy):
    """Disaggregated: among equally loaded decode workers the one in the prefill worker's domain, then its node,
    then the rest (whatever their ids); load still comes first."""
    registry = Registry(Clock())
    servicer = RouterServicer(registry, functools.partial(make_routing_policy, policy, {}), "disaggregated", 1000,
                              meter=MeterProvider().get_meter("test"))
    places = {"p0": ("prefill", "r0/n0/d0"), "a": ("decode", "r1/n5/d0"), "b": ("decode", "r0/n0/d1"),
              "c": ("decode", "r0/n0/d0")}

    async def scenario():
        for wid, (role, topology) in places.items():
            await servicer.Heartbeat(pb.WorkerLoad(worker_id=wid, address=f"addr-{wid}", role=role,
                                                   kv_capacity_tokens=10_000, block_size=BS, topology=topology), None)
        picks = []
        for _ in range(3):
            d = await servicer.Route(pb.RouteRequest(prompt_tokens=64, max_tokens=32, prompt_token_ids=PROMPT), None)
            assert d.prefill_worker == "addr-p0"
            picks.append(d.decode_worker)
        return picks

    # idle: same domain, then same node; the third goes to the idle far one, not to a busier near one
    assert asyncio.run(scenario()) == ["addr-c", "addr-b", "addr-a"]


def test_topology_paths_and_their_distance(monkeypatch):
    from services.common import host

    monkeypatch.setenv(envs.TOPOLOGY.name, "rack-1/node-7/numa0")
    assert host.topology() == "rack-1/node-7/numa0"
    for bad in ("node-7", "rack-1//numa0", "a/b/c/d"):
        monkeypatch.setenv(envs.TOPOLOGY.name, bad)
        with pytest.raises(ValueError, match="MESHSERVE_TOPOLOGY"):
            host.topology()
    monkeypatch.delenv(envs.TOPOLOGY.name)
    assert host.topology() == f"/{host.host_id()}/"  # on one machine: every worker on the same node
    assert [host.distance("r/n/d", other) for other in ("r/n/d", "r/n/e", "r/m/d", "s/n/d", "", "junk", "a/b/c/d")] == [
        0, 1, 2, 3, 3, 3, 3]
