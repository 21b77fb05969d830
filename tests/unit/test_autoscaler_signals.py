"""OTLP metrics from real worker instruments (WorkerMetrics, encoded as the OTLP exporter encodes them) turned into
pool samples: token rates, interval p90s, queue, KV occupancy, CPU, stale workers dropped."""

import os

from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

from services.autoscaler.signals import PoolSignals
from tests.support.autoscaler import step, worker


def export(signals: PoolSignals, reader, now: float) -> None:
    signals.ingest(encode_metrics(reader.get_metrics_data()), now)


def test_rates_percentiles_queue_and_kv_from_otlp():
    m, reader = worker("unified", "u0")
    m.watch_cpu([os.getpid()], 1)
    signals = PoolSignals()
    export(signals, reader, 0.0)
    signals.sample("unified", 0.0)
    for i in range(10):  # ten requests: 100-token prompts, first token 0.3 s after arrival, then 4 more tokens
        step(m, f"r{i}", 1, 100, arrival=0.0, now=0.3, queued=500, kv_used=40)
        for k in range(2, 6):
            step(m, f"r{i}", k, 100, arrival=0.0, now=0.3 + 0.02 * (k - 1), queued=500, kv_used=40, finished=k == 5)
    export(signals, reader, 10.0)
    s = signals.sample("unified", 10.0)
    assert s.ready == 1
    assert s.prompt_tokens_per_s == 100.0  # 1,000 prompt tokens over 10 s
    assert s.output_tokens_per_s == 5.0  # 50 tokens
    assert s.requests_per_s == 1.0
    assert s.ttft_p90_s == 0.5  # 0.3 s: vLLM's (0.25, 0.5] bucket, reported as its upper bound
    assert s.itl_p90_s == 0.025  # 0.02 s: the (0.01, 0.025] bucket
    assert s.queued_prefill_tokens == 500 and s.kv_usage == 0.4
    assert 0.0 <= s.cpu_util <= 1.0
    export(signals, reader, 20.0)
    quiet = signals.sample("unified", 20.0)  # nothing new: zero rates, no percentile
    assert (quiet.prompt_tokens_per_s, quiet.ttft_p90_s) == (0.0, None)


def test_pools_by_role_and_stale_workers_drop_out():
    signals = PoolSignals(stale_s=15)
    d0, r0 = worker("decode", "d0")
    d1, r1 = worker("decode", "d1")
    p0, rp = worker("prefill", "p0")
    for m in (d0, d1, p0):
        step(m, "x", 1, 10, 0.0, 0.1)
    export(signals, r0, 0.0)
    export(signals, r1, 0.0)
    export(signals, rp, 0.0)
    assert signals.live("decode", 1.0) == ["d0", "d1"] and signals.live("prefill", 1.0) == ["p0"]
    export(signals, r0, 20.0)
    assert signals.live("decode", 20.0) == ["d0"]  # d1 silent for 20 s
    assert signals.sample("decode", 20.0, starting=2).starting == 2


def test_a_named_pool_is_counted_apart_from_its_role():
    """An adapter group's workers (unified, pool lora-a) are their own pool: their tokens are not the role's."""
    signals = PoolSignals()
    plain, rp = worker("unified", "u0")
    grouped, rg = worker("unified", "la0", pool="lora-a")
    for m, r in ((plain, rp), (grouped, rg)):
        step(m, "first", 1, 100, 0.0, 0.1)
        export(signals, r, 0.0)
    signals.sample("unified", 0.0)
    signals.sample("lora-a", 0.0)
    step(grouped, "x", 1, 300, 0.0, 0.1)
    for r in (rp, rg):
        export(signals, r, 10.0)
    assert signals.live("unified", 10.0) == ["u0"] and signals.live("lora-a", 10.0) == ["la0"]
    assert signals.sample("lora-a", 10.0).prompt_tokens_per_s == 30.0
    assert signals.sample("unified", 10.0).prompt_tokens_per_s == 0.0


def test_requests_a_gateway_holds_for_an_empty_pool_reach_that_pools_sample():
    """The gateway's waiting_for_worker gauge (per pool), summed over gateways, stale ones dropped: what scales a
    pool from zero, where no worker exports anything."""
    from opentelemetry.metrics import Observation

    from services.common.telemetry import WAITING_FOR_WORKER

    signals, readers = PoolSignals(stale_s=15.0), []
    for instance, held in (("gw-a", {"unified": 2}), ("gw-b", {"unified": 1, "decode": 3})):
        reader = InMemoryMetricReader()
        provider = MeterProvider(metric_readers=[reader], resource=Resource.create(
            {"service.name": "gateway", "service.instance.id": instance}))
        provider.get_meter("t").create_observable_gauge(
            WAITING_FOR_WORKER, [lambda o, held=held: [Observation(n, {"pool": p}) for p, n in held.items()]])
        readers.append(reader)
    for reader in readers:
        export(signals, reader, 100.0)
    assert signals.sample("unified", 101.0).waiting_for_worker == 3
    assert signals.sample("decode", 101.0).waiting_for_worker == 3
    assert signals.sample("prefill", 101.0).waiting_for_worker == 0
    export(signals, readers[0], 110.0)  # gw-b stops reporting: after stale_s it no longer counts
    assert signals.sample("unified", 120.0).waiting_for_worker == 2


def test_the_gateways_admission_queues_reach_the_pool_they_wait_for():
    """Depth summed and the oldest wait at its maximum, over gateways, tenants and bands, for the pool the queue
    waits on (late binding keeps the backlog at the gateway, where the engines' metrics cannot see it)."""
    from opentelemetry.metrics import Observation

    from services.common.telemetry import QUEUE_DEPTH, QUEUE_OLDEST_WAIT

    signals, readers = PoolSignals(stale_s=15.0), []
    queues = {"gw-a": [("A", "standard", 4, 2.5), ("B", "critical", 1, 0.2)], "gw-b": [("A", "standard", 3, 6.0)]}
    for instance, rows in queues.items():
        reader = InMemoryMetricReader()
        meter = MeterProvider(metric_readers=[reader], resource=Resource.create(
            {"service.name": "gateway", "service.instance.id": instance})).get_meter("t")
        for name, index in ((QUEUE_DEPTH, 2), (QUEUE_OLDEST_WAIT, 3)):
            meter.create_observable_gauge(name, [lambda o, rows=rows, i=index: [
                Observation(r[i], {"tenant": r[0], "band": r[1], "priority": "0", "pool": "decode"}) for r in rows]])
        readers.append(reader)
    for reader in readers:
        export(signals, reader, 100.0)
    sample = signals.sample("decode", 101.0)
    assert (sample.gateway_queued, sample.gateway_queue_wait_s) == (8, 6.0)
    assert signals.sample("prefill", 101.0).gateway_queued == 0
