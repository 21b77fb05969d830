"""A minimal OTLP/gRPC trace receiver for tests: appends one JSON line per span to a file.

usage: python -m tests.support.otlp_receiver PORT OUT.jsonl
"""

import json
import sys
from concurrent import futures

import grpc
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


def main() -> None:
    port, path = int(sys.argv[1]), sys.argv[2]
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(path), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("receiving", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
