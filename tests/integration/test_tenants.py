"""Tenants at the gateway, with real processes: each status for each bad credential or limit, the
admission queue when the mesh is full, and deadlines that expire in the queue."""

import threading
import time

import grpc
import pytest
import yaml

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.policy.tenants import hash_key
from tests.support.mesh import generate_request, start_mesh

KEYS = {"alice": "key-alice", "bob": "key-bob", "carol": "key-carol"}


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    cfg = {"tenants": [
        {"name": "alice", "api_key_hashes": [hash_key(KEYS["alice"])], "priorities": [0, 1], "adapters": [],
         "limits": {"max_prompt_tokens": 200, "max_output_tokens": 64}},
        {"name": "bob", "api_key_hashes": [hash_key(KEYS["bob"])], "weight": 2,
         "limits": {"requests_per_s": 0.05}},
        {"name": "carol", "api_key_hashes": [hash_key(KEYS["carol"])], "limits": {"max_queued": 1}},
    ], "admission": {"policy": "fcfs",
                     "starvation_s": 300}}  # FCFS: plain queueing; a long bound: no predicted-wait rejections
    path = tmp_path_factory.mktemp("tenants") / "mesh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # one sequence at a time: a second request must queue at the gateway
    m = start_mesh(tiny_model, tmp_path_factory, "unified", config_file=str(path),
                   worker_args={"unified-0": ["--max-num-seqs", "1"]})
    yield m
    m.stop()


def call(mesh, req, metadata=(), timeout=60):
    with grpc.insecure_channel(mesh.gateway) as ch:
        return list(pb_grpc.GenerationStub(ch).Generate(req, metadata=metadata, timeout=timeout))


def status(mesh, req, metadata=()):
    with pytest.raises(grpc.RpcError) as exc:
        call(mesh, req, metadata)
    return exc.value


def key(name, bearer=False):
    return (("authorization", f"Bearer {KEYS[name]}"),) if bearer else (("x-api-key", KEYS[name]),)


SHORT = generate_request(list(range(3, 20)), max_tokens=4)


def test_keys(mesh):
    assert status(mesh, SHORT).code() == grpc.StatusCode.UNAUTHENTICATED
    assert status(mesh, SHORT, (("x-api-key", "not-a-key"),)).code() == grpc.StatusCode.UNAUTHENTICATED
    assert sum(len(r.token_ids) for r in call(mesh, SHORT, key("alice"))) == 4
    assert sum(len(r.token_ids) for r in call(mesh, SHORT, key("alice", bearer=True))) == 4


@pytest.mark.parametrize("change,code,fragment", [
    (lambda r: setattr(r, "priority", 5), grpc.StatusCode.PERMISSION_DENIED, "priority 5"),
    (lambda r: setattr(r, "adapter", "sql"), grpc.StatusCode.PERMISSION_DENIED, "adapter 'sql'"),
    (lambda r: r.token_ids.ids.extend(range(300)), grpc.StatusCode.RESOURCE_EXHAUSTED, "limit of 200"),
    (lambda r: setattr(r.sampling, "max_tokens", 100), grpc.StatusCode.RESOURCE_EXHAUSTED, "limit of 64"),
])
def test_permission_and_size_limits(mesh, change, code, fragment):
    req = pb.GenerateRequest()
    req.CopyFrom(SHORT)
    change(req)
    err = status(mesh, req, key("alice"))
    assert err.code() == code and fragment in err.details()


def test_request_rate_limit_says_when_to_retry(mesh):
    call(mesh, SHORT, key("bob"))
    err = status(mesh, SHORT, key("bob"))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "requests/s" in err.details()
    retry = dict(err.trailing_metadata())["retry-after-ms"]
    assert 0 < int(retry) <= 20_000


def test_full_mesh_queues_then_tenant_queue_limit_and_deadlines(mesh):
    long = generate_request(list(range(3, 20)), max_tokens=1900)
    first_token, done = threading.Event(), threading.Event()

    def run_long():
        with grpc.insecure_channel(mesh.gateway) as ch:
            call_ = pb_grpc.GenerationStub(ch).Generate(long, metadata=key("carol"), timeout=120)
            for _ in call_:
                first_token.set()
                if done.is_set():
                    call_.cancel()
                    return

    t = threading.Thread(target=run_long)
    t.start()
    outcomes = []
    try:
        assert first_token.wait(60)
        # The only slot is busy. Carol sends two more: one queues, the other overflows her queue of 1.
        # Another tenant's request with a short deadline expires in the queue, never reaching a worker.
        def run(req, who):
            try:
                outcomes.append((who, call(mesh, req, key(who), timeout=120)))
            except grpc.RpcError as e:
                outcomes.append((who, e))

        with_deadline = pb.GenerateRequest()
        with_deadline.CopyFrom(SHORT)
        with_deadline.deadline_ms = 300
        threads = [threading.Thread(target=run, args=a) for a in ((SHORT, "carol"), (SHORT, "carol"),
                                                                   (with_deadline, "alice"))]
        for th in threads:
            th.start()
        wait_until = time.monotonic() + 30
        while len(outcomes) < 2 and time.monotonic() < wait_until:  # the two rejections come at once
            time.sleep(0.05)
    finally:
        done.set()  # the long request ends; the queued one runs
        t.join(120)
    for th in threads:
        th.join(120)
    errors = {who: o for who, o in outcomes if isinstance(o, grpc.RpcError)}
    served = [o for who, o in outcomes if not isinstance(o, grpc.RpcError)]
    assert set(errors) == {"carol", "alice"} and len(served) == 1, outcomes
    full = errors["carol"]
    assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "1 requests queued" in full.details()
    assert int(dict(full.trailing_metadata())["retry-after-ms"]) > 0
    late = errors["alice"]
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "admission queue" in late.details()
    assert sum(len(r.token_ids) for r in served[0]) == 4
    assert served[0][0].queue_wait_ms > 0
