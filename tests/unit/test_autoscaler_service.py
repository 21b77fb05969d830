"""The autoscaler service's round (OTLP in, decision, actuator out) with a fake actuator, and the Compose actuator
against a fake `docker compose` that checks the exact command lines."""

import asyncio
import json
import subprocess

from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services.autoscaler.server import Autoscaler
from services.config.sections import AutoscalerSection, PoolSection
from services.mesh.actuators import ComposeActuator, PoolStatus
from tests.support.autoscaler import step, worker


class FakeActuator:
    def __init__(self, ready: int):
        self.status, self.calls = PoolStatus(ready), []

    async def state(self, pool):
        return self.status

    async def scale(self, pool, replicas, reason):
        self.calls.append((pool, replicas, reason))
        self.status = PoolStatus(self.status.ready, replicas - self.status.ready)


def test_a_round_scales_up_on_output_tokens_and_says_why():
    now = [0.0]
    section = AutoscalerSection(enabled=True, interval_s=1, pools={"decode": PoolSection(
        min_replicas=1, max_replicas=4, decode_tokens_per_s=100, target_util=0.5, startup_s=5, window_s=10)})
    actuator = FakeActuator(ready=1)
    reader = InMemoryMetricReader()
    scaler = Autoscaler(section, actuator, ["decode"], clock=lambda: now[0],
                        meter=MeterProvider(metric_readers=[reader]).get_meter("t"))
    m, wreader = worker("decode", "d0")
    for t in range(0, 5):
        now[0] = float(t)
        for i in range(150):  # 150 output tokens per second: 3 replicas at 50 tok/s each
            step(m, f"r{t}-{i}", 2, 10, 0.0, now[0])
        asyncio.run(scaler.Export(encode_metrics(wreader.get_metrics_data()), None))
        decisions = asyncio.run(scaler.tick())
    assert actuator.calls and actuator.calls[0][:2] == ("decode", 3)
    assert "output 150 tok/s" in actuator.calls[0][2] and actuator.calls[0][2].startswith("token-policy: ")
    assert decisions[-1][1].kind == "hold"  # the replicas starting count: no cascade
    points = [p for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics for m in sm.metrics
              if m.name == "meshserve.autoscaler.decisions" for p in m.data.data_points]
    assert [(dict(p.attributes)["kind"], p.value) for p in points] == [("up", 1)]


def test_an_adapter_groups_pool_scales_on_its_own_workers_traffic():
    """A named pool (the unified workers of one adapter group, mesh.worker_pools) is sized by its own workers'
    prompt tokens at the role's rates; the plain unified workers' traffic does not count for it."""
    from services.config.loader import load_mesh_config

    cfg = load_mesh_config(None, {"mesh": {"mode": "unified", "worker_pools": {"lora-a": {"role": "unified"}}},
                                  "autoscaler": {"interval_s": 1, "pools": {"lora-a": {
                                      "max_replicas": 4, "prefill_tokens_per_s": 1000, "target_util": 0.5,
                                      "startup_s": 5, "window_s": 10}}}})
    now = [0.0]
    actuator = FakeActuator(ready=1)
    scaler = Autoscaler(cfg.autoscaler, actuator, ["lora-a"], clock=lambda: now[0], roles={"lora-a": cfg.pool_role(
        "lora-a")}, meter=MeterProvider().get_meter("t"))
    grouped, greader = worker("unified", "lora-a-0", pool="lora-a")
    plain, preader = worker("unified", "unified-0")
    for t in range(0, 5):
        now[0] = float(t)
        for i in range(10):  # 900 prompt tokens per second on the group's worker: 2 replicas at 500 each
            step(grouped, f"g{t}-{i}", 1, 90, 0.0, now[0])
            step(plain, f"p{t}-{i}", 1, 900, 0.0, now[0])
        for reader in (greader, preader):
            asyncio.run(scaler.Export(encode_metrics(reader.get_metrics_data()), None))
        asyncio.run(scaler.tick())
    assert actuator.calls and actuator.calls[0][:2] == ("lora-a", 2), actuator.calls
    assert "prompt 900 tok/s" in actuator.calls[0][2]


