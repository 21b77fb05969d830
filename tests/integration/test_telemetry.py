"""Telemetry of a running mesh: one request is one trace across gateway, router, prefill, kvstore
and decode (OTLP); every service exports metrics over OTLP and serves Prometheus text at /metrics,
the workers under vLLM's names."""

import json
import re
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import Mesh, MeshSpec, free_port
from tests.support.mesh import ENGINE

SERVICES = {"gateway", "router", "prefill", "kvstore", "decode"}


@pytest.fixture(scope="module")
def traced(tiny_model, tmp_path_factory):
    """A disaggregated mesh exporting to an in-process OTLP receiver, after four requests (one shared prefix)."""
    tmp = tmp_path_factory.mktemp("telemetry")
    port, spans, points = free_port(), tmp / "spans.jsonl", tmp / "metrics.jsonl"
    receiver = subprocess.Popen([sys.executable, "-m", "services.common.otlp_receiver", "--port", str(port),
                                 "--spans", str(spans), "--metrics", str(points)], stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout.readline().startswith("receiving")
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_METRIC_EXPORT_INTERVAL": "500"}
        mesh = Mesh(MeshSpec(str(tiny_model), decode=1, engine_args=ENGINE, env=env), log_dir=str(tmp)).start()
        try:
            with grpc.insecure_channel(mesh.gateway) as ch:
                for i in range(4):
                    list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                        request_id=f"traced-{i}", token_ids=pb.TokenIds(ids=list(range(3, 40)) + [100 + i]),
                        sampling=pb.Sampling(max_tokens=4, temperature=0.0, ignore_eos=True)), timeout=60))
            yield mesh, spans, points
        finally:
            mesh.stop()
    finally:
        receiver.kill()
        receiver.wait()


def _lines(path):
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def test_one_trace_spans_all_five_services(traced):
    _, out, _ = traced
    deadline = time.monotonic() + 30
    while True:
        spans = _lines(out)
        gateway_traces = {s["trace_id"] for s in spans if s["service"] == "gateway"
                          and s["name"].endswith("Generation/Generate")}
        by_trace = {t: {s["service"] for s in spans if s["trace_id"] == t} for t in gateway_traces}
        if any(services >= SERVICES for services in by_trace.values()):
            break
        assert time.monotonic() < deadline, f"spans of one trace: {by_trace}"
        time.sleep(0.3)


def test_every_service_exports_metrics_over_otlp(traced):
    _, _, points = traced
    wanted = {("prefill", "vllm.generation_tokens"), ("decode", "vllm.generation_tokens"),
              ("prefill", "vllm.time_to_first_token_seconds"), ("decode", "vllm.inter_token_latency_seconds"),
              ("gateway", "meshserve.gateway.requests"), ("router", "meshserve.router.decision"),
              ("kvstore", "meshserve.kv_transfer.bytes")}
    deadline = time.monotonic() + 30
    while True:
        seen = {(p["service"], p["name"]) for p in _lines(points) if p["value"] > 0}
        if wanted <= seen:
            break
        assert time.monotonic() < deadline, f"missing over OTLP: {sorted(wanted - seen)}"
        time.sleep(0.3)


def _scrape(url: str) -> dict:
    """Prometheus text as {'name{labels}': value}."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def _total(samples: dict, name: str) -> float:
    return sum(v for k, v in samples.items() if re.fullmatch(re.escape(name) + r"(\{.*\})?", k))


def test_metrics_endpoints_serve_vllm_names_with_values(traced):
    mesh = traced[0]
    prefill, decode = (_scrape(mesh.workers(role)[0].metrics_url) for role in ("prefill", "decode"))
    for worker in (prefill, decode):
        assert _total(worker, "vllm:generation_tokens_total") > 0
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            assert gauge in "".join(worker), gauge
    assert _total(prefill, "vllm:prompt_tokens_total") >= 4 * 30
    assert _total(prefill, "vllm:prefix_cache_queries_total") >= _total(prefill, "vllm:prefix_cache_hits_total") > 0
    assert _total(prefill, "vllm:time_to_first_token_seconds_count") == 4
    assert _total(decode, "vllm:inter_token_latency_seconds_count") == 4 * 2  # tokens 3 and 4 of each request
    assert _total(decode, "vllm:e2e_request_latency_seconds_count") == 4
    assert _total(decode, 'vllm:time_to_first_token_seconds_bucket{role="decode",worker_id="decode-0",le="+Inf"}') == 0
    kvstore = _scrape(mesh.proc("kvstore").metrics_url)
    moved = {k: v for k, v in kvstore.items() if k.startswith("meshserve:kv_transfer_bytes_total{")}
    for direction in ("put", "get"):  # by the transport each transfer used: here, one host, shared memory
        assert sum(v for k, v in moved.items() if f'direction="{direction}"' in k and 'transport="shm"' in k) > 0, moved
    assert _total(_scrape(mesh.proc("router").metrics_url), "meshserve:router_decision_milliseconds_count") >= 4
    gateway = _scrape(mesh.proc("gateway").metrics_url)
    assert _total(gateway, "meshserve:gateway_requests_total") > 0
    assert _scrape(mesh.http + "/metrics").keys() == gateway.keys()  # the HTTP front serves the same


def test_metrics_port_serves_only_metrics(traced):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(traced[0].proc("router").metrics_url.replace("/metrics", "/other"), timeout=10)
    assert e.value.code == 404
