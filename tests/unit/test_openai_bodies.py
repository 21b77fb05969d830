"""OpenAI request bodies: every 400 names the field the validator rejected."""

import pytest

from services.gateway.openai_models import OpenAIBodyError, parse_body

OK = {"model": "tiny", "prompt": "hi", "max_tokens": 4}


@pytest.mark.parametrize("extra,param", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"seed": -1}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "4"}, "max_tokens"),
    ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": "no"}}, "stream_options"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"priority": 1.5}, "priority"),
    ({"criticality": "urgent"}, "criticality"),
    ({"slo_ttft_ms": -1}, "slo_ttft_ms"),
    ({"slo_tpot_ms": "fast"}, "slo_tpot_ms"),
    ({"deadline_ms": 1.5}, "deadline_ms"),
    ({"n": 2}, "n"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logprobs": 5}, "logprobs"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": {"text": "hi"}}, "prompt"),
])
def test_the_400_names_the_field(extra, param):
    with pytest.raises(OpenAIBodyError) as e:
        parse_body({**OK, **extra}, chat=False)
    assert e.value.param == param and param in str(e.value)


def test_neutral_values_and_unknown_harmless_fields_pass():
    b = parse_body({**OK, "n": 1, "echo": False, "presence_penalty": 0, "user": "u1", "x_trace": 1,
                    "temperature": 0, "top_p": 1, "stop": "."}, chat=False)
    p = b.sampling(4, b.want_logprobs)
    assert (p.temperature, p.stop, p.max_tokens, p.logprobs) == (0, (".",), 4, False)
    assert b.prompts() == ["hi"]
    assert parse_body({**OK, "prompt": [[1, 2], [3]]}, chat=False).prompts() == [[1, 2], [3]]
    assert parse_body({**OK, "prompt": [1, 2]}, chat=False).prompts() == [[1, 2]]


def test_chat_body():
    b = parse_body({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3, "logprobs": True},
                   chat=True)
    assert b.want_logprobs and b.max_completion_tokens == 3
    with pytest.raises(OpenAIBodyError) as e:
        parse_body({"max_tokens": 3}, chat=True)
    assert e.value.param == "messages"
    with pytest.raises(OpenAIBodyError) as e:
        parse_body({"messages": [], "logprobs": 1}, chat=True)
    assert e.value.param == "logprobs"


def test_min_tokens_beyond_the_resolved_output_length_names_min_tokens():
    b = parse_body({"prompt": "hi", "min_tokens": 20}, chat=False)
    with pytest.raises(OpenAIBodyError) as e:
        b.sampling(16, False)  # no max_tokens given: the default 16
    assert e.value.param == "min_tokens"


def test_queued_responses_of_one_choice_merge_into_one_event():
    """A stream that fell behind catches up in one SSE event per choice; order, errors and ends are kept."""
    from services.common.pb import meshserve_pb2 as pb
    from services.gateway.http import _merged

    def r(ids, text, reason=""):
        return pb.GenerateResponse(token_ids=ids, logprobs=[-0.5] * len(ids), text=text, finish_reason=reason)

    items = [(0, r([1], "a")), (0, r([2, 3], "bc")), (1, r([7], "x")), (0, r([4], "d", "length")), (0, r([9], "z")),
             (0, None)]
    out = _merged(items)
    assert [(i, list(m.token_ids), m.text, m.finish_reason) if m is not None else (i, None) for i, m in out] == [
        (0, [1, 2, 3], "abc", ""), (1, [7], "x", ""), (0, [4], "d", "length"), (0, [9], "z", ""), (0, None)]
    assert list(out[0][1].logprobs) == [-0.5] * 3
