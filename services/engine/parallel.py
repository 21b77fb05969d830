"""Tensor parallelism: one engine over N ranks, each a process holding a shard of every layer.

Rank 0 is the engine (services.engine.engine.LLMEngine: scheduler, KV manager, prefix cache, sampler, grammars,
LoRA residency); ranks 1..N-1 (rank_main) hold only weights, their KV heads and their LoRA slots, and run every
step rank 0 sends them. The split is Megatron's: q/k/v and gate/up by output columns (each rank its attention heads
and a slice of the MLP), o and down by input columns, so each rank's o and down give partial sums that one
all-reduce per projection adds (two per layer); embeddings and norms are whole on every rank, the LM head is split
by vocabulary rows and each rank's logits slice is gathered to rank 0, which alone samples.

Heads are split by KV head: rank r holds KV heads [lo, hi) and the query heads that read them, so attention needs
nothing from another rank. The split may be uneven: SmolLM2-135M has 3 KV heads (9 query heads), so at N=2
rank 0 holds two and rank 1 one (vLLM refuses a head count its world size does not divide; we take the imbalance,
which only touches attention: the MLP's 1536 columns split evenly). N may not exceed the KV heads. Giving the rank
with fewer heads more MLP columns, to even out each rank's weights per layer, measured worse: the all-reduce after
o and the one after down are barriers, so the attention half and the MLP half of a layer each wait for their own
slower rank, and the shift made the MLP half uneven too (SmolLM2 bfloat16, TPOT 21.1 against 19.7 ms).

The KV pool is sharded by head the same way, in memory every rank maps (a memfd of rank 0, opened by the others
through /proc): a rank computes and attends over its own heads only, while rank 0 reads and writes whole blocks
(all heads, the layout of one rank) for KV export, import and the mesh's pool, so a TP=2 prefill worker hands off
to a TP=1 decode worker and back.

The all-reduce on one host is shared memory (csrc/allreduce.cpp: each rank posts its partial sums and adds every
rank's in rank order, so all ranks get the same bits); `gloo` (torch.distributed over TCP) is the alternative, the
one that could span hosts (a worker starts its ranks as its own processes, so a group is on one host). A rank that
dies is noticed by the others inside their next all-reduce, which raises; rank 0's engine then fails and the worker
(one replica: one servicer, N ranks) goes down as one. The ranks die with rank 0 (parent-death signal).

Each step rank 0 sends the batch's layout (token ids, positions, each sequence's block table, LoRA segments) down a
pipe per rank before it builds its own metadata; each rank builds the same attention metadata from it.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import pickle
import signal
import time
import weakref
from dataclasses import dataclass
from functools import cache

import torch

from services.common.errors import ModelLoadError, RankDied
from services.common.host import free_port
from services.config.engine import EngineConfig, ModelConfig
from services.engine.layers.attention import SeqLayout
from services.engine.lora import LoRABatch
from services.engine.models import build_model
from services.engine.models.llama import LM_HEAD_SHARD

log = logging.getLogger("meshserve.parallel")

BACKENDS = ("shm", "gloo")
READY_TIMEOUT_S = 600.0  # a rank loads the weights and maps its shard in this long, or the start fails


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `world` holds: KV heads [kv[0], kv[1]), query heads [heads[0], heads[1]), MLP columns
    [inter[0], inter[1]), LM head rows (vocabulary) [vocab[0], vocab[1])."""

    rank: int
    world: int
    kv: tuple
    heads: tuple
    inter: tuple
    vocab: tuple

    @property
    def num_kv_heads(self) -> int:
        return self.kv[1] - self.kv[0]


