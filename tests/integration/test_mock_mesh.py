"""The mesh at scale with the mock engine (engine.backend mock): 16 workers (4 prefill, 12 decode) beside the gateway,
router, kvstore and Redis, a short load through the gateway: every request completes with its tokens, the same
prompt gives the same tokens whichever workers served it (KV handed from prefill to decode through the kvstore), and
every worker served some."""

import asyncio

import grpc
import pytest

from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import Mesh, MeshSpec
from tests.support.mesh import generate_request, worker_stats

pytestmark = pytest.mark.slow
PREFILL, DECODE = 4, 12
# time scale 5 of the cpu-smollm2 profile: ~15 ms decode steps, slow enough that the 2-core machine's 16 workers
# and services keep up
MOCK = ["--backend", "mock", "--mock-profile", "cpu-smollm2", "--mock-time-scale", "5", "--kv-cache-gb", "0.05"]


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    spec = MeshSpec(str(tiny_model), mode="disaggregated", prefill=PREFILL, decode=DECODE, engine_args=MOCK)
    m = Mesh(spec, log_dir=str(tmp_path_factory.mktemp("mock-mesh"))).start()
    yield m
    m.stop()


async def stream(address: str, prompts: list, max_tokens: int) -> list:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)

        async def one(ids):
            tokens, reason = [], None
            async for r in stub.Generate(generate_request(ids, max_tokens=max_tokens), timeout=120):
                tokens += list(r.token_ids)
                reason = r.finish_reason or reason
            return tokens, reason

        return await asyncio.gather(*(one(p) for p in prompts))


def test_sixteen_mock_workers_serve_a_load_through_the_gateway(mesh):
    prompts = [[(7 * i + j) % 200 + 1 for j in range(20 + 3 * i)] for i in range(48)]
    prompts += prompts[:16]  # the same prompts again: they must give the same tokens
    results = asyncio.run(stream(mesh.gateway, prompts, max_tokens=16))
    assert all(len(tokens) == 16 and reason == "length" for tokens, reason in results)
    assert [t for t, _ in results[48:]] == [t for t, _ in results[:16]]
    served = {p.name: worker_stats(p.address).max_live for p in mesh.workers("prefill") + mesh.workers("decode")}
    assert len(served) == PREFILL + DECODE
    assert all(n > 0 for n in served.values()), served
