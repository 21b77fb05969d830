"""Sampling: the right distribution, masks that hold, seeds that keep their promise, kernel = fallback."""

import math
import os

import pytest
import torch

from services.engine.layers.kernels import sampler as sampler_kernel
from services.engine.layers.sampler import Sampler, SamplingBatch, sample_torch
from services.engine.request import Request, SamplingParams
from tests.support.kernel_checks import check_kernel_against_fallback
from tests.support.reference import make_engine, random_prompts, run_all

DRAWS = 200_000


def _built_kernel():
    k = sampler_kernel()
    if k is None and os.environ.get("MESHSERVE_KERNELS") == "0":
        pytest.skip("kernels disabled by MESHSERVE_KERNELS=0")
    assert k is not None, "the sampling kernel failed to build (see the logged warning)"
    return k


@pytest.fixture(scope="module")
def kernel():
    return _built_kernel()


@pytest.fixture(params=["kernel", "torch"])
def impl(request):
    """The compiled kernel, or None for the PyTorch fallback."""
    return _built_kernel() if request.param == "kernel" else None


def _batch(rows, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, positions=None, bans=None,
           logprobs=False):
    """A SamplingBatch of `rows` rows with the same parameters (seeds and positions per row)."""
    bans = bans or []
    offsets = torch.arange(rows + 1, dtype=torch.int64) * len(bans)
    ban_ids = torch.tensor(bans * rows, dtype=torch.int64)
    full = lambda v, dt: torch.full((rows,), v, dtype=dt)  # noqa: E731
    return SamplingBatch(full(temperature, torch.float32), full(top_k, torch.int64), full(top_p, torch.float32),
                         full(math.log(min_p) if min_p > 0 else -math.inf, torch.float32),
                         seeds if seeds is not None else torch.full((rows,), 7, dtype=torch.int64),
                         positions if positions is not None else torch.arange(rows, dtype=torch.int64),
                         offsets, ban_ids, full(logprobs, torch.bool))


def _draw(kernel, logits, batch):
    rows = batch.temperature.shape[0]
    x = logits.expand(rows, -1).contiguous()
    return kernel.sample(x, *batch.tensors())[0] if kernel is not None else sample_torch(x, batch)[0]


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2.0), stat / 2))


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0, -1.5, -3.0])


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_the_softmax(impl, temperature):
    """One seeded request's 200k successive draws (positions 0..N) pass a chi-square test at p > 0.001."""
    tokens = _draw(impl, LOGITS, _batch(DRAWS, temperature=temperature))
    counts = torch.bincount(tokens, minlength=len(LOGITS)).double()
    assert _chi_square_p(counts, torch.softmax(LOGITS.double() / temperature, -1)) > 0.001


def test_draws_across_seeds_follow_the_softmax(kernel):
    """The first token of 200k requests with different seeds: the same distribution."""
    positions = torch.zeros(DRAWS, dtype=torch.int64)
    tokens = _draw(kernel, LOGITS, _batch(DRAWS, seeds=torch.arange(DRAWS), positions=positions))
    counts = torch.bincount(tokens, minlength=len(LOGITS)).double()
    assert _chi_square_p(counts, torch.softmax(LOGITS.double(), -1)) > 0.001


def test_a_biased_sampler_fails_the_test():
    """The chi-square check has power: draws from a distribution 5% off on two tokens are rejected."""
    probs = torch.softmax(LOGITS.double(), -1)
    skewed = probs.clone()
    skewed[0] *= 1.05
    skewed[1] -= probs[0] * 0.05
    counts = torch.bincount(torch.multinomial(skewed, DRAWS, replacement=True,
                                              generator=torch.Generator().manual_seed(0)), minlength=10).double()
    assert _chi_square_p(counts, probs) < 0.001


def test_masks_never_emit_a_masked_token(impl):
    k = impl
    n = 20_000
    probs = torch.softmax(LOGITS, -1)
    assert set(_draw(k, LOGITS, _batch(n, top_k=3)).tolist()) == {0, 1, 2}
    # top_p 0.6: tokens 0 (0.32), 1 (0.19) hold 0.51 < 0.6, so token 2 (0.12) is the last kept.
    assert set(_draw(k, LOGITS, _batch(n, top_p=0.6)).tolist()) == {0, 1, 2}
    kept = {i for i, p in enumerate(probs.tolist()) if p >= 0.2 * probs.max()}
    assert set(_draw(k, LOGITS, _batch(n, min_p=0.2)).tolist()) == kept
    # top_k 5 first: renormalised over the five, tokens 0 and 1 hold 0.65 >= 0.6.
    assert set(_draw(k, LOGITS, _batch(n, top_k=5, top_p=0.6)).tolist()) == {0, 1}
    assert set(_draw(k, LOGITS, _batch(n, bans=[0, 2])).tolist()) == set(range(10)) - {0, 2}
    assert set(_draw(k, LOGITS, _batch(n, temperature=0.0)).tolist()) == {0}
    assert set(_draw(k, LOGITS, _batch(n, temperature=0.0, bans=[0])).tolist()) == {1}


