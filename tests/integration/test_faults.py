"""Faults under load (issue 19): 32 greedy streams in flight while one service of a supervised mesh (TLS on, two
routers) is killed with SIGKILL: a decode worker, the prefill worker, the kvstore, a router, Redis. Every stream
completes token-identical to the same request on the healthy mesh (the gateway resumes a stream a dead service
failed on another worker, or on the same one once it is back, re-prefilling the prompt and the tokens already
streamed); the service comes back (3.1-4.2 s for a worker on a quiet 2-core AMD EPYC; under the whole suite's load
with other work on the machine a restarted worker took more than 10 s twice, the bound this had: the bound, now 30 s,
is a liveness check with room, the figure is the measurement's); afterwards no worker holds a block or a sequence,
the kvstore holds no transfer, and both routers see the same load."""

import asyncio
import os
import signal
import time

import pytest

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import MeshSpec, client_channel, serving
from tests.support.mesh import ENGINE, idle, supervised
from tests.support.reference import random_prompts
from tests.support.streams import greedy_streams
from tests.support.wait import wait_for as wait

STREAMS, NEW = 32, 40


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    spec = MeshSpec(str(tiny_model), mode="disaggregated", decode=2, routers=2, tls=True, engine_args=ENGINE)
    yield from supervised(spec, str(tmp_path_factory.mktemp("faults")))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(STREAMS, seed=31, lo=4, hi=60, vocab=4000)


async def run_streams(gateway: str, prompts: list, started: asyncio.Event | None = None, start_after: int = 0):
    """Each prompt's (tokens, status name or None); `started` is set once start_after tokens arrived in all."""
    def on_tokens(received: int) -> None:
        if started is not None and received >= start_after:
            started.set()

    return await greedy_streams(gateway, prompts, NEW, on_tokens=on_tokens)


@pytest.fixture(scope="module")
def reference(mesh, prompts):
    got = asyncio.run(run_streams(mesh.gateway, prompts))
    assert all(status is None for _, status in got), got
    return [tokens for tokens, _ in got]


def router_views(mesh) -> list:
    views = []
    for address in mesh.routers:
        with client_channel(address, mesh.tls_dir) as ch:
            workers = pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers
        views.append(sorted((w.worker_id, w.outstanding_tokens, w.running) for w in workers))
    return views


def wait_for(what: str, check, within_s: float):
    return wait(check, within_s, what, interval_s=0.05)


@pytest.mark.parametrize("victim", ["decode-0", "prefill-0", "kvstore", "router", "redis"])
def test_a_killed_service_loses_no_stream(mesh, prompts, reference, victim):
    proc = mesh.proc(victim)
    pid = proc.popen.pid
    decode_logs = {p.log: p.log.stat().st_size for p in mesh.workers("decode")}

    async def scenario():
        started = asyncio.Event()
        streams = asyncio.ensure_future(run_streams(mesh.gateway, prompts, started, start_after=STREAMS * NEW // 4))
        await asyncio.wait_for(started.wait(), 60)
        os.killpg(pid, signal.SIGKILL)
        killed_s = time.monotonic()
        return await streams, killed_s

    got, killed_s = asyncio.run(scenario())
    failed = [(i, status) for i, (_, status) in enumerate(got) if status]
    assert not failed, f"{len(failed)} of {STREAMS} streams failed: {failed[:4]}"
    wrong = [i for i, (tokens, _) in enumerate(got) if tokens != reference[i]]
    assert not wrong, (f"streams {wrong} differ from the healthy mesh's "
                       f"(first: {got[wrong[0]][0]} vs {reference[wrong[0]]})")
    for log, start in decode_logs.items():  # a prefill that died after its first token: its transfer is released
        with open(log, errors="replace") as f:  # at once, and the decode side recomputes without waiting for it
            f.seek(start)
            assert "nothing landed for" not in f.read(), f"a decode worker waited out a dead prefill's KV ({log})"

    back = (lambda: mesh.proc(victim).popen.pid != pid) if victim == "redis" else (
        lambda: mesh.proc(victim).popen.pid != pid and serving(proc.address, tls_dir=mesh.tls_dir))
    wait_for(f"{victim} back", back, max(killed_s + 30 - time.monotonic(), 0))
    again = asyncio.run(run_streams(mesh.gateway, prompts[:4]))
    assert [t for t, _ in again] == reference[:4], [status for _, status in again]
    wait_for("every block, sequence and transfer freed", lambda: not idle(mesh) or None, 15)
    wait_for("both routers seeing the same load", lambda: len(set(map(tuple, router_views(mesh)))) == 1, 5)


def gauges(mesh, p) -> dict:
    """A worker's running and waiting gauges as its Prometheus endpoint serves them (absent: missing)."""
    import urllib.request

    from services.mesh.launcher import metrics_url

    url = metrics_url(p)  # a restarted worker serves its metrics on a new port
    body = urllib.request.urlopen(url, timeout=5).read().decode()
    got = {}
    for line in body.splitlines():
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            if line.startswith(name + "{") and f'worker_id="{p.name}"' in line:
                got[name] = float(line.rsplit(" ", 1)[1])
    return got


def test_every_gauge_returns_to_zero_after_a_cancel_storm_and_a_restart(mesh, prompts):
    """Issue 43: the running gauge read 1 on idle workers (before any load, after 400 cancels, after a restart)."""
    victim = mesh.proc("prefill-0")
    pid = victim.popen.pid
    os.killpg(pid, signal.SIGKILL)
    wait_for("prefill-0 back", lambda: mesh.proc("prefill-0").popen.pid != pid and serving(
        victim.address, tls_dir=mesh.tls_dir), 30)

    async def storm():  # 96 streams, each cancelled at a different moment: before its prefill, mid-decode, ...
        import grpc

        async with grpc.aio.insecure_channel(mesh.gateway) as ch:
            stub = pb_grpc.GenerationStub(ch)

            async def one(i):
                call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[i % len(prompts)]),
                                                        sampling=pb.Sampling(max_tokens=NEW, ignore_eos=True)),
                                     timeout=60)
                got = 0
                async for r in call:
                    got += len(r.token_ids)
                    if got >= i % (NEW // 2):
                        call.cancel()
                        break
            await asyncio.gather(*(one(i) for i in range(96)), return_exceptions=True)
    asyncio.run(storm())
    workers = mesh.workers("prefill") + mesh.workers("decode")
    zero = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    wait_for("every worker's engine idle", lambda: not idle(mesh) or None, 15)
    wait_for("every worker's running and waiting gauges at 0",
             lambda: all(gauges(mesh, p) == zero for p in workers) or None, 15)
