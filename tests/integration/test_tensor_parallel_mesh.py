"""Tensor-parallel replicas in the running mesh: a TP=2 prefill worker hands its KV (every rank's heads, through the
kvstore) to a TP=2 and a TP=1 decode worker, and the streams equal one TP=1 engine's greedy tokens; each worker
registers as one replica with its ranks and cores; SIGKILL of one rank of a decode group takes that whole replica
down (its servicer exits, the supervisor starts the group again) and every stream it carried completes
token-identical on the other decode worker or the restarted group."""

import asyncio
import os
import signal
from pathlib import Path

import pytest

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import MeshSpec, client_channel, serving
from tests.support.mesh import ENGINE, supervised
from tests.support.procs import children
from tests.support.reference import greedy, make_engine, random_prompts, run_all
from tests.support.streams import greedy_streams
from tests.support.wait import wait_for

STREAMS, NEW = 16, 32
TP2 = ["--tensor-parallel-size", "2"]


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    spec = MeshSpec(str(tiny_model), mode="disaggregated", prefill=1, decode=2, engine_args=ENGINE,
                    worker_args={"prefill-0": TP2, "decode-0": TP2})
    yield from supervised(spec, str(tmp_path_factory.mktemp("tp-mesh")))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(STREAMS, seed=41, lo=4, hi=60, vocab=4000)


@pytest.fixture(scope="module")
def reference(tiny_model, prompts):
    return run_all(make_engine(tiny_model), prompts, greedy(NEW))


def ranks_of(worker_pid: int) -> list[int]:
    """The tensor-parallel ranks 1..N-1 of a worker: children of its engine core (the servicer's child)."""
    return [rank for core in children(worker_pid) for rank in children(core)
            if b"multiprocessing" in Path(f"/proc/{rank}/cmdline").read_bytes()]


def registered(mesh) -> dict:
    with client_channel(mesh.router) as ch:
        workers = pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers
    return {w.worker_id: w for w in workers}


def test_tp2_prefill_and_mixed_decode_give_one_engines_tokens(mesh, prompts, reference):
    got = asyncio.run(greedy_streams(mesh.gateway, prompts, NEW))
    assert [status for _, status in got] == [None] * STREAMS
    assert [tokens for tokens, _ in got] == reference
    workers = registered(mesh)
    assert (workers["prefill-0"].tensor_parallel_size, workers["decode-0"].tensor_parallel_size,
            workers["decode-1"].tensor_parallel_size) == (2, 2, 1)
    assert workers["decode-0"].cores == 2 and workers["decode-1"].cores == 1
    assert len(ranks_of(mesh.proc("decode-0").popen.pid)) == 1  # rank 1 (rank 0 is the engine core itself)


def test_a_killed_rank_takes_its_replica_down_and_no_stream_is_lost(mesh, prompts, reference):
    worker = mesh.proc("decode-0")
    pid = worker.popen.pid
    rank = ranks_of(pid)[0]

    async def scenario():
        started = asyncio.Event()

        def on_tokens(received):
            if received >= STREAMS * NEW // 4:
                started.set()

        streams = asyncio.ensure_future(greedy_streams(mesh.gateway, prompts, NEW, on_tokens=on_tokens))
        await asyncio.wait_for(started.wait(), 60)
        os.kill(rank, signal.SIGKILL)
        return await streams

    got = asyncio.run(scenario())
    failed = [(i, status) for i, (_, status) in enumerate(got) if status]
    assert not failed, f"{len(failed)} of {STREAMS} streams failed: {failed[:4]}"
    assert [tokens for tokens, _ in got] == reference
    wait_for(lambda: mesh.proc("decode-0").popen.pid != pid or None, 30,
             "the group's servicer exited and was restarted", interval_s=0.1)
    with open(worker.log, errors="replace") as f:
        assert "rank 1" in f.read(), "the worker's log names the dead rank"
    back = mesh.proc("decode-0")
    wait_for(lambda: serving(back.address) or None, 60, "decode-0 serving again", interval_s=0.1)
    wait_for(lambda: len(ranks_of(back.popen.pid)) == 1 or None, 30, "the restarted group has its rank 1 again",
             interval_s=0.1)
    again = asyncio.run(greedy_streams(mesh.gateway, prompts[:4], NEW))
    assert [tokens for tokens, _ in again] == reference[:4]
