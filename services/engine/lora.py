"""LoRA adapters on one base model: PEFT folders, their residency in an engine, and a batch's segments.

An adapter is a PEFT folder (adapter_config.json + adapter_model.safetensors) for the engine's base
model: targets among q/k/v/o/gate/up/down, rank up to max_lora_rank, scale lora_alpha / r (or / sqrt(r)
with use_rslora). inspect_adapter() validates one from its config and the safetensors header (every
tensor's name and shape; no weight is read) and raises InvalidRequest naming the adapter and what is
wrong, so a bad adapter is refused before anything of it is registered.

An engine's adapters live in three tiers (services.engine.lora_residency.AdapterResidency):
- known: registered (the config's adapter folder, lora_modules, or a load at run time);
- host: weights read into memory, max_cpu_loras of them, least recently used out first;
- slots: max_loras compute slots, stacked per layer and target (LoRASlots), which the forward reads.
A file is read on the loader thread, never inside a step: a request whose adapter is not in memory yet
waits (the scheduler passes it over) while it loads. Copying host weights into a slot is a memcpy done
at admission. A running (or receiving) request pins its adapter's slot, so the adapters of a batch never
outnumber the slots and eviction (least recently used unpinned slot) never removes one in use.

A step's batch is ordered so that each slot's rows are contiguous; LoRABatch holds the segments and
adds every projection's delta in one call per target (csrc/lora.cpp; a gathered batched matmul where the
kernel is unavailable): no loop over adapters in Python.
"""

from __future__ import annotations

import logging
import re
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.errors import InvalidRequest
from services.config.engine import LoRAConfig, ModelConfig
from services.engine.lora_residency import TARGETS, AdapterInfo, AdapterResidency, adapter_error, read_adapter_config

log = logging.getLogger("meshserve.lora")

MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}  # the model's fused projections and their parts, in column order
GROUP_TARGETS = {g: tuple((TARGETS.index(t), t) for t in parts) for g, parts in GROUPS.items()}  # with indices
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def target_shapes(mc: ModelConfig) -> dict:
    """target -> (in features, out features) of the base projection."""
    q, kv, h, i = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.hidden_size, mc.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


def inspect_adapter(name: str, path: str | Path, mc: ModelConfig, max_rank: int) -> AdapterInfo:
    """Validate a PEFT folder for this base model from its config and safetensors header (see module doc)."""
    cfg = read_adapter_config(name, path, max_rank)
    folder, rank, alpha = cfg.folder, cfg.rank, cfg.alpha

    def bad(why: str):
        return adapter_error(name, folder, why)

    shapes, seen = target_shapes(mc), {}
    try:
        with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    raise bad(f"tensor {key!r} is not a LoRA weight of a decoder layer's projection")
                layer, module, target, ab = int(m[1]), m[2], m[3], m[4]
                if target not in TARGETS or MODULE[target] != module:
                    raise bad(f"tensor {key!r}: unknown target module {target!r}; supported: {', '.join(TARGETS)}")
                if layer >= mc.num_layers:
                    raise bad(f"tensor {key!r}: layer {layer} is beyond the base model's {mc.num_layers}")
                fan_in, fan_out = shapes[target]
                want = [rank, fan_in] if ab == "A" else [fan_out, rank]
                got = list(f.get_slice(key).get_shape())
                if got != want:
                    raise bad(f"tensor {key!r} has shape {got}, expected {want} (rank {rank}, the base model's "
                              f"{target} is {fan_in} -> {fan_out})")
                seen.setdefault((layer, target), set()).add(ab)
    except FileNotFoundError:
        raise bad(f"{WEIGHTS_FILE} not found") from None
    except InvalidRequest:
        raise
    except Exception as e:  # a truncated or foreign file
        raise bad(f"{WEIGHTS_FILE} is not a readable safetensors file ({e})") from None
    half = sorted(f"layer {layer} {t}" for (layer, t), ab in seen.items() if ab != {"A", "B"})
    if half:
        raise bad(f"lora_A and lora_B must come in pairs; missing one for {', '.join(half[:4])}")
    if not seen:
        raise bad("no LoRA weights in " + WEIGHTS_FILE)
    targets = tuple(t for t in TARGETS if any(t == tt for _, tt in seen))
    nbytes = sum(rank * sum(shapes[t]) * 4 for _, t in seen)
    return AdapterInfo(name, str(folder), rank, float(alpha), cfg.scale, targets, nbytes)


