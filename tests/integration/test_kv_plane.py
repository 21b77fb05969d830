"""The KV data plane (issue 14) on real processes: shared memory on one host and gRPC give the same tokens; the
kvstore's pool serves a prompt's blocks to a worker that never computed them, within a tenant's isolation domain
only; a kvstore killed mid-transfer makes the decode side recompute, token-identical; no segment outlives the mesh."""

import asyncio
import os
import signal
import time

import grpc
import pytest
import yaml

from services.common.arena import segments_of
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.policy.tenants import hash_key
from tests.support.mesh import generate_request, kvstore_stats, start_mesh, stream_all
from tests.support.reference import greedy, make_engine, random_prompts, run_all

NEW = 16


@pytest.fixture(scope="module")
def prompts():
    shared = random_prompts(1, seed=31, lo=64, hi=64, vocab=4000)[0]
    return random_prompts(6, seed=32, lo=20, hi=90, vocab=4000) + random_prompts(6, seed=33, lo=1, hi=30,
                                                                                 vocab=4000, prefix=shared)


@pytest.fixture(scope="module")
def expected(tiny_model, prompts):
    return run_all(make_engine(tiny_model), prompts, greedy(NEW))


def logged(mesh, name: str) -> str:
    return mesh.proc(name).log.read_text(errors="replace")


@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_disaggregated_tokens_are_identical_over_both_transports(tiny_model, tmp_path_factory, transport, prompts,
                                                                   expected):
    mesh = start_mesh(tiny_model, tmp_path_factory, "disaggregated", decode=1, kv_transport=transport)
    try:
        assert asyncio.run(stream_all(mesh.gateway, prompts)) == expected
        used = "shm" if transport == "auto" else "grpc"
        for name in ("prefill-0", "decode-0"):
            assert f"transport {used}" in logged(mesh, name), name
        assert kvstore_stats(mesh.kvstore).segment  # the arena is shared memory even when workers use gRPC
        assert "computing its prompt" not in logged(mesh, "decode-0")
        instance = mesh.kv_instance
        assert len(segments_of(instance)) == 1
    finally:
        mesh.stop()
    assert segments_of(instance) == []  # unlinked on a clean stop


def grpc_generate(gateway: str, prompt: list, key: str = "") -> pb.GenerateResponse:
    meta = (("x-api-key", key),) if key else ()
    with grpc.insecure_channel(gateway) as ch:
        events = list(pb_grpc.GenerationStub(ch).Generate(generate_request(prompt, max_tokens=4), metadata=meta,
                                                          timeout=60))
    return events


@pytest.fixture(scope="module")
def pooled(tiny_model, tmp_path_factory):
    """Two unified workers taking turns (round robin), each pulling from and pushing to the pool; tenants A and B
    in their own isolation domains, C sharing A's."""
    cfg = {"tenants": [{"name": "a", "api_key_hashes": [hash_key("key-a")], "cache_domain": "docs"},
                       {"name": "b", "api_key_hashes": [hash_key("key-b")]},
                       {"name": "c", "api_key_hashes": [hash_key("key-c")], "cache_domain": "docs"}]}
    path = tmp_path_factory.mktemp("pool") / "mesh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    mesh = start_mesh(tiny_model, tmp_path_factory, "unified", unified=2, kv_pool=True, policy="round-robin",
                      config_file=str(path))
    yield mesh
    mesh.stop()


def cached(events) -> int:
    return max(e.cached_prompt_tokens for e in events)


def tokens(events) -> list:
    return [t for e in events for t in e.token_ids]


