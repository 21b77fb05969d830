"""The mesh as real processes on loopback: output, cancellation, deadlines, worker loss, bad input."""

import asyncio
import os
import signal
import time

import grpc
import pytest

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from tests.support.mesh import NEW, assert_idle, generate_request, stream_all
from tests.support.reference import assert_matches, greedy, hf_greedy, make_engine, random_prompts, run_all


@pytest.fixture(scope="module")
def prompts():
    shared = random_prompts(1, seed=21, lo=40, hi=40, vocab=4000)[0]
    return random_prompts(20, seed=22, lo=1, hi=90, vocab=4000) + random_prompts(12, seed=23, lo=1, hi=30,
                                                                                 vocab=4000, prefix=shared)


@pytest.fixture(scope="module")
def expected(tiny_model, prompts):
    return hf_greedy(tiny_model, prompts, NEW), run_all(make_engine(tiny_model), prompts, greedy(NEW))


@pytest.mark.parametrize("mode", ["disaggregated", "unified"])
def test_concurrent_streams_match_transformers_and_in_process(mode, request, prompts, expected):
    mesh = request.getfixturevalue(mode)
    refs, in_process = expected
    got = asyncio.run(stream_all(mesh.gateway, prompts))
    assert got == in_process
    assert_matches(got, refs)
    assert_idle(mesh, ["prefill", "decode"] if mode == "disaggregated" else ["unified"])


@pytest.mark.parametrize("mode", ["disaggregated", "unified"])
def test_cancel_mid_stream_frees_everything(mode, request):
    mesh = request.getfixturevalue(mode)

    async def cancel_after_three():
        async with grpc.aio.insecure_channel(mesh.gateway) as ch:
            call = pb_grpc.GenerationStub(ch).Generate(generate_request(list(range(3, 60)), max_tokens=1500))
            seen = 0
            async for r in call:
                seen += len(r.token_ids)
                if seen >= 3:
                    call.cancel()
                    break
            return seen

    seen = asyncio.run(cancel_after_three())
    assert seen >= 3
    assert_idle(mesh, ["prefill", "decode"] if mode == "disaggregated" else ["unified"])


@pytest.mark.parametrize("mode", ["disaggregated", "unified"])
def test_expired_deadline_ends_with_deadline_exceeded(mode, request):
    mesh = request.getfixturevalue(mode)
    req = generate_request(list(range(3, 60)), max_tokens=1900)
    req.deadline_ms = 300
    with grpc.insecure_channel(mesh.gateway) as ch:
        with pytest.raises(grpc.RpcError) as exc:
            for _ in pb_grpc.GenerationStub(ch).Generate(req, timeout=60):
                pass
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_idle(mesh, ["prefill", "decode"] if mode == "disaggregated" else ["unified"])


def _invalid_utf8_request_id() -> bytes:
    good = generate_request([1, 2, 3])
    good.request_id = "x"
    raw = good.SerializeToString()
    return raw.replace(b"\x0a\x01x", b"\x0a\x01\xff", 1)


