"""One request is one trace across gateway, router, prefill, kvstore and decode (OTLP export)."""

import json
import subprocess
import sys
import time

import grpc

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.launcher import Mesh, MeshSpec, free_port
from tests.integration.conftest import ENGINE

SERVICES = {"gateway", "router", "prefill", "kvstore", "decode"}


def test_one_trace_spans_all_five_services(tiny_model, tmp_path):
    port, out = free_port(), tmp_path / "spans.jsonl"
    receiver = subprocess.Popen([sys.executable, "-m", "tests.support.otlp_receiver", str(port), str(out)],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout.readline().strip() == "receiving"
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
        mesh = Mesh(MeshSpec(str(tiny_model), decode=1, engine_args=ENGINE, env=env), log_dir=str(tmp_path)).start()
        try:
            with grpc.insecure_channel(mesh.gateway) as ch:
                list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                    request_id="traced", token_ids=pb.TokenIds(ids=list(range(3, 40))),
                    sampling=pb.Sampling(max_tokens=4, temperature=0.0, ignore_eos=True)), timeout=60))
            deadline = time.monotonic() + 30
            while True:
                spans = [json.loads(ln) for ln in out.read_text().splitlines()] if out.exists() else []
                gateway_traces = {s["trace_id"] for s in spans if s["service"] == "gateway"
                                  and s["name"].endswith("Generation/Generate")}
                by_trace = {t: {s["service"] for s in spans if s["trace_id"] == t} for t in gateway_traces}
                if any(services >= SERVICES for services in by_trace.values()):
                    break
                assert time.monotonic() < deadline, f"spans of one trace: {by_trace}"
                time.sleep(0.3)
        finally:
            mesh.stop()
    finally:
        receiver.kill()
        receiver.wait()
