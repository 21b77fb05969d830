"""Fuzzing the public faces (issue 19), bounded for CI: hypothesis over every GenerateRequest field (gRPC) and over
OpenAI JSON bodies (HTTP). Every answer is a status the interface defines for bad input, never INTERNAL or a 500,
and the gateway's memory stays bounded."""

import json
import math
import urllib.error
import urllib.request

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc

INT64 = st.integers(-(2**63), 2**63 - 1)
SMALL = st.one_of(st.integers(-3, 40), INT64)  # mostly plausible values, sometimes extreme ones
REAL = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-2, 3))
TEXT = st.one_of(st.binary(max_size=300), st.text(max_size=200).map(str.encode))
NAME = st.one_of(st.just(""), st.just("tiny"), st.text(max_size=300))

# What bad input may get (docs/INTERFACES.md "Errors"); OK when the fuzzed request happens to be valid.
GRPC_ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
HTTP_ALLOWED = {200, 400, 404, 413, 429, 504}
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def generate_requests(draw):
    """A valid request with a few of its fields fuzzed (an all-random one is refused at its first field)."""
    req = pb.GenerateRequest(text=b"Kalo mine", sampling=pb.Sampling(max_tokens=4, temperature=0.0))
    s = req.sampling
    fuzz = {
        "max_tokens": lambda: setattr(s, "max_tokens", draw(st.one_of(st.integers(-2, 12), INT64))),
        "top_k": lambda: setattr(s, "top_k", draw(SMALL)),
        "stop": lambda: s.stop.extend(draw(st.lists(TEXT, max_size=3))),
        "stop_token_ids": lambda: s.stop_token_ids.extend(draw(st.lists(SMALL, max_size=3))),
        "flags": lambda: (setattr(s, "ignore_eos", draw(st.booleans())), setattr(s, "logprobs", draw(st.booleans()))),
        "min_tokens": lambda: setattr(s, "min_tokens", draw(SMALL)),
        "min_p": lambda: setattr(s, "min_p", draw(REAL)),
        "temperature": lambda: setattr(s, "temperature", draw(REAL)),
        "top_p": lambda: setattr(s, "top_p", draw(REAL)),
        "seed": lambda: setattr(s, "seed", draw(INT64)),
        "no_sampling": lambda: req.ClearField("sampling"),
        "request_id": lambda: setattr(req, "request_id", draw(NAME)),
        "model": lambda: setattr(req, "model", draw(NAME)),
        "adapter": lambda: setattr(req, "adapter", draw(st.sampled_from(["", "sql"]))),
        "priority": lambda: setattr(req, "priority", draw(SMALL)),
        "deadline_ms": lambda: setattr(req, "deadline_ms", draw(SMALL)),
        "criticality": lambda: setattr(req, "criticality", draw(st.sampled_from(["", "critical", "sheddable", "x"]))),
        "slo": lambda: (setattr(req, "slo_ttft_ms", draw(SMALL)), setattr(req, "slo_tpot_ms", draw(SMALL))),
        "text": lambda: setattr(req, "text", draw(TEXT)),
        "token_ids": lambda: req.token_ids.ids.extend(draw(st.lists(SMALL, max_size=50))),
        "no_prompt": lambda: req.ClearField("prompt"),
    }
    for name in draw(st.lists(st.sampled_from(sorted(fuzz)), min_size=1, max_size=3, unique=True)):
        fuzz[name]()
    return req


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@pytest.fixture(scope="module")
def gateway_rss(unified):
    pid = unified.proc("gateway").popen.pid
    before = rss_kib(pid)
    yield
    grown = rss_kib(pid) - before
    assert grown < 300 * 1024, f"the gateway grew {grown} KiB under fuzzing"


@FUZZ
@given(req=generate_requests())
def test_any_grpc_request_gets_a_defined_status(unified, gateway_rss, req):
    with grpc.insecure_channel(unified.gateway) as ch:
        try:
            for _ in pb_grpc.GenerationStub(ch).Generate(req, timeout=30):
                pass
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
            assert e.details(), code
    event(code.name)  # the spread of outcomes, with --hypothesis-show-statistics
    assert code in GRPC_ALLOWED, (code, req)


JSON_VALUE = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), REAL.filter(math.isfinite),
                                    st.text(max_size=40)),
                          lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8),
                                                                                               inner, max_size=4)),
                          max_leaves=12)
FIELDS = {"model": NAME, "prompt": st.one_of(st.text(max_size=100), st.lists(SMALL, max_size=20), JSON_VALUE),
          "max_tokens": st.one_of(st.integers(-2, 10), JSON_VALUE), "temperature": st.one_of(REAL.filter(math.isfinite),
                                                                                             JSON_VALUE),
          "top_p": JSON_VALUE, "top_k": JSON_VALUE, "seed": st.one_of(st.integers(-1, 2**70), JSON_VALUE),
          "stop": st.one_of(st.text(max_size=20), st.lists(st.text(max_size=10), max_size=20), JSON_VALUE),
          "stream": st.one_of(st.booleans(), JSON_VALUE), "n": JSON_VALUE, "logprobs": JSON_VALUE,
          "priority": JSON_VALUE, "deadline_ms": JSON_VALUE, "slo_ttft_ms": JSON_VALUE,
          "criticality": st.one_of(st.sampled_from(["critical", "standard", "sheddable", "x"]), JSON_VALUE),
          "messages": st.one_of(
              st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                              "content": st.one_of(st.text(max_size=60), JSON_VALUE)}), max_size=3),
              JSON_VALUE)}


@st.composite
def openai_bodies(draw):
    """A valid body with a few fields fuzzed, or (one case in ten) random bytes."""
    chat = draw(st.booleans())
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "Kalo mine"}]} if chat else {"prompt": "Kalo mine"})
    for k in draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=3, unique=True)):
        body[k] = draw(FIELDS[k])
    path = "/v1/chat/completions" if chat else "/v1/completions"
    raw = json.dumps(body).encode() if draw(st.integers(0, 9)) else draw(st.binary(max_size=200))
    return path, raw


@FUZZ
@given(case=openai_bodies())
def test_any_openai_body_gets_a_defined_status(unified, gateway_rss, case):
    path, raw = case
    req = urllib.request.Request(unified.http + path, data=raw, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status = r.status
            r.read()
    except urllib.error.HTTPError as e:
        status = e.code
        reply = json.loads(e.read())
        assert reply["error"]["message"], reply
    event(str(status))
    assert status in HTTP_ALLOWED, (status, path, raw[:200])
