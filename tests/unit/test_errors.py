"""Errors keep their status across gRPC hops whatever their size (issue 65): a message is cut to fit gRPC's metadata,
a forwarded error keeps its status and retry advice, and only the mesh's own limits are rate limits (429)."""

import grpc
import pytest

from services.common import rpc
from services.common.errors import HTTP_STATUS, MAX_MESSAGE_BYTES, bounded_message, http_status


class FakeRpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


def test_a_long_message_is_cut_with_its_length_and_a_short_one_kept():
    assert bounded_message("short") == "short"
    long = "é" * 5000  # two bytes a character: the cut falls on a character boundary
    cut = bounded_message(long)
    assert len(cut.encode()) <= MAX_MESSAGE_BYTES and cut.endswith("[message cut: 5,000 characters in all]")
    cut.encode().decode()  # valid UTF-8


@pytest.mark.parametrize("code", [c for c in grpc.StatusCode if c.name in HTTP_STATUS])
def test_every_forwarded_status_keeps_its_http_status(code):
    trailing = (("retry-after-ms", "250"),) if code.name in ("RESOURCE_EXHAUSTED", "UNAVAILABLE") else ()
    err = rpc.forward_rpc_error(FakeRpcError(code, "x" * 10_000, trailing), "worker:1")
    assert http_status(err) == HTTP_STATUS[code.name] and err.peer == "worker:1"
    assert len(str(err).encode()) <= MAX_MESSAGE_BYTES
    assert err.retry_after_ms == (250 if trailing else None)


def test_grpcs_own_size_refusal_is_no_rate_limit():
    err = rpc.forward_rpc_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                             "received metadata size exceeds hard limit"))
    assert http_status(err) == 500
    ours = rpc.forward_rpc_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "tenant over its limit",
                                              (("retry-after-ms", "1500"),)))
    assert http_status(ours) == 429 and ours.retry_after_ms == 1500
