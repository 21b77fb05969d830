"""LoRA: mixed-adapter batches equal transformers + PEFT; residency never evicts what a batch uses; bad adapters
are refused whole."""

import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from services.common.errors import InvalidRequest, NotFound
from services.config.engine import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from services.engine.engine import LLMEngine
from services.engine.lora import LoRASlots
from services.engine.lora_residency import AdapterResidency
from tests.support.lora import ADAPTERS, peft_greedy, save_peft_adapter
from tests.support.reference import assert_matches, greedy, random_prompts, run_all, save_hf_model

NEW_TOKENS = 12
N_PROMPTS = 15  # three per adapter and three for the base model


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_hf_model(root / "base", "gqa")
    adapters = {name: save_peft_adapter(base, root / name, seed=i + 1, **kw)
                for i, (name, kw) in enumerate(ADAPTERS.items())}
    return base, adapters


@pytest.fixture(scope="module")
def cases(lora_models):
    """Prompts (some longer than a kernel's small-segment rows, some a few tokens), each with an adapter or none,
    and PEFT's greedy output for each with its adapter alone."""
    base, adapters = lora_models
    prompts = random_prompts(N_PROMPTS, seed=3, lo=1, hi=60)
    names = list(ADAPTERS) + [""]
    assigned = [names[i % len(names)] for i in range(N_PROMPTS)]
    refs = [None] * N_PROMPTS
    for name in names:
        idx = [i for i in range(N_PROMPTS) if assigned[i] == name]
        for i, ref in zip(idx, peft_greedy(base, adapters.get(name), [prompts[i] for i in idx], NEW_TOKENS)):
            refs[i] = ref
    return prompts, assigned, refs


def lora_engine(base, adapters, max_loras=8, max_cpu_loras=32, max_seqs=64, max_rank=64, clock=None) -> LLMEngine:
    kw = {"clock": clock} if clock else {}
    engine = LLMEngine(EngineConfig(str(base), cache=CacheConfig(num_blocks=512),
                                    scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=256,
                                                              policy="fcfs"),
                                    lora=LoRAConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras,
                                                    max_lora_rank=max_rank)), **kw)
    for name, path in adapters.items():
        engine.adapters.load(name, str(path), prefetch=True)
    while engine.lora.loading:  # read before the first step, so that what a step holds does not depend on timing
        engine.lora.wait(1.0)
        engine.lora.poll()
    return engine


def run(engine, prompts, assigned, check=None) -> list:
    return run_all(engine, prompts, greedy(NEW_TOKENS), check, assigned)


@pytest.mark.parametrize("kernel", ["compiled", "gathered"])
def test_one_mixed_batch_equals_peft_applying_each_adapter_alone(kernel, lora_models, cases):
    base, adapters = lora_models
    prompts, assigned, refs = cases
    engine = lora_engine(base, adapters)
    if kernel == "gathered":
        engine._lora_kernel = False  # the fallback: gathered batched matmuls
    elif engine._kernel() is None:
        pytest.skip("the LoRA kernel did not build here")
    seen = []

    def adapters_in_batch(e):
        seen.append({r.adapter for r in e.scheduler.running})

    outputs = run(engine, prompts, assigned, adapters_in_batch)
    ties = assert_matches(outputs, refs)
    assert len(ties) <= 1, ties
    assert any(len(s) == len(ADAPTERS) + 1 for s in seen), "all four adapters and the base model shared a batch"
    base_refs = [refs[i] for i in range(N_PROMPTS) if not assigned[i]]
    assert all(refs[i].tokens != base_refs[0].tokens for i in range(N_PROMPTS) if assigned[i]), \
        "each adapter changes the output (else this test could not fail)"
    assert engine.kv.pool.counts()["used"] == 0 and sum(engine.lora.pins) == 0


