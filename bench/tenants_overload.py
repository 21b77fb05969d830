"""Workload tenants-overload: FCFS vs VTC vs fair (light tenants first) vs fair-deadline admission under 2x overload.

2 unified workers, the model given (`--model`; default the bench preset), one torch thread each, 16 sequences per
batch. Capacity C is the sustainable rate measured first in the same run by a ramp on a mesh of its own
(bench/sweep.py, issue 22's method; `--capacity` gives it instead); every mesh is warmed before its clock starts. Three
tenants with weights 1 : 1 : 2 send Poisson streams for 3 minutes: A at 1.25 C (5x its share),
B at 0.25 C, C at 0.5 C, so the offered load is 2 C. Prompts are uniform 64-512 tokens, outputs
uniform 32-256 (greedy, EOS ignored); 30% of requests carry an end-to-end deadline of k x their
predicted solo latency, k uniform in [1.5, 4] (solo latency = a + b x prompt + c x output, fitted
by least squares, no negative term, on 24 requests sent one at a time in the same run). The gateway's admission
policy and every engine's slot policy are the system under test; nothing retries.

Metrics per system (service counted in the fairness unit: prompt tokens + 2 x output tokens,
of requests that finished within the 3-minute window):
- jain_index over x_i = service_i / fair_share_i, where fair shares are the weighted max-min
  fair split of the total service delivered, given each tenant's offered demand in the window
  (B and C are owed their full demand, A the rest); 1.0 = everyone got exactly its share.
- victim_ttft_p99_ratio: max over B and C of TTFT p99 here / TTFT p99 of that tenant alone
  (each alone on a fresh mesh at its own rate, for 1 minute). Rejected requests are counted
  in `rejected_by_tenant`, not in TTFT.
- deadline_attainment: deadline-carrying requests finished within their deadline / those admitted
  (dispatched into the mesh: not refused at arrival, pushed out or dropped from the queue; admitted_to_mesh());
  rejected_at_arrival counts the DEADLINE_EXCEEDED answers naming the predicted finish, with the slowest
  rejection's answer time; deadline_attainment_all counts every deadline request, deadline_attainment_accepted
  those not refused at arrival (a request the queue accepted and later let go for its deadline is a prediction
  that failed: it counts there, not in deadline_attainment).
  deadline_goodput_req_per_s: deadline requests met per second.
- throughput_tokens_per_s: service (prompt + output tokens) of requests finished in the window,
  per second of the window.
- max_queue_wait_ms: the longest admitted request's wait in the admission queue.
- rejection_server_ms_max / _p99: of the requests refused at arrival (a limit, the queue's bound, an SLO, a deadline
  predicted to be missed; not those pushed out of the queue or expired in it later), the time the gateway took to
  answer (its own measure, trailing metadata meshserve-server-ms), beside rejection_ms_max as the client saw it.
The raw outcome of every request goes beside the result (OUT.requests.json).
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import yaml

from bench import sweep
from bench.common import default_model, log, machine, print_table, write_result
from bench.latency import percentile, poisson_arrivals
from services.common.convert import request_from_line
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.common.rpc import SERVER_MS_KEY
from services.mesh.launcher import Mesh, MeshSpec
from services.policy.arbitration import max_min_shares
from services.policy.tenants import hash_key

SYSTEMS = ("fcfs", "vtc", "fair", "fair-deadline")  # vtc: fair without light tenants first
TENANTS = {"A": (1.0, 1.25), "B": (1.0, 0.25), "C": (2.0, 0.5)}  # name: (weight, rate as a multiple of C)
QUEUE_DROPS = ("pushed out", "in the admission qu", "starvation bound")  # the gateway's words for a request it let go
# from its queue undispatched (services/gateway/admission.py)
ENGINE = ["--max-num-batched-tokens", "512", "--max-num-seqs", "16", "--kv-cache-gb", "0.25"]


def add_flags(p) -> None:
    g = p.add_argument_group("tenants-overload")
    g.add_argument("--duration-s", type=float, default=180.0, help="how long the tenants send")
    g.add_argument("--capacity", type=float, default=0.0,
                   help="tenants-overload: the sustainable rate C, req/s (default: a ramp finds it)")
    g.add_argument("--systems", default=",".join(SYSTEMS),
                   help="the admission policies to run, comma-separated (default: all; ratios need fcfs)")


def _request(rng: random.Random, i: int, tenant: str) -> dict:
    return {"id": f"{tenant}-{i}", "tenant": tenant,
            "prompt_token_ids": [rng.randrange(3, 32000) for _ in range(rng.randint(64, 512))],
            "max_tokens": rng.randint(32, 256), "temperature": 0.0, "ignore_eos": True}


def run(args) -> int:
    model_dir = Path(args.model) if args.model else default_model("bench")
    duration = 40.0 if args.quick else args.duration_s
    solo_s = min(duration, 60.0)
    rng = random.Random(args.seed)
    keys, config = tenant_config("tenants", {t: w for t, (w, _) in TENANTS.items()})

    def mesh(policy):
        return Mesh(MeshSpec(str(model_dir), mode="unified", unified=2, engine_args=ENGINE + ["--slot-policy", policy],
                             config_file=config, gateway_args=["--admission-policy", policy]))

    # Capacity: the sustainable rate, by a ramp on a mesh of its own (no tenants; issue 22's method: a burst's
    # throughput overstates what a Poisson stream sustains). Then the solo-latency model.
    ramp: dict = {}
    cap = args.capacity
    if not cap:
        with Mesh(MeshSpec(str(model_dir), mode="unified", unified=2, engine_args=ENGINE + ["--slot-policy", "fcfs"],
                           gateway_args=["--admission-policy", "fcfs"])) as m:
            pool = [{k: v for k, v in _request(rng, i, "C").items() if k != "tenant"} for i in range(600)]
            cap, ramp = sweep.find_sustainable(m, pool, args.seed, args.quick)
    with mesh("fcfs") as m:
        warm(m.gateway, keys)
        solo = [_request(rng, i, "C") for i in range(24)]
        log("24 solo latencies for the deadline model")
        lat = [_drive(m.gateway, keys, [(0.0, r)])[0] for r in solo]
    coef = _fit([(len(r["prompt_token_ids"]), r["max_tokens"]) for r in solo], [o["e2e_ms"] for o in lat])
    log(f"capacity C = {cap:.2f} req/s; solo latency ms = {coef[0]:.1f} + {coef[1]:.3f} x prompt + "
        f"{coef[2]:.2f} x output")

    # The workload: each tenant's Poisson stream over `duration`; 30% with deadlines.
    schedule = []
    for t, (_, mult) in TENANTS.items():
        rate = mult * cap
        for i, at in enumerate(a for a in poisson_arrivals(int(rate * duration * 1.5) + 10, rate,
                                                           rng.randrange(1 << 30))
                               if a < duration):
            r = _request(rng, i, t)
            if rng.random() < 0.3:
                predicted = coef[0] + coef[1] * len(r["prompt_token_ids"]) + coef[2] * r["max_tokens"]
                r["deadline_ms"] = int(max(predicted, 1.0) * rng.uniform(1.5, 4.0))
            schedule.append((at, r))
    schedule.sort(key=lambda e: e[0])
    demand = {t: sum(_service(len(r["prompt_token_ids"]), r["max_tokens"]) for _, r in schedule if r["tenant"] == t)
              for t in TENANTS}
    log(f"{len(schedule)} requests over {duration:.0f} s: " + ", ".join(
        f"{t} {sum(r['tenant'] == t for _, r in schedule)}" for t in TENANTS))

    alone = {}
    for t in ("B", "C"):
        with mesh("fair-deadline") as m:
            warm(m.gateway, keys)
            log(f"{t} alone for {solo_s:.0f} s")
            outs = _drive(m.gateway, keys, [(at, r) for at, r in schedule if r["tenant"] == t and at < solo_s])
        alone[t] = percentile([o["ttft_ms"] for o in outs if "ttft_ms" in o], 0.99)

    systems, raw = {}, {}
    for policy in [x for x in SYSTEMS if x in args.systems.split(",")]:
        with mesh(policy) as m:
            warm(m.gateway, keys)
            log(f"{policy}: {len(schedule)} requests")
            before = sweep.worker_stats([w.address for w in m.workers("unified")])
            outs = _drive(m.gateway, keys, schedule)
            engines = engine_figures(before, sweep.worker_stats([w.address for w in m.workers("unified")]))
        systems[policy] = {**_metrics(outs, schedule, demand, duration, alone), "engines": engines}
        raw[policy] = [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in o.items()} for o in outs]
        log(f"{policy}: {systems[policy]}")
    result = {"workload": "tenants-overload", "command": args.command_line, "machine": machine(),
              "config": {"duration_s": duration, "capacity_req_per_s": round(cap, 3), **ramp,
                         "tenants": {t: {"weight": w, "rate_req_per_s": round(m_ * cap, 3)}
                                     for t, (w, m_) in TENANTS.items()},
                         "requests": len(schedule), "engine_args": ENGINE, "workers": 2, "threads_per_worker": 1,
                         "solo_latency_ms_model": [round(float(c), 4) for c in coef],
                         "alone_ttft_ms_p99": alone, "starvation_s": 30.0, "model": str(model_dir)},
              "systems": systems,
              "ratios": {f"{s}/fcfs:{k}": round(systems[s][k] / systems["fcfs"][k], 3) if systems["fcfs"][k] else None
                         for s in systems if s != "fcfs" and "fcfs" in systems
                         for k in ("deadline_goodput_req_per_s", "throughput_tokens_per_s")}}
    write_result(result, args.out)
    if args.out:  # every request's outcome, beside the result
        Path(args.out).with_suffix(".requests.json").write_text(json.dumps(raw))
    print_table(result)
    return 0


def tenant_config(name: str, weights: dict) -> tuple[dict, str]:
    """A mesh config file in a fresh folder with one tenant per name (its weight) and a key each: (keys, path)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"meshserve-{name}-"))
    keys = {t: f"bench-key-{t}" for t in weights}
    cfg = {"tenants": [{"name": t, "api_key_hashes": [hash_key(keys[t])], "weight": w} for t, w in weights.items()]}
    (workdir / "mesh.yaml").write_text(yaml.safe_dump(cfg))
    return keys, str(workdir / "mesh.yaml")


