"""Workload router-latency: the router and Redis alone (no model), prefix-aware policy.

8 workers registered by heartbeat, each publishing (through the workers' IndexPublisher) its own
random-depth prefixes of 8 prompts of 4,096 tokens (256 blocks of 16) to the Redis index (about 8k
block entries). Then Route requests with 4,096-token prompts (one of the 8 prompts, so every lookup
walks deep sets), one at a time, as the gateway sends them: the prompt and its block hashes (the
gateway hashes each prompt once). `decision_ms` is measured inside the router (the one Redis round
trip, scoring, commit) and returned in RouteDecision; the client-side RPC time is reported beside it.
System `router`: that index; `router-index-100k`: the same after the workers publish other blocks
until the index holds --index-entries block entries (other prompts' chains, as a busy fleet's);
`router-hashing`: the 8k index, the prompt alone (a client that sends no hashes: the router hashes).
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time

import grpc

from bench.common import log, machine, print_table, write_result
from bench.latency import percentile
from services.common.block_hash import extra_keys, hash_blocks, pack_tokens, prompt_hashes
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.common.prefix_index import IndexPublisher, connect
from services.mesh.launcher import free_port, redis_command, serving, signal_group

WORKERS, PROMPTS, PROMPT_TOKENS, BLOCK = 8, 8, 4096, 16


def add_flags(p) -> None:
    g = p.add_argument_group("router-latency")
    g.add_argument("--index-entries", type=int, default=100_000,
                   help="block entries in the index for the second measurement")


def run(args) -> int:
    n = 200 if args.quick else 2000
    redis_port, router_port = free_port(), free_port()
    url = f"redis://127.0.0.1:{redis_port}/0"
    procs = [subprocess.Popen(redis_command(redis_port), stdout=subprocess.DEVNULL, start_new_session=True)]
    procs.append(subprocess.Popen([sys.executable, "-m", "services.router", "--port", str(router_port), "--policy",
                                   "prefix-aware", "--mode", "unified", "--redis-url", url],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
    try:
        deadline = time.monotonic() + 30
        while not serving(f"127.0.0.1:{router_port}"):
            if time.monotonic() > deadline:
                raise TimeoutError("router not healthy")
            time.sleep(0.1)
        systems = asyncio.run(_measure(url, f"127.0.0.1:{router_port}", n, args.seed, args.index_entries))
    finally:
        for p in procs:
            signal_group(p, 15)
            p.wait()
    result = {"workload": "router-latency", "command": args.command_line, "machine": machine(),
              "config": {"routes": n, "workers": WORKERS, "prompts": PROMPTS, "prompt_tokens": PROMPT_TOKENS,
                         "block_size": BLOCK, "policy": "prefix-aware"},
              "systems": systems}
    write_result(result, args.out)
    print_table(result)
    return 0


async def _measure(url: str, router: str, n: int, seed: int, entries: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 32000) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
    hashes = [hash_blocks(p, BLOCK, extra_keys()) for p in prompts]
    client = connect(url, timeout_s=5)
    publishers = []
    for w in range(WORKERS):
        held = [h for hs in hashes for h in hs[:rng.randint(0, len(hs))]]
        pub = IndexPublisher(client, f"w{w}")

        async def snapshot(held=held):
            return held
        assert await pub.flush(snapshot)
        publishers.append((pub, snapshot))
    blocks = sum(p.published_blocks for p, _ in publishers)
    log(f"index: {WORKERS} workers, {blocks} block entries")
    packed = [pack_tokens(p) for p in prompts]  # as the gateway sends them
    async with grpc.aio.insecure_channel(router) as ch:
        stub = pb_grpc.RouterStub(ch)

        async def beats():
            while True:
                for w, (pub, snapshot) in enumerate(publishers):
                    await pub.keepalive(snapshot)
                    await stub.Heartbeat(pb.WorkerLoad(
                        worker_id=f"w{w}", address=f"127.0.0.1:{9000 + w}", role="unified",
                        outstanding_tokens=rng.randint(0, 20000), kv_capacity_tokens=200_000, block_size=BLOCK,
                        index_member=pub.member))
                await asyncio.sleep(0.5)

        beat = asyncio.create_task(beats())
        await asyncio.sleep(0.5)
        hashed = [b"".join(prompt_hashes(p, BLOCK)) for p in packed]  # as the gateway sends them
        systems = {"router": {**await _routes(stub, packed, hashed, n), "index_entries": blocks}}
        log(f"router: {systems['router']}")
        systems["router-hashing"] = {**await _routes(stub, packed, None, n), "index_entries": blocks}
        log(f"router-hashing: {systems['router-hashing']}")
        filler = random.Random(seed + 1)
        while blocks < entries:  # other chains, spread over the workers
            pub, snapshot = publishers[blocks % WORKERS]
            chain = [filler.randbytes(16) for _ in range(min(256, entries - blocks))]
            pub.add([("stored", h) for h in chain])
            assert await pub.flush(snapshot)
            blocks += len(chain)
        systems["router-index-100k"] = {**await _routes(stub, packed, hashed, n), "index_entries": blocks}
        log(f"router-index-100k: {systems['router-index-100k']}")
        beat.cancel()
    await client.aclose()
    return systems


async def _routes(stub, packed: list, hashed: list | None, n: int) -> dict:
    """n Route calls (after 50 unmeasured), cycling over the prompts; with their block hashes unless hashed is
    None."""
    inside, outside, hit = [], [], []
    for i in range(n + 50):
        t = time.perf_counter()
        k = i % PROMPTS
        d = await stub.Route(pb.RouteRequest(request_id=f"r{i}", prompt_tokens=PROMPT_TOKENS, max_tokens=64,
                                             prompt_u32=packed[k], mode="unified",
                                             block_hashes=hashed[k] if hashed else b"",
                                             hash_block_size=BLOCK if hashed else 0))
        if i >= 50:  # warm-up excluded
            outside.append((time.perf_counter() - t) * 1e3)
            inside.append(d.decision_ms)
            hit.append(d.cached_prefix_tokens)
    r = lambda x: round(x, 3)  # noqa: E731
    return {"decision_ms_p50": r(percentile(inside, 0.5)), "decision_ms_p99": r(percentile(inside, 0.99)),
            "rpc_ms_p50": r(percentile(outside, 0.5)), "rpc_ms_p99": r(percentile(outside, 0.99)),
            "mean_cached_prefix_tokens": r(sum(hit) / len(hit)), "routes": n}
