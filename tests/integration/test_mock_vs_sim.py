"""The simulator against the mesh of mock workers on one small workload (bench/mock_cluster.py: the same trace, the
same step-time model, the mock mesh's own hop time): the decode dynamics agree within their bounds (TPOT p50 within
5%, p99 within 10%). TTFT and throughput are reported by the benchmark and not yet asserted: the simulator's TTFT
tail (p99) runs 36-39% above the mock mesh's at 8 workers, a disagreement still to be found (docs/CLUSTER.md)."""

import argparse
import json

import pytest

from bench import mock_cluster

pytestmark = pytest.mark.slow


def test_the_simulator_decodes_as_the_mock_mesh_does(tiny_model):
    args = argparse.Namespace(profile="h100-llama8b", time_scale=4.0, real_tokens_per_s=1200.0, offered=0.7,
                              requests_per_worker=8, seed=0)
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    got = mock_cluster.one(tiny_model, 4, args, vocab)
    assert got["mock"]["completed"] == got["sim"]["completed"] == got["requests"]
    assert got["within"]["tpot_ms_p50"], got["error"]
    assert got["within"]["tpot_ms_p99"], got["error"]
    assert got["memory"]["per_worker_mb_mean"] < 150  # a mock worker is small: 64 of them fit in 16 GB
