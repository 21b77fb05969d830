"""The request as one frozen value, from the edge to the engine.

ClientRequest is what a client asks (gRPC GenerateRequest or an OpenAI HTTP body, each converted
once at its face); the gateway's orchestrator validates it once, authenticates, admits and turns it
into a RequestSpec: the request as every worker and engine sees it. Each hop converts protobuf to
these once (services/common/convert.py); nothing below the servicers reads protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.common.errors import InvalidRequest
from services.common.sampling import SamplingParams


@dataclass(frozen=True)
class ClientRequest:
    client_id: str  # the client's id, echoed back ("" = make one)
    sampling: SamplingParams  # as the client gave them (validated by the orchestrator)
    text: str | None = None  # the prompt as text, tokenized by the model's tokenizer...
    token_ids: tuple | None = None  # ...or as token ids, used as given (exactly one of the two)
    model: str = ""  # "" = the served model
    adapter: str = ""  # LoRA adapter ("" = base model)
    priority: int = 0  # 0 most urgent; negative: sheddable
    deadline_ms: int = 0  # end-to-end budget from arrival (0 = none; the transport's deadline also applies)
    criticality: str = ""  # critical | standard | sheddable ("" = standard; services.policy.bands)
    slo_ttft_ms: int = 0  # the client's time-to-first-token target (0 = none)
    slo_tpot_ms: int = 0  # and time-per-output-token target (0 = none)


@dataclass(frozen=True)
class RequestSpec:
    request_id: str  # unique in the mesh while the request lives
    prompt_token_ids: tuple  # the prompt, tokenized at the edge
    sampling: SamplingParams  # validated at the edge
    priority: int = 0  # 0 most urgent
    band: int = 1  # services.policy.bands: 0 critical, 1 standard, 2 sheddable
    tenant: str = ""  # who asked ("" = the default tenant)
    weight: float = 1.0  # the tenant's share
    deadline_s: float | None = None  # absolute, on the clock of the process holding the spec (None = none)
    predicted_s: float = 0.0  # predicted service time (the gateway's cost model), for slack
    adapter: str = ""  # LoRA adapter ("" = base model)
    cache_salt: str = ""  # prefix-cache isolation domain
    resumed_outputs: int = 0  # resumed after a worker failed: the prompt ends with this many streamed outputs


CRITICALITY_HEADER = "x-criticality"  # services.policy.bands
SLO_HEADERS = {"x-slo-ttft-ms": "slo_ttft_ms", "x-slo-tpot-ms": "slo_tpot_ms"}  # as llm-d reads them


def with_headers(req: ClientRequest, headers) -> ClientRequest:
    """req with what its headers (HTTP) or metadata (gRPC) say of it where its own fields say nothing: criticality
    (x-criticality) and latency targets (x-slo-ttft-ms, x-slo-tpot-ms; milliseconds, integers >= 0)."""
    changes = {}
    value = headers.get(CRITICALITY_HEADER)
    if value is not None and not req.criticality:
        changes["criticality"] = value
    for header, field in SLO_HEADERS.items():
        value = headers.get(header)
        if value is None or getattr(req, field):
            continue
        try:
            changes[field] = int(value.strip())
        except ValueError:
            raise InvalidRequest(f"header {header} must be an integer number of milliseconds, got {value[:40]!r}") \
                from None
    return replace(req, **changes) if changes else req