def test_two_slots_for_four_adapters_still_equal_peft(lora_models, cases):
    """Adapters take turns in the slots; a batch never holds more adapters than slots; output is unchanged."""
    base, adapters = lora_models
    prompts, assigned, refs = cases
    engine = lora_engine(base, adapters, max_loras=2, max_cpu_loras=2)

    def at_most_two(e):
        assert len({r.adapter for r in e.scheduler.running if r.adapter}) <= 2

    outputs = run(engine, prompts, assigned, at_most_two)
    assert len(assert_matches(outputs, refs)) <= 1
    snap = engine.lora.snapshot()
    assert snap.slot_loads > 2 and snap.loads > 2  # evicted and loaded again from disk
    assert sum(engine.lora.pins) == 0


def test_unknown_adapter_is_not_found(lora_models):
    base, adapters = lora_models
    engine = lora_engine(base, {})
    with pytest.raises(NotFound, match="'nope'"):
        engine.add_request("x", [5, 6], greedy(2), adapter="nope")


def test_unload_under_load_loses_no_request(lora_models, cases):
    """Unloaded, an adapter is no longer listed; requests already running, and those still on their way through the
    mesh (a decode after its prefill) for the grace period, finish with it; then it is gone."""
    base, adapters = lora_models
    prompts, assigned, refs = cases
    now = [0.0]
    engine = lora_engine(base, adapters, clock=lambda: now[0])
    for i, (p, a) in enumerate(zip(prompts, assigned)):
        engine.add_request(f"r{i}", p, greedy(NEW_TOKENS), adapter=a)
    engine.step()
    engine.adapters.unload("qv8")
    assert "qv8" not in engine.lora.known and "qv8" not in engine.load().lora.known
    late = next(i for i, a in enumerate(assigned) if a == "qv8")
    engine.add_request("late", prompts[late], greedy(NEW_TOKENS), adapter="qv8")  # in flight before the unload
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.req_id] = o.request.output_token_ids
    assert len(assert_matches([done[f"r{i}"] for i in range(N_PROMPTS)] + [done["late"]],
                              refs + [refs[late]])) <= 1
    now[0] += engine.lora.RETIRE_GRACE_S
    engine.step()  # an idle step sweeps
    with pytest.raises(NotFound):
        engine.add_request("new", [5, 6], greedy(2), adapter="qv8")
    assert "qv8" not in engine.lora.host and "qv8" not in engine.lora.slot_names  # its memory is free
    engine.adapters.load("qv8", str(adapters["qv8"]))  # and it can come back
    assert [a["name"] for a in engine.adapters.listing()] == sorted(ADAPTERS)


# ---- malformed adapters --------------------------------------------------------------------------

