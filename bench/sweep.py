"""Load sweeps for the routing workloads (skewed-costs, prefix-shared): a sustainable rate found by a ramp,
then every policy at fractions of it, on the same arrivals per load, each on a fresh mesh.

The sustainable rate is not a burst's throughput (a burst fills every batch at once and overstates what
a Poisson stream can sustain, by a machine-dependent amount). The ramp streams Poisson arrivals whose
rate grows by RAMP_FACTOR every step (no pause between steps, so a backlog carries over), from about
half a request in flight; a step is sustained while its requests' median TTFT stays within KNEE x the
light-load median (the first step's, or the unloaded one measured a request at a time first, whichever
is higher). Then the backlog is cancelled and the last sustained rate is held (six steps long; three
with --quick); a hold past the knee steps down by RAMP_FACTOR (or to the rate its tokens showed, if
lower) and holds again. A hold must also keep up in tokens (not with --quick): over its second half
the mesh generates at least KEEP_UP x the output tokens per second its arrivals ask for (rate x their
mean max_tokens). TTFT alone overstated what a mesh with many slots sustains by about 2x (issue 39:
tenants-overload's ramp held 1.74 req/s on the smollm2 shape, where the same mesh then delivered 0.9
req/s): every new request got a slot and its first token at once while all decoded slower, and the
backlog showed in TTFT only once the slots filled, after the hold. The sustainable rate is the held
one. Past it, requests queue faster than they are served and TTFT grows without bound; below it, the mesh keeps up.

Balance, per worker, from each worker's Stats before and after the run: its share of the engines'
busy time (seconds in steps) and its mean queueing delay (arrival at the engine to first scheduled).
`busy_share_max_over_mean` is the busiest worker's busy time over the mean: 1.0 is perfectly even, at
any load (the old max/mean of outstanding tokens is high at low load whatever the policy: one request
alone on four workers gives 4).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

import grpc

from bench.common import log
from bench.latency import Timing, percentile, poisson_arrivals, summarize
from bench.online import LoadSampler, run_online, warm
from services.common.convert import request_from_line
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc

LOADS = (0.5, 0.7, 0.85, 0.95)
RAMP_FACTOR = 1.15  # each ramp step's rate over the previous one's
RAMP_STEP_S = 8.0  # arrivals per ramp step, seconds
KNEE = 3.0  # a ramp step is sustained while its median TTFT stays within KNEE x the unloaded median
UNLOADED_REQUESTS = 6  # sent one at a time before the ramp: the unloaded TTFT and e2e
MAX_RAMP_STEPS = 30
HOLD_STEPS = 6  # a confirmation holds the rate this many steps long (3 with --quick)
KEEP_UP = 0.85  # a hold keeps up while it generates this fraction of the output tokens per second it asks for
MAX_HOLDS = 4


def add_flags(p) -> None:
    g = p.add_argument_group("load sweeps (skewed-costs, prefix-shared)")
    g.add_argument("--loads", default=",".join(map(str, LOADS)),
                   help="offered loads, as fractions of the sustainable rate the ramp finds (comma-separated)")
    g.add_argument("--load-seconds", type=float, default=0.0,
                   help="seconds of arrivals at each load (default 60; 15 with --quick)")
    g.add_argument("--plot", default="", help="write the TTFT/e2e p99 vs load plot here (PNG; default: next to "
                                              "--out, same name)")


def loads_of(args) -> list[float]:
    loads = sorted(float(x) for x in args.loads.split(",") if x.strip())
    if not loads or any(not 0 < f <= 2 for f in loads):
        raise SystemExit(f"--loads wants fractions in (0, 2], got {args.loads!r}")
    return loads


def load_seconds(args) -> float:
    return args.load_seconds or (15.0 if args.quick else 60.0)


# ---- the ramp ------------------------------------------------------------------------------------------------


@dataclass
class RampStep:
    offered_req_per_s: float
    requests: int
    ttft_ms_p50: float | None  # None: not one first token came in time
    sustained: bool
    hold: bool = False  # a confirmation: held HOLD_STEPS steps long, after the backlog was cancelled
    tokens_per_s: float | None = None  # a hold's: output tokens generated per second over its second half
    asked_tokens_per_s: float | None = None  # and what its arrivals asked for (rate x mean max_tokens)


def keeps_up(events: list, start_s: float, end_s: float, asked_per_s: float,
             keep_up: float = KEEP_UP) -> tuple[bool, float]:
    """(whether the mesh generated at least keep_up x `asked_per_s` output tokens per second between start_s and
    end_s, the rate it generated); events: (time, tokens) of every response received."""
    rate = sum(n for t, n in events if start_s <= t < end_s) / max(end_s - start_s, 1e-9)
    return rate >= keep_up * asked_per_s, rate


def sustained(ttfts_ms: list, unloaded_ms: float, knee: float = KNEE) -> tuple[bool, float | None]:
    """(whether a ramp step kept up, its median TTFT); a request with no first token yet (None) counts as slower
    than any that has one, and a median that is such a request is past the knee."""
    if not ttfts_ms:
        return True, None
    ordered = sorted(ttfts_ms, key=lambda x: math.inf if x is None else x)
    p50 = ordered[(len(ordered) - 1) // 2]
    return p50 is not None and p50 <= knee * unloaded_ms, p50


def sustainable_rate(steps: list[RampStep]) -> float | None:
    """The rate of the hold that was sustained; the lowest held when none was (unconfirmed); with no hold yet,
    the last sustained ramp step's."""
    holds = [s for s in steps if s.hold]
    if holds:
        ok = [s.offered_req_per_s for s in holds if s.sustained]
        return ok[-1] if ok else min(s.offered_req_per_s for s in holds)
    ok = [s.offered_req_per_s for s in steps if s.sustained and not s.hold]
    return ok[-1] if ok else None


