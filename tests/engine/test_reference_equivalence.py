"""Greedy output must equal Hugging Face transformers token for token, whatever the batching."""

import pytest
import torch

from tests.support.reference import (
    CONFIGS,
    agreement,
    assert_matches,
    greedy,
    hf_greedy,
    make_engine,
    random_prompts,
    run_all,
    save_hf_model,
)

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: save_hf_model(root / name, name) for name in CONFIGS}


@pytest.fixture(scope="module")
def mixed_prompts():
    return random_prompts(32, seed=1, lo=1, hi=90)


@pytest.fixture(scope="module")
def references(hf_models, mixed_prompts):
    return {name: hf_greedy(path, mixed_prompts, NEW_TOKENS) for name, path in hf_models.items()}


def check_each_step(engine):
    engine.kv.check_integrity()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batched_greedy_equals_transformers(name, hf_models, mixed_prompts, references):
    engine = make_engine(hf_models[name])
    outputs = run_all(engine, mixed_prompts, greedy(NEW_TOKENS), check_each_step)
    ties = assert_matches(outputs, references[name])
    assert len(ties) <= 1, f"too many near-ties: {ties}"
    assert engine.kv.pool.counts()["used"] == 0


@pytest.mark.parametrize("name", ["gqa", "gemma3"])
@pytest.mark.parametrize("budget", [1, 7])  # (64, make_engine's default, is test_batched_greedy_equals_transformers)
def test_token_budgets(budget, name, hf_models, mixed_prompts, references):
    """Chunked prefill at any chunk size; for gemma3, chunks that start inside, at and past the sliding window."""
    engine = make_engine(hf_models[name], budget=budget)
    assert_matches(run_all(engine, mixed_prompts, greedy(NEW_TOKENS), check_each_step), references[name])


@pytest.mark.parametrize("block_size", [1])  # (16, make_engine's default, is test_batched_greedy_equals_transformers)
def test_block_sizes(block_size, hf_models, mixed_prompts, references):
    engine = make_engine(hf_models["gqa"], block_size=block_size, num_blocks=4096 // block_size)
    assert_matches(run_all(engine, mixed_prompts, greedy(NEW_TOKENS), check_each_step), references["gqa"])


@pytest.mark.parametrize("name", ["gqa", "gemma3"])
def test_shared_prefixes_hit_the_prefix_cache(name, hf_models):
    """A cached prefix (48 tokens: twice gemma3's sliding window) continued by new prompts."""
    shared = random_prompts(1, seed=7, lo=48, hi=48)[0]
    prompts = random_prompts(32, seed=8, lo=1, hi=40, prefix=shared) + [shared + [5]] * 2
    refs = hf_greedy(hf_models[name], prompts, NEW_TOKENS)
    engine = make_engine(hf_models[name])
    first = run_all(engine, prompts[:1], greedy(NEW_TOKENS))
    engine.requests.clear()
    reqs = [engine.add_request(f"s{i}", p, greedy(NEW_TOKENS)) for i, p in enumerate(prompts[1:])]
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_integrity()
    assert_matches(first + [r.output_token_ids for r in reqs], refs)
    assert all(r.num_cached_prompt >= 48 for r in reqs), [r.num_cached_prompt for r in reqs]


def test_preemption_keeps_output(hf_models, mixed_prompts, references):
    engine = make_engine(hf_models["gqa"], num_blocks=14, budget=64)
    reqs = [engine.add_request(f"p{i}", p, greedy(NEW_TOKENS)) for i, p in enumerate(mixed_prompts)]
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_integrity()
    assert sum(r.num_preemptions for r in reqs) > 0, "the pool was meant to force preemptions"
    assert_matches([r.output_token_ids for r in reqs], references["gqa"])
    assert engine.kv.pool.counts()["used"] == 0


@pytest.mark.parametrize("name, k", [("gqa", 1), ("gqa", 5), ("gemma3", 5)])
def test_export_import_continues_identically(name, k, hf_models, mixed_prompts, references):
    source, target = make_engine(hf_models[name]), make_engine(hf_models[name])
    finished = {}
    for i, p in enumerate(mixed_prompts[:12]):
        req = source.add_request(f"x{i}", p, greedy(NEW_TOKENS))
        while req.num_output < k:
            source.step()
        exported = source.transfer.export_kv(req.req_id)
        assert source.abort(req.req_id)
        moved = target.add_request(req.req_id, p, greedy(NEW_TOKENS), kv=exported)
        finished[i] = moved
    assert source.kv.pool.counts()["used"] == 0
    while target.has_unfinished():
        target.step()
        target.kv.check_integrity()
    outputs = [finished[i].output_token_ids for i in range(12)]
    assert_matches(outputs, references[name][:12])
    assert target.kv.pool.counts()["used"] == 0


@pytest.mark.parametrize("name", ["gqa", "qkv_bias"])
def test_bfloat16_greedy_equals_transformers_in_bfloat16(name, hf_models, mixed_prompts):
    """bfloat16 weights, activations and KV against transformers in bfloat16: token-identical except at a
    bfloat16 near-tie (a top-2 gap of at most 2 units of the top logit's last bit). These random-weight models
    have flat logits, so in bfloat16 about a third of the requests meet an exact or one-unit tie within 16 tokens
    (10 of 32 for gqa); most tokens must still come before any difference."""
    refs = hf_greedy(hf_models[name], mixed_prompts, NEW_TOKENS, dtype=torch.bfloat16)
    engine = make_engine(hf_models[name], dtype="bfloat16")
    assert engine.model.dtype == torch.bfloat16 and engine.kv_cache.k[0].dtype == torch.bfloat16
    outputs = run_all(engine, mixed_prompts, greedy(NEW_TOKENS), check_each_step)
    ties = assert_matches(outputs, refs)
    assert agreement(outputs, refs) >= 0.6, f"near-ties everywhere: {ties}"
    assert engine.kv.pool.counts()["used"] == 0
