"""LoRA adapters on one base model: PEFT folders, their residency in an engine, and a batch's segments.

An adapter is a PEFT folder (adapter_config.json + adapter_model.safetensors) for the engine's base
model: targets among q/k/v/o/gate/up/down, rank up to max_lora_rank, scale lora_alpha / r (or / sqrt(r)
with use_rslora). inspect_adapter() validates one from its config and the safetensors header (every
tensor's name and shape; no weight is read) and raises InvalidRequest naming the adapter and what is
wrong, so a bad adapter is refused before anything of it is registered.

An engine's adapters live in three tiers (AdapterResidency):
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

import json
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.errors import InvalidRequest, NotFound
from services.engine.config import ModelConfig

log = logging.getLogger("meshserve.lora")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}  # the model's fused projections and their parts, in column order
GROUP_TARGETS = {g: tuple((TARGETS.index(t), t) for t in parts) for g, parts in GROUPS.items()}  # with indices
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
UNSUPPORTED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights", "modules_to_save": "modules_to_save",
               "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)"}


def target_shapes(mc: ModelConfig) -> dict:
    """target -> (in features, out features) of the base projection."""
    q, kv, h, i = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.hidden_size, mc.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str  # the PEFT folder
    rank: int
    alpha: float
    scale: float  # applied to B at load: alpha / rank, or alpha / sqrt(rank) (rslora)
    targets: tuple  # the target modules it adapts, in TARGETS order
    nbytes: int  # its weights' size in memory


def inspect_adapter(name: str, path: str | Path, mc: ModelConfig, max_rank: int) -> AdapterInfo:
    """Validate a PEFT folder for this base model from its config and safetensors header (see module doc)."""
    if not name or len(name.encode()) > 256 or any(c.isspace() for c in name):
        raise InvalidRequest(f"adapter name {name!r}: must be 1-256 bytes without whitespace")
    folder = Path(path)

    def bad(why: str):
        return InvalidRequest(f"adapter {name!r} ({folder}): {why}")

    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise bad(f"{CONFIG_FILE} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"{CONFIG_FILE} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type must be LORA, got {cfg.get('peft_type') if isinstance(cfg, dict) else cfg!r}")
    for key, what in UNSUPPORTED.items():
        if cfg.get(key):
            raise bad(f"{what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise bad(f"bias {cfg.get('bias')!r} is not supported (only 'none')")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise bad(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise bad(f"rank {rank} is above this engine's max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise bad(f"lora_alpha must be a positive number, got {alpha!r}")
    listed = cfg.get("target_modules")
    if isinstance(listed, list):
        unknown = [t for t in listed if t not in TARGETS]
        if unknown:
            raise bad(f"unknown target module(s) {unknown}; supported: {', '.join(TARGETS)}")
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
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    nbytes = sum(rank * sum(shapes[t]) * 4 for _, t in seen)
    return AdapterInfo(name, str(folder), rank, float(alpha), scale, targets, nbytes)


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


@dataclass(frozen=True)
class LoRASnapshot:
    """What an engine holds, for heartbeats, metrics and listings."""

    slots: tuple  # adapters in compute slots
    host: tuple  # adapters in host memory (slot ones included)
    known: tuple  # every registered adapter
    free_slots: int  # slots holding no adapter
    pinned: tuple  # adapters in slots that live requests pin
    max_loras: int
    max_cpu_loras: int
    loads: int  # reads from disk, since start
    load_s: float  # seconds spent reading, since start
    slot_loads: int  # copies from host memory into a slot, since start
    hits: int  # admissions that found their adapter in a slot
    misses: int  # admissions that had to wait for their adapter to be read


class AdapterResidency:
    """The three tiers of one engine (module doc). Called on the engine's thread only, except the reads, which
    run on the loader thread and are joined by poll()."""

    RETIRE_GRACE_S = 30.0  # an unloaded adapter still serves requests already in the mesh for this long

    def __init__(self, mc: ModelConfig, dtype: torch.dtype, max_loras: int, max_cpu_loras: int, max_rank: int,
                 in_use=lambda name: False, reader=read_adapter, clock=time.monotonic, slots=None):
        self.mc, self.dtype, self.max_rank, self.reader, self.clock = mc, dtype, max_rank, reader, clock
        self.max_loras, self.max_cpu_loras = max_loras, max(max_cpu_loras, max_loras)
        self.in_use = in_use  # name -> whether a live request still uses it (unregistered ones linger until not)
        self.known: dict[str, AdapterInfo] = {}
        self.retired: dict[str, tuple] = {}  # unregistered: (info, when), kept while requests use it or for the grace
        self.host: OrderedDict[str, dict] = OrderedDict()  # LRU: oldest first
        self.slots = slots or LoRASlots(mc, max_loras, dtype)  # given: a tensor-parallel rank 0's (sharded) slots
        self.slot_names: list[str | None] = [None] * max_loras
        self.slot_tick = [0] * max_loras
        self.pins = [0] * max_loras
        self.loading: dict[str, Future] = {}
        self.failed: dict[str, str] = {}  # name -> why its read failed (drained by the engine)
        self.warm: set = set()  # prefetched adapters that go into a free slot once read
        self._tick = 0
        self._pool: ThreadPoolExecutor | None = None
        self.loads = self.slot_loads = self.hits = self.misses = 0
        self.load_s = 0.0
        self.load_seconds: list[float] = []  # per read, drained by the worker's metrics
        self._lock = threading.Lock()  # guards load_seconds (read from another thread by metrics)

    # ---- the catalogue ------------------------------------------------------------------------

    def register(self, name: str, path: str) -> AdapterInfo:
        info = inspect_adapter(name, path, self.mc, self.max_rank)
        old = self.known.get(name)
        if old is not None:
            if Path(old.path).resolve() == Path(info.path).resolve():
                return old  # loading the same folder twice is a no-op
            raise InvalidRequest(f"adapter {name!r} is already loaded from {old.path}; unload it first")
        if self.max_loras == 0:
            raise InvalidRequest(f"adapter {name!r}: this engine has no LoRA slots (max_loras 0)")
        retired = self.retired.pop(name, None)
        gone = retired[0] if retired else None
        if gone is not None and Path(gone.path).resolve() != Path(info.path).resolve():
            if self.in_use(name):
                self.retired[name] = retired
                raise InvalidRequest(f"adapter {name!r} is being unloaded and still serves accepted requests; load "
                                     f"it from {info.path} once they finish")
            self._drop(name)
        self.slots.ensure(info.rank)
        self.known[name] = info
        return info

    def unregister(self, name: str) -> None:
        """It is no longer listed (the gateway refuses new requests for it); requests already in the mesh (here, or
        on their way: a decode after its prefill) still run with it for RETIRE_GRACE_S, or while they last."""
        info = self.known.pop(name, None)
        if info is None:
            raise NotFound(f"adapter {name!r} is not loaded")
        self.retired[name] = (info, self.clock())

    def forget(self, name: str) -> None:
        """Unregister at once (its read failed: the folder is broken or gone)."""
        self.known.pop(name, None)
        self.retired.pop(name, None)

    def serves(self, name: str) -> bool:
        return name in self.known or name in self.retired

    def info(self, name: str) -> AdapterInfo | None:
        retired = self.retired.get(name)
        return self.known.get(name) or (retired[0] if retired else None)

    def _drop(self, name: str) -> None:
        self.host.pop(name, None)
        for s, held in enumerate(self.slot_names):
            if held == name and not self.pins[s]:
                self.slots.clear(s)
                self.slot_names[s] = None

    # ---- residency ----------------------------------------------------------------------------

    def slot_of(self, name: str) -> int | None:
        try:
            return self.slot_names.index(name)
        except ValueError:
            return None

    def claim(self, name: str) -> int | None:
        """A pinned slot holding the adapter, or None: its weights are still being read (started now if
        not yet), or every slot is pinned by other adapters."""
        slot = self.slot_of(name)
        if slot is not None:
            self.hits += 1
            return self._pin(slot)
        weights = self.host.get(name)
        if weights is None:
            if name not in self.loading:
                self.misses += 1
            self.prefetch(name)
            return None
        free = [s for s, n in enumerate(self.slot_names) if n is None]
        victims = free or sorted((s for s in range(self.max_loras) if not self.pins[s]), key=self.slot_tick.__getitem__)
        if not victims:
            return None
        slot = victims[0]
        self.slots.write(slot, weights)
        self.slot_names[slot] = name
        self.host.move_to_end(name)
        self.slot_loads += 1
        return self._pin(slot)

    def _pin(self, slot: int) -> int:
        self.pins[slot] += 1
        self._tick += 1
        self.slot_tick[slot] = self._tick
        return slot

    def release(self, slot: int) -> None:
        self.pins[slot] -= 1

    def sweep(self) -> None:
        """Drop unregistered adapters past their grace that no live request uses any more."""
        now = self.clock()
        for name in [n for n, (_, t) in self.retired.items() if now - t >= self.RETIRE_GRACE_S and not self.in_use(n)]:
            self.retired.pop(name)
            self._drop(name)

    def prefetch(self, name: str, warm: bool = False) -> bool:
        """Start reading a known adapter into host memory (no-op when there or on its way); False if unknown.
        warm: then put it into a free slot too (never evicting one)."""
        info = self.info(name)
        if info is None:
            return False
        if warm:
            self.warm.add(name)
        if name in self.host or name in self.loading:
            self._warm_up()
            return True
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self.loading[name] = self._pool.submit(self._read, info)
        return True

    def _read(self, info: AdapterInfo) -> tuple[dict, float]:
        t0 = time.perf_counter()
        weights = self.reader(info, self.dtype)
        return weights, time.perf_counter() - t0

    def poll(self) -> None:
        """Join finished reads into host memory (evicting its least recently used adapters not in a pinned slot)."""
        if self.retired:
            self.sweep()
        for name, fut in list(self.loading.items()):
            if not fut.done():
                continue
            del self.loading[name]
            try:
                weights, seconds = fut.result()
            except Exception as e:
                log.error("adapter %r: reading %s failed: %s", name, self.info(name).path if self.info(name) else "?",
                          e)
                self.failed[name] = f"adapter {name!r} could not be read: {e}"
                continue
            if self.info(name) is None:
                continue  # unloaded while it was read
            self.loads += 1
            self.load_s += seconds
            with self._lock:
                self.load_seconds.append(seconds)
            self.host[name] = weights
            self._trim_host()
        self._warm_up()

    def _warm_up(self) -> None:
        """Prefetched adapters in host memory take free slots (least recently used order is unchanged)."""
        for name in [n for n in self.warm if n in self.host]:
            self.warm.discard(name)
            free = [s for s, n in enumerate(self.slot_names) if n is None]
            if free and self.slot_of(name) is None:
                self.slots.write(free[0], self.host[name])
                self.slot_names[free[0]] = name
                self.slot_loads += 1

    def _trim_host(self) -> None:
        pinned = {self.slot_names[s] for s in range(self.max_loras) if self.pins[s]}
        for name in list(self.host):
            if len(self.host) <= self.max_cpu_loras:
                break
            if name not in pinned:
                del self.host[name]

    def wait(self, timeout: float) -> None:
        """Block until a read finishes or timeout passes (for a step with nothing else to do)."""
        if self.loading:
            wait(list(self.loading.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def drain_load_seconds(self) -> list[float]:
        with self._lock:
            out, self.load_seconds = self.load_seconds, []
        return out

    def snapshot(self) -> LoRASnapshot:
        return LoRASnapshot(tuple(n for n in self.slot_names if n), tuple(self.host), tuple(sorted(self.known)),
                            sum(n is None for n in self.slot_names),
                            tuple(n for s, n in enumerate(self.slot_names) if n and self.pins[s]), self.max_loras,
                            self.max_cpu_loras, self.loads,
                            self.load_s, self.slot_loads, self.hits, self.misses)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
