"""scale-from-zero: one request to a mesh with no worker; the gateway holds it and says so, the autoscaler starts a
worker, the worker serves it. Time to first token from a cold pool, beside the same request to a warm worker.

Each repeat starts `meshserve up` (unified mode, no worker, the autoscaler on with `min_replicas: 0`), waits for
it to be ready (gateway, router, kvstore, autoscaler: no worker), sends one streaming request over gRPC and times
its first token and its end; the moment the Supervisor says it started the worker is read from `up`'s output.
Then the same request again, now to the warm worker. Every repeat is a fresh mesh.

    meshserve bench scale-from-zero --model ~/.cache/meshserve/models/smollm2-135m-instruct [--cold-runs 3]
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import yaml

from bench.common import log, machine, write_result
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc

PROMPT = "What is the capital of France? Answer in one word, then say why in a sentence."


def add_flags(p) -> None:
    g = p.add_argument_group("scale-from-zero")
    g.add_argument("--cold-runs", type=int, default=3, help="fresh meshes, one cold request each")


def config(threads: int | None) -> dict:
    return {"mesh": {"mode": "unified", "unified": 0},
            "engine": {"kv_cache_gb": 0.25, **({"threads": threads} if threads else {})},
            "autoscaler": {"enabled": True, "policy": "token-policy", "interval_s": 1.0, "export_interval_ms": 500,
                           "pools": {"unified": {"min_replicas": 0, "max_replicas": 1, "startup_s": 15}}}}


class Up:
    """`meshserve up` in its own process group, its output read as it comes with the time of each line."""

    def __init__(self, model: str, cfg: dict):
        self.dir = tempfile.mkdtemp(prefix="scale-from-zero-")
        (Path(self.dir) / "mesh.yaml").write_text(yaml.safe_dump(cfg))
        self.proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--model", model, "--config",
                                      "mesh.yaml", "--port", "0", "--http-port", "0", "--router-port", "0",
                                      "--kvstore-port", "0", "--supervisor-port", "0", "--autoscaler-port", "0"],
                                     cwd=self.dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))
            if "meshserve is ready" in line:
                self.ready.set()

    def first(self, pattern: str) -> tuple[float, str] | None:
        return next(((t, ln) for t, ln in self.lines if re.search(pattern, ln)), None)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def one_request(gateway: str) -> dict:
    """TTFT and e2e of one greedy streaming request of 32 tokens, from the client's side."""
    req = pb.GenerateRequest(text=PROMPT.encode(),
                             sampling=pb.Sampling(max_tokens=32, temperature=0.0, ignore_eos=True))
    t0 = time.monotonic()
    first, n = None, 0
    with grpc.insecure_channel(gateway) as ch:
        for r in pb_grpc.GenerationStub(ch).Generate(req, timeout=300):
            if r.token_ids and first is None:
                first = time.monotonic()
            n += len(r.token_ids)
    end = time.monotonic()
    return {"t0": t0, "ttft_s": round(first - t0, 3), "e2e_s": round(end - t0, 3), "tokens": n}


def run(args) -> int:
    model = args.model or str(Path.home() / ".cache/meshserve/models/smollm2-135m-instruct")
    runs = []
    for i in range(args.cold_runs):
        up = Up(model, config(args.threads))
        try:
            if not up.ready.wait(300):
                raise SystemExit("meshserve up was not ready in 300 s:\n" + "".join(ln for _, ln in up.lines[-30:]))
            gateway = next(ln.strip() for _, ln in up.lines if re.fullmatch(r"127\.0\.0\.1:\d+", ln.strip()))
            cold = one_request(gateway)
            started = up.first(r"scale unified: started unified-0")
            warm = one_request(gateway)
            run = {"cold_ttft_s": cold["ttft_s"], "cold_e2e_s": cold["e2e_s"], "cold_tokens": cold["tokens"],
                   "autoscaler_started_worker_after_s": round(started[0] - cold["t0"], 3) if started else None,
                   "warm_ttft_s": warm["ttft_s"], "warm_e2e_s": warm["e2e_s"],
                   "decision": started[1].strip() if started else None}
        finally:
            up.stop()
        runs.append(run)
        log(f"repeat {i}: {run}")
    result = {"workload": "scale-from-zero", "command": args.command_line, "machine": machine(), "model": model,
              "config": config(args.threads), "runs": runs}
    write_result(result, args.out)
    return 0
