"""Tool calling: tools and tool_choice checked, tools rendered into the prompt (by the template, or as a Hermes
system prompt), calls parsed out of Qwen2's and SmolLM2's formats, a stream's content released only while no call
may be starting, and the constraints that enforce required and named choice."""

import json

import jsonschema
import pytest

from services.gateway.chat import ChatTemplate
from services.gateway.tools import ToolError, parse_hermes, plan_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def test_qwen2_format_with_two_calls_and_leading_text():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_smollm2_format_a_list_in_one_block():
    text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", ' \
           '"parameters": {"zone": "UTC"}}]</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"zone": "UTC"}


@pytest.mark.parametrize("text", ["no calls here", "<tool_call>{not json</tool_call>", '<tool_call>["x"]</tool_call>',
                                  '<tool_call>{"arguments": {}}</tool_call>'])
def test_output_without_a_parsable_call_is_content(text):
    assert parse_hermes(text) == (text, [])


def test_a_stream_releases_content_only_while_no_call_can_be_starting():
    follow = plan_tools([WEATHER, TIME], "auto").output()
    pieces = ["Sure", ", checking <to", "ol_call>\n{\"name\": \"get_weather\", ",
              "\"arguments\": {\"city\": \"Rome\"}}", "\n</tool_call>"]
    sent = [follow.push(p) for p in pieces]
    assert sent == ["Sure", ", checking ", "", "", ""]
    rest, calls = follow.finish()
    assert rest == "" and calls[0]["function"]["name"] == "get_weather" and follow.finish_reason == "tool_calls"
    plain = plan_tools([WEATHER], "auto").output()
    assert plain.push("a < b") == "a < b" and plain.push(" <") == " " and plain.finish() == ("<", [])
    assert plain.finish_reason is None


def test_required_and_named_choice_are_enforced_by_a_schema():
    required = plan_tools([WEATHER, TIME], "required")
    schema = json.loads(required.guided().spec)
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "x"}}], schema)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "get_weather", "parameters": {"town": "x"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    follow = required.output()
    assert follow.push('[{"name": "get_time", "parameters": {"zone": "x"}}]') == ""
    assert follow.finish()[1][0]["function"] == {"name": "get_time", "arguments": '{"zone": "x"}'}
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.guided().spec) == WEATHER["function"]["parameters"]
    follow = named.output()
    follow.push('{"city": "Lima"}')
    assert follow.finish()[1][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Lima"}'}
    assert follow.finish_reason is None  # as OpenAI: a named function ends with "stop"
    assert plan_tools([WEATHER], "auto").guided() is None and plan_tools([WEATHER], "none").output() is None


@pytest.mark.parametrize("tools,choice,param", [
    ("get_weather", None, "tools"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools"),
    ([{"type": "retrieval"}], None, "tools"),
    ([WEATHER, WEATHER], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "tools"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_name_their_field(tools, choice, param):
    with pytest.raises(ToolError) as e:
        plan_tools(tools, choice)
    assert e.value.param == param


def test_tools_reach_a_template_that_renders_them_and_one_that_does_not():
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    own = ChatTemplate("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                       "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
                       "{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %};{% endfor %}")
    assert own.render(messages, tools=[WEATHER, TIME]) == (
        "[get_weather][get_time]user:weather in Paris?;assistant:get_weather(Paris);tool:18 C;")
    plain = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    text = plain.render(messages, tools=[WEATHER])
    assert text.startswith("<system># Tools") and json.dumps(WEATHER) in text
    assert '<assistant><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool><tool_response>\n18 C\n</tool_response>" in text
    with_system = plain.render([{"role": "system", "content": "Be brief."}] + messages, tools=[WEATHER])
    assert with_system.startswith("<system>Be brief.\n\n# Tools") and with_system.count("<system>") == 1
