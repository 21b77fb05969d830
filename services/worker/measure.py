"""What a worker measures of itself for the router and the gateway: its decode rate (the step costs are the
engine's own fit, services/engine/step_cost.py)."""

from __future__ import annotations


class DecodeRate:
    """Measured decode throughput: tokens sampled per second of busy engine time.

    Reported as a decaying peak (each window's rate, or the previous figure x decay, whichever is
    higher), so a worker that is merely idle does not look slow; windows with under min_busy_s
    of work are skipped.
    """

    def __init__(self, decay: float = 0.98, min_busy_s: float = 0.2):
        self.decay, self.min_busy_s = decay, min_busy_s
        self.rate, self.busy_s, self.tokens = 0.0, 0.0, 0

    def update(self, busy_s: float, tokens: int) -> float:
        window_busy, window_tokens = busy_s - self.busy_s, tokens - self.tokens
        if window_busy >= self.min_busy_s:
            self.rate = max(window_tokens / window_busy, self.rate * self.decay)
            self.busy_s, self.tokens = busy_s, tokens
        return self.rate