def _split(n: int, world: int) -> list[tuple]:
    """[lo, hi) ranges of n items over world parts, as even as possible, larger parts first."""
    bounds, lo = [], 0
    for r in range(world):
        hi = lo + n // world + (r < n % world)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def plan_shards(mc: ModelConfig, world: int) -> list[Shard]:
    """Each rank's part: whole KV heads and their query heads where the ranks are at most the KV heads; with more
    ranks than KV heads (a small model's one or two), each KV head is replicated on world / num_kv_heads ranks, which
    split its query heads between them (as vLLM does), so each rank holds one KV head."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    group = mc.num_heads // mc.num_kv_heads
    if world <= mc.num_kv_heads:
        kv = _split(mc.num_kv_heads, world)
        heads = [(k[0] * group, k[1] * group) for k in kv]
    else:
        copies = world // mc.num_kv_heads
        if world % mc.num_kv_heads or group % copies:
            raise ValueError(f"tensor_parallel_size {world} exceeds the model's {mc.num_kv_heads} KV heads and cannot "
                             f"replicate them: it must be a multiple of the KV heads ({mc.num_kv_heads}) whose "
                             f"{group} query heads each split evenly over the copies")
        per = group // copies
        heads = [(r * per, (r + 1) * per) for r in range(world)]
        kv = [(r // copies, r // copies + 1) for r in range(world)]
    return [Shard(r, world, k, h, inter, vocab)
            for r, (k, h, inter, vocab) in enumerate(zip(kv, heads, _split(mc.intermediate_size, world),
                                                         _split(mc.vocab_size, world)))]


def local_config(mc: ModelConfig, shard: Shard) -> ModelConfig:
    """The model one rank computes: its heads and MLP columns (widths elsewhere unchanged)."""
    return dataclasses.replace(mc, num_heads=shard.heads[1] - shard.heads[0], num_kv_heads=shard.num_kv_heads,
                               intermediate_size=shard.inter[1] - shard.inter[0])


def _ranges(mc: ModelConfig, shard: Shard) -> tuple[dict, dict]:
    """The rank's [lo, hi) of each projection: by output features (column-parallel: q, k, v, gate, up) and by input
    features (row-parallel: o, down)."""
    d = mc.head_dim
    heads, kv = (shard.heads[0] * d, shard.heads[1] * d), (shard.kv[0] * d, shard.kv[1] * d)
    return ({"q_proj": heads, "k_proj": kv, "v_proj": kv, "gate_proj": shard.inter, "up_proj": shard.inter},
            {"o_proj": heads, "down_proj": shard.inter})


def shard_weights(weights: dict, mc: ModelConfig, shard: Shard) -> dict:
    """A rank's part of a Hugging Face Llama state dict (names unchanged). Row-parallel biases (o, down) stay on
    rank 0 only (zeros elsewhere), so the all-reduce adds each once."""
    rows, cols = _ranges(mc, shard)
    out = {}
    for name, w in weights.items():
        parts = name.split(".")
        proj = parts[-2] if len(parts) >= 2 else ""
        if not isinstance(w, torch.Tensor) and (proj in rows or proj in cols):
            raise ModelLoadError(f"tensor parallelism shards float weights; {name} is {type(w).__name__} "
                                 f"(run it with quantization none)")
        if proj in rows:
            lo, hi = rows[proj]
            out[name] = w[lo:hi].contiguous()
        elif proj in cols and parts[-1] == "weight":
            lo, hi = cols[proj]
            out[name] = w[:, lo:hi].contiguous()
        elif proj in cols:  # the bias of a row-parallel projection
            out[name] = w if shard.rank == 0 else torch.zeros_like(w)
        elif name != "lm_head.weight":
            out[name] = w
    head = weights["model.embed_tokens.weight" if mc.tie_embeddings else "lm_head.weight"]
    out[LM_HEAD_SHARD] = head[shard.vocab[0]:shard.vocab[1]].contiguous()
    return out



def shard_adapter(weights: dict, mc: ModelConfig, shard: Shard) -> dict:
    """A rank's part of a LoRA adapter's weights {(layer, target): (A [r, in], B [r, out])}: column-parallel
    targets keep A and their columns of B; row-parallel ones (o, down) their columns of A and all of B, so each
    rank's delta is a partial sum the all-reduce completes with the base projection's."""
    out_cols, in_cols = _ranges(mc, shard)
    out = {}
    for (layer, target), (a, b) in weights.items():
        if target in out_cols:
            lo, hi = out_cols[target]
            b = b[:, lo:hi].contiguous()
        else:
            lo, hi = in_cols[target]
            a = a[:, lo:hi].contiguous()
        out[(layer, target)] = (a, b)
    return out


# ---- shared memory --------------------------------------------------------------------------------------------


class SharedMemory:
    """Bytes every rank of the group maps: a memfd of rank 0 (freed with the last process that maps it: nothing is
    left in /dev/shm when a rank is killed), opened by the others through /proc/<rank 0>/fd."""

    def __init__(self, nbytes: int, name: str, path: str | None = None):
        self.nbytes = nbytes
        if path is None:
            self.fd = os.memfd_create(f"meshserve-tp-{name}", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, nbytes)
            self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        else:
            self.fd, self.path = os.open(path, os.O_RDWR | os.O_CLOEXEC), path
        self.map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)

    def close(self) -> None:
        os.close(self.fd)


def kv_shard_bytes(mc: ModelConfig, shard: Shard, num_blocks: int, block_size: int, dtype: torch.dtype) -> int:
    return 2 * mc.num_layers * num_blocks * block_size * shard.num_kv_heads * mc.head_dim * dtype.itemsize


def kv_views(memory: SharedMemory, mc: ModelConfig, shards: list[Shard], num_blocks: int, block_size: int,
             dtype: torch.dtype) -> list[torch.Tensor]:
    """Each rank's KV shard in the shared pool: [layers, 2, num_blocks * block_size, its KV heads, head_dim]."""
    views, offset = [], 0
    for s in shards:
        n = kv_shard_bytes(mc, s, num_blocks, block_size, dtype)
        views.append(memory.bytes[offset:offset + n].view(dtype).view(
            mc.num_layers, 2, num_blocks * block_size, s.num_kv_heads, mc.head_dim))
        offset += n
    return views


