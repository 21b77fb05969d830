"""Scaling policies replayed over recorded and simulated metric windows (table-driven): no scale-up while enough
capacity is starting, no flapping on a sawtooth, scale-down only after the cooldown and the down window and only by
drain, the start-up time as the forecast horizon, the minimum at zero traffic; the baselines' formulas."""

import pytest

from services.policy.scaling import (
    CpuPolicy,
    PolicyState,
    PoolConfig,
    PoolSample,
    RatePolicy,
    TokenPolicy,
    size_pair,
)

DECODE = PoolConfig("decode", min_replicas=1, max_replicas=8, startup_s=30, decode_tokens_per_s=500, target_util=0.7,
                    cooldown_s=60, down_window_s=120, max_step=2)


def recorded(rows: list[tuple]) -> list[PoolSample]:
    """(t, ready, starting, output tok/s) rows, as an autoscaler would have recorded them."""
    return [PoolSample(t, ready, starting, output_tokens_per_s=out, requests_per_s=out / 50) for t, ready, starting, out
            in rows]


CASES = {  # name: (rows, expected kind, expected target)
    "enough capacity starting: no cascade": ([(0, 1, 2, 1000), (5, 1, 2, 1000), (10, 1, 2, 1000)], "hold", 3),
    "the same demand with nothing starting: up": ([(0, 1, 0, 1000), (5, 1, 0, 1000), (10, 1, 0, 1000)], "up", 3),
    "a rising demand is met where it will be once started": ([(0, 1, 0, 900), (5, 1, 0, 950), (10, 1, 0, 1000)],
                                                             "up", 3),
    "steady and sized: hold": ([(0, 2, 0, 600), (5, 2, 0, 600), (10, 2, 0, 600)], "hold", 2),
    "bounded step": ([(0, 1, 0, 2500), (5, 1, 0, 2500), (10, 1, 0, 2500)], "up", 3),
    "zero traffic but just started: no drain yet": ([(0, 3, 0, 0), (5, 3, 0, 0), (10, 3, 0, 0)], "hold", 3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_recorded_windows(case):
    rows, kind, target = CASES[case]
    samples = recorded(rows)
    d = TokenPolicy(DECODE).decide(samples, PolicyState(), samples[-1].t)
    assert (d.kind, d.target) == (kind, target), d
    assert d.reason


class Pool:
    """A pool whose replicas follow the decisions: added ones start for startup_s, drained ones leave at once."""

    def __init__(self, ready: int, startup_s: float):
        self.ready, self.starting, self.startup_s = ready, [], startup_s

    def step(self, now: float) -> None:
        done = [t for t in self.starting if now - t >= self.startup_s]
        self.starting = [t for t in self.starting if now - t < self.startup_s]
        self.ready += len(done)

    def apply(self, d, now: float) -> None:
        current = self.ready + len(self.starting)
        if d.kind == "up":
            self.starting += [now] * (d.target - current)
        elif d.kind == "drain":
            self.ready -= current - d.target


def simulate(policy, load, duration_s: float, step_s: float = 5.0, ready: int = 1, startup_s: float = 30.0):
    """Decisions over a load curve (output tok/s at t); returns [(t, decision, ready, starting)]."""
    pool, state, samples, out = Pool(ready, startup_s), PolicyState(), [], []
    t = 0.0
    while t <= duration_s:
        pool.step(t)
        rate = load(t)
        capacity = pool.ready * 500
        samples.append(PoolSample(t, pool.ready, len(pool.starting), output_tokens_per_s=min(rate, capacity),
                                  requests_per_s=rate / 50, cpu_util=min(1.0, rate / max(capacity, 1)),
                                  itl_p90_s=0.05 if rate <= capacity * 0.8 else 0.4))
        d = policy.decide(samples, state, t)
        pool.apply(d, t)
        out.append((t, d, pool.ready, len(pool.starting)))
        t += step_s
    return out


def test_no_flapping_on_a_sawtooth():
    sawtooth = lambda t: 1400 if int(t // 20) % 2 == 0 else 300  # noqa: E731  high and low every 20 s
    run = simulate(TokenPolicy(DECODE), sawtooth, 600)
    kinds = [d.kind for _, d, _, _ in run if d.kind != "hold"]
    changes = sum(1 for a, b in zip(kinds, kinds[1:]) if a != b)
    assert "up" in kinds and changes == 0, kinds  # up once to the peak's size, never down between the teeth


def test_scale_down_only_after_cooldown_and_window_and_only_by_drain():
    load = lambda t: 1600 if t < 200 else 0  # noqa: E731
    run = simulate(TokenPolicy(DECODE), load, 800)
    ups = [t for t, d, _, _ in run if d.kind == "up"]
    drains = [(t, d) for t, d, _, _ in run if d.kind == "drain"]
    assert ups and drains
    first_drain = drains[0][0]
    assert first_drain >= max(ups) + DECODE.cooldown_s
    assert first_drain >= 200 + DECODE.down_window_s  # the last high target leaves the window first
    assert all(b[0] - a[0] >= DECODE.cooldown_s for a, b in zip(drains, drains[1:]))
    assert run[-1][2] == DECODE.min_replicas  # zero traffic: the minimum
    assert all("no traffic" in d.reason for _, d in drains)


def test_the_startup_time_is_the_forecast_horizon():
    ramp = lambda t: 20 * t  # noqa: E731  output tok/s rising 20 per second
    samples = [PoolSample(t, 2, 0, output_tokens_per_s=20 * t) for t in range(0, 41, 5)]
    short = TokenPolicy(PoolConfig("decode", startup_s=5)).decide(samples, PolicyState(), 40)
    long = TokenPolicy(PoolConfig("decode", startup_s=120)).decide(samples, PolicyState(), 40)
    assert long.desired > short.desired  # a slow start-up has to ask earlier
    assert ramp(40) == 800


def test_an_slo_breach_adds_a_replica_even_in_the_cooldown_unless_one_is_starting():
    policy, state = TokenPolicy(DECODE), PolicyState(last_change_t=0.0, last_kind="up")
    calm = [PoolSample(t, 2, 0, output_tokens_per_s=300, itl_p90_s=0.5) for t in (10, 15, 20)]
    d = policy.decide(calm, state, 20)
    assert (d.kind, d.target) == ("up", 3) and "inter-token" in d.reason
    starting = [PoolSample(t, 2, 1, output_tokens_per_s=300, itl_p90_s=0.5) for t in (25, 30)]
    assert policy.decide(starting, state, 30).kind == "hold"


def test_a_backlog_in_the_gateways_admission_queue_adds_a_replica():
    """Late binding keeps a saturated pool's backlog at the gateway: the engines' rates and queues look sized (two
    replicas for 600 tok/s), the gateway's queue says otherwise."""
    policy = TokenPolicy(DECODE)
    sized = [PoolSample(t, 2, 0, output_tokens_per_s=600) for t in (10, 15, 20)]
    assert policy.decide(sized, PolicyState(), 20).kind == "hold"
    backlog = sized[:-1] + [PoolSample(20, 2, 0, output_tokens_per_s=600, gateway_queued=12, gateway_queue_wait_s=4.0)]
    d = policy.decide(backlog, PolicyState(), 20)
    assert (d.kind, d.target) == ("up", 3) and "admission queues, the oldest for 4.0 s" in d.reason
    brief = sized[:-1] + [PoolSample(20, 2, 0, output_tokens_per_s=600, gateway_queued=3, gateway_queue_wait_s=0.3)]
    assert policy.decide(brief, PolicyState(), 20).kind == "hold"  # a queue that drains within the bound is fine


def test_a_drain_does_not_hold_back_the_next_scale_up_but_a_scale_up_does():
    busy = [PoolSample(t, 1, 0, output_tokens_per_s=1000) for t in (10, 15, 20)]
    after_drain = PolicyState(last_change_t=15.0, last_kind="drain")
    assert TokenPolicy(DECODE).decide(busy, after_drain, 20).kind == "up"
    after_up = PolicyState(last_change_t=15.0, last_kind="up")
    d = TokenPolicy(DECODE).decide(busy, after_up, 20)
    assert d.kind == "hold" and "cooldown" in d.reason


def test_prefill_pools_size_by_prompt_tokens_and_queue():
    cfg = PoolConfig("prefill", startup_s=10, prefill_tokens_per_s=2000, target_util=0.5, max_replicas=20)
    samples = [PoolSample(t, 1, 0, prompt_tokens_per_s=1000, queued_prefill_tokens=0) for t in (0, 5, 10)]
    assert TokenPolicy(cfg).desired(samples, 10)[0] == 1
    queued = samples[:-1] + [PoolSample(10, 1, 0, prompt_tokens_per_s=1000, queued_prefill_tokens=20_000)]
    assert TokenPolicy(cfg).desired(queued, 10)[0] == 3  # (1000 + 20000 / 10) / 1000


def test_cpu_baseline_is_the_hpa_formula_and_rate_baseline_divides():
    samples = [PoolSample(0, 2, 0, cpu_util=1.0, requests_per_s=9.0)]
    assert CpuPolicy(DECODE, target_cpu=0.5).desired(samples, 0)[0] == 4
    assert CpuPolicy(DECODE, target_cpu=0.95).desired(samples, 0)[0] == 2  # within the 10% tolerance
    assert RatePolicy(DECODE, requests_per_s_per_replica=4).desired(samples, 0)[0] == 3


def test_pair_sized_together_from_the_token_mix():
    p = PoolConfig("prefill", prefill_tokens_per_s=2000, target_util=0.5, max_replicas=10)
    d = PoolConfig("decode", decode_tokens_per_s=500, target_util=0.5, max_replicas=10)
    assert size_pair(p, d, prompt_tokens_per_s=4000, output_tokens_per_s=1000) == (4, 4)
    assert size_pair(p, d, prompt_tokens_per_s=8000, output_tokens_per_s=200) == (8, 1)
    assert size_pair(p, d, prompt_tokens_per_s=0, output_tokens_per_s=0) == (1, 1)


@pytest.mark.parametrize("policy", [TokenPolicy(DECODE), CpuPolicy(DECODE, 0.7), RatePolicy(DECODE, 4.0)],
                         ids=lambda p: p.name)
def test_the_signal_window_decides_as_the_whole_history_would(policy):
    """SignalWindow (the loop the autoscaler service and the simulator share) keeps only the policy's window of
    samples; its decisions over a long, changing recording are those of the policy shown every sample so far."""
    import random

    from services.policy.scaling import SignalWindow

    rng, ready, window, everything, state = random.Random(7), 2, SignalWindow(), [], PolicyState()
    for i in range(200):  # 1,000 s of a load that rises, falls and spikes, a sample every 5 s
        out = max(0.0, 800 + 700 * ((i // 40) % 2) - 600 * (i > 150) + rng.uniform(-200, 200))
        sample = PoolSample(5.0 * i, ready, 0, output_tokens_per_s=out, requests_per_s=out / 50,
                            cpu_util=min(1.0, out / (500 * ready)))
        everything.append(sample)
        got, want = window.decide(policy, sample), policy.decide(everything, state, sample.t)
        assert got == want, i
        ready = got.target
    assert len(window.samples) <= DECODE.window_s / 5 + 1 < len(everything)


@pytest.mark.parametrize("policy", [TokenPolicy, CpuPolicy, RatePolicy])
def test_a_pool_at_zero_starts_one_replica_when_requests_wait_for_it_and_scales_back_to_zero(policy):
    pool = PoolConfig("unified", min_replicas=0, max_replicas=4, startup_s=10, cooldown_s=30, down_window_s=60)
    p, state = policy(pool), PolicyState()
    idle = [PoolSample(t, 0, 0) for t in (0, 5, 10)]
    assert (p.decide(idle, state, 10).kind, p.decide(idle, state, 10).target) == ("hold", 0)  # nothing asks
    # a request arrives: the gateway holds it (no worker at all) and says so; no forecast, no cooldown to wait out
    state.last_change_t, state.last_kind = 9.0, "up"
    waiting = idle + [PoolSample(15, 0, 0, waiting_for_worker=1)]
    d = p.decide(waiting, state, 15)
    assert (d.kind, d.target) == ("up", 1) and "wait for a worker" in d.reason
    # once it is starting, nothing more is asked for it (the held request is not counted twice)
    assert p.decide(waiting + [PoolSample(16, 0, 1, waiting_for_worker=1)], state, 16).target == 1
    # with no traffic for long enough (the CPU baseline's window is the HPA's 300 s) it goes back to zero, by drain
    quiet = [PoolSample(t, 1, 0) for t in range(600, 700, 5)]
    later = p.decide(quiet, state, 700)
    assert (later.kind, later.target) == ("drain", 0)
    # a pool whose maximum is zero is never started
    off = policy(PoolConfig("unified", min_replicas=0, max_replicas=0))
    assert off.decide(waiting, PolicyState(), 15).target == 0
