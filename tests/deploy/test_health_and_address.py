"""What containers need from the services: `meshserve health ADDR` (the probe images use, no extra binary) and the
address a server on every interface advertises (a worker registers under its container's hostname)."""

import socket
import subprocess
import sys
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common import envs, rpc


def health_cmd(address: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "health", address, "--timeout", "2"],
                          capture_output=True, text=True, timeout=60)


def test_health_exits_0_only_when_serving():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        ok = health_cmd(f"127.0.0.1:{port}")
        assert ok.returncode == 0 and ok.stdout.strip() == f"127.0.0.1:{port}: SERVING", ok
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        draining = health_cmd(f"127.0.0.1:{port}")
        assert draining.returncode == 1 and "NOT_SERVING" in draining.stdout
    finally:
        server.stop(0)
    gone = health_cmd(f"127.0.0.1:{port}")
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr


def test_a_server_on_every_interface_advertises_its_hostname_or_the_given_name(monkeypatch):
    monkeypatch.delenv(envs.ADVERTISE_HOST.name, raising=False)
    assert rpc.advertised_host("127.0.0.1") == "127.0.0.1"
    assert rpc.advertised_host("0.0.0.0") == socket.gethostname()
    monkeypatch.setenv(envs.ADVERTISE_HOST.name, "decode-3.meshserve")
    assert rpc.advertised_host("::") == "decode-3.meshserve"
    assert rpc.advertised_host("10.0.0.5") == "10.0.0.5"  # a bound address is what it is
