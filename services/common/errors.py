"""Typed errors shared by every layer, each naming the status it maps to at the edge.

The mapping to gRPC statuses and HTTP codes happens once, at the servicers and the HTTP
front (see docs/INTERFACES.md); everything below raises these. Shortage inside the engine
(no free KV block this step) is not an error: allocation returns None and the scheduler decides.
"""


class MeshError(Exception):
    """Base of every error meshserve reports to a caller."""

    code = "INTERNAL"  # the gRPC status name this error maps to
    peer = ""  # the address of the service that reported it, when it came from another
    retry_after_ms: int | None = None  # when trying again is sensible (None: no advice); gRPC trailing metadata
    # retry-after-ms, HTTP Retry-After (429 and 503)
    stalled = False  # a stream the gateway cut because its worker made no progress (services.policy.progress)


class InvalidRequest(MeshError):
    """A malformed or out-of-range field: empty prompt, token id outside the vocabulary, bad sampling value."""

    code = "INVALID_ARGUMENT"


class OutOfRange(MeshError):
    """Prompt plus max_tokens beyond the model's context or the whole KV pool."""

    code = "OUT_OF_RANGE"


class NotFound(MeshError):
    """Unknown model, adapter or request id."""

    code = "NOT_FOUND"


class CapacityExhausted(MeshError):
    """Over a limit or queue full; retry_after_ms says when trying again is sensible."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_ms: int = 1000):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class Unauthenticated(MeshError):
    """Missing or wrong API key."""

    code = "UNAUTHENTICATED"


class PermissionDenied(MeshError):
    """An adapter, priority or model the tenant may not use."""

    code = "PERMISSION_DENIED"


class ModelLoadError(MeshError):
    """A model folder is missing a file or uses something the engine does not support."""

    code = "FAILED_PRECONDITION"


def error_dict(err: MeshError) -> dict:
    """The JSONL/HTTP shape of an error: {"code": ..., "message": ...}."""
    return {"code": err.code, "message": str(err)}


class DeadlineExceeded(MeshError):
    """The request's deadline passed, or cannot be met."""

    code = "DEADLINE_EXCEEDED"


class Unavailable(MeshError):
    """No worker able to serve, or a dependency down with no fallback."""

    code = "UNAVAILABLE"

    def __init__(self, message: str, retry_after_ms: int | None = None):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class RankDied(Unavailable):
    """A rank of a tensor-parallel group is gone (or out of step): the replica cannot go on and goes down whole."""


class NoWorker(Unavailable):
    """No live worker can take the request right now (none registered for its role, or none passing the routing
    filters): a state that passes, unlike a failed worker. The gateway holds the request and routes it again
    (bounded by its deadline and admission.no_worker_grace_s); across gRPC it travels as UNAVAILABLE with the
    trailing metadata REASON_KEY: NO_WORKER."""

    REASON_KEY, NO_WORKER, ROLE_KEY = "meshserve-reason", "no-worker", "meshserve-empty-role"

    def __init__(self, message: str, empty_role: str = "", retry_after_ms: int | None = None):
        super().__init__(message, retry_after_ms)
        self.empty_role = empty_role  # a role with no worker registered at all ("" = some pass no filter): what
        # the gateway reports as waiting for a worker of that pool (scale from zero)


HTTP_STATUS = {"INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "NOT_FOUND": 404, "UNAUTHENTICATED": 401,
               "PERMISSION_DENIED": 403, "RESOURCE_EXHAUSTED": 429, "DEADLINE_EXCEEDED": 504, "UNAVAILABLE": 503,
               "CANCELLED": 499, "FAILED_PRECONDITION": 500, "INTERNAL": 500}


MAX_MESSAGE_BYTES = 2048  # an error message crossing a gRPC hop travels in metadata (gRPC's limit is 8 KiB in all)


def bounded_message(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """message cut to `limit` UTF-8 bytes with a note of its length: a parser's message about a long input can be
    longer than gRPC's metadata limit, and an overflowing status arrives as RESOURCE_EXHAUSTED (a 429) instead."""
    raw = message.encode()
    if len(raw) <= limit:
        return message
    note = f" [message cut: {len(message):,} characters in all]"
    return raw[:limit - len(note.encode())].decode(errors="ignore") + note


def http_status(err: MeshError) -> int:
    """The HTTP status of an error (by its gRPC code, so errors forwarded from downstream map too)."""
    return HTTP_STATUS.get(err.code, 500)
