"""A KV handoff that fails after the first token reaches the client at once with its cause (issue 19): a full
kvstore is RESOURCE_EXHAUSTED and a dead one UNAVAILABLE, where the decode side used to wait 60 s for blocks that
never came and the client then got INTERNAL."""

import os
import signal
import time

import grpc
import pytest

from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import Mesh, MeshSpec
from tests.support.mesh import ENGINE, generate_request


def start(tiny_model, tmp_path_factory, name: str, **fields) -> Mesh:
    spec = MeshSpec(str(tiny_model), mode="disaggregated", decode=1, engine_args=ENGINE, **fields)
    return Mesh(spec, log_dir=str(tmp_path_factory.mktemp(name))).start()


def first_token_then_error(gateway: str) -> tuple[int, grpc.StatusCode, float]:
    """Stream one request; (tokens received, the status it ended with, seconds it took)."""
    got, t0 = 0, time.monotonic()
    with grpc.insecure_channel(gateway) as ch:
        with pytest.raises(grpc.RpcError) as exc:
            for r in pb_grpc.GenerationStub(ch).Generate(generate_request(list(range(3, 40)), max_tokens=32),
                                                         timeout=90):
                got += len(r.token_ids)
    print("status details:", exc.value.code(), exc.value.details())
    return got, exc.value.code(), time.monotonic() - t0


def test_a_full_kvstore_is_resource_exhausted_at_once(tiny_model, tmp_path_factory):
    mesh = start(tiny_model, tmp_path_factory, "kv-full", kvstore_budget_gb=1e-7)  # 100 bytes: no block fits
    try:
        got, code, took = first_token_then_error(mesh.gateway)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and got <= 1, (code, got)
        assert took < 10, f"the client waited {took:.1f} s for a handoff that had failed"
    finally:
        mesh.stop()


def test_a_dead_kvstore_is_unavailable_not_internal(tiny_model, tmp_path_factory):
    """Nobody restarts the kvstore here: the gateway's resumes (0.1 s doubling to 2 s, 9.1 s in all) give up."""
    mesh = start(tiny_model, tmp_path_factory, "kv-dead")
    try:
        os.killpg(mesh.proc("kvstore").popen.pid, signal.SIGKILL)
        mesh.proc("kvstore").popen.wait()
        got, code, took = first_token_then_error(mesh.gateway)
        assert code == grpc.StatusCode.UNAVAILABLE, code
        assert took < 20, f"the client waited {took:.1f} s"
    finally:
        mesh.stop()