BAD = [
    ("empty prompt", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[]), sampling=pb.Sampling(max_tokens=4)),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("no prompt", pb.GenerateRequest(sampling=pb.Sampling(max_tokens=4)), grpc.StatusCode.INVALID_ARGUMENT),
    ("token out of vocab", generate_request([1, 9000]), grpc.StatusCode.INVALID_ARGUMENT),
    ("negative token", generate_request([1, -5]), grpc.StatusCode.INVALID_ARGUMENT),
    ("max_tokens zero", generate_request([1, 2], max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
    ("no sampling", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1])), grpc.StatusCode.INVALID_ARGUMENT),
    ("bad temperature", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]),
                                           sampling=pb.Sampling(max_tokens=2, temperature=-1)),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("bad top_p", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.Sampling(max_tokens=2, top_p=1.5)),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("invalid UTF-8 prompt", pb.GenerateRequest(text=b"\xff\xfe", sampling=pb.Sampling(max_tokens=2)),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("invalid UTF-8 stop", pb.GenerateRequest(text=b"hi", sampling=pb.Sampling(max_tokens=2, stop=[b"\xc3"])),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("unknown criticality", pb.GenerateRequest(text=b"hi", sampling=pb.Sampling(max_tokens=2), criticality="urgent"),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("critical and negative priority", pb.GenerateRequest(text=b"hi", sampling=pb.Sampling(max_tokens=2), priority=-1,
                                                          criticality="critical"), grpc.StatusCode.INVALID_ARGUMENT),
    ("negative SLO", pb.GenerateRequest(text=b"hi", sampling=pb.Sampling(max_tokens=2), slo_ttft_ms=-5),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("beyond context", generate_request([1, 2], max_tokens=4000), grpc.StatusCode.OUT_OF_RANGE),
    ("unknown model", pb.GenerateRequest(text=b"hi", sampling=pb.Sampling(max_tokens=2), model="gpt-9"),
     grpc.StatusCode.NOT_FOUND),
    ("unknown adapter", pb.GenerateRequest(text=b"hi", sampling=pb.Sampling(max_tokens=2), adapter="sql"),
     grpc.StatusCode.NOT_FOUND),
    # sizes, checked before any work (issue 19): the tiny model's prompt limit is 64 KiB
    ("text over the prompt limit", pb.GenerateRequest(text=b"a" * 70_000, sampling=pb.Sampling(max_tokens=2)),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("request id over 256 bytes", pb.GenerateRequest(request_id="r" * 300, text=b"hi",
                                                     sampling=pb.Sampling(max_tokens=2)),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("model name over 256 bytes", pb.GenerateRequest(model="m" * 300, text=b"hi", sampling=pb.Sampling(max_tokens=2)),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("17 stop strings", pb.GenerateRequest(text=b"hi", sampling=pb.Sampling(max_tokens=2,
                                                                           stop=[b"s%d" % i for i in range(17)])),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("empty text prompt", pb.GenerateRequest(text=b"", sampling=pb.Sampling(max_tokens=2)),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("guided regex that does not compile", generate_request([1, 2], guided=pb.Guided(kind="regex", spec=b"a[")),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("unknown guided kind", generate_request([1, 2], guided=pb.Guided(kind="xml", spec=b"<a/>")),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("invalid UTF-8 guided spec", generate_request([1, 2], guided=pb.Guided(kind="regex", spec=b"\xff")),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("top_logprobs over 20", generate_request([1, 2], top_logprobs=21), grpc.StatusCode.INVALID_ARGUMENT),
]


@pytest.mark.parametrize("name,req,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_its_status(disaggregated, name, req, code):
    with grpc.insecure_channel(disaggregated.gateway) as ch:
        with pytest.raises(grpc.RpcError) as exc:
            list(pb_grpc.GenerationStub(ch).Generate(req, timeout=30))
    assert exc.value.code() == code, exc.value.details()
    assert exc.value.details()


@pytest.mark.parametrize("mode", ["disaggregated", "unified"])
def test_constrained_outputs_over_grpc(mode, request):
    """Structured outputs over gRPC, split across prefill and decode workers too (the decode worker's grammar picks
    up the token the prefill worker sampled): each output matches its constraint; top logprobs come with each token."""
    import json
    import re

    import jsonschema

    from tests.support.schemas import random_schemas

    mesh = request.getfixturevalue(mode)
    schemas = random_schemas(12, seed=5)
    reqs = [generate_request([5 + i, 6, 7], max_tokens=600, temperature=1.0, seed=i, ignore_eos=False,
                             guided=pb.Guided(kind="json", spec=json.dumps(s).encode()))
            for i, s in enumerate(schemas)]
    reqs.append(generate_request([9, 9], max_tokens=40, temperature=1.0, seed=3, ignore_eos=False, top_logprobs=2,
                                 guided=pb.Guided(kind="regex", spec=rb"[a-f]{4}-\d{3}")))

    async def run():
        async with grpc.aio.insecure_channel(mesh.gateway) as ch:
            stub = pb_grpc.GenerationStub(ch)

            async def one(req):
                rs = [r async for r in stub.Generate(req, timeout=120)]
                return "".join(r.text for r in rs), rs[-1].finish_reason, [t for r in rs for t in r.top_logprobs]

            return await asyncio.gather(*(one(r) for r in reqs))

    outs = asyncio.run(run())
    for schema, (text, reason, _) in zip(schemas, outs):
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    text, reason, tops = outs[-1]
    assert reason == "stop" and re.fullmatch(r"[a-f]{4}-\d{3}", text), text
    assert tops and all(len(t.token_ids) == 2 and t.logprobs[0] >= t.logprobs[1] for t in tops)
    assert_idle(mesh, ["prefill", "decode"] if mode == "disaggregated" else ["unified"])


def test_invalid_utf8_in_a_string_field_is_invalid_argument(disaggregated):
    with grpc.insecure_channel(disaggregated.gateway) as ch:
        call = ch.unary_stream("/meshserve.v1.Generation/Generate", request_serializer=lambda b: b,
                               response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as exc:
            list(call(_invalid_utf8_request_id(), timeout=30))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in exc.value.details()


def test_tokenize_is_bounded_too(disaggregated):
    with grpc.insecure_channel(disaggregated.gateway) as ch:
        with pytest.raises(grpc.RpcError) as exc:
            pb_grpc.GenerationStub(ch).Tokenize(pb.TokenizeRequest(text=b"a" * 70_000), timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit" in exc.value.details()


def test_expired_grpc_deadline(disaggregated):
    with grpc.insecure_channel(disaggregated.gateway) as ch:
        with pytest.raises(grpc.RpcError) as exc:
            list(pb_grpc.GenerationStub(ch).Generate(generate_request([1, 2], max_tokens=1900), timeout=0.2))
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_text_prompt_and_list_models(disaggregated):
    with grpc.insecure_channel(disaggregated.gateway) as ch:
        stub = pb_grpc.GenerationStub(ch)
        models = stub.ListModels(pb.ListModelsRequest(), timeout=10).models
        assert [m.name for m in models] == ["tiny"]
        ids = list(stub.Tokenize(pb.TokenizeRequest(text=b"Kalo mine"), timeout=10).token_ids)
        assert ids[0] == 1
        out = list(stub.Generate(pb.GenerateRequest(text=b"Kalo mine", sampling=pb.Sampling(
            max_tokens=6, temperature=0.0, ignore_eos=True)), timeout=30))
        assert sum(len(r.token_ids) for r in out) == 6
        assert out[-1].finish_reason == "length" and out[-1].prompt_tokens == len(ids)


def test_killed_decode_worker_is_dropped_and_others_serve(disaggregated, prompts, expected):
    victim = disaggregated.workers("decode")[-1]
    os.killpg(victim.popen.pid, signal.SIGKILL)
    victim.popen.wait()
    with grpc.insecure_channel(disaggregated.router) as ch:
        router = pb_grpc.RouterStub(ch)
        deadline = time.monotonic() + 20
        while any(w.address == victim.address for w in router.ListWorkers(pb.ListWorkersRequest()).workers):
            assert time.monotonic() < deadline, "the router kept the dead worker"
            time.sleep(0.2)
    got = asyncio.run(stream_all(disaggregated.gateway, prompts[:8]))
    assert got == expected[1][:8]
