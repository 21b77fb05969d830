"""Chat prompts: the model folder's chat template (`chat_template.jinja`, which transformers 5 writes, else
tokenizer_config.json `chat_template`), rendered
with Jinja2 in a sandbox as Hugging Face transformers does (trim_blocks, lstrip_blocks;
`raise_exception` available to templates; bos_token / eos_token from the same file).

Tools (services/gateway/tools.py) go to a template that uses them as its `tools` variable, with assistant
tool calls' arguments as objects (what transformers' templates expect); a template that does not use them gets
them as a Hermes system prompt, assistant calls as <tool_call> blocks and tool results as <tool_response> ones."""

from __future__ import annotations

import json
from pathlib import Path

from services.common.errors import InvalidRequest

ROLES = {"system", "user", "assistant", "developer", "tool"}


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.uses_tools = "tools" in source  # the template renders tools itself (Qwen2's, Llama 3's, ...)

    @staticmethod
    def from_model_dir(model_dir: str | Path) -> ChatTemplate | None:
        """The folder's template, or None when it has none (as transformers reads it: the .jinja file wins)."""
        path, jinja = Path(model_dir) / "tokenizer_config.json", Path(model_dir) / "chat_template.jinja"
        cfg = json.loads(path.read_text()) if path.exists() else {}
        source = jinja.read_text() if jinja.exists() else cfg.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        return ChatTemplate(source, _token(cfg.get("bos_token")), _token(cfg.get("eos_token")))

    def render(self, messages: list, add_generation_prompt: bool = True, tools: list | None = None) -> str:
        from jinja2.exceptions import TemplateError

        messages, extra = normalize(messages), {}
        if tools and self.uses_tools:
            extra["tools"] = tools
        elif tools:
            messages = _hermes_messages(messages, tools)
        else:
            messages = [m if not m.get("tool_calls") else _with_calls_as_text(m) for m in messages]
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except TemplateError as e:
            raise InvalidRequest(f"messages: the model's chat template refused them: {e}") from None


def normalize(messages) -> list[dict]:
    """Messages as {"role", "content": str} (and an assistant's "tool_calls", each {"id", "type", "function": {"name",
    "arguments": object}}; a tool result's "tool_call_id"); text parts of list contents are joined. InvalidRequest
    otherwise."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InvalidRequest(f"messages[{i}] must be an object with a role in {sorted(ROLES)}")
        if "content" not in m:
            raise InvalidRequest(f"messages[{i}].content is required")
        content = m["content"]
        if content is None and m["role"] != "assistant":  # an assistant turn may be null (OpenAI: with tool calls)
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts, not null")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest(f"messages[{i}].content: only text parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts")
        message = {"role": m["role"], "content": content}
        if m["role"] == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _calls(m["tool_calls"], i)
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _calls(calls, i: int) -> list[dict]:
    """An assistant message's tool_calls with their arguments as objects (OpenAI sends them as JSON text)."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"messages[{i}].tool_calls[{j}] must be {{\"function\": {{\"name\", \"arguments\"}}}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise InvalidRequest(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON") from None
        out.append({"id": c.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _with_calls_as_text(m: dict) -> dict:
    blocks = "".join(f"\n<tool_call>\n{json.dumps(c['function'], ensure_ascii=False)}\n</tool_call>"
                     for c in m["tool_calls"])
    return {"role": m["role"], "content": (m["content"] + blocks).strip()}


def _hermes_messages(messages: list[dict], tools: list) -> list[dict]:
    """Messages for a template that does not render tools: the tools as a Hermes system prompt (after the
    request's own system message), calls and results as Hermes blocks."""
    from services.gateway.tools import hermes_system

    system = hermes_system(tools)
    out = []
    if messages[0]["role"] == "system":
        out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + system})
        messages = messages[1:]
    else:
        out.append({"role": "system", "content": system})
    for m in messages:
        if m.get("tool_calls"):
            m = _with_calls_as_text(m)
        elif m["role"] == "tool":
            m = {"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    return out


def _token(value) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...}
        return value.get("content", "")
    return value or ""
