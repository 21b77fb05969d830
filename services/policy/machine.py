"""What `meshserve up` serves with where its config leaves the choice open, picked per machine: the engine's dtype and
weight form by the CPU's ISA level (services.engine.layers.kernels), the topology by its core count. Pure: the level and
the core count in, the choice and one reason per choice out; `up` applies only what the config does not set and
prints the reasons at start-up.

- **Weights and activations.** Where the CPU has native bfloat16 dot products (levels amx and avx512_bf16: AMD Zen 4
  and 5, Intel Cooper Lake and Sapphire Rapids on), bfloat16 (`engine.dtype: bfloat16, quantization: none`): oneDNN's
  linear layers and our prompt and decode kernels all run on bfloat16 instructions there. On a 2-core AMD EPYC
  (Zen 4) with SmolLM2-135M it served 1.92x the output tokens of the quantized weights under `vllm bench serve` at
  unlimited rate (341.6 against 178.1 tok/s, TTFT p50 0.50x) and 2.14x in engine-mixed, with a single request's
  TTFT 0.55x (116 against 211 ms); one stream alone decodes at 19.9 ms a token against the quantized weights' 12.0
  (docs/BENCHMARKS.md, "Every x86 CPU"). Elsewhere float32 activations with the folder's GGUF blocks kept quantized
  where it has them (`quantization: auto`), as before: without native bfloat16 a bfloat16 GEMM is emulated.
- **Topology.** On fewer than 4 cores one unified worker with every core (`mesh.mode: unified`), where the
  disaggregated default (1 prefill + 2 decode workers, a thread each) puts three engines on two cores beside the
  gateway, router and kvstore: on the 2-core EPYC, same weights, the unified worker served 1.20x the split's output
  tokens (178.1 against 148.6 tok/s) at 0.40x its TTFT p50. From 4 cores the split stays (not measured: this
  machine has 2).
"""

from __future__ import annotations

from dataclasses import dataclass

NATIVE_BF16_LEVELS = frozenset({"amx", "avx512_bf16"})  # the kernels' levels (engine.layers.kernels) with bfloat16 dots
UNIFIED_BELOW_CORES = 4


@dataclass(frozen=True)
class ServingDefaults:
    """The choices, and why each was made (one line each, for the start-up output)."""

    mode: str  # mesh.mode: unified or disaggregated
    unified_threads: int  # torch threads of the unified worker (unified mode)
    dtype: str  # engine.dtype
    quantization: str  # engine.quantization
    reasons: tuple  # (setting, why) per choice


def serving_defaults(level: str, cores: int) -> ServingDefaults:
    """The defaults for a CPU at kernel level `level` with `cores` cores this process may use (module doc)."""
    reasons = []
    if level in NATIVE_BF16_LEVELS:
        dtype, quantization = "bfloat16", "none"
        reasons.append(("engine.dtype bfloat16", f"this CPU has native bfloat16 dot products (level {level}): about "
                        "2x the quantized weights' throughput under load and a faster first token; set "
                        "engine.quantization: gguf for the fastest lone stream (12 against 20 ms a token on SmolLM2)"))
    else:
        dtype, quantization = "float32", "auto"
        reasons.append(("engine.dtype float32", f"no native bfloat16 dot products here (level {level}); the "
                        "folder's GGUF blocks stay quantized where it has them"))
    if cores < UNIFIED_BELOW_CORES:
        mode = "unified"
        reasons.append(("mesh.mode unified", f"{cores} core(s): one worker with every core (the 1 prefill + 2 "
                        f"decode split would put three engines on {cores} beside the gateway, router and kvstore)"))
    else:
        mode = "disaggregated"
        reasons.append(("mesh.mode disaggregated", f"{cores} cores: 1 prefill + 2 decode workers"))
    return ServingDefaults(mode, max(1, cores), dtype, quantization, tuple(reasons))
