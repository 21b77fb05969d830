"""The simulated engine's step cost, fitted from a real worker's steps.

step time = base_s + per_seq_s x sequences + per_context_s x context tokens + prefill_s_per_token x prompt tokens
            + prefill_context_s x prompt chunk tokens x their context

where context tokens are the tokens already in the KV cache of the step's sequences (what a decode's attention
reads), prompt tokens are those computed beyond one per sequence, and the last term is a prompt chunk's
attention over the tokens before it (a long prompt's later chunks cost more). The same terms as the engine's own online
fit (services.engine.step_cost.StepCostFit: base, per sequence, per prompt token) plus the context term that fit
leaves out; fitted by least squares, no term negative, to the steps a worker logs (MESHSERVE_STEP_LOG), each
step counted from its start to the next step's start when the worker went straight on (so the loop's own time
between steps, sending outputs to the servicer and taking new requests, is part of a step as it is of
throughput). Where workers share a machine's cores, the rest of the mesh's CPU per second, per request and per token
streamed (host_cpu_*). Beside the step: hop_s, the time from a request's arrival at the gateway to its first step, and
back, beyond the steps themselves (gateway, router and worker hops); kv_bytes_per_token, for KV transfers.

`meshserve sim calibrate` measures all of it on this machine (bench/calibrate.py) and writes the JSON this loads.
"""

from __future__ import annotations

from services.engine.cost_model import CostModel  # noqa: F401 (the simulator's and the mock engine's)

TERMS = ("base_s", "per_seq_s", "per_context_s", "prefill_s_per_token", "prefill_context_s")
GAP_MAX_S = 0.05  # a step starting within this long of the previous one's end followed it straight on


def intervals(steps: list[dict]) -> list[tuple[int, int, int, int, float]]:
    """(sequences, prompt tokens, context tokens, prompt chunk x context, seconds) per logged step of one worker:
    from its start to the next step's start when that followed straight on, else its own time plus the median gap
    between busy steps."""
    steps = sorted(steps, key=lambda s: s["start"])
    gaps = [b["start"] - (a["start"] + a["step_s"]) for a, b in zip(steps, steps[1:])]
    busy = sorted(g for g in gaps if 0 <= g < GAP_MAX_S)
    typical = busy[len(busy) // 2] if busy else 0.0
    out = []
    for i, s in enumerate(steps):
        gap = gaps[i] if i < len(gaps) and 0 <= gaps[i] < GAP_MAX_S else typical
        out.append((s["seqs"], s["tokens"] - s["seqs"], s["context"], s.get("prefill_context", 0), s["step_s"] + gap))
    return out


def nonneg_lstsq(a, y, names: tuple) -> dict:
    """Least squares with no negative term (a negative one is dropped and the rest refitted)."""
    import numpy as np

    keep = list(range(a.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    out = dict.fromkeys(names, 0.0)
    for i, c in zip(keep, coef):
        out[names[i]] = float(max(c, 0.0))
    return out


def fit(rows: list[tuple[int, int, int, int, float]]) -> tuple[dict, dict]:
    """The terms (TERMS) for rows of intervals(), as the engine's own fit splits them: the decode part (base, per
    sequence, per context token) from decode-only steps, then the cost per prompt token and per prompt token x
    context token from what prompt-carrying steps took beyond their decode part. Both by least squares on
    relative error (steps run from a few to a hundred milliseconds: absolute error would let the few long
    prompt steps decide the decode terms), no term negative. Also the fit's relative error on every row."""
    import numpy as np

    decode = [r for r in rows if r[1] == 0]
    prompt = [r for r in rows if r[1] > 0]
    if len(decode) < 12 or len(prompt) < 4:
        raise ValueError(f"{len(decode)} decode-only and {len(prompt)} prompt steps are too few to fit a cost model "
                         "(need 12 and 4)")
    y = np.array([r[4] for r in decode])
    a = np.array([[1.0, r[0], r[2]] for r in decode]) / y[:, None]
    terms = nonneg_lstsq(a, np.ones(len(decode)), TERMS[:3])
    y = np.array([r[4] for r in prompt])
    rest = y - np.array([terms["base_s"] + terms["per_seq_s"] * r[0] + terms["per_context_s"] * r[2] for r in prompt])
    a = np.array([[float(r[1]), float(r[3])] for r in prompt]) / y[:, None]
    terms.update(nonneg_lstsq(a, rest / y, TERMS[3:]))
    all_y = np.array([r[4] for r in rows])
    pred = np.array([[1.0, r[0], r[2], r[1], r[3]] for r in rows]) @ np.array([terms[t] for t in TERMS])
    rel = np.abs(pred - all_y) / all_y
    return terms, {"steps": len(rows), "decode_steps": len(decode), "median_rel_error": round(float(np.median(rel)), 4),
                   "p90_rel_error": round(float(np.quantile(rel, 0.9)), 4)}

