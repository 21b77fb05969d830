"""The mock engine (engine.backend mock): the real scheduler and KV bookkeeping with a step-time model in place of
the forward pass. What the cluster measurements rest on: steps take the modelled time (scaled), tokens are the same
for the same request on any engine, KV moves between engines as in a P/D handoff, bad inputs get clear errors, and
no torch is loaded (64 of them fit on one machine)."""

import json
import subprocess
import sys

import pytest

from services.common.errors import InvalidRequest, NotFound
from services.common.sampling import Guided
from services.config.engine import CacheConfig, EngineConfig, LoRAConfig, MockConfig
from services.engine.cost_model import PRESETS, CostModel
from services.engine.mock import MockEngine
from services.engine.request import SamplingParams


class FakeTime:
    def __init__(self):
        self.now = 100.0
        self.slept = []

    def clock(self):
        return self.now

    def sleep(self, s):
        self.slept.append(s)
        self.now += s


def engine(model, t=None, profile="h100-llama8b", scale=1.0, kv="bytes", lora=None, **cache):
    cfg = EngineConfig(model_dir=str(model), backend="mock", mock=MockConfig(profile=profile, time_scale=scale, kv=kv),
                       cache=CacheConfig(num_blocks=256, **cache), lora=lora or LoRAConfig())
    return MockEngine(cfg, clock=t.clock, sleep=t.sleep) if t else MockEngine(cfg)


def run(e) -> dict:
    outs = {}
    while e.has_unfinished():
        for o in e.step():
            outs.setdefault(o.req_id, []).extend(o.new_token_ids)
    return outs


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0)


def test_tokens_depend_on_the_request_only_and_run_to_max_tokens(tiny_model):
    a, b = engine(tiny_model), engine(tiny_model)
    a.add_request("x", list(range(1, 40)), greedy(12))
    a.add_request("y", list(range(2, 41)), greedy(12))
    b.add_request("other-id", list(range(1, 40)), greedy(12))
    out_a, out_b = run(a), run(b)
    assert len(out_a["x"]) == 12 and out_a["x"] == out_b["other-id"]
    assert out_a["x"] != out_a["y"]
    assert not set(out_a["x"]) & set(a.info.eos_token_ids)
    assert a.load().blocks_used == 0  # every block back


def test_a_step_takes_the_modelled_time_times_the_scale(tiny_model):
    t = FakeTime()
    e = engine(tiny_model, t, scale=10.0)
    cost: CostModel = PRESETS["h100-llama8b"]
    e.add_request("x", list(range(1, 33)), greedy(3))  # 32 prompt tokens: one prefill step, then decodes
    e.step()
    assert t.slept[0] == pytest.approx(10 * cost.step_s(1, 31, 0, 0))
    e.step()  # a decode of 1 sequence over 32 tokens of context, chained on the last step's end
    assert t.slept[1] == pytest.approx(10 * cost.step_s(1, 0, 32, 0))
    assert e.last_step.step_s == pytest.approx(10 * cost.step_s(1, 0, 32, 0))


def test_the_loops_own_time_between_steps_is_inside_the_modelled_time(tiny_model):
    t = FakeTime()
    e = engine(tiny_model, t, scale=10.0)
    e.add_request("x", list(range(1, 33)), greedy(4))
    e.step()
    t.now += 0.001  # the core's work between steps (sending outputs, polling)
    e.step()
    cost = PRESETS["h100-llama8b"]
    assert t.slept[1] == pytest.approx(10 * cost.step_s(1, 0, 32, 0) - 0.001)
    assert e.lag_s == 0.0


def test_kv_moves_to_another_mock_engine_and_decoding_goes_on_as_if_it_had_not(tiny_model):
    whole = engine(tiny_model)
    whole.add_request("x", list(range(5, 60)), greedy(6))
    expected = run(whole)["x"]
    pre, dec = engine(tiny_model), engine(tiny_model)
    pre.add_request("x", list(range(5, 60)), greedy(6))
    first = pre.step()[0].new_token_ids  # the whole prompt in one step: its first token
    kv = pre.transfer.export_kv("x")
    assert all(len(b) == pre.transfer.kv_geometry()[1] for b in kv.blocks)
    pre.abort("x")
    dec.add_request("x", list(range(5, 60)), greedy(6), kv=kv)
    assert first + run(dec)["x"] == expected


