"""OpenAI request bodies as pydantic models: the HTTP front's one validation of a body.

Types are strict where a client's mistake would otherwise pass silently (a string for a boolean,
a boolean for a number). Fields that would change the result and that this server cannot honour
(penalties, logit_bias, tools, ...) are accepted only at their neutral value. Fields a
client may send and that change nothing here (user, ...) are allowed and ignored. A 400 names the
field from the validation error's location (OpenAIBodyError.param), never from message text.
"""

from __future__ import annotations

import json
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

from services.common.errors import InvalidRequest
from services.common.sampling import MAX_TOP_LOGPROBS, Guided, SamplingParams
from services.gateway.tools import ToolError, ToolPlan, plan_tools

Number = StrictInt | StrictFloat  # an int is a fine float; a bool is not
INT64 = 2**63  # every integer travels as a protobuf int64 (JSON allows any size: 400, not a 500 further on)
MAX_N = 16  # choices per prompt (n)
NonNegInt = Annotated[StrictInt, Field(ge=0, lt=INT64)]
PositiveInt = Annotated[StrictInt, Field(gt=0, lt=INT64)]

# Fields that change the result, and the values we can honour (anything else: 400 naming the field).
HONOURED_ONLY = {
    "best_of": lambda v: v == 1, "suffix": lambda v: v == "",
    "presence_penalty": lambda v: v == 0, "frequency_penalty": lambda v: v == 0, "repetition_penalty": lambda v: v == 1,
    "logit_bias": lambda v: v == {}, "functions": lambda v: v == [], "function_call": lambda v: v == "none",
    "use_beam_search": lambda v: v is False, "prompt_logprobs": lambda v: False,
}
# The constraint fields (structured outputs), as OpenAI and vLLM name them: at most one per request.
GUIDED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar")


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


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict | StrictBool = Field(alias="schema", default=True)
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object (any JSON object) or json_schema (the output validates)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs object: exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="allow")
    json_: dict | StrictBool | StrictStr | None = Field(alias="json", default=None)
    regex: Annotated[StrictStr, Field(min_length=1)] | None = None
    choice: Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: Annotated[StrictStr, Field(min_length=1)] | None = None
    json_object: StrictBool | None = None


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
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    best_of: Any = None
    suffix: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | StrictBool | StrictStr | None = None
    guided_regex: Annotated[StrictStr, Field(min_length=1)] | None = None
    guided_choice: Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1)] | None = None
    guided_grammar: Annotated[StrictStr, Field(min_length=1)] | None = None
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

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    def constraint(self) -> Guided | None:
        """What the output must follow: the body's structured-output field (chat: or its tool choice)."""
        return self.guided()

    def guided(self) -> Guided | None:
        """The one constraint the body sets (structured outputs), checked, or None; two at once is a 400."""
        given = [name for name in GUIDED_FIELDS if getattr(self, name) is not None
                 and not (name == "response_format" and self.response_format.type == "text")]
        if len(given) > 1:
            raise OpenAIBodyError(given[1], f"{given[0]} and {given[1]} both constrain the output: give one")
        if not given:
            return None
        guided = self._guided(given[0])
        try:
            guided.validate()
        except InvalidRequest as e:
            raise OpenAIBodyError(given[0], f"{given[0]}: {e}") from None
        return guided

    def _guided(self, name: str) -> Guided:
        value = getattr(self, name)
        if name == "response_format":
            if value.type == "json_object":
                return Guided("json_object")
            if value.json_schema is None:
                raise OpenAIBodyError(name, "response_format json_schema needs its json_schema object")
            return Guided("json", _schema_text(value.json_schema.schema_, name))
        if name == "structured_outputs":
            kinds = {k: v for k, v in (("json", value.json_), ("regex", value.regex), ("choice", value.choice),
                                       ("grammar", value.grammar)) if v is not None}
            if value.json_object:
                kinds["json_object"] = True
            if len(kinds) != 1:
                raise OpenAIBodyError(name, "structured_outputs must set exactly one of json, regex, choice, "
                                            f"grammar, json_object (got {sorted(kinds) or 'none'})")
            (kind, value), = kinds.items()
        else:
            kind = name.removeprefix("guided_")
        if kind == "json_object":
            return Guided("json_object")
        if kind == "json":
            return Guided("json", _schema_text(value, name))
        if kind == "choice":
            return Guided("choice", json.dumps(value))
        return Guided(kind, value)

    def sampling(self, max_tokens: int, logprobs: bool, top_logprobs: int = 0, seed: int | None = None
                 ) -> SamplingParams:
        """The validated body's sampling parameters (max_tokens resolved by the caller; seed: this choice's)."""
        if self.min_tokens is not None and self.min_tokens > max_tokens:
            raise OpenAIBodyError("min_tokens", f"min_tokens ({self.min_tokens}) must be at most the {max_tokens} "
                                                "tokens this request may generate")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, stop=tuple(stop),
                                stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=bool(self.ignore_eos),
                                top_logprobs=top_logprobs, guided=self.constraint(), seed=seed,
                                **{k: v for k in ("temperature", "top_p", "top_k", "min_p", "min_tokens")
                                   if (v := getattr(self, k)) is not None})
        return params

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice index (n > 1): seed + index, as vLLM's (None: each draws its own)."""
        return None if self.seed is None else (self.seed + index) % INT64