def direct(mesh, worker: str, prompt: list, salt: str, request_id: str) -> list:
    """A unified worker called as the gateway calls it (the kvstore named), in isolation domain `salt`."""
    work = pb.WorkRequest(request_id=request_id, prompt_token_ids=prompt, cache_salt=salt, kvstore=mesh.kvstore,
                          sampling=pb.Sampling(max_tokens=4, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(mesh.proc(worker).address) as ch:
        return list(pb_grpc.WorkerStub(ch).Generate(work, timeout=60))


def pooled_blocks_at_least(mesh, n: int) -> None:
    deadline = time.monotonic() + 10
    while kvstore_stats(mesh.kvstore).pool_blocks < n and time.monotonic() < deadline:
        time.sleep(0.05)  # a push lands after the first token


def test_the_pool_serves_a_prefix_to_a_worker_that_never_computed_it(pooled, tiny_model):
    prompt = list(range(200, 200 + 80))  # five full blocks of 16
    first = direct(pooled, "unified-0", prompt, "s1", "p1")  # computes it and pushes it to the pool
    assert cached(first) == 0
    pooled_blocks_at_least(pooled, 4)
    hits = kvstore_stats(pooled.kvstore).hits
    again = direct(pooled, "unified-1", prompt, "s1", "p2")  # a cold cache: takes the blocks from the pool
    assert cached(again) == 64  # four blocks: the last token (here the fifth block's end) is always computed
    assert kvstore_stats(pooled.kvstore).hits >= hits + 4
    assert tokens(again) == tokens(first) == run_all(make_engine(tiny_model), [prompt], greedy(4))[0]


def test_pool_hits_respect_tenant_isolation(pooled):
    """Direct calls in two isolation domains, then the same through the gateway with tenants' keys."""
    prompt = list(range(300, 300 + 80))
    direct(pooled, "unified-0", prompt, "domain-a", "i1")
    pooled_blocks_at_least(pooled, 8)
    assert cached(direct(pooled, "unified-1", prompt, "domain-b", "i2")) == 0  # another domain: no hit
    assert cached(direct(pooled, "unified-1", prompt, "domain-a", "i3")) == 64
    prompt = list(range(500, 500 + 80))
    grpc_generate(pooled.gateway, prompt, "key-a")
    pooled_blocks_at_least(pooled, 12)
    hits = kvstore_stats(pooled.kvstore).hits
    grpc_generate(pooled.gateway, prompt, "key-b")  # B never gets A's blocks (from the pool or a worker)
    assert kvstore_stats(pooled.kvstore).hits == hits
    assert cached(grpc_generate(pooled.gateway, prompt, "key-c")) >= 64  # C shares A's domain: it does


def test_a_kvstore_killed_mid_transfer_makes_the_decode_side_recompute_token_identically(tiny_model, tmp_path_factory,
                                                                                       prompts, expected):
    mesh = start_mesh(tiny_model, tmp_path_factory, "disaggregated", decode=1,
                      env={"KVSTORE_HOLD_META_S": "30"})  # every transfer stays in flight until the kill
    instance = mesh.kv_instance
    try:
        kv = mesh.proc("kvstore")
        killed_segment = segments_of(instance)

        async def kill_after_first_token():
            async with grpc.aio.insecure_channel(mesh.gateway) as ch:
                got = []
                async for r in pb_grpc.GenerationStub(ch).Generate(generate_request(prompts[0]), timeout=60):
                    got += list(r.token_ids)
                    if len(got) == 1:
                        os.killpg(kv.popen.pid, signal.SIGKILL)
                return got

        assert asyncio.run(kill_after_first_token()) == expected[0]
        assert "computing its prompt here" in logged(mesh, "decode-0")
        assert killed_segment == [] or segments_of(instance) == killed_segment  # left behind by SIGKILL ...
        kv.popen.wait()
        deadline = time.monotonic() + 30
        while kv.restarts == 0 and time.monotonic() < deadline:
            mesh.supervise(say=lambda _: None)
            time.sleep(0.2)
        mesh.wait_healthy(30)
        assert asyncio.run(stream_all(mesh.gateway, prompts[:1])) == expected[:1]  # it attached anew: one arena
        assert len(segments_of(instance)) == 1  # ... and reclaimed by the restarted kvstore
    finally:
        mesh.stop()
    assert segments_of(instance) == []


def test_a_prefill_worker_takes_a_prompt_from_the_pool_that_another_prefill_worker_handed_off(tiny_model,
                                                                                               tmp_path_factory):
    """Disaggregated, two prefill workers called as the gateway calls them: the first one's handoff leaves the
    prompt's blocks in the pool; the second leases them instead of computing them; and through the gateway the
    stream is token-identical. A transfer its reader released before the prefill side reserved it (a kvstore
    restart between the two) still yields the first token (a flake of the kvstore kill in tests/integration/
    test_faults.py: the stream failed NOT_FOUND)."""
    mesh = start_mesh(tiny_model, tmp_path_factory, "disaggregated", prefill=2, decode=1, kv_pool=True)
    try:
        prompt = list(range(700, 700 + 80))

        def prefill(worker: str, transfer: str):
            work = pb.WorkRequest(request_id=transfer, prompt_token_ids=prompt, kvstore=mesh.kvstore,
                                  transfer_id=transfer, sampling=pb.Sampling(max_tokens=4, temperature=0.0))
            with grpc.insecure_channel(mesh.proc(worker).address) as ch:
                events = list(pb_grpc.WorkerStub(ch).Prefill(work, timeout=60))
            with grpc.insecure_channel(mesh.kvstore) as ch:  # as the gateway does once decoding is done
                pb_grpc.KVStoreStub(ch).Release(pb.ReleaseRequest(transfer_id=transfer), timeout=10)
            return events

        reference = run_all(make_engine(tiny_model), [prompt], greedy(4))[0]
        assert cached(prefill("prefill-0", "x1")) == 0
        pooled_blocks_at_least(mesh, 4)
        assert cached(prefill("prefill-1", "x2")) == 64  # a cold cache: the pool's blocks
        assert tokens(grpc_generate(mesh.gateway, prompt)) == reference

        with grpc.insecure_channel(mesh.kvstore) as ch:  # the decode side gave up on x3 (its pull failed) and
            pb_grpc.KVStoreStub(ch).Release(pb.ReleaseRequest(transfer_id="x3"), timeout=10)  # released it first
        assert tokens(prefill("prefill-0", "x3")) == reference[:1]  # the first token is still the prefill side's
    finally:
        mesh.stop()