def test_metadata_kv_moves_64_bytes_a_block(tiny_model):
    e = engine(tiny_model, kv="metadata")
    assert e.transfer.kv_geometry() == (16, 64)


@pytest.mark.parametrize("params, why", [
    (SamplingParams(max_tokens=4, logprobs=True), "logprobs"),
    (SamplingParams(max_tokens=4, guided=Guided("regex", "a+")), "structured outputs"),
])
def test_what_the_mock_does_not_model_is_refused_clearly(tiny_model, params, why):
    e = engine(tiny_model)
    with pytest.raises(InvalidRequest, match=why):
        e.add_request("x", [1, 2, 3], params)
    with pytest.raises(InvalidRequest, match="adapter_config.json not found"):
        e.adapters.load("a", "/nowhere")
    assert not e.has_unfinished()


def test_an_unknown_profile_names_the_presets(tiny_model):
    with pytest.raises(InvalidRequest, match="h100-llama8b"):
        engine(tiny_model, profile="no-such-profile")


def test_the_mock_engine_core_loads_no_torch(tiny_model):
    code = ("import sys; from services.worker.core import make_engine; from services.config.engine import "
            f"EngineConfig; make_engine(EngineConfig(model_dir={str(tiny_model)!r}, backend='mock'), 1); "
            "import services.worker.__main__; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def adapters(tmp_path, n: int) -> tuple:
    """n PEFT folders holding only their config (the mock reads no weights)."""
    out = []
    for i in range(n):
        folder = tmp_path / f"a{i}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16,
                                                                "target_modules": ["q_proj", "v_proj"]}))
        out.append((f"a{i}", str(folder)))
    return tuple(out)


def test_adapters_take_turns_in_the_slots_and_each_is_read_once(tiny_model, tmp_path):
    """Three adapters' requests on two slots all complete; each adapter is read from storage once (host memory
    holds all three); a batch never holds more adapters than slots; an unknown adapter is refused."""
    e = engine(tiny_model, lora=LoRAConfig(max_loras=2, max_cpu_loras=4, modules=adapters(tmp_path, 3)))
    for i in range(6):
        e.add_request(f"r{i}", list(range(1 + i, 30 + i)), greedy(6), adapter=f"a{i % 3}")
    outs, most = {}, 0
    while e.has_unfinished():
        for o in e.step():
            outs.setdefault(o.req_id, []).extend(o.new_token_ids)
        most = max(most, len({r.adapter for r in e.scheduler.running}))
    assert sorted(outs) == [f"r{i}" for i in range(6)] and all(len(v) == 6 for v in outs.values())
    snap = e.lora.snapshot()
    assert snap.loads == 3 and snap.slot_loads >= 3 and most <= 2
    assert e.load().blocks_used == 0
    with pytest.raises(NotFound, match="nope"):
        e.add_request("x", [1, 2, 3], greedy(2), adapter="nope")


def test_an_adapter_costs_its_read_and_its_copy_into_a_slot(tiny_model, tmp_path):
    """The read takes the model's lora_read_s (scaled) off the steps; the step that admits the adapter's request
    takes lora_slot_s more than the same step without it, and the steps after it the same."""
    preset = PRESETS["h100-llama8b"]
    lora = LoRAConfig(max_loras=2, modules=adapters(tmp_path, 1))
    ta, tb = FakeTime(), FakeTime()
    a, b = engine(tiny_model, ta, scale=2.0, lora=lora), engine(tiny_model, tb, scale=2.0)
    a.add_request("x", list(range(1, 40)), greedy(5), adapter="a0")
    b.add_request("x", list(range(1, 40)), greedy(5))
    assert run(a) == run(b)  # the adapter changes no mock token
    assert ta.slept[0] == pytest.approx(2.0 * preset.lora_read_s)
    steps_a, steps_b = ta.slept[1:], tb.slept
    assert len(steps_a) == len(steps_b)
    assert steps_a[0] - steps_b[0] == pytest.approx(2.0 * preset.lora_slot_s)
    assert steps_a[1:] == pytest.approx(steps_b[1:])
