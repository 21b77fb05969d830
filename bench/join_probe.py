"""A probe (not a benchmark workload): what one worker's start-up and join cost the worker already serving, on
this machine. One unified worker of the bench preset under a steady Poisson load for 60 s; with `join`, a second
worker is started 10 s in (no start-up delay) and joins as soon as it is healthy. Prints the TTFT p90 of the
requests arriving in each 5 s, so the two runs can be laid side by side.

    python -m bench.join_probe join 28      # req/s
    python -m bench.join_probe none 28
"""

from __future__ import annotations

import sys
import threading
import time

from bench import burst_autoscale
from bench.common import default_model
from bench.latency import percentile, poisson_arrivals
from bench.online import run_online, warm


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in ("join", "none"):
        raise SystemExit(__doc__)
    join, rate, duration = sys.argv[1] == "join", float(sys.argv[2]), 60.0
    arrivals = [a for a in poisson_arrivals(int(rate * duration * 1.2), rate, 5) if a < duration]
    reqs = burst_autoscale.requests(len(arrivals), 7)
    with burst_autoscale.Run(default_model("bench"), 1, burst_autoscale.ENGINE, None) as r:
        warm(r.mesh)
        if join:
            def later():
                time.sleep(10)
                with r.lock:
                    r.mesh.scale("unified", 2, "join probe", say=print)
            threading.Thread(target=later, daemon=True).start()
        timings, _ = run_online(r.mesh.gateway, reqs, arrivals)
    t0 = min(t.arrival_s for t in timings)
    buckets: dict[int, list] = {}
    for t in timings:
        buckets.setdefault(int((t.arrival_s - t0) // 5), []).append((t.first_s - t.arrival_s) * 1e3)
    print(sys.argv[1], " ".join(f"{k * 5}s:{percentile(v, 0.9):.0f}" for k, v in sorted(buckets.items())))


if __name__ == "__main__":
    main()
