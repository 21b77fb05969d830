"""A simulated worker: the engine's real scheduler, KV cache manager and block pool, with step times from the
cost model instead of a forward pass.

Every step is the real Scheduler's decision (slot arbitration and preemption, chunked prefill, prefix-cache
reuse, deadline-aware batch caps, LoRA slot pinning when adapters are on), applied to the real KVCacheManager
over a real BlockPool; the step's duration is the cost model's (sim/cost.py) for what the step carries. The
engine's own online fit (services.engine.step_cost.StepCostFit) learns from the simulated steps, as it does
from real ones, and feeds the deadline-aware batch cap.

Leaps: when a step carries only decodes and the next steps would be the same decision (nobody waiting who
could join, no deadline cap, no slot arbitration at play), the worker runs up to the first finish in one event
of k steps, with the cost of each step summed in closed form; an arrival during a leap cuts it short at the end
of the step in progress, where a real engine would let the newcomer in. The scheduler's state after a leap is
what k single steps leave (the same tokens, blocks and charges). A leap never crosses a finish, so finish
times are exact; token times inside a leap are exact too (the leap keeps its step boundaries).

Batching "request" (the static-batching baseline): a new batch forms only when the last one has drained.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from services.common.sampling import SamplingParams
from services.engine.block_pool import BlockPool
from services.engine.kv_manager import KVCacheManager
from services.engine.lora_residency import AdapterResidency, EmptySlots
from services.engine.request import Request, Status
from services.engine.scheduler import Scheduler
from services.engine.step_cost import StepCostFit
from services.policy.arbitration import make_arbitration_policy

OUTPUT_TOKEN = 7  # the token every simulated step samples (content never matters, lengths do)
MAX_LEAP = 512  # steps in one leap at most


@dataclass
class WorkerSpec:
    role: str = "unified"  # unified | prefill | decode
    num_blocks: int = 4096
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    slot_policy: str = "fcfs"
    prefix_caching: bool = True
    deadline_min_batch: int = 4
    batching: str = "iteration"  # iteration | request
    speed: float = 1.0  # step times are divided by this (a faster or slower instance)
    max_loras: int = 0  # LoRA compute slots (0: adapters are only routing keys, no residency is modelled)
    max_cpu_loras: int = 32  # adapters held in host memory (slot ones included)


@dataclass(eq=False)
class SimRequest:
    """One request's life in the simulation (times on the simulation clock)."""

    trace: object  # sim.trace.TraceRequest
    seq_no: int
    weight: float = 1.0
    arrival_s: float = 0.0
    dispatched_s: float | None = None
    first_s: float | None = None
    last_s: float | None = None
    tokens_out: int = 0
    cached_tokens: int = 0
    error: str = ""  # the gRPC status it ended with ("" = completed)
    workers: list = field(default_factory=list)  # worker ids that served it
    cell: int | None = None  # the router (cell) the gateway gave it
    pending: object = None  # its admission queue entry (services.policy.admission_queue.Pending)
    gateway: object = None  # the gateway replica that admitted it (sim.cluster.Gateway)
    hashes: list = field(default_factory=list)  # its prompt's block hashes, when the KV pool wants them
    ended: bool = False  # completed or failed (the client has its answer)
    credit: str | None = None  # the serving worker whose credit (batch slot) its gateway used to send it there

    @property
    def deadline_s(self) -> float | None:
        d = self.trace.deadline_ms
        return None if d is None else self.arrival_s + d / 1e3


class SimReads:
    """A simulated worker's adapter loader (the engine's one loader thread): each read takes the step-time model's
    lora_read_s (at the worker's speed) after the one before it, then kicks the worker."""

    def __init__(self, worker):
        self.worker, self.free_at = worker, 0.0

    def submit(self, fn, *args) -> Future:
        w = self.worker
        start = max(w.cluster.now, self.free_at)
        self.free_at = end = start + w.cost.lora_read_s / w.spec.speed
        fut = Future()

        def done():
            fut.set_result((fn(*args)[0], end - start))
            w.kick()

        w.cluster.at(end, done)
        return fut


