"""The OpenAI-compatible HTTP front, with the official `openai` client against a real mesh on loopback:
completions and chat, streaming and not, equal to the gRPC path; usage (cached tokens too); each error
status for its cause; a client disconnect frees the request's KV blocks."""

import http.client
import json
import re
import socket
import time
import urllib.error
import urllib.request

import grpc
import jsonschema
import openai
import pytest
import yaml

from services.common.errors import HTTP_STATUS
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.common.tokenizer import Tokenizer
from services.gateway.chat import ChatTemplate
from services.policy.tenants import hash_key
from tests.support.mesh import start_mesh, worker_stats

KEY, LIMITED = "key-main", "key-limited"
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    cfg = {"tenants": [
        {"name": "main", "api_key_hashes": [hash_key(KEY)], "priorities": [0], "criticalities": ["standard"]},
        {"name": "limited", "api_key_hashes": [hash_key(LIMITED)], "limits": {"requests_per_s": 0.05}},
    ]}
    path = tmp_path_factory.mktemp("openai") / "mesh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    m = start_mesh(tiny_model, tmp_path_factory, "unified", config_file=str(path))
    yield m
    m.stop()


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=mesh.http + "/v1", api_key=KEY, max_retries=0, timeout=60)


def grpc_generate(mesh, ids, max_tokens):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.Sampling(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(mesh.gateway) as ch:
        out = list(pb_grpc.GenerationStub(ch).Generate(req, metadata=(("x-api-key", KEY),), timeout=60))
    return [t for r in out for t in r.token_ids], "".join(r.text for r in out)


def test_models_and_health(mesh, client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    with urllib.request.urlopen(mesh.http + "/health", timeout=10) as r:
        assert r.status == 200


def test_completions_equal_the_grpc_path(mesh, client, tiny_model):
    ids = Tokenizer(tiny_model).encode(PROMPT)
    tokens, text = grpc_generate(mesh, ids, 12)
    kw = dict(model="tiny", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    done = client.completions.create(prompt=PROMPT, **kw)
    assert done.choices[0].text == text and done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), len(tokens))
    as_ids = client.completions.create(prompt=ids, **kw)
    assert as_ids.choices[0].text == text
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
    with_lp = client.completions.create(prompt=PROMPT, logprobs=1, **kw)
    assert len(with_lp.choices[0].logprobs.token_logprobs) == 12
    assert all(x <= 0 for x in with_lp.choices[0].logprobs.token_logprobs)


def test_a_list_of_prompts_gives_one_choice_each(client):
    out = client.completions.create(model="tiny", prompt=["one two", "three four five"], max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1] and out.usage.completion_tokens == 6


def test_chat_equals_the_grpc_path_with_the_models_template(mesh, client, tiny_model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    rendered = ChatTemplate.from_model_dir(tiny_model).render(messages)
    ids = Tokenizer(tiny_model).encode(rendered, add_special_tokens=False)
    tokens, text = grpc_generate(mesh, ids, 10)
    kw = dict(model="tiny", messages=messages, max_completion_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    done = client.chat.completions.create(**kw)
    assert done.choices[0].message.role == "assistant" and done.choices[0].message.content == text
    assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == len(tokens)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == text


def test_usage_counts_cached_tokens_after_a_repeated_prompt(client):
    prompt = " ".join(f"word{i}" for i in range(60))
    kw = dict(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_error_statuses(mesh, client):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=mesh.http + "/v1", api_key="wrong", max_retries=0).completions.create(
            model="tiny", prompt="x", max_tokens=1)
    with pytest.raises(openai.PermissionDeniedError):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"priority": 3})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=1, n=17)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       response_format={"type": "json_schema"})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:  # well formed, but the engine's compiler refuses it
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"guided_regex": "a["})
    assert "does not compile" in e.value.body["message"]
    # a compiler's message about a long constraint outgrows gRPC's metadata: cut, it stays a 400 (was a 429)
    for extra in ({"guided_regex": "(" + "a" * 3000}, {"guided_grammar": "start: " + "(" * 25_000 + "x" * 25_000}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra)
        message = e.value.body["message"]
        assert "constraint" in message or "grammar" in message, message[:200]
        assert len(message.encode()) <= 2048 + 200
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=5000)  # beyond the context
    with pytest.raises(openai.APIStatusError) as e:
        # 1 ms cannot hold 200 decode steps on any machine: the deadline expires on the way.
        client.completions.create(model="tiny", prompt="x", max_tokens=200, extra_body={"deadline_ms": 1,
                                                                                          "ignore_eos": True})
    assert e.value.status_code == 504
    limited = openai.OpenAI(base_url=mesh.http + "/v1", api_key=LIMITED, max_retries=0)
    limited.completions.create(model="tiny", prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        limited.completions.create(model="tiny", prompt="x", max_tokens=1)
    assert int(e.value.response.headers["retry-after"]) >= 1
    assert int(e.value.response.headers["retry-after"]) == -(-int(e.value.response.headers["retry-after-ms"]) // 1000)
    req = urllib.request.Request(mesh.http + "/v1/completions", data=b"{not json",
                                 headers={"authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and b"invalid_request_error" in e.value.read()


def test_criticality_and_slo_headers_reach_admission(mesh, client):
    """x-criticality and x-slo-* over HTTP (headers), gRPC (metadata) and as fields: checked at the gateway (an
    unknown band 400, a band the tenant may not use 403, sheddable always allowed), served otherwise."""
    with pytest.raises(openai.BadRequestError, match="criticality must be one of"):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_headers={"x-criticality": "urgent"})
    with pytest.raises(openai.PermissionDeniedError, match="may not send critical requests"):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_headers={"x-criticality": "critical"})
    with pytest.raises(openai.BadRequestError, match="x-slo-ttft-ms must be an integer"):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_headers={"x-slo-ttft-ms": "soon"})
    out = client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_headers={
        "x-criticality": "sheddable", "x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "10000"})
    assert out.usage.completion_tokens >= 1
    out = client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"priority": -1})
    assert out.usage.completion_tokens >= 1  # a negative priority is sheddable: allowed although priorities: [0]
    req = pb.GenerateRequest(text=b"x", sampling=pb.Sampling(max_tokens=1))
    with grpc.insecure_channel(mesh.gateway) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.GenerationStub(ch).Generate(req, metadata=(("x-api-key", KEY), ("x-criticality", "critical")),
                                                     timeout=60))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def post(mesh, body: bytes, path: str = "/v1/completions") -> tuple[int, dict]:
    req = urllib.request.Request(mesh.http + path, data=body, headers={"authorization": f"Bearer {KEY}",
                                                                       "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_bodies_get_a_json_status_not_a_500(mesh):
    """Sizes and values a JSON body can carry that protobuf and the tokenizer cannot (issue 19)."""
    cases = [  # (body, status, words in the message)
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 99999999999999999999}', 400, "max_tokens"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "seed": 18446744073709551616}', 400, "seed"),
        (b'{"model": "tiny", "prompt": [1, 2, 99999999999999999999], "max_tokens": 2}', 400, "prompt"),
        (b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', 400, "surrogate"),
        (b'{"model": "tiny", "prompt": "a\\ud800b"}', 400, "surrogate"),  # tokenized for the default max_tokens
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "stop": ["\\udfff"]}', 400, "stop"),
        (b'{"model": "tiny", "prompt": "", "max_tokens": 2}', 400, "empty"),
        (json.dumps({"model": "tiny", "prompt": "a" * 70_000, "max_tokens": 2}).encode(), 400, "limit"),
    ]
    for body, status, words in cases:
        code, reply = post(mesh, body)
        assert (code, words in reply["error"]["message"]) == (status, True), (body[:80], code, reply)
    code, reply = post(mesh, json.dumps({"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "a" * 70_000}]}).encode(), "/v1/chat/completions")
    assert code == 400 and reply["error"]["param"] == "messages", reply
    # A body over the limit is answered from its Content-Length alone, before the bytes are read.
    host, port = mesh.http.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    for name, value in (("authorization", f"Bearer {KEY}"), ("content-type", "application/json"),
                        ("content-length", str(64 << 20))):
        conn.putheader(name, value)
    conn.endheaders(b'{"model": "tiny", "prompt": "aaaa')
    response = conn.getresponse()
    assert response.status == 413 and "body" in json.loads(response.read())["error"]["message"]
    conn.close()


def test_status_mapping_table():
    assert HTTP_STATUS == {"INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "NOT_FOUND": 404, "UNAUTHENTICATED": 401,
                           "PERMISSION_DENIED": 403, "RESOURCE_EXHAUSTED": 429, "DEADLINE_EXCEEDED": 504,
                           "UNAVAILABLE": 503, "CANCELLED": 499, "FAILED_PRECONDITION": 500, "INTERNAL": 500}


def test_client_disconnect_frees_the_kv_blocks(mesh, client):
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1500, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    aborted_before = sum(worker_stats(p.address).aborted for p in mesh.workers("unified"))
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert sum(worker_stats(p.address).blocks_used for p in mesh.workers("unified")) > 0
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 15
    while sum(worker_stats(p.address).aborted for p in mesh.workers("unified")) == aborted_before:
        assert time.monotonic() < deadline, "the worker never aborted the request"
        time.sleep(0.05)
    deadline = time.monotonic() + 15  # the abort travels asynchronously
    while sum(worker_stats(p.address).blocks_used for p in mesh.workers("unified")) > 0:
        assert time.monotonic() < deadline, "blocks still held after the client went away"
        time.sleep(0.1)


def test_every_public_rpc_wants_the_key_when_tenants_are_configured(mesh):
    with grpc.insecure_channel(mesh.gateway) as ch:
        stub = pb_grpc.GenerationStub(ch)
        for call, req in ((stub.ListModels, pb.ListModelsRequest()), (stub.Tokenize, pb.TokenizeRequest(text=b"hi"))):
            with pytest.raises(grpc.RpcError) as exc:
                call(req, timeout=10)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED, call
            assert call(req, metadata=(("x-api-key", KEY),), timeout=10)


def test_a_tenants_cached_prefix_cannot_be_read_with_a_guessed_salt(mesh):
    """Issue 19: a worker called directly with cache salt "tenant:main" used to serve tenant main's cached prefix
    (its name is all one needed). The salt on the wire is now an HMAC under the gateway's secret."""
    prompt = list(range(100, 100 + 96))  # six blocks
    assert grpc_generate(mesh, prompt, 2)  # tenant main fills the cache...
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.Sampling(max_tokens=2, temperature=0.0))
    with grpc.insecure_channel(mesh.gateway) as ch:
        again = list(pb_grpc.GenerationStub(ch).Generate(req, metadata=(("x-api-key", KEY),), timeout=60))
    assert again[-1].cached_prompt_tokens >= 64  # ...and finds it again through the gateway
    worker = mesh.workers("unified")[0].address
    for guess in ("tenant:main", "main", ""):
        work = pb.WorkRequest(request_id=f"guess-{guess}", prompt_token_ids=prompt, cache_salt=guess,
                              sampling=pb.Sampling(max_tokens=2, temperature=0.0))
        with grpc.insecure_channel(worker) as ch:
            events = list(pb_grpc.WorkerStub(ch).Generate(work, timeout=60))
        assert max(e.cached_prompt_tokens for e in events) == 0, guess


def test_a_half_sent_request_is_disconnected(mesh):
    """Slow-loris (issue 19): a connection that never finishes its request head is closed after HTTP_IDLE_S."""
    import socket

    from services.gateway.http_server import HTTP_IDLE_S

    host, port = mesh.http.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HTTP_IDLE_S + 10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")  # no blank line
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # the server closed it, answering nothing
        assert time.monotonic() - t0 < HTTP_IDLE_S + 5
    # while a complete request on a fresh connection is served as ever
    assert post(mesh, b'{"model": "tiny", "prompt": "x", "max_tokens": 2}')[0] == 200


def test_bodies_an_outside_probe_found_get_a_clear_4xx(mesh):
    """Issue 43: nesting past the parser's depth, a body declared as another type, a chat message without content,
    a body shorter than its Content-Length: each a 4xx naming it (a 500, a 200 or a traceback before)."""
    code, reply = post(mesh, b"[" * 100_000)
    assert code == 400 and "nested too deeply" in reply["error"]["message"], reply
    req = urllib.request.Request(mesh.http + "/v1/completions", data=b'{"model": "tiny", "prompt": "x"}', headers={
        "authorization": f"Bearer {KEY}", "content-type": "text/plain"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 415 and "application/json" in json.loads(e.value.read())["error"]["message"]
    code, reply = post(mesh, json.dumps({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user"}]}).encode(),
                       "/v1/chat/completions")
    assert code == 400 and "messages[0].content is required" in reply["error"]["message"], reply
    host, port = mesh.http.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    for name, value in (("authorization", f"Bearer {KEY}"), ("content-type", "application/json"),
                        ("content-length", "400")):
        conn.putheader(name, value)
    conn.endheaders(b'{"model": "tiny", "prompt": "aaaa')
    conn.sock.shutdown(socket.SHUT_WR)  # 33 of its 400 bytes, then the client closes its side
    conn.sock.settimeout(30)
    while conn.sock.recv(4096):  # the server answers (400) or just closes: the client is gone either way
        pass
    conn.close()
    assert post(mesh, b'{"model": "tiny", "prompt": "x", "max_tokens": 2}')[0] == 200  # and it serves on
    log = (mesh.log_dir / "gateway.log").read_text()
    assert "Traceback" not in log, log[-3000:]


def test_json_schema_responses_validate_for_60_schemas(client):
    """response_format json_schema through the mesh, 60 generated schemas (bounded instances) sent 12 at a time:
    every response parses and validates against its schema."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.support.schemas import random_schemas

    schemas = random_schemas(60, seed=41)

    def ask(i):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i], "strict": True}}
        return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"item {i}"}],
                                              max_tokens=600, temperature=1.0, seed=i, response_format=fmt)

    with ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(ask, range(len(schemas))))
    for schema, out in zip(schemas, outs):
        text = out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_guided_choice_regex_and_json_object_streamed(client):
    kw = dict(model="tiny", max_tokens=200, temperature=1.0)
    choice = client.completions.create(prompt="pick", seed=1, extra_body={"guided_choice": ["alpha", "beta"]}, **kw)
    assert choice.choices[0].text in ("alpha", "beta")
    chunks = list(client.completions.create(prompt="code", seed=2, stream=True,
                                            extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{4}"}}, **kw))
    assert re.fullmatch("[A-Z]{2}[0-9]{4}", "".join(c.choices[0].text for c in chunks if c.choices))


def test_n_choices_are_reproducible_with_a_seed_and_distinct(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, n=4, seed=123,
              extra_body={"ignore_eos": True})
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1
    assert first.usage.completion_tokens == 32
    # choice j is seed + j: the same as a single request with that seed
    one = client.completions.create(**{**kw, "n": 1, "seed": 125})
    assert one.choices[0].text == texts[2]
    streamed = list(client.completions.create(**{**kw, "stream": True}))
    joined = ["".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == j) for j in range(4)]
    assert joined == texts
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=1.0, n=2, seed=7)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    # the first choice computes the prompt; the other three follow at its first token and read it from the cache
    long = " ".join(f"sample{i}" for i in range(70))  # a prompt no other test sends (a cached prefix would count)
    shared = client.completions.create(**{**kw, "prompt": long})
    blocks = shared.usage.prompt_tokens // 4 // 16
    assert blocks >= 3 and shared.usage.prompt_tokens_details.cached_tokens == 3 * blocks * 16


def test_top_logprobs_agree_with_the_engines_logprobs(mesh, client, tiny_model):
    """Chat top_logprobs: k alternatives per token, best first, and the sampled token's logprob among them is the
    same number; greedy: the sampled token is the first; completions logprobs: k the same, as a dict per token;
    the logprobs equal what the gRPC path reports for the same request."""
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=6,
                                         temperature=0, logprobs=True, top_logprobs=5,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    for c in content:
        assert len(c.top_logprobs) == 5
        values = [t.logprob for t in c.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
        assert c.bytes == list(c.token.encode())
    ids = Tokenizer(tiny_model).encode(PROMPT)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.Sampling(
        max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3))
    with grpc.insecure_channel(mesh.gateway) as ch:
        rs = list(pb_grpc.GenerationStub(ch).Generate(req, metadata=(("x-api-key", KEY),), timeout=60))
    grpc_lps = [x for r in rs for x in r.logprobs]
    comp = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert lp.token_logprobs == grpc_lps
    assert len(lp.top_logprobs) == 6 and all(1 <= len(t) <= 3 for t in lp.top_logprobs)  # 3 ids; some decode alike
    for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == x


def test_echo_tokenize_and_detokenize(mesh, client, tiny_model):
    tk = Tokenizer(tiny_model)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert out.choices[0].text == PROMPT + plain.choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text

    def post(path, body, key=KEY):
        req = urllib.request.Request(mesh.http + path, data=json.dumps(body).encode(),
                                     headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, body = post("/tokenize", {"model": "tiny", "prompt": PROMPT, "return_token_strs": True})
    assert status == 200 and body["tokens"] == tk.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0 and len(body["token_strs"]) == body["count"]
    status, chat = post("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    rendered = ChatTemplate.from_model_dir(tiny_model).render([{"role": "user", "content": "hi"}])
    assert status == 200 and chat["tokens"] == tk.encode(rendered, add_special_tokens=False)
    status, back = post("/detokenize", {"model": "tiny", "tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == tk.decode(body["tokens"])
    assert post("/detokenize", {"tokens": [1, -2]})[0] == 400
    assert post("/detokenize", {"tokens": "abc"})[0] == 400
    assert post("/tokenize", {"prompt": 5})[0] == 400
    assert post("/tokenize", {"model": "gpt-9", "prompt": "x"})[0] == 404
    assert post("/tokenize", {"prompt": "x"}, key="wrong")[0] == 401


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_tool_calls_from_a_chat_with_two_tools(client):
    """tool_choice required (enforced by the grammar): the response's tool_calls name one of the two tools with
    arguments that validate against its schema, finish_reason tool_calls, streamed or not; a named function gets
    a call to that function; auto on the random model answers in text (it calls nothing), without error."""
    messages = [{"role": "user", "content": "What is the weather in Paris, and the time in UTC?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    kw = dict(model="tiny", messages=messages, tools=[WEATHER, TIME], max_tokens=300, temperature=1.0)
    for seed in range(3):
        out = client.chat.completions.create(tool_choice="required", seed=seed, **kw)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           seed=4, **kw)
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET", "PST")
    assert named.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(tool_choice="required", seed=0, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    streamed = [(t.function.name, t.function.arguments) for d in deltas for t in d.tool_calls]
    first = client.chat.completions.create(tool_choice="required", seed=0, **kw).choices[0].message.tool_calls
    assert streamed == [(c.function.name, c.function.arguments) for c in first]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    auto = client.chat.completions.create(seed=5, **{**kw, "max_tokens": 8})
    assert auto.choices[0].finish_reason in ("stop", "length") and auto.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "nope"}}, **kw)
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(tool_choice="required", response_format={"type": "json_object"}, **kw)
    assert e.value.body["param"] == "tool_choice"


def test_auto_tool_choice_parses_the_models_tool_call_blocks(client):
    """tool_choice auto: the output is parsed for <tool_call> blocks. The random model never writes one by itself,
    so a regex makes it write text and then a call in Qwen2's format: content keeps the text, the call is parsed,
    streamed or not."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    regex = "(Checking|One moment)\\. " + re.escape(call).replace("\\\n", "\\n")
    kw = dict(model="tiny", messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, TIME], max_tokens=200,
              temperature=1.0, seed=1, extra_body={"guided_regex": regex})
    out = client.chat.completions.create(**kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content in ("Checking. ", "One moment. ")
    [tc] = out.message.tool_calls
    assert (tc.function.name, json.loads(tc.function.arguments)) == ("get_time", {"zone": "UTC"})
    chunks = list(client.chat.completions.create(stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices and c.choices[0].delta.tool_calls for t in c.choices[0].delta.tool_calls]
    assert content == out.message.content and [(t.function.name, t.function.arguments) for t in calls] == [
        (tc.function.name, tc.function.arguments)]
    assert "<tool_call>" not in content and chunks[-1].choices[0].finish_reason == "tool_calls"