def test_top_p_renormalises_over_what_is_kept(kernel):
    """Among the kept tokens the draws still follow the (renormalised) softmax."""
    tokens = _draw(kernel, LOGITS, _batch(DRAWS, top_k=4))
    counts = torch.bincount(tokens, minlength=10).double()[:4]
    assert _chi_square_p(counts, torch.softmax(LOGITS[:4].double(), -1)) > 0.001


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])
def test_fallback_gives_the_kernels_tokens_for_the_same_seeds(kernel, scale):
    check_kernel_against_fallback(kernel, scale)


def test_bfloat16_logits_sample_as_their_float32_widening(kernel):
    """A bfloat16 model hands the sampler its logits as they are: the kernel widens each row itself, so tokens and
    logprobs equal those of the same values widened beforehand (greedy, sampled, masked, banned)."""
    g = torch.Generator().manual_seed(11)
    rows, vocab = 64, 4099
    logits = (torch.randn(rows, vocab, generator=g) * 4).bfloat16()
    cycle = lambda *vals: torch.tensor([vals[i % len(vals)] for i in range(rows)])  # noqa: E731
    batch = SamplingBatch(
        temperature=cycle(0.0, 1.0, 0.7).float(), top_k=cycle(0, 0, 50, 0), top_p=cycle(1.0, 0.9, 1.0).float(),
        log_min_p=torch.full((rows,), -math.inf), seeds=torch.randint(0, 2**62, (rows,), generator=g),
        positions=torch.randint(0, 4096, (rows,), generator=g), ban_offsets=torch.arange(rows + 1),
        ban_ids=logits.float().argmax(dim=-1), want_logprobs=cycle(True, False, True))
    narrow, narrow_lp = kernel.sample(logits, *batch.tensors())
    wide, wide_lp = kernel.sample(logits.float(), *batch.tensors())
    assert narrow.tolist() == wide.tolist()
    assert torch.equal(narrow_lp.isnan(), wide_lp.isnan())
    assert torch.equal(narrow_lp[~narrow_lp.isnan()], wide_lp[~wide_lp.isnan()])
    tokens = Sampler(kernel=kernel)(logits, [_req(i, temperature=0.0) for i in range(rows)]).tokens
    assert tokens == logits.float().argmax(dim=-1).tolist()
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.sample(logits.half(), *batch.tensors())


def _req(i, **kw):
    return Request(f"r{i}", [1], SamplingParams(**kw), arrival_s=0.0, seq_no=i)


def test_sampler_keeps_only_allowed_tokens_as_requests_advance():
    """Through the Sampler (whatever path is built): each row's noise moves with its output position."""
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]] * 3)
    reqs = [_req(0, top_k=2, seed=0), _req(1, top_p=0.5, seed=1), _req(2, temperature=0.0)]
    sampler = Sampler(kernel=sampler_kernel())
    seen = [set() for _ in reqs]
    for _ in range(200):
        tokens = sampler(logits, reqs).tokens
        for r, s, t in zip(reqs, seen, tokens):
            s.add(t)
            r.tokens.append(t)
    assert seen[0] == {0, 1}
    # softmax([5,4,...]) puts 0.63 on token 0: the 0.5 nucleus holds token 0 alone.
    assert seen[1] == {0}
    assert seen[2] == {0}


def test_same_seed_same_tokens_alone_and_in_a_batch_of_32(tiny_model):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    prompt = random_prompts(1, seed=11, lo=30, hi=30, vocab=4000)[0]
    alone = make_engine(tiny_model)
    solo = alone.add_request("solo", prompt, params)
    while alone.has_unfinished():
        alone.step()
    batch = make_engine(tiny_model, budget=128)
    others = random_prompts(31, seed=12, lo=5, hi=60, vocab=4000)
    reqs = [batch.add_request(f"o{i}", p, SamplingParams(max_tokens=30, temperature=1.0, seed=i, ignore_eos=True))
            for i, p in enumerate(others[:15])]
    target = batch.add_request("target", prompt, params)
    reqs += [batch.add_request(f"u{i}", p, SamplingParams(max_tokens=20, temperature=0.7, ignore_eos=True))
             for i, p in enumerate(others[15:])]
    while batch.has_unfinished():
        batch.step()
    assert len(solo.output_token_ids) == 24
    assert target.output_token_ids == solo.output_token_ids


