"""OpenAI request bodies as pydantic models: the HTTP front's one validation of a body.

Types are strict where a client's mistake would otherwise pass silently (a string for a boolean,
a boolean for a number). Fields that would change the result and that this server cannot honour
(n > 1, penalties, tools, guided decoding, ...) are accepted only at their neutral value. Fields a
client may send and that change nothing here (user, ...) are allowed and ignored. A 400 names the
field from the validation error's location (OpenAIBodyError.param), never from message text.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from services.common.sampling import SamplingParams

Number = StrictInt | StrictFloat  # an int is a fine float; a bool is not
INT64 = 2**63  # every integer travels as a protobuf int64 (JSON allows any size: 400, not a 500 further on)
NonNegInt = Annotated[StrictInt, Field(ge=0, lt=INT64)]
PositiveInt = Annotated[StrictInt, Field(gt=0, lt=INT64)]

# Fields that change the result, and the values we can honour (anything else: 400 naming the field).
HONOURED_ONLY = {
    "n": lambda v: v == 1, "best_of": lambda v: v == 1, "echo": lambda v: v is False, "suffix": lambda v: v == "",
    "presence_penalty": lambda v: v == 0, "frequency_penalty": lambda v: v == 0, "repetition_penalty": lambda v: v == 1,
    "logit_bias": lambda v: v == {}, "tools": lambda v: v == [], "functions": lambda v: v == [],
    "tool_choice": lambda v: v == "none", "function_call": lambda v: v == "none",
    "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text",
    "top_logprobs": lambda v: v in (0, 1), "guided_json": lambda v: False,
    "guided_regex": lambda v: False, "guided_choice": lambda v: False, "guided_grammar": lambda v: False,
    "use_beam_search": lambda v: v is False, "prompt_logprobs": lambda v: False,
}


class OpenAIBodyError(ValueError):
    """A body that does not validate: the first failing field (param) and a message naming it."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param

    @staticmethod
    def of(e: ValidationError) -> OpenAIBodyError:
        err = e.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        where = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        return OpenAIBodyError(param, f"{where}: {msg}" if where else msg)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool | None = None


class _Body(BaseModel):
    """The fields both endpoints share. None means absent (the server's default)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[Number, Field(ge=0)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: NonNegInt | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    seed: NonNegInt | None = None
    stop: Annotated[StrictStr, Field(min_length=1)] | list[Annotated[StrictStr, Field(min_length=1)]] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: StrictBool | None = None
    min_tokens: NonNegInt | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    priority: Annotated[StrictInt, Field(gt=-INT64, lt=INT64)] | None = None  # meshserve's: 0 most urgent,
    # negative sheddable
    deadline_ms: NonNegInt | None = None  # meshserve's: end-to-end budget (0 = none)
    criticality: Literal["critical", "standard", "sheddable"] | None = None  # meshserve's (services.policy.bands)
    slo_ttft_ms: NonNegInt | None = None  # meshserve's, as llm-d's x-slo-ttft-ms header: time to first token target
    slo_tpot_ms: NonNegInt | None = None  # ... and time per output token
    user: StrictStr | None = None
    n: Any = None
    best_of: Any = None
    echo: Any = None
    suffix: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    response_format: Any = None
    top_logprobs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    use_beam_search: Any = None
    prompt_logprobs: Any = None

    @field_validator(*HONOURED_ONLY)
    @classmethod
    def _honoured(cls, v, info: ValidationInfo):
        if v is not None and not HONOURED_ONLY[info.field_name](v):
            raise ValueError(f"{info.field_name}={v!r} is not supported by this server")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v, info: ValidationInfo):
        mt = info.data.get("max_tokens")
        if v is not None and mt is not None and v > mt:
            raise ValueError(f"min_tokens ({v}) must be at most max_tokens ({mt})")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int, logprobs: bool) -> SamplingParams:
        """The validated body's sampling parameters (max_tokens resolved by the caller)."""
        if self.min_tokens is not None and self.min_tokens > max_tokens:
            raise OpenAIBodyError("min_tokens", f"min_tokens ({self.min_tokens}) must be at most the {max_tokens} "
                                                "tokens this request may generate")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, stop=tuple(stop),
                             stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=bool(self.ignore_eos),
                             **{k: v for k in ("temperature", "top_p", "top_k", "min_p", "seed", "min_tokens")
                                if (v := getattr(self, k)) is not None})


TokenIds = list[NonNegInt]


class CompletionBody(_Body):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    logprobs: Annotated[StrictInt, Field(ge=0, le=1)] | None = None  # the sampled token's only

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of such lists")
        return v

    def prompts(self) -> list:
        """One prompt per choice: text or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    @property
    def want_logprobs(self) -> bool:
        return self.logprobs is not None


class ChatBody(_Body):
    messages: list
    logprobs: StrictBool | None = None
    max_completion_tokens: PositiveInt | None = None

    @property
    def want_logprobs(self) -> bool:
        return bool(self.logprobs)


def parse_body(body: dict, chat: bool) -> CompletionBody | ChatBody:
    try:
        return (ChatBody if chat else CompletionBody).model_validate(body)
    except ValidationError as e:
        raise OpenAIBodyError.of(e) from None
