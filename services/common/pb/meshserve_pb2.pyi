from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "prefetch")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    prefetch: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., prefetch: _Optional[bool] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "path", "rank", "targets", "slot_workers", "host_workers", "residency")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    SLOT_WORKERS_FIELD_NUMBER: _ClassVar[int]
    HOST_WORKERS_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    targets: _containers.RepeatedScalarFieldContainer[str]
    slot_workers: _containers.RepeatedScalarFieldContainer[str]
    host_workers: _containers.RepeatedScalarFieldContainer[str]
    residency: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., targets: _Optional[_Iterable[str]] = ..., slot_workers: _Optional[_Iterable[str]] = ..., host_workers: _Optional[_Iterable[str]] = ..., residency: _Optional[str] = ...) -> None: ...

class AdapterList(_message.Message):
    __slots__ = ("adapters", "base_model")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    base_model: str
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., base_model: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "min_tokens", "min_p", "top_logprobs", "guided")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[bytes]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    min_tokens: int
    min_p: float
    top_logprobs: int
    guided: Guided
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[bytes]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., min_p: _Optional[float] = ..., top_logprobs: _Optional[int] = ..., guided: _Optional[_Union[Guided, _Mapping]] = ...) -> None: ...

class Guided(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: bytes
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[bytes] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "model", "adapter", "priority", "deadline_ms", "criticality", "slo_ttft_ms", "slo_tpot_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    CRITICALITY_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: bytes
    token_ids: TokenIds
    sampling: Sampling
    model: str
    adapter: str
    priority: int
    deadline_ms: int
    criticality: str
    slo_ttft_ms: int
    slo_tpot_ms: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[bytes] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., model: _Optional[str] = ..., adapter: _Optional[str] = ..., priority: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., criticality: _Optional[str] = ..., slo_ttft_ms: _Optional[int] = ..., slo_tpot_ms: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "prompt_tokens", "cached_prompt_tokens", "queue_wait_ms", "top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    prompt_tokens: int
    cached_prompt_tokens: int
    queue_wait_ms: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., queue_wait_ms: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "max_model_len", "vocab_size", "parent")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_model_len: int
    vocab_size: int
    parent: str
    def __init__(self, name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., parent: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "model")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    text: bytes
    model: str
    def __init__(self, text: _Optional[bytes] = ..., model: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GiveBackCreditRequest(_message.Message):
    __slots__ = ("subscriber", "request_id")
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    subscriber: str
    request_id: str
    def __init__(self, subscriber: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class GiveBackCreditReply(_message.Message):
    __slots__ = ("lost",)
    LOST_FIELD_NUMBER: _ClassVar[int]
    lost: bool
    def __init__(self, lost: _Optional[bool] = ...) -> None: ...

class CreditsRequest(_message.Message):
    __slots__ = ("subscriber",)
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    subscriber: str
    def __init__(self, subscriber: _Optional[str] = ...) -> None: ...

class CreditGrant(_message.Message):
    __slots__ = ("granted", "slots", "live")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    granted: int
    slots: int
    live: int
    def __init__(self, granted: _Optional[int] = ..., slots: _Optional[int] = ..., live: _Optional[int] = ...) -> None: ...

class WorkRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "adapter", "cache_salt", "transfer_id", "kvstore", "tenant", "weight", "deadline_unix_ms", "predicted_s", "resumed_outputs", "credit_from", "band")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_S_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FROM_FIELD_NUMBER: _ClassVar[int]
    BAND_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    priority: int
    adapter: str
    cache_salt: str
    transfer_id: str
    kvstore: str
    tenant: str
    weight: float
    deadline_unix_ms: int
    predicted_s: float
    resumed_outputs: int
    credit_from: str
    band: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., priority: _Optional[int] = ..., adapter: _Optional[str] = ..., cache_salt: _Optional[str] = ..., transfer_id: _Optional[str] = ..., kvstore: _Optional[str] = ..., tenant: _Optional[str] = ..., weight: _Optional[float] = ..., deadline_unix_ms: _Optional[int] = ..., predicted_s: _Optional[float] = ..., resumed_outputs: _Optional[int] = ..., credit_from: _Optional[str] = ..., band: _Optional[int] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "prompt_tokens", "cached_prompt_tokens", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    prompt_tokens: int
    cached_prompt_tokens: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "blocks_used", "blocks_cached", "blocks_free", "blocks_total", "running", "waiting", "outstanding_tokens", "aborted", "lora_loads", "lora_load_s", "lora_slot_loads", "lora_hits", "lora_misses", "slot_preemptions", "uncredited", "max_live", "credit_subscribers", "credits_out", "credits_lost", "busy_s", "started", "queue_wait_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    LORA_LOADS_FIELD_NUMBER: _ClassVar[int]
    LORA_LOAD_S_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOT_LOADS_FIELD_NUMBER: _ClassVar[int]
    LORA_HITS_FIELD_NUMBER: _ClassVar[int]
    LORA_MISSES_FIELD_NUMBER: _ClassVar[int]
    SLOT_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    UNCREDITED_FIELD_NUMBER: _ClassVar[int]
    MAX_LIVE_FIELD_NUMBER: _ClassVar[int]
    CREDIT_SUBSCRIBERS_FIELD_NUMBER: _ClassVar[int]
    CREDITS_OUT_FIELD_NUMBER: _ClassVar[int]
    CREDITS_LOST_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    blocks_total: int
    running: int
    waiting: int
    outstanding_tokens: int
    aborted: int
    lora_loads: int
    lora_load_s: float
    lora_slot_loads: int
    lora_hits: int
    lora_misses: int
    slot_preemptions: int
    uncredited: int
    max_live: int
    credit_subscribers: int
    credits_out: int
    credits_lost: int
    busy_s: float
    started: int
    queue_wait_s: float
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., blocks_used: _Optional[int] = ..., blocks_cached: _Optional[int] = ..., blocks_free: _Optional[int] = ..., blocks_total: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., outstanding_tokens: _Optional[int] = ..., aborted: _Optional[int] = ..., lora_loads: _Optional[int] = ..., lora_load_s: _Optional[float] = ..., lora_slot_loads: _Optional[int] = ..., lora_hits: _Optional[int] = ..., lora_misses: _Optional[int] = ..., slot_preemptions: _Optional[int] = ..., uncredited: _Optional[int] = ..., max_live: _Optional[int] = ..., credit_subscribers: _Optional[int] = ..., credits_out: _Optional[int] = ..., credits_lost: _Optional[int] = ..., busy_s: _Optional[float] = ..., started: _Optional[int] = ..., queue_wait_s: _Optional[float] = ...) -> None: ...

