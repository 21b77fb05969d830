"""A step-time model of an engine, with no model behind it: what the simulator (sim/) and the mock engine
(services/engine/mock.py) both charge a step.

step time = base_s + per_seq_s x sequences + per_context_s x context tokens + prefill_s_per_token x prompt tokens
            + prefill_context_s x prompt chunk tokens x their context

Terms and the rest of the fields are described in sim/cost.py, which fits them to a real worker's logged steps
(`meshserve sim calibrate` writes the JSON that load() reads). PRESETS are profiles stated as assumptions, not
measurements: where a calibration file is at hand, use it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class CostModel:
    base_s: float = 0.0025
    per_seq_s: float = 0.0003
    per_context_s: float = 2e-7
    prefill_s_per_token: float = 6e-5
    prefill_context_s: float = 0.0
    hop_s: float = 0.004  # gateway -> router -> worker and the first token's way back, beyond the steps
    kv_bytes_per_token: int = 16384
    kv_link_gbytes_per_s: float = 1.0  # a worker's KV link to the kvstore (per direction)
    cores: int = 0  # cores the workers share (0 = each worker has its own); steps slow down when more run at once
    # Where workers share cores (cores > 0), the rest of the mesh on that machine takes some of them too: the
    # gateway, router, servicers, Redis and the load's client, in CPU seconds per second, per request arriving and
    # per token streamed (calibrate measures them); their load counts beside the busy workers in the sharing.
    host_cpu_s_per_s: float = 0.0
    host_cpu_s_per_request: float = 0.0
    host_cpu_s_per_token: float = 0.0
    # LoRA adapters (assumed, not calibrated: `sim calibrate` does not fit them): reading one adapter from storage
    # into host memory (in the background; its requests wait), and copying it into a compute slot (inside the step
    # that admits its first request).
    lora_read_s: float = 0.005
    lora_slot_s: float = 0.0002
    source: dict = field(default_factory=dict)  # how it was measured (machine, steps, residuals)

    def step_s(self, seqs: int, prefill_tokens: int = 0, context_tokens: int = 0, prefill_context: int = 0) -> float:
        return (self.base_s + self.per_seq_s * seqs + self.per_context_s * context_tokens
                + self.prefill_s_per_token * prefill_tokens + self.prefill_context_s * prefill_context)

    def host_cores(self, requests_per_s: float, tokens_per_s: float) -> float:
        """The cores the rest of the mesh takes at these request and streamed-token rates (host_cpu_*)."""
        return (self.host_cpu_s_per_s + self.host_cpu_s_per_request * requests_per_s
                + self.host_cpu_s_per_token * tokens_per_s)

    def kv_transfer_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / (self.kv_link_gbytes_per_s * 1e9)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the cost model {path}: {e}") from None
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {sorted(unknown)}")
        return cls(**d)


# Profiles for the mock engine and the simulator, stated as assumptions (orders of magnitude from public figures
# and arithmetic, not measured here): a decode step reads the weights once plus each sequence's KV; a prompt
# token costs 2 x parameters FLOPs at a realistic fraction of peak.
PRESETS = {
    # The simulator's defaults: roughly SmolLM2-135M on one core of this class of CPU (meshserve sim calibrate
    # measures the real figures on the machine at hand).
    "cpu-smollm2": CostModel(source={"preset": "cpu-smollm2", "assumed": "the simulator's defaults"}),
    # Llama-3-8B in bfloat16 on one H100 SXM: 16 GB of weights at ~3 TB/s -> ~6 ms a step; 128 KiB of KV per
    # token (32 layers x 8 KV heads x 128 x 2 x 2 bytes) read at the same rate -> ~4e-8 s per context token;
    # prompts at ~40% of 990 TFLOP/s over 16 GFLOP a token -> ~4e-5 s per token; KV over 400 Gb/s RDMA. A rank-16
    # LoRA adapter on all seven projections is 84 MB: read from NVMe at ~2 GB/s -> 40 ms, copied into a slot over
    # PCIe at ~25 GB/s -> 3.4 ms.
    "h100-llama8b": CostModel(base_s=0.006, per_seq_s=0.00005, per_context_s=4e-8, prefill_s_per_token=4e-5,
                              prefill_context_s=1e-10, hop_s=0.002, kv_bytes_per_token=131072,
                              kv_link_gbytes_per_s=40.0, lora_read_s=0.04, lora_slot_s=0.0034,
                              source={"preset": "h100-llama8b", "assumed": True}),
    # Llama-3.2-1B in bfloat16 on one L4: 2.5 GB at ~250 GB/s -> ~10 ms a step; 32 KiB of KV per token;
    # prompts at ~40% of 120 TFLOP/s over 2.5 GFLOP a token -> ~5e-5 s per token; KV over 25 Gb/s Ethernet; a
    # rank-16 adapter is 22.5 MB: 11 ms from NVMe, 1.1 ms into a slot.
    "l4-llama1b": CostModel(base_s=0.010, per_seq_s=0.0001, per_context_s=1.3e-7, prefill_s_per_token=5e-5,
                            prefill_context_s=1e-10, hop_s=0.002, kv_bytes_per_token=32768,
                            kv_link_gbytes_per_s=3.0, lora_read_s=0.011, lora_slot_s=0.0011,
                            source={"preset": "l4-llama1b", "assumed": True}),
}


def cost_model(name_or_path: str) -> CostModel:
    """A preset by name, else a calibration file (ValueError naming both kinds when neither)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if not Path(name_or_path).is_file():
        raise ValueError(f"no step-time profile {name_or_path!r}: give a preset ({', '.join(PRESETS)}) or a "
                         f"calibration file (`meshserve sim calibrate` writes one)")
    return CostModel.load(name_or_path)