TokenIds = list[NonNegInt]


class CompletionBody(_Body):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # the sampled token's and k more
    echo: StrictBool | None = None
    tools: Any = None
    tool_choice: Any = None

    @field_validator("tools", "tool_choice")
    @classmethod
    def _chat_only(cls, v, info: ValidationInfo):
        if v is not None:
            raise ValueError(f"{info.field_name} is for /v1/chat/completions")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v, info: ValidationInfo):
        if v and info.data.get("logprobs") is not None:
            raise ValueError("echo with logprobs needs the prompt's logprobs, which this server does not compute")
        return v

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids(cls, v):
        """A negative token id named as such (the union's own message blames the first member: "prompt.str")."""
        if isinstance(v, list):
            rows = [(f"prompt[{i}]", p) for i, p in enumerate(v)] if any(isinstance(p, list) for p in v) else [
                ("prompt", v)]
            for where, row in rows:
                for j, t in enumerate(row if isinstance(row, list) else ()):
                    if isinstance(t, int) and not isinstance(t, bool) and t < 0:
                        raise ValueError(f"token ids are >= 0; {where}[{j}] is {t}")
        return v

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

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or 0


class ChatBody(_Body):
    messages: list
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    max_completion_tokens: PositiveInt | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None  # several calls may come in one response either way

    def tool_plan(self) -> ToolPlan | None:
        """tools and tool_choice, checked (a 400 naming the field)."""
        try:
            return plan_tools(self.tools, self.tool_choice)
        except ToolError as e:
            raise OpenAIBodyError(e.param, f"{e.param}: {e}") from None

    def constraint(self) -> Guided | None:
        guided, plan = self.guided(), self.tool_plan()
        forced = plan.guided() if plan else None
        if forced and guided:
            raise OpenAIBodyError("tool_choice", f"tool_choice {plan.mode} constrains the output, and so does a "
                                                 "structured-output field: give one")
        return forced or guided

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @property
    def want_logprobs(self) -> bool:
        return bool(self.logprobs)

    @property
    def num_top_logprobs(self) -> int:
        return self.top_logprobs or 0


def _schema_text(schema, field: str) -> str:
    """A schema given as an object, a boolean, or JSON text, as JSON text (a 400 naming field when it is none)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise OpenAIBodyError(field, f"{field}: the schema is not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise OpenAIBodyError(field, f"{field}: a JSON Schema must be an object")
    return json.dumps(schema)


def parse_body(body: dict, chat: bool) -> CompletionBody | ChatBody:
    try:
        parsed = (ChatBody if chat else CompletionBody).model_validate(body)
    except ValidationError as e:
        raise OpenAIBodyError.of(e) from None
    parsed.constraint()  # a constraint that is malformed (not one that does not compile: the engine says that)
    return parsed
