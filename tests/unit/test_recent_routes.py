"""The router's overlay of recently routed prefixes, and the worker's self-measurements."""

import pytest

from services.engine.step_cost import StepCostFit
from services.policy.routing.recent import RecentRoutes
from services.worker.measure import DecodeRate
from tests.support.fakes import Clock

H = [bytes([i]) * 16 for i in range(6)]
OTHER = [H[0], H[1], b"x" * 16]  # shares two blocks with H


def test_recent_routes_longest_prefix_per_worker_and_expiry():
    clock = Clock()
    recent = RecentRoutes(clock, ttl_s=5.0)
    recent.record(H[:4], "a")
    recent.record(OTHER, "b")
    assert recent.longest(H) == {"a": 4, "b": 2}
    assert recent.longest(H[:3]) == {"a": 3, "b": 2}
    assert recent.longest([b"y" * 16] + H[1:]) == {}  # a prefix starts at the first block
    clock.now = 4.0
    recent.record(H[:1], "b")  # b's latest prompt starting with H[0] replaces its previous one
    clock.now = 5.5  # a's record has expired; b's new one has not
    assert recent.longest(H) == {"b": 1}


def test_recent_routes_memory_is_bounded():
    clock = Clock()
    recent = RecentRoutes(clock, ttl_s=5.0, max_entries=3)
    for i in range(6):
        recent.record([bytes([i]) * 16], f"w{i}")
    assert len(recent.entries) == 3 and sum(map(len, recent.by_first.values())) == 3
    clock.now = 6.0
    recent.record([b"z" * 16], "w9")  # expired entries go as new ones arrive
    assert len(recent.entries) == 1


def test_decode_rate_is_a_decaying_peak_over_busy_time():
    rate = DecodeRate(decay=0.5, min_busy_s=0.2)
    assert rate.update(0.1, 50) == 0.0  # too little work to tell
    assert rate.update(1.0, 400) == 400.0  # 400 tokens in 1 s busy
    assert rate.update(1.5, 450) == 200.0  # a lighter window: the old figure decays, no faster
    assert rate.update(1.5, 450) == 200.0  # idle: unchanged


def test_step_cost_fit():
    fit = StepCostFit(alpha=1.0, min_prefill=32)
    fit.update(4, 100, 0.48)  # prefill before any decode step (a prefill worker runs none): the whole step
    assert fit.prefill_s_per_token == pytest.approx(0.005)
    fit.update(8, 8, 0.02)  # decode only
    assert fit.decode_s_per_step == 0.02
    fit.update(2, 102, 0.12)  # 100 prefill tokens took what the step took beyond a decode step of 2 sequences
    assert fit.prefill_s_per_token == pytest.approx((0.12 - fit.step_s(2)) / 100)
    assert 0.01 < fit.step_s(2) < 0.02


def test_a_prefill_workers_prompt_cost_is_the_slope_of_its_steps():
    fit = StepCostFit(alpha=1.0, forget=0.0)
    for tokens in (40, 200, 64, 900, 120) * 3:  # a fixed 50 ms a step, 0.3 ms a prompt token; no decode-only step
        fit.update(2, 2 + tokens, 0.05 + 0.0003 * tokens)
    assert fit.prefill_s_per_token == pytest.approx(0.0003)  # the whole step per token would say 0.55 ms at 200


def test_step_cost_fit_learns_the_cost_of_a_sequence_from_varied_batches():
    fit = StepCostFit(alpha=1.0, forget=0.0)
    for b in (1, 2, 4, 8, 16) * 4:
        fit.update(b, b, 0.002 + 0.0003 * b)  # decode-only steps
    base, per_seq = fit.line
    assert base == pytest.approx(0.002) and per_seq == pytest.approx(0.0003)
    assert fit.step_s(4, 100) == pytest.approx(0.0032 + 100 * fit.prefill_s_per_token)
    same = StepCostFit(forget=0.0)
    for _ in range(10):
        same.update(16, 16, 0.006)  # one batch size only: the prior splits the time (a sequence = 1/8 of the base)
    base, per_seq = same.line
    assert base + 16 * per_seq == pytest.approx(0.006) and per_seq == pytest.approx(base / 8)


def test_step_cost_fit_line_follows_every_decode_step():
    fit = StepCostFit(alpha=1.0, forget=0.0)
    for b in (1, 2, 4, 8) * 3:
        fit.update(b, b, 0.002 + 0.0003 * b)
    assert fit.line == pytest.approx((0.002, 0.0003))  # read (and kept) here
    for b in (1, 2, 4, 8) * 30:  # the machine slowed: each step costs twice as much
        fit.update(b, b, 2 * (0.002 + 0.0003 * b))
    fit.update(4, 40, 0.05)  # a prompt step does not move the line
    fresh = StepCostFit(alpha=1.0, forget=0.0)
    for b in (1, 2, 4, 8) * 3:
        fresh.update(b, b, 0.002 + 0.0003 * b)
    for b in (1, 2, 4, 8) * 30:
        fresh.update(b, b, 2 * (0.002 + 0.0003 * b))
    assert fit.line == fresh.line and fit.line[0] > 0.0035  # the line read before the slowdown is not reused
