"""An OTLP/gRPC receiver of our own: spans and metric points as JSON lines, a small query API over HTTP, and the
metrics passed on to the autoscaler.

It stands in for the OpenTelemetry Collector and Jaeger where their images cannot be had (deploy's local Compose
override, docs/OPERATIONS.md) and is the receiver the tests run. It is not a collector: no batching, sampling or
retries; a forward that fails is dropped and counted.

    python -m services.common.otlp_receiver --port 4317 --spans /data/spans.jsonl \\
        [--metrics FILE] [--http-port 16686] [--forward-metrics autoscaler:50054]

HTTP (--http-port): GET /api/services (the service names seen), GET /api/traces/TRACE_ID (that trace's spans),
GET /api/spans?service=NAME&limit=N (the latest spans, newest last), GET /health.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections import deque
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

KEPT_SPANS = 100_000  # in memory, for the HTTP API; the file keeps every one


def _attributes(resource) -> dict:
    return {a.key: a.value.string_value for a in resource.attributes}


class SpanStore:
    """Spans as dicts, appended to a JSON-lines file (when given) and kept in memory for queries."""

    def __init__(self, path: str | None):
        self.path = path
        self.spans: deque = deque(maxlen=KEPT_SPANS)
        self.lock = threading.Lock()

    def add(self, rows: list[dict]) -> None:
        with self.lock:
            self.spans.extend(rows)
            if self.path:
                with open(self.path, "a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in rows)

    def query(self, trace_id: str | None = None, service: str | None = None, limit: int = 1000) -> list[dict]:
        with self.lock:
            rows = [r for r in self.spans if (trace_id is None or r["trace_id"] == trace_id)
                    and (service is None or r["service"] == service)]
        return rows[-limit:]

    def services(self) -> list[str]:
        with self.lock:
            return sorted({r["service"] for r in self.spans if r["service"]})


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, store: SpanStore):
        self.store = store

    def Export(self, request, context):
        rows = []
        for rs in request.resource_spans:
            attrs = _attributes(rs.resource)
            for ss in rs.scope_spans:
                rows += [{"service": attrs.get("service.name"), "host": attrs.get("host.name"),
                          "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                          "parent_id": span.parent_span_id.hex(), "name": span.name,
                          "start_ns": span.start_time_unix_nano, "end_ns": span.end_time_unix_nano}
                         for span in ss.spans]
        self.store.add(rows)
        return trace_service_pb2.ExportTraceServiceResponse()


class MetricsReceiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    """Writes one line per metric (its total over the data points) and passes the request on, unchanged, to
    forward (the autoscaler's OTLP port), as the collector's otlp/autoscaler exporter does."""

    def __init__(self, path: str | None, forward: str | None = None):
        self.path = path
        self.forward = metrics_service_pb2_grpc.MetricsServiceStub(grpc.insecure_channel(forward)) if forward \
            else None
        self.dropped = 0

    def Export(self, request, context):
        if self.path:
            with open(self.path, "a") as f:
                for rm in request.resource_metrics:
                    attrs = _attributes(rm.resource)
                    for sm in rm.scope_metrics:
                        for m in sm.metrics:
                            f.write(json.dumps({"service": attrs.get("service.name"), "name": m.name,
                                                "value": _value(m)}) + "\n")
        if self.forward is not None:
            try:
                self.forward.Export(request, timeout=5)
            except grpc.RpcError:
                self.dropped += 1  # the autoscaler is off (its profile) or starting: metrics are periodic
        return metrics_service_pb2.ExportMetricsServiceResponse()


def _value(metric) -> float:
    """The metric's total over its data points: sum or gauge values, histogram counts."""
    kind = metric.WhichOneof("data")
    points = getattr(metric, kind).data_points
    if kind == "histogram":
        return sum(p.count for p in points)
    return sum(p.as_double if p.WhichOneof("value") == "as_double" else p.as_int for p in points)


def _http_handler(store: SpanStore):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            url = urlparse(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            if url.path == "/health":
                body = {"status": "ok"}
            elif url.path == "/api/services":
                body = {"data": store.services()}
            elif url.path.startswith("/api/traces/"):
                body = {"data": store.query(trace_id=url.path.rsplit("/", 1)[1])}
            elif url.path == "/api/spans":
                try:
                    limit = int(query.get("limit", "1000"))
                except ValueError:
                    return self.send_error(400, "limit must be an integer")
                body = {"data": store.query(service=query.get("service"), limit=limit)}
            else:
                return self.send_error(404, "served: /api/services, /api/traces/ID, /api/spans, /health")
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    return Handler


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m services.common.otlp_receiver", description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True, help="OTLP/gRPC port")
    ap.add_argument("--host", default="127.0.0.1", help="the interface to listen on (0.0.0.0 in a container)")
    ap.add_argument("--spans", default=None, help="append every span here as a JSON line")
    ap.add_argument("--metrics", default=None, help="append every metric here as a JSON line")
    ap.add_argument("--http-port", type=int, default=None, help="serve the query API on this port")
    ap.add_argument("--forward-metrics", default=None, help="pass metrics on to this OTLP/gRPC address")
    args = ap.parse_args(argv)
    store = SpanStore(args.spans)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceReceiver(store), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(
        MetricsReceiver(args.metrics, args.forward_metrics), server)
    if not server.add_insecure_port(f"{args.host}:{args.port}"):
        raise SystemExit(f"cannot listen on {args.host}:{args.port}")
    server.start()
    if args.http_port is not None:
        http = ThreadingHTTPServer((args.host, args.http_port), _http_handler(store))
        threading.Thread(target=http.serve_forever, daemon=True).start()
    print(f"receiving OTLP on {args.host}:{args.port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