def broken(src, dst, edit_config=None, edit_tensors=None, drop=None):
    shutil.copytree(src, dst)
    if edit_config:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        edit_config(cfg)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        tensors = load_file(str(dst / "adapter_model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "adapter_model.safetensors"))
    if drop:
        (dst / drop).unlink()
    return dst


def _bad_shape(t):
    key = next(k for k in t if k.endswith("q_proj.lora_A.weight"))
    t[key] = t[key][:, :-1].contiguous()


def _unknown_target(t):
    key = next(k for k in t if "q_proj" in k)
    t[key.replace("self_attn.q_proj", "self_attn.rotary_proj")] = t.pop(key)


def _lm_head(t):
    t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)


def _half_pair(t):
    t.pop(next(k for k in t if k.endswith("v_proj.lora_B.weight")))


BROKEN = {
    "bad-shape": (dict(edit_tensors=_bad_shape), "has shape"),
    "rank-too-high": (dict(), "above this engine's max_lora_rank"),
    "unknown-target": (dict(edit_tensors=_unknown_target), "unknown target module"),
    "unknown-target-config": (dict(edit_config=lambda c: c.update(target_modules=["q_proj", "embed_tokens"])),
                              "unknown target module"),
    "lm-head": (dict(edit_tensors=_lm_head), "not a LoRA weight of a decoder layer"),
    "half-pair": (dict(edit_tensors=_half_pair), "must come in pairs"),
    "missing-weights": (dict(drop="adapter_model.safetensors"), "adapter_model.safetensors not found"),
    "missing-config": (dict(drop="adapter_config.json"), "adapter_config.json not found"),
    "dora": (dict(edit_config=lambda c: c.update(use_dora=True)), "DoRA is not supported"),
    "bias": (dict(edit_config=lambda c: c.update(bias="all")), "bias"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_malformed_adapter_is_refused_whole_naming_it(case, lora_models, tmp_path):
    base, adapters = lora_models
    edits, message = BROKEN[case]
    folder = broken(adapters["qv8"], tmp_path / case, **edits)
    engine = lora_engine(base, {"ok": adapters["attn4"]}, max_rank=4 if case == "rank-too-high" else 64)
    with pytest.raises(InvalidRequest) as err:
        engine.adapters.load(case, str(folder))
    assert f"adapter {case!r}" in str(err.value) and message in str(err.value)
    assert [a["name"] for a in engine.adapters.listing()] == ["ok"]  # nothing of it registered
    with pytest.raises(NotFound):
        engine.add_request("x", [5, 6], greedy(2), adapter=case)


def test_truncated_weights_are_refused(lora_models, tmp_path):
    base, adapters = lora_models
    folder = shutil.copytree(adapters["qv8"], tmp_path / "cut")
    data = (folder / "adapter_model.safetensors").read_bytes()
    (folder / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    engine = lora_engine(base, {})
    with pytest.raises(InvalidRequest, match="'cut'"):
        engine.adapters.load("cut", str(folder))
    assert engine.adapters.listing() == []


# ---- residency: a property over any sequence of admissions, finishes and reads ----------------------

class _Info:
    def __init__(self, name):
        self.name, self.path, self.rank = name, name, 1


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(["claim", "release", "poll"]), st.integers(0, 5)), max_size=60),
       st.integers(1, 3), st.integers(1, 4))
def test_eviction_never_removes_a_pinned_adapter(ops, slots, host):
    from services.config.engine import ModelConfig

    mc = ModelConfig(vocab_size=8, hidden_size=4, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4,
                     intermediate_size=4, max_positions=16)
    weights = {(0, "q_proj"): (torch.ones(1, 4), torch.ones(1, 4))}
    res = AdapterResidency(slots, host, LoRASlots(mc, slots, torch.float32), inspect=None, reader=lambda info: weights)
    res.slots.ensure(1)
    for i in range(6):
        res.known[f"a{i}"] = _Info(f"a{i}")
    held = []  # (slot, adapter) pinned by a "running request"
    for op, i in ops:
        if op == "claim":
            slot = res.claim(f"a{i}")
            if slot is not None:
                assert res.slot_names[slot] == f"a{i}"
                held.append((slot, f"a{i}"))
        elif op == "release" and held:
            slot, _ = held.pop(i % len(held))
            res.release(slot)
        else:
            res.wait(1.0)
            res.poll()
        for slot, name in held:  # what a running request uses stays in its slot
            assert res.slot_names[slot] == name and res.pins[slot] > 0
        assert len({n for n in res.slot_names if n}) == sum(1 for n in res.slot_names if n)  # one slot per adapter
        pinned = {n for s, n in enumerate(res.slot_names) if res.pins[s]}
        assert len(set(res.host) - pinned) <= res.max_cpu_loras
    res.close()


def test_gemma3_with_an_adapter_equals_peft(tmp_path):
    """LoRA on Gemma 3's projections (its own layer: four norms, a GELU gate, a sliding window shorter than the
    prompts) as PEFT applies them, beside requests without it."""
    base = save_hf_model(tmp_path / "gemma3", "gemma3")
    adapter = save_peft_adapter(base, tmp_path / "all32", seed=5, **ADAPTERS["all32"])
    prompts = random_prompts(6, seed=4, lo=10, hi=60)
    assigned = ["all32", "", "all32", "", "all32", "all32"]
    refs = [peft_greedy(base, adapter if name else None, [p], NEW_TOKENS)[0] for p, name in zip(prompts, assigned)]
    assert refs[0].tokens != peft_greedy(base, None, prompts[:1], NEW_TOKENS)[0].tokens  # the adapter matters
    engine = lora_engine(base, {"all32": adapter})
    assert_matches(run(engine, prompts, assigned), refs)
    assert engine.kv.pool.counts()["used"] == 0
