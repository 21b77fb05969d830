"""Service identity (issue 19): with mutual TLS (the default of `meshserve up`), a caller without a mesh certificate
is refused by the router, the kvstore and every worker; a certificate of the wrong identity cannot register a worker,
route, read a transfer or generate; the public gateway port still serves plain gRPC; Redis wants its password."""

import asyncio
import os
from pathlib import Path

import grpc
import pytest
import redis

from services.common.certs import make_certs
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import Mesh, MeshSpec, client_channel
from tests.support.mesh import ENGINE, generate_request


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    spec = MeshSpec(str(tiny_model), mode="disaggregated", decode=1, engine_args=ENGINE, tls=True)
    m = Mesh(spec, log_dir=str(tmp_path_factory.mktemp("mtls"))).start()
    yield m
    m.stop()


def internal(mesh) -> dict:
    return {"router": mesh.router, "kvstore": mesh.kvstore, "prefill-0": mesh.proc("prefill-0").address,
            "decode-0": mesh.proc("decode-0").address}


def test_the_public_port_serves_plain_grpc_through_a_tls_mesh(mesh):
    with grpc.insecure_channel(mesh.gateway) as ch:
        out = list(pb_grpc.GenerationStub(ch).Generate(generate_request(list(range(3, 40)), max_tokens=6), timeout=60))
    assert sum(len(r.token_ids) for r in out) == 6


def test_no_certificate_no_service(mesh):
    calls = {"router": lambda ch: pb_grpc.RouterStub(ch).Heartbeat(pb.WorkerLoad(worker_id="evil", address="x:1",
                                                                                 role="unified"), timeout=5),
             "kvstore": lambda ch: pb_grpc.KVStoreStub(ch).Stats(pb.StatsRequest(), timeout=5),
             "prefill-0": lambda ch: pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=5),
             "decode-0": lambda ch: pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=5)}
    for name, address in internal(mesh).items():
        with grpc.insecure_channel(address) as ch:  # plaintext: the handshake never completes
            with pytest.raises(grpc.RpcError) as exc:
                calls[name](ch)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, name
    other_ca = make_certs(Path(mesh.log_dir) / "other-ca")  # a certificate, but not of this mesh's CA
    for name, address in internal(mesh).items():
        with client_channel(address, str(other_ca), "worker") as ch:
            with pytest.raises(grpc.RpcError) as exc:
                calls[name](ch)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, name


def test_a_certificate_of_the_wrong_identity_is_refused(mesh):
    tls = mesh.tls_dir
    forged = pb.WorkerLoad(worker_id="evil", address="127.0.0.1:1", role="unified", max_num_seqs=8)
    refused = [
        ("client registers a worker", "client", mesh.router, lambda ch: pb_grpc.RouterStub(ch).Heartbeat(forged)),
        ("gateway registers a worker", "gateway", mesh.router, lambda ch: pb_grpc.RouterStub(ch).Heartbeat(forged)),
        ("worker routes", "worker", mesh.router,
         lambda ch: pb_grpc.RouterStub(ch).Route(pb.RouteRequest(request_id="x", prompt_tokens=4, max_tokens=2))),
        ("client reads a transfer", "client", mesh.kvstore,
         lambda ch: list(pb_grpc.KVStoreStub(ch).Get(pb.GetRequest(transfer_id="t", wait_ms=10)))),
        ("worker asks a worker to generate", "worker", mesh.proc("prefill-0").address,
         lambda ch: list(pb_grpc.WorkerStub(ch).Prefill(pb.WorkRequest(request_id="x", prompt_token_ids=[1, 2],
                                                                       sampling=pb.Sampling(max_tokens=2))))),
    ]
    for what, identity, address, call in refused:
        with client_channel(address, tls, identity) as ch:
            with pytest.raises(grpc.RpcError) as exc:
                call(ch)
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED, what
    with client_channel(mesh.router, tls) as ch:  # and the forged worker never made it into the router's view
        assert "evil" not in {w.worker_id for w in pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest()).workers}


def test_redis_wants_its_password(mesh):
    port = int(mesh.redis_url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port).ping()
    assert redis.Redis.from_url(mesh.redis_url).ping()


def test_the_mesh_works_across_tls_in_both_halves(mesh):
    async def many():
        async with grpc.aio.insecure_channel(mesh.gateway) as ch:
            stub = pb_grpc.GenerationStub(ch)

            async def one(i):
                return sum([len(r.token_ids) async for r in stub.Generate(
                    generate_request(list(range(3 + i, 60 + i)), max_tokens=8), timeout=60)])
            return await asyncio.gather(*(one(i) for i in range(8)))
    assert asyncio.run(many()) == [8] * 8  # prefill -> kvstore -> decode, every hop over mutual TLS


