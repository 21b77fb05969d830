"""Tensor parallelism (services/engine/parallel.py): the model split over ranks, one process each.

Greedy output at TP=2 (and TP=3, uneven) equals transformers' and TP=1's token for token in float32 on the seeded
models; KV written by a TP=2 engine continues identically in a TP=1 engine and back (the export layout is the
same); LoRA at TP=2 equals PEFT; the gloo all-reduce gives the shared-memory one's tokens; a rank that dies fails
rank 0's next step at once (no hang), and closing the engine ends its ranks. The real model (SmolLM2) at TP=2 is
in test_real_model.py.
"""

import os
import signal

import pytest
import torch

from services.common.errors import RankDied
from services.common.request import RequestSpec
from services.config.engine import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from services.engine.engine import LLMEngine
from services.engine.parallel import plan_shards, shard_weights
from tests.support.kernel_checks import check_collectives
from tests.support.lora import ADAPTERS, peft_greedy, save_peft_adapter
from tests.support.reference import (
    assert_matches,
    greedy,
    hf_greedy,
    make_engine,
    random_prompts,
    run_all,
    save_hf_model,
)

pytestmark = pytest.mark.slow  # starts tensor-parallel ranks as processes

NEW_TOKENS = 12
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                      intermediate_size=1536, max_positions=8192, tie_embeddings=True)


def test_shards_split_by_kv_head_the_mlp_and_the_vocabulary():
    """SmolLM2's 3 KV heads over 2 ranks: 2 + 1 (9 query heads as 6 + 3); the MLP's columns and the vocabulary
    evenly."""
    shards = plan_shards(SMOLLM2, 2)
    assert [s.kv for s in shards] == [(0, 2), (2, 3)] and [s.heads for s in shards] == [(0, 6), (6, 9)]
    assert [s.inter for s in shards] == [(0, 768), (768, 1536)]
    assert [s.vocab for s in shards] == [(0, 24576), (24576, 49152)]
    assert [s.kv for s in plan_shards(SMOLLM2, 3)] == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="exceeds the model's 3 KV heads and cannot replicate them"):
        plan_shards(SMOLLM2, 4)
    # more ranks than KV heads: each KV head on world / KV heads ranks, its query heads split between them
    gemma = ModelConfig(vocab_size=64, hidden_size=640, num_layers=1, num_heads=4, num_kv_heads=1, head_dim=256,
                        intermediate_size=2048, max_positions=64)
    assert [(s.kv, s.heads) for s in plan_shards(gemma, 2)] == [((0, 1), (0, 2)), ((0, 1), (2, 4))]
    two = ModelConfig(**{**vars(gemma), "num_heads": 8, "num_kv_heads": 2})
    assert [(s.kv, s.heads) for s in plan_shards(two, 4)] == [((0, 1), (0, 2)), ((0, 1), (2, 4)), ((1, 2), (4, 6)),
                                                             ((1, 2), (6, 8))]


