"""Scaling policies: pure, replayable objects that turn a pool's recent signals into a replica count.

A pool (prefill, decode or unified workers) is observed as a series of PoolSamples (the autoscaler builds
one every few seconds from the OTLP metrics it receives; a test or a simulation can build them from a
recording). decide(samples, state, now) returns a Decision: the target replica count, the kind of change
(up, drain, hold) and the reason, a sentence that names the signal that decided it. No I/O, no clock of
its own: the same samples give the same decisions.

TokenPolicy sizes by work in tokens, looking ahead by the pool's measured start-up time:
- demand: the prompt (prefill pools) or output (decode pools) token rate, both for unified pools, forecast
  `startup_s` ahead from the window's linear trend (a replica asked for now serves only from then on), and
  the queued prefill tokens, to be cleared within the same horizon;
- capacity: per ready replica, measured (tokens per second of busy time, from the workers' own step-cost
  fits) at a target utilisation (`target_util`, headroom for the tail);
- SLO guards: TTFT p90 over its SLO (prefill, unified) or inter-token p90 over its SLO (decode, unified), KV
  occupancy above `kv_high`, or a request waiting longer than `queue_wait_s` in the gateways' admission queues
  for the pool (late binding keeps the backlog there, not in the engines), ask for at least one replica more than
  the ready ones, whatever the demand;
- replicas still starting count as capacity: while the ready + starting ones cover the target, nothing is
  added (no cascade 2 -> 4 -> 8 while pods are pending);
- up: at once, by at most `max_step`, not within `cooldown_s` of the previous scale-up (a drain does not hold
  one back: the load came back, and the down window already keeps a pool from flapping); down: only when every
  target of the last `down_window_s` was below the current size by `down_margin` (hysteresis), at most
  `max_step` at a time, never within `cooldown_s` of the previous change, and by drain (the router stops
  routing to the replica, its requests finish, then it stops);
- min/max bounds; with no traffic for the window, `min_replicas`, which may be 0 (scale to zero);
- from zero: a pool with no replica, ready or starting, while the gateways hold requests for it
  (`waiting_for_worker`) goes to max(1, min_replicas) at once.

Baselines, in the same shape, for comparison: CpuPolicy (the Kubernetes HPA formula on CPU utilisation, with
its 5-minute scale-down stabilisation) and RatePolicy (requests per second over a per-replica rate).
size_pair() sizes a disaggregated pair together from the prompt/output token mix.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class PoolSample:
    """One observation of a pool (sums over its replicas unless said)."""

    t: float  # seconds (any monotonic origin)
    ready: int  # replicas serving
    starting: int = 0  # replicas started and not yet ready
    prompt_tokens_per_s: float = 0.0  # prompt tokens arriving
    output_tokens_per_s: float = 0.0  # output tokens produced
    requests_per_s: float = 0.0
    queued_prefill_tokens: float = 0.0  # prompt tokens waiting to be computed
    kv_usage: float = 0.0  # the fullest replica's KV occupancy, 0..1
    ttft_p90_s: float | None = None  # over the sample's interval; None = no first token in it
    itl_p90_s: float | None = None  # inter-token latency p90
    cpu_util: float = 0.0  # mean CPU utilisation of the ready replicas, 0..1
    waiting_for_worker: float = 0.0  # requests the gateways hold because the pool has no worker at all
    gateway_queued: float = 0.0  # requests in the gateways' admission queues, waiting for this pool's capacity
    gateway_queue_wait_s: float = 0.0  # how long the oldest of them has waited


@dataclass(frozen=True)
class PoolConfig:
    role: str  # prefill | decode | unified
    min_replicas: int = 1
    max_replicas: int = 8
    startup_s: float = 30.0  # measured: model load + warm-up of one replica (the forecast horizon)
    prefill_tokens_per_s: float = 2000.0  # one replica's prompt tokens per second, measured
    decode_tokens_per_s: float = 500.0  # one replica's output tokens per second at its usual batch, measured
    target_util: float = 0.7  # capacity is planned at this fraction of a replica's rate
    ttft_slo_s: float = 1.0
    itl_slo_s: float = 0.2
    kv_high: float = 0.85
    queue_wait_s: float = 1.0  # a request waiting longer in a gateway's admission queue for this pool's capacity
    max_step: int = 2  # replicas added or drained per decision, at most
    cooldown_s: float = 60.0  # no change within this long of the previous one (SLO breaches may still add)
    down_window_s: float = 120.0  # scale down only if every target over this window was lower
    down_margin: float = 0.8  # ... and at most this fraction of the current size
    window_s: float = 60.0  # samples considered for rates and the trend


@dataclass(frozen=True)
class Decision:
    target: int  # replicas wanted (ready + starting, after this decision)
    kind: str  # up | drain | hold
    reason: str
    desired: int  # the raw target before hysteresis and bounds (what the signals alone ask for)


@dataclass
class PolicyState:
    """What a policy remembers between decisions (kept by the caller, so that replay is explicit)."""

    last_change_t: float = -math.inf
    last_kind: str = ""  # up | drain: the previous change
    desired_history: list = field(default_factory=list)  # (t, desired) over the last down_window_s
    first_t: float | None = None  # the first decision's time (a scale-down needs a whole window of targets)


def _window(samples: list[PoolSample], now: float, window_s: float) -> list[PoolSample]:
    return [s for s in samples if now - window_s <= s.t <= now]


def _trend(points: list[tuple[float, float]], at: float) -> float:
    """Least-squares line through (t, y), evaluated at `at` (the last value with fewer than 3 points); within
    [0, twice the larger of the latest value and the mean]: a forecast, not an extrapolation to infinity."""
    if not points:
        return 0.0
    last = points[-1][1]
    if len(points) < 3:
        return last
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var <= 0:
        return last
    slope = sum((t - mt) * (y - my) for t, y in points) / var
    return max(0.0, min(my + slope * (at - mt), 2 * max(last, my)))


class _Hysteresis(ABC):
    """What every policy shares: bounds, steps, cooldown, the down window, drain."""

    name = ""

    def __init__(self, config: PoolConfig):
        self.config = config

    def decide(self, samples: list[PoolSample], state: PolicyState, now: float) -> Decision:
        c = self.config
        recent = _window(samples, now, c.window_s)
        if not recent:
            return Decision(c.min_replicas, "hold", "no samples yet", c.min_replicas)
        latest = recent[-1]
        current = latest.ready + latest.starting
        if latest.waiting_for_worker > 0 and current == 0 and c.max_replicas > 0:
            # from zero: requests are held at the gateways and nothing will serve them; no forecast, no cooldown
            target = max(1, c.min_replicas)
            state.first_t = now if state.first_t is None else state.first_t
            state.desired_history.append((now, target))
            state.last_change_t, state.last_kind = now, "up"
            return Decision(target, "up", f"{latest.waiting_for_worker:.0f} request(s) wait for a worker and the "
                                          f"pool has none", target)
        desired, why = self.desired(recent, now)
        desired = max(c.min_replicas, min(c.max_replicas, desired))
        if state.first_t is None:
            state.first_t = now
        state.desired_history = [(t, d) for t, d in state.desired_history if now - t <= c.down_window_s]
        state.desired_history.append((now, desired))
        urgent = self.urgent(latest)
        if desired > current:
            if state.last_kind == "up" and now - state.last_change_t < c.cooldown_s and not urgent:
                return Decision(current, "hold", f"cooldown ({why}; wants {desired})", desired)
            target = min(desired, current + c.max_step)
            state.last_change_t, state.last_kind = now, "up"
            return Decision(target, "up", why, desired)
        if desired < current:
            highest = max(d for _, d in state.desired_history)
            if now - state.first_t < c.down_window_s or highest > math.floor(current * c.down_margin):
                return Decision(current, "hold", f"stabilising before scale-down ({why}; highest target over "
                                                 f"{c.down_window_s:g} s: {highest})", desired)
            if now - state.last_change_t < c.cooldown_s:
                return Decision(current, "hold", f"cooldown ({why}; wants {desired})", desired)
            if latest.starting:
                return Decision(current, "hold", f"{latest.starting} replica(s) still starting", desired)
            target = max(highest, current - c.max_step, c.min_replicas)
            state.last_change_t, state.last_kind = now, "drain"
            return Decision(target, "drain", why, desired)
        return Decision(current, "hold", why, desired)

    def urgent(self, latest: PoolSample) -> bool:
        return False

    @abstractmethod
    def desired(self, recent: list[PoolSample], now: float) -> tuple[int, str]:
        """(replicas the signals ask for, why), before hysteresis and bounds."""


class TokenPolicy(_Hysteresis):
    name = "token-policy"

    def desired(self, recent: list[PoolSample], now: float) -> tuple[int, str]:
        c, latest = self.config, recent[-1]
        if latest.kv_usage == 0 and not any(s.requests_per_s or s.queued_prefill_tokens or s.prompt_tokens_per_s
                                              or s.output_tokens_per_s for s in recent):
            return c.min_replicas, f"no traffic for {c.window_s:g} s"
        horizon = now + c.startup_s
        need, parts = 0.0, []
        if c.role in ("prefill", "unified"):
            rate = _trend([(s.t, s.prompt_tokens_per_s) for s in recent], horizon)
            queue = latest.queued_prefill_tokens / max(c.startup_s, 1.0)  # cleared within the horizon
            n = (rate + queue) / (c.prefill_tokens_per_s * c.target_util)
            need += n
            parts.append(f"prompt {rate:.0f} tok/s in {c.startup_s:g} s + queue {latest.queued_prefill_tokens:.0f} "
                         f"tok -> {n:.2f}")
        if c.role in ("decode", "unified"):
            rate = _trend([(s.t, s.output_tokens_per_s) for s in recent], horizon)
            n = rate / (c.decode_tokens_per_s * c.target_util)
            need += n
            parts.append(f"output {rate:.0f} tok/s in {c.startup_s:g} s -> {n:.2f}")
        desired = math.ceil(need - 1e-9)
        breach = self._breach(latest)
        if breach and desired <= latest.ready:
            desired = latest.ready + 1
            parts.append(breach)
        return max(desired, 1 if need > 0 else 0), "; ".join(parts)

    def _breach(self, s: PoolSample) -> str:
        c = self.config
        if c.role in ("prefill", "unified") and s.ttft_p90_s is not None and s.ttft_p90_s > c.ttft_slo_s:
            return f"TTFT p90 {s.ttft_p90_s * 1e3:.0f} ms over the {c.ttft_slo_s * 1e3:.0f} ms SLO"
        if c.role in ("decode", "unified") and s.itl_p90_s is not None and s.itl_p90_s > c.itl_slo_s:
            return f"inter-token p90 {s.itl_p90_s * 1e3:.0f} ms over the {c.itl_slo_s * 1e3:.0f} ms SLO"
        if c.role in ("decode", "unified") and s.kv_usage > c.kv_high:
            return f"KV occupancy {s.kv_usage:.2f} over {c.kv_high:.2f}"
        if s.gateway_queued > 0 and s.gateway_queue_wait_s > c.queue_wait_s:
            return (f"{s.gateway_queued:.0f} request(s) in the gateways' admission queues, the oldest for "
                    f"{s.gateway_queue_wait_s:.1f} s (over {c.queue_wait_s:g} s)")
        return ""

    def urgent(self, latest: PoolSample) -> bool:
        """An SLO breach with no capacity on its way adds a replica even in the cooldown."""
        return bool(self._breach(latest)) and latest.starting == 0


class CpuPolicy(_Hysteresis):
    """The Kubernetes HPA on CPU: desired = ceil(ready x utilisation / target), 10% tolerance."""

    name = "cpu-utilisation"

    def __init__(self, config: PoolConfig, target_cpu: float = 0.7):
        super().__init__(replace(config, down_window_s=max(config.down_window_s, 300.0)))
        self.target_cpu = target_cpu

    def desired(self, recent: list[PoolSample], now: float) -> tuple[int, str]:
        latest = recent[-1]
        ratio = latest.cpu_util / self.target_cpu
        if abs(ratio - 1) <= 0.1:
            return latest.ready + latest.starting, f"CPU {latest.cpu_util:.2f} within 10% of {self.target_cpu:.2f}"
        return math.ceil(max(latest.ready, 1) * ratio), f"CPU {latest.cpu_util:.2f} vs target {self.target_cpu:.2f}"


class RatePolicy(_Hysteresis):
    """Requests per second over a fixed per-replica rate (production-stack style)."""

    name = "request-rate"

    def __init__(self, config: PoolConfig, requests_per_s_per_replica: float = 4.0):
        super().__init__(config)
        self.per_replica = requests_per_s_per_replica

    def desired(self, recent: list[PoolSample], now: float) -> tuple[int, str]:
        rps = sum(s.requests_per_s for s in recent) / len(recent)
        return math.ceil(rps / self.per_replica - 1e-9), f"{rps:.2f} req/s at {self.per_replica:g} per replica"


POLICIES = {p.name: p for p in (TokenPolicy, CpuPolicy, RatePolicy)}


class SignalWindow:
    """One pool's samples and what its policy remembers, between decisions: the loop that the autoscaler service
    (samples from OTLP metrics) and the simulator (samples from its events) both run, one sample per interval.
    Samples older than the policy's window_s are dropped (no policy reads them; the down window lives in the
    PolicyState)."""

    def __init__(self):
        self.samples: list[PoolSample] = []
        self.state = PolicyState()

    def decide(self, policy, sample: PoolSample) -> Decision:
        """Add this interval's sample and return the policy's decision at its time."""
        self.samples = [s for s in self.samples if sample.t - s.t <= policy.config.window_s]
        self.samples.append(sample)
        return policy.decide(self.samples, self.state, sample.t)


def size_pair(prefill: PoolConfig, decode: PoolConfig, prompt_tokens_per_s: float,
              output_tokens_per_s: float) -> tuple[int, int]:
    """Prefill and decode replicas for a prompt/output token mix, together: each pool's share of the work at its
    measured rate and target utilisation, within its bounds."""
    p = math.ceil(prompt_tokens_per_s / (prefill.prefill_tokens_per_s * prefill.target_util) - 1e-9)
    d = math.ceil(output_tokens_per_s / (decode.decode_tokens_per_s * decode.target_util) - 1e-9)
    return (max(prefill.min_replicas, min(prefill.max_replicas, p)),
            max(decode.min_replicas, min(decode.max_replicas, d)))
