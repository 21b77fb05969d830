"""The cluster simulator: traces, the cost fit, exact step timing, leaps, determinism, and the policies' effects."""

import json
import random
from dataclasses import replace

import pytest

from services.cli import main
from services.common.block_hash import hash_blocks
from services.gateway.record import TraceRecorder
from sim import worker as sim_worker
from sim.cluster import AutoscaleSpec, Cluster, ClusterSpec
from sim.cost import CostModel, fit, intervals
from sim.report import result_of
from sim.run import simulate
from sim.trace import Synthetic, TenantSpec, TraceRequest, read_jsonl, synthetic, write_jsonl
from sim.worker import WorkerSpec

COST = CostModel(base_s=0.004, per_seq_s=0.0005, per_context_s=1e-6, prefill_s_per_token=1e-4,
                 prefill_context_s=3e-8, hop_s=0.006,
                 kv_bytes_per_token=4096, kv_link_gbytes_per_s=0.5)
WORKER = WorkerSpec(num_blocks=2048, block_size=16, max_num_seqs=16, max_num_batched_tokens=256)


def run(spec, trace, cost=COST):
    c = Cluster(spec, cost)
    c.run(trace)
    return c


def by_id(cluster):
    return {r.trace.id: r for r in cluster.done}


# ---- traces -----------------------------------------------------------------------------------------------


def test_synthetic_traces_are_a_function_of_the_seed_and_round_trip_through_jsonl(tmp_path):
    spec = Synthetic(requests=300, rate=50, system_prompts=4, tenants=[TenantSpec("a", 1), TenantSpec("b", 3)],
                     adapters=3, deadline_fraction=0.3, burst_every_s=2, burst_s=0.5, burst_factor=4)
    a, b, c = synthetic(spec, 7), synthetic(spec, 7), synthetic(spec, 8)
    assert a == b and a != c
    assert {r.tenant for r in a} == {"a", "b"} and any(r.adapter for r in a) and any(r.deadline_ms for r in a)
    assert sum(r.tenant == "b" for r in a) > 2 * sum(r.tenant == "a" for r in a)
    path = tmp_path / "t.jsonl"
    write_jsonl(a, path)
    back = read_jsonl(path)
    assert [(r.id, r.prompt_tokens, r.output_tokens, r.prefix, r.tenant, r.adapter, r.deadline_ms) for r in back] == \
        [(r.id, r.prompt_tokens, r.output_tokens, r.prefix, r.tenant, r.adapter, r.deadline_ms) for r in a]
    assert all(abs(x.arrival_s - y.arrival_s) < 1e-6 for x, y in zip(back, a))


def test_gamma_arrivals_are_burstier_than_poisson():
    def cv(trace):
        gaps = [b.arrival_s - a.arrival_s for a, b in zip(trace, trace[1:])]
        mean = sum(gaps) / len(gaps)
        return (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean

    poisson = synthetic(Synthetic(requests=4000, rate=10), 1)
    gamma = synthetic(Synthetic(requests=4000, rate=10, arrival="gamma", cv=3.0), 1)
    assert 0.9 < cv(poisson) < 1.1 and 2.5 < cv(gamma) < 3.5
    assert abs(gamma[-1].arrival_s / 4000 - 0.1) < 0.02  # the mean rate holds


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 2, "colour": 1}', "unknown field"),
    ('{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 2}', "prompt_tokens must be a positive integer"),
    ('{"arrival_s": -1, "prompt_tokens": 3, "output_tokens": 2}', "arrival_s must be >= 0"),
    ('{"arrival_s": 0, "prompt_tokens": 3}', "missing"),
    ('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2, "prefix": [["s", 9]]}', "exceed prompt_tokens"),
])
def test_a_bad_trace_line_is_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{message}"):
        read_jsonl(path)


def test_requests_naming_a_segment_share_its_blocks_and_nothing_else():
    a = TraceRequest(0, 100, 4, id="a", prefix=[["sys", 64]])
    b = TraceRequest(0, 90, 4, id="b", prefix=[["sys", 64]])
    c = TraceRequest(0, 100, 4, id="c", prefix=[["other", 64]])
    ha, hb, hc = (hash_blocks(r.tokens(), 16) for r in (a, b, c))
    assert ha[:4] == hb[:4] and ha[4] != hb[4]
    assert not set(ha) & set(hc)


