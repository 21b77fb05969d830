"""The cluster claims (sim/claims.py, sim/placement_claim.py) at a size CI affords: 16 simulated workers, one load
each. What they must show there is what the claims report at 1,000: least-outstanding cuts round robin's TTFT tail
among workers of two speeds, prefix-aware routing computes fewer prompt tokens than round robin, fair admission is
fairer than FCFS under a heavy tenant, lora-aware routing reads and swaps fewer adapters than least-outstanding at no
cost in throughput, and the mesh's placement sends fewer KV bytes across racks than first fit."""

import pytest

from sim import claims
from sim.placement_claim import measure as placement

slow = pytest.mark.slow  # seconds of simulation each: out of the fast lane


@pytest.fixture(scope="module")
def routing():
    return claims.measure("routing", 16, (0.95,), requests_per_worker=64)["by_load"]["0.95"]


@slow
def test_least_outstanding_halves_round_robins_ttft_tail_among_workers_of_two_speeds(routing):
    assert routing["least-outstanding"]["ttft_ms_p99"] <= 0.5 * routing["round-robin"]["ttft_ms_p99"]
    assert routing["power-of-two"]["ttft_ms_p99"] < routing["round-robin"]["ttft_ms_p99"]
    assert {s["completed"] for s in routing.values()} == {16 * 64}


@slow
def test_a_stale_view_of_the_workers_costs_least_outstanding_its_lead(routing):
    fresh = routing["least-outstanding"]["ttft_ms_p99"] / routing["round-robin"]["ttft_ms_p99"]
    stale = claims.measure("routing", 16, (0.95,), requests_per_worker=64, heartbeat_s=1.0)["targets"]["0.95"]
    assert fresh < stale["ttft_p99_vs_round_robin"]["least-outstanding"]


@slow
def test_prefix_aware_routing_computes_fewer_prompt_tokens_and_starts_sooner():
    r = claims.measure("prefix-8", 16, (0.85,), requests_per_worker=32)["by_load"]["0.85"]
    rr, pa = r["round-robin"], r["prefix-aware"]
    assert pa["prefill_tokens_computed"] < 0.8 * rr["prefill_tokens_computed"]
    assert pa["ttft_ms_p50"] < 0.5 * rr["ttft_ms_p50"]
    assert pa["busy_max_over_mean"] <= 1.3


@slow
def test_fair_admission_is_fairer_than_fcfs_under_a_heavy_tenant():
    r = claims.measure("tenants", 8, (2.0,), requests_per_worker=48)["by_load"]["2"]
    assert r["fair-deadline"]["jain_index"] > r["fcfs"]["jain_index"]
    assert r["fair-deadline"]["light_ttft_p99_ratio"] < r["fcfs"]["light_ttft_p99_ratio"]
    assert set(r["_solo"]["tenants"]) == {f"light{i}" for i in range(1, 10)}


@slow
def test_lora_aware_routing_loads_fewer_adapters_at_the_same_throughput():
    r = claims.measure("lora", 16, (0.85,), requests_per_worker=48)["by_load"]["0.85"]
    lor, aware = r["least-outstanding"], r["lora-aware"]
    assert lor["completed"] == aware["completed"] == 16 * 48
    assert aware["lora_reads"] < 0.75 * lor["lora_reads"]
    assert aware["lora_slot_loads"] < 0.8 * lor["lora_slot_loads"]
    assert aware["output_tokens_per_s"] >= 0.95 * lor["output_tokens_per_s"]


def test_placement_keeps_more_kv_inside_racks_than_first_fit():
    by = placement(200, (0.85,))["0.85"]
    assert by["meshserve"]["kv_cross_rack"] < by["first-fit"]["kv_cross_rack"]
    assert by["meshserve"]["unplaced"] == by["first-fit"]["unplaced"] == 0
