"""OpenTelemetry set-up: traces and metrics exported over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set.

Every service calls setup_tracing(name) once at start; gRPC servers and clients are then
instrumented (W3C trace context travels in gRPC metadata), so one request is one trace across
gateway, router, prefill, kvstore and decode.
"""

from __future__ import annotations

import os

from opentelemetry import trace


def setup_tracing(service_name: str) -> None:
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(insecure=True), schedule_delay_millis=200))
    trace.set_tracer_provider(provider)
    GrpcAioInstrumentorServer().instrument()
    GrpcAioInstrumentorClient().instrument()


def setup_metrics(service_name: str, interval_ms: int = 5000) -> None:
    """Metrics over OTLP (every interval_ms) when an endpoint is set; otherwise instruments are no-ops."""
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return
    from opentelemetry import metrics
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    reader = PeriodicExportingMetricReader(OTLPMetricExporter(insecure=True), export_interval_millis=interval_ms)
    metrics.set_meter_provider(MeterProvider(resource=Resource.create({"service.name": service_name}),
                                             metric_readers=[reader]))
