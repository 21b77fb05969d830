"""`meshserve up` from nothing: generates the tiny model, prints the address and the ready line,
serves a client, and stops every process on SIGTERM, leaving no shared-memory segment behind."""

import json
import os
import re
import signal
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.support.procs import processes_in


def kv_segments() -> set:
    from services.common.arena import PREFIX, SHM_DIR

    return {p.name for p in SHM_DIR.glob(PREFIX + "*")}


def test_up_serves_and_stops_cleanly(tmp_path):
    """The split topology (a small machine's default is one unified worker, which formats no kvstore arena)."""
    before = kv_segments()
    (tmp_path / "mesh.yaml").write_text("mesh: {mode: disaggregated}\n")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--model", "tiny", "--config", "mesh.yaml",
                             "--port", "0", "--http-port", "0",
                             "--router-port", "0", "--kvstore-port", "0", "--supervisor-port", "0"], cwd=tmp_path,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        assert proc.pid in processes_in(tmp_path)
        for line in proc.stdout:
            lines.append(line)
            if re.search(r"\bready\b", line):  # the word: "Address already in use" is not it
                break
        assert any(re.search(r"\bready\b", ln) for ln in lines), "".join(lines)
        chosen = [ln for ln in lines if ln.startswith("default for this machine")]  # the weights: not in the file
        assert len(chosen) == 1 and "engine.dtype" in chosen[0], "".join(lines)
        address = next(ln.strip() for ln in lines if re.fullmatch(r"127\.0\.0\.1:\d+", ln.strip()))
        with grpc.insecure_channel(address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            reply = next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
            assert "meshserve.v1.Generation" in {s.name for s in reply.list_services_response.service}
        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        inp.write_text(json.dumps({"id": "a", "prompt": "Kalo mine", "max_tokens": 5, "temperature": 0}) + "\n")
        client = subprocess.run([sys.executable, "-m", "services.cli", "client", "--target", address, "--input", inp,
                                 "--output", out], capture_output=True, text=True, timeout=60)
        assert client.returncode == 0, client.stderr
        assert len(json.loads(out.read_text())["token_ids"]) == 5
        assert (tmp_path / "models" / "tiny" / "model.safetensors").exists()
        assert len(kv_segments() - before) == 1  # the kvstore's arena, formatted by the first worker
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, rest
    assert "stopped" in rest
    assert not processes_in(tmp_path), "processes of the mesh outlived it"
    assert kv_segments() <= before, "the kvstore's shared memory outlived the mesh"

