"""LoRA residency on the mock mesh against the simulator (bench/cluster_claims.py, claim "lora"): the real
gateway, router and workers with mock engines, adapters as PEFT configs (no weights), reads and slot copies as the
step-time model says. On the same trace the mock mesh and the simulator run the same residency code; what they
count must agree (the claims at 64 workers rest on it), and every request must complete on every worker's share."""

import argparse
import json
from dataclasses import replace

import pytest

from bench import cluster_claims
from sim import claims

pytestmark = pytest.mark.slow


def test_the_mock_mesh_and_the_simulator_load_the_same_adapters(tiny_model, tmp_path, monkeypatch):
    lora = claims.CLAIMS["lora"]
    monkeypatch.setitem(claims.CLAIMS, "lora", replace(lora, mix=replace(lora.mix, adapters=40),
                                                       systems={"lora-aware": lora.systems["lora-aware"]}))
    args = argparse.Namespace(claim_requests_per_worker=24, claim_workers=4, claim_profile="h100-llama8b",
                              claim_loads="0.5", seed=0, claim_time_scale=4.0, claim_real_tokens_per_s=900.0,
                              claim_real_requests_per_s=20.0, claim_sim_only=False)
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    mock, sim = cluster_claims.one_claim("lora", tiny_model, vocab, args)
    m, s = mock["by_load"]["0.5"]["lora-aware"], sim["by_load"]["0.5"]["lora-aware"]
    assert m["completed"] == s["completed"] == 4 * 24
    assert m["lora_reads"] > 0 and m["lora_hits"] > 0
    assert abs(m["lora_reads"] - s["lora_reads"]) <= 0.15 * s["lora_reads"], (m, s)
    assert abs(m["lora_slot_loads"] - s["lora_slot_loads"]) <= 0.15 * s["lora_slot_loads"], (m, s)
