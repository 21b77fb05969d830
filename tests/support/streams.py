"""Many greedy streams through a gateway at once, as the load and fault tests send them."""

from __future__ import annotations

import asyncio

import grpc

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc


async def greedy_streams(gateway: str, prompts: list, max_tokens: int, timeout_s: float = 120,
                         on_tokens=None) -> list:
    """Each prompt's (tokens, "CODE: details" or None); on_tokens(received) is called with the tokens received in
    all streams so far after every response."""
    received = 0

    async def one(stub, ids):
        nonlocal received
        tokens = []
        try:
            async for r in stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.Sampling(
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=True)), timeout=timeout_s):
                tokens += r.token_ids
                received += len(r.token_ids)
                if on_tokens is not None:
                    on_tokens(received)
        except grpc.aio.AioRpcError as e:
            return tokens, f"{e.code().name}: {e.details()}"
        return tokens, None

    async with grpc.aio.insecure_channel(gateway) as ch:
        stub = pb_grpc.GenerationStub(ch)
        return await asyncio.gather(*(one(stub, p) for p in prompts))
