"""Online fit of an engine's step time, from the steps it runs (no I/O).

step time = base_s + per_seq_s x sequences + prefill tokens x prefill_s_per_token

- decode_s_per_step: the exponentially weighted mean of decode-only steps (every sequence adds
  one token), at whatever batch size they ran: what the heartbeat reports as the step cost.
- base_s, per_seq_s: a least-squares line through decode-only steps against their batch size,
  with exponential forgetting, for the deadline-aware batch cap (what a step of b sequences
  costs). Until the steps seen vary enough in size to fit a slope, a sequence is assumed to cost
  PRIOR_SEQ_FRACTION of the fixed part (measured on the bench preset: 2.2 ms at 1 sequence,
  5.6 ms at 16 on one core).
- prefill_s_per_token: from steps with at least min_prefill prompt tokens, what the step took
  beyond its decode part, per prompt token; on a prefill worker (which runs no decode-only step)
  the slope of its steps' times against their prompt tokens.
All 0 until first measured.
"""

from __future__ import annotations

PRIOR_SEQ_FRACTION = 0.125
MIN_SIZE_VARIANCE = 1.0  # batch sizes must spread at least this much (squared sequences) to fit a slope
MIN_PREFILL_VARIANCE = 256.0  # prompt steps must spread this much (squared tokens: 16 tokens) to fit a slope


class StepCostFit:
    def __init__(self, alpha: float = 0.1, min_prefill: int = 32, forget: float = 0.02):
        self.alpha, self.min_prefill, self.forget = alpha, min_prefill, forget
        self.decode_s_per_step = 0.0
        self.prefill_s_per_token = 0.0
        self._s = [0.0] * 5  # weighted sums: 1, x, y, xx, xy over decode-only steps (x = sequences, y = seconds)
        self._line = None  # line's value until the next decode-only step
        self._p = [0.0] * 5  # the same sums over prompt steps (x = prompt tokens), while no decode-only step is seen

    def update(self, num_seqs: int, num_tokens: int, step_s: float) -> None:
        prefill = num_tokens - num_seqs  # each sequence's first token counts as its decode share
        if prefill == 0:
            self.decode_s_per_step = self._ewma(self.decode_s_per_step, step_s)
            keep = 1 - self.forget
            x, y = float(num_seqs), step_s
            self._s = [a * keep + b for a, b in zip(self._s, (1.0, x, y, x * x, x * y))]
            self._line = None
        elif prefill >= self.min_prefill:
            if self.decode_s_per_step > 0:  # beyond the step's decode part
                per_token = max(step_s - self.step_s(num_seqs), 0.0) / prefill
                self.prefill_s_per_token = self._ewma(self.prefill_s_per_token, per_token)
            else:
                self._prefill_only(prefill, step_s)

    def _prefill_only(self, prefill: int, step_s: float) -> None:
        """A prefill worker runs no decode-only step to measure a step's fixed part by: the slope of its steps'
        times against their prompt tokens, once their sizes spread enough (the whole step per token before: over
        small prompts, several times the true cost)."""
        keep = 1 - self.forget
        x = float(prefill)
        self._p = [a * keep + b for a, b in zip(self._p, (1.0, x, step_s, x * x, x * step_s))]
        n, sx, sy, sxx, sxy = self._p
        var = sxx / n - (sx / n) ** 2
        slope = (sxy / n - sx / n * sy / n) / var if var >= MIN_PREFILL_VARIANCE else 0.0
        self.prefill_s_per_token = slope if slope > 0 else self._ewma(self.prefill_s_per_token, step_s / prefill)

    @property
    def line(self) -> tuple[float, float]:
        """(base_s, per_seq_s) of decode steps; (0, 0) until measured."""
        if self._line is None:
            self._line = self._fit_line()
        return self._line

    def _fit_line(self) -> tuple[float, float]:
        n, sx, sy, sxx, sxy = self._s
        if n <= 0:
            return 0.0, 0.0
        mx, my = sx / n, sy / n
        var = sxx / n - mx * mx
        if var >= MIN_SIZE_VARIANCE:
            slope = (sxy / n - mx * my) / var
            if slope > 0:
                base = my - slope * mx
                if base > 0:
                    return base, slope
        base = my / (1 + PRIOR_SEQ_FRACTION * mx)
        return base, base * PRIOR_SEQ_FRACTION

    def step_s(self, num_seqs: int, prefill_tokens: int = 0) -> float:
        """Predicted time of a step of num_seqs sequences and prefill_tokens prompt tokens."""
        base, per_seq = self.line
        return base + per_seq * num_seqs + self.prefill_s_per_token * prefill_tokens

    def _ewma(self, old: float, new: float) -> float:
        return new if old == 0 else (1 - self.alpha) * old + self.alpha * new
