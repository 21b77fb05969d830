"""Where LoRA's time goes in the engine: one engine (bench preset, one torch thread), 32 requests of 128 prompt
tokens and 64 output tokens at once; the decode step's mean time with no adapter, with 8 adapters of ranks 8-64
(lora-00..07 of the lora-zipf set), with one rank-64 all-target adapter, with four of them, and with the
gathered fallback (no compiled kernel). Needs the lora-zipf adapters (`meshserve bench lora-zipf --quick` once).

    .venv/bin/python -m bench.lora_engine_cost
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from services.common.sampling import SamplingParams
from services.config.engine import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from services.engine.engine import LLMEngine

ROOT = Path.home() / ".cache" / "meshserve" / "adapters" / "bench-64"
MODEL = Path.home() / ".cache" / "meshserve" / "models" / "bench"
N = 32


def decode_step_ms(adapters: list, kernel: bool = True) -> tuple[float, float]:
    """(wall seconds, mean decode-only step in ms) for one request per entry of adapters ("" = base model)."""
    e = LLMEngine(EngineConfig(str(MODEL), cache=CacheConfig(num_blocks=4096),
                               scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, policy="fcfs"),
                               lora=LoRAConfig(max_loras=8, max_cpu_loras=32, max_lora_rank=64)))
    for a in sorted(set(adapters) - {""}):
        e.adapters.load(a, str(ROOT / a), prefetch=True)
    while e.lora.loading:  # read before timing
        e.lora.wait(1)
        e.lora.poll()
    if not kernel:
        e._lora_kernel = False
    rng = random.Random(0)
    for i, a in enumerate(adapters):
        e.add_request(f"r{i}", [rng.randrange(3, 30000) for _ in range(128)],
                      SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True), adapter=a)
    decode_s, decodes = 0.0, 0
    t0 = time.perf_counter()
    while e.has_unfinished():
        t = time.perf_counter()
        e.step()
        if e.last_step and e.last_step.num_tokens == e.last_step.num_running:
            decode_s += time.perf_counter() - t
            decodes += 1
    return time.perf_counter() - t0, decode_s / max(decodes, 1) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    names = [f"lora-{i:02d}" for i in range(64)]
    cases = (("base model", [""] * N, True), ("8 adapters, ranks 8-64", [names[i % 8] for i in range(N)], True),
             ("1 adapter, rank 64, all targets", ["lora-11"] * N, True),
             ("4 adapters, rank 64, all targets", [names[11 + 12 * (i % 4)] for i in range(N)], True),
             ("8 adapters, gathered fallback", [names[i % 8] for i in range(N)], False))
    for label, adapters, kernel in cases:
        wall, step = decode_step_ms(adapters, kernel)
        print(f"{label:36s} wall {wall:6.2f} s   decode step {step:6.2f} ms ({N} sequences)", flush=True)


if __name__ == "__main__":
    main()
