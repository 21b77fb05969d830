"""A simulation's result: the benchmark metrics (bench.latency's definitions) and plots.

Latencies are those a client sees: TTFT from arrival at the gateway to the first token, TPOT (last - first) /
(tokens - 1) per request, e2e to the last token, over the requests that completed; throughput over the span
from the trace's start to the last token. SLO attainment counts every request (a rejected one misses).
"""

from __future__ import annotations


def percentile(values: list, q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values. The benchmarks' too
    (bench.latency): the real runs and the simulated ones are summarised alike."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _r(x, nd=2):
    return None if x is None else round(x, nd)


def latency_summary(reqs: list, span_s: float | None = None) -> dict:
    done = [r for r in reqs if not r.error and r.first_s is not None]
    ttft = [(r.first_s - r.arrival_s) * 1e3 for r in done]
    tpot = [(r.last_s - r.first_s) * 1e3 / (r.tokens_out - 1) for r in done if r.tokens_out > 1]
    e2e = [(r.last_s - r.arrival_s) * 1e3 for r in done]
    if span_s is None:
        span_s = max((r.last_s for r in done), default=0.0)
    tokens = sum(r.tokens_out for r in done)
    errors: dict[str, int] = {}
    for r in reqs:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {"ttft_ms_p50": _r(percentile(ttft, 0.5)), "ttft_ms_p99": _r(percentile(ttft, 0.99)),
            "tpot_ms_p50": _r(percentile(tpot, 0.5)), "tpot_ms_p99": _r(percentile(tpot, 0.99)),
            "e2e_ms_p50": _r(percentile(e2e, 0.5)), "e2e_ms_p99": _r(percentile(e2e, 0.99)),
            "output_tokens_per_s": _r(tokens / span_s if span_s > 0 else 0.0, 1),
            "requests": len(reqs), "completed": len(done), "failed_by_status": dict(sorted(errors.items())),
            "prompt_tokens": sum(r.trace.prompt_tokens for r in done),
            "cached_prompt_tokens": sum(r.cached_tokens for r in done)}


def slo_summary(reqs: list, ttft_ms: float | None, tpot_ms: float | None, span_s: float) -> dict:
    if ttft_ms is None and tpot_ms is None:
        return {}
    met = 0
    for r in reqs:
        if r.error or r.first_s is None:
            continue
        ok = ttft_ms is None or (r.first_s - r.arrival_s) * 1e3 <= ttft_ms
        if ok and tpot_ms is not None and r.tokens_out > 1:
            ok = (r.last_s - r.first_s) * 1e3 / (r.tokens_out - 1) <= tpot_ms
        met += ok
    return {"slo_attainment": _r(met / len(reqs), 4) if reqs else None,
            "goodput_req_per_s": _r(met / span_s, 3) if span_s > 0 else None,
            "slo": {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms}}


def tenant_summary(reqs: list) -> dict:
    out: dict[str, dict] = {}
    by: dict[str, list] = {}
    for r in reqs:
        by.setdefault(r.trace.tenant, []).append(r)
    for t, rs in sorted(by.items()):
        done = [r for r in rs if not r.error and r.first_s is not None]
        out[t or "default"] = {
            "requests": len(rs), "completed": len(done),
            "service_tokens": sum(r.trace.prompt_tokens + 2 * r.tokens_out for r in done),
            "ttft_ms_p99": _r(percentile([(r.first_s - r.arrival_s) * 1e3 for r in done], 0.99)),
            "deadline_met": sum(1 for r in done if r.deadline_s is not None and r.last_s <= r.deadline_s),
            "deadline_requests": sum(1 for r in rs if r.deadline_s is not None)}
    return out


def result_of(cluster, wall_s: float) -> dict:
    """The JSON result of a finished run (deterministic apart from `wall_s` and `events_per_s`, kept apart under
    `run` so that results can be compared byte for byte without them)."""
    reqs = sorted(cluster.done, key=lambda r: r.seq_no)
    end = max((r.last_s for r in reqs if r.last_s is not None), default=cluster.now)
    summary = latency_summary(reqs, end)
    spec = cluster.spec
    summary.update(slo_summary(reqs, spec.ttft_slo_ms, spec.tpot_slo_ms, end))
    if spec.slo_grid:
        summary["slo_grid"] = [slo_summary(reqs, ttft, tpot, end) for ttft, tpot in spec.slo_grid]
    stats = cluster.worker_stats()
    lifetime = sum(max((w["retired_s"] if w["retired_s"] is not None else end) - w["started_s"], 0.0) for w in stats)
    slots = sum(w["max_num_seqs"] * max((w["retired_s"] if w["retired_s"] is not None else end) - w["started_s"], 0.0)
                for w in stats)
    summary["utilisation"] = _r(sum(w["busy_s"] for w in stats) / lifetime, 4) if lifetime > 0 else None
    summary["batch_occupancy"] = _r(sum(w["seq_s"] for w in stats) / slots, 4) if slots > 0 else None
    summary["worker_seconds"] = _r(_worker_seconds(cluster.timeline, end), 1)
    summary["max_workers"] = max((n + s for _, n, s in cluster.timeline), default=0)
    busy = [w["busy_s"] for w in stats if w["max_num_seqs"]]
    summary["busy_max_over_mean"] = _r(max(busy) / (sum(busy) / len(busy)), 3) if busy and sum(busy) > 0 else None
    summary["steps"] = sum(w["steps"] for w in stats)
    summary["preemptions"] = sum(w["slot_preemptions"] for w in stats)
    lora = [w["lora"] for w in stats if "lora" in w]
    if lora:  # LoRA: reads from storage, copies into slots, admissions that found / waited for their adapter
        for key in lora[0]:
            summary[key] = sum(x[key] for x in lora)
    return {"summary": summary, "tenants": tenant_summary(reqs),
            "timeline": [list(x) for x in _thin(cluster.timeline)],
            "throughput_timeline": _throughput(reqs, end),
            "run": {"events": cluster.processed, "wall_s": round(wall_s, 2),
                    "events_per_s": round(cluster.processed / wall_s) if wall_s > 0 else None}}


def _worker_seconds(timeline: list, end: float) -> float:
    total = 0.0
    for (t, n, s), nxt in zip(timeline, [*timeline[1:], (end, 0, 0)]):
        total += (n + s) * max(nxt[0] - t, 0.0)
    return total


def _thin(timeline: list, most: int = 2000) -> list:
    step = max(1, len(timeline) // most)
    return timeline[::step] + ([timeline[-1]] if timeline and (len(timeline) - 1) % step else [])


def _throughput(reqs: list, end: float, buckets: int = 200) -> list:
    """[bucket start s, output tokens/s] with each request's tokens spread evenly from its first to last token."""
    if end <= 0:
        return []
    width = end / buckets
    out = [0.0] * buckets
    for r in reqs:
        if r.error or r.first_s is None:
            continue
        a, b = int(r.first_s / width), min(int(r.last_s / width), buckets - 1)
        for i in range(min(a, buckets - 1), b + 1):
            out[i] += r.tokens_out / (b - min(a, buckets - 1) + 1)
    return [[round(i * width, 3), round(x / width, 1)] for i, x in enumerate(out)]


def plot(result: dict, path: str) -> None:
    """Throughput and replicas over time, latency percentiles, per-tenant service: one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    tt = result["throughput_timeline"]
    ax[0][0].plot([x[0] for x in tt], [x[1] for x in tt])
    ax[0][0].set(title="output tokens/s", xlabel="s")
    tl = result["timeline"]
    ax[0][1].step([x[0] for x in tl], [x[1] for x in tl], where="post", label="serving")
    ax[0][1].step([x[0] for x in tl], [x[1] + x[2] for x in tl], where="post", label="serving + starting")
    ax[0][1].set(title="workers", xlabel="s")
    ax[0][1].legend()
    names = ["ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99"]
    ax[1][0].bar(names, [s.get(n) or 0 for n in names])
    ax[1][0].set(title="latency (ms)")
    ax[1][0].tick_params(axis="x", labelsize=7)
    tenants = result["tenants"]
    ax[1][1].bar(list(tenants), [t["service_tokens"] for t in tenants.values()])
    ax[1][1].set(title="service per tenant (prompt + 2 x output tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
