"""Every RPC of every service in the proto is served by a running mesh: none answers UNIMPLEMENTED."""

import threading

import grpc
import pytest
from google.protobuf.message_factory import GetMessageClass

from services.common.pb import meshserve_pb2 as pb

_SUPERVISORS: dict = {}


def supervisor_of(mesh) -> str:
    """The Supervisor service (which `meshserve up` hosts) on the fixture's mesh, started once."""
    if id(mesh) not in _SUPERVISORS:
        from services.mesh.supervisor import serve

        _SUPERVISORS[id(mesh)] = serve(mesh, threading.Lock(), ("unified",), 0, say=lambda line: None)
    return _SUPERVISORS[id(mesh)][1]


ADDRESS = {"Generation": lambda m: m.gateway, "Router": lambda m: m.router, "KVStore": lambda m: m.kvstore,
           "Worker": lambda m: m.workers("unified")[0].address, "Supervisor": supervisor_of}
ALL_RPCS = [(s.name, m) for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods]


def test_the_table_covers_every_service_of_the_proto():
    assert set(ADDRESS) == set(pb.DESCRIPTOR.services_by_name)


@pytest.mark.parametrize("service,method", ALL_RPCS, ids=[f"{s}.{m.name}" for s, m in ALL_RPCS])
def test_rpc_is_served(unified, service, method):
    """An empty request: any answer (OK or a validation error) but UNIMPLEMENTED."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    request, reply = GetMessageClass(method.input_type), GetMessageClass(method.output_type)
    with grpc.insecure_channel(ADDRESS[service](unified)) as ch:
        kind = {(False, False): ch.unary_unary, (False, True): ch.unary_stream, (True, False): ch.stream_unary,
                (True, True): ch.stream_stream}[(method.client_streaming, method.server_streaming)]
        call = kind(path, request_serializer=request.SerializeToString, response_deserializer=reply.FromString)
        arg = iter([request()]) if method.client_streaming else request()
        try:
            result = call(arg, timeout=5)
            if method.server_streaming:
                next(iter(result), None)
        except grpc.RpcError as e:
            assert e.code() != grpc.StatusCode.UNIMPLEMENTED, f"{path}: {e.details()}"