def test_the_public_ports_serve_tls_when_asked(tiny_model, tmp_path_factory):
    """mesh.public_tls: the gateway's gRPC and HTTP ports speak TLS with the mesh CA's gateway certificate; a client
    that trusts ca.pem needs no certificate of its own; a plaintext client gets nothing."""
    import json
    import ssl
    import urllib.request

    spec = MeshSpec(str(tiny_model), mode="unified", engine_args=ENGINE, tls=True, public_tls=True)
    m = Mesh(spec, log_dir=str(tmp_path_factory.mktemp("public-tls"))).start()
    try:
        ca = (Path(m.tls_dir) / "ca.pem").read_bytes()
        with grpc.secure_channel(m.gateway, grpc.ssl_channel_credentials(root_certificates=ca)) as ch:
            out = list(pb_grpc.GenerationStub(ch).Generate(generate_request(list(range(3, 40)), max_tokens=4),
                                                           timeout=60))
        assert sum(len(r.token_ids) for r in out) == 4
        with grpc.insecure_channel(m.gateway) as ch, pytest.raises(grpc.RpcError) as exc:
            list(pb_grpc.GenerationStub(ch).Generate(generate_request([3, 4, 5], max_tokens=2), timeout=10))
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert m.http.startswith("https://")
        context = ssl.create_default_context(cadata=ca.decode())
        with urllib.request.urlopen(m.http + "/v1/models", context=context, timeout=30) as r:
            assert json.load(r)["data"][0]["id"] == Path(str(tiny_model)).name
        with pytest.raises(urllib.error.URLError):  # a client that does not trust the mesh CA
            urllib.request.urlopen(m.http + "/v1/models", context=ssl.create_default_context(), timeout=30)
    finally:
        m.stop()


@pytest.fixture(scope="module")
def supervisor(mesh):
    """The Supervisor service as `meshserve up` hosts it beside this mesh: over the mesh's mutual TLS."""
    import threading

    from services.mesh.supervisor import serve

    server, address = serve(mesh, threading.Lock(), mesh.pools(), 0, say=lambda line: None, tls_dir=mesh.tls_dir)
    yield address
    server.stop(0)


def test_the_supervisor_wants_an_operator_certificate(mesh, supervisor):
    pools = lambda ch: pb_grpc.SupervisorStub(ch).Pools(pb.PoolsRequest(), timeout=5)  # noqa: E731
    scale_to_0 = lambda ch: pb_grpc.SupervisorStub(ch).Scale(pb.ScaleRequest(pool="decode", replicas=0),  # noqa: E731
                                                            timeout=5)
    with grpc.insecure_channel(supervisor) as ch:  # plaintext, as any local process could call it
        for call in (pools, scale_to_0):
            with pytest.raises(grpc.RpcError) as exc:
                call(ch)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    with client_channel(supervisor, str(make_certs(Path(mesh.log_dir) / "stranger-ca")), "client") as ch:
        with pytest.raises(grpc.RpcError) as exc:  # a certificate, but not of this mesh's CA
            scale_to_0(ch)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    with client_channel(supervisor, mesh.tls_dir, "worker") as ch:  # the mesh's, but a worker may not scale
        with pytest.raises(grpc.RpcError) as exc:
            scale_to_0(ch)
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED and "worker" in exc.value.details()
    assert len(mesh.workers("decode")) == 1  # nothing above scaled anything
    for identity in ("client", "autoscaler"):
        with client_channel(supervisor, mesh.tls_dir, identity) as ch:
            assert {p.pool: p.ready for p in pools(ch).pools} == {"prefill": 1, "decode": 1}
    from services.mesh.actuators import LocalActuator

    async def as_the_autoscaler():  # its local actuator, as `meshserve up` starts it (--supervisor-tls-dir)
        actuator = LocalActuator(supervisor, mesh.tls_dir)
        try:
            return await actuator.state("decode")
        finally:
            await actuator.channel.close()
    assert asyncio.run(as_the_autoscaler()).ready == 1


def test_meshserve_scale_presents_the_operator_certificate(mesh, supervisor):
    import subprocess
    import sys

    cli = [sys.executable, "-m", "services.cli", "scale", "--supervisor", supervisor, "decode", "1"]
    plain = subprocess.run(cli, capture_output=True, text=True, timeout=60, env={**os.environ, "MESHSERVE_TLS_DIR": ""})
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr and "--tls-dir" in plain.stderr
    ok = subprocess.run(cli + ["--tls-dir", mesh.tls_dir], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "decode: 1 ready, 0 starting, 0 draining (decode-0)" in ok.stdout, ok.stderr
    missing = subprocess.run(cli + ["--tls-dir", str(Path(mesh.log_dir) / "nowhere")], capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2 and "cannot read the mesh's certificates" in missing.stderr


def test_the_redis_password_is_in_no_command_line_and_no_log(mesh):
    from bench.proc_cpu import descendants

    password = mesh.redis_password
    assert password and password in mesh.redis_url  # the services do use it
    for p in mesh.procs:
        for pid in descendants(p.popen.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            assert password not in argv, f"{p.name} (pid {pid}) has the Redis password in its command line"
    logs = [f for f in Path(mesh.log_dir).rglob("*") if f.is_file() and f.suffix != ".pem"]
    assert any(f.name == "router.log" for f in logs)
    for f in logs:
        if f.name != "redis.conf":  # the password's one home: owner-only
            assert password not in f.read_text(errors="replace"), f"the Redis password is in {f}"
    conf = Path(mesh.log_dir) / "redis.conf"
    assert password in conf.read_text() and conf.stat().st_mode & 0o077 == 0