def test_the_gateway_recorder_writes_a_trace_the_simulator_reads(tmp_path):
    path = tmp_path / "rec.jsonl"
    rec = TraceRecorder(str(path))
    shared = list(range(3, 3 + 48))
    rec.record(100.0, shared + [7] * 10, 5, "t1", "", None, 0, 16)
    rec.record(100.5, shared + [9] * 20, 3, "t2", "ad", 101.5, 1, 16)
    rec.close()
    a, b = read_jsonl(path)
    assert (a.arrival_s, b.arrival_s, a.prompt_tokens, b.output_tokens, b.tenant, b.adapter, b.priority) == \
        (0.0, 0.5, 58, 3, "t2", "ad", 1)
    assert b.deadline_ms == pytest.approx(1000.0)
    assert len(a.prefix) == 3 and len(b.prefix) == 4
    assert a.prefix[:3] != b.prefix[:3]  # another adapter: another isolation domain
    assert all(n == 16 for _, n in a.prefix)


# ---- the cost model -----------------------------------------------------------------------------------------


def test_the_fit_recovers_a_known_cost_model_from_a_step_log():
    rng = random.Random(3)
    truth = CostModel(base_s=0.003, per_seq_s=0.0004, per_context_s=5e-7, prefill_s_per_token=8e-5,
                      prefill_context_s=4e-8)
    steps, t = [], 0.0
    for _ in range(400):
        seqs, prefill, context = rng.randint(1, 32), rng.choice([0, 0, 0, rng.randint(16, 512)]), rng.randint(0, 8000)
        chunk_context = prefill * rng.randint(0, 2000)
        took = truth.step_s(seqs, prefill, context, chunk_context) * rng.uniform(0.97, 1.03)
        steps.append({"start": t, "seqs": seqs, "tokens": seqs + prefill, "context": context,
                      "prefill_context": chunk_context, "step_s": took * 0.9})
        t += took  # the loop's own 10% between steps
    terms, quality = fit(intervals(steps))
    for k in ("base_s", "per_seq_s", "per_context_s", "prefill_s_per_token", "prefill_context_s"):
        assert terms[k] == pytest.approx(getattr(truth, k), rel=0.1), k
    assert quality["median_rel_error"] < 0.03


def test_a_cost_model_round_trips_and_refuses_unknown_fields(tmp_path):
    COST.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == COST
    (tmp_path / "bad.json").write_text(json.dumps({"base_s": 1, "warp": 2}))
    with pytest.raises(ValueError, match="unknown field"):
        CostModel.load(tmp_path / "bad.json")


# ---- exact timing -------------------------------------------------------------------------------------------


def test_one_request_takes_exactly_its_steps_by_the_cost_model():
    prompt, out = 600, 20
    c = run(ClusterSpec(workers=1, worker=WORKER, admission="none"), [TraceRequest(1.0, prompt, out, id="x")])
    r = by_id(c)["x"]
    budget = WORKER.max_num_batched_tokens
    t, done = 1.0 + COST.hop_s / 2, 0
    while done < prompt:  # chunked prefill; the last chunk samples the first token
        chunk = min(budget, prompt - done)
        t += COST.step_s(1, chunk - 1, done, chunk * done)
        done += chunk
    assert r.first_s == pytest.approx(t + COST.hop_s / 2, abs=1e-9)
    for i in range(1, out):  # decode steps over a growing context
        t += COST.step_s(1, 0, prompt + i - 1)
    assert r.last_s == pytest.approx(t + COST.hop_s / 2, abs=1e-9)
    assert r.tokens_out == out and not r.error


