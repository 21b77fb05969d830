"""Saturation at the real model's step times (issue 36): every engine step of the mesh takes 3.5 s (a step-time
floor, MESHSERVE_STEP_FLOOR_S: SmolLM2 at full batch measured 2.3-3.7 s a step on 2 cores), longer than the router's
3 s without a heartbeat, and three times more streams are offered than the decode workers' batches hold, for about
40 s. A busy worker is never forgotten: every request completes, token-identical to the in-process engine, nothing
is resumed, and the router forgets no worker. The waiting happens in the gateway's admission queue (credits), not
in failures. Before the fix, heartbeats waited for the engine's step to end and went out every 3.5 s: the router
forgot the workers and requests failed over or failed."""

import asyncio

import grpc
import pytest

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import Mesh, MeshSpec
from tests.support.reference import greedy, make_engine, random_prompts, run_all
from tests.support.streams import greedy_streams

STEP_FLOOR_S, SLOTS, STREAMS, NEW = 3.5, 4, 24, 4  # 2 decode workers x 4 slots: 24 streams are 3 batches each


@pytest.fixture(scope="module")
def slow_mesh(tiny_model, tmp_path_factory):
    spec = MeshSpec(str(tiny_model), mode="disaggregated", decode=2, env={"MESHSERVE_STEP_FLOOR_S": str(STEP_FLOOR_S)},
                    engine_args=["--kv-cache-gb", "0.05", "--max-num-batched-tokens", "64", "--max-num-seqs",
                                 str(SLOTS)])
    mesh = Mesh(spec, log_dir=str(tmp_path_factory.mktemp("saturation"))).start()
    yield mesh
    mesh.stop()


async def stream_all(gateway: str, prompts: list, after_tokens: int = 0, then=None) -> list:
    """Each prompt's (tokens, status name or None); then() is called once after_tokens tokens arrived in all."""
    def on_tokens(received: int) -> None:
        nonlocal then
        if then is not None and received >= after_tokens:
            then, act = None, then
            act()

    return await greedy_streams(gateway, prompts, NEW, timeout_s=600, on_tokens=on_tokens)


def test_a_saturated_mesh_of_slow_steps_loses_no_request_and_no_worker(slow_mesh, tiny_model):
    prompts = random_prompts(STREAMS, seed=36, lo=4, hi=40, vocab=4000)
    got = asyncio.run(stream_all(slow_mesh.gateway, prompts))
    failed = [status for _, status in got if status is not None]
    assert not failed, failed
    assert [tokens for tokens, _ in got] == run_all(make_engine(tiny_model), prompts, greedy(NEW))
    router_log = (slow_mesh.log_dir / "router.log").read_text()
    gateway_log = (slow_mesh.log_dir / "gateway.log").read_text()
    assert "forgetting worker" not in router_log, router_log
    assert "no live" not in gateway_log and "resuming" not in gateway_log, gateway_log


def test_a_worker_killed_during_the_saturation_is_detected_and_its_requests_resumed(slow_mesh, tiny_model):
    """Liveness that a busy worker cannot lose must still lose a dead one: decode-1 is killed (SIGKILL) with its
    batch in flight at 3.5 s a step; its streams resume on decode-0, token-identical, and the router forgets it."""
    import os
    import signal

    prompts = random_prompts(12, seed=37, lo=4, hi=40, vocab=4000)
    victim = slow_mesh.proc("decode-1")
    # 8 tokens in: the first 4 prompts' first tokens came from the prefill worker, and the decode workers hold them
    got = asyncio.run(stream_all(slow_mesh.gateway, prompts, after_tokens=8,
                                 then=lambda: os.killpg(victim.popen.pid, signal.SIGKILL)))
    victim.popen.wait(30)
    assert victim.popen.poll() is not None
    assert [status for _, status in got] == [None] * len(prompts), got
    assert [tokens for tokens, _ in got] == run_all(make_engine(tiny_model), prompts, greedy(NEW))
    gateway_log = (slow_mesh.log_dir / "gateway.log").read_text()
    assert "resuming after" in gateway_log, gateway_log
    _wait_for(slow_mesh.log_dir / "router.log", lambda text: "forgetting worker decode-1" in text, timeout_s=30)


def _generate(gateway: str, deadline_ms: int = 0):
    """(tokens, status name or None, details) of one greedy request."""
    with grpc.insecure_channel(gateway) as ch:
        tokens = []
        try:
            for r in pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=[5, 6, 7]), deadline_ms=deadline_ms,
                    sampling=pb.Sampling(max_tokens=NEW, temperature=0.0, ignore_eos=True)), timeout=120):
                tokens += r.token_ids
        except grpc.RpcError as e:
            return tokens, e.code().name, e.details()
        return tokens, None, ""


def _wait_for(path, said, timeout_s: float = 60.0) -> None:
    """Until said(the log at path) holds (the event a test waits for, not a guess at its time)."""
    import time

    end = time.monotonic() + timeout_s
    while not said(path.read_text(errors="replace")):
        assert time.monotonic() < end, f"{path.name} never said it"
        time.sleep(0.1)


def test_a_request_waits_for_a_worker_instead_of_failing(tiny_model, tmp_path):
    """No live worker (drained, restarting, loading) costs a request a wait, not a failure: it is held at the gateway
    and served once a worker registers; a deadline or the no-worker grace ends the wait with a status naming it."""
    import concurrent.futures

    spec = MeshSpec(str(tiny_model), mode="unified", engine_args=["--kv-cache-gb", "0.05"],
                    gateway_args=["--admission-no-worker-grace-s", "60"])
    with Mesh(spec, log_dir=str(tmp_path)).start() as mesh:
        want = _generate(mesh.gateway)
        assert want[1] is None and len(want[0]) == NEW
        drained = mesh.workers("unified")
        mesh.scale("unified", 0, say=lambda line: None)
        for p in drained:
            p.popen.wait(60)  # deregistered and gone
        late = _generate(mesh.gateway, deadline_ms=1500)
        assert late[1] == "DEADLINE_EXCEEDED" and "waiting for a worker" in late[2], late
        log = mesh.log_dir / "gateway.log"
        holds = log.read_text().count("holding it until one is live")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(_generate, mesh.gateway)
            _wait_for(log, lambda text: text.count("holding it until one is live") > holds)
            mesh.scale("unified", 1, say=lambda line: None)
            assert held.result(timeout=120) == want
