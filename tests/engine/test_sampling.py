"""Seeded sampling is reproducible whatever the batch; filters keep only allowed tokens."""

import torch

from services.engine.request import Request, SamplingParams
from services.engine.sampler import Sampler
from tests.support.reference import make_engine, random_prompts, run_all


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


def test_different_seeds_differ(tiny_model):
    engine = make_engine(tiny_model)
    prompt = random_prompts(1, seed=5, lo=10, hi=10, vocab=4000)[0]
    a = engine.add_request("a", prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=1, ignore_eos=True))
    b = engine.add_request("b", prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert a.output_token_ids != b.output_token_ids


def _req(i, **kw):
    return Request(f"r{i}", [1], SamplingParams(**kw), arrival_s=0.0, seq_no=i)


def test_top_k_and_top_p_keep_only_allowed_tokens():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]] * 3)
    reqs = [_req(0, top_k=2, seed=0), _req(1, top_p=0.5, seed=1), _req(2, temperature=0.0)]
    sampler = Sampler(0)
    seen = [set() for _ in reqs]
    for _ in range(200):
        tokens, _ = sampler(logits, reqs)
        for s, t in zip(seen, tokens):
            s.add(t)
    assert seen[0] == {0, 1}
    # softmax([5,4,...]) puts 0.63 on token 0: the 0.5 nucleus holds token 0 alone.
    assert seen[1] == {0}
    assert seen[2] == {0}


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