def test_the_rest_of_the_mesh_on_shared_cores_slows_the_steps_by_its_load():
    prompt, out = 600, 20
    spec = ClusterSpec(workers=1, worker=WORKER, admission="none")
    trace = [TraceRequest(1.0, prompt, out, id="x")]
    alone = by_id(run(spec, trace))["x"]
    # One core, half of it taken by the gateway, router and client whatever the load: every step 1.5x its cost; the
    # hop's processes, with no step running on either way, fit in what is left: it takes its time.
    shared = by_id(run(spec, trace, replace(COST, cores=1, host_cpu_s_per_s=0.5)))["x"]
    steps = alone.first_s - 1.0 - COST.hop_s
    assert shared.first_s - 1.0 == pytest.approx(COST.hop_s + 1.5 * steps, rel=1e-9)
    # Half a core more and the hop's processes wait for the core too: 1.5 / 1 x its time either way.
    busy = by_id(run(spec, trace, replace(COST, cores=1, host_cpu_s_per_s=1.5)))["x"]
    assert busy.first_s - 1.0 == pytest.approx(1.5 * COST.hop_s + 2.5 * steps, rel=1e-9)
    assert shared.last_s - shared.first_s == pytest.approx(1.5 * (alone.last_s - alone.first_s), rel=1e-9)
    # A per-token cost: the stream's own tokens take CPU from the steps that make them.
    streamed = by_id(run(spec, trace, replace(COST, cores=1, host_cpu_s_per_token=0.002)))["x"]
    assert streamed.last_s - streamed.first_s > alone.last_s - alone.first_s
    assert streamed.first_s == pytest.approx(alone.first_s, abs=1e-9)  # no token streamed before the first
    # Where workers have cores of their own (cores = 0), the host terms change nothing.
    own = by_id(run(spec, trace, replace(COST, host_cpu_s_per_s=0.5, host_cpu_s_per_token=0.002)))["x"]
    assert (own.first_s, own.last_s) == (alone.first_s, alone.last_s)


def test_calibration_fits_the_mesh_cpu_from_its_phases():
    from bench.calibrate import _host_fit

    rng = random.Random(5)
    phases = []
    for _ in range(10):
        s, n, k = rng.uniform(0.5, 10), rng.randint(1, 40), rng.randint(10, 4000)
        phases.append({"seconds": s, "requests": n, "tokens": k, "cpu_s": 0.1 * s + 0.004 * n + 2e-4 * k})
    assert _host_fit(phases) == pytest.approx((0.1, 0.004, 2e-4), rel=1e-3)
    assert _host_fit(phases[:2]) is None  # too few phases to tell three terms apart


def test_disaggregated_adds_the_kv_transfer_over_both_links():
    prompt, out = 300, 10
    spec = ClusterSpec(mode="disaggregated", prefill=1, workers=1, worker=WORKER, admission="none")
    r = by_id(run(spec, [TraceRequest(0.0, prompt, out, id="x")]))["x"]
    t = COST.hop_s / 2 + COST.step_s(1, 255, 0) + COST.step_s(1, prompt - 256 - 1, 256, (prompt - 256) * 256)
    assert r.first_s == pytest.approx(t + COST.hop_s / 2, abs=1e-9)
    t += 2 * COST.kv_transfer_s(prompt)
    for i in range(1, out):
        t += COST.step_s(1, 0, prompt + i - 1)
    assert r.last_s == pytest.approx(t + COST.hop_s / 2, abs=1e-9)


@pytest.mark.parametrize("mode", ["unified", "disaggregated"])
def test_leaps_give_the_times_single_steps_give(monkeypatch, mode):
    trace = synthetic(Synthetic(requests=150, rate=30, prompt=(16, 300), output=(4, 120)), 5)
    spec = ClusterSpec(workers=2, worker=WORKER, admission="fcfs")
    if mode == "disaggregated":  # one decode worker of 4 slots behind two prefill workers, no gateway queue:
        # imports wait for a slot (up to ~90 at once), and leaps run while they wait
        spec = replace(spec, mode=mode, prefill=2, workers=1, worker=replace(WORKER, max_num_seqs=4),
                       prefill_worker=replace(WORKER, role="prefill"), admission="none")
    leaped = run(spec, trace)
    monkeypatch.setattr(sim_worker, "MAX_LEAP", 1)
    single = run(spec, trace)
    assert leaped.processed < single.processed  # fewer events for the same steps: what makes scale affordable
    assert sum(w.steps for w in leaped.workers) == sum(w.steps for w in single.workers)
    a, b = by_id(leaped), by_id(single)
    for rid, r in a.items():
        s = b[rid]
        assert (r.tokens_out, r.cached_tokens, r.workers) == (s.tokens_out, s.cached_tokens, s.workers)
        assert r.first_s == pytest.approx(s.first_s, abs=1e-6) and r.last_s == pytest.approx(s.last_s, abs=1e-6)


