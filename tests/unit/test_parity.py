"""The services and the simulator decide alike: one trace through the router's servicer and the simulator's
routing, one sequence of arrivals and completions through the gateway's admission and the simulator's gateway,
and the same decisions out of both.

Both sides run the same I/O-free cores (services.policy.routing.pick, services.policy.admission_core); what this
guards is the code around them, which each side has its own of: what the servicer or the simulator hands the
core (the filters' Need, the prompt's hashes and what the index holds, the adapter, the decode hop's block
size and topology; the tenant, the mesh's capacity and KV room, completions) and when it asks. A rule changed
on one side alone shows here as a different decision.
"""

import asyncio
import functools
from types import SimpleNamespace

import pytest

from services.common.block_hash import extra_keys, hash_blocks, pack_tokens
from services.common.errors import MeshError
from services.common.pb import meshserve_pb2 as pb
from services.gateway.admission import Admission
from services.policy.routing.policies import make_routing_policy
from services.policy.tenants import Tenant
from services.router.registry import Registry
from services.router.server import RouterServicer
from sim.cluster import Cluster, ClusterSpec
from sim.cost import CostModel
from sim.trace import TraceRequest
from sim.worker import SimRequest, WorkerSpec
from tests.support.fakes import Clock

BS = 16
NEVER = 1e9  # a heartbeat interval no test reaches: the simulator's views stay as set


class DictIndex:
    """The Redis prefix index's lookup over a dict: block hash -> members holding it."""

    def __init__(self, held: dict):
        self.held, self.degraded = held, False

    def longest_prefix(self, hashes: list) -> dict:
        out, live = {}, None
        for i, h in enumerate(hashes):
            live = set(self.held.get(h, ())) if live is None else live & self.held.get(h, set())
            if not live:
                break
            for m in live:
                out[m] = i + 1
        return out


WORKERS = {  # id -> role, block size, topology, the heartbeat's load fields, adapters registered there
    "unified": {
        "u0": dict(outstanding_tokens=900, capacity_tokens=20_000, max_num_seqs=8, running=2, topology="r1/n1/d0",
                   known_adapters=("sql", "chat"), adapters=("chat",), host_adapters=("chat", "sql"), lora_slots=2,
                   free_lora_slots=1),
        "u1": dict(outstanding_tokens=300, capacity_tokens=20_000, max_num_seqs=8, running=1, topology="r1/n1/d1",
                   known_adapters=("sql",), adapters=("sql",), host_adapters=("sql",), lora_slots=2,
                   free_lora_slots=1),
        "u2": dict(outstanding_tokens=2_500, capacity_tokens=40_000, max_num_seqs=16, running=5, topology="r1/n2/d0",
                   known_adapters=("chat",)),
        "u3": dict(outstanding_tokens=0, capacity_tokens=10_000, max_num_seqs=4, running=0, topology="r2/n1/d0"),
    },
    "disaggregated": {
        "p0": dict(role="prefill", outstanding_tokens=400, capacity_tokens=20_000, max_num_seqs=8,
                   topology="r1/n1/d0"),
        "p1": dict(role="prefill", outstanding_tokens=100, capacity_tokens=20_000, max_num_seqs=8,
                   topology="r1/n2/d0"),
        "d0": dict(role="decode", outstanding_tokens=500, capacity_tokens=20_000, max_num_seqs=8,
                   topology="r1/n1/d0"),
        "d1": dict(role="decode", outstanding_tokens=500, capacity_tokens=20_000, max_num_seqs=8,
                   topology="r1/n2/d1"),
        "d2": dict(role="decode", outstanding_tokens=500, capacity_tokens=20_000, max_num_seqs=8,
                   topology="r2/n1/d0"),
        "d3": dict(role="decode", outstanding_tokens=0, capacity_tokens=20_000, max_num_seqs=8, block_size=32,
                   topology="r1/n1/d0"),
    },
}


def routing_trace(n: int = 48) -> list[TraceRequest]:
    """Requests sharing three system prompts (one a whole number of blocks long), some naming an adapter."""
    out = []
    for i in range(n):
        seg = i % 3
        shared = (4 * BS, 6 * BS - 3, 3 * BS)[seg]
        own = (5, 37, 0, 15, 64)[i % 5]
        adapter = ("", "", "sql", "", "chat")[i % 5]
        out.append(TraceRequest(arrival_s=0.0, prompt_tokens=shared + own + 1, output_tokens=16 + 8 * (i % 7),
                                id=f"r{i}", prefix=[[f"sys{seg}", shared]], adapter=adapter))
    return out


