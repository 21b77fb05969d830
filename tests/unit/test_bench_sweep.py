"""The load-sweep harness's pure parts (bench/sweep.py, bench/plot.py): where a ramp says the mesh stops
keeping up, the balance figures from workers' Stats, per-load ratios, and the plot file."""

from types import SimpleNamespace

from bench.plot import plot_sweep
from bench.sweep import RampStep, balance, keeps_up, ratios_by_load, sustainable_rate, sustained, system_of


def test_a_ramp_step_is_sustained_while_its_median_ttft_stays_within_the_knee():
    assert sustained([90, 100, 110, 250], unloaded_ms=50) == (True, 100)  # 2x the unloaded median: keeps up
    assert sustained([100, 400, 500, 600], unloaded_ms=50) == (False, 400)
    # requests still without a first token count as the slowest: half of them missing is past the knee
    assert sustained([60, 70, None, None], unloaded_ms=50) == (True, 70)
    assert sustained([60, None, None, None], unloaded_ms=50) == (False, None)
    assert sustained([], unloaded_ms=50) == (True, None)  # no arrival in a short step says nothing


def test_the_sustainable_rate_is_the_held_one_and_a_failed_hold_steps_down():
    steps = [RampStep(1.0, 8, 50, True), RampStep(1.15, 9, 60, True), RampStep(1.32, 11, 900, False)]
    assert sustainable_rate(steps) == 1.15  # before any hold: the last sustained step
    assert sustainable_rate([RampStep(1.0, 8, 900, False)]) is None
    held = steps + [RampStep(1.15, 27, 400, False, hold=True), RampStep(1.0, 24, 70, True, hold=True)]
    assert sustainable_rate(held) == 1.0  # 1.15 passed a short step but not a long hold
    assert sustainable_rate(held[:-1]) == 1.15  # no hold sustained yet: the lowest held, unconfirmed


def test_a_hold_keeps_up_only_while_the_mesh_generates_the_tokens_its_arrivals_ask_for():
    """TTFT alone passed a hold at twice what a many-slot mesh sustains (every request got a slot at once and all
    decoded slower): the tokens generated over the hold's second half must reach KEEP_UP of those asked for."""
    events = [(t / 10, 4) for t in range(200)]  # 40 tokens/s over 20 s
    assert keeps_up(events, 10.0, 20.0, asked_per_s=40.0) == (True, 40.0)
    assert keeps_up(events, 10.0, 20.0, asked_per_s=80.0) == (False, 40.0)  # asked twice what it made
    assert keeps_up(events, 10.0, 20.0, asked_per_s=46.0)[0]  # within the 0.85 margin
    assert keeps_up([], 10.0, 20.0, asked_per_s=1.0) == (False, 0.0)


def stats(busy_s, started, queue_wait_s):
    return SimpleNamespace(busy_s=busy_s, started=started, queue_wait_s=queue_wait_s)


def test_balance_is_each_workers_share_of_busy_time_and_its_mean_queueing_delay_over_the_run():
    before = [stats(10.0, 5, 1.0), stats(10.0, 5, 1.0)]
    after = [stats(40.0, 25, 3.0), stats(20.0, 15, 1.5)]  # 30 s and 10 s busy; 20 and 10 requests started
    b = balance(before, after)
    assert b["busy_share"] == [0.75, 0.25]
    assert b["busy_share_max_over_mean"] == 1.5  # the busiest did 1.5x the mean
    assert b["queue_wait_ms_per_worker"] == [100.0, 50.0] and b["queue_wait_ms_spread"] == 50.0
    idle = balance(before, before)
    assert idle["busy_share_max_over_mean"] is None and idle["queue_wait_ms_spread"] is None


def sweep_result():
    def point(load, ttft, e2e):
        return {"load": load, "ttft_ms_p99": ttft, "e2e_ms_p99": e2e}
    return {"workload": "skewed-costs", "machine": {"cpu_model": "test CPU", "cpus": 2},
            "config": {"sustainable_req_per_s": 3.0},
            "systems": {"round-robin": system_of([point(0.5, 100, 1000), point(0.95, 800, 9000)]),
                        "least-outstanding": system_of([point(0.5, 90, 900), point(0.95, 200, 4000)]),
                        "least-outstanding+slowed": system_of([point(0.7, 300, 5000)])}}


def test_a_system_keeps_its_heaviest_loads_figures_on_top_and_ratios_are_per_load():
    result = sweep_result()
    lo = result["systems"]["least-outstanding"]
    assert lo["ttft_ms_p99"] == 200 and [p["load"] for p in lo["loads"]] == [0.5, 0.95]
    assert ratios_by_load(result["systems"], "least-outstanding", "round-robin", ("ttft_ms_p99",)) == {
        "least-outstanding/round-robin:ttft_ms_p99@0.5": 0.9, "least-outstanding/round-robin:ttft_ms_p99@0.95": 0.25}


def test_the_plot_is_a_png_with_a_line_per_swept_policy(tmp_path):
    path = tmp_path / "plots" / "skewed-costs.png"
    assert plot_sweep(sweep_result(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
