"""What a request to the gateway may be: its sizes (SizeBounds), the served model (ModelInfo), and malformed
messages answered with a clear status (BadMessage, tolerant)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InvalidRequest, NotFound


@dataclass(frozen=True)
class SizeBounds:
    """Sizes checked before any work on a request: tokenizing costs the gateway ~300 bytes of memory per
    input byte (an 8 MiB prompt once stalled every request for 12.8 s at 2.4 GB)."""

    max_prompt_bytes: int  # a text prompt, a chat conversation's rendered text, a Tokenize text

    @staticmethod
    def for_model(max_model_len: int, max_prompt_bytes: int = 0) -> SizeBounds:
        """max_prompt_bytes, or 0 for 32 bytes per token of context (at least 64 KiB)."""
        return SizeBounds(max_prompt_bytes or max(65536, 32 * max_model_len))

    @property
    def max_body_bytes(self) -> int:
        """An HTTP body: the prompt with JSON escapes (up to 6 bytes per byte) and 1 MiB for the rest."""
        return 6 * self.max_prompt_bytes + (1 << 20)


def bounded(text: str, field: str, limit: int) -> str:
    """text, if it is valid Unicode of at most limit UTF-8 bytes (InvalidRequest naming the field otherwise)."""
    if len(text) > limit:  # every character is at least one byte: no need to encode it to know
        raise InvalidRequest(f"{field} is over the limit of {limit} bytes ({len(text)} characters)")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidRequest(f"{field} is not valid Unicode (it holds a lone surrogate)") from None
    if size > limit:
        raise InvalidRequest(f"{field} is {size} bytes, over the limit of {limit} bytes")
    return text


@dataclass(frozen=True)
class ModelInfo:
    names: tuple  # the names requests may use; the first is reported (vLLM's --served-model-name A B ...)
    vocab_size: int
    max_model_len: int  # the model's context; workers also check their KV pool

    @staticmethod
    def from_dir(model_dir: str, served_names=()) -> ModelInfo:
        """Named by served_names, else by the folder's name."""
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        return ModelInfo(tuple(served_names) or (Path(model_dir).name,), int(cfg["vocab_size"]),
                         int(cfg["max_position_embeddings"]))

    @property
    def name(self) -> str:
        return self.names[0]

    def check(self, model: str | None) -> None:
        """NotFound unless model names the served model (empty or None: the served one)."""
        if model and model not in self.names:
            raise NotFound(f"model {model!r} is not served here (serving {self.name!r})")


class BadMessage:
    """What the tolerant deserializer returns for bytes protobuf refuses (e.g. invalid UTF-8 in a string)."""

    def __init__(self, error: str):
        self.error, self.request_id = error, ""


def tolerant(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except Exception as e:  # protobuf's DecodeError: answered as INVALID_ARGUMENT, not INTERNAL
            return BadMessage(f"request is not a valid {message_type.__name__} ({e}); "
                              "string fields must be valid UTF-8")
    return parse
