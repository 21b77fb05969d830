"""Online load against a running gateway: requests streamed at their arrival times, and a sampler of
every worker's outstanding tokens (for load imbalance)."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from bench.latency import Timing
from services.common.convert import request_from_line
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc


async def drive(gateway: str, reqs: list, arrivals: list | None, timeout_s: float = 900,
                keys: dict | None = None) -> list[Timing]:
    """Stream every request at its arrival time (None: one at a time); one Timing per request, in order (a
    request that fails has its status in Timing.error). keys: tenant -> API key (a request's "tenant" picks it)."""
    async with grpc.aio.insecure_channel(gateway) as ch:
        stub = pb_grpc.GenerationStub(ch)
        t0 = time.perf_counter()

        async def one(r, at):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            timing = Timing(arrival_s=time.perf_counter())
            try:
                meta = (("x-api-key", keys[r["tenant"]]),) if keys else None
                async for resp in stub.Generate(request_from_line(r), timeout=timeout_s, metadata=meta):
                    timing.on_tokens(time.perf_counter(), list(resp.token_ids))
                    timing.prompt_tokens, timing.cached_tokens = resp.prompt_tokens, resp.cached_prompt_tokens
            except grpc.aio.AioRpcError as e:  # counted (failed_requests), not fatal: a rejection is a result
                timing.error = e.code().name
            return timing

        if arrivals is None:
            return [await one(r, 0.0) for r in reqs]
        return list(await asyncio.gather(*(one(r, at) for r, at in zip(reqs, arrivals))))


def run_online(gateway: str, reqs: list, arrivals: list | None) -> tuple[list[Timing], float]:
    t0 = time.perf_counter()
    timings = asyncio.run(drive(gateway, reqs, arrivals))
    return timings, time.perf_counter() - t0


class LoadSampler:
    """Polls every worker's outstanding tokens (and requests held) every period_s in a thread.

    imbalance(): the mean over samples of max/mean outstanding tokens, over samples where the mean is
    > 0; with busy=True only over samples where the mesh holds at least one request per worker (at
    lower occupancy max/mean is high whatever the policy: one request alone on 4 workers gives 4)."""

    def __init__(self, addresses: list[str], period_s: float = 0.1):
        self.addresses, self.period_s = addresses, period_s
        self.samples: list[list[int]] = []
        self.requests: list[int] = []  # requests held by all workers, per sample
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LoadSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_flag.set()
        self.thread.join()

    def _run(self) -> None:
        channels = [grpc.insecure_channel(a) for a in self.addresses]
        stubs = [pb_grpc.WorkerStub(c) for c in channels]
        while not self.stop_flag.wait(self.period_s):
            try:
                stats = [s.Stats(pb.StatsRequest(), timeout=2) for s in stubs]
            except grpc.RpcError:
                continue
            self.samples.append([st.outstanding_tokens for st in stats])
            self.requests.append(sum(st.running + st.waiting for st in stats))
        for c in channels:
            c.close()

    def imbalance(self, busy: bool = False) -> float | None:
        ratios = [max(s) / (sum(s) / len(s)) for s, n in zip(self.samples, self.requests)
                  if sum(s) > 0 and (not busy or n >= len(s))]
        return round(sum(ratios) / len(ratios), 3) if ratios else None


def warm(mesh) -> None:
    """A few short requests so every worker has run a step (their prompts share nothing with a workload)."""
    reqs = [{"id": f"warm-{i}", "prompt_token_ids": [5 + i] * 24, "max_tokens": 4, "temperature": 0.0,
             "ignore_eos": True} for i in range(8)]
    run_online(mesh.gateway, reqs, [0.0] * len(reqs))
