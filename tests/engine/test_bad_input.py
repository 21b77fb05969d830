"""Every bad input gets a typed error with a clear message, and leaves nothing allocated."""

import pytest

from services.common.errors import InvalidRequest, NotFound, OutOfRange
from services.common.sampling import SamplingParams
from tests.support.reference import make_engine

CASES = [
    ("empty prompt", dict(prompt_token_ids=[]), InvalidRequest, "empty"),
    ("token above vocab", dict(prompt_token_ids=[1, 8192]), InvalidRequest, "[0, 8192)"),
    ("negative token", dict(prompt_token_ids=[-1]), InvalidRequest, "[0, 8192)"),
    ("non-int token", dict(prompt_token_ids=[1.5]), InvalidRequest, "integers"),
    ("max_tokens zero", dict(params=SamplingParams(max_tokens=0)), InvalidRequest, "max_tokens"),
    ("max_tokens negative", dict(params=SamplingParams(max_tokens=-3)), InvalidRequest, "max_tokens"),
    ("temperature negative", dict(params=SamplingParams(temperature=-0.1)), InvalidRequest, "temperature"),
    ("temperature nan", dict(params=SamplingParams(temperature=float("nan"))), InvalidRequest, "temperature"),
    ("top_p zero", dict(params=SamplingParams(top_p=0.0)), InvalidRequest, "top_p"),
    ("top_p above one", dict(params=SamplingParams(top_p=1.5)), InvalidRequest, "top_p"),
    ("top_k negative", dict(params=SamplingParams(top_k=-1)), InvalidRequest, "top_k"),
    ("seed negative", dict(params=SamplingParams(seed=-1)), InvalidRequest, "seed"),
    ("empty stop string", dict(params=SamplingParams(stop=("",))), InvalidRequest, "stop"),
    ("beyond context", dict(params=SamplingParams(max_tokens=2048)), OutOfRange, "exceeds"),
    ("unknown adapter", dict(adapter="sql-lora"), NotFound, "sql-lora"),
    ("both prompt kinds", dict(prompt="hi"), InvalidRequest, "exactly one"),
]


@pytest.mark.parametrize("name,kwargs,error,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_typed_error(tiny_model, name, kwargs, error, fragment):
    engine = make_engine(tiny_model)
    args = {"prompt_token_ids": [1, 2, 3], "params": SamplingParams(max_tokens=4), **kwargs}
    with pytest.raises(error) as exc:
        engine.add_request("bad", args.pop("prompt_token_ids"), args.pop("params"), **args)
    assert fragment in str(exc.value)
    assert engine.load().blocks_used == 0
    assert not engine.has_unfinished()


def test_prompt_plus_output_beyond_the_kv_pool_is_out_of_range(tiny_model):
    engine = make_engine(tiny_model, num_blocks=4, block_size=16)
    with pytest.raises(OutOfRange, match="KV pool"):
        engine.add_request("big", list(range(3, 60)), SamplingParams(max_tokens=10))


def test_duplicate_request_id_is_rejected(tiny_model):
    engine = make_engine(tiny_model)
    engine.add_request("same", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request("same", [1, 2], SamplingParams(max_tokens=2))


def test_abort_frees_blocks_at_once(tiny_model):
    engine = make_engine(tiny_model, budget=8)
    engine.add_request("long", list(range(3, 100)), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.load().blocks_used > 0
    assert engine.abort("long")
    assert engine.load().blocks_used == 0
    assert not engine.abort("long")
    engine.kv.check_integrity()


def test_text_prompt_and_stop_strings(tiny_model):
    engine = make_engine(tiny_model)
    probe = engine.add_request("probe", prompt="Kalo mine rusa.", params=SamplingParams(max_tokens=12, temperature=0,
                                                                                   ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    text = engine.output_text(probe)
    assert probe.prompt_token_ids[0] == 1  # the tokenizer's post-processor adds BOS
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    req = engine.add_request("stopper", prompt="Kalo mine rusa.",
                             params=SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,)))
    while engine.has_unfinished():
        engine.step()
    assert req.finish_reason == "stop"
    assert stop not in engine.output_text(req)
    assert text.startswith(engine.output_text(req))


def test_malformed_imported_kv_is_rejected_and_frees_everything(tiny_model):
    source, target = make_engine(tiny_model), make_engine(tiny_model)
    req = source.add_request("m", list(range(3, 40)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    while req.num_output < 1:
        source.step()
    good = source.transfer.export_kv("m")
    for broken, fragment in ((dict(blocks=good.blocks[:-1]), "blocks for"),
                             (dict(blocks=[b[:-4] for b in good.blocks]), "malformed"),
                             (dict(token_ids=[7] + good.token_ids[1:]), "different prompt")):
        bad = type(good)(**{**good.__dict__, **broken})
        with pytest.raises(InvalidRequest, match=fragment):
            target.add_request("m", list(range(3, 40)), SamplingParams(max_tokens=8), kv=bad)
        assert target.load().blocks_used == 0
        target.kv.check_integrity()
