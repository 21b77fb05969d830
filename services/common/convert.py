"""Protobuf <-> domain conversions used by servicers and clients (the only users of generated types)."""

from __future__ import annotations

import time

from services.common.errors import InvalidRequest
from services.common.pb import meshserve_pb2 as pb
from services.common.request import ClientRequest, RequestSpec
from services.common.sampling import Guided, SamplingParams, guided_from


def utf8(raw: bytes, field: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"field {field!r} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def sampling_from_pb(s: pb.Sampling) -> SamplingParams:
    """Validated SamplingParams (InvalidRequest on any bad value)."""
    params = SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0, top_k=s.top_k, min_p=s.min_p,
        seed=s.seed if s.HasField("seed") else None, stop=tuple(utf8(b, "stop") for b in s.stop),
        stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos, logprobs=s.logprobs, min_tokens=s.min_tokens,
        top_logprobs=s.top_logprobs,
        guided=Guided(s.guided.kind, utf8(s.guided.spec, "guided.spec")) if s.HasField("guided") else None)
    params.validate()
    return params


def sampling_to_pb(p: SamplingParams) -> pb.Sampling:
    s = pb.Sampling(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                    stop=[x.encode() for x in p.stop], stop_token_ids=list(p.stop_token_ids),
                    ignore_eos=p.ignore_eos, logprobs=p.logprobs, min_tokens=p.min_tokens, top_logprobs=p.top_logprobs)
    if p.seed is not None:
        s.seed = p.seed
    if p.guided is not None:
        s.guided.kind, s.guided.spec = p.guided.kind, p.guided.spec.encode()
    return s


def top_logprobs_to_pb(tops: list | None) -> list:
    """[(token ids, logprobs) per token] as TopLogprobs messages ([] when none were asked)."""
    return [pb.TopLogprobs(token_ids=ids, logprobs=lps) for ids, lps in tops or ()]


# A heartbeat (pb.WorkerLoad) field -> the router's WorkerView attribute, both ways, in one place.
LOAD_FIELDS = {"worker_id": "worker_id", "address": "address", "role": "role",
               "outstanding_tokens": "outstanding_tokens", "kv_capacity_tokens": "capacity_tokens",
               "running": "running", "waiting": "waiting", "adapters": "adapters", "block_size": "block_size",
               "index_member": "index_member", "decode_tokens_per_s": "decode_tps", "max_num_seqs": "max_num_seqs",
               "prefill_s_per_token": "prefill_s_per_token", "decode_s_per_step": "decode_s_per_step",
               "host": "host", "kv_pool": "kv_pool", "host_adapters": "host_adapters", "lora_slots": "lora_slots",
               "free_lora_slots": "free_lora_slots", "known_adapters": "known_adapters",
               "pinned_adapters": "pinned_adapters", "topology": "topology", "decode_s_floor": "decode_s_floor",
               "tensor_parallel_size": "tensor_parallel_size", "cores": "cores",
               "max_num_batched_tokens": "max_num_batched_tokens", "longest_step_s": "longest_step_s"}
ADAPTER_FIELDS = ("adapters", "host_adapters", "known_adapters", "pinned_adapters")  # repeated: tuples in the view


def load_from_pb(msg: pb.WorkerLoad) -> dict:
    """A heartbeat as WorkerView attributes (block size 16 when the worker sent none)."""
    out = {view: getattr(msg, field) for field, view in LOAD_FIELDS.items()}
    for name in ADAPTER_FIELDS:
        out[name] = tuple(out[name])
    out["block_size"] = out["block_size"] or 16
    return out


def load_to_pb(view) -> pb.WorkerLoad:
    """A WorkerView as the WorkerLoad that ListWorkers reports."""
    return pb.WorkerLoad(**{field: getattr(view, attr) for field, attr in LOAD_FIELDS.items()})


