"""What a worker measures of itself for the router and the gateway: decode rate and step costs."""

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


class StepCostFit:
    """Online fit of step time = decode_s_per_step + prefill tokens x prefill_s_per_token.

    Steps without prefill (every sequence adds one token) update the per-step cost; steps with
    at least min_prefill prefill tokens update the per-token cost from what the step took beyond
    the per-step cost. Exponentially weighted (alpha); 0 until first measured."""

    def __init__(self, alpha: float = 0.1, min_prefill: int = 32):
        self.alpha, self.min_prefill = alpha, min_prefill
        self.decode_s_per_step = 0.0
        self.prefill_s_per_token = 0.0

    def update(self, num_seqs: int, num_tokens: int, step_s: float) -> None:
        prefill = num_tokens - num_seqs  # each sequence's first token counts as its decode share
        if prefill == 0:
            self.decode_s_per_step = self._ewma(self.decode_s_per_step, step_s)
        elif prefill >= self.min_prefill and self.decode_s_per_step > 0:
            per_token = max(step_s - self.decode_s_per_step, 0.0) / prefill
            self.prefill_s_per_token = self._ewma(self.prefill_s_per_token, per_token)

    def _ewma(self, old: float, new: float) -> float:
        return new if old == 0 else (1 - self.alpha) * old + self.alpha * new
