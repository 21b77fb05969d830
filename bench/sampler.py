"""Workload sampler: one sampling step of a full batch, by kind of row, kernel and PyTorch fallback.

Rows x vocabulary (default 256 x 32,000, the engine-mixed batch at the bench preset's vocabulary)
of random logits at two spreads: "flat" (std 2, a random-weight model: every token is a candidate)
and "peaked" (std 8, closer to a trained model). Each kind of row is timed over the whole batch:
greedy, temperature 1.0, top-p 0.9, top-k 50, min-p 0.05, and top-k 50 + top-p 0.9. Seeds and
output positions differ per row, as in serving. Metric per system: `<kind>_<spread>_ms`, the median
of --repeats calls after one excluded warm-up call. `torch-multinomial` is what the engine did
before the kernel: softmax, then torch's exponential race per row (temperature rows only).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from bench.common import log, machine, print_table, write_result

KINDS = {  # kind: (temperature, top_k, top_p, min_p)
    "greedy": (0.0, 0, 1.0, 0.0), "temperature": (1.0, 0, 1.0, 0.0), "top_p": (1.0, 0, 0.9, 0.0),
    "top_k": (1.0, 50, 1.0, 0.0), "min_p": (1.0, 0, 1.0, 0.05), "top_k_top_p": (1.0, 50, 0.9, 0.0)}
SPREADS = {"flat": 2.0, "peaked": 8.0}


def add_flags(p) -> None:
    g = p.add_argument_group("sampler")
    g.add_argument("--rows", type=int, default=256)
    g.add_argument("--vocab", type=int, default=32000)
    g.add_argument("--repeats", type=int, help="timed calls per row kind (default 20, quick 3)")


def run(args) -> int:
    from services.engine.layers.kernels import sampler

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    repeats = args.repeats or (3 if args.quick else 20)
    kernel = sampler()
    if kernel is None:
        log("the sampling kernel is not built (MESHSERVE_KERNELS=0 or no compiler): timing the fallback only")
    systems = {"kernel": {}, "torch-fallback": {}, "torch-multinomial": {}}
    g = torch.Generator().manual_seed(args.seed)
    for spread, scale in SPREADS.items():
        logits = torch.randn(args.rows, args.vocab, generator=g) * scale
        for kind, params in KINDS.items():
            batch = _batch(args.rows, *params, seed=args.seed)
            if kernel is not None:
                systems["kernel"][f"{kind}_{spread}_ms"] = _time(lambda: kernel.sample(logits, *batch.tensors()),
                                                                 repeats)
            if not args.quick or kind == "temperature":
                systems["torch-fallback"][f"{kind}_{spread}_ms"] = _time(lambda: _fallback(logits, batch),
                                                                          max(1, repeats // 4))
            if kind == "temperature":
                systems["torch-multinomial"][f"{kind}_{spread}_ms"] = _time(lambda: _multinomial(logits), repeats)
            log(f"{spread} {kind}: " + ", ".join(f"{s} {v.get(f'{kind}_{spread}_ms')}" for s, v in systems.items()))
    config = {"rows": args.rows, "vocab": args.vocab, "repeats": repeats, "threads": threads,
              "spreads_std": SPREADS, "kinds": {k: dict(zip(("temperature", "top_k", "top_p", "min_p"), v))
                                                for k, v in KINDS.items()}}
    ratios = {}
    if systems["kernel"]:
        for spread in SPREADS:
            key = f"temperature_{spread}_ms"
            ratio = systems["torch-multinomial"][key] / systems["kernel"][key]
            ratios[f"torch-multinomial/kernel:{key}"] = round(ratio, 1)
    result = {"workload": "sampler", "command": args.command_line, "machine": machine(), "config": config,
              "systems": {k: v for k, v in systems.items() if v}, "ratios": ratios}
    write_result(result, args.out)
    print_table(result)
    return 0


def _batch(rows: int, temperature: float, top_k: int, top_p: float, min_p: float, seed: int):
    from services.engine.layers.sampler import SamplingBatch

    full = lambda v, dt: torch.full((rows,), v, dtype=dt)  # noqa: E731
    return SamplingBatch(full(temperature, torch.float32), full(top_k, torch.int64), full(top_p, torch.float32),
                         full(math.log(min_p) if min_p else -math.inf, torch.float32),
                         torch.arange(seed, seed + rows, dtype=torch.int64), torch.arange(rows, dtype=torch.int64) * 7,
                         torch.zeros(rows + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                         full(False, torch.bool))


def _fallback(logits, batch):
    from services.engine.layers.sampler import sample_torch

    return sample_torch(logits, batch)


def _multinomial(logits: torch.Tensor) -> torch.Tensor:
    """The engine's sampler before the kernel: softmax, exponential noise per row, argmax."""
    probs = torch.softmax(logits, dim=-1)
    q = torch.empty_like(probs)
    for i in range(probs.shape[0]):
        q[i].exponential_()
    return (probs / q).argmax(dim=-1)


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e3, 3)
