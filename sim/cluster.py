"""The simulated cluster: gateway, routers, workers, KV links and the autoscaler as discrete events.

What runs is the services' own decision code, imported unchanged:
- gateway admission: the gateway's I/O-free core (services.policy.admission_core: tenants' limits, the
  AdmissionQueue with its arbitration policy, the admission CostModel, room on the mesh, the under-share
  bypass); the simulator supplies only its capacity (the gateway's share of the slots, the polled KV view);
- routing: the router's I/O-free core (services.policy.routing.pick: the filters, the prefix context, the policies
  by name with their scorers, load guard and in-flight charge, RecentRoutes for prefixes just routed) on
  views.WorkerView refreshed by heartbeats every heartbeat_s, so decisions see state as stale as the real
  router's; tests/unit/test_parity.py drives both sides with one trace and compares the decisions; with
  ClusterSpec.credits, the gateway's credits (a request goes only to a serving worker with a free batch slot; the
  router avoids the others) as each worker's slots less the requests sent there and not ended;
- each worker: sim.worker (the engine's Scheduler, KVCacheManager, BlockPool, StepCostFit);
- the autoscaler: services.policy.scaling (TokenPolicy, CpuPolicy, RatePolicy) deciding every interval_s
  on PoolSamples built as its signals build them; new workers take startup_s before they serve, drained
  ones finish what they hold and leave.

Time: a single clock; events in a heap ordered by (time, sequence number), so equal times keep their insertion
order and a run is a pure function of its inputs: the same spec and trace give the same result, byte for byte.
Hops: a request reaches its worker hop_s/2 after dispatch and its tokens reach the client hop_s/2 after the
step that made them (the cost model's measured hop time); where workers share cores, the hop's processes share
them too, and a hop takes as much longer as a step would (hop()). KV transfers (disaggregated): the prefill worker's
link to the kvstore and the decode worker's link from it, each FIFO at kv_link_gbytes_per_s.
Cells: with cell_size > 0 each router serves cell_size workers and the gateway spreads requests over the
routers in turn (as several routers each own a shard of a large pool); 0 = one router for every worker.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from services.common.block_hash import extra_keys, hash_blocks
from services.common.errors import MeshError
from services.common.members import POOL_MEMBER
from services.engine.lora_residency import TARGETS, AdapterInfo
from services.policy.admission_core import AdmissionCore, MeshView
from services.policy.admission_queue import reported
from services.policy.routing.adapter_placement import AdapterPlacement
from services.policy.routing.filters import Need
from services.policy.routing.pick import Prompt, RouteDecider
from services.policy.routing.policies import make_routing_policy
from services.policy.routing.recent import RecentRoutes
from services.policy.routing.views import WorkerView
from services.policy.tenants import Tenant
from sim.cost import CostModel
from sim.worker import SimRequest, SimWorker, WorkerSpec

GATEWAY_POLL_S = 0.25  # how often a gateway reads the router's view of the workers (their step-cost fits)
REPORTS_FROM = 32  # serving workers whose fits a gateway's cost model hears of at most (their median is what counts)
PLACE_EVERY_S = 1.0  # a router's LoRA placement round (services/router/__main__.py place_loop)
HOST_WINDOW_S = 1.0  # the window of the request and token rates the mesh's own CPU follows (_HostLoad)


@dataclass
class AutoscaleSpec:
    policy: str = "token"  # token | cpu | rate (services.policy.scaling), fixed = no scaling
    interval_s: float = 5.0
    startup_s: float = 120.0
    min_replicas: int = 1
    max_replicas: int = 64
    ttft_slo_s: float = 1.0
    itl_slo_s: float = 0.2
    prefill_tokens_per_s: float = 2000.0  # one replica's, as measured (PoolConfig)
    decode_tokens_per_s: float = 500.0
    target_util: float = 0.7
    cooldown_s: float = 60.0
    down_window_s: float = 120.0
    window_s: float = 60.0
    requests_per_s_per_replica: float = 4.0  # the rate baseline's
    target_cpu: float = 0.7  # the CPU baseline's


@dataclass
class ClusterSpec:
    mode: str = "unified"  # unified | disaggregated
    workers: int = 1  # unified workers, or decode workers when disaggregated
    prefill: int = 0  # prefill workers (disaggregated)
    worker: WorkerSpec = field(default_factory=WorkerSpec)
    prefill_worker: WorkerSpec | None = None  # default: worker's, role prefill
    worker_speeds: tuple = ()  # heterogeneous workers: the k-th of a role in each cell runs at worker.speed x
    #                            speeds[k % len] (with one cell: the i-th worker, speeds[i % len])
    routing: str = "least-outstanding"
    routing_config: dict = field(default_factory=dict)
    admission: str = "fcfs"  # the gateway's queue policy; "none": no queue, straight to routing (workers queue)
    queue_bursts: bool = True  # the gateway's admission.queue_bursts (services.policy.admission_queue)
    share_preemption: bool = False  # the gateway's admission.share_preemption (services.policy.admission_core)
    starvation_s: float = 30.0
    tenant_weights: dict = field(default_factory=dict)  # tenant -> weight (default 1)
    heartbeat_s: float = 1.0
    gateway_poll_s: float = GATEWAY_POLL_S  # how often each gateway reads the router's view (a mock mesh slowed by
    #                                         a time scale polls every 0.25 s of real time: 0.25 / scale mock seconds)
    cell_size: int = 0
    gateways: int = 1  # gateway replicas, each with its own admission queue and an even share of the slots
    autoscale: AutoscaleSpec | None = None
    kv_pool: bool = False  # workers take prompts' blocks from their cell's KV pool and push what they compute there
    kv_pool_blocks: int = 1 << 18  # a pool's capacity in blocks (least recently used go first)
    ttft_slo_ms: float | None = None  # for attainment and goodput
    tpot_slo_ms: float | None = None
    slo_grid: list = field(default_factory=list)  # [ttft_ms, tpot_ms] pairs: attainment and goodput at each too
    credits: bool = False  # the gateway's credits: route only to serving workers with a free batch slot (below)
    lora_placement: bool = True  # routing.lora_placement: each router homes adapters by demand once a second (with
    #                              workers that model LoRA residency: WorkerSpec.max_loras)


class Cluster:
    def __init__(self, spec: ClusterSpec, cost: CostModel, worker_ids: dict | None = None):
        """worker_ids: role -> the ids its workers take (default: role-0, role-1, ...)."""
        self.spec, self.cost = spec, cost
        self.now = 0.0
        self.events: list = []
        self._seq = 0
        self.processed = 0
        self.workers: list[SimWorker] = []
        self.by_id: dict[str, SimWorker] = {}
        self.views: dict[str, WorkerView] = {}
        self.beat_at: dict[str, float] = {}
        self.link_free: dict[str, float] = {}
        self.index: dict[bytes, set] = {}  # block hash -> worker ids holding it (the prefix index)
        self.done: list[SimRequest] = []
        self.live: dict[str, int] = {}  # serving worker -> requests sent there against its credits, not ended
        self.adapters: tuple = ()  # the trace's LoRA adapters (run() sets them)
        self.known_adapters: frozenset = frozenset()  # the same, as the views hold them
        self._adapter_infos: dict = {}
        self.timeline: list[tuple[float, int, int]] = []  # (t, serving workers, starting workers)
        if spec.gateways < 1:
            raise ValueError(f"gateways must be >= 1, got {spec.gateways}")
        self.gateways = [Gateway(self) for _ in range(spec.gateways)]
        self.routers: list = []
        self._turn = 0
        self.starting = 0
        self.draining: set = set()
        self.window = _Window()
        self._reported = (-1, ((), (), ()))
        self.host = _HostLoad(cost) if cost.cores and (cost.host_cpu_s_per_s or cost.host_cpu_s_per_request
                                                       or cost.host_cpu_s_per_token) else None
        prefill_spec = spec.prefill_worker or replace(spec.worker, role="prefill")
        ids = worker_ids or {}
        if spec.mode == "disaggregated":
            groups = [("prefill", spec.prefill, prefill_spec), ("decode", spec.workers, spec.worker)]
        elif spec.mode == "unified":
            groups = [("unified", spec.workers, spec.worker)]
        else:
            raise ValueError(f"unknown mode {spec.mode!r}; known: unified, disaggregated")
        for role, n, wspec in groups:
            # Cells are dealt worker i to cell i mod cells: the k-th worker of every cell (i // cells) takes speed k,
            # so each cell has the same mix of speeds (dealt i mod len, cells of 16 would each be of one speed).
            cells = math.ceil(n / spec.cell_size) if spec.cell_size else 1
            for i, wid in enumerate(ids.get(role) or [f"{role}-{i}" for i in range(n)]):
                speeds = spec.worker_speeds
                speed = wspec.speed * (speeds[(i // cells) % len(speeds)] if speeds else 1)
                self._add_worker(replace(wspec, role=role, speed=speed), wid)
        self._mark_timeline()

    # ---- the event loop ---------------------------------------------------------------------------------------

    def at(self, t: float, fn, *args) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, fn, args))

    def run(self, trace: list, until: float | None = None) -> None:
        """Serve the trace (sorted by arrival) to the end, or until a time. Arrivals are scheduled one ahead, so the
        event heap holds what is in flight, not the whole trace."""
        self.trace, self.arrived = trace, 0
        self.adapters = tuple(sorted({t.adapter for t in trace if t.adapter}))  # registered on every worker
        self.known_adapters = frozenset(self.adapters)
        for v in self.views.values():
            v.known_adapters = self.known_adapters
        for w in self.workers:
            w.register_adapters(self.adapters)
        if self.adapters and self.spec.lora_placement and any(w.lora is not None for w in self.workers):
            for router in self.routers:
                router["placement"] = AdapterPlacement()
            self.at(PLACE_EVERY_S, self._place)
        if trace:
            self._schedule_arrival()
        if self.spec.autoscale is not None:
            self.scaler = _Scaler(self, self.spec.autoscale)
            self.at(0.0, self.scaler.tick)
        events = self.events
        while events:
            t, _, fn, args = heapq.heappop(events)
            if until is not None and t > until:
                break
            self.now = t
            self.processed += 1
            fn(*args)

    # ---- workers ----------------------------------------------------------------------------------------------

    def _add_worker(self, spec: WorkerSpec, worker_id: str) -> SimWorker:
        w = SimWorker(self, worker_id, spec, self.cost, track_events=self._uses_index())
        w.started_s = self.now
        self.workers.append(w)
        self.by_id[worker_id] = w
        self.views[worker_id] = WorkerView(worker_id, worker_id, spec.role, capacity_tokens=w.capacity_tokens,
                                           block_size=spec.block_size, max_num_seqs=spec.max_num_seqs,
                                           index_member=worker_id, known_adapters=self.known_adapters)
        self.beat_at[worker_id] = -math.inf
        self._assign_cells()
        return w

    def _uses_index(self) -> bool:
        return make_routing_policy(self.spec.routing, self.spec.routing_config).uses_prefix

    def _assign_cells(self) -> None:
        """Deal the serving workers to routers; called whenever the serving set changes (added, draining,
        retired), which is also when the cached serving list and gateway slot count are refreshed."""
        size = self.spec.cell_size
        serving = self._serving = [w for w in self.workers if w.alive and w.id not in self.draining]
        self._slot_count = sum(w.spec.max_num_seqs for w in serving if w.role != "prefill")
        if not size:
            cells = [serving]
        else:
            by_role: dict[str, list] = {}
            for w in serving:
                by_role.setdefault(w.role, []).append(w)
            n = max(1, max(math.ceil(len(ws) / size) for ws in by_role.values()))
            cells = [[] for _ in range(n)]
            for ws in by_role.values():
                for i, w in enumerate(ws):
                    cells[i % n].append(w)
        while len(self.routers) < len(cells):
            self.routers.append({"pickers": {}, "recent": RecentRoutes(lambda: self.now), "pool": KVPool(
                self.spec.kv_pool_blocks), "name": f"cell-{len(self.routers)}"})
        del self.routers[len(cells):]
        for router, cell in zip(self.routers, cells):
            router["workers"], router["roles"] = cell, {}
            for w in cell:
                w.router = router
                self.views[w.id].host, self.views[w.id].kv_pool = router["name"], self.spec.kv_pool

    def worker_stats(self) -> list[dict]:
        return [{"id": w.id, "started_s": w.started_s, "retired_s": w.retired_s if not w.alive else None,
                 "busy_s": w.busy_s, "seq_s": w.seq_s, "steps": w.steps, "max_num_seqs": w.spec.max_num_seqs,
                 "slot_preemptions": w.sched.slot_preemptions, "max_holding": w.max_holding,
                 **({"lora": {"lora_reads": w.lora.loads, "lora_slot_loads": w.lora.slot_loads,
                              "lora_hits": w.lora.hits, "lora_misses": w.lora.misses}} if w.lora is not None else {})}
                for w in self.workers]

    def contention(self, worker: SimWorker) -> float:
        """How much slower a step runs because other workers step on the same cores (processor sharing)."""
        if not self.cost.cores:
            return 1.0
        return self._sharing(sum(1 for w in self.workers if w.step is not None and w is not worker) + 1)

    def hop(self) -> float:
        """Half the hop time (each way), stretched where workers share cores by the sharing a step started now would
        see: the gateway, router and servicer processes that pass a request on wait for a core as a step does."""
        half = self.cost.hop_s / 2
        if not self.cost.cores:
            return half
        return half * self._sharing(sum(1 for w in self.workers if w.step is not None))

    def _sharing(self, busy: int) -> float:
        """busy workers and the rest of the mesh's load on the workers' cores: how much slower each runs."""
        load = busy + (self.host.cores(self.now) if self.host is not None else 0.0)
        return max(1.0, load / self.cost.cores)

    def worker_idle_changed(self, worker: SimWorker) -> None:
        if worker.id in self.draining and not worker.holding and worker.step is None:
            self._retire(worker)

    def reported_costs(self) -> tuple:
        """(version, reports): the workers' step-cost fits as the gateways' cost models hear them from the router's
        view (prefill from the roles that prefill, decode and its floor from those that decode), which heartbeats
        refresh every heartbeat_s, from at most REPORTS_FROM serving workers: each term's median (admission.reported),
        taken once for every gateway (CostModel.update of a median alone updates alike)."""
        version = int(self.now // self.spec.heartbeat_s)
        if version != self._reported[0]:
            ws = self._serving[:REPORTS_FROM]
            prefill = [w.fit.prefill_s_per_token for w in ws if w.role != "decode"]
            decoders = [w for w in ws if w.role != "prefill"]
            floors = [w.fit.step_s(w.spec.deadline_min_batch) if w.fit.decode_s_per_step else 0.0 for w in decoders]
            self._reported = (version, tuple(map(reported, (prefill, [w.fit.decode_s_per_step for w in decoders],
                                                            floors))))
        return self._reported

    def serving(self, role: str | None = None) -> list[SimWorker]:
        return self._serving if role is None else [w for w in self._serving if w.role == role]

    # ---- the gateway ------------------------------------------------------------------------------------------

    def _schedule_arrival(self) -> None:
        i = self.arrived
        t = self.trace[i]
        sim = SimRequest(t, i, weight=float(self.spec.tenant_weights.get(t.tenant, 1.0)), arrival_s=t.arrival_s)
        self.at(t.arrival_s, self._arrive, sim)

    @property
    def arrivals_left(self) -> int:
        return len(self.trace) - self.arrived

    def _arrive(self, sim: SimRequest) -> None:
        self.arrived += 1
        if self.arrived < len(self.trace):
            self._schedule_arrival()
        self.window.arrived(sim.trace)
        self.window.pending += 1
        if self.host is not None:
            self.host.add(self.now, requests=1)
        sim.gateway = self.gateways[sim.seq_no % len(self.gateways)]  # a load balancer's round robin
        sim.gateway.arrive(sim)

    def _release(self, sim: SimRequest) -> None:
        sim.gateway.release(sim)

    def _pump(self) -> None:
        for g in self.gateways:
            g.pump()

    def _end(self, sim: SimRequest, error: str = "") -> None:
        sim.error, sim.ended = error, True
        if sim.credit is not None:  # its slot is free again: the worker grants the credit anew
            self.live[sim.credit] -= 1
            sim.credit = None
        self.done.append(sim)
        self.window.pending -= 1

    # ---- routing ----------------------------------------------------------------------------------------------

    def _router(self, sim: SimRequest) -> dict:
        """The request's cell: the gateway takes the routers in turn, per request (a request's prefill and decode
        picks stay in one cell)."""
        if sim.cell is None:
            sim.cell = self._turn
            self._turn += 1
        return self.routers[sim.cell % len(self.routers)]

    def _view(self, w: SimWorker) -> WorkerView:
        """The router's view of w: refreshed when a heartbeat is due (every heartbeat_s from the last)."""
        v = self.views[w.id]
        due = self.beat_at[w.id] + self.spec.heartbeat_s
        if self.now >= due:
            self.beat_at[w.id] = self.now if due == -math.inf else due + (self.now - due) // self.spec.heartbeat_s * \
                self.spec.heartbeat_s
            v.outstanding_tokens, v.running, v.waiting = w.outstanding_tokens(), len(w.sched.running), \
                len(w.sched.waiting) + len(w.held) + len(w.imports)
            v.routed_since_beat = v.routed_requests = 0
            v.routed_adapters = set()
            v.prefill_s_per_token, v.decode_s_per_step = w.fit.prefill_s_per_token, w.fit.decode_s_per_step
            v.decode_s_floor = w.fit.step_s(w.spec.deadline_min_batch) if w.fit.decode_s_per_step else 0.0
            if w.lora is not None:  # what a worker's heartbeat says of its adapters (services/worker/server.py)
                lr = w.lora
                v.adapters, v.host_adapters = tuple(n for n in lr.slot_names if n), tuple(lr.host)
                v.pinned_adapters = tuple(n for i, n in enumerate(lr.slot_names) if n and lr.pins[i])
                v.lora_slots, v.free_lora_slots = lr.max_loras, lr.slot_names.count(None)
        if w.pool.events:
            self._publish(w)  # the real workers publish every 50 ms: as good as at once here
        return v

    def _publish(self, w: SimWorker) -> None:
        events, overflowed = w.pool.drain_events()
        if overflowed:
            for holders in self.index.values():
                holders.discard(w.id)
            events = [("stored", h) for h in w.pool.hashes()]
        for kind, h in events:
            if kind == "stored":
                self.index.setdefault(h, set()).add(w.id)
            else:
                holders = self.index.get(h)
                if holders is not None:
                    holders.discard(w.id)
                    if not holders:
                        del self.index[h]

    def _longest(self, hashes: list, ids: set) -> dict:
        held: dict[str, int] = {}
        live = ids
        for i, h in enumerate(hashes):
            live = live & self.index.get(h, set())
            if not live:
                break
            for wid in live:
                held[wid] = i + 1
        return held

    def _pick(self, role: str, sim: SimRequest, cost: int, tokens: list | None, after: WorkerView | None = None):
        """(worker, its prompt's block hashes when computed, the leading blocks to fetch from the pool), decided by
        the router's own core (services.policy.routing.pick) on the cell's heartbeat-stale views; after: the prefill
        worker's view, for the decode pick that takes its KV (its block size and topology)."""
        router = self._router(sim)
        roles = router["roles"]
        if role not in roles:
            roles[role] = _of_role(router["workers"], role)  # kept until the cells change
        workers, by_id = roles[role]
        if not workers:
            workers, by_id = _of_role(self._serving, role)
        picker = router["pickers"].get(role)
        if picker is None:
            seeded = {"seed": router["name"], **self.spec.routing_config}  # power-of-two draws: one stream a cell
            picker = router["pickers"][role] = RouteDecider(role, make_routing_policy(self.spec.routing, seeded),
                                                          router["recent"])
        adapter = sim.trace.adapter
        # Credits (services/policy/credit_ledger.py): a gateway sends a request only to a serving worker that
        # granted it a credit, one per free batch slot, and asks the router to avoid the others (when every one is
        # avoided the router ignores it). Modelled as the worker's slots less the requests sent there and not ended
        # (exact with one gateway; with several, each sees every free slot of a worker, not its own share). Opt-in
        # (ClusterSpec.credits) until every claim is rerun against the mock mesh with it: docs/CLUSTER.md.
        credited = self.spec.credits and role != "prefill" and self.spec.admission != "none"
        avoid = frozenset(w.id for w in workers if self.live.get(w.id, 0) >= w.spec.max_num_seqs) if credited \
            else frozenset()
        views, _ = picker.candidates([self._view(w) for w in workers],
                                     Need(role, after.block_size if after else 0, adapter, avoid))
        if not views:
            return None, [], 0
        hashes, found, pooled = [], {}, 0
        if (picker.wants_prompt or self.spec.kv_pool) and role != "decode" and tokens is not None:
            hashes = hash_blocks(tokens, views[0].block_size, extra_keys(adapter, ""))
            found = self._longest(hashes, set(by_id))
            pooled = router["pool"].longest(hashes) if self.spec.kv_pool else 0
        prompt = None
        if hashes and picker.wants_prompt:  # routed by all but the prompt's last token, as the gateway hashes it
            route = hashes[:(len(tokens) - 1) // views[0].block_size]  # (services.common.block_hash.prompt_hashes)
            held = {w: min(n, len(route)) for w, n in found.items()}
            if pooled:
                held[f"{POOL_MEMBER}{router['name']}#0"] = min(pooled, len(route))
            prompt = Prompt(route, held)
        placement, homes = router.get("placement"), frozenset()
        if placement is not None:  # the router observes every routed request; homes steer the adapter scorer
            placement.observe(adapter, self.now)
            homes = placement.home(role, adapter) if adapter else homes
        view = picker.pick(views, cost, adapter, prompt, homes=homes, near=after.topology if after else "").worker
        if credited and sim.credit is None:
            self.live[view.worker_id] = self.live.get(view.worker_id, 0) + 1
            sim.credit = view.worker_id
        fetch = pooled if pooled > found.get(view.worker_id, 0) else 0
        if hashes and view.block_size != views[0].block_size:
            hashes, fetch = [], 0  # hashed at another block size: nothing to reuse there
        return by_id[view.worker_id], hashes, fetch

    def adapter_info(self, name: str, path: str) -> AdapterInfo:
        """A trace adapter as a worker's residency registers it (one object shared by every worker)."""
        info = self._adapter_infos.get(name)
        if info is None:
            info = self._adapter_infos[name] = AdapterInfo(name, path, 16, 16.0, 1.0, TARGETS, 0)
        return info

    def _place(self) -> None:
        """One round of each router's LoRA placement (services/router/server.py place()): prefetch orders to the
        workers, which read the adapter into memory and a free slot."""
        for router in self.routers:
            placement = router.get("placement")
            if placement is None:
                continue
            views = [self._view(w) for w in router["workers"]]
            for role in {v.role for v in views}:
                for view, adapter in placement.plan([v for v in views if v.role == role], self.now):
                    w = self.by_id[view.worker_id]
                    if w.lora is not None and w.alive:
                        w.lora.prefetch(adapter, warm=True)
                        w.kick()
        if self.window.pending > 0 or self.arrivals_left > 0:
            self.at(self.now + PLACE_EVERY_S, self._place)

    def _expire(self, sim: SimRequest) -> None:
        """sim's deadline passed while dispatched: the gateway's call ends with DEADLINE_EXCEEDED (a deadline bounds
        every hop) and the worker holding it, if any, drops it."""
        if sim.ended:
            return
        if sim.workers:
            self.by_id[sim.workers[-1]].abort(sim)
        self._fail(sim, "DEADLINE_EXCEEDED")

    def _route_first(self, sim: SimRequest) -> None:
        t = sim.trace
        if sim.ended:
            return
        tokens = t.tokens()
        role, max_tokens = ("unified", t.output_tokens) if self.spec.mode == "unified" else ("prefill", 1)
        w, hashes, fetch = self._pick(role, sim, t.prompt_tokens + (t.output_tokens if role == "unified" else 0),
                                      tokens)
        if w is None or not w.fits(t.prompt_tokens, max_tokens):
            return self._fail(sim, "UNAVAILABLE" if w is None else "OUT_OF_RANGE")
        if self.spec.kv_pool and hashes:
            sim.hashes = hashes
        if fetch:  # the pool holds more of the prompt than the worker caches: fetched over its link first
            bs = w.spec.block_size
            arrive = self.link_free[w.id] = max(self.now, self.link_free.get(w.id, 0.0)) + \
                self.cost.kv_transfer_s(fetch * bs)
            self.at(arrive, w.add, sim, tokens, max_tokens, hashes[:fetch], hashes)
        else:
            w.add(sim, tokens, max_tokens, (), hashes)

    def _fail(self, sim: SimRequest, code: str) -> None:
        self._end(sim, code)
        self._release(sim)

    # ---- what workers report ----------------------------------------------------------------------------------

    def on_tokens(self, worker: SimWorker, sim: SimRequest, first: float, last: float, n: int) -> None:
        """n tokens of sim's, made by steps ending at first ... last."""
        if sim is None:
            return
        back = self.hop()
        if sim.first_s is None:
            sim.first_s = first + back
            self.window.first_token(sim.first_s - sim.arrival_s)
            if sim.hashes:  # its prompt's blocks are computed: pushed to the cell's pool
                worker.router["pool"].put(sim.hashes)
        sim.last_s = last + back
        sim.tokens_out += n
        self.window.tokens(n)
        if self.host is not None:
            self.host.add(self.now, tokens=n)

    def on_finished(self, worker: SimWorker, sim: SimRequest, req) -> None:
        if sim is None:
            return
        if worker.role == "prefill":
            sim.cached_tokens = req.num_cached_prompt
            if sim.tokens_out < sim.trace.output_tokens:
                self._transfer(worker, sim, list(req.tokens))
                self.worker_idle_changed(worker)
                return
        elif worker.role == "unified":
            sim.cached_tokens = req.num_cached_prompt
        self._end(sim)
        self._release(sim)
        self.worker_idle_changed(worker)

    def on_failed(self, worker: SimWorker, sim: SimRequest, code: str) -> None:
        if sim is not None:
            self._fail(sim, code)

    def _transfer(self, src: SimWorker, sim: SimRequest, tokens: list) -> None:
        """The prompt's KV: src -> kvstore over src's link, then kvstore -> the decode worker over its link."""
        dst, _, _ = self._pick("decode", sim, sim.trace.output_tokens, None, after=self.views[src.id])
        if dst is None:
            return self._fail(sim, "UNAVAILABLE")
        took = self.cost.kv_transfer_s(sim.trace.prompt_tokens)
        out = self.link_free[src.id] = max(self.now, self.link_free.get(src.id, 0.0)) + took
        arrive = self.link_free[dst.id] = max(out, self.link_free.get(dst.id, 0.0)) + took
        self.at(arrive, dst.add_import, sim, tokens, sim.trace.output_tokens)

    # ---- autoscaling ------------------------------------------------------------------------------------------

    def start_worker(self, startup_s: float) -> None:
        self.starting += 1
        self._mark_timeline()
        self.at(self.now + startup_s, self._ready)

    def _ready(self) -> None:
        self.starting -= 1
        role = "unified" if self.spec.mode == "unified" else "decode"
        n = sum(1 for w in self.workers if w.role == role)
        self._add_worker(replace(self.spec.worker, role=role), f"{role}-{n}")
        self._mark_timeline()
        self._pump()

    def drain_worker(self) -> None:
        serving = self.serving("unified" if self.spec.mode == "unified" else "decode")
        if len(serving) <= 1:
            return
        w = min(serving, key=lambda x: (x.holding, x.id))
        self.draining.add(w.id)
        self._assign_cells()
        self._mark_timeline()
        self.worker_idle_changed(w)

    def _retire(self, w: SimWorker) -> None:
        w.alive, w.retired_s = False, self.now
        self.draining.discard(w.id)
        self._assign_cells()

    def _mark_timeline(self) -> None:
        self.timeline.append((round(self.now, 6), len(self.serving()), self.starting))


def _of_role(workers: list, role: str) -> tuple[list, dict]:
    """The workers of one role, and the same by id."""
    ws = [w for w in workers if w.role == role]
    return ws, {w.id: w for w in ws}


class Gateway:
    """One gateway replica: the gateway's own admission core (services.policy.admission_core: tenants' limits, the
    queue, room on the mesh, the fair bypass) on the simulated clock, what it has in flight, and its share of the
    workers' slots. With several gateways (a load balancer spreading requests over them in turn) the share is
    even: the real workers hand a freed slot to the gateway holding the fewest unused credits
    (services.gateway.credits), which evens the shares out when the gateways' loads are even, as round robin
    makes them. Its view of the mesh (KV capacity, outstanding tokens, step-cost fits) is polled every
    gateway_poll_s, as the real gateway polls the router's."""

    def __init__(self, cluster: Cluster):
        spec = cluster.spec
        self.c = cluster
        self.core = AdmissionCore("fcfs" if spec.admission == "none" else spec.admission, spec.starvation_s,
                                  clock=lambda: cluster.now, queue_bursts=spec.queue_bursts,
                                  share_preemption=spec.share_preemption)
        self.tenants: dict[str, Tenant] = {}
        self.in_flight = 0
        self.sims: dict[int, SimRequest] = {}  # id(Pending) -> its request
        self.tick_armed = False
        self.polled_s = -math.inf  # when it last read the router's view of the workers
        self.heard = -1  # the version of their fits it last took
        self.kv = (0, 0)  # (KV token capacity, outstanding tokens) of the serving workers, as last polled

    def slots(self) -> int:
        return self.c._slot_count // len(self.c.gateways)

    def _tenant(self, name: str) -> Tenant:
        t = self.tenants.get(name)
        if t is None:
            t = self.tenants[name] = Tenant(name, weight=float(self.c.spec.tenant_weights.get(name, 1.0)))
        return t

    def _poll(self) -> None:
        c = self.c
        if c.now < self.polled_s + c.spec.gateway_poll_s:
            return
        self.polled_s = c.now
        version, reports = c.reported_costs()
        if version != self.heard:
            self.heard = version
            self.core.cost.update(*reports)
        views = [c.views[w.id] for w in c.serving() if w.role != "prefill"]
        self.kv = (sum(v.capacity_tokens for v in views), sum(v.outstanding_tokens for v in views))

    def arrive(self, sim: SimRequest) -> None:
        c, t = self.c, sim.trace
        if c.spec.admission == "none":
            self._dispatch(sim)
            return
        self._poll()
        try:
            p, pushed = self.core.offer(self._tenant(t.tenant), t.id, t.prompt_tokens, t.output_tokens, t.priority,
                                        sim.deadline_s)
        except MeshError as e:
            c._end(sim, e.code)
            return
        sim.pending = p
        self.sims[id(p)] = sim
        for q in pushed:
            c._end(self.sims.pop(id(q)), "RESOURCE_EXHAUSTED")
        self.pump()

    def _dispatch(self, sim: SimRequest) -> None:
        c = self.c
        self.in_flight += 1
        sim.dispatched_s = c.now
        c.at(c.now + c.hop(), c._route_first, sim)
        if sim.deadline_s is not None:
            c.at(max(sim.deadline_s, c.now), c._expire, sim)

    def pump(self) -> None:
        c, core = self.c, self.core
        self._poll()
        core.set_view(MeshView(max(self.slots(), 1), *self.kv))
        expired, dispatched = core.sweep()
        for p in expired:
            c._end(self.sims.pop(id(p)), "RESOURCE_EXHAUSTED" if p.dropped == "bound" else "DEADLINE_EXCEEDED")
        for p in dispatched:
            self._dispatch(self.sims.pop(id(p)))
        queue = core.queue.queue
        if queue and not self.tick_armed and any(q.deadline_s is not None or q.bounded for q in queue):
            self.tick_armed = True  # deadlines and the bound pass without any event: the gateway's 50 ms tick
            c.at(c.now + 0.05, self._tick)

    def _tick(self) -> None:
        self.tick_armed = False
        self.pump()

    def release(self, sim: SimRequest) -> None:
        p = sim.pending
        self.in_flight -= 1
        if p is None:  # admission "none"
            return
        self.core.done(p, sim.tokens_out, sim.first_s, None if sim.error else sim.last_s)  # a failure teaches nothing
        self.pump()


class KVPool:
    """A cell's content-addressed KV pool (the kvstore's), as block hashes, least recently used evicted first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def longest(self, hashes: list) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def put(self, hashes: list) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class _HostLoad:
    """The cores the rest of the mesh takes on a machine its workers share (CostModel.host_cores): at the recent
    request and streamed-token rates (exponentially weighted over HOST_WINDOW_S)."""

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.requests = self.tokens = 0.0  # per second, decayed to `at`
        self.at = 0.0

    def _decay(self, now: float) -> None:
        if now > self.at:
            f = math.exp((self.at - now) / HOST_WINDOW_S)
            self.requests, self.tokens, self.at = self.requests * f, self.tokens * f, now

    def add(self, now: float, requests: int = 0, tokens: int = 0) -> None:
        self._decay(now)
        self.requests += requests / HOST_WINDOW_S
        self.tokens += tokens / HOST_WINDOW_S

    def cores(self, now: float) -> float:
        self._decay(now)
        return self.cost.host_cores(self.requests, self.tokens)


class _Window:
    """What the autoscaler's signals see over an interval (reset by each sample)."""

    def __init__(self):
        self.pending = 0  # requests arrived and not ended (the whole run)
        self.reset()

    def reset(self) -> None:
        self.prompt_tokens = self.output_tokens = self.requests = 0
        self.ttfts: list = []

    def arrived(self, t) -> None:
        self.requests += 1
        self.prompt_tokens += t.prompt_tokens

    def first_token(self, ttft_s: float) -> None:
        self.ttfts.append(ttft_s)

    def tokens(self, n: int) -> None:
        self.output_tokens += n


class _Scaler:
    """The autoscaler's loop: a PoolSample every interval_s, the policy's decision, workers started or drained."""

    def __init__(self, cluster: Cluster, spec: AutoscaleSpec):
        from services.policy.scaling import CpuPolicy, PoolConfig, RatePolicy, SignalWindow, TokenPolicy

        self.cluster, self.spec = cluster, spec
        role = "unified" if cluster.spec.mode == "unified" else "decode"
        config = PoolConfig(role, min_replicas=spec.min_replicas, max_replicas=spec.max_replicas,
                            startup_s=spec.startup_s, prefill_tokens_per_s=spec.prefill_tokens_per_s,
                            decode_tokens_per_s=spec.decode_tokens_per_s, target_util=spec.target_util,
                            ttft_slo_s=spec.ttft_slo_s, itl_slo_s=spec.itl_slo_s, cooldown_s=spec.cooldown_s,
                            down_window_s=spec.down_window_s, window_s=spec.window_s)
        self.policy = {"token": lambda: TokenPolicy(config), "cpu": lambda: CpuPolicy(config, spec.target_cpu),
                       "rate": lambda: RatePolicy(config, spec.requests_per_s_per_replica),
                       "fixed": lambda: None}[spec.policy]()
        self.signals = SignalWindow()  # the autoscaler service's own loop (services/policy/scaling.py)
        self.busy_before: dict[str, float] = {}
        self.decisions = 0

    def tick(self) -> None:
        from services.policy.scaling import PoolSample

        c, dt = self.cluster, self.spec.interval_s
        w = c.window
        serving = c.serving()
        busy = []
        for x in serving:
            before = self.busy_before.get(x.id, x.busy_s)
            busy.append(min(1.0, (x.busy_s - before) / dt))
            self.busy_before[x.id] = x.busy_s
        ttfts = sorted(w.ttfts)
        sample = PoolSample(
            t=c.now, ready=len([x for x in serving if x.role != "prefill"]), starting=c.starting,
            prompt_tokens_per_s=w.prompt_tokens / dt, output_tokens_per_s=w.output_tokens / dt,
            requests_per_s=w.requests / dt,
            queued_prefill_tokens=float(sum(r.num_tokens - r.num_computed for x in serving for r in x.sched.waiting)
                                        + sum(p.input_tokens for g in c.gateways for p in g.core.queue.queue)),
            kv_usage=max((x.pool.num_used / x.pool.num_blocks for x in serving), default=0.0),
            ttft_p90_s=ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
            cpu_util=sum(busy) / len(busy) if busy else 0.0)
        w.reset()
        if self.policy is not None:
            d = self.signals.decide(self.policy, sample)
            self.decisions += 1
            current = sample.ready + sample.starting
            for _ in range(max(0, d.target - current)):
                c.start_worker(self.spec.startup_s)
            for _ in range(max(0, current - d.target)):
                c.drain_worker()
        if w.pending > 0 or c.arrivals_left > 0:
            c.at(c.now + dt, self.tick)