def _seeded(i):
    return SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True)


def test_seeded_tokens_survive_preemption(tiny_model):
    prompts = random_prompts(8, seed=21, lo=40, hi=90, vocab=4000)
    alone = [run_all(make_engine(tiny_model), [p], _seeded(i))[0] for i, p in enumerate(prompts)]
    tight = make_engine(tiny_model, num_blocks=20, budget=64)
    reqs = [tight.add_request(f"p{i}", p, _seeded(i)) for i, p in enumerate(prompts)]
    while tight.has_unfinished():
        tight.step()
        tight.kv.check_integrity()
    assert sum(r.num_preemptions for r in reqs) > 0, "the pool was meant to force preemptions"
    assert [r.output_token_ids for r in reqs] == alone


@pytest.mark.parametrize("seed", [5, None])
def test_sampled_tokens_continue_across_export_import(tiny_model, seed):
    """A request exported after 3 tokens continues in another engine exactly as it would have at home,
    seeded or not (an unseeded request's drawn seed travels with its KV)."""
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
    prompt = random_prompts(1, seed=41, lo=50, hi=50, vocab=4000)[0]
    home = make_engine(tiny_model)
    whole = home.add_request("a", prompt, params)
    while home.has_unfinished():
        home.step()
    source = make_engine(tiny_model)
    moved = source.add_request("a", prompt, params)
    assert moved.sample_seed == whole.sample_seed
    while moved.num_output < 3:
        source.step()
    target = make_engine(tiny_model)
    target.add_request("unrelated", [5, 6, 7], params)  # the target's own seed stream moves on
    req = target.add_request("a", prompt, params, kv=source.transfer.export_kv("a"))
    while target.has_unfinished():
        target.step()
    assert req.output_token_ids == whole.output_token_ids


@pytest.mark.parametrize("k", [1, 7])
def test_a_resumed_request_continues_the_same_draws(tiny_model, k):
    """A resume (the gateway's, after a worker died mid-stream) is a new request whose prompt ends with the k
    tokens already streamed, with resumed_outputs=k: its sampled tokens are the rest of the original's."""
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=77, min_tokens=10, ignore_eos=True)
    prompt = random_prompts(1, seed=43, lo=30, hi=30, vocab=4000)[0]
    whole = run_all(make_engine(tiny_model), [prompt], params)[0]
    engine = make_engine(tiny_model)
    rest = SamplingParams(max_tokens=16 - k, temperature=1.0, top_p=0.95, seed=77, min_tokens=max(10 - k, 0),
                          ignore_eos=True)
    resumed = engine.add_request("a.r1", prompt + whole[:k], rest, resumed_outputs=k)
    while engine.has_unfinished():
        engine.step()
    assert whole[:k] + resumed.output_token_ids == whole
    fresh = run_all(make_engine(tiny_model), [prompt + whole[:k]], rest)[0]
    assert fresh != whole[k:], "without resumed_outputs the draws restart: the test would not see a mistake"


def test_unseeded_requests_draw_their_own_seeds(tiny_model):
    engine = make_engine(tiny_model)
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    a, b = run_all(engine, [[9, 10, 11], [9, 10, 11]], params)
    assert a != b