# ---- all-reduce -----------------------------------------------------------------------------------------------


@cache
def allreduce_kernel():
    from services.engine.layers.kernels import allreduce

    return allreduce()


ALLREDUCE_HEADER = 4096  # csrc/allreduce.cpp's HEADER


def allreduce_region_bytes(world: int, cap: int) -> int:
    return ALLREDUCE_HEADER + world * 2 * cap


class ShmCollectives:
    """The group's collectives through shared memory (module doc; csrc/allreduce.cpp): the in-place all-reduce of
    o and down, and the gather of the logits' vocabulary slices to rank 0."""

    def __init__(self, region: SharedMemory, rank: int, world: int, cap: int, widths: list[int]):
        self.kernel = allreduce_kernel()
        if self.kernel is None:
            raise RuntimeError("the shared-memory all-reduce kernel did not build (see the log); use "
                               "tensor_parallel_backend gloo")
        self.region, self.rank, self.world, self.cap, self.widths = region, rank, world, cap, widths
        self.seq = 0
        self.spent_s = 0.0  # time inside collectives (waiting for the slowest rank included)
        self.calls = 0
        self.kernel.join(region.bytes, rank, os.getpid())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            self.seq = self.kernel.all_reduce_(x, self.region.bytes, self.rank, self.world, self.seq + 1, self.cap)
        except RuntimeError as e:
            raise RankDied(str(e)) from None
        self.spent_s += time.perf_counter() - t0
        self.calls += 1
        return x

    def gather_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the whole logits [rows, vocab] from every rank's slice; None on the other ranks."""
        t0 = time.perf_counter()
        out = x.new_empty((x.shape[0], sum(self.widths))) if self.rank == 0 else x.new_empty(0)
        try:
            self.seq = self.kernel.gather_columns_(x.contiguous(), out, self.region.bytes, self.rank, self.world,
                                                   self.seq + 1, self.cap, self.widths)
        except RuntimeError as e:
            raise RankDied(str(e)) from None
        self.spent_s += time.perf_counter() - t0
        self.calls += 1
        return out if self.rank == 0 else None


class GlooCollectives:
    """The same through torch.distributed's gloo backend (TCP: the path that also spans hosts)."""

    def __init__(self, address: str, rank: int, world: int, widths: list[int], timeout_s: float = 120.0):
        import datetime

        import torch.distributed as dist

        self.dist, self.rank, self.widths = dist, rank, widths
        dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.spent_s = 0.0
        self.calls = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            self.dist.all_reduce(x)
        except RuntimeError as e:  # a peer's connection closed: it is gone
            raise RankDied(f"tensor-parallel all-reduce failed: {e}") from None
        self.spent_s += time.perf_counter() - t0
        self.calls += 1
        return x

    def gather_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [x.new_empty((x.shape[0], w)) for w in self.widths] if self.rank == 0 else None
        try:
            self.dist.gather(x, parts, dst=0)
        except RuntimeError as e:
            raise RankDied(f"tensor-parallel gather failed: {e}") from None
        self.spent_s += time.perf_counter() - t0
        self.calls += 1
        return torch.cat(parts, dim=1) if self.rank == 0 else None

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def make_collectives(shards: list[Shard], rank: int, gloo_address: str, region: SharedMemory | None, cap: int):
    widths = [s.vocab[1] - s.vocab[0] for s in shards]
    if gloo_address:
        return GlooCollectives(gloo_address, rank, len(shards), widths)
    return ShmCollectives(region, rank, len(shards), cap, widths)


