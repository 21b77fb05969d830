"""Telemetry set-up shared by every service: logs, traces and metrics over OTLP, metrics as Prometheus text.

Every service calls setup_telemetry(name, metrics_port) once at start:
- logs: one format, `TIME SERVICE LEVEL message`, on stderr;
- traces: when OTEL_EXPORTER_OTLP_ENDPOINT is set, gRPC servers and clients are instrumented
  (W3C trace context travels in gRPC metadata), so one request is one trace across gateway,
  router, prefill, kvstore and decode;
- metrics: one MeterProvider; every instrument is exported over OTLP every interval when the
  endpoint is set, and rendered as Prometheus text on GET /metrics of the metrics port (and of
  the gateway's HTTP port).

Instrument names are OpenTelemetry names (dots). Prometheus names are derived once, here: the
first dot of a `vllm.` or `meshserve.` name becomes a colon and the others underscores, so
`vllm.num_requests_running` is scraped as `vllm:num_requests_running`, as vLLM's own server names
it (dashboards and autoscaler recipes work unchanged); counters get `_total`, and a unit the name
does not already carry becomes a suffix (`ms` -> `_milliseconds`, `s` -> `_seconds`, `By` -> `_bytes`).
The list of metrics is in docs/METRICS.md.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry import metrics, trace

from services.common import envs

log = logging.getLogger("meshserve.telemetry")
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
UNIT_SUFFIX = {"ms": "_milliseconds", "s": "_seconds", "By": "_bytes"}
_reader = None  # the pull reader behind /metrics, once setup_metrics ran
POOL_ATTRIBUTE = "meshserve.pool"  # a worker's resource attribute: the pool the autoscaler counts it in
WAITING_FOR_WORKER = "meshserve.gateway.waiting_for_worker"  # a gateway's gauge, per pool: requests it holds because
# that pool has no worker at all (the autoscaler's signal to scale a pool from zero)
QUEUE_DEPTH = "meshserve.gateway.queue_depth"  # a gateway's gauges of its admission queue, per pool (the role whose
QUEUE_OLDEST_WAIT = "meshserve.gateway.queue_oldest_wait"  # credits it waits for), tenant, band and priority
# the Gateway API Inference Extension's flow-control names for the same queue (Prometheus: inference_extension_...)
FLOW_QUEUE_SIZE = "inference_extension.flow_control.queue_size"
FLOW_SATURATION = "inference_extension.flow_control.pool_saturation"
FLOW_QUEUE_DURATION = "inference_extension.flow_control.request_queue_duration"
QUEUE_WAIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 60, 120)


def _resource(service_name: str, attributes: dict | None):
    """service.name, host.name (a container's hostname tells replicas of one service apart in a trace),
    service.instance.id (host and process: one per process, also where several share a host), and more."""
    from opentelemetry.sdk.resources import Resource

    host = socket.gethostname()
    return Resource.create({"service.name": service_name, "host.name": host,
                            "service.instance.id": f"{host}:{os.getpid()}", **(attributes or {})})


def setup_tracing(service_name: str, attributes: dict | None = None) -> None:
    if not envs.OTLP_ENDPOINT.get():
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=_resource(service_name, attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(insecure=True), schedule_delay_millis=200))
    trace.set_tracer_provider(provider)
    GrpcAioInstrumentorServer().instrument()
    GrpcAioInstrumentorClient().instrument()


def setup_metrics(service_name: str, interval_ms: int | None = None, attributes: dict | None = None) -> None:
    """The process's MeterProvider: a pull reader for /metrics, plus OTLP export when an endpoint is set
    (OTEL_EXPORTER_OTLP_ENDPOINT, or OTEL_EXPORTER_OTLP_METRICS_ENDPOINT for metrics alone: the autoscaler's).

    interval_ms defaults to OTEL_METRIC_EXPORT_INTERVAL (the SDK's variable), else 5000. attributes: more
    resource attributes (a worker's `meshserve.pool`)."""
    global _reader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader, PeriodicExportingMetricReader

    _reader = InMemoryMetricReader()
    readers = [_reader]
    if envs.OTLP_ENDPOINT.get() or envs.OTLP_METRICS_ENDPOINT.get():
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        interval = interval_ms or envs.METRIC_EXPORT_INTERVAL.get()
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(insecure=True),
                                                     export_interval_millis=interval))
    metrics.set_meter_provider(MeterProvider(resource=_resource(service_name, attributes), metric_readers=readers))


def setup_telemetry(service_name: str, metrics_port: int | None = None, host: str = "127.0.0.1",
                    log_name: str | None = None, attributes: dict | None = None) -> int | None:
    """Logs, traces and metrics for a service; serves /metrics on metrics_port (0 = any free port, None
    or a negative port = not served). Returns the port /metrics is served on, or None. attributes: resource
    attributes beyond service.name."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {log_name or service_name} %(levelname)s %(message)s")
    setup_tracing(service_name, attributes)
    setup_metrics(service_name, attributes=attributes)
    if metrics_port is None or metrics_port < 0:
        return None
    port = serve_metrics(metrics_port, host)
    print(f"{service_name} metrics on http://{host}:{port}/metrics", flush=True)
    return port




def add_metrics_flag(ap) -> None:
    ap.add_argument("--metrics-port", type=int, default=envs.METRICS_PORT.get(),
                    help="serve Prometheus text at GET /metrics on this port (0 = any free port; -1 = off; env "
                         f"{envs.METRICS_PORT.name})")


# ---- Prometheus text ------------------------------------------------------------------------

def prometheus_text(reader=None) -> str:
    """Every metric of this process (or of `reader`, an InMemoryMetricReader) in the Prometheus text
    format; empty before setup_metrics."""
    reader = reader or _reader
    if reader is None:
        return ""
    data = reader.get_metrics_data()
    lines: list[str] = []
    for rm in (data.resource_metrics if data else []):
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                lines += _render(m)
    return "\n".join(lines) + "\n"


def prometheus_name(name: str, unit: str = "", counter: bool = False) -> str:
    prefix, dot, rest = name.partition(".")
    base = f"{prefix}:{rest.replace('.', '_')}" if dot and prefix in ("vllm", "meshserve") else name.replace(".", "_")
    suffix = UNIT_SUFFIX.get(unit, "")
    if suffix and not base.endswith(suffix):
        base += suffix
    return base + ("_total" if counter and not base.endswith("_total") else "")


def _render(metric) -> list[str]:
    from opentelemetry.sdk.metrics.export import Histogram, Sum

    data = metric.data
    counter = isinstance(data, Sum) and data.is_monotonic
    name = prometheus_name(metric.name, metric.unit or "", counter)
    kind = "histogram" if isinstance(data, Histogram) else "counter" if counter else "gauge"
    out = [f"# HELP {name} {metric.description or metric.name}", f"# TYPE {name} {kind}"]
    for p in data.data_points:
        labels = dict(p.attributes or {})
        if kind != "histogram":
            out.append(f"{name}{_labels(labels)} {_number(p.value)}")
            continue
        cumulative = 0
        for bound, count in zip(list(p.explicit_bounds) + [math.inf], p.bucket_counts):
            cumulative += count
            out.append(f"{name}_bucket{_labels({**labels, 'le': _number(bound)})} {cumulative}")
        out.append(f"{name}_sum{_labels(labels)} {_number(p.sum)}")
        out.append(f"{name}_count{_labels(labels)} {p.count}")
    return out


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    quoted = (str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for v in labels.values())
    return "{" + ",".join(f'{k.replace(".", "_")}="{v}"' for k, v in zip(labels, quoted)) + "}"


def _number(v) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v) if isinstance(v, float) else str(v)


class _MetricsHandler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path.split("?")[0] != "/metrics":
            self.send_error(404, "only /metrics is served here")
            return
        body = prometheus_text().encode()
        self.send_response(200)
        self.send_header("Content-Type", PROMETHEUS_CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # scrapes are not worth a log line each
        pass


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Serve GET /metrics from a daemon thread; returns the bound port."""
    server = ThreadingHTTPServer((host, port), _MetricsHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server.server_address[1]