def test_sharded_weights_add_up_to_the_whole_layer():
    """Every rank's rows and columns together are the model's weights exactly once; a row-parallel bias is kept on
    rank 0 only."""
    mc = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=6, num_kv_heads=3, head_dim=8,
                     intermediate_size=96, max_positions=64, o_bias=True)
    g = torch.Generator().manual_seed(0)
    names = {"q_proj": (48, 32), "k_proj": (24, 32), "v_proj": (24, 32), "o_proj": (32, 48), "gate_proj": (96, 32),
             "up_proj": (96, 32), "down_proj": (32, 96)}
    weights = {f"model.layers.0.{'mlp' if n in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{n}.weight":
               torch.randn(shape, generator=g) for n, shape in names.items()}
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.randn(32, generator=g)
    weights["model.embed_tokens.weight"] = torch.randn(64, 32, generator=g)
    weights["lm_head.weight"] = torch.randn(64, 32, generator=g)
    parts = [shard_weights(weights, mc, s) for s in plan_shards(mc, 2)]
    x = torch.randn(5, 48, generator=g)
    o = "model.layers.0.self_attn.o_proj."
    heads = [s.heads for s in plan_shards(mc, 2)]
    partial = [x[:, h0 * 8:h1 * 8] @ p[o + "weight"].T + p[o + "bias"] for (h0, h1), p in zip(heads, parts)]
    assert torch.allclose(sum(partial), x @ weights[o + "weight"].T + weights[o + "bias"], atol=1e-5)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(torch.cat([p[q] for p in parts]), weights[q])
    assert torch.equal(torch.cat([p["lm_head.shard"] for p in parts]), weights["lm_head.weight"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shared_memory_collectives_equal_torch_on_every_rank(dtype):
    check_collectives(dtype)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {name: save_hf_model(root / name, name) for name in ("gqa", "mha", "qkv_bias", "gemma3")}


@pytest.fixture(scope="module")
def prompts():
    """Mixed lengths, half of them sharing a 40-token prefix (prefix cache hits at TP=2)."""
    return random_prompts(8, seed=5, lo=1, hi=90) + random_prompts(8, seed=6, lo=1, hi=50, prefix=list(range(3, 43)))


@pytest.mark.parametrize("name,ranks,budget", [("gqa", 2, 64), ("qkv_bias", 2, 7), ("gemma3", 2, 7), ("mha", 3, 64)])
def test_greedy_equals_transformers_and_tp1(name, ranks, budget, hf_models, prompts):
    """Float32, chunked prefill (a 7-token budget cuts every prompt) and prefix caching: TP=N's tokens are TP=1's
    and transformers', token for token (mha at TP=3: 4 KV heads as 2 + 1 + 1; gemma3, tied, sliding window, one KV
    head: replicated on both ranks, which split its 4 query heads)."""
    refs = hf_greedy(hf_models[name], prompts, NEW_TOKENS)
    single = run_all(make_engine(hf_models[name], budget=budget), prompts, greedy(NEW_TOKENS))
    engine = make_engine(hf_models[name], budget=budget, tensor_parallel_size=ranks, threads=1)
    try:
        split = run_all(engine, prompts, greedy(NEW_TOKENS), lambda e: e.kv.check_integrity())
        assert engine.kv.pool.counts()["used"] == 0
        assert engine.load().blocks_cached > 0  # the shared prefix was cached
        assert engine.group.collectives.calls > 0
    finally:
        engine.close()
    assert split == single
    assert assert_matches(split, refs) == []


@pytest.mark.parametrize("name", ["tiny", "gemma3"])
def test_kv_moves_between_tp2_and_tp1_engines(name, tiny_model, hf_models):
    """A TP=2 engine's export (every KV head once, in the layout of one rank; gemma3's one KV head is on both ranks)
    continues identically in a TP=1 engine, and a TP=1 engine's export in a TP=2 engine (written to both of
    gemma3's copies): prefill and decode workers of different sizes pair."""
    model = tiny_model if name == "tiny" else hf_models[name]
    prompt = random_prompts(1, seed=31, lo=70, hi=70, vocab=4000 if name == "tiny" else 500)[0]
    expected = run_all(make_engine(model), [prompt], greedy(12))[0]
    split = make_engine(model, tensor_parallel_size=2, threads=1)
    try:
        for source, target in ((split, make_engine(model)), (make_engine(model), split)):
            req = source.add_request("s", prompt, greedy(12))
            while req.num_output < 1:
                source.step()
            kv = source.transfer.export_kv("s")
            source.abort("s")
            target.transfer.begin_import(RequestSpec("s", tuple(prompt), greedy(12)))
            target.transfer.import_blocks("s", 0, b"".join(kv.blocks))
            moved = target.transfer.end_import("s", kv.token_ids, kv.num_prompt, kv.num_computed, len(kv.blocks),
                                               kv.sample_seed)
            while target.has_unfinished():
                target.step()
            assert moved.output_token_ids == expected
            assert target.load().blocks_used == 0
    finally:
        split.close()


def test_lora_at_tp2_equals_peft(tmp_path):
    """The four adapters of the LoRA tests (column- and row-parallel targets, ranks 4-32) sharded over two ranks,
    mixed in one batch with the base model: PEFT's tokens, each adapter applied alone."""
    base = save_hf_model(tmp_path / "base", "gqa")
    adapters = {name: save_peft_adapter(base, tmp_path / name, seed=i + 1, **kw)
                for i, (name, kw) in enumerate(ADAPTERS.items())}
    prompts = random_prompts(10, seed=3, lo=1, hi=60)
    names = list(ADAPTERS) + [""]
    assigned = [names[i % len(names)] for i in range(len(prompts))]
    refs = [None] * len(prompts)
    for name in names:
        idx = [i for i in range(len(prompts)) if assigned[i] == name]
        for i, ref in zip(idx, peft_greedy(base, adapters.get(name), [prompts[i] for i in idx], NEW_TOKENS)):
            refs[i] = ref
    engine = LLMEngine(EngineConfig(str(base), num_threads=1, tensor_parallel_size=2,
                                    cache=CacheConfig(num_blocks=512),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=256, policy="fcfs"),
                                    lora=LoRAConfig(max_loras=2, max_cpu_loras=4)))
    try:
        for name, path in adapters.items():
            engine.adapters.load(name, str(path))
        outputs = run_all(engine, prompts, greedy(NEW_TOKENS), None, assigned)
        assert engine.lora.snapshot().slot_loads > 2  # two slots for four adapters: slots were rewritten on both ranks
    finally:
        engine.close()
    assert len(assert_matches(outputs, refs)) <= 1


def test_gloo_backend_gives_the_shared_memory_tokens(hf_models, prompts):
    shm = make_engine(hf_models["gqa"], tensor_parallel_size=2, threads=1)
    gloo = make_engine(hf_models["gqa"], tensor_parallel_size=2, tensor_parallel_backend="gloo", threads=1)
    try:
        assert run_all(gloo, prompts, greedy(NEW_TOKENS)) == run_all(shm, prompts, greedy(NEW_TOKENS))
    finally:
        shm.close()
        gloo.close()


def test_a_dead_rank_fails_the_next_step_and_close_ends_the_ranks(tiny_model):
    """SIGKILL of rank 1 mid-generation: rank 0's next step raises RankDied or the all-reduce's error naming the
    rank (the worker then goes down as one replica); it does not wait forever. close() ends live ranks."""
    engine = make_engine(tiny_model, tensor_parallel_size=2, threads=1)
    try:
        engine.add_request("r", list(range(3, 40)), greedy(50))
        engine.step()
        rank1 = engine.group.procs[0]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(10)
        with pytest.raises(RankDied, match="rank 1"):
            for _ in range(50):
                engine.step()
    finally:
        engine.close()
    other = make_engine(tiny_model, tensor_parallel_size=2, threads=1)
    proc = other.group.procs[0]
    other.close()
    assert not proc.is_alive()


def test_more_ranks_than_kv_heads_is_refused_with_the_reason(tiny_model):
    with pytest.raises(ValueError, match="exceeds the model's .* KV heads"):
        make_engine(tiny_model, tensor_parallel_size=64)
