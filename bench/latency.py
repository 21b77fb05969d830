"""Latency bookkeeping shared by online workloads: per-request timings and their percentiles."""

from __future__ import annotations

from dataclasses import dataclass, field

from sim.report import percentile  # noqa: F401  (one definition: real runs and simulated ones summarise alike)


@dataclass
class Timing:
    arrival_s: float  # when the request was due (the Poisson schedule)
    first_s: float | None = None  # first token received
    second_s: float | None = None  # second token received (the same message as the first: first_s)
    last_s: float | None = None  # last token received
    tokens: int = 0  # output tokens received
    token_ids: list = field(default_factory=list)
    prompt_tokens: int = 0  # as the server reports
    cached_tokens: int = 0  # prompt tokens served from its prefix cache
    error: str = ""  # the status it failed with ("" = none)

    def on_tokens(self, now: float, ids) -> None:
        if ids and self.first_s is None:
            self.first_s = now
        if self.second_s is None and self.tokens + len(ids) >= 2:
            self.second_s = now
        if ids:
            self.last_s = now
        self.tokens += len(ids)
        self.token_ids.extend(ids)


def summarize(timings: list[Timing], wall_s: float) -> dict:
    ttft = [(t.first_s - t.arrival_s) * 1e3 for t in timings if t.first_s is not None]
    tpot = [(t.last_s - t.first_s) * 1e3 / (t.tokens - 1) for t in timings if t.tokens > 1]
    e2e = [(t.last_s - t.arrival_s) * 1e3 for t in timings if t.last_s is not None]
    second = [(t.second_s - t.first_s) * 1e3 for t in timings if t.second_s is not None]
    r = lambda x: None if x is None else round(x, 2)  # noqa: E731
    return {"ttft_ms_p50": r(percentile(ttft, 0.5)), "ttft_ms_p99": r(percentile(ttft, 0.99)),
            "first_to_second_token_ms_p50": r(percentile(second, 0.5)),
            "first_to_second_token_ms_p99": r(percentile(second, 0.99)),
            "tpot_ms_p50": r(percentile(tpot, 0.5)), "tpot_ms_p99": r(percentile(tpot, 0.99)),
            "e2e_ms_p50": r(percentile(e2e, 0.5)), "e2e_ms_p99": r(percentile(e2e, 0.99)),
            "output_tokens_per_s": round(sum(t.tokens for t in timings) / wall_s, 1), "requests": len(timings),
            "failed_requests": sum(bool(t.error) for t in timings),
            "wall_s": round(wall_s, 2)}


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    import random

    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out
