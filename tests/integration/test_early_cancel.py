"""Requests cancelled within milliseconds of sending leak nothing (issue 19): on a mesh whose workers take 8
sequences at most, 400 requests each cancelled 0-10 ms after sending leave every worker with no running or
waiting request, no used block and every slot granted to the gateway as a credit again (a call cancelled in
flight never reaches the worker: its credit is given back), and the mesh still serves."""

import asyncio
import random
import time

import grpc
import pytest

from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import Mesh, MeshSpec
from tests.support.mesh import ENGINE, assert_idle, generate_request, worker_stats

ROLES = {"disaggregated": ["prefill", "decode"], "unified": ["unified"]}
SLOTS = 8


@pytest.fixture(scope="module", params=sorted(ROLES))
def narrow(request, tiny_model, tmp_path_factory):
    spec = MeshSpec(str(tiny_model), mode=request.param, engine_args=ENGINE + ["--max-num-seqs", str(SLOTS)])
    mesh = Mesh(spec, log_dir=str(tmp_path_factory.mktemp(f"narrow-{request.param}"))).start()
    yield request.param, mesh
    mesh.stop()


async def send_and_cancel(gateway: str, n: int, seed: int) -> dict:
    """n requests at once, each cancelled after its own random 0-10 ms; the final status of each call."""
    rng = random.Random(seed)
    codes: dict = {}
    async with grpc.aio.insecure_channel(gateway) as ch:
        stub = pb_grpc.GenerationStub(ch)

        async def one(i: int) -> None:
            ids = [rng.randrange(3, 4000) for _ in range(rng.randint(4, 80))]
            call = stub.Generate(generate_request(ids, max_tokens=64), timeout=60)
            wait = rng.uniform(0, 0.010)

            async def read():
                async for _ in call:
                    pass
            reader = asyncio.ensure_future(read())
            await asyncio.sleep(wait)
            call.cancel()
            try:
                await reader
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass
            code = await call.code()
            codes[code.name] = codes.get(code.name, 0) + 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return codes


async def one_request(gateway: str) -> list:
    async with grpc.aio.insecure_channel(gateway) as ch:
        tokens = []
        async for r in pb_grpc.GenerationStub(ch).Generate(generate_request(list(range(3, 40)), max_tokens=8),
                                                          timeout=60):
            tokens += list(r.token_ids)
        return tokens


def test_early_cancels_leave_no_slot_or_block(narrow):
    mode, mesh = narrow
    codes = asyncio.run(send_and_cancel(mesh.gateway, 400, seed=19))
    assert codes.get("CANCELLED", 0) >= 300, codes  # nearly all were still in flight when cancelled
    assert_idle(mesh, ROLES[mode])  # no used block anywhere, no transfer left in the kvstore
    for role in ROLES[mode]:
        for p in mesh.workers(role):
            stats = worker_stats(p.address)
            assert stats.running == 0 and stats.waiting == 0 and stats.outstanding_tokens == 0, (p.name, stats)
    assert_all_credits_out(mesh, ROLES[mode][-1])
    assert len(asyncio.run(one_request(mesh.gateway))) == 8  # the slots are free: a new request is served


def assert_all_credits_out(mesh, role: str) -> None:
    """Every slot of the workers that grant credits (the role the gateway sends to) is granted to the gateway
    again (polled: credits are given back by asynchronous calls)."""
    deadline = time.monotonic() + 15
    while True:
        stats = {p.name: worker_stats(p.address) for p in mesh.workers(role)}
        if all(s.credits_out == SLOTS for s in stats.values()):
            return
        if time.monotonic() > deadline:
            pytest.fail("slots not granted again: " + ", ".join(
                f"{name}: {s.credits_out} credits out, {s.credits_lost} given back" for name, s in stats.items()))
        time.sleep(0.1)
