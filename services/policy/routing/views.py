"""What the router knows of a worker and of a prompt, as plain data for the pure policies.

A worker's load is the utilisation of its tightest resource, whichever is fullest:
- KV: outstanding tokens (remaining prefill + expected decode, from the last heartbeat, plus
  what was routed since: the in-flight correction) over the token capacity of its KV pool;
- compute: the same tokens times its decode step at a small fixed batch (decode_s_floor, the
  engine's fit) over the fastest candidate's, over the largest candidate KV pool, when every
  candidate has reported a step: a worker half as fast counts its tokens twice. Speed and KV
  size are separate limits (multiplying them counted a half-size, half-speed worker as a
  quarter and starved it), and speed is a fitted step, not a measured throughput (which grows
  with the batch a worker happens to run: the busier worker looked faster and drew more);
- slots: requests it holds (running + waiting, plus those routed since its last heartbeat) over
  the sequences it batches at once (max_num_seqs), when it reports that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common import host


@dataclass
class WorkerView:
    worker_id: str  # unique id (role-port unless told otherwise)
    address: str  # host:port
    role: str  # prefill | decode | unified
    outstanding_tokens: int = 0  # from the last heartbeat
    capacity_tokens: int = 1  # KV pool token capacity
    routed_since_beat: int = 0  # tokens routed to it since its last heartbeat (in-flight correction)
    routed_requests: int = 0  # requests routed to it since its last heartbeat
    routed_adapters: set = field(default_factory=set)  # LoRA adapters routed to it since its last heartbeat
    running: int = 0  # requests in its batch, from the last heartbeat
    waiting: int = 0  # requests queued in its engine
    last_seen_s: float = 0.0  # clock of the last heartbeat
    block_size: int = 16  # KV block size (for hashing prompts)
    index_member: str = ""  # its member in the Redis prefix index ("" = not publishing)
    decode_tps: float = 0.0  # measured decode throughput (0 = unknown)
    adapters: tuple = ()  # LoRA adapters in its compute slots
    host_adapters: tuple = ()  # LoRA adapters in its host memory (slot ones included)
    known_adapters: tuple = ()  # every adapter registered there (what it can serve)
    pinned_adapters: tuple = ()  # slot adapters its running requests pin
    lora_slots: int = 0  # compute slots (0 = no LoRA)
    free_lora_slots: int = 0  # slots holding no adapter
    max_num_seqs: int = 0  # sequences it batches at once (0 = not reported)
    prefill_s_per_token: float = 0.0  # its fitted step costs (0 = not yet known)
    decode_s_per_step: float = 0.0
    decode_s_floor: float = 0.0  # its decode step at deadline-aware batching's smallest batch (0 = not known)
    host: str = ""  # its host identity (the kvstore pool of that host serves it)
    kv_pool: bool = False  # it takes prompts' blocks from the pool
    topology: str = ""  # rack/node/domain (services.common.host.topology; "" = unknown)
    tensor_parallel_size: int = 1  # ranks of its engine (one replica, one group)
    cores: int = 0  # cores its ranks use (0 = not reported)
    max_num_batched_tokens: int = 0  # prompt tokens a step takes at most (0 = not reported)
    longest_step_s: float = 0.0  # its longest recent step (services.policy.progress; 0 = none yet)

    @property
    def tokens(self) -> int:
        return self.outstanding_tokens + self.routed_since_beat


def charge(worker: WorkerView, cost: int, adapter: str = "") -> None:
    """The in-flight correction of one routed request, until the worker's next heartbeat."""
    worker.routed_since_beat += cost
    worker.routed_requests += 1
    if adapter:
        worker.routed_adapters.add(adapter)


def loads(workers: list[WorkerView]) -> list[float]:
    """Each worker's load (see the module docstring): the fuller of its token and slot utilisation."""
    fastest = min((w.decode_s_floor for w in workers), default=0.0)
    largest = max((max(w.capacity_tokens, 1) for w in workers), default=1)
    out = []
    for w in workers:
        kv = w.tokens / max(w.capacity_tokens, 1)
        compute = w.tokens * (w.decode_s_floor / fastest) / largest if fastest > 0 else 0.0
        slots = (w.running + w.waiting + w.routed_requests) / w.max_num_seqs if w.max_num_seqs > 0 else 0.0
        out.append(max(kv, compute, slots))
    return out


@dataclass(frozen=True)
class RouteContext:
    prompt_blocks: int = 0  # full blocks of the prompt that a cache could serve
    cached_blocks: dict = field(default_factory=dict)  # worker_id -> longest cached prefix, in blocks
    adapter: str = ""  # the request's LoRA adapter ("" = base model)
    pooled_blocks: dict = field(default_factory=dict)  # worker_id -> longest prefix its host's KV pool holds
    homes: frozenset = frozenset()  # worker ids that placement homed the adapter on (empty: none planned)
    near: str = ""  # where the request's KV comes from (the prefill worker's topology, for a decode pick):
    #                 equally good workers closer to it go first (services.common.host.distance)


class Why:
    """Why a policy picked a worker, formatted only when read (str()): the router sends it with every decision,
    the simulator, which routes millions of requests, never reads it."""

    __slots__ = ("_format", "_args")

    def __init__(self, fmt, *args):
        self._format, self._args = fmt, args

    def __str__(self) -> str:
        return self._format(*self._args)


def closeness(worker: WorkerView, ctx: RouteContext | None) -> int:
    """The tie-break between equally good workers: distance to ctx.near (0 when there is nothing to be near)."""
    return host.distance(worker.topology, ctx.near) if ctx is not None and ctx.near else 0
