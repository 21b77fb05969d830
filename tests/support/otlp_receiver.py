"""A minimal OTLP/gRPC receiver for tests: one JSON line per span, and per metric data point.

usage: python -m tests.support.otlp_receiver PORT SPANS.jsonl [METRICS.jsonl]
"""

import json
import sys
from concurrent import futures

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, path: str):
        self.path = path

    def Export(self, request, context):
        with open(self.path, "a") as f:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        f.write(json.dumps({"service": attrs.get("service.name"), "trace_id": span.trace_id.hex(),
                                            "name": span.name}) + "\n")
        return trace_service_pb2.ExportTraceServiceResponse()


class MetricsReceiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, path: str):
        self.path = path

    def Export(self, request, context):
        with open(self.path, "a") as f:
            for rm in request.resource_metrics:
                attrs = {a.key: a.value.string_value for a in rm.resource.attributes}
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        f.write(json.dumps({"service": attrs.get("service.name"), "name": m.name,
                                            "value": _value(m)}) + "\n")
        return metrics_service_pb2.ExportMetricsServiceResponse()


def _value(metric) -> float:
    """The metric's total over its data points: sum or gauge values, histogram counts."""
    kind = metric.WhichOneof("data")
    points = getattr(metric, kind).data_points
    if kind == "histogram":
        return sum(p.count for p in points)
    return sum(p.as_double if p.WhichOneof("value") == "as_double" else p.as_int for p in points)


def main() -> None:
    port, path = int(sys.argv[1]), sys.argv[2]
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(path), server)
    if len(sys.argv) > 3:
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(MetricsReceiver(sys.argv[3]), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("receiving", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
