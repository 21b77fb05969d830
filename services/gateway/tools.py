"""Tool calling on the chat endpoint: tools into the prompt, tool calls out of the output.

Tools reach the model through its chat template (the `tools` variable, as transformers passes them); a template
that does not use them (SmolLM2-135M's, the tiny test model's) gets them in a system message in the Hermes
format that Qwen2's template writes and SmolLM2's tool-trained models read. tool_choice decides the rest:

- "none": no tools in the prompt; the output is text.
- "auto" (the default when tools are given): the model's output is parsed by its family's parser (PARSERS);
  calls found become message.tool_calls, with finish_reason "tool_calls"; text before them stays content.
- "required": the output is constrained by the grammar engine to a JSON array of calls, each
  {"name": one of the tools, "parameters": that tool's schema}, as vLLM does; finish_reason "tool_calls".
- {"type": "function", "function": {"name": N}}: the output is constrained to N's parameters schema, and is
  the call's arguments; finish_reason "stop" (as OpenAI's).

Parsers ("hermes", the default): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2,
Hermes), or a JSON list of such objects inside one block (SmolLM2's format); "parameters" is read as
"arguments". ToolOutput follows a choice's text as it streams: content is released until a block may be
starting, and the calls come at the end.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from services.common.errors import InvalidRequest
from services.common.sampling import Guided

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


class ToolError(InvalidRequest):
    """A bad tools or tool_choice field: param names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: tuple  # the request's tools, each {"type": "function", "function": {name, description?, parameters?}}
    name: str = ""  # the named function (mode named)

    @property
    def prompt_tools(self) -> list | None:
        """What the chat template gets as `tools` (None: no tools in the prompt)."""
        return None if self.mode == "none" else list(self.tools)

    def guided(self) -> Guided | None:
        """The constraint that enforces required / named choice (None for auto and none)."""
        if self.mode == "named":
            return Guided("json", json.dumps(_parameters(self._function(self.name))))
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       "parameters": _parameters(t["function"])},
                      "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            return Guided("json", json.dumps({"type": "array", "minItems": 1, "items": {"anyOf": calls}}))
        return None

    def _function(self, name: str) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)

    def output(self) -> ToolOutput | None:
        """A fresh follower of one choice's output (None: the output is plain text)."""
        return None if self.mode == "none" else ToolOutput(self)


def plan_tools(tools, tool_choice) -> ToolPlan | None:
    """The request's tools and tool_choice, checked (ToolError naming the field); None when no tools are given."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", f"tool_choice {tool_choice!r} needs tools")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools", "tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not NAME.match(fn["name"]):
            raise ToolError("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                                     "with a name of 1-64 letters, digits, _ . -")
        if not isinstance(fn.get("parameters", {}), (dict, bool)):
            raise ToolError("tools", f"tools[{i}].function.parameters must be a JSON Schema object")
        if fn["name"] in names:
            raise ToolError("tools", f"tools[{i}]: two tools are named {fn['name']!r}")
        names.append(fn["name"])
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return ToolPlan(tool_choice or "auto", tuple(tools))
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
        else None
    if not isinstance(fn, dict) or fn.get("name") not in names:
        raise ToolError("tool_choice", "tool_choice must be none, auto, required or {\"type\": \"function\", "
                                       f"\"function\": {{\"name\": N}}}} with N one of the tools ({', '.join(names)})")
    return ToolPlan("named", tuple(tools), fn["name"])


def _parameters(fn: dict):
    return fn.get("parameters", {"type": "object", "properties": {}})


def hermes_system(tools: list) -> str:
    """The tools as the Hermes system prompt (one function signature per line)."""
    return HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def tool_call(name: str, arguments) -> dict:
    """One call as OpenAI writes it (arguments as JSON text)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def parse_hermes(text: str) -> tuple[str, list]:
    """(content, calls) of a model's output: calls from its <tool_call> blocks, content the text before the first
    (as it is: a stream sent it so); an output whose blocks do not parse is all content."""
    first = text.find(OPEN)
    if first < 0:
        return text, []
    calls = []
    for block in re.findall(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", text[first:], re.S):
        try:
            value = json.loads(block.strip())
        except json.JSONDecodeError:
            return text, []
        for call in value if isinstance(value, list) else [value]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, []
            calls.append(tool_call(call["name"], call.get("arguments", call.get("parameters", {}))))
    return text[:first], calls


PARSERS = {"hermes": parse_hermes}


@dataclass
class ToolOutput:
    """One choice's output under a tool plan: push() the text as it streams, get the content that is safe to send;
    finish() gives the rest of the content and the calls."""

    plan: ToolPlan
    held: str = ""  # text not released as content yet
    released: bool = False  # content was already sent (a stream)
    calls: list = field(default_factory=list)

    def push(self, text: str) -> str:
        """Content to send now (auto: everything before a block that may be starting; required / named: none)."""
        self.held += text
        if self.plan.mode != "auto" or OPEN in self.held:
            return ""
        keep = next((k for k in range(min(len(OPEN), len(self.held)), 0, -1) if OPEN.startswith(self.held[-k:])), 0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        self.released = self.released or bool(out)
        return out

    def finish(self) -> tuple[str, list]:
        """(content not yet sent, calls) once the output is complete."""
        text, self.held = self.held, ""
        if self.plan.mode == "named":
            self.calls = [tool_call(self.plan.name, text)]
            return "", self.calls
        if self.plan.mode == "required":
            try:
                value = json.loads(text)
            except json.JSONDecodeError:  # cut short by max_tokens: what there is, as content
                return text, []
            self.calls = [tool_call(c["name"], c["parameters"]) for c in value]
            return "", self.calls
        content, self.calls = PARSERS["hermes"](text)
        return content, self.calls

    @property
    def finish_reason(self) -> str | None:
        """tool_calls when calls were made (named choice: stop, as OpenAI's), else the output's own."""
        return "tool_calls" if self.calls and self.plan.mode != "named" else None