# ---- the group, from rank 0 -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankSetup:
    """What a rank needs to join (pickled to it at spawn)."""

    rank: int
    config: EngineConfig
    num_blocks: int
    allreduce_path: str
    allreduce_cap: int
    kv_path: str
    kv_bytes: int
    gloo_address: str
    parent_pid: int


class TensorParallelGroup:
    """Rank 0's side of the group: the shared memory, the other ranks' processes and the pipes to them."""

    def __init__(self, config: EngineConfig, mc: ModelConfig, num_blocks: int):
        """Map the shared memory and start ranks 1..N-1 loading; await_ready() joins them."""
        import multiprocessing

        world, sc = config.tensor_parallel_size, config.scheduler
        if config.tensor_parallel_backend not in BACKENDS:
            raise ValueError(f"tensor_parallel_backend must be one of {BACKENDS}, got "
                             f"{config.tensor_parallel_backend!r}")
        dtype = getattr(torch, config.dtype)
        self.world, self.mc, self.num_blocks, self.backend = world, mc, num_blocks, config.tensor_parallel_backend
        self.shards = plan_shards(mc, world)
        self.shard = self.shards[0]
        block_size = config.cache.block_size
        kv_bytes = sum(kv_shard_bytes(mc, s, num_blocks, block_size, dtype) for s in self.shards)
        self.kv_memory = SharedMemory(kv_bytes, "kv")
        self.kv_shards = kv_views(self.kv_memory, mc, self.shards, num_blocks, block_size, dtype)
        cap = min(sc.max_num_batched_tokens * mc.hidden_size * 4, 16 << 20)
        cap = -(-cap // 4096) * 4096
        self.region, self.cap = SharedMemory(allreduce_region_bytes(world, cap), "allreduce"), cap
        self.gloo = gloo = f"127.0.0.1:{free_port()}" if config.tensor_parallel_backend == "gloo" else ""
        ctx = multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            setup = RankSetup(rank, config, num_blocks, self.region.path, cap, self.kv_memory.path, kv_bytes, gloo,
                              os.getpid())
            proc = ctx.Process(target=rank_main, args=(child, setup), daemon=True, name=f"meshserve-tp-rank{rank}")
            _start_child(proc)
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop, list(self.procs), list(self.conns))
        self.collectives = None

    @property
    def pids(self) -> list[int]:
        return [os.getpid()] + [p.pid for p in self.procs]

    def await_ready(self) -> None:
        """Wait until every rank has loaded its shard and joined the all-reduce; raise what went wrong."""
        try:
            self.collectives = make_collectives(self.shards, 0, self.gloo, self.region, self.cap)
        except Exception:
            self.close()
            raise
        self._await_ranks()
        log.info("tensor parallel: %d ranks (%s all-reduce), KV heads %s, pids %s", self.world, self.backend,
                 [s.kv for s in self.shards], self.pids)

    def _await_ranks(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.1):
                if not proc.is_alive():
                    self.close()
                    raise RankDied(f"tensor-parallel rank {rank} exited ({proc.exitcode}) while starting")
                if time.monotonic() > deadline:
                    self.close()
                    raise RankDied(f"tensor-parallel rank {rank} did not start in {READY_TIMEOUT_S:.0f} s")
            kind, detail = conn.recv()
            if kind != "ready":
                self.close()
                raise ModelLoadError(f"tensor-parallel rank {rank}: {detail}")

    def send(self, msg: tuple) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, ConnectionResetError, OSError) as e:
                raise RankDied(f"tensor-parallel rank {rank} is gone ({e})") from None

    def step(self, ids: list, positions: list, layouts: list, logits_index: list, segments: list | None) -> None:
        """The batch of the step rank 0 is about to run; every rank runs its part of it."""
        self.send(("step", ids, positions, [(s.num_computed, s.num_new, s.block_table) for s in layouts],
                   logits_index, segments))

    def mirror_lora(self, op: str, *args) -> None:
        """A change to the LoRA slots (ensure, write, clear), made on every rank in the same order as the steps."""
        self.send(("lora", op, args))

    def close(self) -> None:
        self._finalizer()


