"""Tenants: who may call the mesh, with what share, under which limits. Pure: the clock is injected.

From the mesh config file's `tenants` list (validated at start by services/config/sections.py TenantSection; errors name
the tenant and key):

    tenants:
      - name: acme
        api_key_hashes: ["sha256$<salt hex>$<digest hex>"]   # `meshserve tenant key` makes one
        weight: 2                    # share of the mesh under contention (default 1)
        limits: {requests_per_s: 10, tokens_per_min: 200000, max_concurrent: 16,
                 max_prompt_tokens: 4096, max_output_tokens: 1024, max_queued: 64}
        priorities: [0, 1]           # allowed priority classes (default: any; a negative one, sheddable, always)
        criticalities: [standard, sheddable]   # allowed bands (default: any; sheddable always)
        adapters: [sql-lora]         # allowed LoRA adapters (default: any)
        cache_domain: shared-docs    # prefix-cache isolation domain (default: the tenant's own)
        admin: true                  # may load and unload LoRA adapters (default: false)

Keys are kept only as salted SHA-256 digests and compared in constant time (hmac.compare_digest,
every stored digest checked whatever matches). With no tenants configured there is one open
tenant, "default", that needs no key (and may load adapters: an open mesh has no admin to tell apart). Request and token
rates are token buckets; tokens are counted at admission as prompt + max_tokens.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from dataclasses import dataclass, field

from services.common.errors import CapacityExhausted, PermissionDenied, Unauthenticated
from services.policy.bands import SHEDDABLE, STANDARD, band_name

DEFAULT_TENANT = "default"


def hash_key(key: str, salt: bytes | None = None) -> str:
    """The stored form of an API key: sha256$<salt hex>$<sha256(salt + key) hex>."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    return f"sha256${salt.hex()}${hashlib.sha256(salt + key.encode()).hexdigest()}"


def new_key() -> tuple[str, str]:
    """A fresh API key and its stored hash."""
    key = "ms-" + secrets.token_urlsafe(24)
    return key, hash_key(key)


@dataclass(frozen=True)
class Limits:
    requests_per_s: float | None = None
    tokens_per_min: float | None = None  # prompt + output
    prompt_tokens_per_min: float | None = None
    output_tokens_per_min: float | None = None
    max_concurrent: int | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    max_queued: int | None = None


@dataclass(frozen=True)
class Tenant:
    name: str
    key_hashes: tuple = ()  # (salt, digest) pairs
    weight: float = 1.0
    limits: Limits = Limits()
    priorities: frozenset | None = None  # None = any
    adapters: frozenset | None = None  # None = any
    cache_salt: str = ""  # the prefix-cache isolation salt: "tenant:<name>" (its own) or "domain:<shared name>"
    admin: bool = False  # may load and unload LoRA adapters
    criticalities: frozenset | None = None  # band numbers (services.policy.bands); None = any

    def check_admin(self) -> None:
        if not self.admin:
            raise PermissionDenied(f"tenant {self.name!r} may not load or unload adapters (needs admin: true)")

    def check_request(self, prompt_tokens: int, max_tokens: int, priority: int, adapter: str,
                      band: int = STANDARD) -> None:
        """Permission and size limits of one request (rates are TenantState's). Asking for less (a sheddable
        request, a negative priority) is always allowed."""
        if self.priorities is not None and priority >= 0 and priority not in self.priorities:
            raise PermissionDenied(f"tenant {self.name!r} may not use priority {priority} "
                                   f"(allowed: {sorted(self.priorities)})")
        if self.criticalities is not None and band != SHEDDABLE and band not in self.criticalities:
            raise PermissionDenied(f"tenant {self.name!r} may not send {band_name(band)} requests (allowed: "
                                   f"{', '.join(band_name(b) for b in sorted(self.criticalities | {SHEDDABLE}))})")
        if adapter and self.adapters is not None and adapter not in self.adapters:
            raise PermissionDenied(f"tenant {self.name!r} may not use adapter {adapter!r}")
        lim = self.limits
        if lim.max_prompt_tokens is not None and prompt_tokens > lim.max_prompt_tokens:
            raise CapacityExhausted(f"prompt of {prompt_tokens} tokens is over tenant {self.name!r}'s limit of "
                                    f"{lim.max_prompt_tokens} (retrying will not help)", retry_after_ms=0)
        if lim.max_output_tokens is not None and max_tokens > lim.max_output_tokens:
            raise CapacityExhausted(f"max_tokens {max_tokens} is over tenant {self.name!r}'s limit of "
                                    f"{lim.max_output_tokens} (retrying will not help)", retry_after_ms=0)


OPEN_TENANT = Tenant(DEFAULT_TENANT, admin=True)  # no tenants configured: one open tenant, one shared cache


def wire_salt(secret: bytes, cache_salt: str) -> str:
    """The salt that travels with a request and keys its prefix-cache blocks: an HMAC of the tenant's isolation
    domain under the gateway's secret, so that knowing a tenant's name (its domain is "tenant:<name>") is not enough
    to read its cached prefixes from a worker. The open default tenant ("") stays unsalted."""
    if not cache_salt:
        return ""
    return hmac.new(secret, cache_salt.encode(), hashlib.sha256).hexdigest()[:32]


