"""Shared pieces of the benchmark harness: machine description, workload requests, result files."""

from __future__ import annotations

import json
import os
import platform
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def machine() -> dict:
    import torch

    cpu = ""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    except OSError:
        pass
    from services.engine.layers.kernels import host_isa

    limits = {k: os.environ[k] for k in ("MESHSERVE_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
              if k in os.environ}
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "isa": vector_isa(), "kernel_isa": host_isa(),
            "isa_limits": limits, "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")


def vector_isa() -> list[str]:
    """The host's vector instruction sets that matter for CPU inference, as /proc/cpuinfo names them."""
    try:
        flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    except OSError:
        return []
    return [f for f in ISA_FLAGS if f in flags]


def random_requests(n: int, prompt_range: tuple, output_range: tuple, vocab: int, seed: int = 0) -> list[dict]:
    """Random-token requests in the JSONL format: greedy, EOS ignored."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = rng.randint(*prompt_range)
        out.append({"id": f"req-{i}", "prompt_token_ids": [rng.randrange(3, vocab) for _ in range(p)],
                    "max_tokens": rng.randint(*output_range), "temperature": 0.0, "ignore_eos": True})
    return out


def default_model(preset: str) -> Path:
    """The seeded preset model in meshserve's model cache (MESHSERVE_CACHE_DIR, default ~/.cache/meshserve), written on
    first use."""
    from services.engine.tools.model_fetch import cached_path
    from services.engine.tools.model_init import write_model

    path = cached_path(preset)
    if not (path / "model.safetensors").exists():
        log(f"writing the {preset} model to {path}")
        write_model(path, preset)
    return path


def worker_lora_stats(mesh, workers: int | None = None) -> dict:
    """The unified workers' LoRA counters from their Stats, summed over the first `workers` (all by default):
    adapter reads and their seconds, slot loads, hits and misses."""
    import grpc

    from services.common.pb import meshserve_pb2 as pb
    from services.common.pb import meshserve_pb2_grpc as pb_grpc

    totals = dict.fromkeys(("lora_loads", "lora_load_s", "lora_slot_loads", "lora_hits", "lora_misses"), 0)
    for w in mesh.workers("unified")[:workers]:
        with grpc.insecure_channel(w.address) as ch:
            s = pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=10)
        for key in totals:
            totals[key] += getattr(s, key)
    return totals


def write_result(result: dict, out: str | None) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
        log(f"wrote {out}")


def print_table(result: dict) -> None:
    systems = result["systems"]
    metrics = sorted({m for s in systems.values() for m, v in s.items() if not isinstance(v, (list, dict))})
    width = max(len(m) for m in metrics) + 2
    print(f"{result['workload']}".ljust(width) + "".join(f"{name:>22}" for name in systems))
    for m in metrics:
        cells = "".join(f"{_fmt(s.get(m)):>22}" for s in systems.values())
        print(m.ljust(width) + cells)
    for k, v in result.get("ratios", {}).items():
        print(f"{k}: {_fmt(v)}")


def _fmt(v) -> str:
    if v is None:
        return "null"
    return f"{v:,.4g}" if isinstance(v, float) else str(v)