def held_prefixes(trace: list) -> dict:
    """The prefix index's state before the trace: u0 holds sys0's blocks, u2 half of sys1's, p1 all of sys2's;
    of the first prompt a whole number of blocks long, u1 and p0 hold every block, u3 and p1 all but the last
    (which routing never counts: the prompt's last token is always computed)."""
    holders = {"sys0": ("u0", 4), "sys1": ("u2", 3), "sys2": ("p1", 3)}
    held: dict = {}

    def hold(t, wid, blocks):
        for h in hash_blocks(t.tokens(), BS, extra_keys(t.adapter, ""))[:blocks]:
            held.setdefault(h, set()).add(wid)
    for t in trace[:3]:
        wid, blocks = holders[t.prefix[0][0]]
        hold(t, wid, blocks)
    whole = next(t for t in trace if t.prompt_tokens % BS == 0)
    for wid, blocks in (("u1", 99), ("p0", 99), ("u3", whole.prompt_tokens // BS - 1),
                        ("p1", whole.prompt_tokens // BS - 1)):
        hold(whole, wid, blocks)
    return held


def real_decisions(mode: str, policy: str, trace: list) -> list:
    clock = Clock()
    registry = Registry(clock, ttl_s=NEVER)
    for wid, fields in WORKERS[mode].items():
        f = dict(fields)
        role = f.pop("role", "unified")
        out, cap = f.pop("outstanding_tokens"), f.pop("capacity_tokens")
        registry.beat(wid, wid, role, out, cap, block_size=f.pop("block_size", BS), index_member=wid, **f)
    router = RouterServicer(registry, functools.partial(make_routing_policy, policy, {}), mode, 1000,
                            index=DictIndex(held_prefixes(trace)))
    decisions = []
    for t in trace:
        d = asyncio.run(router.Route(pb.RouteRequest(request_id=t.id, prompt_tokens=t.prompt_tokens,
                                                     max_tokens=t.output_tokens, prompt_u32=pack_tokens(t.tokens()),
                                                     adapter=t.adapter), None))
        decisions.append((d.prefill_worker, d.decode_worker))
    return decisions


def sim_decisions(mode: str, policy: str, trace: list) -> list:
    spec = WORKERS[mode]
    ids = {role: [w for w, f in spec.items() if f.get("role", "unified") == role] for role in ("unified", "prefill",
                                                                                             "decode")}
    c = Cluster(ClusterSpec(mode=mode, workers=len(ids["unified"] or ids["decode"]), prefill=len(ids["prefill"]),
                            routing=policy, heartbeat_s=NEVER, worker=WorkerSpec(block_size=BS)), CostModel(),
                worker_ids={r: v for r, v in ids.items() if v})
    for wid, fields in spec.items():
        v = c.views[wid]
        c.beat_at[wid] = 0.0  # beaten at 0: the next beat never comes
        for name, value in fields.items():
            if name == "capacity_tokens":
                v.capacity_tokens = value
            elif name != "role":
                setattr(v, name, value)
    c.index = held_prefixes(trace)
    decisions = []
    for i, t in enumerate(trace):
        sim = SimRequest(t, i)
        tokens = t.tokens()
        if mode == "unified":
            w, _, _ = c._pick("unified", sim, t.prompt_tokens + t.output_tokens, tokens)
            decisions.append(("", w.id))
        else:
            p, _, _ = c._pick("prefill", sim, t.prompt_tokens, tokens)
            d, _, _ = c._pick("decode", sim, t.output_tokens, None, after=c.views[p.id])
            decisions.append((p.id, d.id))
    return decisions


@pytest.mark.parametrize("mode", ["unified", "disaggregated"])
@pytest.mark.parametrize("policy", ["prefix-aware", "least-outstanding", "lora-aware"])
def test_router_and_simulator_route_one_trace_alike(mode, policy):
    trace = routing_trace()
    if mode == "disaggregated":
        trace = [TraceRequest(t.arrival_s, t.prompt_tokens, t.output_tokens, t.id, t.prefix) for t in trace]
    real, simulated = real_decisions(mode, policy, trace), sim_decisions(mode, policy, trace)
    assert simulated == real
    assert len(set(real)) > 1  # the trace makes the policies choose, not one worker throughout


# ---- admission ------------------------------------------------------------------------------------------------

WEIGHTS = {"a": 1.0, "b": 2.0}


def admission_events() -> list:
    """(time, kind, fields): tenant a bursts, b trickles, some requests with deadlines; completions free slots.
    Prompts are long beside the workers' KV so that KV room, not only slots, holds requests back."""
    events, t = [], 0.0
    for i in range(40):
        tenant = "a" if i % 4 else "b"
        deadline = 0.6 if i % 7 == 3 else None
        events.append((t, "arrive", dict(id=f"q{i}", tenant=tenant, prompt=200 + 150 * (i % 5), out=64 + 16 * (i % 3),
                                         deadline_ms=None if deadline is None else deadline * 1e3)))
        t += 0.02 if i < 24 else 0.15
        if i % 3 == 2:
            events.append((t, "finish", dict(n=i // 3)))
    for k in range(20):
        t += 0.2
        events.append((t, "finish", dict(n=14 + k)))
    return events


def real_admission(policy: str, events: list, views: list) -> list:
    clock = Clock()
    adm = Admission(policy, starvation_s=5.0, clock=clock)
    adm.update_view(views, "unified")
    log, tickets, running = [], {}, []
    tenants = {name: Tenant(name, weight=w) for name, w in WEIGHTS.items()}

    async def one(f):
        try:
            p = await adm.admit(tenants[f["tenant"]], f["id"], f["prompt"], f["out"], 0,
                                None if f["deadline_ms"] is None else clock.now + f["deadline_ms"] / 1e3)
        except MeshError as e:
            log.append((f["id"], e.code))
            return
        log.append((f["id"], "dispatched"))
        tickets[f["id"]] = p
        running.append(f["id"])

    async def drive():
        tasks = []
        for t, kind, f in events:
            clock.now = t
            adm.pump()  # the gateway's tick
            if kind == "arrive":
                tasks.append(asyncio.get_running_loop().create_task(one(f)))
            else:
                finish(f["n"])
            for _ in range(4):
                await asyncio.sleep(0)
        for task in tasks:
            task.cancel()

    def finish(n):
        if n < len(running) and running[n] is not None:
            p = tickets[running[n]]
            running[n] = None
            adm.done(p, p.max_tokens, p.dispatched_s + 0.05, clock.now)

    asyncio.run(drive())
    return log


def sim_admission(policy: str, events: list) -> tuple[list, list]:
    c = Cluster(ClusterSpec(mode="unified", workers=2, admission=policy, starvation_s=5.0, tenant_weights=WEIGHTS,
                            heartbeat_s=NEVER, worker=WorkerSpec(max_num_seqs=4, num_blocks=128)), CostModel())
    g = c.gateways[0]
    log, running, sims = [], [], {}

    def dispatch(sim):  # where the simulator would route it: the decision is what is compared
        g.in_flight += 1
        sim.dispatched_s = c.now
        log.append((sim.trace.id, "dispatched"))
        running.append(sim.trace.id)

    def end(sim, error=""):
        sim.error, sim.ended = error, True
        log.append((sim.trace.id, error))

    g._dispatch, c._end = dispatch, end
    for i, (t, kind, f) in enumerate(events):
        c.now = t
        g.pump()
        if kind == "arrive":
            tr = TraceRequest(t, f["prompt"], f["out"], f["id"], tenant=f["tenant"], deadline_ms=f["deadline_ms"])
            sims[f["id"]] = sim = SimRequest(tr, i, weight=WEIGHTS[f["tenant"]], arrival_s=t)
            g.arrive(sim)
        elif f["n"] < len(running) and running[f["n"]] is not None:
            sim = sims[running[f["n"]]]
            running[f["n"]] = None
            sim.first_s, sim.last_s, sim.tokens_out = sim.dispatched_s + 0.05, c.now, sim.trace.output_tokens
            g.release(sim)
    views = [SimpleNamespace(role="unified", address=v.address, block_size=v.block_size, max_num_seqs=v.max_num_seqs,
                             kv_capacity_tokens=v.capacity_tokens, outstanding_tokens=v.outstanding_tokens,
                             prefill_s_per_token=0.0, decode_s_per_step=0.0, decode_s_floor=0.0)
             for v in c.views.values()]
    return log, views


@pytest.mark.parametrize("policy", ["fcfs", "fair", "fair-deadline", "priority"])
def test_gateway_and_simulator_admit_one_sequence_alike(policy):
    events = admission_events()
    simulated, views = sim_admission(policy, events)
    real = real_admission(policy, events, views)
    assert simulated == real
    outcomes = {code for _, code in real}
    assert "dispatched" in outcomes and len(outcomes) > 1  # some requests wait out their deadline or are turned away