def warm(gateway: str, keys: dict, make=None) -> None:
    """Every worker runs prompts and decodes of the workload's sizes before the clock starts (a fresh engine's first
    steps are slow), and the gateway's cost model sees a few completions. make(rng, i): one of the workload's
    requests (default: tenant C's)."""
    rng, make = random.Random(1), make or (lambda rng, i: _request(rng, i, "C"))
    reqs = [{**make(rng, i), "id": f"warm-{i}", "max_tokens": 16} for i in range(8)]
    for _ in range(2):
        _drive(gateway, keys, [(0.0, r) for r in reqs])


def _fit(lengths: list, e2e_ms: list) -> list:
    """Least squares e2e = a + b x prompt + c x output, with no negative term (a negative one is dropped)."""
    x, y = np.array([[1.0, p, o] for p, o in lengths]), np.array(e2e_ms)
    keep = [0, 1, 2]
    while True:
        c = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (c >= 0).all() or len(keep) == 1:
            coef = [0.0, 0.0, 0.0]
            for k, v in zip(keep, c):
                coef[k] = max(float(v), 0.0)
            return coef
        keep.pop(int(np.argmin(c)))


def _service(prompt: int, output: int) -> float:
    return prompt + 2 * output


def _drive(gateway: str, keys: dict, schedule: list) -> list[dict]:
    return asyncio.run(_drive_async(gateway, keys, schedule))


