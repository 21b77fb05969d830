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
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"n": True}, "n"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"logprobs": 21}, "logprobs"),
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"echo": "yes"}, "echo"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
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


def test_guided_fields_become_one_constraint():
    cases = [
        ({"response_format": {"type": "json_object"}}, ("json_object", "")),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                                                                     "schema": {"type": "integer"}}}},
         ("json", '{"type": "integer"}')),
        ({"guided_json": {"type": "string"}}, ("json", '{"type": "string"}')),
        ({"guided_json": '{"type": "string"}'}, ("json", '{"type": "string"}')),
        ({"guided_regex": "[0-9]+"}, ("regex", "[0-9]+")),
        ({"guided_choice": ["a", "b"]}, ("choice", '["a", "b"]')),
        ({"guided_grammar": 'root ::= "x"'}, ("grammar", 'root ::= "x"')),
        ({"structured_outputs": {"choice": ["y"]}}, ("choice", '["y"]')),
        ({"structured_outputs": {"json_object": True}}, ("json_object", "")),
        ({"response_format": {"type": "text"}}, None),
    ]
    for extra, want in cases:
        b = parse_body({**OK, **extra}, chat=False)
        g = b.sampling(4, False).guided
        assert (g.kind, g.spec) == want if want else g is None, extra


def test_n_choices_take_consecutive_seeds_and_top_logprobs():
    b = parse_body({**OK, "n": 3, "seed": 10, "logprobs": 4, "echo": False}, chat=False)
    assert b.choices_per_prompt == 3 and [b.choice_seed(j) for j in range(3)] == [10, 11, 12]
    assert b.sampling(4, b.want_logprobs, b.num_top_logprobs, b.choice_seed(1)).top_logprobs == 4
    assert parse_body({**OK, "n": 2}, chat=False).choice_seed(1) is None
    chat = parse_body({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3},
                      chat=True)
    assert chat.num_top_logprobs == 3
    with pytest.raises(OpenAIBodyError) as e:
        parse_body({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, chat=True)
    assert e.value.param == "top_logprobs"


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


@pytest.mark.parametrize("prompt,where", [([1, -2], "prompt[1] is -2"), ([[1], [3, 4, -7]], "prompt[1][2] is -7")])
def test_a_negative_token_id_is_named_as_such(prompt, where):
    with pytest.raises(OpenAIBodyError) as e:
        parse_body({"model": "tiny", "prompt": prompt, "max_tokens": 4}, chat=False)
    assert e.value.param == "prompt" and str(e.value) == f"prompt: token ids are >= 0; {where}"
