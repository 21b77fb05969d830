"""A hung worker is a failed worker (issue 65): with greedy streams in flight on the real model (SmolLM2-135M, two
prefill and two decode workers, two routers), one process is stopped with SIGSTOP (by its own pid, from Python): a
decode worker (its server and its engine core), a decode worker's engine core alone (its server beats on), a prefill
worker, the first router, the kvstore. Every stream completes token-identical to the healthy mesh while the process
is still stopped (the gateway's progress bound cancels a stream whose worker sends nothing and resumes it
elsewhere); after SIGCONT no worker holds a block and the kvstore no transfer, and the mesh serves again.

The time the streams took is printed beside the healthy mesh's; the stop lasts until they are done or LIVENESS_S
passes (a liveness bound with room on a busy 2-core machine, not a measurement)."""

import asyncio
import os
import signal
import time

import grpc
import pytest

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import MeshSpec
from tests.support.mesh import idle, supervised
from tests.support.procs import children
from tests.support.reference import random_prompts
from tests.support.streams import greedy_streams
from tests.support.wait import wait_for

STREAMS, NEW = 12, 24
LIVENESS_S = 90.0


@pytest.fixture(scope="module")
def mesh(smollm2_dir, tmp_path_factory):
    spec = MeshSpec(str(smollm2_dir), mode="disaggregated", prefill=2, decode=2, routers=2,
                    engine_args=["--kv-cache-gb", "0.1"])
    yield from supervised(spec, str(tmp_path_factory.mktemp("hung")))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(STREAMS, seed=65, lo=16, hi=96, vocab=40000)


@pytest.fixture(scope="module")
def reference(mesh, prompts):
    asyncio.run(greedy_streams(mesh.gateway, prompts, 2))  # warm: every worker's step times measured
    start = time.monotonic()
    got = asyncio.run(greedy_streams(mesh.gateway, prompts, NEW))
    assert all(status is None for _, status in got), got
    return [tokens for tokens, _ in got], time.monotonic() - start


def victims(mesh, which: str) -> list[int]:
    """The pids to stop: only processes this test's mesh started, each by its own pid."""
    if which == "decode":
        worker = mesh.proc("decode-0").popen.pid
        return [worker, *children(worker)]
    if which == "core":  # the other decode worker: decode-0 is still avoided after the case before
        return children(mesh.proc("decode-1").popen.pid)
    if which == "prefill":
        worker = mesh.proc("prefill-0").popen.pid
        return [worker, *children(worker)]
    return [mesh.proc({"router": "router", "kvstore": "kvstore"}[which]).popen.pid]


@pytest.mark.parametrize("which", ["decode", "core", "prefill", "router", "kvstore"])
def test_a_stopped_process_stalls_no_stream(mesh, prompts, reference, which):
    want, healthy_s = reference
    pids = victims(mesh, which)
    assert pids, f"no process to stop for {which}"

    async def scenario():
        started = asyncio.Event()
        streams = asyncio.ensure_future(greedy_streams(
            mesh.gateway, prompts, NEW, timeout_s=LIVENESS_S,
            on_tokens=lambda n: n >= (STREAMS * NEW // 4 if which in ("decode", "core") else 0) and started.set()))
        if which in ("decode", "core"):  # mid-decode; the others before the first token (prefills in flight)
            await asyncio.wait_for(started.wait(), 60)
        t0 = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            got = await asyncio.wait_for(streams, LIVENESS_S)
            return got, time.monotonic() - t0
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

    got, took_s = asyncio.run(scenario())
    print(f"\n{which} stopped: {STREAMS} streams done {took_s:.1f} s after the stop (healthy mesh: {healthy_s:.1f} s "
          f"for all of them)")
    failed = [(i, status) for i, (_, status) in enumerate(got) if status]
    assert not failed, f"{len(failed)} of {STREAMS} streams failed: {failed[:4]}"
    wrong = [i for i, (tokens, _) in enumerate(got) if tokens != want[i]]
    assert not wrong, f"streams {wrong} differ from the healthy mesh's"
    # woken: it learns its streams were cancelled and frees their KV; the kvstore drops their transfers
    wait_for(lambda: not idle(mesh) or None, 70, "every block, sequence and transfer freed after SIGCONT")
    if which in ("decode", "core"):  # the woken worker serves (a direct call: the gateway avoids it for a while)
        woken = mesh.proc("decode-0" if which == "decode" else "decode-1")
        assert direct_decode(woken.address, prompts[0]) == want[0]
    again = asyncio.run(greedy_streams(mesh.gateway, prompts[:4], NEW))
    assert [t for t, _ in again] == want[:4], [status for _, status in again]


def direct_decode(address: str, prompt: list) -> list:
    """A decode worker's own Decode without a transfer (it computes the prompt itself)."""
    work = pb.WorkRequest(request_id=f"direct-{time.monotonic_ns()}", prompt_token_ids=prompt,
                          sampling=pb.Sampling(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(address) as ch:
        return [t for ev in pb_grpc.WorkerStub(ch).Decode(work, timeout=60) for t in ev.token_ids]