def spec_from_work(msg: pb.WorkRequest, clock=time.monotonic) -> RequestSpec:
    """A worker's RequestSpec: the gateway's wall-clock deadline moved onto this process's clock."""
    deadline_s = None
    if msg.deadline_unix_ms:
        deadline_s = clock() + msg.deadline_unix_ms / 1000 - time.time()
    return RequestSpec(msg.request_id, tuple(msg.prompt_token_ids), sampling_from_pb(msg.sampling),
                       priority=msg.priority, tenant=msg.tenant, weight=msg.weight or 1.0, deadline_s=deadline_s,
                       predicted_s=msg.predicted_s, adapter=msg.adapter, cache_salt=msg.cache_salt,
                       resumed_outputs=msg.resumed_outputs, band=msg.band)


def work_from_spec(spec: RequestSpec, transfer_id: str, kvstore: str, clock=time.monotonic) -> pb.WorkRequest:
    """The WorkRequest a gateway sends (deadline_s on its clock -> wall-clock milliseconds)."""
    deadline = int((time.time() + spec.deadline_s - clock()) * 1000) if spec.deadline_s is not None else 0
    return pb.WorkRequest(request_id=spec.request_id, prompt_token_ids=spec.prompt_token_ids,
                          sampling=sampling_to_pb(spec.sampling), priority=spec.priority, transfer_id=transfer_id,
                          kvstore=kvstore, adapter=spec.adapter, cache_salt=spec.cache_salt, tenant=spec.tenant,
                          weight=spec.weight, predicted_s=spec.predicted_s, deadline_unix_ms=deadline,
                          resumed_outputs=spec.resumed_outputs, band=spec.band)


def client_request_from_pb(msg: pb.GenerateRequest) -> ClientRequest:
    """The public API's request as a ClientRequest (sampling validated; text checked as UTF-8)."""
    if not msg.HasField("sampling"):
        raise InvalidRequest("sampling is required (at least sampling.max_tokens)")
    kind = msg.WhichOneof("prompt")
    return ClientRequest(client_id=msg.request_id, sampling=sampling_from_pb(msg.sampling),
                         text=utf8(msg.text, "text") if kind == "text" else None,
                         token_ids=tuple(msg.token_ids.ids) if kind == "token_ids" else None, model=msg.model,
                         adapter=msg.adapter, priority=msg.priority, deadline_ms=msg.deadline_ms,
                         criticality=msg.criticality, slo_ttft_ms=msg.slo_ttft_ms, slo_tpot_ms=msg.slo_tpot_ms)


def request_from_line(obj: dict) -> pb.GenerateRequest:
    """A JSONL line (docs/INTERFACES.md) as a GenerateRequest: what `meshserve client` and the benchmarks send."""
    s = pb.Sampling(max_tokens=int(obj.get("max_tokens", 16)), top_k=int(obj.get("top_k", 0)),
                    ignore_eos=bool(obj.get("ignore_eos", False)), logprobs=bool(obj.get("logprobs", False)),
                    min_tokens=int(obj.get("min_tokens") or 0), top_logprobs=int(obj.get("top_logprobs") or 0),
                    stop_token_ids=obj.get("stop_token_ids") or [])
    stop = obj.get("stop") or []
    s.stop.extend(x.encode() for x in ([stop] if isinstance(stop, str) else stop))
    for name in ("temperature", "top_p", "min_p", "seed"):
        if obj.get(name) is not None:
            setattr(s, name, obj[name])
    if obj.get("guided") is not None:
        guided = guided_from(obj["guided"])
        s.guided.kind, s.guided.spec = guided.kind, guided.spec.encode()
    req = pb.GenerateRequest(request_id=str(obj.get("id", "")), sampling=s, priority=int(obj.get("priority", 0)),
                             deadline_ms=int(obj.get("deadline_ms", 0)), adapter=obj.get("adapter") or "",
                             criticality=str(obj.get("criticality") or ""), slo_ttft_ms=int(obj.get("slo_ttft_ms", 0)),
                             slo_tpot_ms=int(obj.get("slo_tpot_ms", 0)))
    if "prompt_token_ids" in obj:
        req.token_ids.ids.extend(obj["prompt_token_ids"])
    else:
        req.text = str(obj.get("prompt", "")).encode()
    return req
