"""Prometheus text from OpenTelemetry instruments: vLLM-style names, counters, gauges, histograms."""

from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services.common.telemetry import prometheus_name, prometheus_text


def test_names_follow_vllm_and_prometheus_conventions():
    assert prometheus_name("vllm.num_requests_running") == "vllm:num_requests_running"
    assert prometheus_name("vllm.prompt_tokens", counter=True) == "vllm:prompt_tokens_total"
    assert prometheus_name("vllm.time_to_first_token_seconds", "s") == "vllm:time_to_first_token_seconds"
    assert prometheus_name("meshserve.router.decision", "ms") == "meshserve:router_decision_milliseconds"
    assert prometheus_name("meshserve.kv_transfer.bytes", "By", counter=True) == "meshserve:kv_transfer_bytes_total"
    assert prometheus_name("other.thing") == "other_thing"


def test_text_format_of_each_kind():
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    meter.create_counter("vllm.generation_tokens").add(5, {"worker_id": 'w"1'})
    meter.create_observable_gauge("vllm.kv_cache_usage_perc", [lambda o: [Observation(0.25, {"role": "decode"})]])
    h = meter.create_histogram("vllm.e2e_request_latency_seconds", unit="s", explicit_bucket_boundaries_advisory=(1.0,
                                                                                                                  2.0))
    for v in (0.5, 1.5, 9.0):
        h.record(v)
    lines = prometheus_text(reader).splitlines()
    assert "# TYPE vllm:generation_tokens_total counter" in lines
    assert 'vllm:generation_tokens_total{worker_id="w\\"1"} 5' in lines
    assert "# TYPE vllm:kv_cache_usage_perc gauge" in lines
    assert 'vllm:kv_cache_usage_perc{role="decode"} 0.25' in lines
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in lines
    assert [ln for ln in lines if ln.startswith("vllm:e2e_request_latency_seconds_")] == [
        'vllm:e2e_request_latency_seconds_bucket{le="1.0"} 1', 'vllm:e2e_request_latency_seconds_bucket{le="2.0"} 2',
        'vllm:e2e_request_latency_seconds_bucket{le="+Inf"} 3', "vllm:e2e_request_latency_seconds_sum 11.0",
        "vllm:e2e_request_latency_seconds_count 3"]