def find_sustainable(mesh, reqs: list, seed: int, quick: bool) -> tuple[float, dict]:
    """Ramp on a running mesh; returns (sustainable req/s, the ramp's record for the result's config)."""
    warm(mesh)
    unloaded, _ = run_online(mesh.gateway, reqs[:UNLOADED_REQUESTS], None)
    ttft = percentile([(t.first_s - t.arrival_s) * 1e3 for t in unloaded], 0.5)
    e2e = percentile([t.last_s - t.arrival_s for t in unloaded], 0.5)
    start = 0.5 / e2e  # about half a request in flight: light load
    factor, step_s = (1.3, 4.0) if quick else (RAMP_FACTOR, RAMP_STEP_S)
    log(f"ramp: unloaded TTFT p50 {ttft:.0f} ms, e2e p50 {e2e * 1e3:.0f} ms; from {start:.2f} req/s, x{factor} "
        f"every {step_s:.0f} s, until the median TTFT passes {KNEE:g}x the light-load one")
    steps, reference = asyncio.run(_ramp(mesh.gateway, reqs[UNLOADED_REQUESTS:], start, factor, step_s, ttft, seed,
                                             quick))
    rate = sustainable_rate(steps)
    if rate is None:
        raise RuntimeError(f"the ramp's first step ({start:.2f} req/s) was already past the knee: {steps}")
    return rate, {"ramp_steps": [asdict(s) for s in steps], "unloaded_ttft_ms_p50": round(ttft, 2),
                  "light_load_ttft_ms_p50": round(reference, 2),
                  "ramp_factor": factor, "ramp_step_s": step_s, "knee": KNEE,
                  "sustainable_req_per_s": round(rate, 3)}