def test_gateway_replicas_each_dispatch_within_their_share_of_the_slots():
    trace = synthetic(Synthetic(requests=400, rate=400, prompt=(16, 64), output=(20, 40)), 3)
    spec = ClusterSpec(workers=2, worker=WORKER, admission="fcfs", gateways=4)
    c = Cluster(spec, COST)
    most = [0] * 4

    def watch():  # after every event: what each gateway has in flight
        for i, g in enumerate(c.gateways):
            most[i] = max(most[i], g.in_flight)

    c.at = _observed(c.at, watch)
    c.run(trace)
    assert all(not r.error and r.tokens_out == r.trace.output_tokens for r in c.done)
    assert most == [2 * WORKER.max_num_seqs // 4] * 4  # each its even share of the 32 slots, all of it used
    assert {id(r.gateway) for r in c.done} == {id(g) for g in c.gateways}
    with pytest.raises(ValueError, match="gateways"):
        Cluster(replace(spec, gateways=0), COST)


@pytest.mark.parametrize("routing", ["round-robin", "least-outstanding"])
def test_the_gateways_credits_keep_every_engine_queue_within_its_slots(routing):
    """As the mesh dispatches (services/policy/credit_ledger.py): a request goes only to a worker with a free batch
    slot, so requests wait at the gateway and no engine holds more than its slots, whatever the routing policy;
    without them round robin piles requests onto the slow worker."""
    trace = synthetic(Synthetic(requests=300, rate=300, prompt=(16, 64), output=(20, 60)), 5)
    spec = ClusterSpec(workers=3, worker=WORKER, admission="fcfs", routing=routing, worker_speeds=(1.0, 0.5, 0.25),
                       credits=True)
    c = run(spec, trace)
    assert all(not r.error for r in c.done)
    assert max(w["max_holding"] for w in c.worker_stats()) <= WORKER.max_num_seqs
    assert set(c.live.values()) == {0}  # every credit back
    if routing == "round-robin":
        unqueued = run(replace(spec, credits=False), trace)
        assert max(w["max_holding"] for w in unqueued.worker_stats()) > WORKER.max_num_seqs


def _observed(at, watch):
    """Cluster.at, with watch() called after each event it schedules."""
    def wrapped(t, fn, *args):
        def call(*a):
            fn(*a)
            watch()
        at(t, call, *args)
    return wrapped


def test_no_block_is_leaked_and_the_kv_stays_consistent():
    trace = synthetic(Synthetic(requests=300, rate=80, prompt=(16, 600), output=(4, 200), system_prompts=3,
                                system_tokens=(64, 256)), 9)
    small = replace(WORKER, num_blocks=160)  # tight: requests are preempted and recompute
    c = run(ClusterSpec(workers=2, worker=small, routing="prefix-aware", admission="none"), trace)
    assert len(c.done) == 300 and all(not r.error for r in c.done)
    assert all(r.tokens_out == r.trace.output_tokens for r in c.done)
    for w in c.workers:
        w.kv.check_integrity()
        assert w.pool.counts()["used"] == 0 and not w.sched.has_work and w.sched.waiting_tokens == 0


@pytest.mark.parametrize("mode", ["unified", "disaggregated"])
def test_a_deadline_passing_in_flight_ends_the_request_then_and_frees_its_slot_and_blocks(mode):
    # One slot per worker: "late" (first in, 400 tokens to make) holds it past its 0.5 s deadline, "next" waits.
    trace = [TraceRequest(0.0, 200, 400, id="late", deadline_ms=500), TraceRequest(0.0, 200, 50, id="next")]
    spec = ClusterSpec(mode=mode, workers=1, prefill=1 if mode == "disaggregated" else 0,
                       worker=replace(WORKER, max_num_seqs=1), admission="none")
    c = run(spec, trace)
    late, nxt = by_id(c)["late"], by_id(c)["next"]
    assert late.error == "DEADLINE_EXCEEDED" and late.tokens_out < 400
    assert late.last_s <= 0.5 + COST.hop_s  # nothing reaches the client after its deadline
    # "next" gets the slot when the step in progress at the deadline ends, not when "late" would have finished.
    assert not nxt.error and nxt.tokens_out == 50 and 0.5 < nxt.last_s < 0.5 + 0.05 + 50 * COST.step_s(1, 0, 250)
    for w in c.workers:
        w.kv.check_integrity()
        assert w.pool.counts()["used"] == 0 and not w.sched.has_work and not w.sims


def test_a_request_larger_than_a_worker_gets_out_of_range():
    c = run(ClusterSpec(workers=1, worker=replace(WORKER, num_blocks=8), admission="none"),
            [TraceRequest(0.0, 200, 5, id="big"), TraceRequest(0.1, 20, 5, id="ok")])
    assert by_id(c)["big"].error == "OUT_OF_RANGE" and not by_id(c)["ok"].error


# ---- determinism ----------------------------------------------------------------------------------------------


def test_the_same_seed_and_trace_give_byte_identical_results_in_one_process_or_several():
    trace = synthetic(Synthetic(requests=400, rate=60, system_prompts=4, system_tokens=(64, 256)), 11)
    spec = ClusterSpec(workers=8, cell_size=4, worker=WORKER, admission="none", routing="prefix-aware")

    def text(processes):
        r = simulate(spec, COST, trace, processes=processes)
        r.pop("run")
        return json.dumps(r, sort_keys=True)

    one = text(1)
    assert one == text(1) == text(2)
    c = Cluster(spec, COST)
    c.run(trace)
    whole = result_of(c, 1.0)
    whole.pop("run")
    assert json.dumps(whole, sort_keys=True) == one  # cells split over processes: the whole cluster's result


# ---- the policies at work -------------------------------------------------------------------------------------


def test_prefix_aware_routing_computes_fewer_prompt_tokens_than_round_robin():
    trace = synthetic(Synthetic(requests=400, rate=40, prompt=(16, 64), output=(8, 32), system_prompts=8,
                                system_tokens=(256, 512)), 13)
    worker = replace(WORKER, num_blocks=160)  # room for about 4 of the 8 system prompts
    computed = {}
    for policy in ("round-robin", "prefix-aware"):
        s = simulate(ClusterSpec(workers=4, worker=worker, routing=policy, admission="none"), COST, trace)["summary"]
        computed[policy] = s["prompt_tokens"] - s["cached_prompt_tokens"]
    assert computed["prefix-aware"] < 0.8 * computed["round-robin"]


def test_the_kv_pool_serves_prefixes_a_worker_does_not_cache():
    trace = synthetic(Synthetic(requests=300, rate=40, prompt=(16, 64), output=(8, 32), system_prompts=8,
                                system_tokens=(256, 512)), 13)
    worker = replace(WORKER, num_blocks=160)
    computed = {}
    for pool in (False, True):
        s = simulate(ClusterSpec(workers=4, worker=worker, routing="round-robin", admission="none", kv_pool=pool),
                     COST, trace)["summary"]
        computed[pool] = s["prompt_tokens"] - s["cached_prompt_tokens"]
    assert computed[True] < 0.7 * computed[False]


def test_request_level_batching_makes_newcomers_wait_for_the_batch_to_drain():
    trace = synthetic(Synthetic(requests=300, rate=12, output=(4, 200)), 17)
    out = {b: simulate(ClusterSpec(workers=2, worker=replace(WORKER, batching=b), admission="none"), COST,
                       trace)["summary"] for b in ("iteration", "request")}
    assert out["request"]["ttft_ms_p50"] > 2 * out["iteration"]["ttft_ms_p50"]
    assert out["request"]["e2e_ms_p99"] > out["iteration"]["e2e_ms_p99"]


def test_fair_admission_protects_a_light_tenant_from_a_heavy_one():
    # Equal weights; the heavy tenant offers 9x the light one's requests, several times what the worker serves, the
    # light one less than its half.
    spec_trace = Synthetic(requests=600, rate=40, prompt=(64, 256), output=(32, 128),
                           tenants=[TenantSpec("heavy", 9), TenantSpec("light", 1)])
    trace = synthetic(spec_trace, 19)
    light = {}
    for policy in ("fcfs", "fair"):
        c = run(ClusterSpec(workers=1, worker=replace(WORKER, max_num_seqs=8, slot_policy=policy), admission=policy,
                            tenant_weights={"heavy": 1, "light": 1}), trace)
        light[policy] = result_of(c, 1.0)["tenants"]["light"]
    assert light["fair"]["completed"] == light["fair"]["requests"] > light["fcfs"]["completed"]
    assert light["fair"]["ttft_ms_p99"] < 0.2 * light["fcfs"]["ttft_ms_p99"]


def test_light_tenants_first_serves_a_tenant_at_its_share_without_queueing_it_behind_a_heavy_one():
    """tenants-overload's mix (issue 39) on the simulator, at twice what the worker serves: A offers five times its
    weighted share, B and C about theirs. VTC alone serves B and C like queues at load 1, behind A's next dispatch;
    by demand they go first and A's backlog waits. The same policy objects as the gateway's."""
    shape = dict(prompt=(64, 256), output=(32, 128))
    probe = run(ClusterSpec(workers=1, worker=WORKER, admission="none"),
                synthetic(Synthetic(requests=400, rate=400, **shape), 29))
    capacity = result_of(probe, 1.0)["summary"]["output_tokens_per_s"] / 80  # req/s (80: the mean output)
    trace = synthetic(Synthetic(requests=int(2 * capacity * 120), rate=2 * capacity, **shape,
                                tenants=[TenantSpec("A", 5), TenantSpec("B", 1), TenantSpec("C", 2)]), 31)
    out = {}
    for policy in ("vtc", "fair"):
        c = run(ClusterSpec(workers=1, worker=replace(WORKER, slot_policy=policy), admission=policy,
                            tenant_weights={"A": 1, "B": 1, "C": 2}), trace)
        out[policy] = result_of(c, 1.0)["tenants"]
    light = {p: max(out[p][t]["ttft_ms_p99"] for t in ("B", "C")) for p in out}
    assert light["fair"] < 0.5 * light["vtc"], light
    for p in out:  # the heavy tenant keeps service either way (the floor: half its share)
        assert out[p]["A"]["completed"] > 0


def test_the_autoscaler_adds_workers_that_serve_only_after_their_start_up():
    trace = synthetic(Synthetic(requests=3000, rate=5, burst_every_s=200, burst_s=60, burst_factor=8), 23)
    scale = AutoscaleSpec(policy="token", startup_s=30.0, interval_s=5.0, max_replicas=12, ttft_slo_s=1.0,
                          prefill_tokens_per_s=3000, decode_tokens_per_s=600, cooldown_s=20, down_window_s=60,
                          window_s=30)
    c = run(ClusterSpec(workers=1, worker=WORKER, autoscale=scale, ttft_slo_ms=1000), trace)
    assert len(c.done) == 3000
    starts = [(t, n, s) for t, n, s in c.timeline if s > 0]
    assert starts and max(n + s for _, n, s in c.timeline) > 2
    first_start = starts[0][0]
    first_ready = next(t for t, n, s in c.timeline if n > 1)
    assert first_ready >= first_start + 30.0 - 1e-9
    assert any(w.started_s >= first_ready and w.steps > 0 for w in c.workers)


def test_the_cli_runs_a_trace_and_names_a_bad_one(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert main(["sim", "trace", "--out", str(trace), "--requests", "50", "--rate", "20"]) == 0
    out = tmp_path / "r.json"
    assert main(["sim", "run", "--trace", str(trace), "--workers", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["summary"]["completed"] == 50 and result["summary"]["ttft_ms_p50"] > 0
    trace.write_text('{"arrival_s": 0}\n')
    assert main(["sim", "run", "--trace", str(trace)]) == 2
    assert "t.jsonl:1: missing" in capsys.readouterr().err


def test_a_study_runs_only_the_systems_named(tmp_path, capsys):
    out = tmp_path / "d.json"
    args = ["sim", "study", "disaggregation", "--workers", "8", "--requests", "300", "--processes", "1",
            "--out", str(out)]
    assert main(args + ["--systems", "unified,disaggregated-1:3"]) == 0
    result = json.loads(out.read_text())
    assert sorted(result["systems"]) == ["disaggregated-1:3", "unified"]
    assert all(s["completed"] == 300 and len(s["slo_grid"]) == 20 for s in result["systems"].values())
    assert out.with_suffix(".png").exists()
    assert main(args + ["--systems", "nope"]) == 2
    assert "none of --systems nope" in capsys.readouterr().err