def read_adapter(info: AdapterInfo, dtype: torch.dtype) -> dict:
    """(layer, target) -> (A [rank, in], B [rank, out]): lora_A as stored, lora_B transposed and scaled."""
    out = {}
    with safe_open(str(Path(info.path) / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            m = _KEY.match(key)
            if m[4] == "A":
                layer, target = int(m[1]), m[3]
                prefix = key[: -len("lora_A.weight")]
                a = f.get_tensor(key).to(torch.float32)
                b = f.get_tensor(prefix + "lora_B.weight").to(torch.float32).t() * info.scale
                out[(layer, target)] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return out


class LoRASlots:
    """The compute slots: per layer and target, A [slots, R, in] and B [slots, R, out], R the largest rank
    registered (grown when a larger one registers; a slot's rows past its rank are zero), and its rank
    per (layer, target) in ranks [layers, targets, slots] (0 = that slot does not adapt it).

    Under tensor parallelism (services.engine.parallel) mc is one rank's shard, `shard` cuts an adapter's whole
    weights to it, and on rank 0 `mirror(op, *args)` repeats every change on the other ranks."""

    def __init__(self, mc: ModelConfig, num_slots: int, dtype: torch.dtype, shard=None, mirror=None):
        self.num_layers, self.num_slots, self.dtype = mc.num_layers, num_slots, dtype
        self.shard, self.mirror = shard, mirror
        self.shapes = target_shapes(mc)
        self.width = 0
        self.A: list[list[torch.Tensor]] = []
        self.B: list[list[torch.Tensor]] = []
        self.ranks = torch.zeros(mc.num_layers, len(TARGETS), num_slots, dtype=torch.int32)
        cols = {}
        for group, parts in GROUPS.items():
            col = 0
            for t in parts:
                cols[t] = (group, col)
                col += self.shapes[t][1]
        self.columns = cols  # target -> (fused projection, its first column there)

    def ensure(self, rank: int) -> None:
        """Make room for rank (between steps: the stacks are replaced)."""
        if rank <= self.width:
            return
        if self.mirror:
            self.mirror("ensure", rank)
        new_a, new_b = [], []
        for layer in range(self.num_layers):
            row_a, row_b = [], []
            for ti, t in enumerate(TARGETS):
                fan_in, fan_out = self.shapes[t]
                a = torch.zeros(self.num_slots, rank, fan_in, dtype=self.dtype)
                b = torch.zeros(self.num_slots, rank, fan_out, dtype=self.dtype)
                if self.width:
                    a[:, :self.width].copy_(self.A[layer][ti])
                    b[:, :self.width].copy_(self.B[layer][ti])
                row_a.append(a)
                row_b.append(b)
            new_a.append(row_a)
            new_b.append(row_b)
        self.A, self.B, self.width = new_a, new_b, rank

    def write(self, slot: int, weights: dict) -> None:
        """weights: {(layer, target): (A [r, in], B [r, out])}, the whole adapter's."""
        if self.mirror:
            self.mirror("write", slot, weights)
        self._clear(slot)
        for (layer, target), (a, b) in (self.shard(weights) if self.shard else weights).items():
            ti, r = TARGETS.index(target), a.shape[0]
            self.A[layer][ti][slot, :r].copy_(a)
            self.B[layer][ti][slot, :r].copy_(b)
            self.ranks[layer, ti, slot] = r

    def clear(self, slot: int) -> None:
        if self.mirror:
            self.mirror("clear", slot)
        self._clear(slot)

    def _clear(self, slot: int) -> None:
        for layer in range(self.num_layers):
            for ti in range(len(TARGETS)):
                r = int(self.ranks[layer, ti, slot])
                if r:
                    self.A[layer][ti][slot, :r].zero_()
                    self.B[layer][ti][slot, :r].zero_()
        self.ranks[:, :, slot] = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for row in self.A + self.B for t in row)


class LoRABatch:
    """One step's adapter segments: (first row, end row, slot) over the flat batch (see module doc)."""

    def __init__(self, slots: LoRASlots, segments: list, kernel=None):
        self.slots = slots
        self.segs = torch.tensor(segments, dtype=torch.long)
        used = sorted({s for _, _, s in segments})
        active = slots.ranks[:, :, used].amax(-1) > 0  # [layers, targets]: some adapter here adapts it
        self.active = active.tolist()
        self.kernel = kernel if slots.dtype == torch.float32 else None
        if self.kernel is None:  # the gathered fallback: each adapted row with its slot
            rows = [torch.arange(a, b) for a, b, _ in segments]
            self.rows = torch.cat(rows)
            self.row_slot = torch.cat([torch.full((b - a,), s, dtype=torch.long) for a, b, s in segments])

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, group: str) -> None:
        """out (the fused projection's output for x) += every row's adapter delta, in place."""
        slots, active = self.slots, self.active[layer]
        for ti, t in GROUP_TARGETS[group]:
            if not active[ti]:
                continue
            col = slots.columns[t][1]
            a, b = slots.A[layer][ti], slots.B[layer][ti]
            if self.kernel is not None:
                self.kernel.lora_apply_(out, x, a, b, self.segs, slots.ranks[layer, ti], col)
            else:
                xa = torch.bmm(a[self.row_slot], x[self.rows].unsqueeze(-1))  # [n, R, 1]; rows past a rank are 0
                delta = torch.bmm(xa.transpose(1, 2), b[self.row_slot]).squeeze(1)
                out[:, col:col + b.shape[-1]].index_add_(0, self.rows, delta.to(out.dtype))


def engine_residency(mc: ModelConfig, dtype: torch.dtype, lc: LoRAConfig, in_use, clock,
                     slots=None) -> AdapterResidency:
    """The model engine's residency: PEFT folders validated for mc, weights read as dtype into LoRASlots (given: a
    tensor-parallel rank 0's sharded slots)."""
    return AdapterResidency(lc.max_loras, lc.max_cpu_loras, slots or LoRASlots(mc, lc.max_loras, dtype),
                            partial(inspect_adapter, mc=mc, max_rank=lc.max_lora_rank),
                            partial(read_adapter, dtype=dtype), in_use=in_use, clock=clock)