async def _ramp(gateway: str, reqs: list, rate: float, factor: float, step_s: float, unloaded_ms: float,
                seed: int, quick: bool = False) -> tuple[list[RampStep], float]:
    """The ramp's steps, and the light-load median TTFT they were judged against. After the first step past the
    knee, the backlog is cancelled and the last sustained rate is held for HOLD_STEPS steps at once; a hold that
    is past the knee steps the rate down by `factor` and holds again (a short step above capacity can pass before
    its backlog shows, the more so with heavy-tailed outputs)."""
    rng, pool, steps, tasks, events = random.Random(seed), itertools.cycle(enumerate(reqs)), [], [], []
    reference = unloaded_ms
    mean_tokens = sum(r.get("max_tokens", 0) for r in reqs) / max(len(reqs), 1)
    async with grpc.aio.insecure_channel(gateway) as ch:
        stub = pb_grpc.GenerationStub(ch)

        async def one(r: dict, at: float, timing: Timing) -> None:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            timing.arrival_s = time.perf_counter()
            async for resp in stub.Generate(request_from_line(r), timeout=900):
                now = time.perf_counter()
                timing.on_tokens(now, list(resp.token_ids))
                events.append((now, len(resp.token_ids)))

        async def step(k: int, rate: float, seconds: float, hold: bool) -> RampStep:
            t = time.perf_counter()
            end, timings = t + seconds, []
            while (t := t + rng.expovariate(rate)) < end:
                i, r = next(pool)
                timing = Timing(arrival_s=t)
                tasks.append(asyncio.ensure_future(one({**r, "id": f"ramp{k}-{i}"}, t, timing)))
                timings.append(timing)
            await asyncio.sleep(max(0.0, end - time.perf_counter()))
            # Wait for the step's first tokens, no longer than it takes to know the step is past the knee.
            give_up = end + max(KNEE * reference / 1e3 * 4, 2.0)
            while any(x.first_s is None for x in timings) and time.perf_counter() < give_up:
                await asyncio.sleep(0.02)
            ttfts = [None if x.first_s is None else (x.first_s - x.arrival_s) * 1e3 for x in timings]
            ok, p50 = sustained(ttfts, reference)
            made = asked = None
            if hold and not quick and mean_tokens:
                asked = rate * mean_tokens
                kept, made = keeps_up(events, end - seconds / 2, end, asked)
                ok = ok and kept
            log(f"ramp {'hold' if hold else 'step'} {k}: {rate:.2f} req/s, {len(timings)} requests, TTFT p50 "
                f"{'-' if p50 is None else f'{p50:.0f} ms'}"
                + ("" if made is None else f", {made:.0f} of {asked:.0f} output tokens/s asked")
                + f": {'sustained' if ok else 'past the knee'}")
            return RampStep(round(rate, 3), len(timings), None if p50 is None else round(p50, 1), ok, hold,
                            None if made is None else round(made, 1), None if asked is None else round(asked, 1))

        async def cancel_all() -> None:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            tasks.clear()

        try:
            for k in range(MAX_RAMP_STEPS):
                s = await step(k, rate, step_s, False)
                if k == 0 and s.ttft_ms_p50 is not None:  # the light-load median of this very mix is the reference
                    reference = max(reference, s.ttft_ms_p50)
                    s.sustained = True
                steps.append(s)
                if not s.sustained:
                    break
                rate *= factor
            rate = sustainable_rate(steps) or rate
            for k in range(MAX_HOLDS):
                await cancel_all()
                s = await step(k, rate, step_s * (3 if quick else HOLD_STEPS), True)
                steps.append(s)
                if s.sustained:
                    break
                # down by the factor, or to what the mesh generated when that was less (a rate it has shown)
                rate = min(rate / factor, rate * s.tokens_per_s / s.asked_tokens_per_s) if s.asked_tokens_per_s \
                    else rate / factor
        finally:
            await cancel_all()
    return steps, reference


# ---- balance --------------------------------------------------------------------------------------------------


def worker_stats(addresses: list[str]) -> list:
    out = []
    for a in addresses:
        with grpc.insecure_channel(a) as ch:
            out.append(pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=5))
    return out


def balance(before: list, after: list) -> dict:
    """Per-worker busy-time shares and queueing delays over a run, from Stats taken before and after it."""
    busy = [a.busy_s - b.busy_s for b, a in zip(before, after)]
    started = [a.started - b.started for b, a in zip(before, after)]
    waits = [(a.queue_wait_s - b.queue_wait_s) * 1e3 / n if n else None
             for b, a, n in zip(before, after, started)]
    total, known = sum(busy), [w for w in waits if w is not None]
    r = lambda x: round(x, 3)  # noqa: E731
    return {"busy_share": [r(x / total) if total else None for x in busy],
            "busy_share_max_over_mean": r(max(busy) / (total / len(busy))) if total else None,
            "started_per_worker": started,
            "queue_wait_ms_per_worker": [None if w is None else round(w, 2) for w in waits],
            "queue_wait_ms_spread": round(max(known) - min(known), 2) if known else None}


# ---- a worker slowed mid-run -----------------------------------------------------------------------------------