def test_compose_actuator_makes_the_exact_calls():
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        assert kw["check"] and kw["capture_output"]
        out = ""
        if argv[6] == "ps":
            out = "\n".join(json.dumps(r) for r in ({"State": "running", "Health": "healthy"},
                                                    {"State": "running", "Health": "starting"},
                                                    {"State": "exited"}))
        return subprocess.CompletedProcess(argv, 0, out, "")

    act = ComposeActuator("deploy/docker-compose.yml", "meshserve", {"decode": "decode"}, run=run)
    assert asyncio.run(act.state("decode")) == PoolStatus(ready=1, starting=1)
    asyncio.run(act.scale("decode", 3, "burst"))
    assert calls == [
        ["docker", "compose", "-f", "deploy/docker-compose.yml", "-p", "meshserve", "ps", "--format", "json", "decode"],
        ["docker", "compose", "-f", "deploy/docker-compose.yml", "-p", "meshserve", "up", "-d", "--scale",
         "decode=3", "--no-recreate", "decode"]]
    # an override after the main file, listed as COMPOSE_FILE lists them (deploy/docker-compose.local.yml)
    calls.clear()
    act = ComposeActuator("/d/docker-compose.yml:/d/docker-compose.local.yml", "p", {"decode": "decode"}, run=run)
    asyncio.run(act.scale("decode", 2, "burst"))
    assert calls == [["docker", "compose", "-f", "/d/docker-compose.yml", "-f", "/d/docker-compose.local.yml",
                      "-p", "p", "up", "-d", "--scale", "decode=2", "--no-recreate", "decode"]]


class FakeKubeAPI:
    """A minimal Kubernetes API server over HTTP: a Deployment's status and its scale subresource."""

    def __init__(self, replicas: int, ready: int):
        import http.server
        import threading

        self.replicas, self.ready, self.requests = replicas, ready, []
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, obj):
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                api.requests.append(("GET", self.path, None, None))
                self._reply({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "decode"},
                             "spec": {"replicas": api.replicas, "selector": {"matchLabels": {"app": "decode"}},
                                      "template": {"spec": {"containers": [{"name": "worker", "image": "meshserve"}]}}},
                             "status": {"replicas": api.replicas, "readyReplicas": api.ready}})

            def do_PATCH(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api.requests.append(("PATCH", self.path, body, self.headers["Content-Type"]))
                api.replicas = body["spec"]["replicas"]
                self._reply({"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": "decode"},
                             "spec": {"replicas": api.replicas}, "status": {"replicas": api.replicas}})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def test_kubernetes_actuator_against_a_fake_api_server():
    from kubernetes import client

    from services.mesh.actuators import KubernetesActuator

    api = FakeKubeAPI(replicas=3, ready=2)
    try:
        act = KubernetesActuator("serving", {"decode": ("Deployment", "decode")},
                                 api_client=client.ApiClient(client.Configuration(host=api.url)))
        assert asyncio.run(act.state("decode")) == PoolStatus(ready=2, starting=1)
        asyncio.run(act.scale("decode", 5, "burst"))
    finally:
        api.server.shutdown()
    assert api.requests[0][:2] == ("GET", "/apis/apps/v1/namespaces/serving/deployments/decode/status")
    method, path, body, content_type = api.requests[1]
    assert (method, path, body) == ("PATCH", "/apis/apps/v1/namespaces/serving/deployments/decode/scale",
                                    {"spec": {"replicas": 5}})
    assert "patch" in content_type and api.replicas == 5


def test_the_autoscaler_command_parses_kubernetes_workloads_and_names_a_bad_pair():
    import pytest

    from services.autoscaler.__main__ import parse_workloads

    assert parse_workloads("decode=Deployment/meshserve-decode,sql=StatefulSet/sql") == {
        "decode": ("Deployment", "meshserve-decode"), "sql": ("StatefulSet", "sql")}
    for bad in ("decode=Pod/x", "decode", "=Deployment/x", "decode=Deployment/"):
        with pytest.raises(SystemExit, match="--k8s-workloads"):
            parse_workloads(bad)
