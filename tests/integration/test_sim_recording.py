"""A real mesh feeds the simulator: its gateway records the trace it was offered, its worker logs the steps the
calibration fits, and the simulator replays the recording."""

import asyncio
import json

import grpc

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from sim.cluster import ClusterSpec
from sim.cost import CostModel, fit, intervals
from sim.run import simulate
from sim.trace import read_jsonl
from sim.worker import WorkerSpec
from tests.support.mesh import start_mesh


async def _send(address, prompts, max_tokens):
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)

        async def one(ids, n):
            got = 0
            s = pb.Sampling(max_tokens=n, temperature=0.0, ignore_eos=True)
            async for r in stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=s), timeout=120):
                got += len(r.token_ids)
            return got

        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens)))


def test_a_recorded_trace_and_step_log_drive_the_simulator(tiny_model, tmp_path_factory, tmp_path):
    trace_path, steps = tmp_path / "trace.jsonl", tmp_path / "steps"
    steps.mkdir()
    shared = [5 + i % 50 for i in range(48)]  # three full blocks of 16 every prompt starts with
    prompts = [shared + [100 + i] * (3 + 7 * i) for i in range(12)]
    # the longest output outlasts every prompt step by far, so the fit finds its 12 decode-only steps however
    # the gateway happens to interleave the arrivals (at 4 + 2i it logged 11 once)
    max_tokens = [8 + 4 * i for i in range(12)]
    mesh = start_mesh(tiny_model, tmp_path_factory, "unified", gateway_args=["--record-trace", str(trace_path)],
                      env={"MESHSERVE_STEP_LOG": str(steps)})
    try:
        got = asyncio.run(_send(mesh.gateway, prompts, max_tokens))
        assert got == max_tokens
    finally:
        mesh.stop()  # the step log is complete once the worker has stopped

    trace = read_jsonl(trace_path)
    assert sorted(r.prompt_tokens for r in trace) == sorted(map(len, prompts))
    assert sorted(r.output_tokens for r in trace) == sorted(max_tokens)
    assert len({tuple(map(tuple, r.prefix[:3])) for r in trace}) == 1  # the shared prefix, as shared segments
    assert len({tuple(map(tuple, r.prefix)) for r in trace if len(r.prefix) > 3}) == \
        sum(len(p) // 16 > 3 for p in prompts)

    logged = list(steps.glob("steps-*.jsonl"))
    rows = intervals([json.loads(line) for f in logged for line in f.read_text().splitlines()])
    assert sum(r[0] for r in rows) >= sum(max_tokens)  # every output token came from a logged step
    terms, quality = fit(rows)
    assert terms["base_s"] > 0 and quality["steps"] == len(rows)

    spec = ClusterSpec(workers=1, worker=WorkerSpec(num_blocks=256, max_num_batched_tokens=64), admission="none",
                       routing="prefix-aware")
    summary = simulate(spec, CostModel(**terms), trace)["summary"]
    assert summary["completed"] == 12 and summary["cached_prompt_tokens"] > 0