class Slowdown:
    """Less CPU for one worker, as a CPU quota does (cgroups' cpu.max throttles a group for part of every
    period): its process group is stopped for `stopped` of every period_s (SIGSTOP/SIGCONT), from start() until
    close(). A half-size instance type on a machine of equal cores, or another tenant's noise on its host. The
    stopping runs in its own small process, so the load generator's GIL does not stretch the periods."""

    SCRIPT = """
import os, signal, sys, time
pgid, stopped, period = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
done = []
signal.signal(signal.SIGTERM, lambda *_: done.append(1))
try:
    while not done:
        os.killpg(pgid, signal.SIGSTOP)
        time.sleep(period * stopped)
        os.killpg(pgid, signal.SIGCONT)
        time.sleep(period * (1 - stopped))
except ProcessLookupError:
    pass
finally:
    try:
        os.killpg(pgid, signal.SIGCONT)
    except ProcessLookupError:
        pass
"""

    def __init__(self, popen, stopped: float = 0.5, period_s: float = 0.02):
        self.pgid, self.stopped, self.period_s = popen.pid, stopped, period_s
        self.proc = None

    def start(self) -> Slowdown:
        self.proc = subprocess.Popen([sys.executable, "-c", self.SCRIPT, str(self.pgid), str(self.stopped),
                                      str(self.period_s)])
        return self

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()
        try:
            os.killpg(self.pgid, signal.SIGCONT)  # whatever happened to the helper
        except ProcessLookupError:
            pass


# ---- one point of a sweep -------------------------------------------------------------------------------------


def run_point(mesh, reqs: list, arrivals: list, slow_at: float | None = None) -> dict:
    """The requests at their arrival times on a started mesh; latency figures, the old imbalance and the
    per-worker balance. slow_at: seconds into the arrivals when unified-0 is slowed to half speed (the share of
    requests it started before and after is reported)."""
    warm(mesh)
    workers = mesh.workers("unified")
    addresses = [p.address for p in workers]
    before = worker_stats(addresses)
    slowdown, at_slow = None, {}
    if slow_at is not None:
        slowdown = Slowdown(workers[0].popen)

        def slow() -> None:
            at_slow["stats"] = worker_stats(addresses)
            slowdown.start()
        timer = threading.Timer(slow_at, slow)
        timer.start()
    try:
        with LoadSampler(addresses) as sampler:
            timings, wall = run_online(mesh.gateway, reqs, arrivals)
    finally:
        if slowdown is not None:
            timer.cancel()
            slowdown.close()
    after = worker_stats(addresses)
    figures = {**summarize(timings, wall), "imbalance_max_over_mean": sampler.imbalance(),
               "imbalance_busy_max_over_mean": sampler.imbalance(busy=True), **balance(before, after),
               "prompt_tokens": sum(t.prompt_tokens for t in timings),
               "cached_prompt_tokens": sum(t.cached_tokens for t in timings)}
    if "stats" in at_slow:
        mid = at_slow["stats"]
        figures["slowed_worker_share_before"] = _first_share(before, mid)
        figures["slowed_worker_share_after"] = _first_share(mid, after)
    return figures


def _first_share(before: list, after: list) -> float | None:
    """The first worker's share of the requests the workers started between two Stats snapshots."""
    started = [a.started - b.started for b, a in zip(before, after)]
    return round(started[0] / sum(started), 3) if sum(started) else None


def sweep(make_mesh, workload, policies, loads: list[float], rate: float, seconds: float, seed: int,
          point=run_point) -> dict:
    """Every policy at every load: arrivals at load x rate for `seconds`, the same per load for every policy (the
    first n requests of workload(n)), each on a fresh mesh. Returns {policy: [figures per load]}."""
    out: dict = {p: [] for p in policies}
    for k, load in enumerate(loads):
        offered = load * rate
        n = max(8, round(offered * seconds))
        reqs, arrivals = workload(n), poisson_arrivals(n, offered, seed + 1000 * (k + 1))
        for policy in policies:
            log(f"load {load:.2f} ({offered:.2f} req/s, {n} requests): {policy}")
            with make_mesh(policy) as mesh:
                figures = point(mesh, reqs, arrivals)
            out[policy].append({"load": load, "offered_req_per_s": round(offered, 3), **figures})
            log(f"  TTFT p50/p99 {figures['ttft_ms_p50']}/{figures['ttft_ms_p99']} ms, e2e p99 "
                f"{figures['e2e_ms_p99']} ms, busy max/mean {figures['busy_share_max_over_mean']}")
    return out


def system_of(loads: list[dict]) -> dict:
    """A system's result: the figures at its heaviest load at the top level (the names every result keeps), and
    every load's in `loads`."""
    return {**loads[-1], "loads": loads}


def ratios_by_load(systems: dict, num: str, den: str, metrics) -> dict:
    """{"num/den:metric@load": ratio} for every load both ran."""
    out = {}
    for a, b in zip(systems[num]["loads"], systems[den]["loads"]):
        for m in metrics:
            if a.get(m) is not None and b.get(m):
                out[f"{num}/{den}:{m}@{a['load']:g}"] = round(a[m] / b[m], 3)
    return out