def cache_secret(value: str | None) -> tuple[bytes, bool]:
    """The cache-salt secret as configured (`MESHSERVE_CACHE_SECRET`; `meshserve up` makes one per run), or a fresh
    random one (then False: salts, hence the tenants' prefix caches, do not outlive this process nor match another
    gateway's)."""
    return (value.encode(), True) if value else (secrets.token_bytes(32), False)


class Authenticator:
    def __init__(self, tenants: list[Tenant]):
        self.tenants = tenants
        self.open = not tenants

    def authenticate(self, key: str | None) -> Tenant:
        if self.open:
            return OPEN_TENANT
        if not key:
            raise Unauthenticated("an API key is required (metadata x-api-key, or authorization: Bearer KEY)")
        presented, found = key.encode(), None
        for tenant in self.tenants:
            for salt, digest in tenant.key_hashes:
                if hmac.compare_digest(hashlib.sha256(salt + presented).digest(), digest) and found is None:
                    found = tenant
        if found is None:
            raise Unauthenticated("the API key is not valid")
        return found


class TokenBucket:
    """rate per second, burst capacity; take() says how long until `amount` would fit when it does not."""

    def __init__(self, rate: float, capacity: float, now: float):
        self.rate, self.capacity, self.level, self.t = rate, capacity, capacity, now

    def take(self, amount: float, now: float) -> float:
        """0.0 and taken, or the seconds to wait (nothing taken)."""
        self.level = min(self.capacity, self.level + max(now - self.t, 0.0) * self.rate)
        self.t = max(self.t, now)
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.level) / self.rate

    def give(self, amount: float) -> None:
        """Put back what take() took (a reservation not used), never above the capacity."""
        self.level = min(self.capacity, self.level + amount)


@dataclass
class TenantState:
    """A tenant's live counters at the gateway: rates, concurrency, queue length."""

    tenant: Tenant
    now: float
    running: int = 0
    queued: int = 0
    buckets: dict = field(default_factory=dict)

    def __post_init__(self):
        lim = self.tenant.limits
        if lim.requests_per_s is not None:
            self.buckets["requests"] = TokenBucket(lim.requests_per_s, max(1.0, lim.requests_per_s), self.now)
        for kind, per_min in (("tokens", lim.tokens_per_min), ("prompt tokens", lim.prompt_tokens_per_min),
                              ("output tokens", lim.output_tokens_per_min)):
            if per_min is not None:
                self.buckets[kind] = TokenBucket(per_min / 60, per_min, self.now)

    def admit_rates(self, prompt_tokens: int, max_tokens: int, now: float) -> None:
        """Charge the rate limits for one request, or raise RESOURCE_EXHAUSTED with when to retry (and charge
        nothing). Output tokens are charged as max_tokens, reserved: settle() gives back what was not made."""
        name, lim = self.tenant.name, self.tenant.limits
        charges = {"requests": 1, "tokens": prompt_tokens + max_tokens, "prompt tokens": prompt_tokens,
                   "output tokens": max_tokens}
        limits = {"requests": f"{lim.requests_per_s:g} requests/s" if lim.requests_per_s else "",
                  "tokens": f"{lim.tokens_per_min:g} tokens/min" if lim.tokens_per_min else "",
                  "prompt tokens": f"{lim.prompt_tokens_per_min:g} prompt tokens/min"
                  if lim.prompt_tokens_per_min else "",
                  "output tokens": f"{lim.output_tokens_per_min:g} output tokens/min"
                  if lim.output_tokens_per_min else ""}
        taken = []
        for kind, bucket in self.buckets.items():
            wait = bucket.take(charges[kind], now)
            if not wait:
                taken.append(kind)
                continue
            for k in taken:  # not admitted: give back what the other limits took
                self.buckets[k].give(charges[k])
            if math.isinf(wait):
                raise CapacityExhausted(f"request of {charges[kind]} {kind} exceeds tenant {name!r}'s "
                                        f"{limits[kind]} (retrying will not help)", retry_after_ms=0)
            raise CapacityExhausted(f"tenant {name!r} is over its {limits[kind]}", retry_after_ms=_ms(wait))

    def settle(self, prompt_tokens: int, max_tokens: int, output_tokens: int | None) -> None:
        """A request admitted by admit_rates() ended with output_tokens made: the unmade part of its max_tokens goes
        back to the output and total budgets. None: it was never served (pushed out of the queue, or expired
        there): everything it was charged goes back, the request too."""
        unmade = max_tokens - (output_tokens or 0)
        back = {"tokens": unmade, "output tokens": unmade}
        if output_tokens is None:
            back.update({"requests": 1, "tokens": prompt_tokens + max_tokens, "prompt tokens": prompt_tokens})
        for kind, bucket in self.buckets.items():
            if back.get(kind, 0) > 0:
                bucket.give(back[kind])


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))
