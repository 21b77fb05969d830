"""Simulated requests: synthetic traces, in the trace format (services/common/workload_trace.py: one JSONL line each,
also what `meshserve up --record-trace` writes from a running mesh).

Synthetic traces (synthetic()): Poisson or Gamma arrivals (cv > 1 is burstier), optional bursts and a diurnal
rate, uniform or lognormal lengths, shared system prompts with Zipf popularity, tenants with their own rates
and weights, Zipf-popular LoRA adapters, and a fraction of requests with deadlines. A seeded random.Random
draws everything, so a seed is a trace.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from services.common.workload_trace import TraceRequest, line_of, read_jsonl, write_jsonl  # noqa: F401  (sim's names)


@dataclass
class TenantSpec:
    name: str
    rate_share: float = 1.0  # its fraction of the arrival rate (normalised over tenants)
    weight: float = 1.0  # its fair share (the mesh's tenant weight; not used for arrivals)


@dataclass
class Synthetic:
    """What synthetic() draws (every field has a default: a plain Poisson mix)."""
    requests: int = 1000
    rate: float = 10.0  # mean arrivals per second
    arrival: str = "poisson"  # poisson | gamma
    cv: float = 1.0  # gamma arrivals: coefficient of variation of the gaps (1 = Poisson)
    prompt: tuple = (32, 512)  # uniform range, or with lengths="lognormal" (median, sigma)
    output: tuple = (16, 256)
    lengths: str = "uniform"  # uniform | lognormal
    output_lengths: str = ""  # the outputs' own distribution (uniform | lognormal); "" = lengths
    max_prompt: int = 4096
    max_output: int = 1024
    system_prompts: int = 0  # shared prefixes (0 = none); each request starts with one, Zipf-popular
    system_tokens: tuple = (1024, 2048)  # their lengths (uniform)
    zipf: float = 1.0
    tenants: list = field(default_factory=list)  # TenantSpec; empty = one default tenant
    adapters: int = 0  # LoRA adapters, Zipf-popular (0 = base model only)
    adapter_fraction: float = 1.0  # of requests that name an adapter (when adapters > 0)
    deadline_fraction: float = 0.0
    deadline_ms: tuple = (2000.0, 8000.0)  # uniform range, from arrival
    burst_every_s: float = 0.0  # 0 = no bursts; else a burst of burst_factor x the rate for burst_s
    burst_s: float = 0.0
    burst_factor: float = 1.0
    diurnal_period_s: float = 0.0  # 0 = flat; else the rate follows 1 + diurnal_amplitude x sin(2 pi t / period)
    diurnal_amplitude: float = 0.0


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1 / (k + 1) ** s for k in range(n)]


def _length(rng: random.Random, spec: Synthetic, what: tuple, cap: int, kind: str = "") -> int:
    if (kind or spec.lengths) == "lognormal":
        median, sigma = what
        return max(1, min(cap, int(rng.lognormvariate(math.log(median), sigma))))
    return rng.randint(*what)


def _rate_at(spec: Synthetic, t: float) -> float:
    rate = spec.rate
    if spec.diurnal_period_s > 0:
        rate *= max(0.05, 1 + spec.diurnal_amplitude * math.sin(2 * math.pi * t / spec.diurnal_period_s))
    if spec.burst_every_s > 0 and (t % spec.burst_every_s) < spec.burst_s:
        rate *= spec.burst_factor
    return rate


def synthetic(spec: Synthetic, seed: int = 0) -> list[TraceRequest]:
    """A trace drawn from spec (see Synthetic); the same seed gives the same trace."""
    rng = random.Random(seed)
    tenants = spec.tenants or [TenantSpec("")]
    shares = [t.rate_share for t in tenants]
    systems = [rng.randint(*spec.system_tokens) for _ in range(spec.system_prompts)]
    sys_w, ad_w = _zipf_weights(spec.system_prompts, spec.zipf), _zipf_weights(spec.adapters, spec.zipf)
    out, t = [], 0.0
    varying = spec.diurnal_period_s > 0 or spec.burst_every_s > 0
    peak = spec.rate * (1 + max(spec.diurnal_amplitude, 0)) * max(spec.burst_factor, 1) if varying else spec.rate
    while len(out) < spec.requests:
        # Thinning (Lewis-Shedler) for a time-varying rate: draw at the peak rate, keep with rate(t) / peak.
        gap = _gap(rng, spec, peak)
        t += gap
        if varying and rng.random() > _rate_at(spec, t) / peak:
            continue
        i = len(out)
        tenant = rng.choices(tenants, shares)[0] if len(tenants) > 1 else tenants[0]
        prefix = []
        prompt = _length(rng, spec, spec.prompt, spec.max_prompt)
        if systems:
            s = rng.choices(range(len(systems)), sys_w)[0]
            prefix = [[f"sys{s}", systems[s]]]
            prompt += systems[s]
        adapter = ""
        if spec.adapters and rng.random() < spec.adapter_fraction:
            adapter = f"adapter{rng.choices(range(spec.adapters), ad_w)[0]}"
        deadline = None
        if spec.deadline_fraction and rng.random() < spec.deadline_fraction:
            deadline = round(rng.uniform(*spec.deadline_ms), 1)
        out.append(TraceRequest(arrival_s=t, prompt_tokens=prompt, output_tokens=_length(rng, spec, spec.output,
                                                                                          spec.max_output,
                                                                                          spec.output_lengths),
                                id=f"s{i}", prefix=prefix, tenant=tenant.name, adapter=adapter, deadline_ms=deadline))
    return out


def _gap(rng: random.Random, spec: Synthetic, rate: float) -> float:
    if spec.arrival == "gamma" and spec.cv != 1.0:
        shape = 1 / (spec.cv * spec.cv)
        return rng.gammavariate(shape, 1 / (shape * rate))
    if spec.arrival not in ("poisson", "gamma"):
        raise ValueError(f"unknown arrival process {spec.arrival!r}; known: poisson, gamma")
    return rng.expovariate(rate)
