"""The request as one frozen value, from the edge to the engine.

ClientRequest is what a client asks (gRPC GenerateRequest or an OpenAI HTTP body, each converted
once at its face); the gateway's orchestrator validates it once, authenticates, admits and turns it
into a RequestSpec: the request as every worker and engine sees it. Each hop converts protobuf to
these once (services/common/convert.py); nothing below the servicers reads protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.sampling import SamplingParams


@dataclass(frozen=True)
class ClientRequest:
    client_id: str  # the client's id, echoed back ("" = make one)
    sampling: SamplingParams  # as the client gave them (validated by the orchestrator)
    text: str | None = None  # the prompt as text, tokenized by the model's tokenizer...
    token_ids: tuple | None = None  # ...or as token ids, used as given (exactly one of the two)
    model: str = ""  # "" = the served model
    adapter: str = ""  # LoRA adapter ("" = base model)
    priority: int = 0  # 0 most urgent
    deadline_ms: int = 0  # end-to-end budget from arrival (0 = none; the transport's deadline also applies)


@dataclass(frozen=True)
class RequestSpec:
    request_id: str  # unique in the mesh while the request lives
    prompt_token_ids: tuple  # the prompt, tokenized at the edge
    sampling: SamplingParams  # validated at the edge
    priority: int = 0  # 0 most urgent
    tenant: str = ""  # who asked ("" = the default tenant)
    weight: float = 1.0  # the tenant's share
    deadline_s: float | None = None  # absolute, on the clock of the process holding the spec (None = none)
    predicted_s: float = 0.0  # predicted service time (the gateway's cost model), for slack
    adapter: str = ""  # LoRA adapter ("" = base model)
    cache_salt: str = ""  # prefix-cache isolation domain
    resumed_outputs: int = 0  # resumed after a worker failed: the prompt ends with this many streamed outputs