def _start_child(proc) -> None:
    """Start a rank from this process even where it is itself a daemonic multiprocessing child (a worker's engine
    core is): multiprocessing refuses that because a daemon's children would outlive it, but a rank dies with its
    parent by the parent-death signal it arms first (rank_main), and close() or the finalizer stops it before."""
    import multiprocessing

    me = multiprocessing.current_process()
    daemon = me._config.get("daemon")
    me._config["daemon"] = False
    try:
        proc.start()
    finally:
        if daemon is not None:
            me._config["daemon"] = daemon


def _stop(procs: list, conns: list) -> None:
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("stop",)))
        except OSError:
            pass
        conn.close()
    for proc in procs:
        proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)


# ---- ranks 1..N-1 -----------------------------------------------------------------------------------------------


def rank_main(conn, setup: RankSetup) -> None:
    """Entry point of rank setup.rank (multiprocessing spawn): load its shard, then run rank 0's steps until the
    pipe closes. Any failure ends the process, which the other ranks notice in their next all-reduce."""
    from services.common.die_with_parent import arm

    if not arm(setup.parent_pid):
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{setup.rank} %(levelname)s %(message)s")
    config = setup.config
    torch.set_num_threads(config.num_threads or 1)
    try:
        rank = _Rank(setup)
    except Exception as e:  # noqa: BLE001 - told to rank 0, which fails its start with it
        log.exception("rank %d failed to start", setup.rank)
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    try:
        while True:
            msg = pickle.loads(conn.recv_bytes())
            if msg[0] == "stop":
                break
            rank.handle(msg)
    except EOFError:
        pass  # rank 0 is gone
    except Exception:
        log.exception("rank %d failed", setup.rank)
        os._exit(1)  # the other ranks see it in their next all-reduce
    finally:
        rank.close()


class _Rank:
    """One non-zero rank: its shard of the model, its KV heads (views of the shared pool) and its LoRA slots."""

    def __init__(self, setup: RankSetup):
        from services.engine.layers.attention import KVCache, TorchAttention
        from services.engine.layers.kernels import lora as lora_kernel
        from services.engine.layers.kernels import paged_attention
        from services.engine.loader import load_model
        from services.engine.lora import LoRASlots

        config = setup.config
        loaded = load_model(config.model_dir, config.dtype, "none")
        mc = loaded.config
        shards = plan_shards(mc, config.tensor_parallel_size)
        shard = shards[setup.rank]
        self.model = build_model(local_config(mc, shard), shard_weights(loaded.weights, mc, shard))
        dtype = self.model.dtype
        self.kv_memory = SharedMemory(setup.kv_bytes, "kv", setup.kv_path)
        views = kv_views(self.kv_memory, mc, shards, setup.num_blocks, config.cache.block_size, dtype)
        self.kv_cache = KVCache.over(views[setup.rank], config.cache.block_size)
        kernel = paged_attention() if dtype in (torch.float32, torch.bfloat16) else None
        lc = local_config(mc, shard)
        self.attention = TorchAttention.for_model(lc, config.cache.block_size, kernel, dtype)
        self.slots = LoRASlots(lc, config.lora.max_loras, dtype,
                               shard=lambda w: shard_adapter(w, mc, shard)) if config.lora.max_loras else None
        self.lora_kernel = lora_kernel() if self.slots is not None else None
        region = None if setup.gloo_address else SharedMemory(
            allreduce_region_bytes(len(shards), setup.allreduce_cap), "allreduce", setup.allreduce_path)
        self.collectives = make_collectives(shards, setup.rank, setup.gloo_address, region, setup.allreduce_cap)
        self.model.tp = self.collectives

    def handle(self, msg: tuple) -> None:
        if msg[0] == "step":
            _, ids, positions, layouts, logits_index, segments = msg
            meta = self.attention.build_metadata([SeqLayout(*s) for s in layouts])
            lora = LoRABatch(self.slots, segments, self.lora_kernel or None) if segments else None
            self.model.forward(torch.tensor(ids), torch.tensor(positions), self.attention, meta, self.kv_cache,
                               torch.tensor(logits_index, dtype=torch.long), lora)
        elif msg[0] == "lora":
            _, op, args = msg
            getattr(self.slots, op)(*args)
        else:
            raise ValueError(f"unknown message {msg[0]!r}")

    def close(self) -> None:
        if isinstance(self.collectives, GlooCollectives):
            self.collectives.close()