async def _drive_async(gateway: str, keys: dict, schedule: list) -> list[dict]:
    async with grpc.aio.insecure_channel(gateway) as ch:
        stub = pb_grpc.GenerationStub(ch)
        t0 = time.perf_counter()

        async def one(at, r):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            start = time.perf_counter()
            out = {"tenant": r["tenant"], "deadline_ms": r.get("deadline_ms"), "arrival_s": start - t0,
                   "prompt": len(r["prompt_token_ids"]), "output": 0}
            try:
                async for resp in stub.Generate(request_from_line(r), metadata=(("x-api-key", keys[r["tenant"]]),),
                                                timeout=600):
                    now = time.perf_counter()
                    if resp.token_ids and "ttft_ms" not in out:
                        out["ttft_ms"] = (now - start) * 1e3
                        out["queue_wait_ms"] = resp.queue_wait_ms
                    out["output"] += len(resp.token_ids)
                out["e2e_ms"] = (time.perf_counter() - start) * 1e3
                out["end_s"] = time.perf_counter() - t0
            except grpc.aio.AioRpcError as e:
                out["error"] = e.code().name
                out["error_ms"] = (time.perf_counter() - start) * 1e3
                server_ms = dict(e.trailing_metadata() or ()).get(SERVER_MS_KEY)
                if server_ms is not None:
                    out["server_ms"] = float(server_ms)
                details = e.details() or ""
                out["at_arrival"] = out["output"] == 0 and "predicted to finish" in details
                out["refused"] = out["output"] == 0 and (out["at_arrival"] or (
                    e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "pushed out" not in details
                    and "no slot within" not in details))  # not pushed out or timed out in the queue later
                out["in_queue"] = out["output"] == 0 and any(s in details for s in QUEUE_DROPS)  # before dispatch
                out["detail"] = details[:160]
            return out

        return list(await asyncio.gather(*(one(at, r) for at, r in schedule)))


