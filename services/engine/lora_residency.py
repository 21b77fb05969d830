"""Which LoRA adapters an engine holds where: the three tiers of lora.py's module doc (known, host memory, compute
slots), with no tensors in it. The slots, the validation of a folder and the read of its weights are given
(services.engine.lora's for the model engine; the mock engine and the simulator give their own: a modelled read
time, slots that hold nothing), so the same residency decides admissions, evictions and reads everywhere.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InvalidRequest, NotFound

log = logging.getLogger("meshserve.lora")


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
UNSUPPORTED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights", "modules_to_save": "modules_to_save",
               "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)"}


@dataclass(frozen=True)
class AdapterConfig:
    """A PEFT folder's adapter_config.json, validated."""

    folder: Path
    rank: int
    alpha: float
    scale: float  # alpha / rank, or alpha / sqrt(rank) (rslora)
    listed: tuple | None  # target_modules as listed (None: not a list, e.g. "all-linear")


def adapter_error(name: str, folder, why: str) -> InvalidRequest:
    return InvalidRequest(f"adapter {name!r} ({folder}): {why}")


def read_adapter_config(name: str, path, max_rank: int) -> AdapterConfig:
    """The folder's adapter config, validated (InvalidRequest naming the adapter and what is wrong); no weight is
    read (services.engine.lora.inspect_adapter checks the weights' header against the base model)."""
    if not name or len(name.encode()) > 256 or any(c.isspace() for c in name):
        raise InvalidRequest(f"adapter name {name!r}: must be 1-256 bytes without whitespace")
    folder = Path(path)

    def bad(why: str):
        return adapter_error(name, folder, why)

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
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterConfig(folder, rank, float(alpha), scale, tuple(listed) if isinstance(listed, list) else None)


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str  # the PEFT folder
    rank: int
    alpha: float
    scale: float  # applied to B at load: alpha / rank, or alpha / sqrt(rank) (rslora)
    targets: tuple  # the target modules it adapts, in TARGETS order
    nbytes: int  # its weights' size in memory


class EmptySlots:
    """LoRA compute slots that hold nothing: the mock engine and the simulator model where
    adapters are, not their weights."""

    def ensure(self, rank: int) -> None:
        pass

    def write(self, slot: int, weights) -> None:
        pass

    def clear(self, slot: int) -> None:
        pass


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

    def __init__(self, max_loras: int, max_cpu_loras: int, slots, inspect, reader, in_use=lambda name: False,
                 clock=time.monotonic, executor=None):
        """slots: the compute slots (ensure(rank), write(slot, weights), clear(slot)); inspect(name, path) ->
        AdapterInfo, raising InvalidRequest for a bad adapter; reader(info) -> its weights (on the executor);
        executor: where reads run (submit(fn, *args) -> Future; default one loader thread)."""
        self.inspect, self.reader, self.clock = inspect, reader, clock
        self.max_loras, self.max_cpu_loras = max_loras, max(max_cpu_loras, max_loras)
        self.in_use = in_use  # name -> whether a live request still uses it (unregistered ones linger until not)
        self.known: dict[str, AdapterInfo] = {}
        self.retired: dict[str, tuple] = {}  # unregistered: (info, when), kept while requests use it or for the grace
        self.host: OrderedDict[str, dict] = OrderedDict()  # LRU: oldest first
        self.slots = slots
        self.slot_names: list[str | None] = [None] * max_loras
        self.slot_tick = [0] * max_loras
        self.pins = [0] * max_loras
        self.loading: dict[str, Future] = {}
        self.failed: dict[str, str] = {}  # name -> why its read failed (drained by the engine)
        self.warm: set = set()  # prefetched adapters that go into a free slot once read
        self._tick = 0
        self._pool = executor
        self._own_pool = executor is None
        self.loads = self.slot_loads = self.hits = self.misses = 0
        self.load_s = 0.0
        self.load_seconds: list[float] = []  # per read, drained by the worker's metrics
        self._lock = threading.Lock()  # guards load_seconds (read from another thread by metrics)

    # ---- the catalogue ------------------------------------------------------------------------

    def register(self, name: str, path: str) -> AdapterInfo:
        info = self.inspect(name, path)
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
        weights = self.reader(info)
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
        if self._pool is not None and self._own_pool:
            self._pool.shutdown(wait=False, cancel_futures=True)
