"""SIGTERM on a worker: it stops taking work, lets the in-flight stream finish, deregisters, exits 0."""

import os
import signal
import threading

import grpc

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from tests.support.mesh import start_mesh


def test_sigterm_lets_in_flight_requests_finish(tiny_model, tmp_path_factory):
    mesh = start_mesh(tiny_model, tmp_path_factory, "unified", unified=1)
    try:
        worker = mesh.workers("unified")[0]
        started, tokens, reasons = threading.Event(), [], []

        def stream():
            with grpc.insecure_channel(mesh.gateway) as ch:
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(3, 30))), sampling=pb.Sampling(
                    max_tokens=400, temperature=0.0, ignore_eos=True))
                for r in pb_grpc.GenerationStub(ch).Generate(req, timeout=120):
                    tokens.extend(r.token_ids)
                    started.set()
                    if r.finish_reason:
                        reasons.append(r.finish_reason)

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        os.kill(worker.popen.pid, signal.SIGTERM)
        t.join(120)
        assert reasons == ["length"] and len(tokens) == 400
        assert worker.popen.wait(60) == 0
        with grpc.insecure_channel(mesh.router) as ch:
            listed = pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers
        assert worker.address not in [w.address for w in listed]
    finally:
        mesh.stop()


def test_a_mesh_that_fails_to_start_stops_what_it_started(tiny_model, tmp_path_factory):
    """The gateway refuses its flags: start() raises, and every process it had started is gone."""
    import pytest

    from services.mesh.launcher import Mesh, MeshSpec
    from tests.support.mesh import ENGINE

    mesh = Mesh(MeshSpec(str(tiny_model), mode="unified", engine_args=ENGINE, gateway_args=["--admission-policy", "x"]),
                log_dir=str(tmp_path_factory.mktemp("failing")))
    with pytest.raises(RuntimeError, match="gateway exited"):
        mesh.start()
    assert len(mesh.procs) >= 4 and all(p.popen.poll() is not None for p in mesh.procs)