def _count(items) -> dict:
    out: dict = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def engine_figures(before: list, after: list) -> dict:
    """Where requests waited, from the workers' Stats before and after a run: the engines' own queueing delay (arrival
    at the engine to first scheduled, mean over the requests they started; late binding keeps it near zero), slot
    preemptions, requests that came past the credits, and the most served at once by one worker."""
    started = sum(a.started - b.started for b, a in zip(before, after))
    wait = sum(a.queue_wait_s - b.queue_wait_s for b, a in zip(before, after))
    return {"engine_queue_wait_ms_mean": round(wait * 1e3 / started, 2) if started else None,
            "slot_preemptions": sum(a.slot_preemptions - b.slot_preemptions for b, a in zip(before, after)),
            "uncredited": sum(a.uncredited - b.uncredited for b, a in zip(before, after)),
            "max_live_per_worker": max((a.max_live for a in after), default=0)}


def admitted_to_mesh(o: dict) -> bool:
    """Was the request dispatched from the admission queue into the mesh? Not if it was refused at arrival (a limit,
    the bound, its tenant's share, a deadline predicted to be missed), pushed out of the queue, or dropped from it
    (its deadline or the bound passed while it waited): each of those is answered before any work."""
    if "error" not in o or o["output"]:
        return True
    detail = o.get("detail", "")
    in_queue = o.get("in_queue", any(s in detail for s in QUEUE_DROPS))  # results before in_queue: a cut detail
    return not (o.get("refused") or o.get("at_arrival") or in_queue)


def _metrics(outs: list, schedule: list, demand: dict, duration: float, alone: dict) -> dict:
    weights = {t: w for t, (w, _) in TENANTS.items()}
    served = {t: sum(_service(o["prompt"], o["output"]) for o in outs
                     if o["tenant"] == t and "error" not in o and o["end_s"] <= duration) for t in TENANTS}
    shares = max_min_shares(sum(served.values()), demand, weights)
    xs = [served[t] / shares[t] for t in TENANTS if shares[t] > 0]
    jain = sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))
    ttft = {t: percentile([o["ttft_ms"] for o in outs if o["tenant"] == t and "ttft_ms" in o], 0.99) for t in TENANTS}
    victim = max(ttft[t] / alone[t] for t in ("B", "C") if ttft[t] is not None and alone[t])
    with_deadline = [o for o in outs if o["deadline_ms"]]
    rejected = [o for o in with_deadline if o.get("at_arrival")]
    admitted = sum(1 for o in with_deadline if admitted_to_mesh(o))
    accepted = sum(1 for o in with_deadline if not (o.get("refused") or o.get("at_arrival")))
    met = sum(1 for o in with_deadline if "error" not in o and o["e2e_ms"] <= o["deadline_ms"])
    waits = [o["queue_wait_ms"] for o in outs if "queue_wait_ms" in o]
    server = [o["server_ms"] for o in outs if "server_ms" in o and o.get("refused")]  # refused at arrival
    r = lambda v: None if v is None else round(v, 3)  # noqa: E731
    return {"jain_index": r(jain), "victim_ttft_p99_ratio": r(victim),
            "deadline_attainment": r(met / admitted) if admitted else None,
            "deadline_attainment_all": r(met / len(with_deadline)) if with_deadline else None,
            "deadline_attainment_accepted": r(met / accepted) if accepted else None,
            "deadline_accepted": accepted,
            "deadline_requests": len(with_deadline), "deadline_admitted": admitted,
            "rejected_at_arrival": len(rejected),
            "rejection_ms_max": r(max(o["error_ms"] for o in rejected)) if rejected else None,
            "rejection_server_ms_max": r(max(server)) if server else None,
            "rejection_server_ms_p99": r(percentile(server, 0.99)) if server else None,
            "deadline_goodput_req_per_s": r(met / duration),
            "throughput_tokens_per_s": r(sum(o["prompt"] + o["output"] for o in outs
                                             if "error" not in o and o["end_s"] <= duration) / duration),
            "max_queue_wait_ms": r(max(waits)) if waits else None,
            "service_share": {t: r(served[t] / max(sum(served.values()), 1e-9)) for t in TENANTS},
            "fair_share": {t: r(shares[t] / max(sum(shares.values()), 1e-9)) for t in TENANTS},
            "ttft_ms_p99": {t: r(ttft[t]) for t in TENANTS},
            "rejected_by_tenant": {t: sum(1 for o in outs if o["tenant"] == t and "error" in o) for t in TENANTS},
            "errors_by_tenant": {t: _count(o["error"] for o in outs if o["tenant"] == t and "error" in o)
                                 for t in TENANTS},
            "requests": len(outs)}
