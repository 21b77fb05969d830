"""Workload priority-overload: criticality bands under 2x overload, beside the same load without them.

2 unified workers, one torch thread each, 16 sequences per batch (tenants-overload's engine), the model given
(`--model`; the issue's figures use the smollm2-shape preset). First a ramp on a mesh of its own finds the
sustainable rate R (bench/sweep.py, issue 22's method: Poisson steps growing by 15% until the median TTFT passes
3x the light-load one, then held). Then two tenants send Poisson streams for `--duration-s`:

- K, critical: 0.3 R (its requests carry `criticality: critical`);
- S: standard requests at 1.0 R and sheddable ones (`criticality: sheddable`) at 0.7 R.

Offered: 2.0 R. Prompts uniform 64-256 tokens, outputs uniform 32-128 (greedy, EOS ignored), the same arrivals for
every system. Systems: `no-bands` (the criticality fields stripped: everything is standard) and `bands`; both under
the same admission and slot policy (`--policy`, default fcfs, so the bands are all that differs). K alone, at its
own rate on a fresh mesh (min(duration, 60) s), gives its solo TTFT p99.

Metrics per system: K's TTFT p99 and its ratio to K alone (target <= 1.5 with bands); rejections by band (count
and fraction of that band's requests): the sheddable ones should be the ones turned away; the standard band's TTFT
p99; throughput (prompt + output tokens of requests finished within the window per second); the longest
admission-queue wait of an admitted request.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from bench import sweep
from bench.common import default_model, log, machine, print_table, write_result
from bench.latency import percentile, poisson_arrivals
from bench.tenants_overload import ENGINE, _drive, engine_figures, tenant_config, warm
from services.mesh.launcher import Mesh, MeshSpec

CLASSES = {"K-critical": ("K", "critical", 0.3), "S-standard": ("S", "standard", 1.0),
           "S-sheddable": ("S", "sheddable", 0.7)}  # class: (tenant, criticality, rate as a multiple of R)
SYSTEMS = ("no-bands", "bands")
RAMP_POOL = 600


def add_flags(p) -> None:
    g = p.add_argument_group("priority-overload")
    g.add_argument("--policy", default="fcfs", help="admission and slot policy of every system (default fcfs)")
    g.add_argument("--sustainable-rate", type=float, default=0.0,
                   help="priority-overload: the sustainable rate R, req/s (default: a ramp finds it)")


def _request(rng: random.Random, i: int, cls: str) -> dict:
    tenant, criticality, _ = CLASSES[cls]
    return {"id": f"{cls}-{i}", "tenant": tenant, "class": cls, "criticality": criticality,
            "prompt_token_ids": [rng.randrange(3, 32000) for _ in range(rng.randint(64, 256))],
            "max_tokens": rng.randint(32, 128), "temperature": 0.0, "ignore_eos": True}


def run(args) -> int:
    model_dir = Path(args.model) if args.model else default_model("bench")
    duration = 40.0 if args.quick else args.duration_s
    solo_s = min(duration, 60.0)
    rng = random.Random(args.seed)
    keys, config = tenant_config("priority", {"K": 1.0, "S": 1.0})

    def mesh(tenants: bool = True):
        return Mesh(MeshSpec(str(model_dir), mode="unified", unified=2,
                             engine_args=ENGINE + ["--slot-policy", args.policy],
                             config_file=config if tenants else None,
                             gateway_args=["--admission-policy", args.policy]))

    ramp: dict = {}
    rate = args.sustainable_rate
    if not rate:
        with mesh(tenants=False) as m:
            pool = [{k: v for k, v in _request(rng, i, "S-standard").items() if k not in ("tenant", "class")}
                    for i in range(RAMP_POOL)]
            rate, ramp = sweep.find_sustainable(m, pool, args.seed, args.quick)
    log(f"sustainable rate R = {rate:.2f} req/s; offered {2.0 * rate:.2f} req/s")

    schedule = []
    for cls, (_, _, mult) in CLASSES.items():
        arrivals = poisson_arrivals(int(mult * rate * duration * 1.5) + 10, mult * rate, rng.randrange(1 << 30))
        schedule += [(at, _request(rng, i, cls)) for i, at in enumerate(a for a in arrivals if a < duration)]
    schedule.sort(key=lambda e: e[0])
    log(f"{len(schedule)} requests over {duration:.0f} s: " + ", ".join(
        f"{c} {sum(r['class'] == c for _, r in schedule)}" for c in CLASSES))

    with mesh() as m:
        warm(m.gateway, keys, lambda rng, i: _request(rng, i, "S-standard"))
        log(f"K alone for {solo_s:.0f} s")
        solo = _drive(m.gateway, keys, [(at, r) for at, r in schedule if r["class"] == "K-critical" and at < solo_s])
    alone = percentile([o["ttft_ms"] for o in solo if "ttft_ms" in o], 0.99)
    log(f"K alone: TTFT p99 {alone:.0f} ms")

    systems, raw = {}, {}
    for name in SYSTEMS:
        sent = schedule if name == "bands" else [(at, {**r, "criticality": ""}) for at, r in schedule]
        with mesh() as m:
            warm(m.gateway, keys, lambda rng, i: _request(rng, i, "S-standard"))
            log(f"{name}: {len(sent)} requests")
            before = sweep.worker_stats([w.address for w in m.workers("unified")])
            outs = _drive(m.gateway, keys, sent)
            engines = engine_figures(before, sweep.worker_stats([w.address for w in m.workers("unified")]))
        for o, (_, r) in zip(outs, schedule):
            o["class"] = r["class"]
        systems[name] = {**_metrics(outs, duration, alone), "engines": engines}
        raw[name] = [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in o.items()
                      if k in ("class", "arrival_s", "ttft_ms", "queue_wait_ms", "e2e_ms", "output", "error")}
                     for o in outs]
        log(f"{name}: {systems[name]}")
    result = {"workload": "priority-overload", "command": args.command_line, "machine": machine(),
              "config": {"duration_s": duration, "sustainable_req_per_s": round(rate, 3), "policy": args.policy,
                         "classes": {c: {"tenant": t, "criticality": k, "rate_req_per_s": round(mult * rate, 3)}
                                     for c, (t, k, mult) in CLASSES.items()},
                         "requests": len(schedule), "engine_args": ENGINE, "workers": 2, "threads_per_worker": 1,
                         "k_alone_ttft_ms_p99": round(alone, 2), "model": str(model_dir), **ramp},
              "systems": systems,
              "ratios": {"bands/no-bands:throughput_tokens_per_s": round(
                  systems["bands"]["throughput_tokens_per_s"] / systems["no-bands"]["throughput_tokens_per_s"], 3)}}
    write_result(result, args.out)
    if args.out:  # every request's outcome, beside the result
        Path(args.out).with_suffix(".requests.json").write_text(json.dumps(raw))
    print_table(result)
    return 0


def _metrics(outs: list, duration: float, alone: float) -> dict:
    r = lambda v: None if v is None else round(v, 3)  # noqa: E731
    by = {c: [o for o in outs if o["class"] == c] for c in CLASSES}
    ttft = {c: percentile([o["ttft_ms"] for o in xs if "ttft_ms" in o], 0.99) for c, xs in by.items()}
    rejected = {c: sum(1 for o in xs if "error" in o) for c, xs in by.items()}
    waits = [o["queue_wait_ms"] for o in outs if "queue_wait_ms" in o]
    errors: dict = {}
    for o in outs:
        if "error" in o:
            errors[f"{o['class']}:{o['error']}"] = errors.get(f"{o['class']}:{o['error']}", 0) + 1
    return {"k_ttft_ms_p99": r(ttft["K-critical"]),
            "k_ttft_p99_over_alone": r(ttft["K-critical"] / alone) if ttft["K-critical"] and alone else None,
            "ttft_ms_p99": {c: r(v) for c, v in ttft.items()},
            "ttft_ms_p50": {c: r(percentile([o["ttft_ms"] for o in xs if "ttft_ms" in o], 0.5))
                            for c, xs in by.items()},
            "queue_wait_ms_p99": {c: r(percentile([o["queue_wait_ms"] for o in xs if "queue_wait_ms" in o], 0.99))
                                  for c, xs in by.items()},
            "rejected": rejected, "rejected_fraction": {c: r(rejected[c] / max(len(xs), 1)) for c, xs in by.items()},
            "errors": errors,
            "throughput_tokens_per_s": r(sum(o["prompt"] + o["output"] for o in outs
                                             if "error" not in o and o["end_s"] <= duration) / duration),
            "max_queue_wait_ms": r(max(waits)) if waits else None, "requests": len(outs)}