class WorkerId(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "address", "role", "outstanding_tokens", "kv_capacity_tokens", "kv_used_tokens", "running", "waiting", "adapters", "block_size", "index_member", "decode_tokens_per_s", "max_num_seqs", "prefill_s_per_token", "decode_s_per_step", "host", "kv_pool", "host_adapters", "lora_slots", "free_lora_slots", "known_adapters", "pinned_adapters", "topology", "decode_s_floor", "tensor_parallel_size", "cores", "max_num_batched_tokens", "longest_step_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    INDEX_MEMBER_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_FIELD_NUMBER: _ClassVar[int]
    HOST_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    PINNED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FLOOR_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LONGEST_STEP_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    role: str
    outstanding_tokens: int
    kv_capacity_tokens: int
    kv_used_tokens: int
    running: int
    waiting: int
    adapters: _containers.RepeatedScalarFieldContainer[str]
    block_size: int
    index_member: str
    decode_tokens_per_s: float
    max_num_seqs: int
    prefill_s_per_token: float
    decode_s_per_step: float
    host: str
    kv_pool: bool
    host_adapters: _containers.RepeatedScalarFieldContainer[str]
    lora_slots: int
    free_lora_slots: int
    known_adapters: _containers.RepeatedScalarFieldContainer[str]
    pinned_adapters: _containers.RepeatedScalarFieldContainer[str]
    topology: str
    decode_s_floor: float
    tensor_parallel_size: int
    cores: int
    max_num_batched_tokens: int
    longest_step_s: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[str] = ..., outstanding_tokens: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., kv_used_tokens: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., adapters: _Optional[_Iterable[str]] = ..., block_size: _Optional[int] = ..., index_member: _Optional[str] = ..., decode_tokens_per_s: _Optional[float] = ..., max_num_seqs: _Optional[int] = ..., prefill_s_per_token: _Optional[float] = ..., decode_s_per_step: _Optional[float] = ..., host: _Optional[str] = ..., kv_pool: _Optional[bool] = ..., host_adapters: _Optional[_Iterable[str]] = ..., lora_slots: _Optional[int] = ..., free_lora_slots: _Optional[int] = ..., known_adapters: _Optional[_Iterable[str]] = ..., pinned_adapters: _Optional[_Iterable[str]] = ..., topology: _Optional[str] = ..., decode_s_floor: _Optional[float] = ..., tensor_parallel_size: _Optional[int] = ..., cores: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., longest_step_s: _Optional[float] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "max_tokens", "mode", "prompt_token_ids", "adapter", "cache_salt", "prompt_u32", "avoid", "block_hashes", "hash_block_size")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_U32_FIELD_NUMBER: _ClassVar[int]
    AVOID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    max_tokens: int
    mode: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter: str
    cache_salt: str
    prompt_u32: bytes
    avoid: _containers.RepeatedScalarFieldContainer[str]
    block_hashes: bytes
    hash_block_size: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., mode: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., adapter: _Optional[str] = ..., cache_salt: _Optional[str] = ..., prompt_u32: _Optional[bytes] = ..., avoid: _Optional[_Iterable[str]] = ..., block_hashes: _Optional[bytes] = ..., hash_block_size: _Optional[int] = ...) -> None: ...