def test_different_seeds_differ(tiny_model):
    engine = make_engine(tiny_model)
    prompt = random_prompts(1, seed=5, lo=10, hi=10, vocab=4000)[0]
    a = engine.add_request("a", prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=1, ignore_eos=True))
    b = engine.add_request("b", prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert a.output_token_ids != b.output_token_ids


def test_logprobs_are_the_models_log_probabilities(tiny_model):
    engine = make_engine(tiny_model)
    req = engine.add_request("lp", [1, 50, 60], SamplingParams(max_tokens=4, temperature=0.0, logprobs=True,
                                                               ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(req.logprobs) == 4
    assert all(lp <= 0.0 for lp in req.logprobs)


def test_min_tokens_bans_stop_tokens_until_reached(tiny_model):
    engine = make_engine(tiny_model)
    prompt = list(range(5, 30))
    free = run_all(engine, [prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    stop_at_first = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=(free[0],))
    assert run_all(engine, [prompt], stop_at_first)[0] == free[:1]  # the stop token ends it at once
    held = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=(free[0],), min_tokens=3)
    out = run_all(engine, [prompt], held)[0]
    assert len(out) >= 3 and free[0] not in out[:3]


def test_min_p_is_validated():
    from services.common.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="min_p"):
        SamplingParams(min_p=1.5).validate()


def _random_masks(rows: int, vocab: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """allow_rows (every third row free) and bitmasks allowing a random ~10% of the vocabulary (and never none)."""
    words = (vocab + 31) // 32
    allowed = torch.rand(rows, words * 32, generator=g) < 0.1
    allowed[:, vocab:] = False
    allowed[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=g)] = True
    weights = (1 << torch.arange(32, dtype=torch.int64))
    masks = (allowed.view(rows, words, 32).long() * weights).sum(-1)
    masks = torch.where(masks >= 2**31, masks - 2**32, masks).to(torch.int32)
    allow_rows = torch.tensor([-1 if i % 3 == 0 else i for i in range(rows)], dtype=torch.int64)
    return allow_rows, masks, allowed[:, :vocab]


def test_grammar_masks_hold_and_kernel_equals_fallback(kernel):
    """A row with a bitmask samples only tokens whose bit is set (greedy and sampled, with top-k / top-p on top),
    a row without one is unaffected, the kernel and the PyTorch fallback agree token for token, and logprobs stay
    those of the unmasked distribution."""
    g = torch.Generator().manual_seed(5)
    rows, vocab = 48, 4099
    logits = torch.randn(rows, vocab, generator=g) * 3
    allow_rows, masks, allowed = _random_masks(rows, vocab, g)
    cycle = lambda *vals: torch.tensor([vals[i % len(vals)] for i in range(rows)])  # noqa: E731
    batch = SamplingBatch(
        temperature=cycle(0.0, 1.0, 0.7, 1.0).float(), top_k=cycle(0, 0, 20), top_p=cycle(1.0, 0.9).float(),
        log_min_p=torch.full((rows,), -math.inf), seeds=torch.randint(0, 2**62, (rows,), generator=g),
        positions=torch.randint(0, 4096, (rows,), generator=g), ban_offsets=torch.zeros(rows + 1, dtype=torch.int64),
        ban_ids=torch.zeros(0, dtype=torch.int64), want_logprobs=torch.ones(rows, dtype=torch.bool),
        allow_rows=allow_rows, allow=masks)
    fast, fast_lp = kernel.sample(logits, *batch.tensors())
    slow, slow_lp = sample_torch(logits, batch)
    assert fast.tolist() == slow.tolist()
    for b in range(rows):
        if allow_rows[b] >= 0:
            assert allowed[allow_rows[b], fast[b]], f"row {b} sampled a masked token"
    free = SamplingBatch(**{**batch.__dict__, "allow_rows": None, "allow": None})
    unmasked, unmasked_lp = kernel.sample(logits, *free.tensors())
    assert fast[allow_rows < 0].tolist() == unmasked[allow_rows < 0].tolist()
    raw = torch.log_softmax(logits, dim=-1).gather(1, fast[:, None]).squeeze(1)
    assert torch.allclose(fast_lp, raw, atol=1e-5)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.sample(logits, *SamplingBatch(**{**batch.__dict__, "allow_rows": allow_rows + rows}).tensors())
    with pytest.raises(RuntimeError, match="bitmask"):
        kernel.sample(logits, *SamplingBatch(**{**batch.__dict__, "allow": masks[:, :-1].contiguous()}).tensors())


def test_top_logprobs_are_the_most_likely_tokens_and_agree_with_the_logprob():
    """top_logprobs: the k most likely tokens of the raw distribution, best first; the sampled token's own logprob
    is the same number where it is among them (greedy: it is the first)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 500, generator=g) * 2
    reqs = [_req(0, temperature=0.0, top_logprobs=5), _req(1, temperature=1.0, seed=2, top_logprobs=20),
            _req(2, temperature=0.0, logprobs=True), _req(3, temperature=0.0), _req(4, top_logprobs=1, seed=9),
            _req(5, temperature=0.0, top_logprobs=3)]
    out = Sampler(kernel=sampler_kernel())(logits, reqs)
    lsm = torch.log_softmax(logits, dim=-1)
    for i, r in enumerate(reqs):
        k = r.params.top_logprobs
        if not k:
            assert out.top[i] is None
            continue
        ids, lps = out.top[i]
        want = lsm[i].topk(k)
        assert ids == want.indices.tolist() and torch.allclose(torch.tensor(lps), want.values)
        assert lps == sorted(lps, reverse=True)
        if out.tokens[i] in ids:
            assert lps[ids.index(out.tokens[i])] == out.logprobs[i]
    assert out.tokens[0] == out.top[0][0][0] and out.logprobs[0] == out.top[0][1][0]
    assert math.isnan(out.logprobs[3]) and not math.isnan(out.logprobs[2])
