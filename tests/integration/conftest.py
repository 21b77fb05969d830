
import grpc
import pytest

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import Mesh, MeshSpec

ENGINE = ["--kv-cache-gb", "0.05", "--max-num-batched-tokens", "64"]


def supervised(spec: MeshSpec, log_dir: str):
    """Start a mesh and supervise it (restart what exits) on a thread until the generator is closed: a module
    fixture's body (`yield from supervised(...)`)."""
    import threading

    m = Mesh(spec, log_dir=log_dir).start()
    stop = threading.Event()
    supervisor = threading.Thread(target=lambda: [m.supervise(lambda line: None) for _ in iter(lambda: stop.wait(0.1),
                                                                                               True)])
    supervisor.start()
    try:
        yield m
    finally:
        stop.set()
        supervisor.join()
        m.stop()


def start_mesh(model, tmp_path_factory, mode, **kw):
    spec = MeshSpec(str(model), mode=mode, engine_args=ENGINE, **kw)
    return Mesh(spec, log_dir=str(tmp_path_factory.mktemp(f"mesh-{mode}"))).start()


@pytest.fixture(scope="module")
def disaggregated(tiny_model, tmp_path_factory):
    mesh = start_mesh(tiny_model, tmp_path_factory, "disaggregated")
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def unified(tiny_model, tmp_path_factory):
    mesh = start_mesh(tiny_model, tmp_path_factory, "unified")
    yield mesh
    mesh.stop()


def worker_stats(address: str) -> pb.WorkerStats:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=5)


def kvstore_stats(address: str) -> pb.KVStoreStats:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.KVStoreStub(ch).Stats(pb.StatsRequest(), timeout=5)