class RouteDecision(_message.Message):
    __slots__ = ("prefill_worker", "decode_worker", "mode", "reason", "decision_ms", "cached_prefix_tokens")
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DECISION_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prefill_worker: str
    decode_worker: str
    mode: str
    reason: str
    decision_ms: float
    cached_prefix_tokens: int
    def __init__(self, prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., mode: _Optional[str] = ..., reason: _Optional[str] = ..., decision_ms: _Optional[float] = ..., cached_prefix_tokens: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "prefix_index_degraded")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_INDEX_DEGRADED_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerLoad]
    prefix_index_degraded: bool
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerLoad, _Mapping]]] = ..., prefix_index_degraded: _Optional[bool] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("host", "block_bytes", "transport")
    HOST_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    host: str
    block_bytes: int
    transport: str
    def __init__(self, host: _Optional[str] = ..., block_bytes: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("transport", "segment", "generation", "slot_bytes", "slots", "reason")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transport: str
    segment: str
    generation: str
    slot_bytes: int
    slots: int
    reason: str
    def __init__(self, transport: _Optional[str] = ..., segment: _Optional[str] = ..., generation: _Optional[str] = ..., slot_bytes: _Optional[int] = ..., slots: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("transfer_id", "hashes", "num_blocks", "block_bytes")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_blocks: int
    block_bytes: int
    def __init__(self, transfer_id: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("slots", "present", "generation")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    generation: str
    def __init__(self, slots: _Optional[_Iterable[int]] = ..., present: _Optional[_Iterable[bool]] = ..., generation: _Optional[str] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("transfer_id", "hashes", "start", "block_bytes")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    start: int
    block_bytes: int
    def __init__(self, transfer_id: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., start: _Optional[int] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class AcquireReply(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    def __init__(self, blocks: _Optional[int] = ...) -> None: ...

class KVMeta(_message.Message):
    __slots__ = ("token_ids", "num_prompt", "num_computed", "block_size", "dtype", "num_blocks", "sample_seed")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SEED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt: int
    num_computed: int
    block_size: int
    dtype: str
    num_blocks: int
    sample_seed: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., num_prompt: _Optional[int] = ..., num_computed: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., num_blocks: _Optional[int] = ..., sample_seed: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("transfer_id", "index", "data", "meta", "last", "first_block", "checksums", "slots")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    index: int
    data: bytes
    meta: KVMeta
    last: bool
    first_block: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transfer_id: _Optional[str] = ..., index: _Optional[int] = ..., data: _Optional[bytes] = ..., meta: _Optional[_Union[KVMeta, _Mapping]] = ..., last: _Optional[bool] = ..., first_block: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ..., slots: _Optional[_Iterable[int]] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("blocks", "bytes")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("transfer_id", "wait_ms", "shm", "generation")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    wait_ms: int
    shm: bool
    generation: str
    def __init__(self, transfer_id: _Optional[str] = ..., wait_ms: _Optional[int] = ..., shm: _Optional[bool] = ..., generation: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("transfer_id", "abandoned")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    abandoned: bool
    def __init__(self, transfer_id: _Optional[str] = ..., abandoned: _Optional[bool] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class KVStoreStats(_message.Message):
    __slots__ = ("transfers", "bytes", "byte_budget", "evicted", "expired", "pool_blocks", "pinned_blocks", "hits", "segment", "block_bytes")
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    POOL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    transfers: int
    bytes: int
    byte_budget: int
    evicted: int
    expired: int
    pool_blocks: int
    pinned_blocks: int
    hits: int
    segment: str
    block_bytes: int
    def __init__(self, transfers: _Optional[int] = ..., bytes: _Optional[int] = ..., byte_budget: _Optional[int] = ..., evicted: _Optional[int] = ..., expired: _Optional[int] = ..., pool_blocks: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., hits: _Optional[int] = ..., segment: _Optional[str] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("pool", "replicas", "reason")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    pool: str
    replicas: int
    reason: str
    def __init__(self, pool: _Optional[str] = ..., replicas: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class PoolState(_message.Message):
    __slots__ = ("pool", "ready", "starting", "draining", "startup_s", "workers")
    POOL_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    STARTUP_S_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    ready: int
    starting: int
    draining: int
    startup_s: float
    workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pool: _Optional[str] = ..., ready: _Optional[int] = ..., starting: _Optional[int] = ..., draining: _Optional[int] = ..., startup_s: _Optional[float] = ..., workers: _Optional[_Iterable[str]] = ...) -> None: ...

class PoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolsReply(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolState]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolState, _Mapping]]] = ...) -> None: ...