class SimWorker:
    def __init__(self, cluster, worker_id: str, spec: WorkerSpec, cost, track_events: bool = True):
        self.cluster, self.id, self.spec, self.cost = cluster, worker_id, spec, cost
        self.role = spec.role
        self.pool = BlockPool(spec.num_blocks)
        if track_events:  # for the prefix index (only a prefix-aware router reads it)
            self.pool.track_events()
        self.kv = KVCacheManager(self.pool, spec.block_size, spec.prefix_caching)
        self.fit = StepCostFit()
        # LoRA: the engine's own residency over slots that hold nothing, reads taking modelled time (SimReads)
        self.lora = AdapterResidency(spec.max_loras, spec.max_cpu_loras, EmptySlots(), cluster.adapter_info,
                                     lambda info: {}, clock=lambda: cluster.now,
                                     executor=SimReads(self)) if spec.max_loras else None
        self.sched = Scheduler(self.kv, make_arbitration_policy(spec.slot_policy), spec.max_num_seqs,
                               spec.max_num_batched_tokens, clock=lambda: cluster.now, step_cost=self.fit,
                               lora=self.lora, deadline_min_batch=spec.deadline_min_batch)
        self.sims: dict[str, SimRequest] = {}  # req_id -> its SimRequest
        self.held: list[Request] = []  # request-level batching: waiting for the batch to drain
        self.imports: list = []  # (Request, SimRequest) whose KV arrived, waiting for blocks
        self.step = None  # the step (or leap) in flight: dict
        self.version = 0
        self.busy_s = 0.0
        self.seq_s = 0.0  # sequences x seconds of the steps run (batch occupancy = seq_s / (max_num_seqs x time))
        self.steps = 0
        self.alive = True
        self.started_s = 0.0
        self.retired_s = None
        self.router = None  # its cell's router (the cluster's)
        self.changes = 0  # kicks so far: what outstanding_tokens' cache is keyed on
        self._outstanding = (-1, 0)
        self._seq = 0
        self.aborted: list[str] = []  # requests whose calls were cancelled during the step in flight
        self.max_holding = 0  # the most requests it held at once (running, waiting, arriving)
        self.register_adapters(cluster.adapters)

    def register_adapters(self, names) -> None:
        """The trace's adapters, registered here (as a worker's config lists them); no-op without LoRA slots."""
        if self.lora is not None:
            for name in names:
                self.lora.register(name, name)

    # ---- load, as a heartbeat reports it ----------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.spec.num_blocks * self.spec.block_size

    def outstanding_tokens(self) -> int:
        """Tokens still to compute for the requests it holds (what its heartbeat reports). Cached until kick()
        next runs: every change to what the worker holds (a request in, a step done) ends in a kick."""
        if self._outstanding[0] == self.changes:
            return self._outstanding[1]
        n = self.sched.waiting_tokens  # kept by the scheduler: a waiting request's part is fixed while it waits
        # The scheduler's _remaining, (tokens - computed) + (max_tokens - outputs), summed in one expression: here
        # neither part is ever below zero (a finished request leaves at once), so the sum is prompt + max_tokens -
        # computed.
        n += sum(len(r.prompt_token_ids) + r.params.max_tokens - r.num_computed for r in self.sched.running)
        n += sum(len(r.prompt_token_ids) + r.params.max_tokens - r.num_computed for r in self.held)
        self._outstanding = (self.changes, n)
        return n

    @property
    def holding(self) -> int:
        return len(self.sched.running) + len(self.sched.waiting) + len(self.held) + len(self.imports)

    def fits(self, prompt_tokens: int, max_tokens: int) -> bool:
        return prompt_tokens + max_tokens <= self.capacity_tokens

    # ---- requests in ----------------------------------------------------------------------------------------

    def add(self, sim: SimRequest, tokens: list, max_tokens: int, pooled: list = (), hashes: list = ()) -> None:
        """A request to compute from its prompt (unified or prefill role); `pooled`: the hashes of its leading
        blocks fetched from the KV pool, which join this worker's prefix cache first; `hashes`: its full blocks'
        hashes when the router computed them already (the same chained hashes the KV manager would compute)."""
        t = sim.trace
        if sim.ended:
            return  # its deadline passed on the way here
        if pooled:
            self._import_pooled(pooled)
        req = Request(t.id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_s=self.cluster.now,
                      seq_no=self._next_seq(), priority=t.priority, adapter=t.adapter, tenant=t.tenant,
                      weight=sim.weight, deadline_s=sim.deadline_s)
        self.sims[req.req_id] = sim
        sim.workers.append(self.id)
        self.max_holding = max(self.max_holding, self.holding + 1)
        if hashes and self.spec.prefix_caching and not req.adapter:
            self.kv.hashes[req.req_id] = list(hashes)
        if self.spec.batching == "request":
            self.held.append(req)
        else:
            self.sched.add(req)
        self.kick()

    def _import_pooled(self, hashes: list) -> None:
        """Blocks from the pool become cached blocks here, as the engine's import from the pool leaves them."""
        for h in hashes:
            if self.pool.lookup(h) is not None:
                continue
            got = self.pool.allocate(1) if self.pool.num_available > 0 else None
            if got is None:
                return
            self.pool.register(got[0], h)
            self.pool.release(got)

    def add_import(self, sim: SimRequest, tokens: list, max_tokens: int) -> None:
        """A request whose prompt KV (and first token) arrived from a prefill worker (decode role)."""
        t = sim.trace
        if sim.ended:
            return
        req = Request(t.id, tokens[:t.prompt_tokens], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      arrival_s=self.cluster.now, seq_no=self._next_seq(), tenant=t.tenant, weight=sim.weight,
                      deadline_s=sim.deadline_s)
        req.tokens = list(tokens)
        self.sims[req.req_id] = sim
        sim.workers.append(self.id)
        self.imports.append(req)
        if self._take_imports() and self.step is not None and self.step["k"] > 1:
            self._cut_leap()  # it joins the batch at the end of the step in progress
        self.kick()

    def _take_imports(self) -> int:
        """Imports join the running batch while a slot and their blocks are to be had; returns how many did."""
        taken = 0
        while self.imports:
            req = self.imports[0]
            if len(self.sched.running) >= self.spec.max_num_seqs or not self.kv.allocate(req, req.num_tokens - 1):
                break
            self.imports.pop(0)
            req.num_computed, req.status = req.num_tokens - 1, Status.RUNNING
            self.kv.commit(req)
            self.sched.add_running(req)
            taken += 1
        return taken

    def abort(self, sim: SimRequest) -> None:
        """sim's call was cancelled (its deadline passed): the engine drops the request at the end of the step in
        progress (at once if none is), freeing its blocks; what that step makes of it goes nowhere."""
        rid = sim.trace.id
        if self.sims.pop(rid, None) is None:
            return
        if self.step is None:
            self._drop(rid)
            self.kick()
            return
        self.aborted.append(rid)
        if self.step["k"] > 1:
            self._cut_leap()

    def _drop(self, rid: str) -> None:
        self.held = [r for r in self.held if r.req_id != rid]
        self.imports = [r for r in self.imports if r.req_id != rid]
        req = next((r for r in (*self.sched.running, *self.sched.waiting) if r.req_id == rid), None)
        if req is not None:
            self.sched.finish(req, "abort")

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ---- stepping -------------------------------------------------------------------------------------------

    def kick(self) -> None:
        """Start a step if none is in flight and there is work; cut a leap short if work arrived."""
        self.changes += 1
        if not self.alive:
            return
        if self.step is not None:
            if self.step["k"] > 1 and self._could_join():
                self._cut_leap()
            return
        if self.spec.batching == "request" and not self.sched.has_work and self.held:
            for req in self.held[:self.spec.max_num_seqs]:
                self.sched.add(req)
            del self.held[:self.spec.max_num_seqs]
        if not self.sched.has_work:
            return
        lora, slot_loads = self.lora, 0
        if lora is not None:
            slot_loads = lora.slot_loads
            lora.poll()  # join finished reads (read-ahead ones go into free slots)
        out = self.sched.schedule()
        if out.empty:
            if lora is None or not lora.loading:  # else waiting on a read, whose end kicks again
                self._unservable()
            return
        now = self.cluster.now
        seqs = len(out.seqs)
        context = sum(s.num_computed for s in out.seqs)
        prefill = out.num_tokens - seqs
        prefill_context = sum(s.num_new * s.num_computed for s in out.seqs if s.num_new > 1) if prefill else 0
        k = self._leap_steps(out)
        slow = self.cluster.contention(self) / self.spec.speed
        # Step i of the leap ends at start + a (i + 1) + b i (i + 1) / 2: each decode step costs b more than the one
        # before (its sequences' context grew by one token each), so a leap's times come in closed form.
        if k == 1:
            copies = (lora.slot_loads - slot_loads) * self.cost.lora_slot_s if lora is not None else 0.0
            a, b = (self.cost.step_s(seqs, prefill, context, prefill_context) + copies) * slow, 0.0
        else:
            a, b = self.cost.step_s(seqs, 0, context) * slow, self.cost.per_context_s * seqs * slow
        self.version += 1
        self.step = {"out": out, "k": k, "start": now, "a": a, "b": b, "version": self.version, "slow": slow}
        self.cluster.at(_end(self.step, k - 1), self._step_done, self.version)

    def _could_join(self) -> bool:
        """Could work that just arrived change the next step? (Not when every slot is taken under FCFS.)"""
        s = self.sched
        return len(s.running) < s.max_num_seqs or s.policy.name != "fcfs"

    def _leap_steps(self, out) -> int:
        """How many identical decode steps to run as one (1 = a single step; the module docstring)."""
        s = self.sched
        if (len(out.seqs) < 1 or out.preempted or out.num_tokens != len(out.seqs) or s.policy.uses_deadlines
                or (s.waiting and len(s.running) < s.max_num_seqs) or s.lora is not None):
            return 1
        if s.waiting and s.policy.name != "fcfs":
            return 1  # the fair policies may hand a slot over at any step
        if any(not seq.sample for seq in out.seqs) or len(out.seqs) != len(s.running):
            return 1
        k = min(MAX_LEAP, min(r.params.max_tokens - r.num_output for r in s.running))
        if k <= 1:
            return 1
        # Blocks the next k-1 steps need beyond this one's, which schedule() already allocated.
        bs = self.kv.block_size
        need = sum(-(-(r.num_computed + k) // bs) - -(-(r.num_computed + 1) // bs) for r in s.running)
        while k > 1 and need > self.pool.num_available:
            k //= 2
            need = sum(-(-(r.num_computed + k) // bs) - -(-(r.num_computed + 1) // bs) for r in s.running)
        return k

    def _cut_leap(self) -> None:
        step, now = self.step, self.cluster.now
        lo, hi = 0, step["k"] - 1  # the step in progress: the first whose end is not before now
        while lo < hi:
            mid = (lo + hi) // 2
            if _end(step, mid) >= now:
                hi = mid
            else:
                lo = mid + 1
        if lo + 1 >= step["k"]:
            return
        step["k"] = lo + 1
        self.version += 1
        step["version"] = self.version
        self.cluster.at(_end(step, lo), self._step_done, self.version)

    def _step_done(self, version: int) -> None:
        if version != self.version or self.step is None:
            return  # superseded (a cut leap) or the worker went away
        step, self.step = self.step, None
        out, k = step["out"], step["k"]
        first, last = _end(step, 0), _end(step, k - 1)
        self.busy_s += last - step["start"]
        self.seq_s += len(out.seqs) * (last - step["start"])
        self.steps += k
        seqs = len(out.seqs)
        slow = step["slow"] * self.spec.speed  # the contention alone: the fit learns this worker's own step times
        # What the engine's fit learns: the first step's time, and a leap's decode steps as one mean sample (k
        # samples of the same step would only weigh it k times over).
        self.fit.update(seqs, out.num_tokens, (first - step["start"]) / slow)
        if k > 1:
            self.fit.update(seqs, seqs, (last - first) / (k - 1) / slow)
        if k == 1:
            self.sched.update(out)
        else:  # k decode steps: what k calls of update() and the engine's appends leave
            kv = self.kv
            for s in out.seqs:
                req = s.request
                req.num_computed = s.num_computed + k
                kv.allocate(req, req.num_computed)
        finished = []
        charge = self.sched.policy.charge if self.sched.policy.name != "fcfs" else None
        on_tokens = self.cluster.on_tokens
        for s in out.seqs:
            req = s.request
            if not s.sample:
                continue
            req.tokens.extend([OUTPUT_TOKEN] * k)
            if k > 1:
                self.kv.commit(req)
            if charge is not None:
                charge(req.tenant, req.weight, output_tokens=k)
            on_tokens(self, self.sims.get(req.req_id), first, last, k)
            if len(req.tokens) - req.num_prompt >= req.params.max_tokens:
                finished.append(req)
        for req in finished:
            self.sched.finish(req, "length")
            sim = self.sims.pop(req.req_id, None)
            self.cluster.on_finished(self, sim, req)
        for rid in self.aborted:
            self._drop(rid)
        self.aborted.clear()
        self._take_imports()
        self.cluster.worker_idle_changed(self)
        self.kick()

    def _unservable(self) -> None:
        """Nothing could be scheduled with nothing running: the waiting requests cannot fit (the real engine
        rejects these at add: OUT_OF_RANGE)."""
        for req in list(self.sched.waiting):
            if not self.sched.running:
                self.sched.finish(req, "abort")
                sim = self.sims.pop(req.req_id, None)
                self.cluster.on_failed(self, sim, "OUT_OF_RANGE")


def _end(step: dict, i: int) -> float:
    """When step i of a step or leap in flight ends (0 = its first)."""
    return step["start"] + step["a"] * (i + 1) + step["b"] * i * (i + 1) / 2
