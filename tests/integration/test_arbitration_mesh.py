"""Slot arbitration on real processes (issue 18): the gateway dispatches against the credits a worker grants,
an under-share tenant's request takes a slot by preemption (once, never swapped back; with
admission.share_preemption), so does a critical request, and a deadline that
cannot be met is turned away at arrival while a feasible one is served in time.

One mesh for the module: one unified worker with 4 slots, the fair-deadline policy in the gateway and the
engine, tenants heavy and light of equal weight."""

import threading
import time

import grpc
import pytest
import yaml

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.policy.tenants import hash_key
from tests.support.mesh import generate_request, start_mesh, worker_stats

KEYS = {"heavy": "key-heavy", "light": "key-light"}
SLOTS = 4


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    cfg = {"tenants": [{"name": t, "api_key_hashes": [hash_key(k)]} for t, k in KEYS.items()],
           "admission": {"policy": "fair-deadline", "starvation_s": 300, "share_preemption": True}}
    path = tmp_path_factory.mktemp("arbitration") / "mesh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    m = start_mesh(tiny_model, tmp_path_factory, "unified", config_file=str(path),
                   worker_args={"unified-0": ["--max-num-seqs", str(SLOTS), "--slot-policy", "fair-deadline"]})
    yield m
    m.stop()


def stats(mesh) -> pb.WorkerStats:
    return worker_stats(mesh.workers("unified")[0].address)


def generate(mesh, tenant, req, timeout=120, on_first=None):
    """The request's tokens (raises grpc.RpcError)."""
    tokens = []
    with grpc.insecure_channel(mesh.gateway) as ch:
        for r in pb_grpc.GenerationStub(ch).Generate(req, metadata=(("x-api-key", KEYS[tenant]),), timeout=timeout):
            if r.token_ids and not tokens and on_first is not None:
                on_first()
            tokens += r.token_ids
    return tokens


def in_threads(calls) -> list:
    """Run (fn, args) pairs at once; their results (or exceptions) in order."""
    out = [None] * len(calls)

    def run(i, fn, args):
        try:
            out[i] = fn(*args)
        except Exception as e:  # noqa: BLE001  (returned for the test to assert on)
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, fn, args)) for i, (fn, args) in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return out


def test_a_burst_never_puts_more_work_on_a_worker_than_its_credits(mesh):
    deadline = time.monotonic() + 30
    while stats(mesh).credit_subscribers < 1:  # the gateway follows the worker's credits (it found it at start)
        assert time.monotonic() < deadline, "the gateway never opened a credit stream to the worker"
        time.sleep(0.05)
    before = stats(mesh)
    reqs = [generate_request(list(range(3 + i, 40 + i)), max_tokens=24) for i in range(3 * SLOTS)]
    outs = in_threads([(generate, (mesh, "heavy", r)) for r in reqs])
    assert all(len(o) == 24 for o in outs), outs
    after = stats(mesh)
    # 12 requests at once for 4 slots: 8 waited in the gateway's queue, none in the engine's, none sent uncredited
    assert after.max_live <= SLOTS and after.uncredited == before.uncredited
    assert after.running == after.waiting == 0


def _one_past_a_full_mesh(mesh, holders: list, holder_tenant: str, newcomer, newcomer_tenant: str):
    """The holders (400 tokens each, two more than the slots) hold every slot; once they all have, the newcomer (8
    tokens) is sent. Returns (every output, newcomer's last; the order they finished in; the newcomer's slot
    preemptions and uncredited dispatches, from the worker's Stats)."""
    before = stats(mesh)
    started = threading.Semaphore(0)
    finished: list = []

    def run_holder(req):
        out = generate(mesh, holder_tenant, req, on_first=started.release)
        finished.append("holder")
        return out

    def run_newcomer():
        for _ in range(SLOTS):
            assert started.acquire(timeout=60)
        out = generate(mesh, newcomer_tenant, newcomer)
        finished.append("newcomer")
        return out

    outs = in_threads([(run_holder, (r,)) for r in holders] + [(run_newcomer, ())])
    after = stats(mesh)
    return outs, finished, after.slot_preemptions - before.slot_preemptions, after.uncredited - before.uncredited


def test_an_under_share_tenant_takes_a_slot_by_preemption_once(mesh):
    heavy = [generate_request(list(range(50 + i, 90 + i)), max_tokens=400) for i in range(SLOTS + 2)]
    light = generate_request(list(range(200, 230)), max_tokens=8)
    outs, finished, preempted, uncredited = _one_past_a_full_mesh(mesh, heavy, "heavy", light, "light")
    assert all(len(o) == 400 for o in outs[:-1]) and len(outs[-1]) == 8, outs
    # light did not wait for a heavy request to finish: it went past the full mesh and the engine preempted one
    # heavy request for it, exactly once; the preempted one was resumed and finished in full (outputs above)
    assert finished.index("newcomer") < finished.index("holder")
    assert preempted == 1
    assert uncredited == 1  # light's, sent past the credits to be preempted for


def test_a_critical_request_takes_a_standard_requests_slot_at_once(mesh):
    """Bands on the real path: the tenant's own standard requests hold every slot (and two more queue at the
    gateway); its critical one (x-criticality metadata) goes past the full mesh and the engine preempts a standard
    request for it, once; every request still finishes whole."""
    standard = [generate_request(list(range(300 + i, 340 + i)), max_tokens=400) for i in range(SLOTS + 2)]
    critical = generate_request(list(range(500, 530)), max_tokens=8)
    critical.criticality = "critical"
    outs, finished, preempted, uncredited = _one_past_a_full_mesh(mesh, standard, "heavy", critical, "heavy")
    assert all(len(o) == 400 for o in outs[:-1]) and len(outs[-1]) == 8, outs
    assert finished.index("newcomer") < finished.index("holder")
    assert preempted == 1
    assert uncredited == 1


def test_an_infeasible_deadline_is_rejected_at_arrival_and_a_feasible_one_served_in_time(mesh):
    for i in range(8):  # the gateway trusts its predictions once it has measured completions itself
        generate(mesh, "light", generate_request(list(range(5 + i, 30 + i)), max_tokens=16))
    tight = generate_request(list(range(3, 60)), max_tokens=500)
    tight.deadline_ms = 20
    with pytest.raises(grpc.RpcError) as e:
        generate(mesh, "light", tight)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "predicted to finish in" in e.value.details() and "deadline in" in e.value.details()
    feasible = generate_request(list(range(3, 60)), max_tokens=16)
    feasible.deadline_ms = 20_000
    assert len(generate(mesh, "light", feasible)) == 16  # within its deadline, or the call would have failed
    assert stats(mesh).aborted == 0
