"""Chat prompts: the model folder's chat template (`chat_template.jinja`, which transformers 5 writes, else
tokenizer_config.json `chat_template`), rendered
with Jinja2 in a sandbox as Hugging Face transformers does (trim_blocks, lstrip_blocks;
`raise_exception` available to templates; bos_token / eos_token from the same file)."""

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

    def render(self, messages: list, add_generation_prompt: bool = True) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self.template.render(messages=normalize(messages), add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as e:
            raise InvalidRequest(f"messages: the model's chat template refused them: {e}") from None


def normalize(messages) -> list[dict]:
    """Messages as {"role", "content": str}; text parts of list contents are joined. InvalidRequest otherwise."""
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
        out.append({"role": m["role"], "content": content})
    return out


def _token(value) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...}
        return value.get("content", "")
    return value or ""
