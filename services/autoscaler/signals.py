"""From OTLP metrics to PoolSamples: what the workers export, turned into one observation per pool.

Workers export cumulative OpenTelemetry metrics (services/worker/metrics.py) with resource attributes
`meshserve.pool` = their pool (a role, or a named group of workers such as one adapter group's; without it
`service.name`, their role, is the pool) and data-point attribute `worker_id`. ingest() keeps, per worker,
the latest value of each metric the policies read; sample() turns the change since the previous sample
into rates and interval percentiles:

- prompt / output tokens per second: `vllm.prompt_tokens`, `vllm.generation_tokens` (counters);
- requests per second: first tokens sampled (the TTFT histogram's count), or finished requests on decode
  workers (the e2e histogram's count), whichever is larger;
- TTFT and inter-token p90: from the histograms' bucket counts over the interval (the bucket's upper bound);
- queued prefill tokens (sum) and KV occupancy (the fullest worker): gauges, latest;
- CPU utilisation: `meshserve.worker.cpu_seconds` (servicer + engine core) over the interval, per core the
  worker uses, averaged over workers (the HPA baseline's signal);
- requests waiting for a worker: the gateways' `meshserve.gateway.waiting_for_worker` gauge (per pool, the
  requests a gateway holds because that pool has no worker at all), summed over gateways: what scales a pool
  from zero, where no worker exports anything;
- the gateways' admission queues: `meshserve.gateway.queue_depth` summed and `meshserve.gateway.queue_oldest_wait`
  (the oldest request's wait) at its maximum, over gateways, tenants, bands and priorities, for the pool whose
  capacity the queue waits for (the gauges' `pool`): requests wait there, not in the engines, when the pool is
  saturated (late binding), so the engines' own queues say nothing of it.

A worker silent for `stale_s` no longer counts. Pure apart from the parsing: the clock is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.telemetry import POOL_ATTRIBUTE, QUEUE_DEPTH, QUEUE_OLDEST_WAIT, WAITING_FOR_WORKER
from services.policy.scaling import PoolSample

COUNTERS = {"vllm.prompt_tokens": "prompt", "vllm.generation_tokens": "output", "meshserve.worker.cpu_seconds": "cpu"}
GAUGES = {"meshserve.worker.queued_prefill_tokens": "queued", "vllm.kv_cache_usage_perc": "kv",
          "vllm.num_requests_running": "running", "vllm.num_requests_waiting": "waiting",
          "meshserve.worker.cpu_cores": "cores"}
HISTOGRAMS = {"vllm.time_to_first_token_seconds": "ttft", "vllm.inter_token_latency_seconds": "itl",
              "vllm.e2e_request_latency_seconds": "e2e"}


@dataclass
class WorkerSeries:
    pool: str
    seen_s: float = 0.0
    values: dict = field(default_factory=dict)  # name -> float, or (bounds, counts, count) for histograms
    previous: dict = field(default_factory=dict)  # values at the previous sample()
    sampled: bool = False  # it was in a previous sample: a metric new since then started from zero


def _attr(attrs, key: str) -> str:
    for a in attrs:
        if a.key == key:
            return a.value.string_value
    return ""


def _number(point) -> float:
    return point.as_double if point.WhichOneof("value") == "as_double" else float(point.as_int)


class PoolSignals:
    def __init__(self, stale_s: float = 15.0):
        self.stale_s = stale_s
        self.workers: dict[str, WorkerSeries] = {}
        self.last_sample_s: dict[str, float] = {}
        self.waiting: dict[tuple, tuple] = {}  # (gateway instance, pool) -> (requests waiting for a worker, seen)
        self.queues: dict[tuple, tuple] = {}  # (gateway instance, metric, pool, series) -> (value, seen)

    def ingest(self, request, now: float) -> int:
        """Record an ExportMetricsServiceRequest; returns how many data points were used."""
        used = 0
        for rm in request.resource_metrics:
            pool = _attr(rm.resource.attributes, POOL_ATTRIBUTE) or _attr(rm.resource.attributes, "service.name")
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    if m.name == WAITING_FOR_WORKER:
                        source = _attr(rm.resource.attributes, "service.instance.id") or pool
                        for p in getattr(m, kind).data_points:
                            self.waiting[(source, _attr(p.attributes, "pool"))] = (_number(p), now)
                            used += 1
                        continue
                    if m.name in (QUEUE_DEPTH, QUEUE_OLDEST_WAIT):
                        source = _attr(rm.resource.attributes, "service.instance.id") or pool
                        for p in getattr(m, kind).data_points:
                            series = tuple(sorted((a.key, a.value.string_value) for a in p.attributes))
                            self.queues[(source, m.name, _attr(p.attributes, "pool"), series)] = (_number(p), now)
                            used += 1
                        continue
                    if m.name not in COUNTERS and m.name not in GAUGES and m.name not in HISTOGRAMS:
                        continue
                    for p in getattr(m, kind).data_points:
                        worker = _attr(p.attributes, "worker_id")
                        if not worker:
                            continue
                        w = self.workers.setdefault(worker, WorkerSeries(pool))
                        w.pool, w.seen_s = pool, now
                        if kind == "histogram":
                            w.values[m.name] = (tuple(p.explicit_bounds), tuple(p.bucket_counts), p.count)
                        else:
                            w.values[m.name] = _number(p)
                        used += 1
        return used

    def live(self, pool: str, now: float) -> list[str]:
        return sorted(wid for wid, w in self.workers.items() if w.pool == pool and now - w.seen_s <= self.stale_s)

    def sample(self, pool: str, now: float, starting: int = 0, ready: int | None = None) -> PoolSample:
        """The pool's observation since its previous sample (rates over that interval)."""
        live = [self.workers[w] for w in self.live(pool, now)]
        dt = now - self.last_sample_s.get(pool, now)
        self.last_sample_s[pool] = now
        rates = {"prompt": 0.0, "output": 0.0, "cpu": 0.0}
        hist = {"ttft": [], "itl": [], "e2e": []}
        queued = kv = cpu_util = 0.0
        for w in live:
            for name, key in COUNTERS.items():
                now_v, then_v = w.values.get(name), w.previous.get(name, 0.0 if w.sampled else None)
                if now_v is not None and then_v is not None and dt > 0:
                    rates[key] += max(now_v - then_v, 0.0) / dt
            if dt > 0 and "meshserve.worker.cpu_seconds" in w.previous:
                used = max(w.values["meshserve.worker.cpu_seconds"] - w.previous["meshserve.worker.cpu_seconds"], 0)
                cpu_util += min(used / dt / max(w.values.get("meshserve.worker.cpu_cores", 1.0), 1.0), 1.0)
            for name, key in HISTOGRAMS.items():
                if name in w.values and (name in w.previous or w.sampled):
                    bounds = w.values[name][0]
                    before = w.previous.get(name, (bounds, (0,) * (len(bounds) + 1), 0))
                    hist[key].append(_delta(before, w.values[name]))
            queued += w.values.get("meshserve.worker.queued_prefill_tokens", 0.0)
            kv = max(kv, w.values.get("vllm.kv_cache_usage_perc", 0.0))
            w.previous, w.sampled = dict(w.values), True
        waiting = sum(n for (_, p), (n, seen) in self.waiting.items() if p == pool and now - seen <= self.stale_s)
        queue = {QUEUE_DEPTH: [], QUEUE_OLDEST_WAIT: []}
        for (_, name, p, _), (value, seen) in self.queues.items():
            if p == pool and now - seen <= self.stale_s:
                queue[name].append(value)
        starts = sum(sum(d[1]) for d in hist["ttft"])
        finishes = sum(sum(d[1]) for d in hist["e2e"])
        return PoolSample(now, len(live) if ready is None else ready, starting,
                          prompt_tokens_per_s=rates["prompt"], output_tokens_per_s=rates["output"],
                          requests_per_s=max(starts, finishes) / dt if dt > 0 else 0.0,
                          queued_prefill_tokens=queued, kv_usage=kv, ttft_p90_s=_p90(hist["ttft"]),
                          itl_p90_s=_p90(hist["itl"]), cpu_util=cpu_util / len(live) if live else 0.0,
                          waiting_for_worker=waiting, gateway_queued=sum(queue[QUEUE_DEPTH]),
                          gateway_queue_wait_s=max(queue[QUEUE_OLDEST_WAIT], default=0.0))


def _delta(before, after) -> tuple:
    """(bounds, per-bucket counts over the interval) of a cumulative histogram (a reset restarts from zero)."""
    bounds, counts, total = after
    b_bounds, b_counts, b_total = before
    if b_bounds != bounds or total < b_total:
        return bounds, counts
    return bounds, tuple(max(a - b, 0) for a, b in zip(counts, b_counts))


def _p90(deltas: list) -> float | None:
    """The 90th percentile over merged interval histograms, as its bucket's upper bound (the last finite bound
    for the overflow bucket); None without observations."""
    merged: dict = {}
    for bounds, counts in deltas:
        for i, c in enumerate(counts):
            edge = bounds[i] if i < len(bounds) else (bounds[-1] if bounds else 0.0) * 2
            merged[edge] = merged.get(edge, 0) + c
    total = sum(merged.values())
    if not total:
        return None
    seen = 0
    for edge in sorted(merged):
        seen += merged[edge]
        if seen >= 0.9 * total:
            return edge
    return None
