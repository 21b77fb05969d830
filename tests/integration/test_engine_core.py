"""The engine core in its own process (issue 13): a SIGKILL of a worker's core ends every stream it was serving with
UNAVAILABLE at once, the worker deregisters and exits non-zero, its supervisor starts it again and it serves; the
core dies with its worker."""

import asyncio
import os
import signal
import threading
import time

import grpc
import pytest

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import Mesh, MeshSpec
from tests.support.mesh import ENGINE
from tests.support.reference import random_prompts


def children(pid: int) -> list[int]:
    """The engine core processes of a worker (multiprocessing also starts a resource tracker beside it)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid and b"spawn_main" in open(
                    f"/proc/{entry}/cmdline", "rb").read():
                out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def mesh(tiny_model, tmp_path):
    m = Mesh(MeshSpec(str(tiny_model), mode="unified", unified=1, engine_args=ENGINE), log_dir=str(tmp_path)).start()
    yield m
    m.stop()


def test_a_killed_engine_core_fails_its_streams_at_once_and_the_worker_comes_back(mesh):
    worker = mesh.proc("unified-0")
    [core] = children(worker.popen.pid)
    prompts = random_prompts(8, seed=3, lo=8, hi=40, vocab=4000)

    async def streams():
        started = asyncio.Event()
        async with grpc.aio.insecure_channel(worker.address) as ch:
            stub = pb_grpc.WorkerStub(ch)

            async def one(i, ids):
                got = 0
                try:
                    async for ev in stub.Generate(pb.WorkRequest(
                            request_id=f"core-{i}", prompt_token_ids=ids,
                            sampling=pb.Sampling(max_tokens=2000, temperature=0.0, ignore_eos=True)), timeout=60):
                        got += len(ev.token_ids)
                        if got >= 4:
                            started.set()
                except grpc.aio.AioRpcError as e:
                    return e.code(), time.monotonic()
                return None, time.monotonic()

            tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
            await asyncio.wait_for(started.wait(), 30)
            os.kill(core, signal.SIGKILL)
            killed = time.monotonic()
            return [(code, at - killed) for code, at in await asyncio.gather(*tasks)]

    ended = asyncio.run(streams())
    assert all(code == grpc.StatusCode.UNAVAILABLE for code, _ in ended), ended
    assert max(took for _, took in ended) < 2, ended

    assert worker.popen.wait(30) != 0  # the worker exits non-zero for its supervisor
    with grpc.insecure_channel(mesh.router) as ch:  # ...and deregistered on its way out
        assert all(w.worker_id != "unified-0"
                   for w in pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers)

    stop = threading.Event()
    supervisor = threading.Thread(target=lambda: [mesh.supervise(lambda line: None)
                                                  for _ in iter(lambda: stop.wait(0.1), True)])
    supervisor.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with grpc.insecure_channel(mesh.gateway) as ch:
                    out = list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                        token_ids=pb.TokenIds(ids=prompts[0]), sampling=pb.Sampling(max_tokens=4, temperature=0.0,
                                                                                   ignore_eos=True)), timeout=10))
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the worker did not serve again"
                time.sleep(0.2)
        assert sum(len(r.token_ids) for r in out) == 4
    finally:
        stop.set()
        supervisor.join()


def test_the_core_dies_with_its_worker(mesh):
    worker = mesh.proc("unified-0")
    [core] = children(worker.popen.pid)
    os.kill(worker.popen.pid, signal.SIGKILL)
    worker.popen.wait()
    deadline = time.monotonic() + 10
    while alive(core):
        assert time.monotonic() < deadline, "the engine core outlived its worker"
        time.sleep(0.05)
